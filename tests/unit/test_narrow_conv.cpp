// The narrow convolution kernels (AVX-512, vectorised over pixels) against the float64 reference:
// the sweep's cases they take, every row width up to two of their 48-column blocks and more
// (the masked edges of all three passes), channel counts that fill no block of 8, non-square
// kernels and unequal dilations, box kernels, zero padding in the kernel (before and after,
// "same" and asymmetric, at row widths around the blocks and the filter's pieces); that the
// filter gradients are the same on every run and add into dw; streaming stores give the same
// bits; the cases they decline (padding
// past the kernel's span among them); and that the oneDNN backend plans NCHW for them. Under
// --precision bf16: Tessera's AMX kernels (CPUs with AMX) or bfloat16 dot products (AVX512_BF16).
// Skipped where the CPU has no AVX-512. Single process.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tessera/kernels/amx_conv.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera_config.h"

#include "conv_cases.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

using namespace conv_cases;

// Skips the test where the CPU has no AVX-512 (the narrow kernels decline every case), and
// switches the kernels on for it (whatever TESSERA_NARROW_CONV says).
#define REQUIRE_NARROW_KERNELS()                                                         \
  if (!simd_available(SimdLevel::avx512))                                                \
    GTEST_SKIP() << "this CPU (or compiler) has no AVX-512: the narrow kernels decline"; \
  const NarrowSwitch narrow_on(true)

// Case with the fields the narrow kernels care about; stride 1, no groups, no padding.
Case narrow_case(std::int64_t n, std::int64_t c, std::int64_t o, std::int64_t kernel,
                 std::int64_t dilation, std::int64_t out_h, std::int64_t out_w, bool bias) {
  return {.n = n,
          .c = c,
          .o = o,
          .groups = 1,
          .kernel = kernel,
          .stride = 1,
          .dilation = dilation,
          .pad = 0,
          .out_h = out_h,
          .out_w = out_w,
          .trailing = 0,
          .bias = bias};
}

// The same with zero padding in the kernel: `before` rows and columns before the input, `after`
// after it (x = out + span - before - after).
Case padded_case(std::int64_t n, std::int64_t c, std::int64_t o, std::int64_t kernel,
                 std::int64_t dilation, std::int64_t out_h, std::int64_t out_w, bool bias,
                 std::int64_t before, std::int64_t after) {
  Case k = narrow_case(n, c, o, kernel, dilation, out_h, out_w, bias);
  k.pad = before;
  k.pad_after = after;
  return k;
}

// "same" padding: x as large as y, span / 2 before and the rest after (one more for an odd
// span: kernel 4, or 2 at dilation 1).
Case same_case(std::int64_t n, std::int64_t c, std::int64_t o, std::int64_t kernel,
               std::int64_t dilation, std::int64_t out_h, std::int64_t out_w, bool bias) {
  const std::int64_t span = dilation * (kernel - 1);
  return padded_case(n, c, o, kernel, dilation, out_h, out_w, bias, span / 2, span - span / 2);
}

std::unique_ptr<ConvKernel<float>> make(const Case& c) {
  return make_narrow_conv(c.shapes(), c.geometry());
}

void expect_both_match(const Case& c) {
  std::unique_ptr<ConvKernel<float>> k = make(c);
  ASSERT_NE(k, nullptr) << c.str();
  EXPECT_EQ(k->name(), "narrow avx512");
  expect_matches_reference(*k, c);
  expect_box_kernel_matches(c, [&](const ConvShapes& s) {
    std::unique_ptr<ConvKernel<float>> box = make_narrow_conv(s, c.geometry());
    EXPECT_NE(box, nullptr) << "box, " << c.str();
    return box;
  });
}

TEST(NarrowConv, MatchesTheReferenceOverTheSweepsCasesItTakes) {
  REQUIRE_NARROW_KERNELS();
  int taken = 0;
  for (const Case& c : sweep()) {
    if (!narrow_conv_fits(c.shapes(), c.geometry())) continue;
    ++taken;
    expect_both_match(c);
  }
  EXPECT_GE(taken, 4);
}

// Widths 1 to 100 and 200 (the forward's blocks are 48 columns, the filter's pieces 512, the
// vectors 16): masked loads and stores at both edges of every pass, with output channels that
// fill no block (1, 3, 12: a second block of 4) and input channels that fill no chunk of 8.
TEST(NarrowConv, MatchesTheReferenceAtEveryRowWidth) {
  REQUIRE_NARROW_KERNELS();
  const std::int64_t channels[][2] = {{5, 3}, {1, 8}, {13, 12}, {3, 1}, {24, 16}};
  for (std::int64_t w = 1; w <= 100; ++w) {
    const auto [c, o] = channels[w % 5];
    expect_both_match(narrow_case(1 + w % 2, c, o, 3, 1, 2 + w % 3, w, w % 3 == 0));
  }
  expect_both_match(narrow_case(1, 8, 8, 3, 1, 3, 200, true));
  expect_both_match(narrow_case(1, 3, 8, 3, 1, 4, 600, false));  // two filter pieces
}

// 16 -> 16 channels, taken where x comes in NCHW (ConvShapes::x_nchw): two blocks of 8 outputs
// from two chunks of 8 inputs, at widths around the forward's blocks, "same" padding and none,
// tiles and boxes.
TEST(NarrowConv, MatchesTheReferenceForSixteenChannelsFromNchw) {
  REQUIRE_NARROW_KERNELS();
  for (const Case& c :
       {narrow_case(2, 16, 16, 3, 1, 5, 47, true), narrow_case(1, 16, 16, 3, 2, 4, 97, false),
        same_case(1, 16, 16, 3, 1, 6, 50, true), same_case(2, 16, 16, 5, 1, 3, 17, false)}) {
    ConvShapes s = c.shapes();
    s.x_nchw = true;
    std::unique_ptr<ConvKernel<float>> k = make_narrow_conv(s, c.geometry());
    ASSERT_NE(k, nullptr) << c.str();
    EXPECT_EQ(k->name(), "narrow avx512");
    expect_matches_reference(*k, c);
    expect_box_kernel_matches(c, [&](ConvShapes b) {
      b.x_nchw = true;
      std::unique_ptr<ConvKernel<float>> box = make_narrow_conv(b, c.geometry());
      EXPECT_NE(box, nullptr) << "box, " << c.str();
      return box;
    });
  }
}

TEST(NarrowConv, MatchesTheReferenceForEveryKernelExtentAndDilation) {
  REQUIRE_NARROW_KERNELS();
  for (std::int64_t kernel : {2, 3, 4, 5, 7})
    for (std::int64_t dilation : {1, 2, 3})
      expect_both_match(narrow_case(2, 6, 5, kernel, dilation, 5, 19 + 4 * kernel, kernel % 2));
  expect_both_match(narrow_case(1, 64, 8, 3, 1, 3, 37, true));
}

// A kernel extent, dilation and zero padding per axis (Case has one extent, one dilation and
// padding alike on both axes); `after`: the padding after the input, kSymmetric: `pad`.
struct Geometry {
  std::int64_t kh, kw, dh, dw;
  std::int64_t pad_top = 0, pad_left = 0;
  std::int64_t after_h = Case::kSymmetric, after_w = Case::kSymmetric;
};

