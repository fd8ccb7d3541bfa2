// Reference pooling and nearest-upsampling kernels against their definitions, central finite
// differences (float64) and PyTorch's tie rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/reference_pool.hpp"
#include "tessera/kernels/reference_upsample.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/random.hpp"
#include "tessera/tensor.hpp"

namespace tessera {
namespace {

using test::dot;
using test::rel_error;

using reference::PoolGeometry;
using reference::UpsampleGeometry;

constexpr std::uint64_t kSeed = 20240917;

// Uniform in [-1, 1), rounded to float so that float and double runs see the same data.
template <typename T>
Tensor<T> random_tensor(Shape4 s, std::uint64_t stream) {
  return test::random_tensor<T>(s, kSeed, stream);
}

// Distinct values 0.01 apart (a seeded shuffle of -n/2 .. n/2 - 1, times 0.01): no ties, and no
// perturbation below 0.005 changes which element of a window is the largest.
Tensor<double> distinct_tensor(Shape4 s, std::uint64_t stream) {
  const std::int64_t n = s.numel();
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::vector<double> key(order.size());
  for (std::size_t k = 0; k < key.size(); ++k)
    key[k] = uniform01(kSeed, stream, k);
  std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return key[std::size_t(a)] < key[std::size_t(b)];
  });
  Tensor<double> t(s);
  for (std::int64_t k = 0; k < n; ++k)
    t.data()[order[std::size_t(k)]] = 0.01 * double(k - n / 2);
  return t;
}

// PyTorch's floor-mode output extent: (in + 2 pad - kernel) / stride + 1.
std::int64_t pool_extent(std::int64_t in, std::int64_t k, std::int64_t s, std::int64_t p) {
  return (in + 2 * p - k) / s + 1;
}

struct PoolCase {
  std::int64_t n = 2, c = 3, h = 7, w = 9;
  std::int64_t kh = 2, kw = 2, sh = 2, sw = 2, ph = 0, pw = 0;

  Shape4 x_shape() const { return {n, c, h, w}; }
  Shape4 y_shape() const { return {n, c, pool_extent(h, kh, sh, ph), pool_extent(w, kw, sw, pw)}; }
  PoolGeometry geometry() const {
    return reference::pool_geometry(x_shape(), kh, kw, sh, sw, ph, pw);
  }
  std::string str() const {
    return "x[" + std::to_string(n) + "," + std::to_string(c) + "," + std::to_string(h) + "," +
           std::to_string(w) + "] k=" + std::to_string(kh) + "x" + std::to_string(kw) +
           " s=" + std::to_string(sh) + "x" + std::to_string(sw) + " p=" + std::to_string(ph) +
           "x" + std::to_string(pw);
  }
};

// Kernels 1, 2, 3, 4 and non-square; strides 1, 2, 3 and mixed; every padding PyTorch allows
// (0 .. kernel / 2 per axis); odd images and images barely larger than the kernel.
std::vector<PoolCase> pool_sweep() {
  struct Two {
    std::int64_t h, w;
  };
  const Two kernels[] = {{1, 1}, {2, 2}, {3, 3}, {4, 4}, {3, 2}, {1, 3}};
  const Two strides[] = {{1, 1}, {2, 2}, {3, 3}, {1, 2}};
  const Two images[] = {{7, 9}, {5, 4}, {4, 3}};
  std::vector<PoolCase> cases;
  for (const Two& k : kernels)
    for (const Two& s : strides)
      for (std::int64_t ph = 0; ph <= k.h / 2; ++ph)
        for (std::int64_t pw = 0; pw <= k.w / 2; ++pw)
          for (const Two& img : images) {
            PoolCase c{.h = img.h, .w = img.w, .kh = k.h, .kw = k.w};
            c.sh = s.h;
            c.sw = s.w;
            c.ph = ph;
            c.pw = pw;
            const Shape4 y = c.y_shape();
            if (img.h + 2 * ph >= k.h && img.w + 2 * pw >= k.w && y.h > 0 && y.w > 0)
              cases.push_back(c);
          }
  return cases;
}

