// The oneDNN pooling kernel against the reference: max pooling bit for bit (ties everywhere: data
// of three values), average pooling to float rounding; NCHW and nchw16c; windows whose image part
// is smaller than the window (the padding holds the kernel's window_padding()); NaN and infinities
// (the reference runs); the cases it declines. Single process.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/pool_kernel.hpp"
#include "tessera/layers/pool2d.hpp"
#include "tessera/process_grid.hpp"
#include "tessera/random.hpp"
#include "tessera_config.h"

#include "unit_test.hpp"
#if TESSERA_HAVE_ONEDNN
#include "tessera/kernels/onednn_pool.hpp"
#endif

namespace tessera {
namespace {

using reference::PoolGeometry;

constexpr std::uint64_t kSeed = 20261122;

TEST(PoolKernel, Float64AndReferenceBackendUseTheReference) {
  const PoolGeometry g = reference::pool_geometry({1, 2, 6, 6}, 2, 2, 2, 2, 0, 0);
  for (KernelBackend b : test::built_backends()) {
    const Backend& backend = backend_of(b);
    EXPECT_EQ(
        backend.pool<double>(PoolKind::max, {.x = {1, 2, 6, 6}, .y = {1, 2, 3, 3}}, g)->name(),
        "reference");
    // The reference takes no nchw16c.
    EXPECT_EQ(
        backend.pool<double>(
            PoolKind::max, {.x = {1, 16, 6, 6}, .y = {1, 16, 3, 3}, .layout = Layout::nchw16c}, g),
        nullptr);
  }
  const Backend& reference = backend_of(KernelBackend::reference);
  EXPECT_EQ(reference.pool<float>(PoolKind::avg, {.x = {1, 2, 6, 6}, .y = {1, 2, 3, 3}}, g)->name(),
            "reference");
}

#if TESSERA_HAVE_ONEDNN

struct PoolCase {
  PoolKind kind;
  std::int64_t n, c, kernel, stride;
  std::int64_t out_h, out_w;
  std::int64_t margin;    // window rows / columns outside the image at the top and left, and
                          // one fewer at the bottom and right
  std::int64_t trailing;  // unread window rows and columns past the last output's, < stride
  Layout layout;

