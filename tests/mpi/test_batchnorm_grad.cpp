// Batch norm on the test grid against one rank: the statistics must be those of the whole global
// batch (every sample group, every tile), in training and evaluation, float64 and float32, and
// stable in float32 when the mean dwarfs the spread.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <sstream>
#include <utility>

#include "check_model.hpp"
#include "mpi_test.hpp"
#include "tessera/batch.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/random.hpp"

namespace tessera {
namespace {

// conv -> batchnorm -> relu -> 1x1 conv head; `bn_fields` is JSON text inside the bn layer. A
// conv feeding a batch norm has no bias, as usual: the batch mean would cancel it, and its
// gradient would be rounding noise (zero in exact arithmetic), meaningless to compare.
std::string conv_bn_model(const std::string& bn_fields) {
  return R"({"name": "bn", "input_channels": 2, "layers": [
    {"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1, "bias": false},
    {"name": "bn1", "type": "batchnorm2d")" +
         (bn_fields.empty() ? "" : ", " + bn_fields) + R"(},
    {"name": "r1", "type": "relu"},
    {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";
}

struct BnCase {
  double momentum, eps;
  std::string fields() const {
    std::ostringstream s;
    s << "\"momentum\": " << momentum << ", \"eps\": " << eps;
    return s.str();
  }
};

TEST(BatchNormGrad, ConvBatchNormReluTrainAndEval) {
  const BnCase cases[] = {{0.1, 1e-5}, {0.5, 1e-3}, {1.0, 0.1}, {0.0, 1e-5}};
  for (auto [h, w] : {std::pair{17, 15}, std::pair{10, 9}})
    for (Mode mode : {Mode::train, Mode::eval}) {
      const std::string m = mode == Mode::train ? "train " : "eval ";
      const std::string image = " image " + std::to_string(h) + "x" + std::to_string(w);
      test::check_model<double>(parse_model(conv_bn_model("")), {3, 2, h, w},
                                m + "defaults float64" + image, {.mode = mode});
      test::check_model<float>(parse_model(conv_bn_model("")), {3, 2, h, w},
                               m + "defaults float32" + image, {.mode = mode});
      for (const BnCase& c : cases) {
        const ModelSpec spec = parse_model(conv_bn_model(c.fields()));
        test::check_model<double>(spec, {3, 2, h, w}, m + c.fields() + " float64" + image,
                                  {.mode = mode});
        test::check_model<float>(spec, {3, 2, h, w}, m + c.fields() + " float32" + image,
                                 {.mode = mode});
      }
    }
}

// Between convs of 16 and 32 channels the batch norms take and give nchw16c (float32, oneDNN
// convs): per-block sums, the same global statistics on every grid; training and evaluation.
TEST(BatchNormGrad, ChannelBlockedFloat32) {
  const ModelSpec spec = parse_model(R"({"name": "bn16", "input_channels": 3, "layers": [
    {"name": "c1", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1, "bias": false},
    {"name": "bn1", "type": "batchnorm2d"},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": 1, "bias": false},
    {"name": "bn2", "type": "batchnorm2d", "momentum": 0.5},
    {"name": "r2", "type": "relu"},
    {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})");
  for (Mode mode : {Mode::train, Mode::eval})
    test::check_model<float>(spec, {3, 3, 17, 15},
                             mode == Mode::train ? "blocked train" : "blocked eval",
                             {.mode = mode});
}

// Batch norm on the model's input, and after a stride-2 conv whose tiles do not line up with
// its input's; two samples over two sample groups leave one sample per group. c1 pads, so bn0's
// bias does not shift c1's output uniformly (bn1 would cancel that, leaving bn0's bias gradient
// at zero, i.e. rounding noise).
TEST(BatchNormGrad, OnTheInputAndAfterAStridedConv) {
  const ModelSpec spec = parse_model(R"({"input_channels": 3, "layers": [
    {"name": "bn0", "type": "batchnorm2d", "momentum": 0.3},
    {"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "stride": 2, "padding": 1, "bias": false},
    {"name": "bn1", "type": "batchnorm2d", "eps": 0.01},
    {"name": "r1", "type": "leaky_relu"},
    {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 3, "padding": "same"}]})");
  for (Shape4 s : {Shape4{3, 3, 17, 15}, Shape4{2, 3, 10, 9}})
    for (Mode mode : {Mode::train, Mode::eval}) {
      const std::string what = (mode == Mode::train ? "train " : "eval ") + s.str();
      test::check_model<double>(spec, s, what + " float64", {.mode = mode});
      test::check_model<float>(spec, s, what + " float32", {.mode = mode});
    }
}

// The image of this rank's tile: value(global flat index) for every element.
template <typename T>
DistTensor<T> make_input(const Distribution& d, const std::function<double(std::int64_t)>& value) {
  DistTensor<T> x(d);
  const Shape4& g = d.global;
  const Range ns = d.samples(), hs = d.rows(), ws = d.cols();
  for (std::int64_t n = ns.begin; n < ns.end; ++n)
    for (std::int64_t c = 0; c < g.c; ++c)
      for (std::int64_t h = hs.begin; h < hs.end; ++h)
        for (std::int64_t w = ws.begin; w < ws.end; ++w)
          x.local.at(n - ns.begin, c, h - hs.begin, w - ws.begin) =
              static_cast<T>(value(((n * g.c + c) * g.h + h) * g.w + w));
  return x;
}

// One step of `sharded` (on the test grid) and of `reference` (on one rank) with the same batch;
// expects loss, output, input gradient, every parameter gradient and every buffer within `tol`.
template <typename S, typename R>
void expect_same_step(Model<S>& sharded, Model<R>& reference,
                      const std::function<double(std::int64_t)>& input, std::uint64_t seed,
                      double tol, const std::string& what) {
  const DistTensor<S> x = make_input<S>(sharded.input_distribution(), input);
  const DistTensor<R> rx = make_input<R>(reference.input_distribution(), input);
  const auto labels = random_label_tile(sharded.output_distribution(), seed);
  const auto rlabels = random_label_tile(reference.output_distribution(), seed);
  const StepResult<S> s = forward_backward(sharded, x, labels);
  const StepResult<R> r = forward_backward(reference, rx, rlabels);
  EXPECT_NEAR(s.loss, r.loss, tol * std::abs(r.loss)) << what;
  EXPECT_LE(test::tile_error(s.output, r.output.local), tol) << what << ": output";
  EXPECT_LE(test::tile_error(s.input_grad, r.input_grad.local), tol) << what << ": input gradient";
  auto ps = sharded.params();
  auto pr = reference.params();
  ASSERT_EQ(ps.size(), pr.size()) << what;
  // The sharded model may compute on a device (TESSERA_KERNELS=emulated): read in host copies.
  for (std::size_t k = 0; k < ps.size(); ++k) {
    const Tensor<S> mine = to_host(ps[k].param->grad);
    const Tensor<R> theirs = to_host(pr[k].param->grad);
    EXPECT_LE(test::rel_error(mine.span(), theirs.span()), tol)
        << what << ": gradient of " << ps[k].key();
  }
  auto bs = sharded.buffers();
  auto br = reference.buffers();
  ASSERT_EQ(bs.size(), br.size()) << what;
  for (std::size_t k = 0; k < bs.size(); ++k) {
    const Tensor<S> mine = to_host(bs[k].buffer->value);
    const Tensor<R> theirs = to_host(br[k].buffer->value);
    EXPECT_LE(test::rel_error(mine.span(), theirs.span()), tol)
        << what << ": buffer " << bs[k].key();
  }
}

// Uniform(-1, 1) from the seed and the global index.
std::function<double(std::int64_t)> uniform_input(std::uint64_t seed) {
  return [seed](std::int64_t k) {
    return static_cast<double>(static_cast<float>(2 * uniform01(seed, 99, std::uint64_t(k)) - 1));
  };
}

// Two training steps move the running statistics away from (0, 1); evaluation must then use
// them, the same on every rank.
template <typename T>
void check_eval_after_training() {
  const double tol = std::is_same_v<T, double> ? 1e-10 : 1e-4;
  const ModelSpec spec = parse_model(conv_bn_model(R"("momentum": 0.4)"));
  const Runtime& single = test::single_runtime();
  for (Shape4 input : {Shape4{3, 2, 17, 15}, Shape4{3, 2, 10, 9}}) {
    Model<T> sharded(spec, test::world_runtime(), input);
    Model<T> reference(spec, single, input);
    for (Model<T>* m : {&sharded, &reference})
      m->init_params(11);
    const std::string what = input.str() + (std::is_same_v<T, double> ? " float64" : " float32");
    for (std::uint64_t step = 1; step <= 2; ++step)
      expect_same_step(sharded, reference, uniform_input(step), step, tol,
                       what + " training step " + std::to_string(step));
    EXPECT_NE(reference.buffers().at(0).buffer->value.data()[0], T(0)) << what;
    sharded.state().mode = reference.state().mode = Mode::eval;
    expect_same_step(sharded, reference, uniform_input(3), 3, tol, what + " evaluation");
  }
}

TEST(BatchNormGrad, EvaluationUsesTheTrainedRunningStatistics) {
  check_eval_after_training<double>();
  check_eval_after_training<float>();
}

// A mean of 1e6 next to a spread of 0.6: E[x^2] - E[x]^2 would cancel ~12 of double's 16 digits
// (x^2 ~ 1e12) and be wrong at the 1e-3 level; the two-pass variance keeps float32 within its
// usual tolerance of the float64 result. The inputs 1e6 + k/16 (k in [-16, 16]) are exact in
// float32 (its spacing at 1e6 is 1/16), so both runs see the same numbers and every difference
// is the computation's.
TEST(BatchNormGrad, LargeMeanIsStableInFloat32AgainstFloat64) {
  const ModelSpec spec = parse_model(R"({"input_channels": 2, "layers": [
    {"name": "bn0", "type": "batchnorm2d"},
    {"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1, "bias": false},
    {"name": "bn1", "type": "batchnorm2d", "momentum": 0.5},
    {"name": "r1", "type": "relu"},
    {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})");
  auto input = [](std::int64_t k) {
    const double step = std::floor(33 * uniform01(5, 17, std::uint64_t(k))) - 16;
    const std::int64_t channel = (k / (17 * 15)) % 2;  // the 17x15 image's planes
    return (channel == 0 ? 1e6 : -7e5) + step / 16;
  };
  const Runtime& single = test::single_runtime();
  const Shape4 shape{3, 2, 17, 15};
  Model<float> sharded(spec, test::world_runtime(), shape);
  Model<double> reference(spec, single, shape);
  sharded.init_params(3);
  reference.init_params(3);
  // bn0's affine parameters by hand (the same values in both models), away from (1, 0).
  auto ps = sharded.params();
  auto pr = reference.params();
  // (The sharded model's parameters through host copies: it may compute on a device.)
  HostValues<float> weight0(ps[0].param->value), bias0(ps[1].param->value);
  for (std::size_t c = 0; c < 2; ++c) {
    const double weight = 0.5 + double(c), bias = 0.25 - double(c);
    weight0.span()[c] = static_cast<float>(weight);
    pr[0].param->value.data()[c] = weight;
    bias0.span()[c] = static_cast<float>(bias);
    pr[1].param->value.data()[c] = bias;
  }
  weight0.store();
  bias0.store();
  // init_params draws the conv weights in double and rounds them; give float64 the same values.
  for (std::size_t k = 2; k < ps.size(); ++k) {
    const Tensor<float> drawn = to_host(ps[k].param->value);
    for (std::int64_t i = 0; i < pr[k].param->value.numel(); ++i)
      pr[k].param->value.data()[i] = double(drawn.data()[i]);
  }
  expect_same_step(sharded, reference, input, 4, 1e-4, "mean 1e6, float32 vs float64");
  // bn0's running mean took a tenth (its momentum) of the batch mean of channel 0.
  EXPECT_NEAR(sharded.buffers().at(0).buffer->value.data()[0], 1e5, 0.1);
}

}  // namespace
}  // namespace tessera
