// The oneDNN convolution against the reference kernels (computed in float64 on the same
// float32-rounded data), over kernels 1/2/3/5, strides 1/2/3, dilations 1/2, groups 1/2/depthwise,
// odd sizes, 1 to 3 samples, 3 to 32 channels; and the cases it declines, which must fall back to
// the reference. Single process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tessera/batch.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/kernels/reference_dense.hpp"
#include "tessera/kernels/reference_upsample.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/conv_transpose2d.hpp"
#include "tessera/process_grid.hpp"
#include "tessera/random.hpp"
#include "tessera_config.h"

#include "../common/test_helpers.hpp"
#include "conv_cases.hpp"
#include "unit_test.hpp"
#if TESSERA_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>

#include "tessera/kernels/onednn_conv.hpp"
#endif

namespace tessera {
namespace {

using reference::ConvGeometry;
using namespace conv_cases;

Case declinable_base() {
  return {.n = 2,
          .c = 4,
          .o = 6,
          .groups = 1,
          .kernel = 3,
          .stride = 2,
          .dilation = 1,
          .pad = 0,
          .out_h = 5,
          .out_w = 7,
          .trailing = 0,
          .bias = true};
}

// Cases oneDNN cannot express.
std::vector<Case> declined_cases() {
  // A window that starts inside the input (negative padding, as transposed convs use).
  Case inside = declinable_base();
  inside.pad = -1;
  // More unread trailing rows than one stride: oneDNN would derive a larger output.
  Case trailing = declinable_base();
  trailing.trailing = 2;
  return {inside, trailing};
}

TEST(KernelBackend, ParsesAndRefuses) {
  EXPECT_EQ(parse_kernel_backend("reference"), KernelBackend::reference);
  EXPECT_THROW(parse_kernel_backend("mkl"), Error);
  EXPECT_THROW(parse_kernel_backend(""), Error);
  if (TESSERA_HAVE_ONEDNN) {
    EXPECT_EQ(parse_kernel_backend("onednn"), KernelBackend::onednn);
  } else {
    EXPECT_THROW(parse_kernel_backend("onednn"), Error);
  }
  EXPECT_GE(kernel_threads().count, 1);
  EXPECT_FALSE(kernel_threads().reason.empty());
}

TEST(KernelBackend, Float64AlwaysUsesTheReference) {
  const Case c = sweep()[5];
  for (KernelBackend b : test::built_backends())
    EXPECT_EQ(backend_of(b).conv<double>(c.shapes(), c.geometry())->name(), "reference");
  EXPECT_EQ(backend_of(KernelBackend::reference).conv<float>(c.shapes(), c.geometry())->name(),
            "reference");
}

// Whatever the backend, the float32 kernel handed out computes what the reference does; cases a
// fast backend declines get the reference itself.
TEST(KernelBackend, FloatKernelsMatchTheReferenceAndDeclinedCasesFallBack) {
  const std::vector<Case> cases = sweep();
  for (KernelBackend b : test::built_backends()) {
    SCOPED_TRACE(to_string(b));
    const Backend& backend = backend_of(b);
    for (std::size_t i = 0; i < cases.size(); i += 7) {
      std::unique_ptr<ConvKernel<float>> k =
          backend.conv<float>(cases[i].shapes(), cases[i].geometry());
      expect_matches_reference(*k, cases[i]);
    }
    for (const Case& c : declined_cases()) {
      std::unique_ptr<ConvKernel<float>> k = backend.conv<float>(c.shapes(), c.geometry());
      EXPECT_EQ(k->name(), "reference") << c.str();
      expect_matches_reference(*k, c);
    }
  }
}

TEST(ReferenceConv, BoxKernelsMatchTheWholeTensor) {
  for (const Case& c : sweep())
    expect_box_kernel_matches(c, [&](const ConvShapes& s) {
      return std::make_unique<ReferenceConv<float>>(c.geometry(), s);
    });
}

// Conv2d<float> plans the active backend's kernel at bind(), for its window; float64 the
// reference.
// The reference takes NCHW only: for an nchw16c input the factory returns no kernel rather than
// one that would misread it.
TEST(KernelBackend, OnlyFastKernelsTakeChannelBlockedInputs) {
  Case c = sweep()[0];
  c.c = 16;
  c.groups = 1;
  ConvShapes s = c.shapes();
  s.x_layout = Layout::nchw16c;
  for (KernelBackend b : test::built_backends())
    EXPECT_EQ(backend_of(b).conv<double>(s, c.geometry()), nullptr);
  EXPECT_EQ(backend_of(KernelBackend::reference).conv<float>(s, c.geometry()), nullptr);
}

// Batch norm is Tessera's threaded loops on every CPU backend (oneDNN's would take one tile's
// statistics), handed out by the backend like every kernel, and computes the reference's sums.
TEST(KernelBackend, BatchNormComesFromTheBackend) {
  for (KernelBackend b : test::built_backends()) {
    const std::unique_ptr<BatchNormKernel<float>> k = backend_of(b).batch_norm<float>();
    ASSERT_NE(k, nullptr);
    EXPECT_EQ(k->name(), "threaded");
    const Tensor<float> x = random_tensor({2, 3, 5, 4}, 77);
    std::vector<double> got(3), want(3);
    k->sum(x, Layout::nchw, got);
    reference::batchnorm_sum(x, std::span<double>(want));
    for (std::size_t c = 0; c < 3; ++c)
      EXPECT_NEAR(got[c], want[c], 1e-12 * std::max(1.0, std::abs(want[c]))) << c;
  }
  ASSERT_NE(backend_of(KernelBackend::reference).batch_norm<double>(), nullptr);
}

// Upsampling and the head's kernels come from the backend too, and compute the reference's.
TEST(KernelBackend, LocalKernelsComeFromTheBackend) {
  const reference::UpsampleGeometry g{.scale_h = 2, .scale_w = 3, .phase_h = 1, .phase_w = 2};
  const Tensor<double> x = test::random_tensor<double>({2, 3, 4, 5}, 5, 1);
  for (KernelBackend b : test::built_backends()) {
    const Backend& backend = backend_of(b);
    Tensor<double> y({2, 3, 6, 11}), want({2, 3, 6, 11});
    backend.upsample<double>(g)->forward(x, y);
    reference::upsample_nearest_forward(x, want, g);
    EXPECT_EQ(test::rel_error(y.span(), want.span()), 0.0) << to_string(b);
    std::vector<double> sums(6), want_sums(6);
    backend.spatial_sum<double>()->sums(x, sums);
    reference::spatial_sums<double>(x, want_sums);
    EXPECT_EQ(test::rel_error(sums, want_sums), 0.0) << to_string(b);
    const std::vector<double> w = test::random_vector<double>(4 * 6, 5, 2), bias(4, 0.5);
    std::vector<double> out(2 * 4), want_out(2 * 4);
    backend.linear<double>(6, 4)->forward(sums, w, bias, out, 2);
    reference::linear_forward<double>(sums, w, bias, want_out, 2, 6, 4);
    EXPECT_EQ(test::rel_error(out, want_out), 0.0) << to_string(b);
    const std::vector<std::int32_t> labels{0, 2, 1, 1, 0, 2, 2, 1, 0, 1, 2, 0, 1, 1,
                                           0, 2, 0, 1, 2, 0, 1, 2, 0, 1, 1, 0, 2, 0,
                                           1, 2, 2, 1, 0, 1, 0, 2, 1, 0, 2, 1};
    Tensor<double> grad(x.shape()), want_grad(x.shape());
    const double loss = backend.loss<double>()->cross_entropy(x, labels, 0.5, &grad);
    EXPECT_EQ(loss, reference::pixel_cross_entropy(x, labels, 0.5, &want_grad)) << to_string(b);
    EXPECT_EQ(test::rel_error(grad.span(), want_grad.span()), 0.0) << to_string(b);
  }
}

// Both backends in one process: each layer gets its kernel from the runtime it is bound to.
TEST(KernelBackend, Conv2dPlansItsKernelAtBind) {
  for (KernelBackend b : test::built_backends()) {
    const Runtime& single = test::single_runtime(b);
    const Distribution in{{2, 3, 17, 15}, single.comm().shape(), single.comm().coords()};
    const Conv2dSpec spec{
        .out_channels = 8, .kernel = {3, 3}, .pad_begin = {1, 1}, .pad_end = {1, 1}};
    Conv2d<float> f("c1", spec, 1);
    f.setup(in);
    EXPECT_EQ(f.kernel(), nullptr);
    f.bind(single);
    ASSERT_NE(f.kernel(), nullptr);
    // The fast backend's 3 -> 8 conv: oneDNN's, or the narrow kernels' on AVX-512.
    const bool fast = b == KernelBackend::onednn;
    const std::string name = f.kernel()->name();
    EXPECT_EQ(name.starts_with("onednn") || name.starts_with("narrow"), fast) << name;
    Conv2d<double> d("c1", spec, 1);
    d.setup(in);
    d.bind(single);
    EXPECT_EQ(d.kernel()->name(), "reference");
  }
}

#if TESSERA_HAVE_ONEDNN

TEST(OneDnnConv, MatchesReferenceOverSweep) {
  std::map<std::string, int> chosen;
  int declined = 0;
  for (const Case& c : sweep()) {
    std::unique_ptr<OneDnnConv> k = OneDnnConv::create(c.shapes(), c.geometry());
    if (!k) {
      ++declined;
      std::cout << "  declined: " << c.str() << "\n";
      continue;
    }
    ++chosen[k->name()];
    expect_matches_reference(*k, c);
    // Planned once, executed many times: a second run gives the same results.
    expect_matches_reference(*k, c);
  }
  // Which implementations oneDNN picked, for the record (they depend on the CPU).
  for (const auto& [name, count] : chosen)
    std::cout << "  " << count << " case(s): " << name << "\n";
  std::cout << "  " << declined << " case(s) declined\n";
  // Plain convolutions (groups 1, no padding) are the common case and must take the fast path.
  for (const Case& c : sweep()) {
    if (c.groups == 1 && c.pad == 0) {
      EXPECT_NE(OneDnnConv::create(c.shapes(), c.geometry()), nullptr) << c.str();
    }
  }
}

TEST(OneDnnConv, BoxKernelsMatchTheReference) {
  int planned = 0;
  for (const Case& c : sweep())
    expect_box_kernel_matches(c, [&](const ConvShapes& s) -> std::unique_ptr<ConvKernel<float>> {
      std::unique_ptr<OneDnnConv> k = OneDnnConv::create(s, c.geometry());
      planned += k != nullptr;
      if (k && c.groups == 1) {
        // A box kernel runs forward_box only.
        Tensor<float> y(c.y());
        EXPECT_THROW(
            k->forward(Tensor<float>(c.x()), Tensor<float>(c.w()),
                       c.bias ? Tensor<float>({c.o, 1, 1, 1}).span() : std::span<float>(), y),
            Error);
      }
      return k;
    });
  EXPECT_GT(planned, 30);  // the strided descriptors are the common case, not a fallback
}

// A window in nchw16c (as the halo exchange assembles it for a conv with 16k input channels):
// forward, backward-data (dx in nchw16c) and backward-filter read and write it in place, whole or
// as a box, with the reference's results.
// Every 16- or 32-channel case of the sweep, and the same with 8 channels more (24, 40: the last
// block padded with zero channels, as Conv2d's windows of such convs are).
// Resets the process-wide switch however the test ends.
struct WinogradSwitch {
  explicit WinogradSwitch(bool on) { set_conv_winograd(on); }
  ~WinogradSwitch() { set_conv_winograd(true); }
};

// A window in nchw16c (channels a multiple of 16, or more padded to one) or in nchw8c (a multiple
// of 8 that is not one of 16, as Conv2d offers it) gives the reference's results on all three
// passes, and so does a box of a larger window at its planned place. Winograd stays off here: an
// nchw8c window is declined where it would apply (EightChannelWindowsDeclineWhereWinogradPays).
TEST(OneDnnConv, ChannelBlockedInputsMatchTheReference) {
  const WinogradSwitch direct(false);
  int tested = 0;
  std::vector<std::pair<Case, Layout>> cases;
  for (const Case& c : sweep()) {
    if (c.c % 8 != 0 || c.groups != 1) continue;
    Case padded = c;
    padded.c += 8;
    for (const Case& k : {c, padded}) {
      if (k.c % kBlock == 0 || k.c > kBlock) cases.emplace_back(k, Layout::nchw16c);
      if (k.c % kBlock != 0) cases.emplace_back(k, Layout::nchw8c);
    }
  }
  for (const auto& [c, layout] : cases) {
    const std::string what = c.str() + " " + to_string(layout);
    const ConvGeometry g = c.geometry();
    ConvShapes shapes = c.shapes();
    shapes.x_layout = layout;
    std::unique_ptr<OneDnnConv> k = OneDnnConv::create(shapes, g);
    // oneDNN's 8-channel kernels do not dilate: declined (the conv then takes nchw16c or NCHW,
    // Conv2d::bind_kernel); they take every other geometry here.
    if (layout == Layout::nchw8c && c.dilation > 1 && k == nullptr) continue;
    ASSERT_NE(k, nullptr) << what;
    ++tested;
    const Tensor<float> x = random_tensor(c.x(), 1), w = random_tensor(c.w(), 2);
    const Tensor<float> dy = random_tensor(c.y(), 3);
    const Tensor<float> b = c.bias ? random_tensor({c.o, 1, 1, 1}, 4) : Tensor<float>();
    const Tensor<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
    const Tensor<double> bd = to_double(b);
    const Tensor<float> xb = to_layout(x, layout);

    Tensor<float> y(c.y());
    k->forward(xb, w, b.span(), y);
    Tensor<double> yd(c.y());
    reference::conv2d_forward(xd, wd, bd.span(), yd, g);
    EXPECT_LE(rel_error(y.span(), yd.span()), kTolerance) << "forward, " << what;

    Tensor<float> dxb(c.x(), layout);
    k->backward_data(dy, w, dxb);
    Tensor<double> dxd(c.x());
    reference::conv2d_backward_data(dyd, wd, dxd, g);
    const Tensor<float> dx = to_layout(dxb, Layout::nchw);
    EXPECT_LE(rel_error(dx.span(), dxd.span()), kTolerance) << "backward-data, " << what;

    Tensor<float> dw(c.w()), db({c.o, 1, 1, 1});
    Tensor<double> dwd(c.w()), dbd({c.o, 1, 1, 1});
    k->backward_filter(xb, dy, dw, c.bias ? db.span() : std::span<float>());
    reference::conv2d_backward_filter(xd, dyd, dwd, c.bias ? dbd.span() : std::span<double>(), g);
    EXPECT_LE(rel_error(dw.span(), dwd.span()), kTolerance) << "backward-weights, " << what;

    // A box of a larger blocked window, at the place it was planned for.
    const BoxAt at{2, 3};
    Tensor<float> outer = random_tensor({c.n, c.c, c.x().h + 5, c.x().w + 7}, 8);
    copy_box_in(x, outer, at);
    const Tensor<float> outer_b = to_layout(outer, layout);
    ConvShapes box = shapes;
    box.x_outer = outer.shape();
    box.y_outer = c.y();
    box.x_at = at;
    std::unique_ptr<OneDnnConv> kb = OneDnnConv::create(box, g);
    ASSERT_NE(kb, nullptr) << what;
    Tensor<float> yb(c.y());
    kb->forward_box(outer_b, at, w, b.span(), yb, {0, 0});
    EXPECT_LE(rel_error(yb.span(), yd.span()), kTolerance) << "box forward, " << what;
    EXPECT_THROW(kb->forward_box(outer_b, {1, 3}, w, b.span(), yb, {0, 0}), Error);
  }
  EXPECT_GE(tested, 16);
}

// One training step of `spec` in float32 (oneDNN where it takes the case) and in float64 (the
// reference kernels) on one rank, from the same seeded parameters and batch: loss, logits, input
// gradient and every parameter gradient agree to float32 rounding.
void expect_float32_matches_float64(const ModelSpec& spec, Shape4 input, std::uint64_t seed,
                                    const std::string& what) {
  const Runtime& single = test::single_runtime(KernelBackend::onednn);
  Model<float> f(spec, single, input);
  Model<double> d(spec, single, input);
  f.init_params(seed);
  d.init_params(seed);
  DistTensor<double> xd(d.input_distribution());
  xd.local = random_image_tile<double>(xd.dist, seed);
  DistTensor<float> xf(f.input_distribution());
  for (std::int64_t k = 0; k < xd.local.numel(); ++k)
    xf.local.data()[k] = static_cast<float>(xd.local.data()[k]);
  const Labels labels = random_label_tile(d.output_distribution(), seed);
  const StepResult<float> rf = forward_backward(f, xf, labels);
  const StepResult<double> rd = forward_backward(d, xd, labels);
  EXPECT_NEAR(rf.loss, rd.loss, 1e-5 * std::abs(rd.loss)) << what;
  EXPECT_LE(rel_error(rf.output.local.span(), rd.output.local.span()), kTolerance) << what;
  EXPECT_LE(rel_error(rf.input_grad.local.span(), rd.input_grad.local.span()), kTolerance) << what;
  const auto pf = f.params();
  const auto pd = d.params();
  for (std::size_t k = 0; k < pf.size(); ++k)
    EXPECT_LE(rel_error(std::span<const float>(pf[k].param->grad.span()),
                        std::span<const double>(pd[k].param->grad.span())),
              kTolerance)
        << pf[k].key() << ", " << what;
}

// A conv chain whose activations stay in nchw16c from layer to layer (float32, oneDNN), batch
// norm and pooling included, gives the float64 reference model's loss, logits and gradients:
// layouts change nothing but speed.
TEST(OneDnnConv, ChannelBlockedActivationsGiveTheReferenceResults) {
  const ModelSpec spec = parse_model(
      R"({"name": "blocked", "input_channels": 3, "layers": [
          {"name": "c1", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1,
           "bias": false},
          {"name": "bn1", "type": "batchnorm2d"},
          {"name": "r1", "type": "relu"},
          {"name": "p1", "type": "maxpool2d", "kernel": 2},
          {"name": "c2", "type": "conv2d", "out_channels": 32, "kernel": 3, "stride": 2},
          {"name": "r2", "type": "leaky_relu", "slope": 0.1},
          {"name": "p2", "type": "avgpool2d", "kernel": 3, "stride": 1, "padding": 1},
          {"name": "c3", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": "same"},
          {"name": "r3", "type": "sigmoid"},
          {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})");
  expect_float32_matches_float64(spec, {2, 3, 38, 34}, 3, "blocked chain");
}

// unet-small's full-resolution end: windows of 8 and 24 channels assembled in nchw8c (the 24 from
// a concat), an 8 -> 16 conv whose nchw8c window feeds a 16-channel blocked output, and an
// 8 -> 2 head planned as GEMMs: the float64 reference's loss, logits and gradients.
TEST(OneDnnConv, EightChannelWindowsGiveTheReferenceResults) {
  const ModelSpec spec = parse_model(
      R"({"name": "eights", "input_channels": 3, "layers": [
          {"name": "e1", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1},
          {"name": "e1_relu", "type": "relu"},
          {"name": "e2", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1},
          {"name": "up", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1,
           "bias": false},
          {"name": "up_bn", "type": "batchnorm2d"},
          {"name": "cat", "type": "concat", "inputs": ["up_bn", "e2"]},
          {"name": "d1", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1,
           "bias": false},
          {"name": "d1_relu", "type": "relu"},
          {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  // With the narrow kernels (on AVX-512) these convs compute in NCHW; without, in 8-channel blocks.
  for (bool narrow : {true, false}) {
    const NarrowSwitch scope(narrow);
    expect_float32_matches_float64(spec, {2, 3, 30, 26}, 5, "8-channel windows");
  }
}

// unet-small's shape end to end, with 8-channel activations in nchw8c from the convs that write
// them through batch norm, ReLU and pooling, a 16-channel transposed conv and upsampling in
// nchw16c, and concats read by their convs (16-channel blocks into an 8-channel window): the
// float64 reference's loss, logits and gradients.
TEST(OneDnnConv, EightChannelActivationsGiveTheReferenceResults) {
  const ModelSpec spec = parse_model(
      R"({"name": "unet-like", "input_channels": 3, "layers": [
          {"name": "e1", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1,
           "bias": false},
          {"name": "e1_bn", "type": "batchnorm2d"},
          {"name": "e1_relu", "type": "relu"},
          {"name": "p1", "type": "maxpool2d", "kernel": 2},
          {"name": "e2", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1},
          {"name": "e2_relu", "type": "relu"},
          {"name": "p2", "type": "maxpool2d", "kernel": 2},
          {"name": "m", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": 1},
          {"name": "t", "type": "conv_transpose2d", "out_channels": 16, "kernel": 2, "stride": 2},
          {"name": "cat2", "type": "concat", "inputs": ["t", "e2_relu"]},
          {"name": "d2", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1,
           "bias": false},
          {"name": "d2_bn", "type": "batchnorm2d"},
          {"name": "up", "type": "upsample_nearest", "scale": 2},
          {"name": "cat1", "type": "concat", "inputs": ["up", "e1_relu"]},
          {"name": "d1", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1,
           "bias": false},
          {"name": "d1_bn", "type": "batchnorm2d"},
          {"name": "d1_relu", "type": "relu"},
          {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  for (bool narrow : {true, false}) {
    const NarrowSwitch scope(narrow);
    expect_float32_matches_float64(spec, {2, 3, 28, 36}, 7, "8-channel activations");
  }
}

// A 16 -> 16 conv whose input comes in NCHW whatever it takes (from a narrow conv through batch
// norm and ReLU, or a concat of two narrow convs' outputs) computes with the narrow kernels; one
// after a max pooling (oneDNN's, which gives nchw16c) with oneDNN's. Both give the float64
// reference's loss, logits and gradients, with the narrow kernels on and off.
TEST(OneDnnConv, SixteenChannelConvsFromNchwComputeNarrow) {
  const ModelSpec spec = parse_model(
      R"({"name": "sixteens", "input_channels": 3, "layers": [
          {"name": "e1", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1,
           "bias": false},
          {"name": "e1_bn", "type": "batchnorm2d"},
          {"name": "e1_relu", "type": "relu"},
          {"name": "e2", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1},
          {"name": "e2_relu", "type": "relu"},
          {"name": "p", "type": "maxpool2d", "kernel": 2},
          {"name": "e3", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1},
          {"name": "a", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1,
           "inputs": ["e3"]},
          {"name": "b", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1,
           "inputs": ["e3"]},
          {"name": "cat", "type": "concat", "inputs": ["a", "b"]},
          {"name": "c", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1},
          {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  const bool avx512 = simd_available(SimdLevel::avx512);
  for (bool narrow : {true, false}) {
    const NarrowSwitch scope(narrow);
    expect_float32_matches_float64(spec, {2, 3, 30, 26}, 9, "16-channel convs");
    const Runtime& single = test::single_runtime(KernelBackend::onednn);
    Model<float> f(spec, single, {2, 3, 30, 26});
    std::map<std::string, std::string> kernels;
    for (const auto& [layer, kernel] : f.kernel_summaries())
      kernels[layer] = kernel;
    const bool on = narrow && avx512;
    EXPECT_EQ(kernels["e2"].starts_with("narrow"), on) << kernels["e2"];
    EXPECT_EQ(kernels["c"].starts_with("narrow"), on) << kernels["c"];
    EXPECT_TRUE(kernels["e3"].starts_with("onednn")) << kernels["e3"];
  }
}

// Transposed convs run as the adjoint of a planned conv kernel (oneDNN's backward-data for their
// forward, and so on), or 2x2 stride 2 to 16 channels on AVX-512 with the patch kernel for the
// forward and filter gradient (kernels/patch_deconv.hpp): float32 models give the float64
// reference's loss, logits and gradients, over strides, paddings, output paddings, bias or none,
// and windows and outputs of 16 channels (nchw16c).
TEST(OneDnnConv, TransposedConvLayersGiveTheReferenceResults) {
  for (const std::string up : {R"("out_channels": 8, "kernel": 2, "stride": 2)",
                               R"("out_channels": 16, "kernel": 2, "stride": 2)",
                               R"("out_channels": 16, "kernel": 2, "stride": 2, "bias": false)",
                               R"("out_channels": 16, "kernel": 2, "stride": 2, "padding": 1)",
                               R"("out_channels": 8, "kernel": 3, "stride": 2, "padding": 1,
                                  "output_padding": 1)",
                               R"("out_channels": 8, "kernel": 4, "stride": 2, "padding": 1,
                                  "bias": false)",
                               R"("out_channels": 8, "kernel": [3, 2], "stride": [1, 2])"}) {
    const ModelSpec spec = parse_model(
        R"({"name": "up", "input_channels": 3, "layers": [
            {"name": "c1", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1},
            {"name": "r1", "type": "relu"},
            {"name": "up", "type": "conv_transpose2d", )" +
        up + R"(},
            {"name": "r2", "type": "relu"},
            {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})");
    expect_float32_matches_float64(spec, {2, 3, 13, 11}, 5, up);
    // Which kernels ran: the patch kernel exactly where it fits.
    const Runtime& single = test::single_runtime(KernelBackend::onednn);
    Model<float> f(spec, single, {2, 3, 13, 11});
    const bool patch = simd_available(SimdLevel::avx512) &&
                       up.starts_with(R"("out_channels": 16, "kernel": 2, "stride": 2)");
    int seen = 0;
    for (const auto& [layer, kernel] : f.kernel_summaries()) {
      if (layer != "up") continue;
      ++seen;
      EXPECT_EQ(kernel.starts_with("tessera patch avx512, input gradient onednn"), patch)
          << up << ": " << kernel;
    }
    EXPECT_EQ(seen, 1) << up;
  }
}

TEST(OneDnnConv, TransposedConvPlansTheAdjointConvAtBind) {
  const Runtime& single = test::single_runtime(KernelBackend::onednn);
  const Distribution in{{2, 32, 9, 8}, single.comm().shape(), single.comm().coords()};
  ConvTranspose2d<float> f("up", {.out_channels = 16, .kernel = {2, 2}, .stride = {2, 2}}, 1);
  f.setup(in);
  f.bind(single);
  EXPECT_TRUE(f.kernel_name().starts_with("onednn")) << f.kernel_name();
  ConvTranspose2d<double> d("up", {.out_channels = 16, .kernel = {2, 2}, .stride = {2, 2}}, 1);
  d.setup(in);
  d.bind(single);
  EXPECT_EQ(d.kernel_name(), "reference");
}

TEST(OneDnnConv, DeclinesWhatItCannotExpress) {
  const Case base = declinable_base();
  ASSERT_NE(OneDnnConv::create(base.shapes(), base.geometry()), nullptr);
  for (const Case& c : declined_cases())
    EXPECT_EQ(OneDnnConv::create(c.shapes(), c.geometry()), nullptr) << c.str();
  // Shapes that do not fit the geometry are declined too (the reference then reports them).
  ConvShapes bad = base.shapes();
  bad.w.n = 5;
  EXPECT_EQ(OneDnnConv::create(bad, base.geometry()), nullptr);
  ConvGeometry groups = base.geometry();
  groups.groups = 3;
  EXPECT_EQ(OneDnnConv::create(base.shapes(), groups), nullptr);
}

// oneDNN's Winograd kernels (jit_wino_4x3) need AVX-512 (its avx512_core: F, BW, VL, DQ).
bool cpu_has_avx512_core() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool plans_winograd(const ConvShapes& s, const ConvGeometry& g) {
  std::unique_ptr<OneDnnConv> k = OneDnnConv::create(s, g);
  return k && k->name().find("wino") != std::string::npos;
}

Case winograd_case(std::int64_t c, std::int64_t o) {
  return {.n = 1,
          .c = c,
          .o = o,
          .groups = 1,
          .kernel = 3,
          .stride = 1,
          .dilation = 1,
          .pad = 0,
          .out_h = 21,
          .out_w = 18,
          .trailing = 0,
          .bias = true};
}

// 3x3 convolutions, stride 1, with >= 16 channels on both sides and >= 32 on one take Winograd's
// F(4x4, 3x3) on all three passes (README.md "Winograd convolutions") and match the float64
// reference within float32's tolerance, NCHW or nchw16c; everything else, box kernels, outputs
// thinner than 4 and TESSERA_WINOGRAD=0 stay direct. A fused ReLU rides along as the post-op; a
// fused leaky ReLU, which oneDNN's Winograd kernel does not take, is declined so that the conv
// plans without it.
TEST(OneDnnConv, WinogradWhereItPaysAndTheReferenceResults) {
  if (!cpu_has_avx512_core()) GTEST_SKIP() << "this CPU has no AVX-512: oneDNN has no Winograd";
  for (auto [c, o] : {std::pair{32, 32}, {16, 32}, {32, 16}, {48, 40}}) {
    const Case k3 = winograd_case(c, o);
    for (Layout layout : {Layout::nchw, Layout::nchw16c}) {
      if (layout == Layout::nchw16c && c % kBlock != 0) continue;
      ConvShapes shapes = k3.shapes();
      shapes.x_layout = layout;
      std::unique_ptr<OneDnnConv> k = OneDnnConv::create(shapes, k3.geometry());
      ASSERT_NE(k, nullptr) << k3.str();
      const std::string name = k->name();
      // "onednn <forward>/<backward-data>/<backward-weights>": each one Winograd.
      std::size_t passes = 0;
      for (std::size_t at = name.find("wino"); at != std::string::npos;
           at = name.find("wino", at + 1))
        ++passes;
      EXPECT_EQ(passes, 3u) << name << ", " << k3.str();
      if (layout == Layout::nchw) {
        expect_matches_reference(*k, k3);
        continue;
      }
      const Tensor<float> x = random_tensor(k3.x(), 1), w = random_tensor(k3.w(), 2);
      const Tensor<float> b = random_tensor({o, 1, 1, 1}, 4);
      Tensor<float> y(k3.y());
      k->forward(to_layout(x, Layout::nchw16c), w, b.span(), y);
      Tensor<double> yd(k3.y());
      const Tensor<double> bd = to_double(b);
      reference::conv2d_forward(to_double(x), to_double(w), bd.span(), yd, k3.geometry());
      EXPECT_LE(rel_error(y.span(), yd.span()), kTolerance) << "nchw16c forward, " << k3.str();
    }
  }

  const Case k3 = winograd_case(32, 32);
  {
    WinogradSwitch off(false);
    EXPECT_FALSE(plans_winograd(k3.shapes(), k3.geometry()));
  }
  ASSERT_TRUE(plans_winograd(k3.shapes(), k3.geometry()));
  Case narrow = winograd_case(8, 32), strided = k3, dilated = k3, wide = k3, grouped = k3;
  strided.stride = 2;
  dilated.dilation = 2;
  wide.kernel = 5;
  grouped.groups = 2;
  // Outputs thinner than one 4x4 Winograd tile (a windowless conv's border strip: one column)
  // stay direct; four across take it.
  Case column = k3, rows = k3, four = k3;
  column.out_w = 1;
  rows.out_h = 3;
  four.out_w = 4;
  for (const Case& c :
       {narrow, winograd_case(16, 16), strided, dilated, wide, grouped, column, rows})
    EXPECT_FALSE(plans_winograd(c.shapes(), c.geometry())) << c.str();
  EXPECT_TRUE(plans_winograd(four.shapes(), four.geometry())) << four.str();
  ConvShapes box = k3.shapes();
  box.x_outer = {1, 32, k3.x().h + 4, k3.x().w + 4};
  box.y_outer = {1, 32, k3.y().h + 4, k3.y().w + 4};
  EXPECT_FALSE(plans_winograd(box, k3.geometry()));

  ConvShapes relu = k3.shapes();
  relu.activation = FusedActivation{.kind = ActivationKind::relu};
  std::unique_ptr<OneDnnConv> fused = OneDnnConv::create(relu, k3.geometry());
  ASSERT_NE(fused, nullptr);
  EXPECT_TRUE(fused->applies_activation());
  EXPECT_NE(fused->name().find("wino"), std::string::npos) << fused->name();
  const Tensor<float> x = random_tensor(k3.x(), 1), w = random_tensor(k3.w(), 2);
  const Tensor<float> b = random_tensor({32, 1, 1, 1}, 4);
  Tensor<float> y(k3.y());
  fused->forward(x, w, b.span(), y);
  Tensor<double> yd(k3.y());
  const Tensor<double> bd = to_double(b);
  reference::conv2d_forward(to_double(x), to_double(w), bd.span(), yd, k3.geometry());
  for (double& v : yd.span())
    v = std::max(v, 0.0);
  EXPECT_LE(rel_error(y.span(), yd.span()), kTolerance) << "forward with ReLU";

  ConvShapes leaky = k3.shapes();
  leaky.activation = FusedActivation{.kind = ActivationKind::leaky_relu, .slope = 0.1};
  EXPECT_EQ(OneDnnConv::create(leaky, k3.geometry()), nullptr);
  WinogradSwitch off(false);
  std::unique_ptr<OneDnnConv> direct = OneDnnConv::create(leaky, k3.geometry());
  ASSERT_NE(direct, nullptr);
  EXPECT_TRUE(direct->applies_activation());
}

// oneDNN 2.6 plans the forward of a 16 -> 32 channel 3x3 conv with a 512x256 output (unet-small's
// m1 on each of 2 ranks) in Winograd's whole-tensor schedule, 60 MiB of scratchpad and 2.7x the
// direct kernel's time: that pass stays direct, its backward passes (tiled, 6-8 MiB) Winograd.
TEST(OneDnnConv, WinogradWholeTensorSchedulesStayDirect) {
  if (!cpu_has_avx512_core()) GTEST_SKIP() << "this CPU has no AVX-512: oneDNN has no Winograd";
  const ConvShapes s{.x = {1, 16, 514, 258},
                     .w = {32, 16, 3, 3},
                     .y = {1, 32, 512, 256},
                     .bias = true,
                     .x_layout = Layout::nchw16c,
                     .y_layout = Layout::nchw16c};
  std::unique_ptr<OneDnnConv> k = OneDnnConv::create(s, ConvGeometry{});
  ASSERT_NE(k, nullptr);
  // "onednn <forward>/<backward-data>/<backward-weights>"
  const std::string name = k->name();
  std::vector<std::string> passes;
  for (std::size_t at = 0, slash; at <= name.size(); at = slash + 1) {
    slash = std::min(name.find('/', at), name.size());
    passes.push_back(name.substr(at, slash - at));
  }
  ASSERT_EQ(passes.size(), 3u) << name;
  EXPECT_EQ(passes[0].find("wino"), std::string::npos) << name;
  EXPECT_NE(passes[1].find("wino"), std::string::npos) << name;
  EXPECT_NE(passes[2].find("wino"), std::string::npos) << name;
}

// An 8 -> 8 channel conv computes in oneDNN's 8-channel blocks (converting Tessera's NCHW window,
// output and gradients on the way) rather than in the half-padded 16-channel blocks oneDNN picks
// itself: the reference's results, whole tensor or box (which stays with oneDNN's choice).
// oneDNN's 8-channel kernels do not dilate: a dilated 8 -> 8 conv in NCHW is planned in oneDNN's
// own layouts instead of falling to the reference, and an nchw8c window is declined (the conv
// then takes its next window layout).
TEST(OneDnnConv, DilatedEightChannelConvsStayOnOneDnn) {
  Case c = winograd_case(8, 8);
  c.dilation = 2;
  std::unique_ptr<OneDnnConv> k = OneDnnConv::create(c.shapes(), c.geometry());
  ASSERT_NE(k, nullptr) << c.str();
  expect_matches_reference(*k, c);
  ConvShapes window = c.shapes();
  window.x_layout = Layout::nchw8c;
  EXPECT_EQ(OneDnnConv::create(window, c.geometry()), nullptr);
}

TEST(OneDnnConv, EightChannelConvsComputeInEightChannelBlocks) {
  for (std::int64_t stride : {1, 2}) {
    Case c = winograd_case(8, 8);
    c.stride = stride;
    std::unique_ptr<OneDnnConv> k = OneDnnConv::create(c.shapes(), c.geometry());
    ASSERT_NE(k, nullptr) << c.str();
    // oneDNN's 8-channel blocked kernels are its AVX2 ones; on an AVX-512 CPU its own choice for
    // these shapes is an avx512_core kernel in 16-channel blocks for forward and backward-data.
    if (cpu_has_avx512_core()) {
      const std::string name = k->name();
      std::size_t avx2 = 0;
      for (std::size_t at = name.find("avx2"); at != std::string::npos;
           at = name.find("avx2", at + 1))
        ++avx2;
      EXPECT_EQ(avx2, 3u) << name;
    }
    expect_matches_reference(*k, c);
    expect_box_kernel_matches(c, [&](const ConvShapes& s) -> std::unique_ptr<ConvKernel<float>> {
      return OneDnnConv::create(s, c.geometry());
    });
  }
}

// An nchw8c window is declined where oneDNN computes faster from 16-channel blocks (Winograd's
// shapes) and under bf16, which has no 8-channel kernels: Conv2d then offers the next layout.
TEST(OneDnnConv, EightChannelWindowsDeclineWhereWinogradPays) {
  ConvShapes wino = winograd_case(24, 32).shapes();
  wino.x_layout = Layout::nchw8c;
  const ConvGeometry g = winograd_case(24, 32).geometry();
  if (cpu_has_avx512_core()) {
    EXPECT_EQ(OneDnnConv::create(wino, g), nullptr);
  }
  {
    const WinogradSwitch off(false);
    EXPECT_NE(OneDnnConv::create(wino, g), nullptr);
  }
  ConvShapes narrow = winograd_case(24, 8).shapes();
  narrow.x_layout = Layout::nchw8c;
  EXPECT_NE(OneDnnConv::create(narrow, g), nullptr);
  set_conv_bf16(true);
  std::unique_ptr<OneDnnConv> bf16 = OneDnnConv::create(narrow, g);
  set_conv_bf16(false);
  EXPECT_EQ(bf16, nullptr);
}

// --precision bf16 is offered where the CPU has the bfloat16 instructions, and not where oneDNN
// would emulate them with float multiplies (slower than float32; its kernels are tested there).
TEST(OneDnnConv, Bf16IsOfferedWhereTheCpuHasTheInstructions) {
  if (std::getenv("DNNL_MAX_CPU_ISA") != nullptr || std::getenv("ONEDNN_MAX_CPU_ISA") != nullptr)
    GTEST_SKIP() << "ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA limits the instructions oneDNN uses";
  const bool instructions = __builtin_cpu_supports("avx512bf16");
  EXPECT_EQ(bf16_supported(), instructions);
  EXPECT_EQ(onednn_bf16_native(), instructions);
  const bool avx512_core = __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (avx512_core) {
    EXPECT_TRUE(onednn_bf16_supported()) << "natively or emulated";
  }
}

// --precision bf16's convolutions for a scope (set_conv_bf16); float32 after it.
struct Bf16Switch {
  Bf16Switch() { set_conv_bf16(true); }
  ~Bf16Switch() { set_conv_bf16(false); }
  Bf16Switch(const Bf16Switch&) = delete;
  Bf16Switch& operator=(const Bf16Switch&) = delete;
};

// Under --precision bf16 a 1x1 conv to fewer than 16 channels (a segmentation head: memory-bound)
// and a conv reading fewer than 16 channels (an image's 3) compute in float32, so they match the
// float32 reference to float32's tolerance, on oneDNN's kernels and as GEMMs on 8-channel blocks;
// so does a strided conv of fewer than 128 products an input value (a 2x2 stride-2 transposed
// conv's adjoint, a 3x3 stride-2 conv to 32 channels); a 3x3 conv of 32 channels and a 3x3
// stride-2 conv to 64 channels still compute in bfloat16.
TEST(OneDnnConv, NarrowHeadsComputeInFloat32UnderBf16) {
  if (!onednn_bf16_supported())
    GTEST_SKIP() << "oneDNN has no bfloat16 convolutions of its own here";
  const Bf16Switch bf16;
  Case head = winograd_case(32, 2);
  head.kernel = 1;
  std::unique_ptr<OneDnnConv> k = OneDnnConv::create(head.shapes(), head.geometry());
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->name().find("bf16"), std::string::npos) << k->name();
  expect_matches_reference(*k, head);
  const Case first = winograd_case(3, 32);
  std::unique_ptr<OneDnnConv> image = OneDnnConv::create(first.shapes(), first.geometry());
  ASSERT_NE(image, nullptr);
  EXPECT_EQ(image->name().find("bf16"), std::string::npos) << image->name();
  expect_matches_reference(*image, first);
  Case blocked = winograd_case(8, 2);
  blocked.kernel = 1;
  ConvShapes shapes = blocked.shapes();
  shapes.x_layout = Layout::nchw8c;
  std::unique_ptr<ConvKernel<float>> gemm =
      make_onednn_blocked_pointwise(shapes, blocked.geometry());
  ASSERT_NE(gemm, nullptr);
  expect_matches_reference(*gemm, blocked, Layout::nchw8c);
  Case adjoint = winograd_case(16, 32);  // unet-small's up2 (32 -> 16, 2x2, stride 2) adjoint
  adjoint.kernel = 2, adjoint.stride = 2;
  Case strided = winograd_case(16, 32);  // 9 x 32 / 4 = 72 products an input value
  strided.stride = 2, strided.pad = 1;
  for (const Case& c : {adjoint, strided}) {
    std::unique_ptr<OneDnnConv> k = OneDnnConv::create(c.shapes(), c.geometry());
    ASSERT_NE(k, nullptr);
    EXPECT_EQ(k->name().find("bf16"), std::string::npos) << k->name();
    expect_matches_reference(*k, c);
  }
  Case deep = winograd_case(32, 64);  // 9 x 64 / 4 = 144
  deep.stride = 2, deep.pad = 1;
  for (const Case& c : {winograd_case(32, 32), deep}) {
    std::unique_ptr<OneDnnConv> conv = OneDnnConv::create(c.shapes(), c.geometry());
    ASSERT_NE(conv, nullptr);
    EXPECT_NE(conv->name().find("bf16"), std::string::npos) << conv->name();
  }
}

// Under --precision bf16 every case of the sweep, and 32-channel 3x3 convs with outputs wider than
// 736 columns, computes its three passes within bfloat16's tolerance of the float64 reference
// (each factor keeps 8 bits). On CPUs with AMX oneDNN 2.x plans backward-weights with its AMX
// kernel, whose primitive for outputs wider than 736 columns was not created in 5 minutes and
// which crashed or corrupted the heap on narrower ones: that pass computes in float32 there.
TEST(OneDnnConv, Bf16ConvolutionsMatchTheReference) {
  if (!onednn_bf16_supported())
    GTEST_SKIP() << "oneDNN has no bfloat16 convolutions of its own here";
  const Bf16Switch bf16;
  std::vector<Case> cases = sweep();
  for (std::int64_t width : {737, 800}) {
    Case wide = winograd_case(32, 32);
    wide.n = 2, wide.pad = 1, wide.out_h = 3, wide.out_w = width;
    cases.push_back(wide);
  }
  // Strided convs compute in bfloat16 from 128 products an input value on (the sweep's have fewer).
  for (std::int64_t stride : {2, 3})
    for (std::int64_t kernel : {3, 5})
      for (std::int64_t dilation : {1, 2}) {
        Case deep = winograd_case(16, 128);
        deep.stride = stride, deep.kernel = kernel, deep.dilation = dilation, deep.pad = 1;
        deep.out_h = 7, deep.out_w = 9, deep.trailing = stride - 1;
        cases.push_back(deep);
      }
  int in_bf16 = 0;
  for (const Case& c : cases) {
    std::unique_ptr<OneDnnConv> k = OneDnnConv::create(c.shapes(), c.geometry());
    if (!k) continue;  // declined: the reference computes it
    const std::string name = k->name();
    if (name.find("bf16") != std::string::npos) ++in_bf16;
    if (dnnl_version()->major < 3) {
      EXPECT_EQ(name.substr(name.rfind('/')).find("amx"), std::string::npos)
          << "backward-weights on oneDNN 2's AMX kernel: " << name;
    }
    expect_matches_reference(*k, c, Layout::nchw, 2e-2);
  }
  EXPECT_GT(in_bf16, 10);
}

// onednn_weights_scratch_limit for a scope; as before after it.
struct WeightsScratchLimit {
  const std::size_t before;
  explicit WeightsScratchLimit(std::size_t bytes)
      : before(set_onednn_weights_scratch_limit(bytes)) {}
  ~WeightsScratchLimit() { set_onednn_weights_scratch_limit(before); }
  WeightsScratchLimit(const WeightsScratchLimit&) = delete;
  WeightsScratchLimit& operator=(const WeightsScratchLimit&) = delete;
};

// A backward-weights pass whose scratchpad would exceed the limit runs in strips of output rows
// (here one row each, the limit 1 byte): the first and last strips' windows reach into the
// padding, strides and dilations skip rows, unread trailing rows stay unread, samples lie apart,
// and the gradients, added strip by strip into what dw and dbias held, are the reference's, on
// NCHW and nchw16c windows. Over the sweep wherever oneDNN's kernel asks a scratchpad at all.
TEST(OneDnnConv, BackwardWeightsInStripsMatchesTheReference) {
  const WeightsScratchLimit tiny(1);
  int striped = 0;
  for (Case c : sweep()) {
    for (Layout layout : {Layout::nchw, Layout::nchw16c}) {
      if (layout == Layout::nchw16c && (c.c % kBlock != 0 || c.groups != 1)) continue;
      ConvShapes shapes = c.shapes();
      shapes.x_layout = layout;
      std::unique_ptr<OneDnnConv> k = OneDnnConv::create(shapes, c.geometry());
      if (!k || k->weights_strips() == 0) continue;
      EXPECT_EQ(k->weights_strips(), c.out_h) << c.str();
      EXPECT_NE(k->name().find("in " + std::to_string(c.out_h) + " strips"), std::string::npos)
          << k->name();
      expect_matches_reference(*k, c, layout);
      ++striped;
    }
  }
  // Which of oneDNN's float32 kernels ask a scratchpad depends on the CPU; its AVX-512 ones
  // reduce per-thread weight gradients in it.
  if (cpu_has_avx512_core()) {
    EXPECT_GT(striped, 10);
  }
  std::cout << "[          ] " << striped << " cases in strips\n";
  {
    const WeightsScratchLimit large(std::size_t{1} << 40);
    const Case c = winograd_case(32, 32);
    std::unique_ptr<OneDnnConv> k = OneDnnConv::create(c.shapes(), c.geometry());
    ASSERT_NE(k, nullptr);
    EXPECT_EQ(k->weights_strips(), 0) << "under the limit: one call";
  }
}

// Under --precision bf16 oneDNN's backward-weights kernel copies x and dy whole into its
// scratchpad (1 GiB for 32 channels at 2048x2048): in strips its gradients are the whole call's
// (the same bfloat16 products, float32 sums in another order), padded first and last strips,
// strides and dilations included.
TEST(OneDnnConv, Bf16BackwardWeightsInStripsMatchesTheWholeCall) {
  if (!onednn_bf16_supported())
    GTEST_SKIP() << "oneDNN has no bfloat16 convolutions of its own here";
  const Bf16Switch bf16;
  int tested = 0;
  for (auto [stride, dilation, pad] : {std::tuple{1, 1, 1}, {2, 1, 0}, {1, 2, 2}, {3, 1, 1}}) {
    Case c = winograd_case(32, 128);  // strided: bfloat16 from 128 products an input value on
    c.n = 2, c.stride = stride, c.dilation = dilation, c.pad = pad, c.out_h = 13;
    c.trailing = stride - 1;
    std::unique_ptr<OneDnnConv> whole = OneDnnConv::create(c.shapes(), c.geometry());
    std::unique_ptr<OneDnnConv> strips;
    {
      const WeightsScratchLimit tiny(1);
      strips = OneDnnConv::create(c.shapes(), c.geometry());
    }
    ASSERT_TRUE(whole && strips) << c.str();
    ASSERT_NE(strips->name().find("bf16"), std::string::npos) << strips->name();
    if (strips->weights_strips() == 0) continue;  // no scratchpad asked for this shape
    const Tensor<float> x = random_tensor(c.x(), 1), dy = random_tensor(c.y(), 3);
    const Tensor<float> dw0 = random_tensor(c.w(), 5), db0 = random_tensor({c.o, 1, 1, 1}, 6);
    Tensor<float> dw_whole = dw0, db_whole = db0, dw_strips = dw0, db_strips = db0;
    whole->backward_filter(x, dy, dw_whole, db_whole.span());
    strips->backward_filter(x, dy, dw_strips, db_strips.span());
    EXPECT_LE(rel_error(dw_strips.span(), dw_whole.span()), 1e-5) << c.str();
    EXPECT_LE(rel_error(db_strips.span(), db_whole.span()), 1e-5) << c.str();
    // And near float32's reference: bfloat16 keeps 8 bits of each factor.
    Tensor<double> dwd = to_double(dw0), dbd = to_double(db0);
    reference::conv2d_backward_filter(to_double(x), to_double(dy), dwd, dbd.span(), c.geometry());
    EXPECT_LE(rel_error(dw_strips.span(), dwd.span()), 2e-2) << c.str();
    ++tested;
  }
  EXPECT_GT(tested, 0) << "oneDNN's bf16 backward-weights asked no scratchpad for any shape";
}

// A 1x1 conv of fewer than 16 channels on each side between NCHW tensors (a segmentation head)
// is planned in NCHW, one GEMM per pass with no conversions, and gives the reference's results.
TEST(OneDnnConv, NarrowPointwiseConvsComputeInPlaceAsGemms) {
  Case head = winograd_case(8, 2);
  head.kernel = 1;
  std::unique_ptr<OneDnnConv> k = OneDnnConv::create(head.shapes(), head.geometry());
  ASSERT_NE(k, nullptr);
  const std::string name = k->name();
  std::size_t gemm = 0;
  for (std::size_t at = name.find("gemm"); at != std::string::npos; at = name.find("gemm", at + 1))
    ++gemm;
  EXPECT_EQ(gemm, 3u) << name;
  expect_matches_reference(*k, head);
}

// A narrow 1x1 conv whose window is its tile in nchw8c (a head after 8-channel activations:
// Conv2d plans the tile in nchw8c where its input is expected so) is GEMMs on the 8-channel
// blocks (make_onednn_blocked_pointwise), through the backend too: the reference's results on all
// three passes, the weight and bias gradients added to what they held, two samples. Cases it does
// not express go to the other kernels.
TEST(OneDnnConv, NarrowPointwiseConvsOnEightChannelBlocksAreGemms) {
  for (const auto& [channels, outputs, bias] :
       {std::tuple{8, 2, true}, std::tuple{24, 3, false}, std::tuple{8, 15, true}}) {
    Case c = winograd_case(channels, outputs);
    c.kernel = 1;
    c.n = 2;
    c.bias = bias;
    const std::string what = c.str();
    const ConvGeometry g = c.geometry();
    ConvShapes shapes = c.shapes();
    shapes.x_layout = Layout::nchw8c;
    std::unique_ptr<ConvKernel<float>> k = make_onednn_blocked_pointwise(shapes, g);
    ASSERT_NE(k, nullptr) << what;
    EXPECT_EQ(k->name(), "onednn sgemm (1x1 from nchw8c)");
    EXPECT_EQ(backend_of(KernelBackend::onednn).conv<float>(shapes, g)->name(), k->name());
    // The three passes, the weight and bias gradients added to what they held.
    expect_matches_reference(*k, c, Layout::nchw8c);
    const Tensor<float> w = random_tensor(c.w(), 2);
    Tensor<float> y(c.y());
    EXPECT_THROW(k->forward(Tensor<float>({1, 8, 2, 2}), w, {}, y), Error) << "shape, " << what;
    EXPECT_THROW(
        k->forward(Tensor<float>(c.x(), Layout::nchw8c), Tensor<float>({c.o, 1, 1, 1}), {}, y),
        Error)
        << "weight shape, " << what;
  }
  Case c = winograd_case(8, 2);
  c.kernel = 1;
  const ConvGeometry g = c.geometry();
  ConvShapes shapes = c.shapes();
  shapes.x_layout = Layout::nchw8c;
  ConvShapes plain = shapes, activated = shapes;
  Case sixteen = winograd_case(8, 16);
  sixteen.kernel = 1;
  ConvShapes wide = sixteen.shapes();
  wide.x_layout = Layout::nchw8c;
  plain.x_layout = Layout::nchw;
  activated.activation = FusedActivation{.kind = ActivationKind::relu, .slope = 0};
  EXPECT_EQ(make_onednn_blocked_pointwise(wide, g), nullptr) << "16 outputs: oneDNN's blocks";
  EXPECT_EQ(make_onednn_blocked_pointwise(plain, g), nullptr) << "an NCHW window";
  EXPECT_EQ(make_onednn_blocked_pointwise(activated, g), nullptr) << "a fused activation";
  Case strided = c;
  strided.stride = 2;
  ConvShapes s2 = strided.shapes();
  s2.x_layout = Layout::nchw8c;
  EXPECT_EQ(make_onednn_blocked_pointwise(s2, strided.geometry()), nullptr) << "stride 2";
}

// The kernel a 1x1 conv from x in `layout` gets: the GEMMs on 8-channel blocks from nchw8c,
// oneDNN's otherwise.
std::unique_ptr<ConvKernel<float>> pointwise_kernel(const Case& c, Layout layout) {
  ConvShapes shapes = c.shapes();
  shapes.x_layout = layout;
  if (layout == Layout::nchw8c) return make_onednn_blocked_pointwise(shapes, c.geometry());
  return OneDnnConv::create(shapes, c.geometry());
}

// A 1x1 conv's backward in one pass (backward_fused, what Conv2d runs for a head whose window is
// its tile), and its forward, on the GEMMs of 8-channel blocks and on oneDNN's NCHW and nchw16c
// kernels (from nchw16c both passes are Tessera's loops): dx as
// backward-data, times f' of the fused input activation read from x (the activation's output), and
// the weight and bias gradients added to what they held, against the reference in double; image
// sides that leave pixels past the last 16-pixel vector; two samples. A sigmoid's f', more than 8
// outputs and kernels other than 1x1 go the separate way (false, nothing written).
TEST(OneDnnConv, PointwiseBackwardIsOnePassWithTheActivationsDerivative) {
  if (simd_level() != SimdLevel::avx512) GTEST_SKIP() << "the fused pass is AVX-512 only";
  const std::optional<FusedActivation> none;
  // With and without streaming stores (every output streams where its alignment allows: an odd
  // pixel count leaves nchw8c's odd blocks and samples on 32 bytes, which must not stream).
  const std::int64_t streaming = streaming_store_bytes();
  for (const std::int64_t threshold : {streaming, std::int64_t{0}})
    for (const Layout layout : {Layout::nchw8c, Layout::nchw, Layout::nchw16c})
      for (const auto& [eights, outputs, bias, f] :
           {std::tuple{1, 2, true, std::optional<FusedActivation>{{ActivationKind::relu, 0}}},
            std::tuple{3, 2, false,
                       std::optional<FusedActivation>{{ActivationKind::leaky_relu, 0.1}}},
            std::tuple{1, 8, true, none}}) {
        // 8, 24 and 8 channels; in 16-channel blocks 16, 48 and 16.
        const std::int64_t channels = eights * (layout == Layout::nchw16c ? 16 : 8);
        set_streaming_store_bytes(threshold);
        Case c = winograd_case(channels, outputs);
        c.kernel = 1;
        c.n = 2;
        c.bias = bias;
        c.out_w = 19;  // 21 x 19 pixels: 24 vectors and 15 left
        const std::string what = c.str() + " from " + to_string(layout);
        std::unique_ptr<ConvKernel<float>> k = pointwise_kernel(c, layout);
        ASSERT_NE(k, nullptr) << what;
        // x as an activation's output: about a third of it zero (ReLU) or negative (leaky).
        Tensor<float> x_plain = random_tensor(c.x(), 1);
        if (f && f->kind == ActivationKind::relu)
          for (float& v : x_plain.span())
            v = v < -0.3f ? 0.0f : v;
        const Tensor<float> x = to_layout(x_plain, layout);
        const Tensor<float> w = random_tensor(c.w(), 2), dy = random_tensor(c.y(), 3);
        Tensor<float> dx(c.x(), layout, 7.0f);
        Tensor<float> dw = random_tensor(c.w(), 5);
        Tensor<float> db = bias ? random_tensor({c.o, 1, 1, 1}, 6) : Tensor<float>();
        Tensor<double> dwd = to_double(dw), dbd = to_double(db), dxd(c.x());
        ASSERT_TRUE(k->backward_fused(x, dy, w, f, dx, dw, db.span())) << what;
        const Tensor<double> xd = to_double(x_plain), wd = to_double(w), dyd = to_double(dy);
        reference::conv2d_backward_data(dyd, wd, dxd, c.geometry());
        if (f)
          for (std::int64_t i = 0; i < dxd.numel(); ++i)
            if (!(xd.data()[i] > 0)) dxd.data()[i] *= f->slope;
        reference::conv2d_backward_filter(xd, dyd, dwd, dbd.span(), c.geometry());
        const Tensor<float> dx_plain = to_layout(dx, Layout::nchw);
        EXPECT_LE(rel_error(dx_plain.span(), dxd.span()), kTolerance) << "dx, " << what;
        EXPECT_LE(rel_error(dw.span(), dwd.span()), kTolerance) << "dw, " << what;
        EXPECT_LE(rel_error(db.span(), dbd.span()), kTolerance) << "dbias, " << what;
        // The forward too (from nchw16c, one pass of Tessera's loops: pointwise_forward_one_pass).
        const Tensor<float> b = bias ? random_tensor({c.o, 1, 1, 1}, 4) : Tensor<float>();
        Tensor<float> y(c.y(), 7.0f);
        k->forward(x, w, b.span(), y);
        Tensor<double> yd(c.y());
        const Tensor<double> bd = to_double(b);
        reference::conv2d_forward(xd, wd, bd.span(), yd, c.geometry());
        EXPECT_LE(rel_error(y.span(), yd.span()), kTolerance) << "forward, " << what;
        if (f) {  // f' made a difference: applied, not skipped
          Tensor<float> unactivated(c.x(), layout);
          k->backward_data(dy, w, unactivated);
          EXPECT_GT(rel_error(to_layout(unactivated, Layout::nchw).span(), dxd.span()), kTolerance)
              << what;
        }
      }
  set_streaming_store_bytes(streaming);
  // Declined: nothing written.
  const auto declines = [](const Case& c, Layout layout, const std::optional<FusedActivation>& f,
                           const std::string& what) {
    std::unique_ptr<ConvKernel<float>> k = pointwise_kernel(c, layout);
    ASSERT_NE(k, nullptr) << what;
    const Tensor<float> x(c.x(), layout, 1.0f), w(c.w(), 1.0f), dy(c.y(), 1.0f);
    Tensor<float> dx(c.x(), layout, 7.0f), dw(c.w(), 0.0f), db({c.o, 1, 1, 1}, 0.0f);
    EXPECT_FALSE(k->backward_fused(x, dy, w, f, dx, dw, db.span())) << what;
    EXPECT_EQ(dx.span()[0], 7.0f) << what;
    EXPECT_EQ(dw.span()[0], 0.0f) << what;
  };
  Case fifteen = winograd_case(8, 15), two = winograd_case(8, 2), three = winograd_case(8, 2);
  fifteen.kernel = two.kernel = 1;
  declines(fifteen, Layout::nchw8c, none, "15 outputs");
  declines(two, Layout::nchw8c, FusedActivation{ActivationKind::sigmoid, 0}, "a sigmoid");
  declines(three, Layout::nchw, none, "a 3x3 kernel");
}

TEST(OneDnnConv, RefusesTensorsOfOtherShapes) {
  const Case c = sweep()[7];
  std::unique_ptr<OneDnnConv> k = OneDnnConv::create(c.shapes(), c.geometry());
  ASSERT_NE(k, nullptr);
  const Tensor<float> w = random_tensor(c.w(), 2), b({c.o, 1, 1, 1});
  Shape4 other = c.x();
  other.h += 1;
  Tensor<float> y(c.y());
  EXPECT_THROW(k->forward(Tensor<float>(other), w, c.bias ? b.span() : std::span<const float>(), y),
               Error);
}

#else

TEST(OneDnnConv, NotBuilt) {
  GTEST_SKIP() << "built without oneDNN (libdnnl)";
}

#endif

}  // namespace
}  // namespace tessera