// The image positions of output (oh, ow)'s window, straight from PyTorch's definition.
struct Window {
  std::int64_t h0, h1, w0, w1;
};
Window window_of(const PoolCase& c, std::int64_t oh, std::int64_t ow) {
  const std::int64_t hs = oh * c.sh - c.ph, ws = ow * c.sw - c.pw;
  return {std::max<std::int64_t>(hs, 0), std::min(hs + c.kh, c.h), std::max<std::int64_t>(ws, 0),
          std::min(ws + c.kw, c.w)};
}

template <typename T>
void check_maxpool_against_definition() {
  int checked = 0;
  for (const PoolCase& c : pool_sweep()) {
    const Tensor<T> x = random_tensor<T>(c.x_shape(), 1);
    const Shape4 ys = c.y_shape();
    Tensor<T> y(ys, std::numeric_limits<T>::quiet_NaN());
    std::vector<std::int64_t> argmax(static_cast<std::size_t>(ys.numel()), -7);
    reference::maxpool2d_forward(x, y, std::span<std::int64_t>(argmax), c.geometry());
    std::size_t k = 0;
    for (std::int64_t n = 0; n < ys.n; ++n)
      for (std::int64_t ch = 0; ch < ys.c; ++ch)
        for (std::int64_t oh = 0; oh < ys.h; ++oh)
          for (std::int64_t ow = 0; ow < ys.w; ++ow, ++k) {
            const Window b = window_of(c, oh, ow);
            ASSERT_LT(b.h0, b.h1) << c.str();
            ASSERT_LT(b.w0, b.w1) << c.str();
            T best = x.at(n, ch, b.h0, b.w0);
            std::int64_t at = b.h0 * c.w + b.w0;
            for (std::int64_t h = b.h0; h < b.h1; ++h)
              for (std::int64_t w = b.w0; w < b.w1; ++w)
                if (x.at(n, ch, h, w) > best) {
                  best = x.at(n, ch, h, w);
                  at = h * c.w + w;
                }
            ASSERT_EQ(y.data()[k], best) << c.str() << " at " << oh << "," << ow;
            ASSERT_EQ(argmax[k], at) << c.str() << " at " << oh << "," << ow;
          }
    ++checked;
  }
  EXPECT_GT(checked, 200);
}

TEST(ReferenceMaxPool, ForwardMatchesTheDefinitionDouble) {
  check_maxpool_against_definition<double>();
}
TEST(ReferenceMaxPool, ForwardMatchesTheDefinitionFloat) {
  check_maxpool_against_definition<float>();
}

// An all-negative image: a kernel that pooled the padding as zeros would output 0 at the border.
TEST(ReferenceMaxPool, PaddingIsNeverSelected) {
  Tensor<double> x({1, 1, 3, 3});
  for (int k = 0; k < 9; ++k)
    x.data()[k] = -1.0 - k;  // -1 .. -9
  Tensor<double> y({1, 1, 2, 2});
  std::vector<std::int64_t> argmax(4);
  reference::maxpool2d_forward(x, y, std::span<std::int64_t>(argmax),
                               reference::pool_geometry(x.shape(), 2, 2, 2, 2, 1, 1));
  // Windows: {x00}, {x01, x02}, {x10, x20}, {x11, x12, x21, x22}.
  EXPECT_EQ(y.at(0, 0, 0, 0), -1.0);
  EXPECT_EQ(y.at(0, 0, 0, 1), -2.0);
  EXPECT_EQ(y.at(0, 0, 1, 0), -4.0);
  EXPECT_EQ(y.at(0, 0, 1, 1), -5.0);
  EXPECT_EQ(argmax, (std::vector<std::int64_t>{0, 1, 3, 4}));
}

