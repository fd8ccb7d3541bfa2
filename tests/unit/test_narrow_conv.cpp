// The narrow convolution kernels (AVX-512, vectorised over pixels) against the float64 reference:
// the sweep's cases they take, every row width up to two of their 48-column blocks and more
// (the masked edges of all three passes), channel counts that fill no block of 8, non-square
// kernels and unequal dilations, box kernels; that the filter gradients are the same on every run
// and add into dw; the cases they decline; and that the oneDNN backend plans NCHW for them.
// Skipped where the CPU has no AVX-512. Single process.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>

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
// switches the kernels on for it (by default they are on only where they pay:
// wide_multiplies_pay).
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

TEST(NarrowConv, MatchesTheReferenceForEveryKernelExtentAndDilation) {
  REQUIRE_NARROW_KERNELS();
  for (std::int64_t kernel : {2, 3, 4, 5, 7})
    for (std::int64_t dilation : {1, 2, 3})
      expect_both_match(narrow_case(2, 6, 5, kernel, dilation, 5, 19 + 4 * kernel, kernel % 2));
  expect_both_match(narrow_case(1, 64, 8, 3, 1, 3, 37, true));
}

// Non-square kernels and dilations that differ between the axes, through the reference directly
// (Case has one extent and one dilation).
TEST(NarrowConv, MatchesTheReferenceForNonSquareKernels) {
  REQUIRE_NARROW_KERNELS();
  struct Geometry {
    std::int64_t kh, kw, dh, dw;
  };
  for (const Geometry& q : {Geometry{1, 3, 1, 1}, Geometry{3, 1, 1, 1}, Geometry{2, 5, 1, 2},
                            Geometry{7, 2, 2, 1}, Geometry{3, 3, 2, 1}}) {
    const std::int64_t n = 2, c = 7, o = 9, oh = 6, ow = 53;
    const ConvGeometry g{.dilation_h = q.dh, .dilation_w = q.dw};
    const ConvShapes s{.x = {n, c, oh + q.dh * (q.kh - 1), ow + q.dw * (q.kw - 1)},
                       .w = {o, c, q.kh, q.kw},
                       .y = {n, o, oh, ow},
                       .bias = true};
    const std::string what = "kernel " + std::to_string(q.kh) + "x" + std::to_string(q.kw) +
                             " dilation " + std::to_string(q.dh) + "x" + std::to_string(q.dw);
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
// every run with the same thread count, and within float rounding of one thread's on two.
TEST(NarrowConv, FilterGradientsAreTheSameOnEveryRun) {
  REQUIRE_NARROW_KERNELS();
  const Case c = narrow_case(2, 24, 8, 3, 1, 33, 70, true);
  std::unique_ptr<ConvKernel<float>> k = make(c);
  ASSERT_NE(k, nullptr);
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
    EXPECT_EQ(std::memcmp(dw1.data(), dw2.data(), dw1.numel() * sizeof(float)), 0) << threads;
    EXPECT_EQ(std::memcmp(db1.data(), db2.data(), db1.numel() * sizeof(float)), 0) << threads;
    const Threads one(1);
    const auto [dw_one, db_one] = filter();
    EXPECT_LE(rel_error(dw1.span(), dw_one.span()), 1e-6) << threads;
    EXPECT_LE(rel_error(db1.span(), db_one.span()), 1e-6) << threads;
  }
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
  declined([](Case& c) { c.pad = 1; }, "padding inside the kernel");
  declined([](Case& c) { c.kernel = 1; }, "1x1 (the GEMM heads' case)");
  declined([](Case& c) { c.kernel = 8; }, "kernel 8x8");
  // Channels oneDNN's kernels compute faster, or too many.
  for (auto [in, out] : {std::pair{16, 16}, {32, 16}, {48, 16}, {65, 8}, {8, 17}})
    declined([&](Case& c) { c.c = in, c.o = out; },
             std::to_string(in) + " -> " + std::to_string(out) + " channels");
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
  set_conv_bf16(true);
  EXPECT_EQ(make(base), nullptr) << "--precision bf16";
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
