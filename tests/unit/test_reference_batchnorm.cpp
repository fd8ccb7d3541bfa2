// The batch-norm reference kernels against the definition (forward) and against central finite
// differences of the whole batch-norm function in float64, statistics included (backward); the
// threaded kernels the layer runs against the reference, in NCHW, nchw16c and nchw8c.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/batchnorm_kernels.hpp"
#include "tessera/kernels/reference_batchnorm.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/random.hpp"
#include "tessera/tensor.hpp"

namespace tessera {
namespace {

using test::rel_error;

using reference::BatchNormStats;

constexpr std::uint64_t kSeed = 20240612;

// Uniform in [lo, hi), rounded to float so that float and double runs see the same data.
template <typename T>
Tensor<T> random_tensor(Shape4 s, std::uint64_t stream, double lo = -1, double hi = 1) {
  return test::random_tensor<T>(s, kSeed, stream, lo, hi);
}

template <typename T>
std::vector<T> random_vector(std::int64_t n, std::uint64_t stream, double lo, double hi) {
  return test::random_vector<T>(n, kSeed, stream, lo, hi);
}

// The training statistics of x composed from the kernels on one tile: the whole batch.
struct Stats {
  std::vector<double> mean, var, invstd;
  BatchNormStats view() const { return {mean, invstd}; }
};

template <typename T>
Stats batch_stats(const Tensor<T>& x, double eps) {
  const Shape4& s = x.shape();
  const auto channels = static_cast<std::size_t>(s.c);
  const double count = double(s.n * s.h * s.w);
  Stats st{std::vector<double>(channels), std::vector<double>(channels),
           std::vector<double>(channels)};
  reference::batchnorm_sum(x, std::span<double>(st.mean));
  for (double& m : st.mean)
    m /= count;
  reference::batchnorm_centered_square_sum(x, std::span<const double>(st.mean),
                                           std::span<double>(st.var));
  for (std::size_t c = 0; c < channels; ++c) {
    st.var[c] /= count;
    st.invstd[c] = 1 / std::sqrt(st.var[c] + eps);
  }
  return st;
}

// Training-mode batch norm of x through the kernels.
template <typename T>
Tensor<T> train_forward(const Tensor<T>& x, const std::vector<T>& weight,
                        const std::vector<T>& bias, double eps) {
  const Stats st = batch_stats(x, eps);
  Tensor<T> y(x.shape());
  reference::batchnorm_forward(x, st.view(), std::span<const T>(weight), std::span<const T>(bias),
                               y);
  return y;
}

// The gradients of sum(g * y) with respect to x, weight and bias, through the kernels.
template <typename T>
struct Grads {
  Tensor<T> dx;
  std::vector<double> dweight, dbias;
};

template <typename T>
Grads<T> train_backward(const Tensor<T>& x, const Tensor<T>& g, const std::vector<T>& weight,
                        double eps) {
  const Stats st = batch_stats(x, eps);
  const auto channels = static_cast<std::size_t>(x.shape().c);
  const double count = double(x.shape().n * x.shape().h * x.shape().w);
  Grads<T> r{Tensor<T>(x.shape()), std::vector<double>(channels), std::vector<double>(channels)};
  reference::batchnorm_backward_sums(x, g, st.view(), std::span<double>(r.dbias),
                                     std::span<double>(r.dweight));
  std::vector<double> mean_dy(channels), mean_dy_xhat(channels);
  for (std::size_t c = 0; c < channels; ++c) {
    mean_dy[c] = r.dbias[c] / count;
    mean_dy_xhat[c] = r.dweight[c] / count;
  }
  reference::batchnorm_backward_data(x, g, st.view(), std::span<const T>(weight),
                                     std::span<const double>(mean_dy),
                                     std::span<const double>(mean_dy_xhat), r.dx);
  return r;
}

double dot(const Tensor<double>& a, const Tensor<double>& b) {
  return test::dot(a.span(), b.span());
}

// Central difference of f at `value` (perturbed in place and restored).
double central_difference(double& value, const std::function<double()>& f) {
  const double h = 1e-5, saved = value;
  value = saved + h;
  const double up = f();
  value = saved - h;
  const double down = f();
  value = saved;
  return (up - down) / (2 * h);
}

const Shape4 kShapes[] = {{2, 3, 4, 5}, {1, 2, 3, 1}, {3, 1, 1, 2}, {1, 4, 1, 2}};

template <typename T>
void check_train_forward_against_definition(double tolerance) {
  for (const Shape4& s : kShapes) {
    const Tensor<T> x = random_tensor<T>(s, 1, -2, 3);
    const auto weight = random_vector<T>(s.c, 2, 0.5, 2), bias = random_vector<T>(s.c, 3, -1, 1);
    const double eps = 1e-3;
    const Tensor<T> y = train_forward(x, weight, bias, eps);
    std::vector<double> want(static_cast<std::size_t>(x.numel()));
    for (std::int64_t c = 0; c < s.c; ++c) {
      // The definition: the biased variance over n, h, w, in long double.
      long double sum = 0, square = 0;
      const long double count = s.n * s.h * s.w;
      for (std::int64_t n = 0; n < s.n; ++n)
        for (std::int64_t h = 0; h < s.h; ++h)
          for (std::int64_t w = 0; w < s.w; ++w)
            sum += x.at(n, c, h, w);
      const long double mean = sum / count;
      for (std::int64_t n = 0; n < s.n; ++n)
        for (std::int64_t h = 0; h < s.h; ++h)
          for (std::int64_t w = 0; w < s.w; ++w)
            square += (x.at(n, c, h, w) - mean) * (x.at(n, c, h, w) - mean);
      const long double var = square / count;
      for (std::int64_t n = 0; n < s.n; ++n)
        for (std::int64_t h = 0; h < s.h; ++h)
          for (std::int64_t w = 0; w < s.w; ++w)
            want[static_cast<std::size_t>(x.offset(n, c, h, w))] =
                double((x.at(n, c, h, w) - mean) / std::sqrt(var + eps) * weight[std::size_t(c)] +
                       bias[std::size_t(c)]);
    }
    EXPECT_LE(rel_error(y.span(), std::span<const double>(want)), tolerance) << s.str();
  }
}

TEST(ReferenceBatchNorm, TrainForwardMatchesDefinitionFloat64) {
  check_train_forward_against_definition<double>(1e-14);
}

TEST(ReferenceBatchNorm, TrainForwardMatchesDefinitionFloat32) {
  check_train_forward_against_definition<float>(1e-6);
}

TEST(ReferenceBatchNorm, TwoPassVarianceIgnoresALargeMean) {
  // 1e6 + k/16 is exact in float32 (its spacing there is 1/16), so the variance is that of
  // k/16 exactly; E[x^2] - E[x]^2 would lose it to cancellation even in double (x^2 ~ 1e12).
  const Shape4 s{3, 2, 17, 15};
  Tensor<float> x(s);
  Tensor<double> centred(s);
  for (std::int64_t k = 0; k < x.numel(); ++k) {
    const double step = std::floor(33 * uniform01(kSeed, 7, std::uint64_t(k))) - 16;
    x.data()[k] = static_cast<float>(1e6 + step / 16);
    centred.data()[k] = step / 16;
  }
  const Stats big = batch_stats(x, 1e-5), small = batch_stats(centred, 1e-5);
  for (std::size_t c = 0; c < 2; ++c) {
    EXPECT_NEAR(big.mean[c], 1e6 + small.mean[c], 1e-9);
    EXPECT_NEAR(big.var[c], small.var[c], 1e-12 * small.var[c]);
  }
}

TEST(ReferenceBatchNorm, TrainBackwardMatchesFiniteDifferences) {
  for (const Shape4& s : kShapes) {
    if (s.n * s.h * s.w < 2) continue;
    Tensor<double> x = random_tensor<double>(s, 4, -2, 3);
    const Tensor<double> g = random_tensor<double>(s, 5);
    auto weight = random_vector<double>(s.c, 6, 0.5, 2),
         bias = random_vector<double>(s.c, 7, -1, 1);
    const double eps = 1e-2;
    const Grads<double> got = train_backward(x, g, weight, eps);
    auto loss = [&] { return dot(train_forward(x, weight, bias, eps), g); };
    std::vector<double> dx(static_cast<std::size_t>(x.numel())), dw(weight.size()), db(bias.size());
    for (std::int64_t k = 0; k < x.numel(); ++k)
      dx[std::size_t(k)] = central_difference(x.data()[k], loss);
    for (std::size_t c = 0; c < weight.size(); ++c) {
      dw[c] = central_difference(weight[c], loss);
      db[c] = central_difference(bias[c], loss);
    }
    EXPECT_LE(rel_error(std::as_const(got.dx).span(), std::span<const double>(dx)), 1e-7)
        << s.str();
    EXPECT_LE(rel_error(std::span<const double>(got.dweight), std::span<const double>(dw)), 1e-7)
        << s.str();
    EXPECT_LE(rel_error(std::span<const double>(got.dbias), std::span<const double>(db)), 1e-7)
        << s.str();
    // The statistics remove the mean and the xhat-direction of dy: dx is orthogonal to both.
    for (std::int64_t c = 0; c < s.c; ++c) {
      double along_one = 0;
      for (std::int64_t n = 0; n < s.n; ++n)
        for (std::int64_t h = 0; h < s.h; ++h)
          for (std::int64_t w = 0; w < s.w; ++w)
            along_one += got.dx.at(n, c, h, w);
      EXPECT_NEAR(along_one, 0, 1e-12) << s.str();
    }
  }
}

TEST(ReferenceBatchNorm, TrainBackwardFloat32MatchesFloat64) {
  const Shape4 s{3, 4, 7, 5};
  const auto x64 = random_tensor<double>(s, 8, -1, 2), g64 = random_tensor<double>(s, 9);
  const auto x32 = random_tensor<float>(s, 8, -1, 2), g32 = random_tensor<float>(s, 9);
  const auto w64 = random_vector<double>(s.c, 10, 0.5, 2);
  const auto w32 = random_vector<float>(s.c, 10, 0.5, 2);
  const Grads<double> want = train_backward(x64, g64, w64, 1e-5);
  const Grads<float> got = train_backward(x32, g32, w32, 1e-5);
  EXPECT_LE(rel_error(std::as_const(got.dx).span(), std::as_const(want.dx).span()), 1e-5);
  EXPECT_LE(rel_error(std::span<const double>(got.dweight), std::span<const double>(want.dweight)),
            1e-5);
  EXPECT_LE(rel_error(std::span<const double>(got.dbias), std::span<const double>(want.dbias)),
            1e-5);
}

TEST(ReferenceBatchNorm, EvalUsesTheGivenStatisticsAndTheirConstantGradient) {
  const Shape4 s{2, 3, 4, 3};
  Tensor<double> x = random_tensor<double>(s, 11, -2, 3);
  const Tensor<double> g = random_tensor<double>(s, 12);
  auto weight = random_vector<double>(s.c, 13, 0.5, 2),
       bias = random_vector<double>(s.c, 14, -1, 1);
  const auto running_mean = random_vector<double>(s.c, 15, -1, 1);
  const auto running_var = random_vector<double>(s.c, 16, 0.2, 3);
  const double eps = 1e-3;
  std::vector<double> invstd(weight.size());
  for (std::size_t c = 0; c < invstd.size(); ++c)
    invstd[c] = 1 / std::sqrt(running_var[c] + eps);
  const BatchNormStats stats{running_mean, invstd};
  auto forward = [&] {
    Tensor<double> y(s);
    reference::batchnorm_forward(x, stats, std::span<const double>(weight),
                                 std::span<const double>(bias), y);
    return y;
  };
  const Tensor<double> y = forward();
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t c = 0; c < s.c; ++c)
      for (std::int64_t h = 0; h < s.h; ++h)
        for (std::int64_t w = 0; w < s.w; ++w) {
          const auto k = std::size_t(c);
          const double want =
              (x.at(n, c, h, w) - running_mean[k]) / std::sqrt(running_var[k] + eps) * weight[k] +
              bias[k];
          EXPECT_NEAR(y.at(n, c, h, w), want, 1e-14 * (1 + std::abs(want)));
        }

