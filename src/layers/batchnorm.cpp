#include "tessera/layers/batchnorm.hpp"

#include <algorithm>
#include <utility>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/layers/window.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
BatchNormSpec parse_batchnorm(const LayerSpec& spec) {
  Fields f(spec);
  BatchNormSpec s;
  if (const nlohmann::json* eps = f.raw("eps"); eps != nullptr) {
    if (!eps->is_number() || !(eps->get<double>() > 0))
      f.fail("field 'eps' must be a number > 0, got " + eps->dump());
    s.eps = eps->get<double>();
  }
  s.momentum = f.number("momentum", 0.1, 0, 1);
  f.finish();
  return s;
}

template <typename T>
Distribution BatchNorm2d<T>::setup(const Distribution& in) {
  const std::string who = "layer '" + this->name() + "' (batchnorm2d)";
  require_spatial(who, in);
  const Shape4& s = in.global;
  count_ = s.n * s.h * s.w;
  shape_ = s;
  const Shape4 c{s.c, 1, 1, 1};
  weight_ = this->make_param("weight", c, T(1));
  bias_ = this->make_param("bias", c);
  running_mean_ = this->make_buffer("running_mean", c);
  running_var_ = this->make_buffer("running_var", c, T(1));
  return in;
}

template <typename T>
void BatchNorm2d<T>::check_trainable() const {
  // Known from the global shape: every rank refuses it alike, before any collective work.
  TESSERA_CHECK(count_ > 1, "layer '" + this->name() +
                                "' (batchnorm2d): expected more than 1 value per channel when "
                                "training, but its input " +
                                shape_.str() +
                                " has N * H * W = 1 (a batch variance needs two values)");
}

template <typename T>
DistTensor<T> BatchNorm2d<T>::forward(const DistTensor<T>& x, const RunState& state) {
  TESSERA_CHECK(kernel_ != nullptr,
                "layer '" + this->name() + "' (batchnorm2d): forward before bind");
  if (state.mode == Mode::train) check_trainable();
  const std::size_t channels = static_cast<std::size_t>(x.dist.global.c);
  mode_ = state.mode;
  layout_ = x.layout();
  // Kept for backward: taken over after this forward where the model hands the input over
  // (take_input), else a threaded copy into a buffer reused from forward to forward unless a
  // backward released it.
  if (this->input_handed_over()) {
    x_ = Tensor<T>();
  } else {
    if (x_.shape() != x.local.shape() || x_.layout() != layout_)
      x_ = Tensor<T>(x.local.shape(), layout_, uninitialized, this->allocator());
    if (x_.storage().host_accessible())
      parallel_copy(x.local.data(), x.local.numel(), x_.data());
    else
      x_ = x.local;  // the device's copy
  }
  const MemorySpace space = this->allocator().space();
  const std::span<const T> weight = std::as_const(weight_.value).span_in(space);
  const std::span<const T> bias = std::as_const(bias_.value).span_in(space);
  DistTensor<T> y(x.dist, layout_, uninitialized, this->allocator());
  // The whole batch on this rank and a kernel that keeps the statistics where it computes: no
  // reduction, and the host does not wait for the sums (BatchNormKernel::trains_alone).
  alone_ = mode_ == Mode::train && !activation_ && may_train_alone_ && comm_ != nullptr &&
           comm_->size(Group::world) == 1;
  if (alone_) {
    kernel_->train_forward_alone(
        x.local, layout_, training(), std::as_const(running_mean_.value).span(),
        std::as_const(running_var_.value).span(), !running_in_kernel_, weight, bias, y.local);
    running_in_kernel_ = true;
    return y;
  }
  store_running();
  mean_.assign(channels, 0.0);
  invstd_.assign(channels, 0.0);
  T* running_mean = running_mean_.value.data();
  T* running_var = running_var_.value.data();
  if (mode_ == Mode::train) {
    TESSERA_CHECK(comm_ != nullptr,
                  "layer '" + this->name() + "' (batchnorm2d): forward before bind");
    const std::string what = "batch-norm statistics of layer '" + this->name() + "'";
    // One pass over x around the running mean (the same on every rank), reduced in one message;
    // a second pass where that lost precision (batch_statistics: the first steps of an input far
    // from zero, a non-finite value). Every rank decides the same: from the reduced sums.
    batch_statistics(*kernel_, x.local, layout_, training(), running_mean_.value.span(),
                     running_var_.value.span(), std::span<double>(mean_),
                     std::span<double>(invstd_),
                     [&](std::span<double> v) { allreduce_sum(*comm_, v, Group::world, what); });
  } else {
    for (std::size_t c = 0; c < channels; ++c) {
      mean_[c] = double(running_mean[c]);
      invstd_[c] = elementwise::batchnorm_invstd(double(running_var[c]), spec_.eps);
    }
  }
  if (activation_)
    kernel_->forward_activated(x.local, layout_, {mean_, invstd_}, weight, bias, *activation_,
                               y.local);
  else
    kernel_->forward(x.local, layout_, {mean_, invstd_}, weight, bias, y.local);
  return y;
}

