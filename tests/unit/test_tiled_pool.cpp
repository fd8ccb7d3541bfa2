// The tiled max-pooling kernel (windows that tile the image) against the reference, bit for bit:
// ties everywhere, NaN, infinities, signed zeros in the gradient, trailing rows and columns under
// no window, every kernel shape it takes; the cases it declines; and that the oneDNN backend
// hands it out for NCHW pooling by 2. Single process.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/pool_kernel.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/layers/pool2d.hpp"
#include "tessera/random.hpp"
#include "tessera_config.h"

#include "../common/test_helpers.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

using reference::PoolGeometry;

constexpr std::uint64_t kSeed = 20261125;

struct TiledCase {
  std::int64_t n, c, kh, kw, out_h, out_w;
  std::int64_t trailing_h = 0, trailing_w = 0;  // rows / columns after the last window's
  Layout layout = Layout::nchw;

  Shape4 x() const { return {n, c, out_h * kh + trailing_h, out_w * kw + trailing_w}; }
  Shape4 y() const { return {n, c, out_h, out_w}; }
  PoolGeometry geometry() const {
    const Shape4 s = x();
    return reference::pool_geometry(s, kh, kw, kh, kw, 0, 0);
  }
  PoolShapes shapes() const { return {.x = x(), .y = y(), .layout = layout}; }
  std::string str() const {
    return "kernel " + std::to_string(kh) + "x" + std::to_string(kw) + " x" + x().str() + " in " +
           to_string(layout);
  }
};

// Values of -1, 0, 1 (most windows hold several maxima), with `special` at every 7th element.
template <typename T>
Tensor<T> tie_data(const Shape4& s, std::uint64_t stream, T special) {
  Tensor<T> t(s);
  for (std::int64_t k = 0; k < t.numel(); ++k)
    t.data()[k] = k % 7 == 3 ? special : T(int(uniform01(kSeed, stream, std::uint64_t(k)) * 3) - 1);
  return t;
}

// Bit for bit: the same value and sign, NaN equal to NaN.
template <typename T>
std::int64_t mismatches(const Tensor<T>& got, const Tensor<T>& want) {
  std::int64_t wrong = 0;
  for (std::int64_t k = 0; k < want.numel(); ++k) {
    const T a = got.data()[k], b = want.data()[k];
    if (std::isnan(a) && std::isnan(b)) continue;
    wrong += !(a == b && std::signbit(a) == std::signbit(b));
  }
  return wrong;
}

template <typename T>
void expect_reference_results(const TiledCase& c, T special) {
  std::unique_ptr<TiledMaxPool<T>> tiled =
      TiledMaxPool<T>::create(PoolKind::max, c.shapes(), c.geometry());
  ASSERT_NE(tiled, nullptr) << c.str();
  ReferencePool<T> reference(PoolKind::max, c.geometry());
  const Tensor<T> x = tie_data<T>(c.x(), 1, special);
  // Gradients with signed zeros: the reference sums into zeros, so -0 comes back as +0.
  Tensor<T> dy = tie_data<T>(c.y(), 2, T(-0.0));
  const T nan = std::numeric_limits<T>::quiet_NaN();
  // In a blocked layout: the same values, converted (a last block's padding channels zeros).
  const Tensor<T> xl = to_layout(x, c.layout), dyl = to_layout(dy, c.layout);
  Tensor<T> y(c.y(), c.layout, nan), dx(c.x(), c.layout, nan), want_y(c.y()), want_dx(c.x());
  for (int pass = 0; pass < 2; ++pass) {  // again into buffers holding the last results
    tiled->forward(xl, y);
    tiled->backward(dyl, dx);
    reference.forward(x, want_y);
    reference.backward(dy, want_dx);
    EXPECT_EQ(mismatches(to_layout(y, Layout::nchw), want_y), 0)
        << "forward, " << c.str() << ", special " << special;
    EXPECT_EQ(mismatches(to_layout(dx, Layout::nchw), want_dx), 0)
        << "backward, " << c.str() << ", special " << special;
  }
}

