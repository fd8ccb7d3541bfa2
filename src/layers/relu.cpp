#include "tessera/layers/relu.hpp"

#include <utility>

#include "tessera/kernels/reference.hpp"

namespace tessera {

template <typename T>
DistTensor<T> Relu<T>::forward(const DistTensor<T>& x) {
  y_ = DistTensor<T>(x.dist);
  reference::relu_forward<T>(x.local.span(), y_.local.span());
  return y_;
}

template <typename T>
DistTensor<T> Relu<T>::backward(const DistTensor<T>& dy) {
  DistTensor<T> dx(dy.dist);
  reference::relu_backward<T>(std::as_const(y_.local).span(), dy.local.span(), dx.local.span());
  return dx;
}

template class Relu<float>;
template class Relu<double>;

}  // namespace tessera
