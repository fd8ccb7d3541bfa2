// The batch-normalisation kernels the layer runs: the reference's arithmetic (kernels/
// reference_batchnorm.hpp: every sum and statistic in double) as vectorised loops split over the
// kernel threads, on NCHW or nchw16c tensors. oneDNN's batch normalisation computes its training
// statistics over the tensor it is given, one tile here, while Tessera's are those of the whole
// global batch (sums allreduced over ranks between the passes), so these loops do the work.
//
// Sums are taken per (sample, channel) plane, or per (sample, block of 16 channels) in nchw16c,
// and added in a fixed order: results do not depend on the thread count. They differ from the
// reference's sequential sums by double rounding (near 1e-16 relative). All local.
#pragma once

#include <optional>
#include <span>

#include "tessera/kernels/reference_batchnorm.hpp"
#include "tessera/tensor.hpp"

namespace tessera::fast {

using reference::BatchNormStats;

// As reference::batchnorm_sum, on x in `layout`.
template <typename T>
void batchnorm_sum(const Tensor<T>& x, Layout layout, std::span<double> sum);

// As reference::batchnorm_centered_square_sum.
template <typename T>
void batchnorm_centered_square_sum(const Tensor<T>& x, Layout layout, std::span<const double> mean,
                                   std::span<double> sum);

// Per-channel sums of x - shift and of (x - shift)^2, in one pass over x (in `layout`).
template <typename T>
void batchnorm_shifted_sums(const Tensor<T>& x, Layout layout, std::span<const double> shift,
                            std::span<double> sum, std::span<double> square_sum);

// As reference::batchnorm_forward; y in x's layout. With `leaky_slope`, y = leaky_relu(y, slope)
// as each value is written (slope 0: ReLU), bit for bit the activation's own arithmetic
// (elementwise::leaky_relu).
template <typename T>
void batchnorm_forward(const Tensor<T>& x, Layout layout, const BatchNormStats& stats,
                       std::span<const T> weight, std::span<const T> bias, Tensor<T>& y,
                       std::optional<T> leaky_slope = std::nullopt);

// What a forward that applied a (leaky) ReLU normalised with (its weight and bias) and the
// activation's slope (0: ReLU): given to the backward passes of such a batch norm whose activation
// has no consumer that applies its derivative, they multiply dy by f' first, read from
// f(batchnorm(x)) computed again as batchnorm_forward computed it, bit for bit, so that the
// activation keeps no mask and makes no pass of its own (elementwise::leaky_relu_grad, as the
// activation's own backward from its output).
template <typename T>
struct AppliedActivation {
  std::span<const T> weight, bias;
  T slope = T(0);
};

// The inputs x whose normalised value y = elementwise::batchnorm_apply(x, mean, scale, shift) is
// > 0 (as T: what a (leaky) ReLU's f' reads from its output), as the interval lo <= x <= hi (empty:
// lo NaN). Exact: y rounds monotonically in x for a scale > 0 (< 0: the other way), so the
// interval is found by bisection over T's ordered values with batchnorm_apply itself; a scale of
// 0 gives y = shift for every finite x (an infinite one: NaN). The backward passes then compare x
// with it instead of normalising x again. Local; pure.
template <typename T>
struct PositiveRange {
  T lo, hi;
};
template <typename T>
PositiveRange<T> batchnorm_positive_range(double mean, double scale, double shift);

// As reference::batchnorm_backward_sums; dy in x's layout. With `applied`, of dy * f'.
template <typename T>
void batchnorm_backward_sums(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const BatchNormStats& stats, std::span<double> sum_dy,
                             std::span<double> sum_dy_xhat,
                             const AppliedActivation<T>* applied = nullptr);

// As reference::batchnorm_backward_data; dy and dx in x's layout. With `applied`, of dy * f'.
template <typename T>
void batchnorm_backward_data(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const BatchNormStats& stats, std::span<const T> weight,
                             std::span<const double> mean_dy, std::span<const double> mean_dy_xhat,
                             Tensor<T>& dx, const AppliedActivation<T>* applied = nullptr);

}  // namespace tessera::fast
