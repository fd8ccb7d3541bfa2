#include "tessera/layers/pointwise.hpp"

#include <utility>

#include "tessera/error.hpp"
#include "tessera/parallel.hpp"
#include "tessera/random.hpp"

namespace tessera {

ActivationSpec parse_activation(const LayerSpec& spec) {
  Fields f(spec);
  ActivationSpec s;
  if (spec.type == "leaky_relu") {
    s.kind = ActivationKind::leaky_relu;
    s.slope = f.number("slope", 0.01, 0, 1e300);
  } else if (spec.type == "sigmoid") {
    s.kind = ActivationKind::sigmoid;
  }
  f.finish();
  return s;
}

template <typename T>
DistTensor<T> Activation<T>::forward(const DistTensor<T>& x, const RunState&) {
  TESSERA_CHECK(kernel_ != nullptr, "layer '" + this->name() + "': forward before bind");
  DistTensor<T> y(x.dist, uninitialized);
  y.layout = x.layout;
  kernel_->forward(x.local, y.local);
  return y;
}

template <typename T>
DistTensor<T> Activation<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  DistTensor<T> dx(dy.dist, uninitialized);
  dx.layout = dy.layout;
  kernel_->backward(dy.local, dx.local);
  return dx;
}

DropoutSpec parse_dropout(const LayerSpec& spec) {
  Fields f(spec);
  DropoutSpec s;
  s.p = f.number("p", 0.5, 0, 1);
  f.finish();
  return s;
}

template <typename T>
DistTensor<T> Dropout<T>::forward(const DistTensor<T>& x, const RunState& state) {
  if (state.mode == Mode::eval || spec_.p == 0) {
    mask_.value = Tensor<T>();
    return x;
  }
  const Shape4& g = x.dist.global;
  const Range ns = x.dist.samples(), hs = x.dist.rows(), ws = x.dist.cols();
  const T keep = spec_.p < 1 ? static_cast<T>(1 / (1 - spec_.p)) : T(0);
  const std::uint64_t stream =
      hash_string(this->name()) ^ splitmix64(static_cast<std::uint64_t>(state.step));
  mask_.value = Tensor<T>(x.local.shape());
  DistTensor<T> y(x.dist);
  for (std::int64_t n = ns.begin; n < ns.end; ++n)
    for (std::int64_t c = 0; c < g.c; ++c)
      for (std::int64_t h = hs.begin; h < hs.end; ++h)
        for (std::int64_t w = ws.begin; w < ws.end; ++w) {
          const auto index = static_cast<std::uint64_t>(((n * g.c + c) * g.h + h) * g.w + w);
          const T s = uniform01(state.seed, stream, index) >= spec_.p ? keep : T(0);
          const std::int64_t n0 = n - ns.begin, h0 = h - hs.begin, w0 = w - ws.begin;
          mask_.value.at(n0, c, h0, w0) = s;
          y.local.at(n0, c, h0, w0) = x.local.at(n0, c, h0, w0) * s;
        }
  return y;
}

template <typename T>
DistTensor<T> Dropout<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  if (mask_.value.numel() == 0) return dy;
  DistTensor<T> dx(dy.dist);
  for (std::int64_t k = 0; k < dx.local.numel(); ++k)
    dx.local.data()[k] = dy.local.data()[k] * mask_.value.data()[k];
  return dx;
}

template class Activation<float>;
template class Activation<double>;
template class Dropout<float>;
template class Dropout<double>;

}  // namespace tessera
