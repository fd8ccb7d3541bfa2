// Sharded forward and backward against the single-rank run, over the convolution matrix of
// README.md "Tests": every rank compares its own tiles with the reference it computes itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <sstream>

#include "check_model.hpp"
#include "mpi_test.hpp"
#include "tessera/batch.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera/layers/conv2d.hpp"

namespace tessera {
namespace {

struct ConvCase {
  std::int64_t kernel, stride, dilation;
  std::string padding;  // JSON: 0, "same", or [2, 1]
  std::int64_t height, width;

  std::string str() const {
    std::ostringstream s;
    s << "kernel " << kernel << " stride " << stride << " dilation " << dilation << " padding "
      << padding << " image " << height << "x" << width;
    return s.str();
  }
  // The conv's output rows and columns, from PyTorch's formula.
  test::CheckOptions options() const {
    if (padding == "\"same\"") return {.smallest_h = height, .smallest_w = width};
    const std::int64_t ph = padding == "0" ? 0 : 2, pw = padding == "0" ? 0 : 1;  // or [2, 1]
    return {.smallest_h = test::window_rows(height, kernel, stride, dilation, ph),
            .smallest_w = test::window_rows(width, kernel, stride, dilation, pw)};
  }
  // conv (the case) -> relu -> 1x1 conv head to 3 classes.
  std::string model() const {
    std::ostringstream s;
    s << R"({"name": "case", "input_channels": 2, "layers": [)"
      << R"({"name": "c", "type": "conv2d", "out_channels": 4, "kernel": )" << kernel
      << ", \"stride\": " << stride << ", \"dilation\": " << dilation
      << ", \"padding\": " << padding << "},"
      << R"({"name": "r", "type": "relu"},)"
      << R"({"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";
    return s.str();
  }
};

std::vector<ConvCase> conv_cases() {
  std::vector<ConvCase> out;
  for (auto [h, w] : {std::pair{17, 15}, std::pair{10, 9}})
    for (std::int64_t k : {1, 2, 3, 5, 7})
      for (std::int64_t s : {1, 2, 3})
        for (std::int64_t d : {1, 2})
          for (std::string p : {"0", "\"same\"", "[2, 1]"}) {
            if (p == "\"same\"" && s != 1) continue;  // PyTorch's rule, enforced by the parser
            const ConvCase c{k, s, d, p, h, w};
            // A kernel reaching past the padded image has no output on any grid.
            if (c.options().smallest_h > 0 && c.options().smallest_w > 0) out.push_back(c);
          }
  return out;
}

TEST(ConvGrad, MatrixFloat64) {
  for (const ConvCase& c : conv_cases())
    test::check_model<double>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                              c.options());
}

TEST(ConvGrad, MatrixFloat32) {
  for (const ConvCase& c : conv_cases())
    test::check_model<float>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                             c.options());
}

// The matrices above run with the interior computed while halos travel: on a grid with more
// than one spatial rank a 3x3 conv splits its tile into the interior and the strips next to its
// neighbours, and alone it does not.
TEST(ConvGrad, InteriorOverlapsTheHalos) {
  RuntimeOptions options = test::world_runtime().options();
  options.windowless = false;  // the window path's strips (windowless: the test below)
  options.overlap = false;
  const Runtime without = test::make_test_runtime(options);
  options.overlap = true;
  const Runtime with = test::make_test_runtime(options);
  const Comm& grid = with.comm();
  const Distribution in{{3, 2, 17, 15}, grid.shape(), grid.coords()};
  const Conv2dSpec spec{
      .out_channels = 4, .kernel = {3, 3}, .pad_begin = {1, 1}, .pad_end = {1, 1}};
  const GridShape g = grid.shape();
  // Neighbours above and below add top and bottom strips; left and right add side strips.
  const std::size_t strips = (g.h > 1 ? (grid.coords().i > 0) + (grid.coords().i + 1 < g.h) : 0) +
                             (g.w > 1 ? (grid.coords().j > 0) + (grid.coords().j + 1 < g.w) : 0);
  for (const Runtime* runtime : {&with, &without}) {
    Conv2d<float> conv("c", spec, 1);
    conv.setup(in);
    conv.bind(*runtime);
    if (runtime->overlap())
      EXPECT_EQ(conv.overlap_regions(), strips == 0 ? 0 : 1 + strips);
    else
      EXPECT_EQ(conv.overlap_regions(), 0u);
  }
}