  Shape4 x() const {
    return {n, c, (out_h - 1) * stride + kernel + trailing,
            (out_w - 1) * stride + kernel + trailing};
  }
  Shape4 y() const { return {n, c, out_h, out_w}; }
  PoolGeometry geometry() const {
    const Shape4 s = x();
    const std::int64_t end = margin > 0 ? margin - 1 : 0;
    return {.kernel_h = kernel,
            .kernel_w = kernel,
            .stride_h = stride,
            .stride_w = stride,
            .pad_top = 0,
            .pad_left = 0,
            .image = {{margin, s.h - end}, {margin, s.w - end}}};
  }
  PoolShapes shapes() const { return {.x = x(), .y = y(), .layout = layout}; }
  std::string str() const {
    return std::string(kind == PoolKind::max ? "max" : "avg") + " n" + std::to_string(n) + " c" +
           std::to_string(c) + " k" + std::to_string(kernel) + " s" + std::to_string(stride) +
           " margin " + std::to_string(margin) + " trailing " + std::to_string(trailing) + " " +
           to_string(layout) + " x" + x().str();
  }
};

std::vector<PoolCase> sweep() {
  std::vector<PoolCase> out;
  std::int64_t i = 0;
  for (PoolKind kind : {PoolKind::max, PoolKind::avg})
    for (std::int64_t k : {1, 2, 3, 4})
      for (std::int64_t s : {1, 2, 3})
        for (Layout layout : {Layout::nchw, Layout::nchw16c, Layout::nchw8c})
          for (std::int64_t margin = 0; margin <= k / 2; ++margin, ++i)
            out.push_back({.kind = kind,
                           .n = 1 + i % 2,
                           .c = layout == Layout::nchw16c  ? 16 * (1 + i % 2)
                                : layout == Layout::nchw8c ? 8 * (1 + i % 3)
                                                           : 1 + i % 5,
                           .kernel = k,
                           .stride = s,
                           .out_h = 3 + i % 4,
                           .out_w = 5 + i % 3,
                           .margin = margin,
                           .trailing = i % s,
                           .layout = layout});
  return out;
}

// NCHW data of values -2, -1, 0 (most windows hold several maxima) or, with `distinct`, uniform in
// [-1, 1); the window padding outside the image.
Tensor<float> window_data(const PoolCase& c, float padding, bool distinct, std::uint64_t stream) {
  const Shape4 s = c.x();
  const Box image = c.geometry().image;
  Tensor<float> t(s);
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t ch = 0; ch < s.c; ++ch)
      for (std::int64_t h = 0; h < s.h; ++h)
        for (std::int64_t w = 0; w < s.w; ++w) {
          const auto k = static_cast<std::uint64_t>(t.offset(n, ch, h, w));
          const float v = distinct ? static_cast<float>(2 * uniform01(kSeed, stream, k) - 1)
                                   : static_cast<float>(int(uniform01(kSeed, stream, k) * 3) - 2);
          t.at(n, ch, h, w) = image.h.contains(h) && image.w.contains(w) ? v : padding;
        }
  return t;
}

Tensor<float> gradient_data(const Shape4& s, std::uint64_t stream) {
  Tensor<float> t(s);
  for (std::int64_t k = 0; k < t.numel(); ++k)
    t.data()[k] = static_cast<float>(int(uniform01(kSeed, stream, std::uint64_t(k)) * 7) + 1);
  return t;
}

struct Result {
  Tensor<float> y, dx;  // NCHW
};

// Runs `kernel` on NCHW data (converted to the case's layout and back); dx starts as NaN so that
// anything the backward leaves unwritten shows. dx outside the image is set to 0, as the
// reference writes it: the kernels' contract leaves it open (the exchange drops it).
Result run(PoolKernel<float>& kernel, const PoolCase& c, const Tensor<float>& x,
           const Tensor<float>& dy) {
  const Layout l = c.layout;
  Tensor<float> y(c.y(), l, std::numeric_limits<float>::quiet_NaN());
  Tensor<float> dx(c.x(), l, std::numeric_limits<float>::quiet_NaN());
  kernel.forward(to_layout(x, l), y);
  kernel.backward(to_layout(dy, l), dx);
  // In the layout planned, whichever path computed them (the reference fallback included).
  EXPECT_EQ(y.layout(), l) << c.str();
  EXPECT_EQ(dx.layout(), l) << c.str();
  Result r{to_layout(y, Layout::nchw), to_layout(dx, Layout::nchw)};
  const Box image = c.geometry().image;
  const Shape4 s = c.x();
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t ch = 0; ch < s.c; ++ch)
      for (std::int64_t h = 0; h < s.h; ++h)
        for (std::int64_t w = 0; w < s.w; ++w)
          if (!image.h.contains(h) || !image.w.contains(w)) r.dx.at(n, ch, h, w) = 0;
  return r;
}

// The reference's results; it reads NCHW and ignores the padding.
Result reference_result(const PoolCase& c, const Tensor<float>& x, const Tensor<float>& dy) {
  ReferencePool<float> ref(c.kind, c.geometry());
  Result r{Tensor<float>(c.y()), Tensor<float>(c.x())};
  ref.forward(x, r.y);
  ref.backward(dy, r.dx);
  return r;
}

// Bit for bit (NaN equal to NaN), or within `tolerance` of the largest reference magnitude.
int mismatches(const Tensor<float>& got, const Tensor<float>& want, double tolerance) {
  double scale = 0;
  for (float v : want.span())
    if (std::isfinite(v)) scale = std::max(scale, double(std::abs(v)));
  int wrong = 0;
  for (std::int64_t k = 0; k < got.numel(); ++k) {
    const float a = got.data()[k], b = want.data()[k];
    if (std::isnan(a) && std::isnan(b)) continue;
    if (tolerance == 0 ? !(a == b && std::signbit(a) == std::signbit(b))
                       : !(std::abs(double(a) - double(b)) <= tolerance * scale))
      ++wrong;
  }
  return wrong;
}

