// Reference CPU kernels of 2-D batch normalisation: plain loops over one rank's tile, float and
// double. They compute per-channel partial sums and apply per-channel statistics; combining the
// sums of all ranks into statistics is the layer's job (the kernels know nothing about ranks).
// Every sum and statistic is in double whatever T: the tiles' partial sums are then added over
// ranks with relative rounding near 1e-16, far below float32's, so the float32 result does not
// depend on the grid. All local.
#pragma once

#include <span>

#include "tessera/tensor.hpp"

namespace tessera::reference {

// Per-channel statistics that normalise x: xhat = (x - mean[c]) * invstd[c]. Each has C entries.
struct BatchNormStats {
  std::span<const double> mean;
  std::span<const double> invstd;  // 1 / sqrt(var + eps)
};

// sum[c] = sum over n, h, w of x[n, c, h, w] (overwritten; C entries).
template <typename T>
void batchnorm_sum(const Tensor<T>& x, std::span<double> sum);

// sum[c] = sum over n, h, w of (x[n, c, h, w] - mean[c])^2 (overwritten): the second pass of the
// two-pass variance, which, unlike E[x^2] - E[x]^2, loses nothing to a large mean.
template <typename T>
void batchnorm_centered_square_sum(const Tensor<T>& x, std::span<const double> mean,
                                   std::span<double> sum);

// y = xhat * weight[c] + bias[c] (y overwritten; same shape as x).
template <typename T>
void batchnorm_forward(const Tensor<T>& x, const BatchNormStats& stats, std::span<const T> weight,
                       std::span<const T> bias, Tensor<T>& y);

// sum_dy[c] = sum of dy and sum_dy_xhat[c] = sum of dy * xhat over n, h, w (both overwritten):
// the bias and weight gradients, and what the input gradient needs in training.
template <typename T>
void batchnorm_backward_sums(const Tensor<T>& x, const Tensor<T>& dy, const BatchNormStats& stats,
                             std::span<double> sum_dy, std::span<double> sum_dy_xhat);

// dx = weight[c] * invstd[c] * (dy - mean_dy[c] - xhat * mean_dy_xhat[c]) (dx overwritten).
// In training the statistics depend on x: mean_dy and mean_dy_xhat are the means of dy and of
// dy * xhat over the whole batch (n, h, w). In evaluation the statistics are constants: pass
// zeros, and dx = weight * invstd * dy.
template <typename T>
void batchnorm_backward_data(const Tensor<T>& x, const Tensor<T>& dy, const BatchNormStats& stats,
                             std::span<const T> weight, std::span<const double> mean_dy,
                             std::span<const double> mean_dy_xhat, Tensor<T>& dx);

}  // namespace tessera::reference