TEST(TiledMaxPool, GivesTheReferenceResultsBitForBit) {
  const double inf = std::numeric_limits<double>::infinity();
  std::int64_t i = 0;
  for (std::int64_t kh : {1, 2, 3})
    for (std::int64_t kw : {1, 2, 4})
      for (double special : {0.0, std::numeric_limits<double>::quiet_NaN(), inf, -inf, 1e30}) {
        ++i;
        const TiledCase c{.n = 1 + i % 2,
                          .c = 1 + i % 3,
                          .kh = kh,
                          .kw = kw,
                          .out_h = 3 + i % 4,
                          .out_w = 5 + i % 9,
                          .trailing_h = i % kh,
                          .trailing_w = (i + 1) % kw};
        expect_reference_results<float>(c, static_cast<float>(special));
        expect_reference_results<double>(c, special);
      }
}

TEST(TiledMaxPool, GivesTheReferenceResultsAtEverySimdLevelWithAndWithoutStreaming) {
  // 2x2 windows in rows of 16 and more (AVX-512 takes 16 windows at a time, forward and
  // backward; 37 leaves 5 over),
  // rows of an even and an odd width (the second row of a band then not 64-byte aligned).
  test::at_every_simd_level_streaming_or_not([] {
    for (const TiledCase& c :
         {TiledCase{.n = 2, .c = 3, .kh = 2, .kw = 2, .out_h = 5, .out_w = 32},
          TiledCase{.n = 1, .c = 2, .kh = 2, .kw = 2, .out_h = 4, .out_w = 37, .trailing_w = 1},
          TiledCase{.n = 1, .c = 1, .kh = 2, .kw = 2, .out_h = 3, .out_w = 16, .trailing_h = 1}})
      for (double special :
           {std::numeric_limits<double>::quiet_NaN(), -0.0, std::numeric_limits<double>::infinity(),
            -std::numeric_limits<double>::infinity()}) {
        expect_reference_results<float>(c, static_cast<float>(special));
        expect_reference_results<double>(c, special);
      }
  });
}

// nchw8c and nchw16c, each channel of a block pooled on its own (the padding channels of a last
// partial block too), 2x2 windows (AVX-512 for 16-channel blocks of float) and others, at both
// SIMD levels, streaming or not: the reference's results bit for bit.
TEST(TiledMaxPool, BlockedLayoutsGiveTheReferenceResultsBitForBit) {
  std::int64_t i = 0;
  test::at_every_simd_level_streaming_or_not([&] {
    for (const Layout layout : {Layout::nchw8c, Layout::nchw16c})
      for (std::int64_t channels : {3, 16, 20})
        for (const auto& [kh, kw] : {std::pair{2, 2}, std::pair{3, 2}, std::pair{1, 3}})
          for (double special : {std::numeric_limits<double>::quiet_NaN(), -0.0,
                                 -std::numeric_limits<double>::infinity()}) {
            ++i;
            const TiledCase c{.n = 1 + i % 2,
                              .c = channels,
                              .kh = kh,
                              .kw = kw,
                              .out_h = 2 + i % 3,
                              .out_w = 3 + i % 5,
                              .trailing_h = i % 2,
                              .trailing_w = (i / 2) % 2,
                              .layout = layout};
            expect_reference_results<float>(c, static_cast<float>(special));
            expect_reference_results<double>(c, special);
          }
  });
}

// backward_add (a U-Net's skip connection: the pooled tensor's gradient from its other consumer
// is there already) gives, bit for bit, that gradient plus what backward writes, as adding the
// tensors would: 2x2 windows in NCHW (AVX-512: 16 windows at a time, and the rest) and in
// channel blocks, trailing rows and columns under no window (+ 0: -0 becomes +0), signed zeros,
// NaN and infinities in both gradients, at every SIMD level, streaming or not (adding never
// streams). Other windows: declined, dx untouched.
template <typename T>
void expect_backward_add(const TiledCase& c, T special) {
  std::unique_ptr<TiledMaxPool<T>> tiled =
      TiledMaxPool<T>::create(PoolKind::max, c.shapes(), c.geometry());
  ASSERT_NE(tiled, nullptr) << c.str();
  const Tensor<T> x = to_layout(tie_data<T>(c.x(), 1, special), c.layout);
  const Tensor<T> dy = to_layout(tie_data<T>(c.y(), 2, T(-0.0)), c.layout);
  const Tensor<T> held = to_layout(tie_data<T>(c.x(), 3, special), c.layout);
  Tensor<T> y(c.y(), c.layout, T(0)), dx(c.x(), c.layout, T(0));
  tiled->forward(x, y);
  tiled->backward(dy, dx);
  Tensor<T> want = held;
  for (std::size_t k = 0; k < want.size(); ++k)
    want.data()[k] += dx.data()[k];
  Tensor<T> got = held;
  ASSERT_TRUE(tiled->backward_add(dy, got)) << c.str();
  EXPECT_EQ(mismatches(to_layout(got, Layout::nchw), to_layout(want, Layout::nchw)), 0)
      << c.str() << ", special " << special;
}