TEST(OneDnnPool, MatchesTheReferenceTiesAndPaddingIncluded) {
  int blocked = 0, planned_blocked = 0;
  for (const PoolCase& c : sweep()) {
    std::unique_ptr<OneDnnPool> k = OneDnnPool::create(c.kind, c.shapes(), c.geometry());
    blocked += c.layout == Layout::nchw16c;
    // NCHW gets only oneDNN's plain-loop implementations on some machines: declined there.
    if (!k) {
      std::cout << "  declined: " << c.str() << "\n";
      continue;
    }
    planned_blocked += c.layout == Layout::nchw16c;
    EXPECT_EQ(k->window_padding(),
              c.kind == PoolKind::max ? -std::numeric_limits<float>::infinity() : 0.0f);
    for (bool distinct : {false, true}) {
      const Tensor<float> x = window_data(c, k->window_padding(), distinct, 1);
      const Tensor<float> dy = gradient_data(c.y(), 2);
      const Result got = run(*k, c, x, dy);
      EXPECT_FALSE(k->last_forward_was_reference()) << c.str();
      const Result want = reference_result(c, x, dy);
      // Max: the same element of each window, so the same values and gradients bit for bit.
      // Average: sums in another order.
      const double tolerance = c.kind == PoolKind::max ? 0 : 1e-6;
      EXPECT_EQ(mismatches(got.y, want.y, tolerance), 0)
          << k->name() << " forward, " << c.str() << (distinct ? " distinct" : " ties");
      EXPECT_EQ(mismatches(got.dx, want.dx, tolerance), 0)
          << k->name() << " backward, " << c.str() << (distinct ? " distinct" : " ties");
    }
  }
  EXPECT_EQ(planned_blocked, blocked) << "every nchw16c case has a JIT implementation";
}

// NaN, infinities and the lowest float follow the reference's rules (a NaN wins, a window of
// -infinity gives -infinity, a window of the lowest float sends its gradient to its first image
// position): the kernel runs the reference for that forward and its backward, and oneDNN again
// once the data are ordinary.
TEST(OneDnnPool, NonFiniteInputsGiveTheReferenceResults) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (PoolKind kind : {PoolKind::max, PoolKind::avg})
    for (Layout layout : {Layout::nchw16c, Layout::nchw8c, Layout::nchw}) {
      const PoolCase c{.kind = kind,
                       .n = 1,
                       .c = 16,
                       .kernel = 3,
                       .stride = 2,
                       .out_h = 4,
                       .out_w = 4,
                       .margin = 1,
                       .trailing = 0,
                       .layout = layout};
      std::unique_ptr<OneDnnPool> k = OneDnnPool::create(kind, c.shapes(), c.geometry());
      if (!k && layout == Layout::nchw) continue;  // declined (no JIT implementation)
      ASSERT_NE(k, nullptr) << c.str();
      const Tensor<float> dy = gradient_data(c.y(), 2);
      for (float bad : {nan, inf, -inf}) {
        Tensor<float> x = window_data(c, k->window_padding(), false, 1);
        x.at(0, 3, 2, 2) = bad;
        // A window wholly -inf in another channel (its image part only).
        for (std::int64_t h = 1; h < 4; ++h)
          for (std::int64_t w = 1; w < 4; ++w)
            x.at(0, 5, h, w) = -inf;
        const Result got = run(*k, c, x, dy);
        EXPECT_TRUE(k->last_forward_was_reference()) << c.str();
        const Result want = reference_result(c, x, dy);
        EXPECT_EQ(mismatches(got.y, want.y, 0), 0) << "forward with " << bad << ", " << c.str();
        EXPECT_EQ(mismatches(got.dx, want.dx, 0), 0) << "backward with " << bad << ", " << c.str();
      }
      {
        // A border window (its first row and column padding) whose image part is all the lowest
        // float: the reference sends the gradient to its first image position.
        Tensor<float> x = window_data(c, k->window_padding(), false, 1);
        for (std::int64_t h = 1; h < 3; ++h)
          for (std::int64_t w = 1; w < 3; ++w)
            x.at(0, 7, h, w) = std::numeric_limits<float>::lowest();
        const Result got = run(*k, c, x, dy);
        EXPECT_TRUE(k->last_forward_was_reference()) << c.str();
        const Result want = reference_result(c, x, dy);
        EXPECT_EQ(mismatches(got.y, want.y, 0), 0) << "forward with -FLT_MAX, " << c.str();
        EXPECT_EQ(mismatches(got.dx, want.dx, 0), 0) << "backward with -FLT_MAX, " << c.str();
      }
      if (kind == PoolKind::max) {
        Tensor<float> x = window_data(c, k->window_padding(), false, 1);
        x.at(0, 3, 2, 2) = nan;
        const Result got = run(*k, c, x, dy);
        EXPECT_TRUE(std::isnan(got.y.at(0, 3, 0, 0))) << "a NaN wins its window, " << c.str();
      }
      const Tensor<float> x = window_data(c, k->window_padding(), true, 3);
      run(*k, c, x, dy);
      EXPECT_FALSE(k->last_forward_was_reference()) << c.str();
    }
}