// The matrices above compute the convs of stride 1 whose output tiles are their input tiles
// ("same" padding) windowless: the tile from itself with the kernel's zero padding, then the
// border strips next to neighbours from strip buffers of their own, with or without overlap.
// Other convs, and convs on tiles too small for an interior, keep their windows.
TEST(ConvGrad, WindowlessConvsComputeTheirBorderStrips) {
  RuntimeOptions options = test::world_runtime().options();
  options.windowless = true;
  const Comm& grid = test::world_runtime().comm();
  const GridShape g = grid.shape();
  const std::size_t strips = (g.h > 1 ? (grid.coords().i > 0) + (grid.coords().i + 1 < g.h) : 0) +
                             (g.w > 1 ? (grid.coords().j > 0) + (grid.coords().j + 1 < g.w) : 0);
  const Conv2dSpec same{
      .out_channels = 4, .kernel = {3, 3}, .pad_begin = {1, 1}, .pad_end = {1, 1}};
  Conv2dSpec strided = same;
  strided.stride = {2, 2};
  Conv2dSpec pointwise = same;
  pointwise.kernel = {1, 1};
  pointwise.pad_begin = pointwise.pad_end = {0, 0};
  // 7x7 over 8 x 15: a middle tile of 3 rows or 5 columns has no output reading only its own
  // tile (3 rows each way), two tiles on an axis do.
  Conv2dSpec wide = same;
  wide.kernel = {7, 7};
  wide.pad_begin = wide.pad_end = {3, 3};
  for (bool overlap : {true, false}) {
    options.overlap = overlap;
    const Runtime runtime = test::make_test_runtime(options);
    const auto bound = [&](const Conv2dSpec& spec, std::int64_t h) {
      auto conv = std::make_unique<Conv2d<float>>("c", spec, 1);
      conv->setup(Distribution{{3, 2, h, 15}, g, grid.coords()});
      conv->bind(runtime);
      return conv;
    };
    // Device memory (the emulated device's) keeps its windows where the tile has neighbours.
    const bool host = runtime.allocator().space() == MemorySpace::host;
    const auto c = bound(same, 17);
    EXPECT_EQ(c->windowless(), host || (g.h == 1 && g.w == 1));
    // A tile that is the whole image (this rank's own, on a grid of one tile): windowless in
    // host and device memory alike, with no strips.
    {
      Conv2d<float> whole("c", same, 1);
      whole.setup(Distribution{{3, 2, 17, 15}, GridShape{}, GridCoords{}});
      whole.bind(runtime);
      EXPECT_TRUE(whole.windowless());
      EXPECT_EQ(whole.border_strips(), 0u);
    }
    if (host) {
      EXPECT_EQ(c->border_strips(), strips);
      EXPECT_EQ(c->overlap_regions(), 0u);
    }
    EXPECT_FALSE(bound(strided, 17)->windowless());
    EXPECT_FALSE(bound(pointwise, 17)->windowless());
    EXPECT_EQ(bound(wide, 8)->windowless(),
              (host && g.h <= 2 && g.w <= 2) || (g.h == 1 && g.w == 1));
  }
  options.windowless = false;
  const Runtime off = test::make_test_runtime(options);
  Conv2d<float> c("c", same, 1);
  c.setup(Distribution{{3, 2, 17, 15}, g, grid.coords()});
  c.bind(off);
  EXPECT_FALSE(c.windowless());
}

// The same-padding cases of the matrix on the window path (TESSERA_WINDOWLESS=0) against the
// single-rank run, which computes them windowless: the two paths agree.
TEST(ConvGrad, SameConvsOnTheWindowPathFloat64) {
  RuntimeOptions options = test::world_runtime().options();
  options.windowless = false;
  const Runtime windows = test::make_test_runtime(options);
  int cases = 0;
  for (const ConvCase& c : conv_cases()) {
    if (c.stride != 1 || c.padding != "\"same\"") continue;
    test::CheckOptions o = c.options();
    o.grid = &windows;
    test::check_model<double>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(), o);
    ++cases;
  }
  EXPECT_GE(cases, 10);
}

