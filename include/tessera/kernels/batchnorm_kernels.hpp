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

// As reference::batchnorm_backward_sums; dy in x's layout.
template <typename T>
void batchnorm_backward_sums(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const BatchNormStats& stats, std::span<double> sum_dy,
                             std::span<double> sum_dy_xhat);

// As reference::batchnorm_backward_data; dy and dx in x's layout.
template <typename T>
void batchnorm_backward_data(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const BatchNormStats& stats, std::span<const T> weight,
                             std::span<const double> mean_dy, std::span<const double> mean_dy_xhat,
                             Tensor<T>& dx);

}  // namespace tessera::fast