TEST(TiledMaxPool, BackwardAddsIntoAGradientBitForBit) {
  const double nan = std::numeric_limits<double>::quiet_NaN(),
               inf = std::numeric_limits<double>::infinity();
  test::at_every_simd_level_streaming_or_not([&] {
    std::int64_t i = 0;
    for (const Layout layout : {Layout::nchw, Layout::nchw8c, Layout::nchw16c})
      for (std::int64_t out_w : {16, 37})
        for (double special : {nan, -0.0, inf, -inf}) {
          ++i;
          const TiledCase c{.n = 1 + i % 2,
                            .c = layout == Layout::nchw ? 3 : 20,
                            .kh = 2,
                            .kw = 2,
                            .out_h = 3 + i % 3,
                            .out_w = out_w,
                            .trailing_h = i % 2,
                            .trailing_w = (i / 2) % 2,
                            .layout = layout};
          expect_backward_add<float>(c, static_cast<float>(special));
          expect_backward_add<double>(c, special);
        }
  });
  const TiledCase three{.n = 1, .c = 2, .kh = 3, .kw = 3, .out_h = 2, .out_w = 3};
  std::unique_ptr<TiledMaxPool<float>> k =
      TiledMaxPool<float>::create(PoolKind::max, three.shapes(), three.geometry());
  ASSERT_NE(k, nullptr);
  Tensor<float> x = tie_data<float>(three.x(), 1, 0.0f), y(three.y()), dy(three.y(), 1.0f);
  k->forward(x, y);
  Tensor<float> dx(three.x(), 5.0f);
  EXPECT_FALSE(k->backward_add(dy, dx));
  EXPECT_EQ(mismatches(dx, Tensor<float>(three.x(), 5.0f)), 0);
}

TEST(TiledMaxPool, DeclinesWindowsThatDoNotTileTheImage) {
  const TiledCase base{.n = 1, .c = 2, .kh = 2, .kw = 2, .out_h = 4, .out_w = 4};
  EXPECT_NE(TiledMaxPool<float>::create(PoolKind::max, base.shapes(), base.geometry()), nullptr);
  EXPECT_EQ(TiledMaxPool<float>::create(PoolKind::avg, base.shapes(), base.geometry()), nullptr);
  // Overlapping windows (3x3, stride 2) and gaps between them (2x2, stride 3).
  const Shape4 x = base.x();
  EXPECT_EQ(TiledMaxPool<float>::create(PoolKind::max, {.x = x, .y = {1, 2, 3, 3}},
                                        reference::pool_geometry(x, 3, 3, 2, 2, 0, 0)),
            nullptr);
  EXPECT_EQ(TiledMaxPool<float>::create(PoolKind::max, {.x = x, .y = {1, 2, 3, 3}},
                                        reference::pool_geometry(x, 2, 2, 3, 3, 0, 0)),
            nullptr);
  // Padding, and an image that leaves out the window's first row (a window reading padding).
  PoolGeometry padded = base.geometry();
  padded.pad_left = 1;
  EXPECT_EQ(TiledMaxPool<float>::create(PoolKind::max, base.shapes(), padded), nullptr);
  PoolGeometry margin = base.geometry();
  margin.image.h.begin = 1;
  EXPECT_EQ(TiledMaxPool<float>::create(PoolKind::max, base.shapes(), margin), nullptr);
  // More outputs than x holds windows. (Blocked layouts are taken.)
  EXPECT_EQ(
      TiledMaxPool<float>::create(PoolKind::max, {.x = x, .y = {1, 2, 5, 4}}, base.geometry()),
      nullptr);
  PoolShapes blocked = base.shapes();
  blocked.layout = Layout::nchw16c;
  EXPECT_NE(TiledMaxPool<float>::create(PoolKind::max, blocked, base.geometry()), nullptr);
  // Called with another layout than planned.
  auto b = TiledMaxPool<float>::create(PoolKind::max, blocked, base.geometry());
  Tensor<float> yb(base.y(), Layout::nchw16c);
  EXPECT_THROW(b->forward(Tensor<float>(x), yb), Error);
  // Wrong shapes at run time, and a backward with no forward before it.
  auto k = TiledMaxPool<float>::create(PoolKind::max, base.shapes(), base.geometry());
  Tensor<float> y(base.y()), dx(base.x());
  EXPECT_THROW(k->backward(y, dx), Error);
  EXPECT_THROW(k->forward(Tensor<float>({1, 2, 9, 8}), y), Error);
}