TEST(OneDnnPool, DeclinesWhatItCannotExpress) {
  const PoolCase base{.kind = PoolKind::max,
                      .n = 1,
                      .c = 16,
                      .kernel = 2,
                      .stride = 2,
                      .out_h = 3,
                      .out_w = 3,
                      .margin = 0,
                      .trailing = 1,
                      .layout = Layout::nchw16c};
  EXPECT_NE(OneDnnPool::create(base.kind, base.shapes(), base.geometry()), nullptr);
  // Padding in the geometry (windows have none).
  PoolGeometry padded = base.geometry();
  padded.pad_top = 1;
  EXPECT_EQ(OneDnnPool::create(base.kind, base.shapes(), padded), nullptr);
  // A whole stride of unread rows: oneDNN would see one more output.
  PoolShapes tall = base.shapes();
  tall.x.h += 1;
  EXPECT_EQ(OneDnnPool::create(base.kind, tall, base.geometry()), nullptr);
  // An image box past the window's edge.
  PoolGeometry wide = base.geometry();
  wide.image.w.end += 1;
  EXPECT_EQ(OneDnnPool::create(base.kind, base.shapes(), wide), nullptr);
  // nchw16c with 4 channels.
  PoolShapes few = base.shapes();
  few.x.c = few.y.c = 4;
  EXPECT_EQ(OneDnnPool::create(base.kind, few, base.geometry()), nullptr);
  // Wrong shapes at run time are refused.
  std::unique_ptr<OneDnnPool> k = OneDnnPool::create(base.kind, base.shapes(), base.geometry());
  Tensor<float> y(base.y());
  EXPECT_THROW(k->forward(Tensor<float>({1, 16, 5, 5}), y), Error);
}

TEST(OneDnnPool, IsWhatTheFactoryGivesForFloat32) {
  const Backend& onednn = backend_of(KernelBackend::onednn);
  const PoolGeometry g = reference::pool_geometry({1, 16, 6, 6}, 2, 2, 2, 2, 0, 0);
  auto k = onednn.pool<float>(
      PoolKind::avg, {.x = {1, 16, 6, 6}, .y = {1, 16, 3, 3}, .layout = Layout::nchw16c}, g);
  ASSERT_NE(k, nullptr);
  EXPECT_TRUE(k->name().starts_with("onednn")) << k->name();
  // NCHW: oneDNN's when it has a JIT implementation, else the reference; never none.
  EXPECT_NE(onednn.pool<float>(PoolKind::avg, {.x = {1, 16, 6, 6}, .y = {1, 16, 3, 3}}, g),
            nullptr);
}

// The layer plans its kernel at bind: oneDNN on nchw16c where the model lets its output go on
// blocked (16 channels), the reference for float64.
TEST(OneDnnPool, Pool2dPlansItsKernelAtBind) {
  const Runtime& single = test::single_runtime(KernelBackend::onednn);
  const Distribution in{{2, 16, 17, 15}, single.comm().shape(), single.comm().coords()};
  LayerSpec spec;
  spec.name = "p";
  spec.type = "maxpool2d";
  spec.fields = {{"kernel", 3}, {"stride", 2}, {"padding", 1}};
  spec.where = "layer 'p' (maxpool2d)";
  Pool2d<float> f("p", parse_pool2d(spec), 1);
  f.setup(in);
  EXPECT_EQ(f.kernel_name(), "none");
  f.allow_blocked_output(true);
  f.bind(single);
  EXPECT_TRUE(f.kernel_name().starts_with("onednn")) << f.kernel_name();
  Pool2d<double> d("p", parse_pool2d(spec), 1);
  d.setup(in);
  d.allow_blocked_output(true);
  d.bind(single);
  EXPECT_EQ(d.kernel_name(), "reference");
}

#else

TEST(OneDnnPool, NotBuilt) {
  GTEST_SKIP() << "built without oneDNN (libdnnl)";
}

#endif

}  // namespace
}  // namespace tessera