  std::vector<double> dweight(weight.size()), dbias(weight.size()), zeros(weight.size(), 0.0);
  reference::batchnorm_backward_sums(x, g, stats, std::span<double>(dbias),
                                     std::span<double>(dweight));
  Tensor<double> dx(s);
  reference::batchnorm_backward_data(x, g, stats, std::span<const double>(weight),
                                     std::span<const double>(zeros), std::span<const double>(zeros),
                                     dx);
  auto loss = [&] { return dot(forward(), g); };
  std::vector<double> fdx(static_cast<std::size_t>(x.numel())), fdw(weight.size()),
      fdb(weight.size());
  for (std::int64_t k = 0; k < x.numel(); ++k)
    fdx[std::size_t(k)] = central_difference(x.data()[k], loss);
  for (std::size_t c = 0; c < weight.size(); ++c) {
    fdw[c] = central_difference(weight[c], loss);
    fdb[c] = central_difference(bias[c], loss);
  }
  EXPECT_LE(rel_error(std::as_const(dx).span(), std::span<const double>(fdx)), 1e-8);
  EXPECT_LE(rel_error(std::span<const double>(dweight), std::span<const double>(fdw)), 1e-8);
  EXPECT_LE(rel_error(std::span<const double>(dbias), std::span<const double>(fdb)), 1e-8);
}

TEST(ReferenceBatchNorm, MismatchedSizesAreErrors) {
  const Tensor<double> x(Shape4{1, 3, 2, 2});
  std::vector<double> two(2);
  EXPECT_THROW(reference::batchnorm_sum(x, std::span<double>(two)), Error);
  std::vector<double> three(3, 1.0);
  Tensor<double> y(Shape4{1, 3, 2, 1});
  EXPECT_THROW(reference::batchnorm_forward(x, {three, three}, std::span<const double>(three),
                                            std::span<const double>(three), y),
               Error);
}

// Relative difference of two per-channel sums, against the larger of the sum and 1: sums of
// signed terms cancel to near zero, so 1e-11 allows for the rounding of ~10^5 terms of order 1
// added in another order, while one wrong term (order 0.1 or more) fails.
double sum_error(std::span<const double> a, std::span<const double> b) {
  double worst = 0;
  for (std::size_t c = 0; c < a.size(); ++c)
    worst = std::max(worst, std::abs(a[c] - b[c]) / std::max(1.0, std::abs(b[c])));
  return worst;
}

// The threaded kernels give the reference's sums (to double rounding: another order) and its
// pointwise results, in both layouts, on shapes whose planes are not a multiple of 16 (NCHW's
// tails) and large enough that the threads split them; a mean far from zero included.
template <typename T>
void expect_fast_kernels_match_reference(const Shape4& s, Layout layout, double offset) {
  const std::string what = s.str() + " " + to_string(layout);
  const Tensor<T> x = random_tensor<T>(s, 1, offset - 1, offset + 1);
  const Tensor<T> dy = random_tensor<T>(s, 2);
  const std::vector<T> weight = random_vector<T>(s.c, 3, 0.5, 1.5);
  const std::vector<T> bias = random_vector<T>(s.c, 4, -1, 1);
  const Tensor<T> xb = to_layout(x, layout), dyb = to_layout(dy, layout);
  const std::size_t c = std::size_t(s.c);

  std::vector<double> sum(c), want(c);
  fast::batchnorm_sum(xb, layout, std::span<double>(sum));
  reference::batchnorm_sum(x, std::span<double>(want));
  EXPECT_LE(sum_error(sum, want), 1e-11) << "sum " << what;
  std::vector<double> mean(c), invstd(c);
  for (std::size_t k = 0; k < c; ++k)
    mean[k] = want[k] / double(s.n * s.h * s.w);
  fast::batchnorm_centered_square_sum(xb, layout, std::span<const double>(mean),
                                      std::span<double>(sum));
  reference::batchnorm_centered_square_sum(x, std::span<const double>(mean),
                                           std::span<double>(want));
  EXPECT_LE(sum_error(sum, want), 1e-11) << "square sum " << what;
  // In one pass around a shift: the sums of x - shift and of its squares. (The first cancels
  // to near 0 where the shift is the mean: held to 1e-12 of the sum of |x - shift|, which one
  // term wrong or missing exceeds; the sum it is held to is taken in long double.)
  {
    std::vector<double> shift(c), shifted(c), shifted_square(c), size(c), want_square(c);
    std::vector<long double> want_shifted(c);
    for (std::size_t k = 0; k < c; ++k)
      shift[k] = mean[k] + 0.25 * double(k) - 0.5;
    fast::batchnorm_shifted_sums(xb, layout, std::span<const double>(shift),
                                 std::span<double>(shifted), std::span<double>(shifted_square));
    for (std::int64_t n = 0; n < s.n; ++n)
      for (std::size_t k = 0; k < c; ++k)
        for (std::int64_t h = 0; h < s.h; ++h)
          for (std::int64_t w = 0; w < s.w; ++w) {
            const double d = double(x.at(n, std::int64_t(k), h, w)) - shift[k];
            want_shifted[k] += static_cast<long double>(d);
            size[k] += std::abs(d);
          }
    for (std::size_t k = 0; k < c; ++k)
      EXPECT_LE(std::abs(shifted[k] - static_cast<double>(want_shifted[k])), 1e-12 * size[k])
          << "shifted sum of channel " << k << ", " << what;
    reference::batchnorm_centered_square_sum(x, std::span<const double>(shift),
                                             std::span<double>(want_square));
    EXPECT_LE(sum_error(shifted_square, want_square), 1e-11) << "shifted square " << what;
  }
  for (std::size_t k = 0; k < c; ++k)
    invstd[k] = 1 / std::sqrt(want[k] / double(s.n * s.h * s.w) + 1e-5);
  const BatchNormStats stats{mean, invstd};

  Tensor<T> y(s, layout), y_want(s);
  fast::batchnorm_forward(xb, layout, stats, std::span<const T>(weight), std::span<const T>(bias),
                          y);
  reference::batchnorm_forward(x, stats, std::span<const T>(weight), std::span<const T>(bias),
                               y_want);
  // The same arithmetic on each element: bit for bit.
  const Tensor<T> y_plain = to_layout(y, Layout::nchw);
  EXPECT_TRUE(std::equal(y_plain.span().begin(), y_plain.span().end(), y_want.span().begin()))
      << "forward " << what;

  std::vector<double> sum_dy(c), sum_dy_xhat(c), want_dy(c), want_dy_xhat(c);
  fast::batchnorm_backward_sums(xb, dyb, layout, stats, std::span<double>(sum_dy),
                                std::span<double>(sum_dy_xhat));
  reference::batchnorm_backward_sums(x, dy, stats, std::span<double>(want_dy),
                                     std::span<double>(want_dy_xhat));
  EXPECT_LE(sum_error(sum_dy, want_dy), 1e-11) << "sum of dy " << what;
  EXPECT_LE(sum_error(sum_dy_xhat, want_dy_xhat), 1e-11) << "sum of dy * xhat " << what;

  for (std::size_t k = 0; k < c; ++k) {
    want_dy[k] /= double(s.n * s.h * s.w);
    want_dy_xhat[k] /= double(s.n * s.h * s.w);
  }
  Tensor<T> dx(s, layout), dx_want(s);
  fast::batchnorm_backward_data(xb, dyb, layout, stats, std::span<const T>(weight),
                                std::span<const double>(want_dy),
                                std::span<const double>(want_dy_xhat), dx);
  reference::batchnorm_backward_data(x, dy, stats, std::span<const T>(weight),
                                     std::span<const double>(want_dy),
                                     std::span<const double>(want_dy_xhat), dx_want);
  const Tensor<T> dx_plain = to_layout(dx, Layout::nchw);
  EXPECT_TRUE(std::equal(dx_plain.span().begin(), dx_plain.span().end(), dx_want.span().begin()))
      << "backward data " << what;
}

TEST(BatchNormKernels, MatchTheReferenceInEveryLayout) {
  for (double offset : {0.0, 1000.0}) {
    for (const Shape4& s : {Shape4{2, 3, 5, 7}, Shape4{3, 5, 97, 89}, Shape4{1, 2, 1, 1}}) {
      expect_fast_kernels_match_reference<double>(s, Layout::nchw, offset);
      expect_fast_kernels_match_reference<float>(s, Layout::nchw, offset);
    }
    for (const Shape4& s :
         {Shape4{2, 16, 5, 7}, Shape4{3, 32, 67, 61}, Shape4{2, 8, 5, 7}, Shape4{1, 24, 33, 31}}) {
      for (Layout layout : {Layout::nchw, Layout::nchw16c, Layout::nchw8c}) {
        if (s.c % block_of(layout) != 0) continue;
        expect_fast_kernels_match_reference<double>(s, layout, offset);
        expect_fast_kernels_match_reference<float>(s, layout, offset);
      }
    }
  }
}

// Everything the fast kernels give for one input, for comparing runs bit for bit.
template <typename T>
struct FastResults {
  std::vector<double> sum, square_sum, shifted, shifted_square, sum_dy, sum_dy_xhat;
  std::vector<T> y, dx;
  bool operator==(const FastResults&) const = default;
};

template <typename T>
FastResults<T> run_fast_kernels(const Tensor<T>& x, const Tensor<T>& dy, Layout layout) {
  const Shape4& s = x.shape();
  const std::size_t c = std::size_t(s.c);
  const std::vector<T> weight = random_vector<T>(s.c, 3, 0.5, 1.5);
  const std::vector<T> bias = random_vector<T>(s.c, 4, -1, 1);
  FastResults<T> r{std::vector<double>(c),
                   std::vector<double>(c),
                   std::vector<double>(c),
                   std::vector<double>(c),
                   std::vector<double>(c),
                   std::vector<double>(c),
                   {},
                   {}};
  fast::batchnorm_sum(x, layout, std::span<double>(r.sum));
  std::vector<double> mean(c), invstd(c), a(c), b(c);
  for (std::size_t k = 0; k < c; ++k)
    mean[k] = r.sum[k] / double(s.n * s.h * s.w);
  fast::batchnorm_centered_square_sum(x, layout, std::span<const double>(mean),
                                      std::span<double>(r.square_sum));
  fast::batchnorm_shifted_sums(x, layout, std::span<const double>(mean),
                               std::span<double>(r.shifted), std::span<double>(r.shifted_square));
  for (std::size_t k = 0; k < c; ++k)
    invstd[k] = 1 / std::sqrt(r.square_sum[k] / double(s.n * s.h * s.w) + 1e-5);
  const BatchNormStats stats{mean, invstd};
  Tensor<T> y(s, layout), dx(s, layout);
  fast::batchnorm_forward(x, layout, stats, std::span<const T>(weight), std::span<const T>(bias), y,
                          std::optional<T>(T(0.1)));
  fast::batchnorm_backward_sums(x, dy, layout, stats, std::span<double>(r.sum_dy),
                                std::span<double>(r.sum_dy_xhat));
  for (std::size_t k = 0; k < c; ++k) {
    a[k] = r.sum_dy[k] / double(s.n * s.h * s.w);
    b[k] = r.sum_dy_xhat[k] / double(s.n * s.h * s.w);
  }
  fast::batchnorm_backward_data(x, dy, layout, stats, std::span<const T>(weight),
                                std::span<const double>(a), std::span<const double>(b), dx);
  r.y.assign(y.span().begin(), y.span().end());
  r.dx.assign(dx.span().begin(), dx.span().end());
  return r;
}

// Units of many pieces (the threads split one sample's channels), tails past the last 16 lanes,
// outputs written with streaming stores and without: the baseline and AVX-512 loops on 1 and 2
// threads give the same results bit for bit, and the reference's (forward with its sums: to 1e-11).
template <typename T>
void expect_same_at_every_simd_level(const Shape4& s, Layout layout) {
  const Tensor<T> x = to_layout(random_tensor<T>(s, 5, 2, 4), layout);
  const Tensor<T> dy = to_layout(random_tensor<T>(s, 6), layout);
  const SimdLevel before = simd_level();
  set_simd_level(SimdLevel::baseline);
  const FastResults<T> want = [&] {
    const KernelThreads threads = kernel_threads();
    set_kernel_threads({1, "test"});
    FastResults<T> r = run_fast_kernels(x, dy, layout);
    set_kernel_threads(threads);
    return r;
  }();
  for (SimdLevel level : {SimdLevel::baseline, SimdLevel::avx512}) {
    if (!simd_available(level)) continue;
    set_simd_level(level);
    for (int n : {1, 2}) {
      // Streaming stores for every output, and for none.
      for (std::int64_t stream : {std::int64_t{0}, std::numeric_limits<std::int64_t>::max()}) {
        const KernelThreads threads = kernel_threads();
        const std::int64_t stream_before = streaming_store_bytes();
        set_kernel_threads({n, "test"});
        set_streaming_store_bytes(stream);
        const FastResults<T> got = run_fast_kernels(x, dy, layout);
        set_kernel_threads(threads);
        set_streaming_store_bytes(stream_before);
        EXPECT_TRUE(got == want) << s.str() << " " << to_string(layout) << ", " << to_string(level)
                                 << ", " << n << " threads, streaming from " << stream << " bytes";
      }
    }
  }
  set_simd_level(before);
  const Tensor<T> plain = to_layout(x, Layout::nchw);
  std::vector<double> sum(std::size_t(s.c));
  reference::batchnorm_sum(plain, std::span<double>(sum));
  EXPECT_LE(sum_error(want.sum, sum), 1e-11) << s.str() << " " << to_string(layout);
}

TEST(BatchNormKernels, GiveTheSameResultsAtEverySimdLevelAndThreadCount) {
  expect_same_at_every_simd_level<float>({1, 8, 517, 515}, Layout::nchw8c);
  expect_same_at_every_simd_level<float>({1, 16, 600, 520}, Layout::nchw16c);  // 19 MiB
  expect_same_at_every_simd_level<double>({2, 3, 1031, 1029}, Layout::nchw);   // 48 MiB
  expect_same_at_every_simd_level<double>({1, 16, 67, 61}, Layout::nchw16c);
  // The large shapes against the reference too, at the level this machine runs.
  expect_fast_kernels_match_reference<float>({1, 16, 600, 520}, Layout::nchw16c, 1000.0);
  expect_fast_kernels_match_reference<double>({2, 3, 1031, 1029}, Layout::nchw, 0.0);
}

// fast::batchnorm_positive_range against the normalisation itself: at random inputs, at the
// interval's ends and their neighbours, at zeros, infinities, NaN and the smallest subnormals; for
// scales of either sign, tiny and huge, zero, infinite and NaN, and infinite or NaN means and
// shifts (a NaN-poisoned step).
template <typename T>
void expect_positive_range_exact() {
  constexpr T inf = std::numeric_limits<T>::infinity();
  const double dinf = std::numeric_limits<double>::infinity(),
               dnan = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::array<double, 3>> cases = {
      {0.1, 1.5, -0.1},    {-0.3, -2.0, 0.05}, {0.0, 1.0, 0.0},    {0.0, -1.0, 0.0},
      {0.2, 1e-30, 1e-38}, {0.2, 1e30, -3.0},  {1e3, 1e-3, 1e-45}, {0.5, 0.0, 0.25},
      {0.5, 0.0, -0.25},   {0.5, 0.0, 0.0},    {0.0, dinf, 0.0},   {0.0, -dinf, 1.0},
      {0.0, dnan, 1.0},    {dnan, 1.0, 1.0},   {dinf, 1.0, 0.0},   {-dinf, 1.0, 0.0},
      {0.0, 1.0, dinf},    {0.0, 1.0, -dinf},  {0.0, 1.0, dnan},   {3.0, -1e-40, 1e-300}};
  std::uint64_t index = 0;
  const auto uniform = [&](double lo, double hi) {
    return lo + (hi - lo) * uniform01(kSeed, 77, index++);
  };
  for (int k = 0; k < 40; ++k)
    cases.push_back({uniform(-2, 2), uniform(-3, 3), uniform(-1, 1)});
  for (const auto& [mean, scale, shift] : cases) {
    const fast::PositiveRange<T> r = fast::batchnorm_positive_range<T>(mean, scale, shift);
    std::vector<T> xs = {T(0),
                         -T(0),
                         inf,
                         -inf,
                         std::numeric_limits<T>::quiet_NaN(),
                         std::numeric_limits<T>::denorm_min(),
                         -std::numeric_limits<T>::denorm_min(),
                         std::numeric_limits<T>::max(),
                         -std::numeric_limits<T>::max(),
                         static_cast<T>(mean)};
    for (T e : {r.lo, r.hi})
      if (!std::isnan(e))
        for (T x : {e, std::nextafter(e, inf), std::nextafter(e, -inf)})
          xs.push_back(x);
    for (int i = 0; i < 2000; ++i)
      xs.push_back(static_cast<T>(uniform(-4, 4)));
    int wrong = 0;
    for (T x : xs) {
      const bool want = elementwise::batchnorm_apply(x, mean, scale, shift) > T(0);
      wrong += want != (x >= r.lo && x <= r.hi);
    }
    EXPECT_EQ(wrong, 0) << "mean " << mean << ", scale " << scale << ", shift " << shift << ": ["
                        << r.lo << ", " << r.hi << "]";
  }
}

TEST(BatchNormKernels, ThePositiveRangeIsExactlyWhereTheNormalisedValueIsPositive) {
  expect_positive_range_exact<float>();
  expect_positive_range_exact<double>();
}

TEST(BatchNormKernels, SimdLevelsAreNamedAndTheBaselineIsAlwaysThere) {
  EXPECT_TRUE(simd_available(SimdLevel::baseline));
  EXPECT_STREQ(to_string(SimdLevel::baseline), "baseline");
  EXPECT_STREQ(to_string(SimdLevel::avx512), "avx512");
  EXPECT_EQ(parse_simd_level("baseline"), SimdLevel::baseline);
  EXPECT_EQ(parse_simd_level("avx512"), SimdLevel::avx512);
  EXPECT_THROW(parse_simd_level("sse2"), Error);
  EXPECT_GT(streaming_store_bytes(), 0);
  if (!simd_available(SimdLevel::avx512)) {
    EXPECT_THROW(set_simd_level(SimdLevel::avx512), Error);
    EXPECT_EQ(simd_level(), SimdLevel::baseline);
  }
}

TEST(BatchNormKernels, TheTriadMeasuresABandwidthAndChecksItsArguments) {
  const double gbs = triad_bandwidth_gbs(std::int64_t{1} << 20, 3);
  EXPECT_GT(gbs, 0.0);
  EXPECT_TRUE(std::isfinite(gbs));
  EXPECT_THROW(triad_bandwidth_gbs(512, 3), Error);
  EXPECT_THROW(triad_bandwidth_gbs(std::int64_t{1} << 20, 0), Error);
}

TEST(BatchNormKernels, RefuseMismatchedSizesAndBlockedOddChannels) {
  const Tensor<float> x({1, 16, 4, 4});
  std::vector<double> few(3);
  EXPECT_THROW(fast::batchnorm_sum(x, Layout::nchw16c, std::span<double>(few)), Error);
  const Tensor<float> odd({1, 8, 4, 4});
  std::vector<double> eight(8);
  EXPECT_THROW(fast::batchnorm_sum(odd, Layout::nchw16c, std::span<double>(eight)), Error);
  const Tensor<float> twelve({1, 12, 4, 4});
  std::vector<double> sums(12);
  EXPECT_THROW(fast::batchnorm_sum(twelve, Layout::nchw8c, std::span<double>(sums)), Error);
}

}  // namespace
}  // namespace tessera