// All three passes of the narrow kernel for `q` against the reference: n x c -> o channels,
// output oh x ow.
void expect_geometry_matches(const Geometry& q, std::int64_t n, std::int64_t c, std::int64_t o,
                             std::int64_t oh, std::int64_t ow) {
  const ConvGeometry g{
      .dilation_h = q.dh, .dilation_w = q.dw, .pad_top = q.pad_top, .pad_left = q.pad_left};
  const std::int64_t after_h = q.after_h == Case::kSymmetric ? q.pad_top : q.after_h;
  const std::int64_t after_w = q.after_w == Case::kSymmetric ? q.pad_left : q.after_w;
  const ConvShapes s{.x = {n, c, oh + q.dh * (q.kh - 1) - q.pad_top - after_h,
                           ow + q.dw * (q.kw - 1) - q.pad_left - after_w},
                     .w = {o, c, q.kh, q.kw},
                     .y = {n, o, oh, ow},
                     .bias = true};
  const std::string what = "kernel " + std::to_string(q.kh) + "x" + std::to_string(q.kw) +
                           " dilation " + std::to_string(q.dh) + "x" + std::to_string(q.dw) +
                           " padding " + std::to_string(q.pad_top) + "/" + std::to_string(after_h) +
                           " x " + std::to_string(q.pad_left) + "/" + std::to_string(after_w) +
                           ", " + std::to_string(c) + " -> " + std::to_string(o) + ", x " +
                           s.x.str();
  std::unique_ptr<ConvKernel<float>> k = make_narrow_conv(s, g);
  ASSERT_NE(k, nullptr) << what;
  const Tensor<float> x = random_tensor(s.x, 1), w = random_tensor(s.w, 2);
  const Tensor<float> dy = random_tensor(s.y, 3), b = random_tensor({o, 1, 1, 1}, 4);
  Tensor<float> y(s.y, 7.0f), dx(s.x, 7.0f), dw = random_tensor(s.w, 5);
  Tensor<float> db = random_tensor({o, 1, 1, 1}, 6);
  Tensor<double> yd(s.y), dxd(s.x), dwd = to_double(dw), dbd = to_double(db);
  k->forward(x, w, b.span(), y);
  k->backward_data(dy, w, dx);
  k->backward_filter(x, dy, dw, db.span());
  const Tensor<double> bd = to_double(b);
  reference::conv2d_forward(to_double(x), to_double(w), std::as_const(bd).span(), yd, g);
  reference::conv2d_backward_data(to_double(dy), to_double(w), dxd, g);
  reference::conv2d_backward_filter(to_double(x), to_double(dy), dwd, dbd.span(), g);
  EXPECT_LE(rel_error(y.span(), yd.span()), kTolerance) << "forward, " << what;
  EXPECT_LE(rel_error(dx.span(), dxd.span()), kTolerance) << "backward-data, " << what;
  EXPECT_LE(rel_error(dw.span(), dwd.span()), kTolerance) << "backward-weights, " << what;
  EXPECT_LE(rel_error(db.span(), dbd.span()), kTolerance) << "backward-bias, " << what;
}

// Non-square kernels and dilations that differ between the axes, through the reference directly.
TEST(NarrowConv, MatchesTheReferenceForNonSquareKernels) {
  REQUIRE_NARROW_KERNELS();
  for (const Geometry& q : {Geometry{1, 3, 1, 1}, Geometry{3, 1, 1, 1}, Geometry{2, 5, 1, 2},
                            Geometry{7, 2, 2, 1}, Geometry{3, 3, 2, 1}})
    expect_geometry_matches(q, 2, 7, 9, 6, 53);
}

// Zero padding in the kernel, as a conv computed straight from its tile takes it: "same" (one
// more after than before where the span is odd), none before and the whole span after, the whole
// span before and none after, the whole span on both sides; kernels 2 to 7, dilations 1 and 2,
// 3, 8, 24 -> 8 and 8 -> 16 channels, batch 2; box kernels too (zeros outside the box).
TEST(NarrowConv, MatchesTheReferenceWithPaddingInTheKernel) {
  REQUIRE_NARROW_KERNELS();
  const std::int64_t channels[][2] = {{3, 8}, {8, 8}, {24, 8}, {8, 16}};
  int i = 0;
  for (std::int64_t kernel : {2, 3, 4, 5, 7})
    for (std::int64_t dilation : {1, 2}) {
      const std::int64_t span = dilation * (kernel - 1);
      for (const auto& [before, after] :
           {std::pair{span / 2, span - span / 2}, {0, span}, {span, 0}, {span, span}})
        for (const auto& [c, o] : channels) {
          ++i;
          // x of 3 to 7 rows and 29 to 64 columns.
          const std::int64_t more = before + after - span;
          expect_both_match(padded_case(2, c, o, kernel, dilation, 3 + i % 5 + more,
                                        29 + 7 * (i % 6) + more, i % 2 == 0, before, after));
        }
    }
  // Padding wider than a vector (dilation 9: 18 columns), more than one masked vector at each end
  // of a row; with the whole span on both sides, rows whose taps all lie in the padding.
  expect_both_match(same_case(2, 8, 8, 3, 9, 5, 40, true));
  expect_both_match(padded_case(2, 8, 8, 3, 9, 20, 45, true, 18, 18));
  expect_both_match(padded_case(1, 24, 8, 7, 3, 20, 530, false, 18, 17));
}

// Non-square kernels with padding of their own per axis: 1x3 and 3x1 "same" and one-sided,
// unequal dilations with unequal padding before and after.
TEST(NarrowConv, MatchesTheReferenceForNonSquareKernelsWithPadding) {
  REQUIRE_NARROW_KERNELS();
  const std::int64_t channels[][2] = {{3, 8}, {8, 8}, {24, 8}, {8, 16}};
  for (const auto& [c, o] : channels)
    for (const Geometry& q :
         {Geometry{.kh = 1, .kw = 3, .dh = 1, .dw = 1, .pad_left = 1},
          Geometry{.kh = 3, .kw = 1, .dh = 1, .dw = 1, .pad_top = 1},
          Geometry{.kh = 1, .kw = 3, .dh = 1, .dw = 2, .pad_left = 2},
          Geometry{.kh = 3, .kw = 1, .dh = 2, .dw = 1, .pad_top = 2},
          Geometry{.kh = 1, .kw = 3, .dh = 1, .dw = 1, .after_h = 0, .after_w = 2},
          Geometry{.kh = 3, .kw = 1, .dh = 1, .dw = 1, .pad_top = 2, .after_h = 0},
          Geometry{.kh = 2, .kw = 5, .dh = 1, .dw = 2, .pad_left = 4, .after_h = 1, .after_w = 0},
          Geometry{.kh = 7, .kw = 2, .dh = 2, .dw = 1, .pad_top = 6, .after_h = 5, .after_w = 1},
          Geometry{.kh = 3, .kw = 3, .dh = 2, .dw = 1, .pad_top = 2, .pad_left = 1},
          Geometry{.kh = 5, .kw = 5, .dh = 1, .dw = 1, .pad_top = 2, .pad_left = 2},
          Geometry{.kh = 7, .kw = 7, .dh = 2, .dw = 2, .pad_top = 6, .pad_left = 6}})
      expect_geometry_matches(q, 2, c, o, 6, 53);
}

// Row widths 1 to 100 (the forward's and backward-data's 48-column blocks, 16-column vectors)
// and 500 to 530 (the filter gradient's 512-column pieces) with "same" padding of 1 to 6 columns
// (kernels 3, 5, 7, dilations 1 and 2): the masked vectors at both ends of a row in all three
// passes, rows narrower than the padding, the first and last rows' tap rows in it.
TEST(NarrowConv, MatchesTheReferenceWithPaddingAtEveryRowWidth) {
  REQUIRE_NARROW_KERNELS();
  const std::int64_t channels[][2] = {{3, 8}, {8, 8}, {24, 8}, {8, 16}, {5, 3}};
  const std::int64_t geometry[][2] = {{3, 1}, {5, 1}, {3, 2}, {7, 2}};  // kernel, dilation
  for (std::int64_t w = 1; w <= 100; ++w) {
    const auto [c, o] = channels[w % 5];
    const auto [kernel, dilation] = geometry[w % 4];
    expect_both_match(same_case(1 + w % 2, c, o, kernel, dilation, 1 + w % 4, w, w % 3 == 0));
  }
  for (std::int64_t w = 500; w <= 530; ++w) {
    const auto [c, o] = channels[w % 5];
    const auto [kernel, dilation] = geometry[w % 4];
    expect_both_match(same_case(1, c, o, kernel, dilation, 2, w, w % 3 == 0));
  }
}

bool same_bits(const Tensor<float>& a, const Tensor<float>& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(float)) == 0;
}

// Sets the streaming-store threshold back to what it was (set_streaming_store_bytes) on leaving
// its scope.
struct StreamingThreshold {
  std::int64_t bytes = streaming_store_bytes();
  ~StreamingThreshold() { set_streaming_store_bytes(bytes); }
};

