#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/layers/pointwise.hpp"
#include "tessera/random.hpp"
#include "tessera/tensor.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

using test::dot;
using test::max_abs;
using test::rel_error;

using reference::ConvGeometry;

constexpr std::uint64_t kSeed = 20240611;

// Random values already rounded to float, so float and double runs see the same data.
template <typename T>
Tensor<T> random_tensor(Shape4 s, std::uint64_t stream) {
  return test::random_tensor<T>(s, kSeed, stream);
}

template <typename T>
std::vector<T> random_vector(std::int64_t n, std::uint64_t stream) {
  return test::random_vector<T>(n, kSeed, stream);
}

template <typename To, typename From>
Tensor<To> convert(const Tensor<From>& t) {
  Tensor<To> out(t.shape());
  for (std::int64_t k = 0; k < t.numel(); ++k)
    out.data()[k] = static_cast<To>(t.data()[k]);
  return out;
}

template <typename T>
Tensor<T> abs_of(const Tensor<T>& t) {
  Tensor<T> out(t.shape());
  for (std::int64_t k = 0; k < t.numel(); ++k)
    out.data()[k] = std::abs(t.data()[k]);
  return out;
}

// floor((in + pad_begin + pad_end - d*(k-1) - 1) / s) + 1, or 0 when no window fits.
std::int64_t out_extent(std::int64_t in, std::int64_t pad_begin, std::int64_t pad_end,
                        std::int64_t k, std::int64_t s, std::int64_t d) {
  const std::int64_t span = in + pad_begin + pad_end - d * (k - 1) - 1;
  return span < 0 ? 0 : span / s + 1;
}

struct ConvCase {
  std::int64_t n = 2, c = 4, o = 4, h = 7, w = 9, kh = 3, kw = 3;
  std::int64_t pad_bottom = 0, pad_right = 0;
  ConvGeometry g;

  Shape4 x_shape() const { return {n, c, h, w}; }
  Shape4 w_shape() const { return {o, c / g.groups, kh, kw}; }
  Shape4 y_shape() const {
    return {n, o, out_extent(h, g.pad_top, pad_bottom, kh, g.stride_h, g.dilation_h),
            out_extent(w, g.pad_left, pad_right, kw, g.stride_w, g.dilation_w)};
  }
  std::string str() const {
    return "x[" + std::to_string(n) + "," + std::to_string(c) + "," + std::to_string(h) + "," +
           std::to_string(w) + "] o=" + std::to_string(o) + " groups=" + std::to_string(g.groups) +
           " k=" + std::to_string(kh) + "x" + std::to_string(kw) +
           " s=" + std::to_string(g.stride_h) + "x" + std::to_string(g.stride_w) +
           " d=" + std::to_string(g.dilation_h) + "x" + std::to_string(g.dilation_w) +
           " pad(t,l,b,r)=" + std::to_string(g.pad_top) + "," + std::to_string(g.pad_left) + "," +
           std::to_string(pad_bottom) + "," + std::to_string(pad_right);
  }
};

// Kernels 1, 2, 3, 5 and non-square; strides 1, 2, 3 (and mixed); dilations 1, 2 (and mixed);
// pad_top / pad_left 0..2 with varied pad_bottom / pad_right; groups 1, 2 and depthwise (with a
// channel multiplier of 2); odd image sizes. Cases with an empty output are left out.
std::vector<ConvCase> conv_sweep(std::int64_t channels) {
  struct Pair {
    std::int64_t h, w;
  };
  const Pair kernels[] = {{1, 1}, {2, 2}, {3, 3}, {5, 5}, {3, 2}, {1, 3}};
  const Pair strides[] = {{1, 1}, {2, 2}, {3, 3}, {2, 1}};
  const Pair dilations[] = {{1, 1}, {2, 2}, {1, 2}};
  const Pair images[] = {{7, 9}, {5, 4}};
  std::vector<std::int64_t> groups = {1, 2, channels};
  groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
  std::vector<ConvCase> cases;
  for (const Pair& k : kernels)
    for (const Pair& s : strides)
      for (const Pair& d : dilations)
        for (std::int64_t pt = 0; pt <= 2; ++pt)
          for (std::int64_t pl = 0; pl <= 2; ++pl)
            for (std::int64_t gr : groups)
              for (const Pair& img : images) {
                ConvCase c;
                c.c = channels;
                c.o = gr == channels ? 2 * channels : channels;
                c.h = img.h;
                c.w = img.w;
                c.kh = k.h;
                c.kw = k.w;
                c.g = ConvGeometry{.stride_h = s.h,
                                   .stride_w = s.w,
                                   .dilation_h = d.h,
                                   .dilation_w = d.w,
                                   .pad_top = pt,
                                   .pad_left = pl,
                                   .groups = gr};
                c.pad_bottom = (pt + k.h) % 4;
                c.pad_right = (pl + 2 * k.w + 1) % 4;
                const Shape4 y = c.y_shape();
                if (y.h > 0 && y.w > 0) cases.push_back(c);
              }
  return cases;
}