// The distributed layers' case: x is a window with padding materialised in it, and `image`
// marks the part inside the picture. Whatever the padding holds (here +100) it is never pooled,
// so the result equals the unpadded x with pad_top / pad_left.
template <typename T>
void check_image_box_equals_padding() {
  int checked = 0;
  for (const PoolCase& c : pool_sweep()) {
    const Tensor<T> x = random_tensor<T>(c.x_shape(), 2);
    const Shape4 ys = c.y_shape();
    // Enough rows and columns on every side for the reach of every window.
    const std::int64_t extra_h = c.ph + c.kh + c.sh, extra_w = c.pw + c.kw + c.sw;
    Tensor<T> padded({c.n, c.c, c.h + 2 * extra_h, c.w + 2 * extra_w}, T(100));
    for (std::int64_t n = 0; n < c.n; ++n)
      for (std::int64_t ch = 0; ch < c.c; ++ch)
        for (std::int64_t h = 0; h < c.h; ++h)
          for (std::int64_t w = 0; w < c.w; ++w)
            padded.at(n, ch, h + extra_h, w + extra_w) = x.at(n, ch, h, w);
    PoolGeometry g = c.geometry();
    g.pad_top = c.ph - extra_h;
    g.pad_left = c.pw - extra_w;
    g.image = {{extra_h, extra_h + c.h}, {extra_w, extra_w + c.w}};

    Tensor<T> y(ys), y_padded(ys), a(ys), a_padded(ys);
    std::vector<std::int64_t> arg(std::size_t(ys.numel())), arg_padded(arg.size());
    reference::maxpool2d_forward(x, y, std::span<std::int64_t>(arg), c.geometry());
    reference::maxpool2d_forward(padded, y_padded, std::span<std::int64_t>(arg_padded), g);
    reference::avgpool2d_forward(x, a, c.geometry());
    reference::avgpool2d_forward(padded, a_padded, g);
    ASSERT_TRUE(std::equal(y.span().begin(), y.span().end(), y_padded.span().begin())) << c.str();
    ASSERT_TRUE(std::equal(a.span().begin(), a.span().end(), a_padded.span().begin())) << c.str();
    // The argmax moves with the frame: (h, w) of x is (h + extra_h, w + extra_w) of padded.
    for (std::size_t k = 0; k < arg.size(); ++k) {
      const std::int64_t h = arg[k] / c.w, w = arg[k] % c.w;
      ASSERT_EQ(arg_padded[k], (h + extra_h) * padded.shape().w + w + extra_w) << c.str();
    }
    ++checked;
  }
  EXPECT_GT(checked, 200);
}

TEST(ReferenceMaxPool, ImageBoxActsAsPaddingDouble) {
  check_image_box_equals_padding<double>();
}
TEST(ReferenceMaxPool, ImageBoxActsAsPaddingFloat) {
  check_image_box_equals_padding<float>();
}

// PyTorch CPU: a strictly greater value or a NaN takes over from the running maximum, which
// starts at -inf on the window's first image position.
TEST(ReferenceMaxPool, TiesGoToTheFirstMaximumInRowMajorOrder) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  struct Tie {
    std::vector<double> window;  // 2 x 3, row-major
    std::int64_t expect;         // index into it
  };
  const Tie ties[] = {
      {{1, 5, 5, 5, 5, 5}, 1},                    // the first of five equal maxima
      {{1, 2, 3, 7, 7, 0}, 3},                    // a tie in the second row: its first
      {{7, 2, 3, 7, 0, 0}, 0},                    // the first row before the second
      {{0, 0, 0, 0, 0, 0}, 0},                    // all equal
      {{-inf, -inf, -inf, -inf, -inf, -inf}, 0},  // nothing beats -inf: the first position
      {{-inf, -inf, -3, -inf, -3, -inf}, 2},
      {{1, nan, 9, nan, 2, 3}, 3},           // NaN wins, the last NaN of the scan
      {{-0.0, 0.0, 0.0, 0.0, 0.0, 0.0}, 0},  // -0 == +0: a tie, not a larger value
  };
  for (const Tie& t : ties) {
    Tensor<double> x({1, 1, 2, 3});
    std::copy(t.window.begin(), t.window.end(), x.data());
    Tensor<double> y({1, 1, 1, 1});
    std::vector<std::int64_t> argmax(1, -1);
    reference::maxpool2d_forward(x, y, std::span<std::int64_t>(argmax),
                                 reference::pool_geometry(x.shape(), 2, 3, 1, 1, 0, 0));
    EXPECT_EQ(argmax[0], t.expect) << "window starting " << t.window[0] << ", " << t.window[1];
    const double want = t.window[std::size_t(t.expect)];
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(y.data()[0]));
    } else {
      EXPECT_EQ(y.data()[0], want);
    }
    // The whole gradient goes to the chosen one.
    Tensor<double> dy({1, 1, 1, 1}, 2.5), dx(x.shape(), nan);
    reference::maxpool2d_backward(dy, std::span<const std::int64_t>(argmax), dx);
    for (std::int64_t k = 0; k < 6; ++k)
      EXPECT_EQ(dx.data()[k], k == t.expect ? 2.5 : 0.0);
  }
}