#if TESSERA_HAVE_ONEDNN
// NCHW max pooling by windows that tile the image is the tiled kernel's on the oneDNN backend,
// whatever oneDNN has for it on this CPU (plain loops on AMD EPYC, JIT loops through a transposed
// copy on Skylake-SP, both slower): 8 channels pooled by 2, as unet-small's first pool, and 4
// channels of 256 x 256, which oneDNN's JIT takes on Skylake-SP. The reference backend keeps the
// reference.
TEST(TiledMaxPool, IsWhatTheOneDnnBackendGivesForNchwPoolingByTwo) {
  for (const auto& [x, y] : {std::pair{Shape4{1, 8, 64, 64}, Shape4{1, 8, 32, 32}},
                             std::pair{Shape4{1, 4, 256, 256}, Shape4{1, 4, 128, 128}}}) {
    const PoolGeometry g = reference::pool_geometry(x, 2, 2, 2, 2, 0, 0);
    auto k = backend_of(KernelBackend::onednn).pool<float>(PoolKind::max, {.x = x, .y = y}, g);
    ASSERT_NE(k, nullptr);
    EXPECT_EQ(k->name(), "tiled max") << x.str();
    EXPECT_EQ(backend_of(KernelBackend::reference)
                  .pool<float>(PoolKind::max, {.x = x, .y = y}, g)
                  ->name(),
              "reference");
  }
}

DistTensor<float> distributed(const Distribution& d, Tensor<float> local) {
  DistTensor<float> t;
  t.dist = d;
  t.local = std::move(local);
  return t;
}

// A 16-channel pool whose output may go on nchw16c pools an nchw16c input in nchw16c and an NCHW
// one (a ReLU output that feeds a concat too) in NCHW: its output and input gradient stay NCHW, no
// conversion at the input's resolution. The same values either way.
TEST(TiledMaxPool, Pool2dPoolsNchwInputsAsTheyLie) {
  const Runtime& single = test::single_runtime(KernelBackend::onednn);
  const Distribution in{{2, 16, 12, 10}, single.comm().shape(), single.comm().coords()};
  LayerSpec spec;
  spec.name = "p";
  spec.type = "maxpool2d";
  spec.fields = {{"kernel", 2}};
  spec.where = "layer 'p' (maxpool2d)";
  Pool2d<float> pool("p", parse_pool2d(spec), 1);
  const Distribution out = pool.setup(in);
  pool.allow_blocked_output(true);
  pool.bind(single);
  EXPECT_EQ(pool.kernel_name(), "tiled max");  // the nchw16c one
  EXPECT_EQ(pool.nchw_kernel_name(), "tiled max");
  const TiledCase c{.n = 2, .c = 16, .kh = 2, .kw = 2, .out_h = 6, .out_w = 5};
  ReferencePool<float> reference(PoolKind::max, c.geometry());
  const Tensor<float> x = tie_data<float>(c.x(), 3, 0.5f);
  const Tensor<float> dy = tie_data<float>(c.y(), 4, 2.0f);
  Tensor<float> want_y(c.y()), want_dx(c.x());
  reference.forward(x, want_y);
  reference.backward(dy, want_dx);
  for (Layout layout : {Layout::nchw, Layout::nchw16c, Layout::nchw}) {
    const DistTensor<float> y = pool.forward(distributed(in, to_layout(x, layout)), RunState{});
    EXPECT_EQ(y.layout(), layout);
    EXPECT_EQ(mismatches(to_layout(y.local, Layout::nchw), want_y), 0);
    const DistTensor<float> dx =
        pool.backward_one(distributed(out, to_layout(dy, layout)), RunState{});
    EXPECT_EQ(dx.layout(), layout);
    EXPECT_EQ(mismatches(to_layout(dx.local, Layout::nchw), want_dx), 0);
  }
}
#endif

}  // namespace
}  // namespace tessera