// The forward and backward-data of case k with streaming stores for every output (a threshold of
// 0) give the bits they give with plain stores (make(k): whichever kernel the switches choose).
void expect_streamed_bit_for_bit(const Case& k) {
  const StreamingThreshold restore;
  const Tensor<float> x = random_tensor(k.x(), 1), wt = random_tensor(k.w(), 2);
  const Tensor<float> dy = random_tensor(k.y(), 3), b = random_tensor({k.o, 1, 1, 1}, 4);
  Tensor<float> y[2] = {Tensor<float>(k.y()), Tensor<float>(k.y())};
  Tensor<float> dx[2] = {Tensor<float>(k.x()), Tensor<float>(k.x())};
  for (int streaming = 0; streaming < 2; ++streaming) {
    set_streaming_store_bytes(streaming ? 0 : std::int64_t{1} << 40);
    std::unique_ptr<ConvKernel<float>> kernel = make(k);
    ASSERT_NE(kernel, nullptr) << k.str();
    kernel->forward(x, wt, b.span(), y[streaming]);
    kernel->backward_data(dy, wt, dx[streaming]);
  }
  EXPECT_TRUE(same_bits(y[0], y[1])) << "streamed forward, " << k.str();
  EXPECT_TRUE(same_bits(dx[0], dx[1])) << "streamed backward-data, " << k.str();
}

// With streaming stores for every output (a threshold of 0), where one pass over the input
// channels writes the output (at most 8 of them: the forward from up to 8, backward-data from up to
// 8 output channels) and its rows start on 64-byte lines (widths that are multiples of 16) or not,
// the forward and backward-data give the same bits as with plain stores, and match the reference.
TEST(NarrowConv, StreamsItsOutputWithTheSameBits) {
  REQUIRE_NARROW_KERNELS();
  const StreamingThreshold restore;
  const std::int64_t channels[][2] = {{3, 8}, {8, 8}, {8, 16}, {5, 3}, {24, 8}, {8, 12}};
  for (const std::int64_t w : {16, 17, 32, 48, 64, 96, 100, 128, 160, 512}) {
    for (const auto& [c, o] : channels) {
      const Case k = same_case(2, c, o, 3, 1, 5, w, true);
      expect_streamed_bit_for_bit(k);
      set_streaming_store_bytes(0);
      expect_both_match(k);
    }
  }
}

// A fused (leaky) ReLU is applied as the forward writes y, bit for bit as elementwise::leaky_relu
// on the unfused output (NaN included, over two chunks of input channels); the backward passes are
// the unfused kernel's.
TEST(NarrowConv, AppliesAFusedActivationAsItWrites) {
  REQUIRE_NARROW_KERNELS();
  for (const FusedActivation f :
       {FusedActivation{.kind = ActivationKind::relu},
        FusedActivation{.kind = ActivationKind::leaky_relu, .slope = 0.1}}) {
    Case c = narrow_case(2, 13, 10, 3, 1, 7, 61, true);
    ConvShapes fused = c.shapes();
    fused.activation = f;
    std::unique_ptr<ConvKernel<float>> k = make_narrow_conv(fused, c.geometry()), plain = make(c);
    ASSERT_NE(k, nullptr);
    EXPECT_TRUE(k->applies_activation());
    EXPECT_FALSE(plain->applies_activation());
    Tensor<float> x = random_tensor(c.x(), 1);
    x.data()[5] = std::numeric_limits<float>::quiet_NaN();
    const Tensor<float> w = random_tensor(c.w(), 2), b = random_tensor({c.o, 1, 1, 1}, 4);
    Tensor<float> y(c.y()), want(c.y());
    k->forward(x, w, b.span(), y);
    plain->forward(x, w, b.span(), want);
    const float slope = static_cast<float>(f.slope);
    std::int64_t differ = 0, nan = 0;
    for (std::int64_t i = 0; i < want.numel(); ++i) {
      const float v = elementwise::leaky_relu(want.data()[i], slope);
      nan += std::isnan(v);
      differ += std::memcmp(&v, y.data() + i, sizeof v) != 0 &&
                !(std::isnan(v) && std::isnan(y.data()[i]));
    }
    EXPECT_EQ(differ, 0);
    EXPECT_GT(nan, 0);  // the NaN input went through
  }
}

struct Threads {
  const KernelThreads before = kernel_threads();
  explicit Threads(int n) { set_kernel_threads({n, "test"}); }
  ~Threads() { set_kernel_threads(before); }
};

// The filter gradient sums per part of the rows in double, parts added in order: the same bits on
// every run with the same thread count, and within float rounding of one thread's on two; with
// padding in the kernel too (a 530-column row: two filter pieces, masked vectors at both ends).
TEST(NarrowConv, FilterGradientsAreTheSameOnEveryRun) {
  REQUIRE_NARROW_KERNELS();
  for (const Case& c :
       {narrow_case(2, 24, 8, 3, 1, 33, 70, true), same_case(2, 24, 8, 3, 1, 33, 530, true),
        same_case(2, 8, 16, 5, 2, 21, 77, true)}) {
    std::unique_ptr<ConvKernel<float>> k = make(c);
    ASSERT_NE(k, nullptr) << c.str();
    const Tensor<float> x = random_tensor(c.x(), 1), dy = random_tensor(c.y(), 3);
    auto filter = [&] {
      Tensor<float> dw(c.w()), db({c.o, 1, 1, 1});
      k->backward_filter(x, dy, dw, db.span());
      return std::pair{dw, db};
    };
    for (int threads : {1, 2, 3}) {
      const Threads scope(threads);
      const auto [dw1, db1] = filter();
      const auto [dw2, db2] = filter();
      EXPECT_EQ(std::memcmp(dw1.data(), dw2.data(), dw1.numel() * sizeof(float)), 0)
          << threads << ", " << c.str();
      EXPECT_EQ(std::memcmp(db1.data(), db2.data(), db1.numel() * sizeof(float)), 0)
          << threads << ", " << c.str();
      const Threads one(1);
      const auto [dw_one, db_one] = filter();
      EXPECT_LE(rel_error(dw1.span(), dw_one.span()), 1e-6) << threads << ", " << c.str();
      EXPECT_LE(rel_error(db1.span(), db_one.span()), 1e-6) << threads << ", " << c.str();
    }
  }
}

// `t` split by channels into tensors of `channels` each (a concat's parts), and back.
std::vector<Tensor<float>> split(const Tensor<float>& t,
                                 const std::vector<std::int64_t>& channels) {
  const Shape4& s = t.shape();
  std::vector<Tensor<float>> parts;
  std::int64_t first = 0;
  for (std::int64_t c : channels) {
    Tensor<float> p({s.n, c, s.h, s.w});
    for (std::int64_t n = 0; n < s.n; ++n)
      std::memcpy(p.data() + n * c * s.h * s.w, t.data() + (n * s.c + first) * s.h * s.w,
                  static_cast<std::size_t>(c * s.h * s.w) * sizeof(float));
    parts.push_back(std::move(p));
    first += c;
  }
  return parts;
}

template <typename P>
std::vector<P*> pointers(std::vector<Tensor<float>>& parts) {
  std::vector<P*> out;
  for (Tensor<float>& p : parts)
    out.push_back(&p);
  return out;
}

