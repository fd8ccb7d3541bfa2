// The AMX correlation kernel (include/tessera/kernels/amx_conv.hpp), against the float64
// reference computed from the same bfloat16-rounded inputs, and as OneDnnConv runs it under
// --precision bf16. Skipped on CPUs without AMX. Single process.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "conv_cases.hpp"
#include "tessera/kernels/amx_conv.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera_config.h"
#if TESSERA_HAVE_ONEDNN
#include "tessera/kernels/onednn_conv.hpp"
#endif

namespace tessera {
namespace {

using conv_cases::random_tensor;
using conv_cases::rounded;
using test::rel_error;

struct AmxCase {
  std::int64_t n, in_c, out_c, kh, kw, dil, pad_top, pad_left, pad_bottom, pad_right, out_h, out_w;
  bool bias;
  std::optional<FusedActivation> f;

  Shape4 in() const {
    return {n, in_c, out_h + dil * (kh - 1) - pad_top - pad_bottom,
            out_w + dil * (kw - 1) - pad_left - pad_right};
  }
  Shape4 out() const { return {n, out_c, out_h, out_w}; }
  amx::Correlation correlation() const {
    return {.in = in(),
            .out = out(),
            .kh = kh,
            .kw = kw,
            .pad_top = pad_top,
            .pad_left = pad_left,
            .dil_h = dil,
            .dil_w = dil};
  }
  reference::ConvGeometry geometry() const {
    return {.stride_h = 1,
            .stride_w = 1,
            .dilation_h = dil,
            .dilation_w = dil,
            .pad_top = pad_top,
            .pad_left = pad_left,
            .groups = 1};
  }
  std::string str() const {
    return "n" + std::to_string(n) + " " + std::to_string(in_c) + "->" + std::to_string(out_c) +
           " k" + std::to_string(kh) + "x" + std::to_string(kw) + " d" + std::to_string(dil) +
           " pad " + std::to_string(pad_top) + "," + std::to_string(pad_left) + "," +
           std::to_string(pad_bottom) + "," + std::to_string(pad_right) + " out " +
           std::to_string(out_h) + "x" + std::to_string(out_w) + (bias ? " bias" : "") +
           (f ? (f->kind == ActivationKind::relu ? " relu" : " leaky") : "");
  }
};

// Widths below, at and past a tile's 16 pixels (the last tile overlapping the one before), odd
// channel chunks (16 and 48 inputs: a chunk of 32 half padding), odd output blocks, padding on
// either side or none (a window), asymmetric and over-wide padding (the adjoint's then negative),
// dilations, non-square kernels, samples, heights past backward-weights' groups of rows.
std::vector<AmxCase> amx_cases() {
  const FusedActivation relu{ActivationKind::relu, 0}, leaky{ActivationKind::leaky_relu, 0.1};
  return {
      {1, 32, 32, 3, 3, 1, 1, 1, 1, 1, 5, 37, true, relu},
      {2, 16, 48, 3, 3, 1, 1, 1, 1, 1, 4, 16, false, std::nullopt},
      {1, 48, 16, 3, 3, 2, 2, 2, 2, 2, 3, 7, true, leaky},
      {2, 64, 32, 1, 1, 1, 0, 0, 0, 0, 3, 33, true, std::nullopt},
      {1, 32, 16, 5, 3, 1, 0, 0, 0, 0, 2, 18, false, relu},
      {1, 16, 16, 3, 5, 1, 2, 0, 1, 3, 6, 20, true, std::nullopt},
      {1, 32, 48, 3, 3, 1, 0, 2, 2, 0, 4, 31, true, leaky},
      {3, 16, 32, 2, 2, 1, 1, 1, 0, 0, 3, 9, false, std::nullopt},
      {1, 32, 32, 3, 3, 1, 3, 3, 3, 3, 6, 40, false, std::nullopt},
      // Taller than a backward-weights group of rows (up to 8): groups end inside a sample.
      {2, 32, 16, 3, 3, 1, 1, 1, 1, 1, 21, 9, true, relu},
      {1, 16, 32, 3, 3, 2, 2, 2, 2, 2, 19, 5, false, std::nullopt},
  };
}

Tensor<double> activated(Tensor<double> y, const std::optional<FusedActivation>& f) {
  if (f)
    for (double& v : y.span())
      v = elementwise::leaky_relu(v, f->kind == ActivationKind::leaky_relu ? f->slope : 0.0);
  return y;
}

// The three passes on the kernels themselves (backward-data as the adjoint's correlation): within
// float32 sums' rounding of the float64 reference on bfloat16-rounded factors (dbias: dy's float32
// sums), the gradients added into what dw and dbias held.
TEST(AmxConv, CorrelationMatchesTheReferenceOnRoundedInputs) {
  if (!amx::available()) GTEST_SKIP() << "no AMX on this CPU (or TESSERA_AMX=0)";
  for (const AmxCase& c : amx_cases()) {
    const Shape4 xs = c.in(), ys = c.out(), ws{c.out_c, c.in_c, c.kh, c.kw};
    const Tensor<float> x = random_tensor(xs, 1), w = random_tensor(ws, 2);
    const Tensor<float> dy = random_tensor(ys, 3);
    const Tensor<float> b = c.bias ? random_tensor({c.out_c, 1, 1, 1}, 4) : Tensor<float>();
    const Tensor<double> bd = conv_cases::to_double(b);

    const amx::Correlation correlation = c.correlation();
    std::unique_ptr<amx::Conv> forward = amx::Conv::plan(correlation);
    ASSERT_NE(forward, nullptr) << c.str();
    forward->set_weights(w.data(), false);
    const Tensor<float> x16 = to_layout(x, Layout::nchw16c);
    Tensor<float> y16(ys, Layout::nchw16c, 7.0f);
    forward->run(x16.data(), b.span(), c.f, y16.data());
    Tensor<double> yd(ys);
    reference::conv2d_forward(rounded(x), rounded(w), bd.span(), yd, c.geometry());
    yd = activated(std::move(yd), c.f);
    EXPECT_LE(rel_error(to_layout(y16, Layout::nchw).span(), yd.span()), 1e-5)
        << "forward, " << c.str();

    std::unique_ptr<amx::Conv> data = amx::Conv::plan(amx::adjoint(correlation));
    ASSERT_NE(data, nullptr) << c.str();
    data->set_weights(w.data(), true);
    const Tensor<float> dy16 = to_layout(dy, Layout::nchw16c);
    Tensor<float> dx16(xs, Layout::nchw16c, 7.0f);
    data->run(dy16.data(), {}, std::nullopt, dx16.data());
    Tensor<double> dxd(xs);
    reference::conv2d_backward_data(rounded(dy), rounded(w), dxd, c.geometry());
    EXPECT_LE(rel_error(to_layout(dx16, Layout::nchw).span(), dxd.span()), 1e-5)
        << "backward-data, " << c.str();

    std::unique_ptr<amx::ConvWeights> weights = amx::ConvWeights::plan(correlation);
    ASSERT_NE(weights, nullptr) << c.str();
    // Added into what dw and dbias held.
    Tensor<float> dw = random_tensor(ws, 5);
    Tensor<float> db = c.bias ? random_tensor({c.out_c, 1, 1, 1}, 6) : Tensor<float>();
    Tensor<double> dwd = conv_cases::to_double(dw), dbd = conv_cases::to_double(db);
    weights->run(x16.data(), dy16.data(), dw.data(), db.span());
    // dbias from float32 dy; dw from the rounded factors.
    reference::conv2d_backward_filter(rounded(x), rounded(dy), dwd, std::span<double>(),
                                      c.geometry());
    Tensor<double> unused(ws);
    reference::conv2d_backward_filter(conv_cases::to_double(x), conv_cases::to_double(dy), unused,
                                      dbd.span(), c.geometry());
    EXPECT_LE(rel_error(dw.span(), dwd.span()), 1e-5) << "backward-weights, " << c.str();
    EXPECT_LE(rel_error(db.span(), dbd.span()), 1e-5) << "backward-bias, " << c.str();
  }
}

// The NCHW passes (plan_nchw, run_planes) for channel counts that fill no block or chunk: within
// float32 sums' rounding of the float64 reference on bfloat16-rounded factors, as above; the
// output's planes a box of a larger tensor (rows and planes farther apart than its width), the
// input's a concat's two parts.
TEST(AmxConv, NchwPlanesMatchTheReferenceOnRoundedInputs) {
  if (!amx::available()) GTEST_SKIP() << "no AMX on this CPU (or TESSERA_AMX=0)";
  const FusedActivation relu{ActivationKind::relu, 0}, leaky{ActivationKind::leaky_relu, 0.1};
  const AmxCase cases[] = {
      {1, 3, 8, 3, 3, 1, 1, 1, 1, 1, 5, 37, true, relu},
      {2, 24, 8, 3, 3, 1, 1, 1, 1, 1, 4, 16, false, std::nullopt},
      {1, 8, 16, 3, 3, 2, 2, 2, 2, 2, 3, 7, true, leaky},
      {1, 37, 5, 3, 3, 1, 0, 0, 0, 0, 2, 18, false, std::nullopt},
      {1, 64, 8, 3, 3, 1, 1, 1, 1, 1, 3, 33, true, std::nullopt},
      {1, 8, 24, 5, 3, 1, 2, 1, 2, 1, 4, 1, false, relu},
      {2, 13, 12, 3, 3, 1, 1, 1, 1, 1, 21, 9, true, std::nullopt},
  };
  for (const AmxCase& c : cases) {
    const Shape4 xs = c.in(), ys = c.out(), ws{c.out_c, c.in_c, c.kh, c.kw};
    const Tensor<float> x = random_tensor(xs, 1), w = random_tensor(ws, 2);
    const Tensor<float> dy = random_tensor(ys, 3);
    const Tensor<float> b = c.bias ? random_tensor({c.out_c, 1, 1, 1}, 4) : Tensor<float>();
    const amx::Correlation correlation = c.correlation();
    // x as two parts: its first channels (a multiple of 8 where there are more than 8), the rest.
    const std::int64_t first = c.in_c > 8 ? c.in_c / 8 * 8 - (c.in_c % 8 == 0 ? 8 : 0) : c.in_c;
    Tensor<float> x0({xs.n, first, xs.h, xs.w}), x1({xs.n, xs.c - first, xs.h, xs.w});
    for (std::int64_t n = 0; n < xs.n; ++n)
      for (std::int64_t i = 0; i < xs.c; ++i)
        for (std::int64_t e = 0; e < xs.h * xs.w; ++e)
          (i < first ? x0.data()[(n * first + i) * xs.h * xs.w + e]
                     : x1.data()[(n * (xs.c - first) + i - first) * xs.h * xs.w + e]) =
              x.data()[(n * xs.c + i) * xs.h * xs.w + e];
    ChannelPlanes<const float> xp;
    xp.parts[0] = {x0.data(), 0, first};
    xp.parts[1] = {x1.data(), first, xs.c - first};
    xp.count = xs.c > first ? 2 : 1;
    xp.plane = xs.h * xs.w;
    xp.row = xs.w;

    std::unique_ptr<amx::Conv> forward = amx::Conv::plan_nchw(correlation);
    ASSERT_NE(forward, nullptr) << c.str();
    forward->set_weights(w.data(), false);
    // y in a box at (1, 2) of a tensor 3 rows and 5 columns larger.
    Tensor<float> outer({ys.n, ys.c, ys.h + 3, ys.w + 5}, 7.0f);
    forward->run_planes(xp, b.span(), c.f, channel_planes(outer.data(), outer.shape(), 1, 2));
    Tensor<float> y(ys);
    copy_box_out(outer, BoxAt{1, 2}, y);
    Tensor<double> yd(ys);
    const Tensor<double> bd = conv_cases::to_double(b);
    reference::conv2d_forward(rounded(x), rounded(w), bd.span(), yd, c.geometry());
    yd = activated(std::move(yd), c.f);
    EXPECT_LE(rel_error(y.span(), yd.span()), 1e-5) << "forward, " << c.str();
    Tensor<float> blank(ys, 7.0f);
    copy_box_in(blank, outer, BoxAt{1, 2});
    for (float v : outer.span())
      ASSERT_EQ(v, 7.0f) << "written outside the box, " << c.str();

    std::unique_ptr<amx::Conv> data = amx::Conv::plan_nchw(amx::adjoint(correlation));
    ASSERT_NE(data, nullptr) << c.str();
    data->set_weights(w.data(), true);
    Tensor<float> dx(xs, 7.0f);
    data->run_planes(channel_planes(dy.data(), ys), {}, std::nullopt,
                     channel_planes(dx.data(), xs));
    Tensor<double> dxd(xs);
    reference::conv2d_backward_data(rounded(dy), rounded(w), dxd, c.geometry());
    EXPECT_LE(rel_error(dx.span(), dxd.span()), 1e-5) << "backward-data, " << c.str();

    std::unique_ptr<amx::ConvWeights> weights = amx::ConvWeights::plan_nchw(correlation);
    ASSERT_NE(weights, nullptr) << c.str();
    Tensor<float> dw = random_tensor(ws, 5);
    Tensor<float> db = c.bias ? random_tensor({c.out_c, 1, 1, 1}, 6) : Tensor<float>();
    Tensor<double> dwd = conv_cases::to_double(dw), dbd = conv_cases::to_double(db);
    weights->run_planes(xp, channel_planes(dy.data(), ys), dw.data(), db.span());
    reference::conv2d_backward_filter(rounded(x), rounded(dy), dwd, std::span<double>(),
                                      c.geometry());
    Tensor<double> unused(ws);
    reference::conv2d_backward_filter(conv_cases::to_double(x), conv_cases::to_double(dy), unused,
                                      dbd.span(), c.geometry());
    EXPECT_LE(rel_error(dw.span(), dwd.span()), 1e-5) << "backward-weights, " << c.str();
    EXPECT_LE(rel_error(db.span(), dbd.span()), 1e-5) << "backward-bias, " << c.str();
  }
}

// Channels that are not a multiple of 16 are not the kernel's.
TEST(AmxConv, DeclinesChannelsOutsideBlocks) {
  if (!amx::available()) GTEST_SKIP() << "no AMX on this CPU (or TESSERA_AMX=0)";
  EXPECT_EQ(amx::Conv::plan({.in = {1, 8, 4, 4}, .out = {1, 16, 4, 4}, .kh = 1, .kw = 1}), nullptr);
  EXPECT_EQ(amx::Conv::plan({.in = {1, 16, 4, 4}, .out = {1, 24, 4, 4}, .kh = 1, .kw = 1}),
            nullptr);
  EXPECT_NE(amx::Conv::plan({.in = {1, 16, 4, 4}, .out = {1, 16, 4, 4}, .kh = 1, .kw = 1}),
            nullptr);
}

#if TESSERA_HAVE_ONEDNN
// Under --precision bf16 a conv between nchw16c tensors, stride 1, runs its three passes on the
// AMX kernels (OneDnnConv::name says so) and they match the float64 reference to bfloat16's
// tolerance, with a fused ReLU too; backward_fused gives the same gradients with the derivative of
// the activation whose output x is applied to dx as it is written.
TEST(AmxConv, OneDnnConvRunsItUnderBf16) {
  if (!amx::available()) GTEST_SKIP() << "no AMX on this CPU (or TESSERA_AMX=0)";
  if (!onednn_bf16_supported()) GTEST_SKIP() << "oneDNN has no bfloat16 convolutions here";
  struct Bf16 {
    Bf16() { set_conv_bf16(true); }
    ~Bf16() { set_conv_bf16(false); }
  } bf16_scope;
  for (const AmxCase& c : amx_cases()) {
    const Shape4 xs = c.in(), ys = c.out(), ws{c.out_c, c.in_c, c.kh, c.kw};
    const reference::ConvGeometry g = c.geometry();
    const ConvShapes shapes{.x = xs,
                            .w = ws,
                            .y = ys,
                            .bias = c.bias,
                            .x_layout = Layout::nchw16c,
                            .y_layout = Layout::nchw16c,
                            .activation = c.f};
    std::unique_ptr<OneDnnConv> k = OneDnnConv::create(shapes, g);
    ASSERT_NE(k, nullptr) << c.str();
    EXPECT_EQ(k->name(), "onednn tessera amx/tessera amx/tessera amx") << c.str();
    const Tensor<float> x = random_tensor(xs, 1), w = random_tensor(ws, 2);
    const Tensor<float> dy = random_tensor(ys, 3);
    const Tensor<float> b = c.bias ? random_tensor({c.out_c, 1, 1, 1}, 4) : Tensor<float>();
    const Tensor<double> xd = conv_cases::to_double(x), wd = conv_cases::to_double(w);
    const Tensor<double> dyd = conv_cases::to_double(dy), bd = conv_cases::to_double(b);
    const Tensor<float> x16 = to_layout(x, Layout::nchw16c), dy16 = to_layout(dy, Layout::nchw16c);

    Tensor<float> y16(ys, Layout::nchw16c, 7.0f);
    k->forward(x16, w, b.span(), y16);
    Tensor<double> yd(ys);
    reference::conv2d_forward(xd, wd, bd.span(), yd, g);
    yd = activated(std::move(yd), c.f);
    EXPECT_LE(rel_error(to_layout(y16, Layout::nchw).span(), yd.span()), 2e-2)
        << "forward, " << c.str();

    Tensor<float> dx16(xs, Layout::nchw16c, 7.0f);
    k->backward_data(dy16, w, dx16);
    Tensor<double> dxd(xs);
    reference::conv2d_backward_data(dyd, wd, dxd, g);
    EXPECT_LE(rel_error(to_layout(dx16, Layout::nchw).span(), dxd.span()), 2e-2)
        << "backward-data, " << c.str();

    Tensor<float> dw(ws), db = c.bias ? Tensor<float>({c.out_c, 1, 1, 1}) : Tensor<float>();
    Tensor<double> dwd(ws), dbd = c.bias ? Tensor<double>({c.out_c, 1, 1, 1}) : Tensor<double>();
    k->backward_filter(x16, dy16, dw, db.span());
    reference::conv2d_backward_filter(xd, dyd, dwd, dbd.span(), g);
    EXPECT_LE(rel_error(dw.span(), dwd.span()), 2e-2) << "backward-weights, " << c.str();
    EXPECT_LE(rel_error(db.span(), dbd.span()), 2e-2) << "backward-bias, " << c.str();

    // backward_fused: backward-data times the derivative of the (leaky) ReLU whose output x is
    // (the conv's own activation, or a leaky one), and backward-weights, in one call.
    const FusedActivation gate = c.f ? *c.f : FusedActivation{ActivationKind::leaky_relu, 0.2};
    Tensor<float> dx_fused(xs, Layout::nchw16c, 7.0f), dw_fused(ws);
    Tensor<float> db_fused = c.bias ? Tensor<float>({c.out_c, 1, 1, 1}) : Tensor<float>();
    ASSERT_TRUE(k->backward_fused(x16, dy16, w, gate, dx_fused, dw_fused, db_fused.span()))
        << c.str();
    const double slope = gate.kind == ActivationKind::leaky_relu ? gate.slope : 0.0;
    Tensor<double> gated = dxd;
    for (std::int64_t e = 0; e < gated.numel(); ++e)
      gated.data()[e] = elementwise::leaky_relu_grad(x.data()[e] > 0, dxd.data()[e], slope);
    EXPECT_LE(rel_error(to_layout(dx_fused, Layout::nchw).span(), gated.span()), 2e-2)
        << "fused backward-data, " << c.str();
    EXPECT_EQ(std::vector<float>(dw_fused.span().begin(), dw_fused.span().end()),
              std::vector<float>(dw.span().begin(), dw.span().end()))
        << "fused backward-weights, " << c.str();
    EXPECT_EQ(std::vector<float>(db_fused.span().begin(), db_fused.span().end()),
              std::vector<float>(db.span().begin(), db.span().end()))
        << "fused backward-bias, " << c.str();
  }
}
#endif

}  // namespace
}  // namespace tessera