// The convolution straight from its definition, in double: y[n,o,oh,ow] = bias[o] +
// sum over (ic in o's group, kh, kw) of w * x[n, ic, oh*sh - pt + kh*dh, ow*sw - pl + kw*dw],
// reads outside x being zero. `abs_sum` gets |bias| + sum of |w * x| (the rounding scale).
template <typename T>
void naive_conv(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias,
                const ConvGeometry& g, Shape4 ys, std::vector<double>& y,
                std::vector<double>& abs_sum) {
  const Shape4 xs = x.shape(), ws = w.shape();
  y.assign(static_cast<std::size_t>(ys.numel()), 0.0);
  abs_sum.assign(y.size(), 0.0);
  const std::int64_t in_per_group = xs.c / g.groups, out_per_group = ys.c / g.groups;
  std::size_t k = 0;
  for (std::int64_t n = 0; n < ys.n; ++n)
    for (std::int64_t o = 0; o < ys.c; ++o)
      for (std::int64_t oh = 0; oh < ys.h; ++oh)
        for (std::int64_t ow = 0; ow < ys.w; ++ow, ++k) {
          double sum = bias.empty() ? 0.0 : double(bias[std::size_t(o)]);
          double mag = std::abs(sum);
          const std::int64_t group = o / out_per_group;
          for (std::int64_t j = 0; j < in_per_group; ++j)
            for (std::int64_t a = 0; a < ws.h; ++a)
              for (std::int64_t b = 0; b < ws.w; ++b) {
                const std::int64_t ih = oh * g.stride_h - g.pad_top + a * g.dilation_h;
                const std::int64_t iw = ow * g.stride_w - g.pad_left + b * g.dilation_w;
                if (ih < 0 || ih >= xs.h || iw < 0 || iw >= xs.w) continue;
                const double term =
                    double(w.at(o, j, a, b)) * double(x.at(n, group * in_per_group + j, ih, iw));
                sum += term;
                mag += std::abs(term);
              }
          y[k] = sum;
          abs_sum[k] = mag;
        }
}