// backward_fused (both passes and the input activation's f' in one sweep over bands of rows) gives
// the bits of backward_data, f' from x (CpuActivation's rule) and backward_filter run apart, on
// one thread and on two (the filter sums' parts are the thread count's either way): without an
// activation, with ReLU and leaky ReLU (x with zeros, negatives and a NaN), bias or none, "same"
// padding with row widths and heights that split into several bands and a part boundary inside a
// sample; in float32 and, where the CPU has them, in bfloat16 dot products under --precision bf16
// (narrow_conv_bf16_dot). It declines where the heights of x and y differ, and for sigmoid.
TEST(NarrowConv, FusedBackwardIsTheSeparatePassesBitForBit) {
  REQUIRE_NARROW_KERNELS();
  const std::optional<FusedActivation> activations[] = {
      std::nullopt, FusedActivation{.kind = ActivationKind::relu},
      FusedActivation{.kind = ActivationKind::leaky_relu, .slope = 0.1}};
  const Case cases[] = {
      same_case(2, 8, 8, 3, 1, 37, 2048, false), same_case(2, 8, 16, 3, 1, 29, 1030, true),
      same_case(1, 3, 8, 5, 2, 70, 61, true), same_case(3, 24, 8, 3, 1, 9, 300, false)};
  struct Float32After {
    ~Float32After() { set_conv_bf16(false); }
  } float32_after;
  for (const bool bf16 : {false, true})
    for (const Case& c : cases) {
      if (bf16 && !narrow_conv_bf16_dot()) break;
      set_conv_bf16(bf16);
      std::unique_ptr<ConvKernel<float>> k = make(c);
      ASSERT_NE(k, nullptr) << c.str();
      EXPECT_EQ(k->name(), bf16 ? "narrow avx512 bf16" : "narrow avx512") << c.str();
      Tensor<float> x = random_tensor(c.x(), 21);
      for (std::int64_t i = 0; i < x.numel(); i += 7)
        x.data()[i] = i % 3 == 0 ? 0.0f : -std::abs(x.data()[i]);
      x.data()[11] = std::numeric_limits<float>::quiet_NaN();
      const Tensor<float> w = random_tensor(c.w(), 22), dy = random_tensor(c.y(), 23);
      for (const std::optional<FusedActivation>& f : activations) {
        const float slope = f && f->kind == ActivationKind::leaky_relu ? 0.1f : 0.0f;
        for (int threads : {1, 2}) {
          const Threads scope(threads);
          Tensor<float> dx(c.x()), dw(c.w(), 0.5f), db({c.o, 1, 1, 1}, 0.25f);
          Tensor<float> dx_fused(c.x(), 3.0f), dw_fused = dw, db_fused = db;
          const std::span<float> bias = c.bias ? db.span() : std::span<float>();
          const std::span<float> bias_fused = c.bias ? db_fused.span() : std::span<float>();
          k->backward_data(dy, w, dx);
          if (f)
            for (std::int64_t i = 0; i < dx.numel(); ++i)
              dx.data()[i] = elementwise::leaky_relu_grad(x.data()[i] > 0.0f, dx.data()[i], slope);
          k->backward_filter(x, dy, dw, bias);
          ASSERT_TRUE(k->backward_fused(x, dy, w, f, dx_fused, dw_fused, bias_fused)) << c.str();
          const std::string what =
              c.str() + (f ? f->kind == ActivationKind::relu ? ", relu" : ", leaky relu" : "") +
              ", " + std::to_string(threads) + " threads" + (bf16 ? ", bf16" : "");
          EXPECT_TRUE(same_bits(dx_fused, dx)) << "dx, " << what;
          EXPECT_TRUE(same_bits(dw_fused, dw)) << "dw, " << what;
          EXPECT_TRUE(same_bits(db_fused, db)) << "dbias, " << what;
        }
      }
    }
  set_conv_bf16(false);
  Case shorter = narrow_case(1, 8, 8, 3, 1, 7, 40, false);  // no padding: x two rows taller
  std::unique_ptr<ConvKernel<float>> k = make(shorter);
  ASSERT_NE(k, nullptr);
  Tensor<float> x(shorter.x()), dy(shorter.y()), w(shorter.w()), dx(shorter.x()), dw(shorter.w());
  EXPECT_FALSE(k->backward_fused(x, dy, w, std::nullopt, dx, dw, {}));
  Case same = same_case(1, 8, 8, 3, 1, 7, 40, false);
  std::unique_ptr<ConvKernel<float>> s = make(same);
  Tensor<float> sx(same.x()), sdy(same.y()), sdx(same.x());
  EXPECT_FALSE(
      s->backward_fused(sx, sdy, w, FusedActivation{.kind = ActivationKind::sigmoid}, sdx, dw, {}));
}

// The three passes on a concat's parts (ConvKernel::forward_parts) against the same passes on
// their concatenation, bit for bit: the narrow kernel reads and writes the parts where they lie
// (reads_parts), other kernels gather them (the reference's default).
void expect_parts_match(ConvKernel<float>& k, const Case& c,
                        const std::vector<std::int64_t>& channels) {
  const Tensor<float> x = random_tensor(c.x(), 11), w = random_tensor(c.w(), 12),
                      dy = random_tensor(c.y(), 13), b = random_tensor({c.o, 1, 1, 1}, 14);
  std::vector<Tensor<float>> xs = split(x, channels);
  const std::vector<const Tensor<float>*> in = pointers<const Tensor<float>>(xs);
  Tensor<float> y(c.y()), y_parts(c.y());
  k.forward(x, w, b.span(), y);
  k.forward_parts(in, w, b.span(), y_parts);
  EXPECT_TRUE(same_bits(y, y_parts)) << "forward, " << c.str();
  Tensor<float> dx(c.x());
  k.backward_data(dy, w, dx);
  std::vector<Tensor<float>> dxs = split(Tensor<float>(c.x(), 7.0f), channels);
  k.backward_data_parts(dy, w, pointers<Tensor<float>>(dxs));
  const std::vector<Tensor<float>> expected = split(dx, channels);
  for (std::size_t p = 0; p < dxs.size(); ++p)
    EXPECT_TRUE(same_bits(dxs[p], expected[p])) << "backward-data part " << p << ", " << c.str();
  Tensor<float> dw(c.w(), 1.0f), db({c.o, 1, 1, 1}, 1.0f), dw_parts = dw, db_parts = db;
  k.backward_filter(x, dy, dw, db.span());
  k.backward_filter_parts(in, dy, dw_parts, db_parts.span());
  EXPECT_TRUE(same_bits(dw, dw_parts)) << "backward-filter, " << c.str();
  EXPECT_TRUE(same_bits(db, db_parts)) << "backward-filter's bias, " << c.str();
}

TEST(NarrowConv, ReadsAConcatsPartsWhereTheyLie) {
  REQUIRE_NARROW_KERNELS();
  // unet-small's d1 (16 + 8 -> 8), two parts of 16 at dilation 2 to 6, three parts whose last
  // fills no chunk of 8, at widths with masked edges.
  const std::pair<Case, std::vector<std::int64_t>> cases[] = {
      {same_case(2, 24, 8, 3, 1, 9, 70, false), {16, 8}},
      {same_case(1, 32, 6, 3, 2, 11, 37, true), {16, 16}},
      {narrow_case(2, 37, 5, 3, 1, 4, 21, true), {16, 16, 5}},
      {same_case(1, 24, 16, 3, 1, 6, 50, true), {16, 8}}};
  for (const auto& [c, channels] : cases) {
    std::unique_ptr<ConvKernel<float>> k = make(c);
    ASSERT_NE(k, nullptr) << c.str();
    EXPECT_TRUE(k->reads_parts());
    expect_parts_match(*k, c, channels);
  }
}

// The case's box kernels (expect_box_kernel_matches, within `tolerance`), each named `name`.
void expect_box_kernels_named(const Case& c, const std::string& name, double tolerance) {
  expect_box_kernel_matches(
      c,
      [&](const ConvShapes& s) {
        std::unique_ptr<ConvKernel<float>> box = make_narrow_conv(s, c.geometry());
        EXPECT_NE(box, nullptr) << "box, " << c.str();
        if (box) {
          EXPECT_EQ(box->name(), name) << "box, " << c.str();
        }
        return box;
      },
      tolerance);
}

// A kernel planned with a fused ReLU or leaky ReLU: its forward bit for bit the plain kernel's
// through elementwise::leaky_relu.
void expect_fused_activation_bit_for_bit(const Case& c) {
  for (const FusedActivation f :
       {FusedActivation{.kind = ActivationKind::relu},
        FusedActivation{.kind = ActivationKind::leaky_relu, .slope = 0.1}}) {
    ConvShapes fused = c.shapes();
    fused.activation = f;
    std::unique_ptr<ConvKernel<float>> k = make_narrow_conv(fused, c.geometry()), plain = make(c);
    ASSERT_NE(k, nullptr);
    EXPECT_TRUE(k->applies_activation());
    const Tensor<float> x = random_tensor(c.x(), 1), w = random_tensor(c.w(), 2);
    const Tensor<float> b = random_tensor({c.o, 1, 1, 1}, 4);
    Tensor<float> y(c.y()), want(c.y());
    k->forward(x, w, b.span(), y);
    plain->forward(x, w, b.span(), want);
    for (float& v : want.span())
      v = elementwise::leaky_relu(v, static_cast<float>(f.slope));
    EXPECT_TRUE(same_bits(y, want)) << "fused activation " << f.slope << ", " << c.str();
  }
}

