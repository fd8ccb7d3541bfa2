// Skip connections (concat, add, branches) and the classification head (global_avgpool, linear,
// cross_entropy) on the test grid against one rank.
#include <gtest/gtest.h>

#include "check_model.hpp"
#include "mpi_test.hpp"
#include "tessera/error.hpp"

namespace tessera {
namespace {

// c1 feeds three layers; a concat and an add join the branches again.
const char* kSkips = R"({"input_channels": 2, "layers": [
  {"name": "c1", "type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 1},
  {"name": "r1", "type": "relu"},
  {"name": "c2", "type": "conv2d", "out_channels": 4, "kernel": 5, "padding": 2, "dilation": 1},
  {"name": "c3", "type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 2, "dilation": 2, "inputs": "c1"},
  {"name": "k1", "type": "concat", "inputs": ["c2", "c3", "c1"]},
  {"name": "c4", "type": "conv2d", "out_channels": 3, "kernel": 1},
  {"name": "a1", "type": "add", "inputs": ["c4", "c1", "c3"]},
  {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 3, "padding": "same"}]})";

TEST(SkipConnections, ConcatAddAndBranchesMatchOneRank) {
  const ModelSpec spec = parse_model(kSkips);
  test::check_model<double>(spec, {3, 2, 17, 15}, "skips float64");
  test::check_model<float>(spec, {3, 2, 17, 15}, "skips float32");
  test::check_model<double>(spec, {2, 2, 10, 9}, "skips small tiles");
}

const char* kClassifier = R"({"input_channels": 3, "layers": [
  {"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "stride": 2, "padding": 1},
  {"name": "r1", "type": "relu"},
  {"name": "c2", "type": "conv2d", "out_channels": 6, "kernel": 3, "stride": 2},
  {"name": "r2", "type": "leaky_relu"},
  {"name": "gap", "type": "global_avgpool"},
  {"name": "fc1", "type": "linear", "out_features": 5},
  {"name": "s1", "type": "sigmoid"},
  {"name": "fc2", "type": "linear", "out_features": 3, "bias": false}],
  "loss": "cross_entropy"})";

TEST(ClassificationHead, GlobalPoolingLinearAndCrossEntropyMatchOneRank) {
  const ModelSpec spec = parse_model(kClassifier);
  for (Shape4 s : {Shape4{3, 3, 21, 19}, Shape4{4, 3, 12, 13}}) {
    // c2's output: the smallest image (12x13 gives 2x3, too few rows for 3 spatial rows).
    const auto c2 = [](std::int64_t x) {
      return test::window_rows(test::window_rows(x, 3, 2, 1, 1), 3, 2, 1, 0);
    };
    const test::CheckOptions options{.smallest_h = c2(s.h), .smallest_w = c2(s.w)};
    test::check_model<double>(spec, s, "classifier float64 " + s.str(), options);
    test::check_model<float>(spec, s, "classifier float32 " + s.str(), options);
  }
}

// A replicated vector joined with itself: merge layers accept replicated inputs too.
TEST(ClassificationHead, AddOfReplicatedVectors) {
  const ModelSpec spec = parse_model(R"({"input_channels": 2, "layers": [
    {"name": "c1", "type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 1},
    {"name": "gap", "type": "global_avgpool"},
    {"name": "fc1", "type": "linear", "out_features": 3},
    {"name": "sum", "type": "add", "inputs": ["fc1", "gap"]},
    {"name": "fc2", "type": "linear", "out_features": 2}], "loss": "cross_entropy"})");
  test::check_model<double>(spec, {3, 2, 11, 10}, "replicated add");
}

TEST(ModelErrors, ShapeAndLossMismatchesNameTheLayer) {
  const Runtime& grid = test::world_runtime();
  auto refused = [&](const std::string& json, Shape4 input, const std::string& part) {
    try {
      Model<double> m(parse_model(json), grid, input);
      ADD_FAILURE() << "accepted " << json;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  // Concat of 17x15 with its stride-2 conv (9x8).
  refused(R"({"input_channels": 2, "layers": [
    {"name": "c1", "type": "conv2d", "out_channels": 3, "kernel": 3, "stride": 2, "padding": 1},
    {"name": "k", "type": "concat", "inputs": ["c1", "input"]}]})",
          {2, 2, 17, 15}, "layer 'k' (concat)");
  // Linear on an image.
  refused(R"({"input_channels": 2, "layers": [
    {"name": "fc", "type": "linear", "out_features": 3}], "loss": "cross_entropy"})",
          {2, 2, 17, 15}, "layer 'fc' (linear)");
  // Pixel loss after global pooling, and the other way round.
  refused(R"({"input_channels": 2, "layers": [{"name": "g", "type": "global_avgpool"}]})",
          {2, 2, 17, 15}, "cross_entropy");
  refused(R"({"input_channels": 2, "layers": [
    {"name": "c", "type": "conv2d", "out_channels": 2, "kernel": 1}], "loss": "cross_entropy"})",
          {2, 2, 17, 15}, "pixel_cross_entropy");
  // A halo layer after global pooling.
  refused(R"({"input_channels": 2, "layers": [{"name": "g", "type": "global_avgpool"},
    {"name": "c", "type": "conv2d", "out_channels": 2, "kernel": 1}]})",
          {2, 2, 17, 15}, "layer 'c' (conv2d)");
}

}  // namespace
}  // namespace tessera