// Training does not ask for dL/dimages: the first conv then skips its backward-data and the
// exchange after it, and every parameter gradient is the same, bit for bit. On a GPU with
// cuDNN's deterministic algorithms: its fastest backward-filter algorithms add with atomics, in an
// order that changes from run to run.
TEST(ConvGrad, SkippingTheInputGradientChangesNoParameterGradient) {
  struct Deterministic {
    CudaOptions saved = cuda_options();
    Deterministic() {
      CudaOptions o = saved;
      o.deterministic = true;
      set_cuda_options(o);
    }
    ~Deterministic() { set_cuda_options(saved); }
  } deterministic;
  const Runtime& grid = test::world_runtime();
  const ModelSpec spec = load_model("convstack-small");
  const Shape4 input{3, 3, 17, 15};
  Model<double> with(spec, grid, input), without(spec, grid, input);
  with.init_params(7);
  without.init_params(7);
  without.set_input_grad(false);
  DistTensor<double> x(with.input_distribution());
  x.local = random_image_tile<double>(x.dist, 7);
  const Labels labels = random_label_tile(with.output_distribution(), 7);
  const StepResult<double> a = forward_backward(with, x, labels);
  const StepResult<double> b = forward_backward(without, x, labels);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.input_grad.local.numel(), x.local.numel());
  EXPECT_EQ(b.input_grad.local.numel(), 0);
  const auto pa = with.params(), pb = without.params();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t k = 0; k < pa.size(); ++k) {
    const Tensor<double> ha = to_host(pa[k].param->grad), hb = to_host(pb[k].param->grad);
    const std::span<const double> ga = ha.span(), gb = hb.span();
    EXPECT_TRUE(std::equal(ga.begin(), ga.end(), gb.begin(), gb.end())) << pa[k].key();
  }
}

// conv (3 -> c1) -> relu -> conv (c1 -> c2, each geometry of the matrix's kind) -> relu ->
// [conv to 8] -> 1x1 head, float32 on the test grid against one rank.
void check_wide_chain(std::int64_t c1, std::int64_t c2, bool narrow_tail) {
  for (const std::string second :
       {R"("kernel": 3, "padding": 1)", R"("kernel": 3, "stride": 2, "padding": 1)",
        R"("kernel": 5, "dilation": 2, "padding": "same")",
        R"("kernel": [2, 3], "padding": [2, 1])"}) {
    std::string model = R"({"name": "wide", "input_channels": 3, "layers": [)"
                        R"({"name": "c1", "type": "conv2d", "out_channels": )" +
                        std::to_string(c1) +
                        R"(, "kernel": 3, "padding": 1},)"
                        R"({"name": "r1", "type": "relu"},)"
                        R"({"name": "c2", "type": "conv2d", "out_channels": )" +
                        std::to_string(c2) + ", " + second +
                        R"(},)"
                        R"({"name": "r2", "type": "relu"},)";
    if (narrow_tail)
      model += R"({"name": "c3", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1},)";
    model += R"({"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";
    test::check_model<float>(parse_model(model), {3, 3, 17, 15},
                             std::to_string(c1) + " -> " + std::to_string(c2) + ", c2 " + second);
  }
}

// Convs reading 16 or 32 channels assemble their windows in nchw16c (float32, oneDNN): the
// exchange converts, oneDNN reads the window and writes its gradient in place; strides,
// dilations and asymmetric padding as in the matrix.
TEST(ConvGrad, ChannelBlockedWindowsFloat32) {
  check_wide_chain(16, 32, false);
}

// Convs reading 20 or 24 channels assemble their windows in nchw16c with the last block padded
// (float32, oneDNN); then 8 channels (NCHW again).
TEST(ConvGrad, ChannelPaddedWindowsFloat32) {
  check_wide_chain(20, 24, true);
}