// A concat's parts (unet-small's d1, and three parts whose last fills no chunk of 8) on a kernel
// named `name`: bit for bit the whole tensor's passes.
void expect_parts_bit_for_bit(const std::string& name) {
  const std::pair<Case, std::vector<std::int64_t>> parts[] = {
      {same_case(2, 24, 8, 3, 1, 9, 70, false), {16, 8}},
      {narrow_case(2, 37, 5, 3, 1, 4, 21, true), {16, 16, 5}}};
  for (const auto& [c, split_at] : parts) {
    std::unique_ptr<ConvKernel<float>> k = make(c);
    ASSERT_NE(k, nullptr) << c.str();
    EXPECT_EQ(k->name(), name) << c.str();
    expect_parts_match(*k, c, split_at);
  }
}

// Under --precision bf16 on CPUs with AMX the narrow convolutions run on Tessera's AMX kernels
// (include/tessera/kernels/amx_conv.hpp), which read and write the planes as they lie: whole
// tensors, boxes (the forward) and a concat's parts (bit for bit the whole tensor's), at row widths
// around their 16-pixel tiles, channel counts that fill no block, every kernel extent and
// dilation, zero padding in the kernel, a fused (leaky) ReLU; within bfloat16's tolerance of the
// float64 reference (test_amx_conv.cpp checks the kernels to float32's on rounded inputs).
TEST(NarrowConv, RunsOnAmxUnderBf16) {
  REQUIRE_NARROW_KERNELS();
  if (!amx::available()) GTEST_SKIP() << "no AMX on this CPU (or TESSERA_AMX=0)";
  struct Bf16 {
    Bf16() { set_conv_bf16(true); }
    ~Bf16() { set_conv_bf16(false); }
  } bf16_scope;
  constexpr double kBf16 = 1e-2;
  const auto check = [&](const Case& c) {
    std::unique_ptr<ConvKernel<float>> k = make(c);
    ASSERT_NE(k, nullptr) << c.str();
    EXPECT_EQ(k->name(), "narrow tessera amx") << c.str();
    expect_matches_reference(*k, c, Layout::nchw, kBf16);
    expect_box_kernels_named(c, "narrow tessera amx", kBf16);
  };
  // (At least 128 products a pixel and tap: fewer stay on the float32 kernels.)
  const std::int64_t channels[][2] = {{13, 12}, {16, 8}, {24, 8}, {8, 16},
                                      {64, 8},  {37, 5}, {11, 12}};
  for (std::int64_t w = 1; w <= 70; w += 3) {
    const auto [c, o] = channels[w % 7];
    check(narrow_case(1 + w % 2, c, o, 3, 1, 2 + w % 3, w, w % 3 == 0));
    check(same_case(1, c, o, 3, 1, 3, w, w % 2 == 0));
  }
  for (std::int64_t kernel : {2, 3, 5, 7})
    for (std::int64_t dilation : {1, 2})
      check(padded_case(2, 26, 5, kernel, dilation, 5, 19 + 4 * kernel, kernel % 2, dilation,
                        dilation * (kernel - 1) - dilation));
  check(same_case(1, 24, 8, 3, 1, 21, 40, false));  // taller than a group of weight rows
  // Fewer than 128 products a pixel and tap: the float32 kernels.
  for (const Case& c :
       {same_case(1, 8, 8, 3, 1, 3, 20, false), same_case(1, 3, 8, 3, 1, 3, 20, false)})
    EXPECT_EQ(make(c)->name(), "narrow avx512") << c.str();

  expect_fused_activation_bit_for_bit(same_case(2, 19, 8, 3, 1, 7, 61, true));
  expect_parts_bit_for_bit("narrow tessera amx");
}

// An input of case c whose channels [begin, end) hold 2x2 blocks of equal values starting at even
// global rows and columns, x's row 0 and column 0 at global parities `parity` (a nearest
// upsampling's output, ConvShapes::doubled_begin); the other channels random.
Tensor<float> doubled_input(const Case& c, std::int64_t begin, std::int64_t end, BoxAt parity,
                            std::uint64_t stream) {
  Tensor<float> x = random_tensor(c.x(), stream);
  const Shape4 s = c.x();
  const Tensor<float> blocks = random_tensor({s.n, s.c, s.h / 2 + 2, s.w / 2 + 2}, stream + 1);
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t ch = begin; ch < end; ++ch)
      for (std::int64_t h = 0; h < s.h; ++h)
        for (std::int64_t w = 0; w < s.w; ++w)
          x.data()[((n * s.c + ch) * s.h + h) * s.w + w] =
              blocks.data()[((n * s.c + ch) * (s.h / 2 + 2) + (h + parity.h) / 2) * (s.w / 2 + 2) +
                            (w + parity.w) / 2];
  return x;
}

// The three passes against the float64 reference on bfloat16-rounded factors (x, w, dy; not the
// bias), within float32 sums' rounding of the largest value (the bias gradient from dy as it is),
// the forward through the fused activation `f` if any; dw and dbias added into. x: `given_x`
// where given, else random.
void expect_matches_rounded_reference(ConvKernel<float>& k, const Case& c,
                                      const std::optional<FusedActivation>& f,
                                      const Tensor<float>* given_x = nullptr) {
  constexpr double kSums = 1e-5;
  const ConvGeometry g = c.geometry();
  const Tensor<float> x = given_x != nullptr ? *given_x : random_tensor(c.x(), 1);
  const Tensor<float> w = random_tensor(c.w(), 2);
  const Tensor<float> dy = random_tensor(c.y(), 3);
  const Tensor<float> b = c.bias ? random_tensor({c.o, 1, 1, 1}, 4) : Tensor<float>();
  const Tensor<double> xr = rounded(x), wr = rounded(w), dyr = rounded(dy), bd = to_double(b);

  Tensor<float> y(c.y(), 7.0f);
  k.forward(x, w, b.span(), y);
  Tensor<double> yd(c.y());
  reference::conv2d_forward(xr, wr, bd.span(), yd, g);
  if (f)
    for (double& v : yd.span())
      v = v > 0 ? v : f->kind == ActivationKind::leaky_relu ? f->slope * v : 0.0;
  EXPECT_LE(rel_error(y.span(), yd.span()), kSums) << "forward, " << c.str();

  Tensor<float> dx(c.x(), 7.0f);
  k.backward_data(dy, w, dx);
  Tensor<double> dxd(c.x());
  reference::conv2d_backward_data(dyr, wr, dxd, g);
  EXPECT_LE(rel_error(dx.span(), dxd.span()), kSums) << "backward-data, " << c.str();

  Tensor<float> dw = random_tensor(c.w(), 5);
  Tensor<double> dwd = to_double(dw), unused(c.w());
  Tensor<float> db = c.bias ? random_tensor({c.o, 1, 1, 1}, 6) : Tensor<float>();
  Tensor<double> dbd = to_double(db);
  k.backward_filter(x, dy, dw, db.span());
  reference::conv2d_backward_filter(xr, dyr, dwd, {}, g);
  reference::conv2d_backward_filter(to_double(x), to_double(dy), unused, dbd.span(), g);
  EXPECT_LE(rel_error(dw.span(), dwd.span()), kSums) << "backward-weights, " << c.str();
  EXPECT_LE(rel_error(db.span(), dbd.span()), kSums) << "backward-bias, " << c.str();
}

// Under --precision bf16 on CPUs with AVX512_BF16 and no AMX the narrow kernels compute in
// bfloat16 dot products (narrow_conv_bf16_dot): every pass within float32 sums' rounding of the
// float64 reference on bfloat16-rounded factors (the conversions round to nearest even): row
// widths around the 16-lane vectors, the 48-column blocks and the filter's 512-column pieces, odd
// channel counts (a pair half empty), one input channel, two blocks of outputs, every kernel
// extent and dilation with padding in the kernel, several samples and a tall tile on 1 and 2
// threads (the rows' ring), a fused (leaky) ReLU (bit for bit the plain forward's through
// elementwise::leaky_relu); boxes (within bfloat16's tolerance of the unrounded reference), a
// concat's parts and streamed outputs bit for bit the whole tensor's; a layer of doubled channels
// too (no pair taps). TESSERA_NARROW_BF16=0 or --precision float32: the float32 kernels.
bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool narrow_bf16_switched_off() {
  const char* env = std::getenv("TESSERA_NARROW_BF16");
  return env != nullptr && std::string(env) == "0";
}

