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
std::optional<FusedActivation> Activation<T>::fusable_activation(const Backend& backend) const {
  if (spec_.kind == ActivationKind::sigmoid ||
      !backend.activation<T>(spec_.kind, spec_.slope)->works_from_output())
    return std::nullopt;
  return FusedActivation{.kind = spec_.kind, .slope = spec_.slope};
}

template <typename T>
DistTensor<T> Activation<T>::forward(const DistTensor<T>& x, const RunState& state) {
  TESSERA_CHECK(kernel_ != nullptr, "layer '" + this->name() + "': forward before bind");
  if (by_producer_) {  // a caller that did not move x through gets a copy
    keep_forward(x, state);
    return x;
  }
  DistTensor<T> y(x.dist, x.layout(), uninitialized, this->allocator());
  if (by_consumer_)
    kernel_->forward_unkept(x.local, y.local);
  else
    kernel_->forward(x.local, y.local);
  return y;
}

template <typename T>
void Activation<T>::keep_forward(const DistTensor<T>& x, const RunState&) {
  // x is f's output already; backward needs it unless the consumer applies f' (evaluation keeps
  // it too: gradcheck --mode eval runs backward).
  if (!by_consumer_) kernel_->keep_output(x.local);
}

template <typename T>
DistTensor<T> Activation<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  if (by_consumer_) return dy;  // a caller that did not move dy through gets a copy
  DistTensor<T> dx(dy.dist, dy.layout(), uninitialized, this->allocator());
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
  TESSERA_CHECK(kernel_ != nullptr, "layer '" + this->name() + "': forward before bind");
  const std::uint64_t stream =
      hash_string(this->name()) ^ splitmix64(static_cast<std::uint64_t>(state.step));
  if (!(mask_.value.shape() == x.local.shape()))
    mask_.value = Tensor<T>(x.local.shape(), Layout::nchw, uninitialized, this->allocator());
  DistTensor<T> y(x.dist, Layout::nchw, uninitialized, this->allocator());
  const TileOrigin origin{x.dist.global, x.dist.samples().begin, x.dist.rows().begin,
                          x.dist.cols().begin};
  kernel_->forward(x.local, origin, state.seed, stream, mask_.value, y.local);
  return y;
}

template <typename T>
DistTensor<T> Dropout<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  if (mask_.value.numel() == 0) return dy;
  DistTensor<T> dx(dy.dist, Layout::nchw, uninitialized, this->allocator());
  kernel_->backward(dy.local, mask_.value, dx.local);
  return dx;
}

template class Activation<float>;
template class Activation<double>;
template class Dropout<float>;
template class Dropout<double>;

}  // namespace tessera
