// A batch-normalisation kernel as a Backend hands it out: the local halves of the layer's
// passes. The layer reduces the sums over the grid between them (BatchNorm2d), so the statistics
// are those of the whole global batch whatever the backend; a backend only computes on its
// rank's tile (a GPU backend: on the device). Every method is local.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference_batchnorm.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

// What a batch norm's forward_activated applied: f, after normalising with this weight and bias.
template <typename T>
struct ForwardActivation {
  std::span<const T> weight, bias;
  FusedActivation f;
};

// The constants of a training batch norm (BatchNormKernel::train_forward_alone): the values per
// channel in the batch (N * H * W), eps and the running statistics' momentum.
struct BatchNormTraining {
  double count = 0, eps = 0, momentum = 0;
};

template <typename T>
class BatchNormKernel {
 public:
  virtual ~BatchNormKernel() = default;
  virtual std::string name() const = 0;
  // Per-channel sum of x (in `layout`) over this tile, into `sum` (one entry per channel).
  virtual void sum(const Tensor<T>& x, Layout layout, std::span<double> sum) const = 0;
  // Per-channel sum of (x - mean)^2 over this tile.
  virtual void centered_square_sum(const Tensor<T>& x, Layout layout, std::span<const double> mean,
                                   std::span<double> sum) const = 0;
  // Per-channel sums of x - shift and of (x - shift)^2 over this tile: the statistics in one pass
  // (BatchNorm2d). By default sum() and centered_square_sum() around `shift`, the first less
  // count * shift: two passes, for backends without a one-pass kernel.
  virtual void shifted_sums(const Tensor<T>& x, Layout layout, std::span<const double> shift,
                            std::span<double> sum, std::span<double> square_sum) const {
    this->sum(x, layout, sum);
    centered_square_sum(x, layout, shift, square_sum);
    const double count = static_cast<double>(x.shape().n * x.shape().h * x.shape().w);
    for (std::size_t c = 0; c < sum.size(); ++c)
      sum[c] -= count * shift[c];
  }
  // y = (x - mean) * invstd * weight + bias, in x's layout.
  virtual void forward(const Tensor<T>& x, Layout layout, const reference::BatchNormStats& stats,
                       std::span<const T> weight, std::span<const T> bias, Tensor<T>& y) const = 0;
  // Whether forward_activated applies `f` (the layer then computes its following activation), and
  // the *_activated backward passes its derivative.
  virtual bool applies(const FusedActivation& /*f*/) const { return false; }
  // forward, then y = f(y) as each value is written: the activation's arithmetic bit for bit.
  virtual void forward_activated(const Tensor<T>& /*x*/, Layout /*layout*/,
                                 const reference::BatchNormStats& /*stats*/,
                                 std::span<const T> /*weight*/, std::span<const T> /*bias*/,
                                 const FusedActivation& /*f*/, Tensor<T>& /*y*/) const {
    throw Error("batch norm kernel '" + name() + "' applies no activation");
  }
  // Per-channel sums of dy and of dy * xhat over this tile.
  virtual void backward_sums(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const reference::BatchNormStats& stats, std::span<double> sum_dy,
                             std::span<double> sum_dy_xhat) const = 0;
  // dx = weight * invstd * (dy - mean_dy - xhat * mean_dy_xhat), in x's layout.
  virtual void backward_data(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const reference::BatchNormStats& stats, std::span<const T> weight,
                             std::span<const double> mean_dy, std::span<const double> mean_dy_xhat,
                             Tensor<T>& dx) const = 0;
  // backward_sums and backward_data of a forward_activated output whose gradient dy has not been
  // multiplied by f' (no consumer of the activation applies it): they multiply dy by f' first, read
  // from f's output, which they compute again from x as forward_activated did (`a`: the forward's
  // weight, bias and f), bit for bit the activation's own backward from its output. Where
  // applies(f).
  virtual void backward_sums_activated(const Tensor<T>& /*x*/, const Tensor<T>& /*dy*/,
                                       Layout /*layout*/,
                                       const reference::BatchNormStats& /*stats*/,
                                       const ForwardActivation<T>& /*a*/,
                                       std::span<double> /*sum_dy*/,
                                       std::span<double> /*sum_dy_xhat*/) const {
    throw Error("batch norm kernel '" + name() + "' applies no activation's derivative");
  }
  virtual void backward_data_activated(const Tensor<T>& /*x*/, const Tensor<T>& /*dy*/,
                                       Layout /*layout*/,
                                       const reference::BatchNormStats& /*stats*/,
                                       const ForwardActivation<T>& /*a*/,
                                       std::span<const double> /*mean_dy*/,
                                       std::span<const double> /*mean_dy_xhat*/,
                                       Tensor<T>& /*dx*/) const {
    throw Error("batch norm kernel '" + name() + "' applies no activation's derivative");
  }