template <typename T>
void BatchNorm2d<T>::take_input(DistTensor<T>&& x) {
  if (this->input_handed_over()) x_ = std::move(x.local);
}

template <typename T>
DistTensor<T> BatchNorm2d<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  TESSERA_CHECK(x_.shape() == dy.local.shape() && x_.layout() == dy.layout(),
                "layer '" + this->name() + "' (batchnorm2d): backward without its forward's input");
  if (alone_) {
    DistTensor<T> dx(dy.dist, layout_, uninitialized, this->allocator());
    kernel_->train_backward_alone(x_, dy.local, layout_,
                                  std::as_const(weight_.value).span_in(this->allocator().space()),
                                  bias_.grad, weight_.grad, dx.local);
    x_ = Tensor<T>();
    return dx;
  }
  const std::size_t channels = mean_.size();
  const reference::BatchNormStats stats{mean_, invstd_};
  // [sum of dy | sum of dy * xhat] over this rank's tile, then over the grid: one message.
  std::vector<double> sums(2 * channels);
  const std::span<double> sum_dy(sums.data(), channels),
      sum_dy_xhat(sums.data() + channels, channels);
  // With the activation's f' (take_output_activation_grad): the parameters are the forward's,
  // since the optimizer updates them after the backward pass.
  const MemorySpace space = this->allocator().space();
  const std::span<const T> weight = std::as_const(weight_.value).span_in(space);
  const ForwardActivation<T> applied{.weight = weight,
                                     .bias = std::as_const(bias_.value).span_in(space),
                                     .f = activation_.value_or(FusedActivation{})};
  if (activation_grad_)
    kernel_->backward_sums_activated(x_, dy.local, layout_, stats, applied, sum_dy, sum_dy_xhat);
  else
    kernel_->backward_sums(x_, dy.local, layout_, stats, sum_dy, sum_dy_xhat);
  // The parameter gradients take this rank's share; Model::reduce_gradients adds the others.
  // (C values each: on a device through host copies.)
  HostValues<T> bias_grad(bias_.grad), weight_grad(weight_.grad);
  for (std::size_t c = 0; c < channels; ++c) {
    bias_grad.span()[c] += static_cast<T>(sum_dy[c]);
    weight_grad.span()[c] += static_cast<T>(sum_dy_xhat[c]);
  }
  bias_grad.store();
  weight_grad.store();
  // From here on `sums` holds what the input gradient subtracts: the batch means of dy and of
  // dy * xhat in training, nothing in evaluation.
  if (mode_ == Mode::train) {
    allreduce_sum(*comm_, std::span<double>(sums), Group::world,
                  "batch-norm gradient sums of layer '" + this->name() + "'");
    for (double& v : sums)
      v /= static_cast<double>(count_);
  } else {
    std::fill(sums.begin(), sums.end(), 0.0);  // the running statistics do not depend on x
  }
  DistTensor<T> dx(dy.dist, layout_, uninitialized, this->allocator());
  if (activation_grad_)
    kernel_->backward_data_activated(x_, dy.local, layout_, stats, applied,
                                     std::span<const double>(sum_dy),
                                     std::span<const double>(sum_dy_xhat), dx.local);
  else
    kernel_->backward_data(x_, dy.local, layout_, stats, weight, std::span<const double>(sum_dy),
                           std::span<const double>(sum_dy_xhat), dx.local);
  x_ = Tensor<T>();  // one backward per forward: the copy goes back as the pass proceeds
  return dx;
}

template <typename T>
void BatchNorm2d<T>::store_running() {
  if (!running_in_kernel_) return;
  kernel_->store_running(running_mean_.value.span(), running_var_.value.span());
  running_in_kernel_ = false;
}

template class BatchNorm2d<float>;
template class BatchNorm2d<double>;

}  // namespace tessera