// Pooling between convs of 16 and 32 channels pools nchw16c windows into nchw16c outputs
// (oneDNN), with padding (the window's -infinity / zero border) and without.
TEST(ConvGrad, ChannelBlockedPoolingFloat32) {
  for (const std::string pool :
       {R"("type": "maxpool2d", "kernel": 2)",
        R"("type": "maxpool2d", "kernel": 3, "stride": 2, "padding": 1)",
        R"("type": "avgpool2d", "kernel": 3, "stride": 2, "padding": 1)"}) {
    const std::string model =
        R"({"name": "blocked", "input_channels": 3, "layers": [)"
        R"({"name": "c1", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1},)"
        R"({"name": "r1", "type": "relu"},)"
        R"({"name": "p1", )" +
        pool +
        R"(},)"
        R"({"name": "c2", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": 1},)"
        R"({"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";
    test::check_model<float>(parse_model(model), {3, 3, 17, 15}, "p1 " + pool);
  }
}

TEST(ConvGrad, BuiltinModelBothDtypes) {
  const ModelSpec spec = load_model("convstack-small");
  test::check_model<double>(spec, {3, 3, 33, 31}, "convstack-small float64");
  test::check_model<float>(spec, {3, 3, 33, 31}, "convstack-small float32");
}

TEST(ConvGrad, NonSquareKernelsStridesAndNoBias) {
  const ModelSpec spec = parse_model(R"({"input_channels": 2, "layers": [
    {"type": "conv2d", "out_channels": 3, "kernel": [3, 5], "stride": [2, 1], "dilation": [1, 2], "padding": [1, 4], "bias": false},
    {"type": "relu"},
    {"type": "conv2d", "out_channels": 3, "kernel": [2, 1], "stride": [1, 3], "padding": [0, 2]},
    {"type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  test::check_model<double>(spec, {2, 2, 19, 23}, "non-square float64");
  test::check_model<float>(spec, {2, 2, 19, 23}, "non-square float32");
}

// Both backends in one process, on the test grid: the same float32 model on reference kernels
// and on oneDNN computes the same step (to float32 rounding), so neither depends on a setting
// read at start-up.
TEST(ConvGrad, BothBackendsInOneProcessAgree) {
  if (default_kernel_backend() != KernelBackend::onednn) GTEST_SKIP() << "built without oneDNN";
  RuntimeOptions options = test::world_runtime().options();
  options.kernels = KernelBackend::reference;
  const Runtime reference = test::make_test_runtime(options);
  options.kernels = KernelBackend::onednn;
  const Runtime onednn = test::make_test_runtime(options);
  const ModelSpec spec = load_model("convstack-small");
  const Shape4 input{3, 3, 17, 15};
  Model<float> r(spec, reference, input), o(spec, onednn, input);
  r.init_params(5);
  o.init_params(5);
  DistTensor<float> x(r.input_distribution());
  x.local = random_image_tile<float>(x.dist, 5);
  const Labels labels = random_label_tile(r.output_distribution(), 5);
  const StepResult<float> a = forward_backward(r, x, labels);
  const StepResult<float> b = forward_backward(o, x, labels);
  EXPECT_NEAR(a.loss, b.loss, 1e-4 * std::abs(a.loss));
  const std::span<const float> ya = a.output.local.span(), yb = b.output.local.span();
  EXPECT_LE(test::rel_error(yb, ya), 1e-4) << "output";
  const auto pa = r.params(), pb = o.params();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t k = 0; k < pa.size(); ++k) {
    const std::span<const float> ga = pa[k].param->grad.span(), gb = pb[k].param->grad.span();
    EXPECT_LE(test::rel_error(gb, ga), 1e-4) << pa[k].key();
  }
}

TEST(ConvGrad, FewerSamplesThanGroupsIsAnError) {
  const GridShape g = test::test_grid();
  if (g.n == 1) GTEST_SKIP() << "needs a data-parallel grid";
  const Runtime& grid = test::world_runtime();
  const ModelSpec spec = load_model("convstack-small");
  try {
    Model<double> m(spec, grid, {g.n - 1, 3, 33, 31});
    ADD_FAILURE() << "accepted a batch smaller than the sample groups";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data-parallel groups"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