// Skips a test of the bfloat16 dot products where they do not compute (narrow_conv_bf16_dot), and
// switches the narrow kernels on for it.
#define REQUIRE_DOT_PRODUCTS()                                                            \
  REQUIRE_NARROW_KERNELS();                                                               \
  if (!cpu_has_avx512_bf16() || amx::available())                                         \
    GTEST_SKIP() << "the CPU has no AVX512_BF16, or has AMX (the AMX kernels take bf16)"; \
  if (narrow_bf16_switched_off()) GTEST_SKIP() << "TESSERA_NARROW_BF16=0"

TEST(NarrowConv, DotProductsUnderBf16MatchTheReferenceOnRoundedInputs) {
  REQUIRE_DOT_PRODUCTS();
  EXPECT_TRUE(narrow_conv_bf16_dot());
  EXPECT_EQ(make(same_case(1, 8, 8, 3, 1, 3, 20, false))->name(), "narrow avx512");  // float32
  struct Bf16 {
    Bf16() { set_conv_bf16(true); }
    ~Bf16() { set_conv_bf16(false); }
  } bf16_scope;
  const auto check = [&](const Case& c, const std::optional<FusedActivation>& f = std::nullopt) {
    ConvShapes shapes = c.shapes();
    shapes.activation = f;
    std::unique_ptr<ConvKernel<float>> k = make_narrow_conv(shapes, c.geometry());
    ASSERT_NE(k, nullptr) << c.str();
    EXPECT_EQ(k->name(), "narrow avx512 bf16") << c.str();
    expect_matches_rounded_reference(*k, c, f);
    if (f) return;
    expect_box_kernels_named(c, "narrow avx512 bf16", 1e-2);
  };
  const std::int64_t channels[][2] = {{13, 12}, {16, 8}, {24, 8}, {8, 16}, {3, 8}, {1, 3}, {64, 8}};
  for (std::int64_t w = 1; w <= 100; w += 3) {
    const auto [c, o] = channels[w % 7];
    check(narrow_case(1 + w % 2, c, o, 3, 1, 2 + w % 3, w, w % 3 == 0));
    check(same_case(1, c, o, 3, 1, 3, w, w % 2 == 0));
  }
  check(narrow_case(1, 3, 8, 3, 1, 4, 600, false));  // two filter pieces
  check(same_case(1, 5, 8, 3, 1, 3, 530, true));
  for (std::int64_t kernel : {2, 3, 5, 7})
    for (std::int64_t dilation : {1, 2})
      check(padded_case(2, 11, 5, kernel, dilation, 5, 19 + 4 * kernel, kernel % 2, dilation,
                        dilation * (kernel - 1) - dilation));
  check(same_case(3, 24, 8, 3, 1, 21, 40, false));
  {
    const Threads two(2);
    check(same_case(2, 24, 8, 3, 1, 21, 70, true));
    check(same_case(1, 12, 16, 3, 2, 13, 50, false));
  }
  for (const FusedActivation f :
       {FusedActivation{.kind = ActivationKind::relu},
        FusedActivation{.kind = ActivationKind::leaky_relu, .slope = 0.1}})
    check(same_case(2, 19, 8, 3, 1, 7, 61, true), f);
  expect_fused_activation_bit_for_bit(same_case(2, 19, 8, 3, 1, 7, 61, true));
  expect_parts_bit_for_bit("narrow avx512 bf16");
  expect_streamed_bit_for_bit(same_case(2, 24, 8, 3, 1, 5, 96, true));
  // Doubled channels (an upsampling's output, ConvShapes::doubled_begin), on such an input: all 9
  // taps in bfloat16 (the filter gradient's twin rows: DotFilterGradientReadsEachBlocksRowsOnce).
  const Case d = same_case(1, 24, 8, 3, 1, 6, 40, false);
  ConvShapes doubled = d.shapes();
  doubled.doubled_begin = 0;
  doubled.doubled_end = 16;
  doubled.doubled_parity = BoxAt{0, 0};
  std::unique_ptr<ConvKernel<float>> k = make_narrow_conv(doubled, d.geometry());
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->name(), "narrow avx512 bf16");
  const Tensor<float> xd = doubled_input(d, 0, 16, BoxAt{0, 0}, 61);
  expect_matches_rounded_reference(*k, d, std::nullopt, &xd);
}

