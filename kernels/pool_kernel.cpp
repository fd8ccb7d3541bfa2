#include "tessera/kernels/pool_kernel.hpp"

#include <span>

namespace tessera {

template <typename T>
void ReferencePool<T>::forward(const Tensor<T>& x, Tensor<T>& y) {
  if (kind_ == PoolKind::max) {
    argmax_.assign(static_cast<std::size_t>(y.numel()), 0);
    reference::maxpool2d_forward(x, y, std::span<std::int64_t>(argmax_), g_);
  } else {
    reference::avgpool2d_forward(x, y, g_);
  }
}

template <typename T>
void ReferencePool<T>::backward(const Tensor<T>& dy, Tensor<T>& dx) {
  if (kind_ == PoolKind::max)
    reference::maxpool2d_backward(dy, std::span<const std::int64_t>(argmax_), dx);
  else
    reference::avgpool2d_backward(dy, dx, g_);
}

template class ReferencePool<float>;
template class ReferencePool<double>;

}  // namespace tessera
