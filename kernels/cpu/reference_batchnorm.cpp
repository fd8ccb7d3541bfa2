#include "tessera/kernels/reference_batchnorm.hpp"

#include <algorithm>
#include <string>

#include "batchnorm_checks.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/window_arithmetic.hpp"

namespace tessera::reference {
namespace {

using batchnorm_checks::channels;
using batchnorm_checks::same;
using batchnorm_checks::statistics;

// Calls body(c, offset of x[n, c, 0, 0], plane size) for every (n, c).
template <typename Body>
void for_each_plane(const Shape4& s, Body&& body) {
  const std::int64_t plane = s.h * s.w;
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t c = 0; c < s.c; ++c)
      body(c, (n * s.c + c) * plane, plane);
}

}  // namespace

template <typename T>
void batchnorm_sum(const Tensor<T>& x, std::span<double> sum) {
  channels("batchnorm_sum", x.shape(), sum.size(), "sum");
  std::fill(sum.begin(), sum.end(), 0.0);
  for_each_plane(x.shape(), [&](std::int64_t c, std::int64_t at, std::int64_t plane) {
    const T* p = x.data() + at;
    double s = 0;
    for (std::int64_t k = 0; k < plane; ++k)
      s += double(p[k]);
    sum[std::size_t(c)] += s;
  });
}

template <typename T>
void batchnorm_centered_square_sum(const Tensor<T>& x, std::span<const double> mean,
                                   std::span<double> sum) {
  channels("batchnorm_centered_square_sum", x.shape(), mean.size(), "mean");
  channels("batchnorm_centered_square_sum", x.shape(), sum.size(), "sum");
  std::fill(sum.begin(), sum.end(), 0.0);
  for_each_plane(x.shape(), [&](std::int64_t c, std::int64_t at, std::int64_t plane) {
    const T* p = x.data() + at;
    const double m = mean[std::size_t(c)];
    double s = 0;
    for (std::int64_t k = 0; k < plane; ++k) {
      const double d = double(p[k]) - m;
      s += d * d;
    }
    sum[std::size_t(c)] += s;
  });
}

template <typename T>
void batchnorm_forward(const Tensor<T>& x, const BatchNormStats& stats, std::span<const T> weight,
                       std::span<const T> bias, Tensor<T>& y) {
  const Shape4& s = x.shape();
  statistics("batchnorm_forward", s, stats);
  channels("batchnorm_forward", s, weight.size(), "weight");
  channels("batchnorm_forward", s, bias.size(), "bias");
  same("batchnorm_forward", s, y.shape(), "output");
  for_each_plane(s, [&](std::int64_t c, std::int64_t at, std::int64_t plane) {
    const std::size_t ch = std::size_t(c);
    const double m = stats.mean[ch], scale = stats.invstd[ch] * double(weight[ch]);
    const double shift = double(bias[ch]);
    const T* p = x.data() + at;
    T* q = y.data() + at;
    for (std::int64_t k = 0; k < plane; ++k)
      q[k] = elementwise::batchnorm_apply(p[k], m, scale, shift);
  });
}

template <typename T>
void batchnorm_backward_sums(const Tensor<T>& x, const Tensor<T>& dy, const BatchNormStats& stats,
                             std::span<double> sum_dy, std::span<double> sum_dy_xhat) {
  const Shape4& s = x.shape();
  statistics("batchnorm_backward_sums", s, stats);
  same("batchnorm_backward_sums", s, dy.shape(), "output gradient");
  channels("batchnorm_backward_sums", s, sum_dy.size(), "sum_dy");
  channels("batchnorm_backward_sums", s, sum_dy_xhat.size(), "sum_dy_xhat");
  std::fill(sum_dy.begin(), sum_dy.end(), 0.0);
  std::fill(sum_dy_xhat.begin(), sum_dy_xhat.end(), 0.0);
  for_each_plane(s, [&](std::int64_t c, std::int64_t at, std::int64_t plane) {
    const std::size_t ch = std::size_t(c);
    const double m = stats.mean[ch], r = stats.invstd[ch];
    const T* p = x.data() + at;
    const T* g = dy.data() + at;
    double a = 0, b = 0;
    for (std::int64_t k = 0; k < plane; ++k) {
      a += double(g[k]);
      b += double(g[k]) * (double(p[k]) - m) * r;
    }
    sum_dy[ch] += a;
    sum_dy_xhat[ch] += b;
  });
}

template <typename T>
void batchnorm_backward_data(const Tensor<T>& x, const Tensor<T>& dy, const BatchNormStats& stats,
                             std::span<const T> weight, std::span<const double> mean_dy,
                             std::span<const double> mean_dy_xhat, Tensor<T>& dx) {
  const Shape4& s = x.shape();
  batchnorm_checks::backward_data("batchnorm_backward_data", x, dy, stats, weight.size(),
                                  mean_dy.size(), mean_dy_xhat.size(), dx);
  for_each_plane(s, [&](std::int64_t c, std::int64_t at, std::int64_t plane) {
    const std::size_t ch = std::size_t(c);
    const double m = stats.mean[ch], r = stats.invstd[ch];
    const double scale = double(weight[ch]) * r, a = mean_dy[ch], b = mean_dy_xhat[ch];
    const T* p = x.data() + at;
    const T* g = dy.data() + at;
    T* q = dx.data() + at;
    for (std::int64_t k = 0; k < plane; ++k)
      q[k] = elementwise::batchnorm_grad(g[k], p[k], m, r, scale, a, b);
  });
}

#define TESSERA_INSTANTIATE(T)                                                                    \
  template void batchnorm_sum<T>(const Tensor<T>&, std::span<double>);                            \
  template void batchnorm_centered_square_sum<T>(const Tensor<T>&, std::span<const double>,       \
                                                 std::span<double>);                              \
  template void batchnorm_forward<T>(const Tensor<T>&, const BatchNormStats&, std::span<const T>, \
                                     std::span<const T>, Tensor<T>&);                             \
  template void batchnorm_backward_sums<T>(const Tensor<T>&, const Tensor<T>&,                    \
                                           const BatchNormStats&, std::span<double>,              \
                                           std::span<double>);                                    \
  template void batchnorm_backward_data<T>(                                                       \
      const Tensor<T>&, const Tensor<T>&, const BatchNormStats&, std::span<const T>,              \
      std::span<const double>, std::span<const double>, Tensor<T>&);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::reference