template <typename T>
void check_forward_against_naive() {
  int checked = 0;
  for (const ConvCase& c : conv_sweep(4)) {
    const Tensor<T> x = random_tensor<T>(c.x_shape(), 1);
    const Tensor<T> w = random_tensor<T>(c.w_shape(), 2);
    const std::vector<T> bias = random_vector<T>(c.o, 3);
    for (bool with_bias : {true, false}) {
      const std::span<const T> b = with_bias ? std::span<const T>(bias) : std::span<const T>();
      // The output must be overwritten, whatever it held.
      Tensor<T> y(c.y_shape(), std::numeric_limits<T>::quiet_NaN());
      reference::conv2d_forward(x, w, b, y, c.g);
      std::vector<double> ref, mag;
      naive_conv(x, w, b, c.g, c.y_shape(), ref, mag);
      // Each output sums at most 1 + c*kh*kw terms: its rounding error is below that many
      // epsilons of the sum of magnitudes (for both the kernel and the double reference).
      const double terms = double(1 + c.c * c.kh * c.kw);
      const double eps = std::numeric_limits<T>::epsilon();
      for (std::size_t k = 0; k < ref.size(); ++k)
        ASSERT_NEAR(double(y.data()[k]), ref[k], 2 * terms * eps * mag[k] + 1e-300)
            << c.str() << " bias=" << with_bias << " at " << k;
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000);
}

TEST(ReferenceConv, ForwardMatchesTheDefinitionDouble) {
  check_forward_against_naive<double>();
}
TEST(ReferenceConv, ForwardMatchesTheDefinitionFloat) {
  check_forward_against_naive<float>();
}

// A hand-computed case: one 3x3 image, a 2x2 kernel, stride 1, pad 1 all round.
TEST(ReferenceConv, ForwardSmallHandComputedCase) {
  Tensor<double> x({1, 1, 3, 3});
  for (int k = 0; k < 9; ++k)
    x.data()[k] = k + 1;  // 1..9
  Tensor<double> w({1, 1, 2, 2});
  w.at(0, 0, 0, 0) = 1;
  w.at(0, 0, 0, 1) = 10;
  w.at(0, 0, 1, 0) = 100;
  w.at(0, 0, 1, 1) = 1000;
  const std::vector<double> bias = {0.5};
  Tensor<double> y({1, 1, 4, 4});
  reference::conv2d_forward<double>(x, w, bias, y, ConvGeometry{.pad_top = 1, .pad_left = 1});
  // y[0,0] only sees x[0,0] under the tap (1,1); y[3,3] only sees x[2,2] under the tap (0,0).
  EXPECT_EQ(y.at(0, 0, 0, 0), 0.5 + 1000 * 1);
  EXPECT_EQ(y.at(0, 0, 3, 3), 0.5 + 1 * 9);
  // y[1,1] sees x[0..1, 0..1] = 1 2 / 4 5.
  EXPECT_EQ(y.at(0, 0, 1, 1), 0.5 + 1 * 1 + 10 * 2 + 100 * 4 + 1000 * 5);
  // y[0,2] sees row -1 (zeros) and x[0, 1..2] = 2 3 under taps (1,0), (1,1).
  EXPECT_EQ(y.at(0, 0, 0, 2), 0.5 + 100 * 2 + 1000 * 3);
}

// <conv(x, w), y> == <x, conv^T(y, w)>, to 1e-12 of <|conv|(|x|, |w|), |y|>.
TEST(ReferenceConv, BackwardDataIsTheAdjointOfForward) {
  int checked = 0;
  for (const ConvCase& c : conv_sweep(4)) {
    const Tensor<double> x = random_tensor<double>(c.x_shape(), 11);
    const Tensor<double> w = random_tensor<double>(c.w_shape(), 12);
    const Tensor<double> r = random_tensor<double>(c.y_shape(), 13);
    Tensor<double> y(c.y_shape()), y_abs(c.y_shape());
    reference::conv2d_forward<double>(x, w, {}, y, c.g);
    reference::conv2d_forward<double>(abs_of(x), abs_of(w), {}, y_abs, c.g);
    Tensor<double> dx(c.x_shape(), std::numeric_limits<double>::quiet_NaN());
    reference::conv2d_backward_data(r, w, dx, c.g);
    const double lhs = dot(y.span(), r.span());
    const double rhs = dot(x.span(), dx.span());
    const double scale = dot(y_abs.span(), abs_of(r).span());
    ASSERT_GT(scale, 0) << c.str();
    ASSERT_LE(std::abs(lhs - rhs), 1e-12 * scale) << c.str() << ": " << lhs << " vs " << rhs;
    ++checked;
  }
  EXPECT_GT(checked, 1000);
}

// L = sum(r * conv(x, w, b)) and its gradients from the backward kernels.
struct ConvProblem {
  ConvCase c;
  Tensor<double> x, w, r;
  std::vector<double> bias;

  explicit ConvProblem(const ConvCase& cc)
      : c(cc),
        x(random_tensor<double>(cc.x_shape(), 21)),
        w(random_tensor<double>(cc.w_shape(), 22)),
        r(random_tensor<double>(cc.y_shape(), 24)),
        bias(random_vector<double>(cc.o, 23)) {}

  double loss() const {
    Tensor<double> y(c.y_shape());
    reference::conv2d_forward<double>(x, w, bias, y, c.g);
    return dot(y.span(), r.span());
  }
};

// Central differences of `p.loss()` with respect to every element of `v` (which p.loss reads).
// L is linear in each of x, w and bias, so the only error is rounding.
std::vector<double> central_differences(ConvProblem& p, std::span<double> v) {
  constexpr double h = 1e-3;
  std::vector<double> grad(v.size());
  for (std::size_t k = 0; k < v.size(); ++k) {
    const double saved = v[k];
    v[k] = saved + h;
    const double up = p.loss();
    v[k] = saved - h;
    const double down = p.loss();
    v[k] = saved;
    grad[k] = (up - down) / (2 * h);
  }
  return grad;
}

TEST(ReferenceConv, BackwardMatchesCentralFiniteDifferences) {
  int checked = 0;
  // The whole sweep, with 2 input channels (groups 1, and 2 = depthwise) to keep it quick.
  for (const ConvCase& sweep_case : conv_sweep(2)) {
    ConvProblem p(sweep_case);
    const ConvCase& c = p.c;
    Tensor<double> dx(c.x_shape()), dw(c.w_shape());
    std::vector<double> dbias(static_cast<std::size_t>(c.o), 0.0);
    reference::conv2d_backward_data(p.r, p.w, dx, c.g);
    reference::conv2d_backward_filter<double>(p.x, p.r, dw, dbias, c.g);

    const std::vector<double> fd_x = central_differences(p, p.x.span());
    const std::vector<double> fd_w = central_differences(p, p.w.span());
    const std::vector<double> fd_b = central_differences(p, p.bias);
    ASSERT_GT(max_abs(dx.span()), 0) << c.str();
    EXPECT_LT(rel_error(dx.span(), fd_x), 1e-7) << "dx " << c.str();
    EXPECT_LT(rel_error(dw.span(), fd_w), 1e-7) << "dw " << c.str();
    EXPECT_LT(rel_error(dbias, fd_b), 1e-7) << "dbias " << c.str();
    ++checked;
  }
  EXPECT_GT(checked, 1000);
}

TEST(ReferenceConv, BackwardFilterAccumulatesIntoWeightAndBiasGradients) {
  int checked = 0;
  const std::vector<ConvCase> all = conv_sweep(4);
  for (std::size_t i = 0; i < all.size(); i += 5) {
    const ConvCase& c = all[i];
    const Tensor<double> x = random_tensor<double>(c.x_shape(), 31);
    const Tensor<double> dy = random_tensor<double>(c.y_shape(), 32);
    // Once from zero: the gradient itself.
    Tensor<double> g_w(c.w_shape());
    std::vector<double> g_b(static_cast<std::size_t>(c.o), 0.0);
    reference::conv2d_backward_filter<double>(x, dy, g_w, g_b, c.g);
    // Twice from zero: doubles.
    Tensor<double> twice_w(c.w_shape());
    std::vector<double> twice_b(g_b.size(), 0.0);
    reference::conv2d_backward_filter<double>(x, dy, twice_w, twice_b, c.g);
    reference::conv2d_backward_filter<double>(x, dy, twice_w, twice_b, c.g);
    // From a nonzero start: start + gradient.
    Tensor<double> start_w = random_tensor<double>(c.w_shape(), 33);
    std::vector<double> start_b = random_vector<double>(c.o, 34);
    Tensor<double> acc_w = start_w;
    std::vector<double> acc_b = start_b;
    reference::conv2d_backward_filter<double>(x, dy, acc_w, acc_b, c.g);

    std::vector<double> expect_twice_w(g_w.span().begin(), g_w.span().end());
    std::vector<double> expect_twice_b = g_b;
    for (double& v : expect_twice_w)
      v *= 2;
    for (double& v : expect_twice_b)
      v *= 2;
    std::vector<double> expect_acc_w(g_w.span().begin(), g_w.span().end());
    std::vector<double> expect_acc_b = g_b;
    for (std::size_t k = 0; k < expect_acc_w.size(); ++k)
      expect_acc_w[k] += start_w.data()[k];
    for (std::size_t k = 0; k < expect_acc_b.size(); ++k)
      expect_acc_b[k] += start_b[k];

    ASSERT_GT(max_abs(g_w.span()), 0) << c.str();
    EXPECT_LT(rel_error(twice_w.span(), expect_twice_w), 1e-13) << c.str();
    EXPECT_LT(rel_error(twice_b, expect_twice_b), 1e-13) << c.str();
    EXPECT_LT(rel_error(acc_w.span(), expect_acc_w), 1e-13) << c.str();
    EXPECT_LT(rel_error(acc_b, expect_acc_b), 1e-13) << c.str();

    // Without a bias gradient, the weight gradient is the same.
    Tensor<double> nob_w(c.w_shape());
    reference::conv2d_backward_filter<double>(x, dy, nob_w, {}, c.g);
    EXPECT_LT(rel_error(nob_w.span(), g_w.span()), 1e-15) << c.str();
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

// Same data (already representable in float) through both precisions.
TEST(ReferenceConv, FloatAgreesWithDouble) {
  for (const ConvCase& c : conv_sweep(4)) {
    const Tensor<double> x = random_tensor<double>(c.x_shape(), 41);
    const Tensor<double> w = random_tensor<double>(c.w_shape(), 42);
    const Tensor<double> dy = random_tensor<double>(c.y_shape(), 43);
    const std::vector<double> bias = random_vector<double>(c.o, 44);
    const Tensor<float> xf = convert<float>(x), wf = convert<float>(w), dyf = convert<float>(dy);
    const std::vector<float> biasf(bias.begin(), bias.end());

    Tensor<double> y(c.y_shape()), dx(c.x_shape()), dw(c.w_shape());
    std::vector<double> db(bias.size(), 0.0);
    Tensor<float> yf(c.y_shape()), dxf(c.x_shape()), dwf(c.w_shape());
    std::vector<float> dbf(bias.size(), 0.0f);
    reference::conv2d_forward<double>(x, w, bias, y, c.g);
    reference::conv2d_forward<float>(xf, wf, biasf, yf, c.g);
    reference::conv2d_backward_data(dy, w, dx, c.g);
    reference::conv2d_backward_data(dyf, wf, dxf, c.g);
    reference::conv2d_backward_filter<double>(x, dy, dw, db, c.g);
    reference::conv2d_backward_filter<float>(xf, dyf, dwf, dbf, c.g);

    EXPECT_LT(rel_error(yf.span(), y.span()), 1e-4) << "y " << c.str();
    EXPECT_LT(rel_error(dxf.span(), dx.span()), 1e-4) << "dx " << c.str();
    EXPECT_LT(rel_error(dwf.span(), dw.span()), 1e-4) << "dw " << c.str();
    EXPECT_LT(rel_error(dbf, db), 1e-4) << "dbias " << c.str();
  }
}

template <typename Fn>
void expect_error(Fn&& fn, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << "no tessera::Error for " << what;
  } catch (const Error& e) {
    EXPECT_FALSE(std::string(e.what()).empty()) << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a tessera::Error for " << what << ": " << e.what();
  }
}

TEST(ReferenceConv, ShapeMismatchesThrow) {
  const Tensor<double> x({2, 4, 7, 9});
  const Tensor<double> w({6, 4, 3, 3});
  const std::vector<double> bias(6, 0.0);
  Tensor<double> y({2, 6, 5, 7});
  Tensor<double> dx({2, 4, 7, 9}), dw({6, 4, 3, 3});
  std::vector<double> db(6, 0.0);
  const ConvGeometry g;
  // The consistent call works.
  reference::conv2d_forward<double>(x, w, bias, y, g);
  reference::conv2d_backward_data(y, w, dx, g);
  reference::conv2d_backward_filter<double>(x, y, dw, db, g);

  const Tensor<double> w_channels({6, 3, 3, 3});  // weight channels do not match the input
  expect_error([&] { reference::conv2d_forward<double>(x, w_channels, bias, y, g); },
               "forward, weight channels");
  expect_error([&] { reference::conv2d_backward_data(y, w_channels, dx, g); },
               "backward_data, weight channels");
  Tensor<double> dw_channels({6, 3, 3, 3});
  expect_error([&] { reference::conv2d_backward_filter<double>(x, y, dw_channels, db, g); },
               "backward_filter, weight channels");

  Tensor<double> y_channels({2, 5, 5, 7});  // output channels != weight outputs
  expect_error([&] { reference::conv2d_forward<double>(x, w, {}, y_channels, g); },
               "forward, output channels");
  expect_error([&] { reference::conv2d_backward_data(y_channels, w, dx, g); },
               "backward_data, output channels");
  expect_error([&] { reference::conv2d_backward_filter<double>(x, y_channels, dw, {}, g); },
               "backward_filter, output channels");

  Tensor<double> y_batch({1, 6, 5, 7});  // batch differs
  expect_error([&] { reference::conv2d_forward<double>(x, w, bias, y_batch, g); },
               "forward, batch");
  expect_error([&] { reference::conv2d_backward_data(y_batch, w, dx, g); }, "backward_data, batch");
  expect_error([&] { reference::conv2d_backward_filter<double>(x, y_batch, dw, db, g); },
               "backward_filter, batch");

  // Groups: 3 does not divide 4 channels; 0 groups; 4 channels in 2 groups need weight channels
  // 2 and outputs divisible by 2.
  const Tensor<double> w_g2({6, 2, 3, 3}), w_g2_odd({5, 2, 3, 3});
  Tensor<double> y5({2, 5, 5, 7});
  expect_error([&] { reference::conv2d_forward<double>(x, w, {}, y, {.groups = 3}); }, "groups 3");
  expect_error([&] { reference::conv2d_forward<double>(x, w, {}, y, {.groups = 0}); }, "groups 0");
  expect_error([&] { reference::conv2d_forward<double>(x, w, {}, y, {.groups = 2}); },
               "groups 2 with ungrouped weight");
  expect_error([&] { reference::conv2d_forward<double>(x, w_g2_odd, {}, y5, {.groups = 2}); },
               "groups 2, 5 outputs");
  reference::conv2d_forward<double>(x, w_g2, {}, y, {.groups = 2});  // fits

  // The bias must have one value per output channel (or be empty).
  const std::vector<double> short_bias(5, 0.0);
  std::vector<double> short_db(5, 0.0);
  expect_error([&] { reference::conv2d_forward<double>(x, w, short_bias, y, g); },
               "forward, bias size");
  expect_error([&] { reference::conv2d_backward_filter<double>(x, y, dw, short_db, g); },
               "backward_filter, bias size");
}

template <typename T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <typename T>
void check_relu() {
  const std::vector<T> x = {T(-2), T(-0.5), T(0), T(-0.0), T(1e-30), T(0.25), T(3)};
  std::vector<T> y(x.size(), T(7));
  reference::leaky_relu_forward<T>(x, T(0), y);
  const std::vector<T> expect_y = {T(0), T(0), T(0), T(0), T(1e-30), T(0.25), T(3)};
  EXPECT_EQ(y, expect_y);
  const std::vector<T> dy = {T(1), T(2), T(3), T(4), T(5), T(6), T(-7)};
  std::vector<T> dx(x.size(), T(9));
  reference::leaky_relu_backward<T>(y, dy, T(0), dx);
  const std::vector<T> expect_dx = {T(0), T(0), T(0), T(0), T(5), T(6), T(-7)};
  EXPECT_EQ(dx, expect_dx);

  // Random: forward is max(x, 0), backward passes dy exactly where x > 0.
  const std::vector<T> rx = random_vector<T>(1000, 51), rdy = random_vector<T>(1000, 52);
  std::vector<T> ry(rx.size()), rdx(rx.size());
  reference::leaky_relu_forward<T>(rx, T(0), ry);
  reference::leaky_relu_backward<T>(ry, rdy, T(0), rdx);
  for (std::size_t k = 0; k < rx.size(); ++k) {
    EXPECT_EQ(ry[k], std::max(rx[k], T(0)));
    EXPECT_EQ(rdx[k], rx[k] > T(0) ? rdy[k] : T(0));
  }
}

TEST(ReferenceRelu, ForwardAndBackwardDouble) {
  check_relu<double>();
}
TEST(ReferenceRelu, ForwardAndBackwardFloat) {
  check_relu<float>();
}

// The relu and leaky_relu layers keep a byte mask instead of their output and run vectorised and
// threaded: bit for bit the reference rules, signed zeros included, on a tensor large enough to
// be split over the kernel threads.
template <typename T>
void check_activation_layer_matches_reference() {
  const Shape4 shape{2, 3, 150, 160};  // 144000 elements: more than one thread's share
  const Distribution d{shape, GridShape{1, 1, 1}, GridCoords{}};
  DistTensor<T> x(d), dy(d);
  const std::vector<T> rx = random_vector<T>(static_cast<std::size_t>(shape.numel()), 61);
  const std::vector<T> rdy = random_vector<T>(static_cast<std::size_t>(shape.numel()), 62);
  std::copy(rx.begin(), rx.end(), x.local.data());
  std::copy(rdy.begin(), rdy.end(), dy.local.data());
  x.local.data()[0] = T(0), x.local.data()[1] = T(-0.0), x.local.data()[2] = T(1e-30);
  for (double slope : {0.0, 0.01, 0.2})
    for (KernelBackend backend : test::built_backends()) {
      Activation<T> layer(
          "a",
          {.kind = slope == 0 ? ActivationKind::relu : ActivationKind::leaky_relu, .slope = slope});
      layer.setup(d);
      layer.bind(test::single_runtime(backend));
      const DistTensor<T> y = layer.forward(x, RunState{});
      const DistTensor<T> dx = layer.backward_one(dy, RunState{});
      std::vector<T> ry(rx.size()), rdx(rx.size());
      reference::leaky_relu_forward<T>(x.local.span(), T(slope), ry);
      reference::leaky_relu_backward<T>(ry, dy.local.span(), T(slope), rdx);
      std::int64_t wrong = 0;
      for (std::size_t k = 0; k < rx.size(); ++k)
        wrong += !same_bits(y.local.data()[k], ry[k]) + !same_bits(dx.local.data()[k], rdx[k]);
      EXPECT_EQ(wrong, 0) << "slope " << slope << ", " << to_string(backend);
    }
}

TEST(ActivationLayer, MatchesTheReferenceBitForBitDouble) {
  check_activation_layer_matches_reference<double>();
}
TEST(ActivationLayer, MatchesTheReferenceBitForBitFloat) {
  check_activation_layer_matches_reference<float>();
}

// Sum over pixels of -log(exp(x[label]) / sum_c exp(x[c])), straight from the definition.
double direct_cross_entropy(const Tensor<double>& logits, const std::vector<std::int32_t>& labels) {
  const Shape4 s = logits.shape();
  double total = 0;
  std::size_t p = 0;
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t i = 0; i < s.h; ++i)
      for (std::int64_t j = 0; j < s.w; ++j, ++p) {
        double sum = 0;
        for (std::int64_t c = 0; c < s.c; ++c)
          sum += std::exp(logits.at(n, c, i, j));
        total -= std::log(std::exp(logits.at(n, labels[p], i, j)) / sum);
      }
  return total;
}

std::vector<std::int32_t> random_labels(std::int64_t count, std::int64_t classes,
                                        std::uint64_t stream) {
  std::vector<std::int32_t> labels(static_cast<std::size_t>(count));
  for (std::size_t k = 0; k < labels.size(); ++k)
    labels[k] = static_cast<std::int32_t>(uniform01(kSeed, stream, k) * double(classes));
  return labels;
}

// Dropout from every backend: each element of a tile at (1, 0, 2, 3) of its tensor is scaled as
// dropout_scale says for its global index (the mask a single rank would draw), about p of them
// are dropped, and the backward multiplies by the same mask.
template <typename T>
void check_dropout_kernel() {
  const Shape4 global{3, 2, 9, 11}, tile{2, 2, 5, 6};
  const TileOrigin origin{global, 1, 2, 3};
  const double p = 0.3;
  const T keep = static_cast<T>(1 / (1 - p));
  const Tensor<T> x = test::random_tensor<T>(tile, 1, 2), dy = test::random_tensor<T>(tile, 1, 3);
  for (KernelBackend backend : test::built_backends()) {
    auto kernel = backend_of(backend).dropout<T>(p);
    Tensor<T> mask(tile, T(-1)), y(tile, T(-1)), dx(tile, T(-1));
    kernel->forward(x, origin, 7, 11, mask, y);
    kernel->backward(dy, mask, dx);
    std::int64_t dropped = 0;
    for (std::int64_t n = 0; n < tile.n; ++n)
      for (std::int64_t c = 0; c < tile.c; ++c)
        for (std::int64_t h = 0; h < tile.h; ++h)
          for (std::int64_t w = 0; w < tile.w; ++w) {
            const auto index =
                static_cast<std::uint64_t>(((origin.n + n) * global.c + c) * global.h * global.w +
                                           (origin.h + h) * global.w + origin.w + w);
            const T s = uniform01(7, 11, index) >= p ? keep : T(0);
            ASSERT_EQ(mask.at(n, c, h, w), s) << to_string(backend) << " at " << n << c << h << w;
            ASSERT_EQ(y.at(n, c, h, w), x.at(n, c, h, w) * s);
            ASSERT_EQ(dx.at(n, c, h, w), dy.at(n, c, h, w) * s);
            dropped += s == T(0);
          }
    EXPECT_NEAR(static_cast<double>(dropped) / static_cast<double>(tile.numel()), p, 0.12);
    Tensor<T> small(Shape4{2, 2, 5, 5});
    EXPECT_THROW(kernel->forward(x, origin, 7, 11, small, y), Error);
    EXPECT_THROW(kernel->forward(x, TileOrigin{global, 2, 2, 3}, 7, 11, mask, y), Error)
        << "a tile past the tensor's samples";
  }
}

TEST(DropoutKernel, DrawsTheGlobalMaskDouble) {
  check_dropout_kernel<double>();
}
TEST(DropoutKernel, DrawsTheGlobalMaskFloat) {
  check_dropout_kernel<float>();
}

// Units in the last place between two positive doubles (their bit patterns' distance).
std::int64_t ulps_apart(double a, double b) {
  const auto bits = [](double x) {
    std::int64_t v;
    std::memcpy(&v, &x, sizeof v);
    return v;
  };
  return std::abs(bits(a) - bits(b));
}

// The cross-entropy's own exp and log (include/tessera/kernels/elementwise.hpp) against the C
// library's, over their whole working range: within 2 units in the last place (each is within 1
// of the exact value); their edges and special values as documented.
TEST(ExpAndLog, AreWithinTwoUnitsInTheLastPlace) {
  using elementwise::exp_poly, elementwise::log_poly;
  std::int64_t worst_exp = 0, worst_log = 0;
  for (std::int64_t k = 0; k <= 2000000; ++k) {
    const double a = -708.0 + 1417.0 * static_cast<double>(k) / 2000000.0;  // [-708, 709]
    worst_exp = std::max(worst_exp, ulps_apart(exp_poly(a), std::exp(a)));
    const double small = -1.0 + 2.0 * uniform01(7, 1, static_cast<std::uint64_t>(k));  // |r| small
    worst_exp = std::max(worst_exp, ulps_apart(exp_poly(small), std::exp(small)));
    const double x = std::ldexp(1.0 + uniform01(7, 2, static_cast<std::uint64_t>(k)),
                                static_cast<int>(k % 2045) - 1022);  // every exponent
    worst_log = std::max(worst_log, ulps_apart(log_poly(x), std::log(x)));
    const double near_one = 1.0 + 1e-6 * uniform01(7, 3, static_cast<std::uint64_t>(k));
    if (near_one != 1.0)
      worst_log = std::max(worst_log, ulps_apart(log_poly(near_one), std::log(near_one)));
  }
  EXPECT_LE(worst_exp, 2);
  EXPECT_LE(worst_log, 2);
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(exp_poly(0.0), 1.0);
  EXPECT_EQ(exp_poly(-708.5), 0.0);  // below kExpLowest
  EXPECT_EQ(exp_poly(-inf), 0.0);
  EXPECT_EQ(exp_poly(709.5), inf);
  EXPECT_TRUE(std::isnan(exp_poly(std::numeric_limits<double>::quiet_NaN())));
  EXPECT_GT(exp_poly(-708.0), 0.0);
  EXPECT_EQ(log_poly(1.0), 0.0);
  EXPECT_EQ(log_poly(inf), inf);
  EXPECT_TRUE(std::isnan(log_poly(std::numeric_limits<double>::quiet_NaN())));
  EXPECT_LE(ulps_apart(log_poly(std::numeric_limits<double>::min()),
                       std::log(std::numeric_limits<double>::min())),
            2);
  EXPECT_LE(ulps_apart(log_poly(std::numeric_limits<double>::max()),
                       std::log(std::numeric_limits<double>::max())),
            2);
}

TEST(ReferenceCrossEntropy, ValueMatchesTheDefinition) {
  for (const Shape4 s : {Shape4{2, 3, 5, 4}, Shape4{1, 2, 7, 9}, Shape4{3, 1, 2, 3}}) {
    Tensor<double> logits = random_tensor<double>(s, 61);
    for (double& v : logits.span())
      v *= 4;
    const std::vector<std::int32_t> labels = random_labels(s.n * s.h * s.w, s.c, 62);
    const double expect = direct_cross_entropy(logits, labels);
    EXPECT_NEAR(reference::pixel_cross_entropy<double>(logits, labels, 1.0, nullptr), expect,
                1e-12 * std::abs(expect) + 1e-14)
        << s.str();
    const Tensor<float> lf = convert<float>(logits);
    EXPECT_NEAR(reference::pixel_cross_entropy<float>(lf, labels, 1.0f, nullptr), expect,
                1e-5 * std::abs(expect) + 1e-6)
        << s.str();
  }
}

// Up to elementwise::kCachedClasses classes each exp is taken once (the largest's is 1 without a
// call), more are recomputed for the gradient: both give the definition's value and softmax -
// onehot, with ties for the largest logit too.
TEST(ReferenceCrossEntropy, FewAndManyClassesGiveTheDefinitionsValueAndGradient) {
  for (std::int64_t classes : {std::int64_t{2}, elementwise::kCachedClasses,
                               elementwise::kCachedClasses + 1, std::int64_t{13}}) {
    const Shape4 s{2, classes, 3, 4};
    Tensor<double> logits = random_tensor<double>(s, 81);
    for (double& v : logits.span())
      v *= 5;
    for (std::int64_t c = 0; c < classes; ++c)  // pixel (0, 0, 0): every logit the same
      logits.at(0, c, 0, 0) = 0.25;
    logits.at(1, 1, 2, 3) = logits.at(1, 0, 2, 3) = 40;  // a tie for the largest
    const std::vector<std::int32_t> labels = random_labels(s.n * s.h * s.w, classes, 82);
    Tensor<double> grad(s, std::numeric_limits<double>::quiet_NaN());  // overwritten
    const double value = reference::pixel_cross_entropy<double>(logits, labels, 0.5, &grad);
    const double expect = direct_cross_entropy(logits, labels);
    EXPECT_NEAR(value, expect, 1e-12 * std::abs(expect)) << classes << " classes";
    std::size_t p = 0;
    for (std::int64_t n = 0; n < s.n; ++n)
      for (std::int64_t i = 0; i < s.h; ++i)
        for (std::int64_t j = 0; j < s.w; ++j, ++p) {
          double sum = 0;
          for (std::int64_t c = 0; c < classes; ++c)
            sum += std::exp(logits.at(n, c, i, j));
          for (std::int64_t c = 0; c < classes; ++c) {
            const double want =
                0.5 * (std::exp(logits.at(n, c, i, j)) / sum - (c == labels[p] ? 1.0 : 0.0));
            EXPECT_NEAR(grad.at(n, c, i, j), want, 1e-15) << classes << " classes, " << c;
          }
        }
    EXPECT_NEAR(grad.at(0, 1, 0, 0) + (labels[0] == 1 ? 0.5 : 0.0), 0.5 / double(classes), 1e-16)
        << "equal logits: softmax 1 / classes";
  }
}

TEST(ReferenceCrossEntropy, LargeLogitsDoNotOverflow) {
  Tensor<double> logits({1, 3, 1, 2});
  const double base[3] = {1000, 1001, 999};
  for (int c = 0; c < 3; ++c) {
    logits.at(0, c, 0, 0) = base[c];
    logits.at(0, c, 0, 1) = -base[c];
  }
  const std::vector<std::int32_t> labels = {1, 2};
  Tensor<double> d(logits.shape());
  const double value = reference::pixel_cross_entropy<double>(logits, labels, 1.0, &d);
  // Shifted by the maximum, pixel 0 is {-1, 0, -2} with label 1 and pixel 1 {-1, -2, 0} with
  // label 2: both lose log(1 + e^-1 + e^-2).
  const double each = std::log(1 + std::exp(-1.0) + std::exp(-2.0));
  EXPECT_NEAR(value, 2 * each, 1e-12);
  for (double v : d.span())
    EXPECT_TRUE(std::isfinite(v));
}

TEST(ReferenceCrossEntropy, GradientMatchesCentralFiniteDifferences) {
  const Shape4 s{2, 4, 3, 5};
  Tensor<double> logits = random_tensor<double>(s, 71);
  for (double& v : logits.span())
    v *= 3;
  const std::vector<std::int32_t> labels = random_labels(s.n * s.h * s.w, s.c, 72);
  Tensor<double> grad(s, std::numeric_limits<double>::quiet_NaN());  // overwritten
  reference::pixel_cross_entropy<double>(logits, labels, 1.0, &grad);

  constexpr double h = 1e-5;
  std::vector<double> fd(static_cast<std::size_t>(s.numel()));
  for (std::size_t k = 0; k < fd.size(); ++k) {
    double& v = logits.data()[k];
    const double saved = v;
    v = saved + h;
    const double up = reference::pixel_cross_entropy<double>(logits, labels, 1.0, nullptr);
    v = saved - h;
    const double down = reference::pixel_cross_entropy<double>(logits, labels, 1.0, nullptr);
    v = saved;
    fd[k] = (up - down) / (2 * h);
  }
  EXPECT_LT(rel_error(grad.span(), fd), 1e-7);

  // softmax - onehot sums to zero over the channels of each pixel.
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t i = 0; i < s.h; ++i)
      for (std::int64_t j = 0; j < s.w; ++j) {
        double sum = 0;
        for (std::int64_t c = 0; c < s.c; ++c)
          sum += grad.at(n, c, i, j);
        EXPECT_NEAR(sum, 0.0, 1e-14);
      }
}