// Overlapping windows (stride 1, kernel 3) on a constant image: each output takes its window's
// first image position, so the gradient lands on the top-left corners only, several times.
TEST(ReferenceMaxPool, TiesInOverlappingWindowsAccumulate) {
  Tensor<double> x({1, 1, 4, 4}, 3.0);
  Tensor<double> y({1, 1, 4, 4});
  std::vector<std::int64_t> argmax(16);
  reference::maxpool2d_forward(x, y, std::span<std::int64_t>(argmax),
                               reference::pool_geometry(x.shape(), 3, 3, 1, 1, 1, 1));
  for (std::int64_t oh = 0; oh < 4; ++oh)
    for (std::int64_t ow = 0; ow < 4; ++ow)
      EXPECT_EQ(argmax[std::size_t(oh * 4 + ow)],
                std::max<std::int64_t>(oh - 1, 0) * 4 + std::max<std::int64_t>(ow - 1, 0));
  Tensor<double> dy({1, 1, 4, 4}, 1.0), dx(x.shape());
  reference::maxpool2d_backward(dy, std::span<const std::int64_t>(argmax), dx);
  // Row (column) 0 is chosen by outputs 0 and 1, rows 1 and 2 by one output each, row 3 by none.
  const double per_axis[4] = {2, 1, 1, 0};
  for (std::int64_t h = 0; h < 4; ++h)
    for (std::int64_t w = 0; w < 4; ++w)
      EXPECT_EQ(dx.at(0, 0, h, w), per_axis[h] * per_axis[w]) << h << "," << w;
}

TEST(ReferenceMaxPool, WindowWhollyInThePaddingIsAnError) {
  Tensor<double> x({1, 1, 3, 3}), y({1, 1, 2, 2});
  std::vector<std::int64_t> argmax(4);
  // Pad 2 with kernel 2: the first window holds only padding (PyTorch forbids the padding).
  EXPECT_THROW(reference::maxpool2d_forward(x, y, std::span<std::int64_t>(argmax),
                                            reference::pool_geometry(x.shape(), 2, 2, 2, 2, 2, 2)),
               Error);
}

template <typename T>
void check_avgpool_against_definition() {
  int checked = 0;
  const double eps = std::numeric_limits<T>::epsilon();
  for (const PoolCase& c : pool_sweep()) {
    const Tensor<T> x = random_tensor<T>(c.x_shape(), 3);
    const Shape4 ys = c.y_shape();
    Tensor<T> y(ys, std::numeric_limits<T>::quiet_NaN());
    reference::avgpool2d_forward(x, y, c.geometry());
    for (std::int64_t n = 0; n < ys.n; ++n)
      for (std::int64_t ch = 0; ch < ys.c; ++ch)
        for (std::int64_t oh = 0; oh < ys.h; ++oh)
          for (std::int64_t ow = 0; ow < ys.w; ++ow) {
            const Window b = window_of(c, oh, ow);
            double sum = 0, mag = 0;
            for (std::int64_t h = b.h0; h < b.h1; ++h)
              for (std::int64_t w = b.w0; w < b.w1; ++w) {
                sum += double(x.at(n, ch, h, w));
                mag += std::abs(double(x.at(n, ch, h, w)));
              }
            // count_include_pad: the divisor is the kernel area, padding or not.
            const double want = sum / double(c.kh * c.kw);
            ASSERT_NEAR(double(y.at(n, ch, oh, ow)), want,
                        2 * double(c.kh * c.kw + 1) * eps * mag / double(c.kh * c.kw) + 1e-300)
                << c.str() << " at " << oh << "," << ow;
          }
    ++checked;
  }
  EXPECT_GT(checked, 200);
}