// Pair taps (ConvShapes::doubled_begin): where some input channels hold 2x2 blocks of equal values,
// a 3x3 kernel reads each block's row and column once (4 products instead of 9 per channel and
// output). Forward (with bias and a fused ReLU), backward-filter and the fused backward against
// the float64 reference on such inputs: "same" padding (a windowless tile) and none (a window
// with its halo), every parity of x's origin, the doubled channels first, last or between, row
// widths around the 48-column blocks and the filter's 512-column pieces, several samples, 1 and 2
// threads; the concat's parts bit for bit the whole tensor's. Blocks split by x's edges (an odd
// tile start with "same" padding) decline the pair taps and still match. On random input (no
// blocks) the pair taps' forward differs from the reference: the test can fail. Under bf16 such
// kernels stay float32.
TEST(NarrowConv, PairTapsReadEachBlockOnce) {
  REQUIRE_NARROW_KERNELS();
  struct PairCase {
    Case c;
    std::int64_t begin, end;
    BoxAt parity;
    bool pairs;  // whether the pair taps apply
  };
  std::vector<PairCase> cases;
  std::int64_t i = 0;
  for (std::int64_t width : {6, 47, 50, 97, 530, 1030})
    for (const auto& [channels, begin, end] :
         {std::tuple{24, 0, 16}, {24, 16, 24}, {32, 8, 24}, {8, 0, 8}, {13, 8, 13}})
      for (std::int64_t pad : {1, 0}) {
        ++i;
        const std::int64_t height = 4 + i % 5;
        Case c = pad == 1 ? same_case(1 + i % 2, channels, i % 3 == 0 ? 5 : 8, 3, 1, height, width,
                                      i % 2 == 0)
                          : narrow_case(1 + i % 2, channels, 8, 3, 1, height, width, i % 2 == 0);
        // "same" padding: x is the tile, whose edges must not split a block (even starts; odd
        // heights and widths end on the image's edge, a block's end); no padding: x is the
        // window, one row and column before the tile (odd starts: tiles starting at even ones;
        // even: tiles at odd ones, their first block's other half in the halo).
        for (BoxAt parity : {BoxAt{0, 0}, BoxAt{1, 1}, BoxAt{0, 1}, BoxAt{1, 0}}) {
          const bool split = pad == 1 ? (parity.h == 1 || parity.w == 1 || (c.x().h % 2 == 1) ||
                                         (c.x().w % 2 == 1))
                                      : false;
          cases.push_back({c, begin, end, parity, !split});
        }
      }
  int paired = 0;
  for (const PairCase& p : cases) {
    const Case& c = p.c;
    const std::string what = c.str() + ", doubled " + std::to_string(p.begin) + "-" +
                             std::to_string(p.end) + " at parity " + std::to_string(p.parity.h) +
                             "," + std::to_string(p.parity.w);
    ConvShapes s = c.shapes();
    s.doubled_begin = p.begin;
    s.doubled_end = p.end;
    s.doubled_parity = p.parity;
    s.activation = FusedActivation{.kind = ActivationKind::relu};
    std::unique_ptr<ConvKernel<float>> k = make_narrow_conv(s, c.geometry());
    ASSERT_NE(k, nullptr) << what;
    EXPECT_EQ(k->name(), p.pairs ? "narrow avx512, pair taps" : "narrow avx512") << what;
    paired += p.pairs;
    const ConvGeometry g = c.geometry();
    const Tensor<float> x = doubled_input(c, p.begin, p.end, p.parity, 31);
    const Tensor<float> w = random_tensor(c.w(), 32), dy = random_tensor(c.y(), 33);
    const Tensor<float> b = c.bias ? random_tensor({c.o, 1, 1, 1}, 34) : Tensor<float>();
    const Tensor<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy),
                         bd = to_double(b);
    Tensor<double> yd(c.y());
    reference::conv2d_forward(xd, wd, bd.span(), yd, g);
    for (std::int64_t j = 0; j < yd.numel(); ++j)
      yd.data()[j] = std::max(yd.data()[j], 0.0);
    Tensor<double> dwd(c.w()), dbd({c.o, 1, 1, 1});
    reference::conv2d_backward_filter(xd, dyd, dwd, c.bias ? dbd.span() : std::span<double>(), g);
    for (int threads : {1, 2}) {
      const Threads scope(threads);
      Tensor<float> y(c.y(), 7.0f);
      k->forward(x, w, b.span(), y);
      EXPECT_LE(rel_error(y.span(), yd.span()), kTolerance) << "forward, " << what;
      Tensor<float> dw(c.w()), db({c.o, 1, 1, 1});
      const std::span<float> bias = c.bias ? db.span() : std::span<float>();
      k->backward_filter(x, dy, dw, bias);
      EXPECT_LE(rel_error(dw.span(), dwd.span()), kTolerance) << "backward-weights, " << what;
      if (c.bias) {
        EXPECT_LE(rel_error(db.span(), dbd.span()), kTolerance) << "bias, " << what;
      }
      // The fused backward (x and y of one height) gives the separate passes' bits.
      Tensor<float> dx(c.x()), dx_fused(c.x()), dw_fused(c.w()), db_fused({c.o, 1, 1, 1});
      if (k->backward_fused(x, dy, w, std::nullopt, dx_fused, dw_fused,
                            c.bias ? db_fused.span() : std::span<float>())) {
        k->backward_data(dy, w, dx);
        EXPECT_TRUE(same_bits(dx_fused, dx)) << "fused dx, " << what;
        EXPECT_TRUE(same_bits(dw_fused, dw)) << "fused dw, " << what;
      }
    }
    // A concat's parts: the doubled channels a part of their own.
    std::vector<std::int64_t> channels;
    std::int64_t last = 0;
    for (std::int64_t edge : {p.begin, p.end, c.c})
      if (edge > last) channels.push_back(edge - last), last = edge;
    std::vector<Tensor<float>> xs = split(x, channels);
    const std::vector<const Tensor<float>*> in = pointers<const Tensor<float>>(xs);
    Tensor<float> y(c.y()), y_parts(c.y());
    k->forward(x, w, b.span(), y);
    k->forward_parts(in, w, b.span(), y_parts);
    EXPECT_TRUE(same_bits(y, y_parts)) << "forward parts, " << what;
    Tensor<float> dw(c.w()), dw_parts(c.w());
    k->backward_filter(x, dy, dw, {});
    k->backward_filter_parts(in, dy, dw_parts, {});
    EXPECT_TRUE(same_bits(dw, dw_parts)) << "filter parts, " << what;
  }
  EXPECT_GT(paired, 100);
  // Random input: the blocks the pair taps assume are not there.
  const Case c = same_case(1, 24, 8, 3, 1, 6, 40, false);
  ConvShapes s = c.shapes();
  s.doubled_begin = 0;
  s.doubled_end = 16;
  s.doubled_parity = BoxAt{};
  std::unique_ptr<ConvKernel<float>> k = make_narrow_conv(s, c.geometry());
  const Tensor<float> x = random_tensor(c.x(), 41), w = random_tensor(c.w(), 42);
  Tensor<float> y(c.y());
  k->forward(x, w, {}, y);
  Tensor<double> yd(c.y());
  reference::conv2d_forward(to_double(x), to_double(w), {}, yd, c.geometry());
  EXPECT_GT(rel_error(y.span(), yd.span()), 1e-2);
  // Under --precision bf16 on AMX every kernel of such a layer computes in float32, its border
  // strips' too (told the channels, not where the blocks lie): a sharded run's border outputs
  // would otherwise be bfloat16's products where one rank computes float32's
  // (cli_precision_bf16's gradcheck failed so).
  if (amx::available()) {
    set_conv_bf16(true);
    ConvShapes strip = c.shapes();
    strip.doubled_begin = 0;
    strip.doubled_end = 16;
    EXPECT_EQ(make_narrow_conv(strip, c.geometry())->name(), "narrow avx512");
    EXPECT_EQ(make_narrow_conv(s, c.geometry())->name(), "narrow avx512, pair taps");
    strip.doubled_end = 0;
    EXPECT_EQ(make_narrow_conv(strip, c.geometry())->name(), "narrow tessera amx");
    set_conv_bf16(false);
  }
}

// Twin tap rows (FilterJob::twin_rows): under the bfloat16 dot products, the filter gradient of
// doubled channels computes the products of two tap rows that read one block's two rows once and
// adds them to both: bit for bit the kernel told nothing of the blocks, in backward_filter, the
// fused backward and from a concat's parts, at every parity of x's origin, "same" padding (a
// windowless tile, odd heights ending on a block's first row) and none (a window), 3x3 and 5x5
// kernels (two twins a row), 1 and 2 threads. On random input (no blocks) the results differ:
// the test can fail.
TEST(NarrowConv, DotFilterGradientReadsEachBlocksRowsOnce) {
  REQUIRE_DOT_PRODUCTS();
  struct Bf16 {
    Bf16() { set_conv_bf16(true); }
    ~Bf16() { set_conv_bf16(false); }
  } bf16_scope;
  std::int64_t i = 0;
  for (std::int64_t kernel : {3, 5})
    for (std::int64_t height : {6, 7})
      for (std::int64_t width : {9, 70})
        for (bool pad : {true, false})
          for (BoxAt parity : {BoxAt{0, 0}, BoxAt{1, 1}, BoxAt{1, 0}}) {
            ++i;
            const Case c =
                pad ? same_case(1 + i % 2, 24, 8, kernel, 1, height, width, i % 2 == 0)
                    : narrow_case(1 + i % 2, 24, 8, kernel, 1, height, width, i % 2 == 0);
            const std::int64_t begin = i % 3 == 0 ? 8 : 0, end = begin + 16;
            const std::string what = c.str() + ", doubled " + std::to_string(begin) + "-" +
                                     std::to_string(end) + " at parity " +
                                     std::to_string(parity.h) + "," + std::to_string(parity.w);
            ConvShapes s = c.shapes();
            s.doubled_begin = begin;
            s.doubled_end = end;
            s.doubled_parity = parity;
            std::unique_ptr<ConvKernel<float>> twins = make_narrow_conv(s, c.geometry());
            std::unique_ptr<ConvKernel<float>> plain = make_narrow_conv(c.shapes(), c.geometry());
            ASSERT_NE(twins, nullptr) << what;
            ASSERT_NE(plain, nullptr) << what;
            EXPECT_EQ(twins->name(), "narrow avx512 bf16") << what;
            const Tensor<float> x = doubled_input(c, begin, end, parity, 51);
            const Tensor<float> w = random_tensor(c.w(), 52), dy = random_tensor(c.y(), 53);
            const auto bias = [&](Tensor<float>& t) {
              return c.bias ? t.span() : std::span<float>();
            };
            for (int threads : {1, 2}) {
              const Threads scope(threads);
              Tensor<float> dw(c.w()), dw_plain(c.w()), db({c.o, 1, 1, 1}), db_plain(db.shape());
              twins->backward_filter(x, dy, dw, bias(db));
              plain->backward_filter(x, dy, dw_plain, bias(db_plain));
              EXPECT_TRUE(same_bits(dw, dw_plain)) << "backward-weights, " << what;
              EXPECT_TRUE(same_bits(db, db_plain)) << "bias, " << what;
              Tensor<float> dx(c.x()), dx_plain(c.x()), dwf(c.w()), dwf_plain(c.w());
              Tensor<float> dbf(db.shape()), dbf_plain(db.shape());
              if (twins->backward_fused(x, dy, w, std::nullopt, dx, dwf, bias(dbf))) {
                ASSERT_TRUE(plain->backward_fused(x, dy, w, std::nullopt, dx_plain, dwf_plain,
                                                  bias(dbf_plain)))
                    << what;
                EXPECT_TRUE(same_bits(dwf, dwf_plain)) << "fused dw, " << what;
                EXPECT_TRUE(same_bits(dx, dx_plain)) << "fused dx, " << what;
              }
            }
            const std::int64_t cut = begin > 0 ? begin : end;  // the doubled channels a part
            std::vector<Tensor<float>> xs = split(x, {cut, c.c - cut});
            const std::vector<const Tensor<float>*> in = pointers<const Tensor<float>>(xs);
            Tensor<float> dw(c.w()), dw_parts(c.w());
            plain->backward_filter(x, dy, dw, {});
            twins->backward_filter_parts(in, dy, dw_parts, {});
            EXPECT_TRUE(same_bits(dw, dw_parts)) << "filter parts, " << what;
          }
  // Random input: the rows the twins take for equal are not.
  const Case c = same_case(1, 24, 8, 3, 1, 6, 40, false);
  ConvShapes s = c.shapes();
  s.doubled_begin = 0;
  s.doubled_end = 16;
  s.doubled_parity = BoxAt{};
  const Tensor<float> x = random_tensor(c.x(), 54), dy = random_tensor(c.y(), 55);
  Tensor<float> dw(c.w()), dw_plain(c.w());
  make_narrow_conv(s, c.geometry())->backward_filter(x, dy, dw, {});
  make_narrow_conv(c.shapes(), c.geometry())->backward_filter(x, dy, dw_plain, {});
  EXPECT_FALSE(same_bits(dw, dw_plain));
}