TEST(ReferenceCrossEntropy, ScaleMultipliesTheGradientNotTheValue) {
  const Shape4 s{2, 3, 4, 3};
  const Tensor<double> logits = random_tensor<double>(s, 81);
  const std::vector<std::int32_t> labels = random_labels(s.n * s.h * s.w, s.c, 82);
  Tensor<double> g1(s), gs(s);
  const double v1 = reference::pixel_cross_entropy<double>(logits, labels, 1.0, &g1);
  const double vs = reference::pixel_cross_entropy<double>(logits, labels, 0.37, &gs);
  EXPECT_DOUBLE_EQ(v1, vs);
  for (std::int64_t k = 0; k < s.numel(); ++k)
    EXPECT_NEAR(gs.data()[k], 0.37 * g1.data()[k], 1e-16);

  // float gradients agree with double.
  const Tensor<float> lf = convert<float>(logits);
  Tensor<float> gf(s);
  reference::pixel_cross_entropy<float>(lf, labels, 0.37f, &gf);
  EXPECT_LT(rel_error(gf.span(), gs.span()), 1e-5);
}

TEST(ReferenceCrossEntropy, BadLabelsThrow) {
  const Shape4 s{1, 3, 2, 2};
  const Tensor<double> logits = random_tensor<double>(s, 91);
  const Tensor<float> lf = convert<float>(logits);
  Tensor<double> d(s);
  for (std::int32_t bad : {-1, 3, 100}) {
    std::vector<std::int32_t> labels = {0, 1, 2, 0};
    labels[2] = bad;
    expect_error([&] { reference::pixel_cross_entropy<double>(logits, labels, 1.0, nullptr); },
                 "label " + std::to_string(bad));
    expect_error([&] { reference::pixel_cross_entropy<double>(logits, labels, 1.0, &d); },
                 "label " + std::to_string(bad) + " with gradient");
    expect_error([&] { reference::pixel_cross_entropy<float>(lf, labels, 1.0f, nullptr); },
                 "float label " + std::to_string(bad));
    try {
      reference::pixel_cross_entropy<double>(logits, labels, 1.0, nullptr);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
    }
  }
  // Every label in [0, C) is fine; a wrong number of labels is not.
  reference::pixel_cross_entropy<double>(logits, std::vector<std::int32_t>{0, 1, 2, 2}, 1.0, &d);
  expect_error(
      [&] {
        reference::pixel_cross_entropy<double>(logits, std::vector<std::int32_t>{0, 1, 2}, 1.0, &d);
      },
      "3 labels for 4 pixels");
  // The gradient must have the logits' shape.
  Tensor<double> small({1, 2, 2, 2});
  expect_error(
      [&] {
        reference::pixel_cross_entropy<double>(logits, std::vector<std::int32_t>{0, 1, 2, 2}, 1.0,
                                               &small);
      },
      "gradient shape");
}

}  // namespace
}  // namespace tessera