TEST(ReferenceAvgPool, ForwardMatchesTheDefinitionDouble) {
  check_avgpool_against_definition<double>();
}
TEST(ReferenceAvgPool, ForwardMatchesTheDefinitionFloat) {
  check_avgpool_against_definition<float>();
}

TEST(ReferenceAvgPool, PaddingCountsInTheDivisor) {
  Tensor<double> x({1, 1, 2, 2}, 1.0);
  Tensor<double> y({1, 1, 2, 2});
  reference::avgpool2d_forward(x, y, reference::pool_geometry(x.shape(), 2, 2, 2, 2, 1, 1));
  // Each window holds one image pixel and three padding zeros: 1 / 4.
  for (double v : y.span())
    EXPECT_EQ(v, 0.25);
}

// Central differences of L = <pool(x), r> with respect to every element of x.
template <typename Forward>
std::vector<double> central_differences(Tensor<double>& x, const Tensor<double>& r,
                                        Forward&& forward) {
  constexpr double step = 1e-3;
  std::vector<double> grad(static_cast<std::size_t>(x.numel()));
  Tensor<double> y(r.shape());
  for (std::size_t k = 0; k < grad.size(); ++k) {
    const double saved = x.data()[k];
    x.data()[k] = saved + step;
    forward(x, y);
    const double up = dot(y.span(), r.span());
    x.data()[k] = saved - step;
    forward(x, y);
    const double down = dot(y.span(), r.span());
    x.data()[k] = saved;
    grad[k] = (up - down) / (2 * step);
  }
  return grad;
}

TEST(ReferenceMaxPool, BackwardMatchesCentralFiniteDifferences) {
  int checked = 0;
  for (const PoolCase& c : pool_sweep()) {
    // Values 0.01 apart and a step of 0.001: the argmax of no window changes under the step.
    Tensor<double> x = distinct_tensor(c.x_shape(), 4);
    const Tensor<double> r = random_tensor<double>(c.y_shape(), 5);
    const PoolGeometry g = c.geometry();
    Tensor<double> y(c.y_shape());
    std::vector<std::int64_t> argmax(std::size_t(y.numel()));
    reference::maxpool2d_forward(x, y, std::span<std::int64_t>(argmax), g);
    Tensor<double> dx(c.x_shape(), std::numeric_limits<double>::quiet_NaN());
    reference::maxpool2d_backward(r, std::span<const std::int64_t>(argmax), dx);
    std::vector<std::int64_t> scratch(argmax.size());
    const std::vector<double> fd =
        central_differences(x, r, [&](const Tensor<double>& in, Tensor<double>& out) {
          reference::maxpool2d_forward(in, out, std::span<std::int64_t>(scratch), g);
        });
    EXPECT_LT(rel_error(dx.span(), fd), 1e-9) << c.str();
    ++checked;
  }
  EXPECT_GT(checked, 200);
}

TEST(ReferenceAvgPool, BackwardMatchesCentralFiniteDifferences) {
  int checked = 0;
  for (const PoolCase& c : pool_sweep()) {
    Tensor<double> x = random_tensor<double>(c.x_shape(), 6);
    const Tensor<double> r = random_tensor<double>(c.y_shape(), 7);
    const PoolGeometry g = c.geometry();
    Tensor<double> dx(c.x_shape(), std::numeric_limits<double>::quiet_NaN());
    reference::avgpool2d_backward(r, dx, g);
    const std::vector<double> fd =
        central_differences(x, r, [&](const Tensor<double>& in, Tensor<double>& out) {
          reference::avgpool2d_forward(in, out, g);
        });
    ASSERT_TRUE(std::any_of(dx.span().begin(), dx.span().end(), [](double v) { return v != 0; }))
        << c.str();
    EXPECT_LT(rel_error(dx.span(), fd), 1e-9) << c.str();
    ++checked;
  }
  EXPECT_GT(checked, 200);
}

// ---- nearest upsampling ----

