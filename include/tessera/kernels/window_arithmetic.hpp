// The per-output arithmetic of the layers whose outputs read windows or channels: pooling,
// nearest upsampling and batch normalisation. Written once for the CPU reference loops
// (kernels/cpu/reference_pool.cpp, reference_upsample.cpp, reference_batchnorm.cpp) and the CUDA
// kernels (kernels/cuda/layers.cu), as kernels/elementwise.hpp does for the pointwise kernels, so
// the CPU tests exercise what the GPU runs. The CPU scatters gradients (each output adds into the
// inputs it read, outputs in row-major order); the GPU gathers them (each input sums the outputs
// that read it, in the same order): `covering` gives those outputs, so both add the same terms in
// the same order and agree bit for bit. Plain C++ that nvcc also compiles. Local; pure.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "tessera/kernels/elementwise.hpp"

namespace tessera::elementwise {

// floor(a / b) for b > 0, a of any sign.
TESSERA_HD inline std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  const std::int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

// A half-open run of indices.
struct Span1 {
  std::int64_t begin = 0, end = 0;
};

// Output o of a pooling axis reads inputs o * stride - pad + [0, kernel), of which only
// [image_begin, image_end) are image positions: the ones it pools.
TESSERA_HD inline Span1 pool_window(std::int64_t o, std::int64_t stride, std::int64_t pad,
                                    std::int64_t kernel, std::int64_t image_begin,
                                    std::int64_t image_end) {
  const std::int64_t b = o * stride - pad, e = b + kernel;
  return {b > image_begin ? b : image_begin, e < image_end ? e : image_end};
}

// The outputs o in [0, count) whose window o * stride - pad + [0, kernel) holds input i.
TESSERA_HD inline Span1 covering(std::int64_t i, std::int64_t stride, std::int64_t pad,
                                 std::int64_t kernel, std::int64_t count) {
  // o * stride <= i + pad  and  o * stride > i + pad - kernel.
  const std::int64_t last = floor_div(i + pad, stride) + 1;
  const std::int64_t first = floor_div(i + pad - kernel, stride) + 1;
  return {first > 0 ? first : 0, last < count ? last : count};
}

// PyTorch's max scan over rows x columns of a plane with rows `row` long: from -infinity at the
// first position, a strictly greater value or a NaN takes over, so the first maximum wins a tie
// and the last NaN wins over everything. `at` receives the winner's h * row + w. The window must
// hold a position.
template <typename T>
TESSERA_HD inline T window_max(const T* plane, std::int64_t row, Span1 rows, Span1 cols,
                               std::int64_t& at) {
  T best = -std::numeric_limits<T>::infinity();
  at = rows.begin * row + cols.begin;
  for (std::int64_t h = rows.begin; h < rows.end; ++h)
    for (std::int64_t w = cols.begin; w < cols.end; ++w) {
      const T v = plane[h * row + w];
      if (v > best || v != v) {
        best = v;
        at = h * row + w;
      }
    }
  return best;
}

// The window's sum in row-major order divided by `area` (a division, as PyTorch: not a multiply
// by the reciprocal).
template <typename T>
TESSERA_HD inline T window_mean(const T* plane, std::int64_t row, Span1 rows, Span1 cols, T area) {
  T sum = T(0);
  for (std::int64_t h = rows.begin; h < rows.end; ++h)
    for (std::int64_t w = cols.begin; w < cols.end; ++w)
      sum += plane[h * row + w];
  return sum / area;
}

// The input index nearest upsampling reads for output q: floor((q + phase) / scale).
TESSERA_HD inline std::int64_t upsample_source(std::int64_t q, std::int64_t scale,
                                               std::int64_t phase) {
  return (q + phase) / scale;
}
// The outputs in [0, count) that read input i: those of upsample_source(q) == i.
TESSERA_HD inline Span1 upsample_readers(std::int64_t i, std::int64_t scale, std::int64_t phase,
                                         std::int64_t count) {
  const std::int64_t b = i * scale - phase, e = b + scale;
  return {b > 0 ? b : 0, e < count ? e : count};
}

// Batch normalisation of one value, in double: (x - mean) * scale + shift with scale =
// invstd * weight and shift = bias.
template <typename T>
TESSERA_HD inline T batchnorm_apply(T x, double mean, double scale, double shift) {
  return static_cast<T>((double(x) - mean) * scale + shift);
}
// Its input gradient: scale * (dy - mean_dy - xhat * mean_dy_xhat), xhat = (x - mean) * invstd,
// scale = weight * invstd.
template <typename T>
TESSERA_HD inline T batchnorm_grad(T dy, T x, double mean, double invstd, double scale,
                                   double mean_dy, double mean_dy_xhat) {
  return static_cast<T>(scale *
                        (double(dy) - mean_dy - (double(x) - mean) * invstd * mean_dy_xhat));
}

// Batch norm's statistics of one channel from its sums over the whole batch of `count` values
// (BatchNorm2d, src/layers/batchnorm.cpp): s1 = the sum of x - shift, s2 = the sum of
// (x - shift)^2, `shift` the running mean. var = s2 / count - (s1 / count)^2 then keeps all but
// about (mean - shift)^2 / var of double's precision: `conditioned` says whether that is at most
// kBatchNormShiftedLimit (else the caller sums (x - mean)^2 in a second pass; NaN is not
// conditioned). The same arithmetic on the host and, where a GPU keeps the statistics on the
// device, in kernels/cuda/layers.cu.
inline constexpr double kBatchNormShiftedLimit = 1e3;
struct BatchNormMoments {
  double mean = 0, var = 0;
  bool conditioned = true;
};
TESSERA_HD inline BatchNormMoments batchnorm_moments(double s1, double s2, double shift,
                                                     double count) {
  const double d = s1 / count;
  const double var = s2 / count - d * d;
  return {shift + d, var, d * d <= kBatchNormShiftedLimit * var};
}
// 1 / sqrt(var + eps): what the batch is normalised with (var biased).
TESSERA_HD inline double batchnorm_invstd(double var, double eps) {
  using std::sqrt;
  return 1 / sqrt(var + eps);
}
// running = (1 - momentum) * running + momentum * the batch's statistic, the variance unbiased.
template <typename T>
TESSERA_HD inline void batchnorm_update_running(T& running_mean, T& running_var, double mean,
                                                double var, double momentum, double count) {
  running_mean = static_cast<T>((1 - momentum) * double(running_mean) + momentum * mean);
  running_var =
      static_cast<T>((1 - momentum) * double(running_var) + momentum * var * count / (count - 1));
}

}  // namespace tessera::elementwise
