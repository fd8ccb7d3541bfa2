// A batch-normalisation kernel as a Backend hands it out: the local halves of the layer's
// passes. The layer reduces the sums over the grid between them (BatchNorm2d), so the statistics
// are those of the whole global batch whatever the backend; a backend only computes on its
// rank's tile (a GPU backend: on the device). Every method is local.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "tessera/error.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference_batchnorm.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

// What a batch norm's forward_activated applied: f, after normalising with this weight and bias.
template <typename T>
struct ForwardActivation {
  std::span<const T> weight, bias;
  FusedActivation f;
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
};

// Tessera's CPU batch norm: the threaded loops of batchnorm_kernels.hpp (the reference's
// arithmetic, both layouts). Every backend's choice on the CPU. Local.
template <typename T>
std::unique_ptr<BatchNormKernel<T>> make_cpu_batch_norm();

}  // namespace tessera