  // Training where one rank holds the whole batch (no other rank shares the statistics): a kernel
  // that trains_alone() computes the statistics itself, keeps them and the running statistics in
  // its own memory (a GPU's) and so never makes the host wait for its sums; BatchNorm2d then calls
  // the three methods below in place of the ones above. The same arithmetic as BatchNorm2d's
  // (elementwise::batchnorm_moments and the rest). Default: not supported.
  virtual bool trains_alone() const { return false; }
  // The training forward of the whole batch x: the statistics (one pass around the running mean, a
  // second where batchnorm_moments is not conditioned), the running statistics updated, y
  // normalised. The kernel's copy of the running statistics is taken from `running_mean` and
  // `running_var` (host memory) where `load_running`: the first call, and any after the host's
  // copy was read or written (BatchNorm2d::buffers()); the batch's statistics are kept for
  // train_backward_alone.
  virtual void train_forward_alone(const Tensor<T>& /*x*/, Layout /*layout*/,
                                   const BatchNormTraining& /*training*/,
                                   std::span<const T> /*running_mean*/,
                                   std::span<const T> /*running_var*/, bool /*load_running*/,
                                   std::span<const T> /*weight*/, std::span<const T> /*bias*/,
                                   Tensor<T>& /*y*/) const {
    throw Error("batch norm kernel '" + name() + "' does not train alone");
  }
  // The backward of the last train_forward_alone: bias_grad += the sum of dy, weight_grad += the
  // sum of dy * xhat (C values each, in the kernel's memory), dx as backward_data computes it.
  virtual void train_backward_alone(const Tensor<T>& /*x*/, const Tensor<T>& /*dy*/,
                                    Layout /*layout*/, std::span<const T> /*weight*/,
                                    Tensor<T>& /*bias_grad*/, Tensor<T>& /*weight_grad*/,
                                    Tensor<T>& /*dx*/) const {
    throw Error("batch norm kernel '" + name() + "' does not train alone");
  }
  // Copies the kernel's running statistics into host memory (finished on return).
  virtual void store_running(std::span<T> /*running_mean*/, std::span<T> /*running_var*/) const {
    throw Error("batch norm kernel '" + name() + "' does not train alone");
  }
};

// BatchNorm2d's training statistics of the batch whose tile on this rank is x, with kernel k: the
// sums of x - K and (x - K)^2 around K, the running mean, `reduce`d over the ranks that share the
// batch, then each channel's mean and biased variance (elementwise::batchnorm_moments), with a
// second pass summing (x - mean)^2 (reduced too) where any channel's one-pass moments are not
// conditioned; then invstd (elementwise::batchnorm_invstd) and the running statistics updated
// (elementwise::batchnorm_update_running). training.count: the values per channel in the whole
// batch. `reduce(std::span<double>)` sums in place over those ranks (collective there) or, with
// the batch on this rank alone, does nothing. The same on every rank that shares the batch.
template <typename T, typename Reduce>
void batch_statistics(const BatchNormKernel<T>& k, const Tensor<T>& x, Layout layout,
                      const BatchNormTraining& training, std::span<T> running_mean,
                      std::span<T> running_var, std::span<double> mean, std::span<double> invstd,
                      Reduce&& reduce) {
  const std::size_t channels = running_mean.size();
  const double count = training.count;
  std::vector<double> shift(channels), var(channels), sums(2 * channels);
  for (std::size_t c = 0; c < channels; ++c)
    shift[c] = double(running_mean[c]);
  const std::span<double> sum(sums.data(), channels), square_sum(sums.data() + channels, channels);
  k.shifted_sums(x, layout, shift, sum, square_sum);
  reduce(std::span<double>(sums));  // one message
  bool conditioned = true;
  for (std::size_t c = 0; c < channels; ++c) {
    const elementwise::BatchNormMoments m =
        elementwise::batchnorm_moments(sum[c], square_sum[c], shift[c], count);
    mean[c] = m.mean;
    var[c] = m.var;
    conditioned = conditioned && m.conditioned;
  }
  if (!conditioned) {
    k.centered_square_sum(x, layout, std::span<const double>(mean), square_sum);
    reduce(square_sum);
    for (std::size_t c = 0; c < channels; ++c)
      var[c] = square_sum[c] / count;
  }
  for (std::size_t c = 0; c < channels; ++c) {
    invstd[c] = elementwise::batchnorm_invstd(var[c], training.eps);
    elementwise::batchnorm_update_running(running_mean[c], running_var[c], mean[c], var[c],
                                          training.momentum, count);
  }
}

// Tessera's CPU batch norm: the threaded loops of batchnorm_kernels.hpp (the reference's
// arithmetic, both layouts). Every backend's choice on the CPU. Local.
template <typename T>
std::unique_ptr<BatchNormKernel<T>> make_cpu_batch_norm();

}  // namespace tessera