template <typename T>
void check_upsample_against_definition() {
  for (std::int64_t sh : {1, 2, 3})
    for (std::int64_t sw : {1, 2, 3, 4}) {
      const Shape4 xs{2, 3, 5, 4};
      const Tensor<T> x = random_tensor<T>(xs, 8);
      const Shape4 ys{xs.n, xs.c, xs.h * sh, xs.w * sw};
      Tensor<T> y(ys, std::numeric_limits<T>::quiet_NaN());
      reference::upsample_nearest_forward(x, y, UpsampleGeometry{.scale_h = sh, .scale_w = sw});
      for (std::int64_t n = 0; n < ys.n; ++n)
        for (std::int64_t c = 0; c < ys.c; ++c)
          for (std::int64_t q = 0; q < ys.h; ++q)
            for (std::int64_t p = 0; p < ys.w; ++p)
              ASSERT_EQ(y.at(n, c, q, p), x.at(n, c, q / sh, p / sw))
                  << "scale " << sh << "x" << sw << " at " << q << "," << p;
    }
}

TEST(ReferenceUpsample, ForwardMatchesTheDefinitionDouble) {
  check_upsample_against_definition<double>();
}
TEST(ReferenceUpsample, ForwardMatchesTheDefinitionFloat) {
  check_upsample_against_definition<float>();
}

// A tile of output rows [qb, qe) x columns [pb, pe), computed from the input window
// [qb / s, (qe - 1) / s + 1) x ... with phase qb mod s, equals that part of the whole output.
TEST(ReferenceUpsample, TileFromItsWindowWithPhaseMatchesTheWhole) {
  const Shape4 xs{1, 2, 7, 6};
  const Tensor<double> x = random_tensor<double>(xs, 9);
  for (std::int64_t s : {1, 2, 3}) {
    const Shape4 ys{xs.n, xs.c, xs.h * s, xs.w * s};
    Tensor<double> whole(ys);
    reference::upsample_nearest_forward(x, whole, UpsampleGeometry{.scale_h = s, .scale_w = s});
    for (std::int64_t qb = 0; qb < ys.h; ++qb)
      for (std::int64_t qe = qb + 1; qe <= ys.h; qe += 2) {
        const std::int64_t pb = (qb * 5) % ys.w, pe = std::min(ys.w, pb + 1 + qe % 4);
        const std::int64_t ib = qb / s, ie = (qe - 1) / s + 1;
        const std::int64_t jb = pb / s, je = (pe - 1) / s + 1;
        Tensor<double> window({xs.n, xs.c, ie - ib, je - jb});
        for (std::int64_t c = 0; c < xs.c; ++c)
          for (std::int64_t i = ib; i < ie; ++i)
            for (std::int64_t j = jb; j < je; ++j)
              window.at(0, c, i - ib, j - jb) = x.at(0, c, i, j);
        Tensor<double> tile({xs.n, xs.c, qe - qb, pe - pb});
        const UpsampleGeometry g{.scale_h = s, .scale_w = s, .phase_h = qb % s, .phase_w = pb % s};
        reference::upsample_nearest_forward(window, tile, g);
        for (std::int64_t c = 0; c < xs.c; ++c)
          for (std::int64_t q = qb; q < qe; ++q)
            for (std::int64_t p = pb; p < pe; ++p)
              ASSERT_EQ(tile.at(0, c, q - qb, p - pb), whole.at(0, c, q, p))
                  << "scale " << s << " tile rows [" << qb << ", " << qe << ") at " << q << ","
                  << p;
        // The window is exactly what the tile reads: one row or column fewer would not do.
        if (ie - ib > 1) {
          Tensor<double> short_window({xs.n, xs.c, ie - ib - 1, je - jb});
          EXPECT_THROW(reference::upsample_nearest_forward(short_window, tile, g), Error);
        }
      }
  }
}

