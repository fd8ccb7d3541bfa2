#include "tessera/layers/batchnorm.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/layers/window.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

// The largest (mean - K)^2 / var for which the one-pass statistics are kept (forward): their
// variance then holds all but about 1e-13 of its value in relative terms (double's 2^-53 times
// 1 + this).
constexpr double kShiftedLimit = 1e3;

}  // namespace

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
  // Known from the global shape, so every rank refuses it here, before any collective work.
  TESSERA_CHECK(count_ > 1,
                who + ": expected more than 1 value per channel when training, but its input " +
                    s.str() + " has N * H * W = 1 (a batch variance needs two values)");
  const Shape4 c{s.c, 1, 1, 1};
  weight_ = this->make_param("weight", c, T(1));
  bias_ = this->make_param("bias", c);
  running_mean_ = this->make_buffer("running_mean", c);
  running_var_ = this->make_buffer("running_var", c, T(1));
  return in;
}

template <typename T>
DistTensor<T> BatchNorm2d<T>::forward(const DistTensor<T>& x, const RunState& state) {
  TESSERA_CHECK(kernel_ != nullptr,
                "layer '" + this->name() + "' (batchnorm2d): forward before bind");
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
  mean_.assign(channels, 0.0);
  invstd_.assign(channels, 0.0);
  T* running_mean = running_mean_.value.data();
  T* running_var = running_var_.value.data();
  if (mode_ == Mode::train) {
    TESSERA_CHECK(comm_ != nullptr,
                  "layer '" + this->name() + "' (batchnorm2d): forward before bind");
    const double count = static_cast<double>(count_);
    const std::string what = "batch-norm statistics of layer '" + this->name() + "'";
    // One pass over x: the sums of x - K and (x - K)^2, K the running mean (the same on every
    // rank), reduced in one message. var = S2 / N - (S1 / N)^2 then keeps all but about
    // (mean - K)^2 / var of double's precision; where that exceeds kShiftedLimit on any channel
    // (the first steps of an input far from zero, a non-finite value), a second pass sums
    // (x - mean)^2, so that a mean large next to the spread costs no precision. Every rank
    // decides the same: from the reduced sums.
    std::vector<double> shift(channels), sums(2 * channels);
    for (std::size_t c = 0; c < channels; ++c)
      shift[c] = double(running_mean[c]);
    const std::span<double> sum(sums.data(), channels),
        square_sum(sums.data() + channels, channels);
    kernel_->shifted_sums(x.local, layout_, std::span<const double>(shift), sum, square_sum);
    allreduce_sum(*comm_, std::span<double>(sums), Group::world, what);
    bool conditioned = true;
    std::vector<double> var(channels);
    for (std::size_t c = 0; c < channels; ++c) {
      const double d = sum[c] / count;
      mean_[c] = shift[c] + d;
      var[c] = square_sum[c] / count - d * d;
      conditioned = conditioned && d * d <= kShiftedLimit * var[c];
    }
    if (!conditioned) {
      kernel_->centered_square_sum(x.local, layout_, std::span<const double>(mean_), square_sum);
      allreduce_sum(*comm_, square_sum, Group::world, what);
      for (std::size_t c = 0; c < channels; ++c)
        var[c] = square_sum[c] / count;
    }
    const double m = spec_.momentum;
    for (std::size_t c = 0; c < channels; ++c) {
      const double v = var[c];  // biased: what the batch is normalised with
      invstd_[c] = 1 / std::sqrt(v + spec_.eps);
      running_mean[c] = static_cast<T>((1 - m) * double(running_mean[c]) + m * mean_[c]);
      running_var[c] =
          static_cast<T>((1 - m) * double(running_var[c]) + m * v * count / (count - 1));
    }
  } else {
    for (std::size_t c = 0; c < channels; ++c) {
      mean_[c] = double(running_mean[c]);
      invstd_[c] = 1 / std::sqrt(double(running_var[c]) + spec_.eps);
    }
  }
  DistTensor<T> y(x.dist, layout_, uninitialized, this->allocator());
  const MemorySpace space = this->allocator().space();
  const std::span<const T> weight = std::as_const(weight_.value).span_in(space);
  const std::span<const T> bias = std::as_const(bias_.value).span_in(space);
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

template class BatchNorm2d<float>;
template class BatchNorm2d<double>;

}  // namespace tessera
