// Pointwise layers and the model graph on the test grid against one rank.
#include <gtest/gtest.h>

#include "check_model.hpp"
#include "mpi_test.hpp"

namespace tessera {
namespace {

const char* kPointwise = R"({"input_channels": 2, "layers": [
  {"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1},
  {"name": "a1", "type": "leaky_relu", "slope": 0.2},
  {"name": "c2", "type": "conv2d", "out_channels": 4, "kernel": 3, "stride": 2},
  {"name": "a2", "type": "sigmoid"},
  {"name": "d1", "type": "dropout", "p": 0.3},
  {"name": "c3", "type": "conv2d", "out_channels": 4, "kernel": 2, "dilation": 2, "padding": "same"},
  {"name": "a3", "type": "leaky_relu"},
  {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";

TEST(Pointwise, LeakyReluSigmoidAndDropoutInTrainingAndEvaluation) {
  const ModelSpec spec = parse_model(kPointwise);
  for (Mode mode : {Mode::train, Mode::eval}) {
    const std::string what = mode == Mode::train ? "train" : "eval";
    test::check_model<double>(spec, {3, 2, 17, 15}, what + " float64", {.mode = mode});
    test::check_model<float>(spec, {3, 2, 17, 15}, what + " float32", {.mode = mode});
  }
}

TEST(Pointwise, DropoutDropsTheSameElementsOnEveryGrid) {
  // p = 1 drops everything; a trained model's output then no longer depends on the input.
  const ModelSpec all = parse_model(R"({"input_channels": 2, "layers": [
    {"type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 1},
    {"type": "dropout", "p": 1.0},
    {"type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  test::check_model<double>(all, {2, 2, 9, 10}, "p = 1", {.zero_input_grad = true});
  const ModelSpec half = parse_model(R"({"input_channels": 2, "layers": [
    {"type": "dropout", "p": 0.5},
    {"type": "conv2d", "out_channels": 2, "kernel": 3, "padding": 1}]})");
  for (std::uint64_t seed : {1, 2, 3})
    test::check_model<double>(half, {2, 2, 13, 11}, "p = 0.5, seed " + std::to_string(seed),
                              {.seed = seed});
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

TEST(BuiltinModels, UnetSmallAndConvnetSmallMatchOneRankInTrainingAndEvaluation) {
  const ModelSpec unet = load_model("unet-small");
  const ModelSpec convnet = load_model("convnet-small");
  for (Mode mode : {Mode::train, Mode::eval}) {
    const std::string m = mode == Mode::train ? " train" : " eval";
    test::check_model<double>(unet, {3, 3, 36, 44}, "unet-small float64" + m, {.mode = mode});
    test::check_model<float>(unet, {2, 3, 24, 20}, "unet-small float32" + m, {.mode = mode});
    test::check_model<double>(convnet, {3, 3, 33, 31}, "convnet-small float64" + m, {.mode = mode});
    test::check_model<float>(convnet, {4, 3, 17, 20}, "convnet-small float32" + m, {.mode = mode});
  }
}

}  // namespace
}  // namespace tessera