TEST(ReferenceUpsample, BackwardSumsEachBlockAndMatchesFiniteDifferences) {
  for (std::int64_t s : {1, 2, 3}) {
    const Shape4 xs{2, 2, 4, 5};
    const Shape4 ys{xs.n, xs.c, xs.h * s, xs.w * s};
    Tensor<double> x = random_tensor<double>(xs, 10);
    const Tensor<double> r = random_tensor<double>(ys, 11);
    const UpsampleGeometry g{.scale_h = s, .scale_w = s};
    Tensor<double> dx(xs, std::numeric_limits<double>::quiet_NaN());
    reference::upsample_nearest_backward(r, dx, g);
    // The definition: input (i, j) gets the sum of its s x s block of output gradients.
    for (std::int64_t n = 0; n < xs.n; ++n)
      for (std::int64_t c = 0; c < xs.c; ++c)
        for (std::int64_t i = 0; i < xs.h; ++i)
          for (std::int64_t j = 0; j < xs.w; ++j) {
            double sum = 0;
            for (std::int64_t a = 0; a < s; ++a)
              for (std::int64_t b = 0; b < s; ++b)
                sum += r.at(n, c, i * s + a, j * s + b);
            ASSERT_NEAR(dx.at(n, c, i, j), sum, 1e-14) << "scale " << s;
          }
    const std::vector<double> fd =
        central_differences(x, r, [&](const Tensor<double>& in, Tensor<double>& out) {
          reference::upsample_nearest_forward(in, out, g);
        });
    EXPECT_LT(rel_error(dx.span(), fd), 1e-9) << "scale " << s;
  }
}

// With a phase, the first (partial) block of the window has fewer outputs than s x s.
TEST(ReferenceUpsample, BackwardWithPhaseCountsPartialBlocks) {
  // Scale 3, phase 2: output rows 0 .. 4 read window rows 0, 1, 1, 1, 2.
  Tensor<double> dy({1, 1, 5, 5}, 1.0), dx({1, 1, 3, 3});
  reference::upsample_nearest_backward(
      dy, dx, UpsampleGeometry{.scale_h = 3, .scale_w = 3, .phase_h = 2, .phase_w = 2});
  const double per_axis[3] = {1, 3, 1};
  for (std::int64_t i = 0; i < 3; ++i)
    for (std::int64_t j = 0; j < 3; ++j)
      EXPECT_EQ(dx.at(0, 0, i, j), per_axis[i] * per_axis[j]) << i << "," << j;
}

// The GPU gathers each input's gradient from the outputs whose windows hold it
// (kernels/cuda/layers.cu): the ranges it loops over must be exactly those outputs, in order.
TEST(WindowArithmetic, GatherRangesAreTheOutputsThatReadEachInput) {
  for (std::int64_t kernel = 1; kernel <= 4; ++kernel)
    for (std::int64_t stride = 1; stride <= 4; ++stride)
      for (std::int64_t pad = 0; pad <= 2; ++pad)
        for (std::int64_t count = 1; count <= 6; ++count)
          for (std::int64_t i = -1; i < count * stride + kernel; ++i) {
            std::int64_t first = -1, last = -1;
            for (std::int64_t o = 0; o < count; ++o) {
              const std::int64_t b = o * stride - pad;
              if (i >= b && i < b + kernel) {
                if (first < 0) first = o;
                last = o + 1;
              }
            }
            const elementwise::Span1 r = elementwise::covering(i, stride, pad, kernel, count);
            if (first < 0) {
              EXPECT_GE(r.begin, r.end) << kernel << " " << stride << " " << pad << " " << i;
            } else {
              EXPECT_EQ(r.begin, first) << kernel << " " << stride << " " << pad << " " << i;
              EXPECT_EQ(r.end, last) << kernel << " " << stride << " " << pad << " " << i;
            }
          }
  for (std::int64_t scale = 1; scale <= 4; ++scale)
    for (std::int64_t phase = 0; phase < scale; ++phase)
      for (std::int64_t count = 1; count <= 9; ++count)
        for (std::int64_t i = 0; i * scale - phase < count; ++i) {
          std::int64_t first = -1, last = -1;
          for (std::int64_t q = 0; q < count; ++q)
            if (elementwise::upsample_source(q, scale, phase) == i) {
              if (first < 0) first = q;
              last = q + 1;
            }
          const elementwise::Span1 r = elementwise::upsample_readers(i, scale, phase, count);
          EXPECT_EQ(r.begin, first) << scale << " " << phase << " " << i;
          EXPECT_EQ(r.end, last) << scale << " " << phase << " " << i;
        }
}

}  // namespace
}  // namespace tessera