TEST(ConvKernel, GathersAConcatsPartsByDefault) {
  const Case c = same_case(2, 24, 8, 3, 1, 5, 9, true);
  ReferenceConv<float> k(c.geometry(), c.shapes());
  EXPECT_FALSE(k.reads_parts());
  expect_parts_match(k, c, {16, 8});
}

TEST(NarrowConv, DeclinesWhatItDoesNotTake) {
  REQUIRE_NARROW_KERNELS();
  const Case base = narrow_case(1, 8, 8, 3, 1, 5, 9, false);
  ASSERT_NE(make(base), nullptr);
  const auto declined = [&](auto change, const std::string& why) {
    Case c = base;
    change(c);
    EXPECT_EQ(make(c), nullptr) << why;
  };
  declined([](Case& c) { c.stride = 2; }, "stride 2");
  declined([](Case& c) { c.groups = 2; }, "groups");
  // Padding in the kernel within the span (3x3: 0 to 2 before and after) is taken; past it or
  // negative declined: before, after, or both, and per axis.
  for (auto [before, after] : {std::pair{3, 0}, {0, 3}, {3, 3}, {-1, 1}, {1, -1}, {-1, -1}, {2, 3}})
    declined([&](Case& c) { c.pad = before, c.pad_after = after; },
             "padding " + std::to_string(before) + " before, " + std::to_string(after) + " after");
  declined([](Case& c) { c.dilation = 2, c.pad = 5, c.pad_after = 0; }, "padding 5 at dilation 2");
  {
    const ConvShapes s{.x = {1, 8, 5, 9}, .w = {8, 8, 1, 3}, .y = {1, 8, 5, 9}, .bias = false};
    EXPECT_NE(make_narrow_conv(s, {.pad_left = 1}), nullptr) << "1x3, padding 1 x 1";
    EXPECT_EQ(make_narrow_conv(s, {.pad_top = 1, .pad_left = 1}), nullptr)
        << "1x3, padding 1 on the rows";
    const ConvShapes short_x{.x = {1, 8, 4, 9}, .w = {8, 8, 1, 3}, .y = {1, 8, 5, 9}};
    EXPECT_EQ(make_narrow_conv(short_x, {.pad_left = 1}), nullptr) << "1x3, a row padded after";
  }
  declined([](Case& c) { c.kernel = 1; }, "1x1 (the GEMM heads' case)");
  declined([](Case& c) { c.kernel = 8; }, "kernel 8x8");
  // Channels oneDNN's kernels compute faster, or too many.
  for (auto [in, out] : {std::pair{16, 16}, {32, 16}, {48, 16}, {65, 8}, {8, 17}})
    declined([&](Case& c) { c.c = in, c.o = out; },
             std::to_string(in) + " -> " + std::to_string(out) + " channels");
  // 16 -> 16 from an input that comes in NCHW anyway is taken; more inputs are not.
  for (auto [in, out] : {std::pair{16, 16}, {32, 16}, {48, 16}, {65, 8}, {8, 17}}) {
    Case c = base;
    c.c = in, c.o = out;
    ConvShapes nchw = c.shapes();
    nchw.x_nchw = true;
    EXPECT_EQ(make_narrow_conv(nchw, c.geometry()) != nullptr, in == 16)
        << in << " -> " << out << " channels from NCHW";
  }
  ConvShapes s = base.shapes();
  s.activation = FusedActivation{.kind = ActivationKind::sigmoid};
  EXPECT_EQ(make_narrow_conv(s, base.geometry()), nullptr) << "a fused sigmoid";
  for (Layout layout : {Layout::nchw8c, Layout::nchw16c}) {
    s = base.shapes();
    s.x_layout = layout;
    EXPECT_EQ(make_narrow_conv(s, base.geometry()), nullptr) << to_string(layout);
    s = base.shapes();
    s.y_layout = layout;
    EXPECT_EQ(make_narrow_conv(s, base.geometry()), nullptr) << to_string(layout);
  }
  s = base.shapes();
  s.x_outer = {1, 8, 7, 11};  // the box's 7 x 11 does not fit at (1, 1)
  s.y_outer = {1, 8, 6, 10};
  s.x_at = {1, 1};
  EXPECT_EQ(make_narrow_conv(s, base.geometry()), nullptr) << "a box outside its tensor";
  {
    const NarrowSwitch off(false);
    EXPECT_EQ(make(base), nullptr) << "switched off";
  }
  const SimdLevel level = simd_level();
  set_simd_level(SimdLevel::baseline);
  EXPECT_EQ(make(base), nullptr) << "TESSERA_SIMD=baseline";
  set_simd_level(level);
  set_conv_bf16(true);  // they compute in float32 then (oneDNN's bf16 kernels pad 8 channels)
  EXPECT_NE(make(base), nullptr) << "--precision bf16";
  set_conv_bf16(false);
}

#if TESSERA_HAVE_ONEDNN
// The oneDNN backend hands the narrow kernel out in NCHW and declines blocked layouts for its
// cases, so that Conv2d plans NCHW windows and outputs for them (unet-small's 24 -> 8 conv after a
// concat, here): the reference's results either way, and oneDNN's 8-channel blocks when the
// narrow kernels are off.
TEST(NarrowConv, TheOneDnnBackendPlansNchwForItsCases) {
  REQUIRE_NARROW_KERNELS();
  const Backend& backend = backend_of(KernelBackend::onednn);
  const Case c = narrow_case(1, 24, 8, 3, 1, 6, 20, false);
  ConvShapes s = c.shapes();
  EXPECT_EQ(backend.conv<float>(s, c.geometry())->name(), "narrow avx512");
  s.x_layout = Layout::nchw8c;
  s.y_layout = Layout::nchw8c;
  EXPECT_EQ(backend.conv<float>(s, c.geometry()), nullptr);
  {
    const NarrowSwitch off(false);
    EXPECT_TRUE(backend.conv<float>(s, c.geometry())->name().starts_with("onednn"));
  }

  const Runtime& single = test::single_runtime(KernelBackend::onednn);
  const Distribution in{{1, 24, 20, 22}, single.comm().shape(), single.comm().coords()};
  const Conv2dSpec spec{
      .out_channels = 8, .kernel = {3, 3}, .pad_begin = {1, 1}, .pad_end = {1, 1}, .bias = false};
  for (bool narrow : {true, false}) {
    const NarrowSwitch scope(narrow);
    Conv2d<float> conv("d1", spec, 1);
    conv.setup(in);
    // What the model asks before it decides layouts: the padded image's shapes.
    EXPECT_EQ(conv.computes_in_nchw(backend), narrow);
    conv.allow_blocked_output(true);
    conv.bind(single);
    EXPECT_EQ(conv.kernel()->name() == "narrow avx512", narrow) << conv.kernel()->name();
    DistTensor<float> x;
    x.dist = in;
    x.local = random_tensor(in.local_shape(), 7);
    EXPECT_EQ(conv.forward(x, RunState{}).layout(), narrow ? Layout::nchw : Layout::nchw8c);
  }
}
#endif

}  // namespace
}  // namespace tessera
