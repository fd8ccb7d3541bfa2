// JSON fields of maxpool2d, avgpool2d and upsample_nearest: PyTorch's defaults, and errors that
// name the layer and the field.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "../common/test_helpers.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/layers/pool2d.hpp"
#include "tessera/layers/upsample.hpp"

namespace tessera {
namespace {

using test::expect_mentions;

std::string model_with(const std::string& layer) {
  return R"({"name": "t", "input_channels": 3, "layers": [)" + layer + "]}";
}

LayerSpec only_layer(const std::string& layer) {
  const ModelSpec m = parse_model(model_with(layer));
  EXPECT_EQ(m.layers.size(), 1u);
  return m.layers.at(0);
}

std::string parse_error(const std::string& layer) {
  try {
    parse_model(model_with(layer), "net.json");
    ADD_FAILURE() << "accepted " << layer;
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a tessera::Error (" << e.what() << ") for " << layer;
  }
  return "";
}

TEST(PoolSpec, StrideDefaultsToTheKernelAndPaddingToZero) {
  for (const char* type : {"maxpool2d", "avgpool2d"}) {
    const Pool2dSpec s =
        parse_pool2d(only_layer(std::string(R"({"type": ")") + type + R"(", "kernel": [3, 2]})"));
    EXPECT_EQ(s.kind, std::string(type) == "maxpool2d" ? PoolKind::max : PoolKind::avg);
    EXPECT_EQ(s.kernel, (Pair{3, 2}));
    EXPECT_EQ(s.stride, (Pair{3, 2}));
    EXPECT_EQ(s.padding, (Pair{0, 0}));
  }
  const Pool2dSpec s = parse_pool2d(
      only_layer(R"({"type": "maxpool2d", "kernel": 3, "stride": [1, 2], "padding": [1, 0]})"));
  EXPECT_EQ(s.kernel, (Pair{3, 3}));
  EXPECT_EQ(s.stride, (Pair{1, 2}));
  EXPECT_EQ(s.padding, (Pair{1, 0}));
  // The window axis is conv's with dilation 1 and the padding on both sides.
  const WindowAxis a = s.axis(1);
  EXPECT_EQ(a.kernel, 3);
  EXPECT_EQ(a.stride, 2);
  EXPECT_EQ(a.pad_begin, 0);
  EXPECT_EQ(a.pad_end, 0);
  EXPECT_EQ(a.dilation, 1);
  EXPECT_EQ(s.axis(0).pad_begin, 1);
  EXPECT_EQ(s.axis(0).pad_end, 1);
}

TEST(PoolSpec, PaddingUpToHalfTheKernelIsAccepted) {
  // PyTorch: padding <= kernel / 2 (integer division).
  EXPECT_NO_THROW(parse_model(model_with(R"({"type": "maxpool2d", "kernel": 2, "padding": 1})")));
  EXPECT_NO_THROW(parse_model(model_with(R"({"type": "avgpool2d", "kernel": 5, "padding": 2})")));
  EXPECT_NO_THROW(
      parse_model(model_with(R"({"type": "maxpool2d", "kernel": [4, 1], "padding": [2, 0]})")));
}

TEST(PoolSpec, UpsampleScale) {
  EXPECT_EQ(parse_upsample(only_layer(R"({"type": "upsample_nearest", "scale": 3})")).scale, 3);
  // The window of output rows [qb, qe) is [floor(qb / s), floor((qe - 1) / s) + 1).
  const WindowMap m = upsample_window(3);
  EXPECT_EQ(m.rows({0, 1}), (Range{0, 1}));
  EXPECT_EQ(m.rows({2, 4}), (Range{0, 2}));
  EXPECT_EQ(m.cols({5, 9}), (Range{1, 3}));
  EXPECT_EQ(m.cols({6, 9}), (Range{2, 3}));
  EXPECT_TRUE(m.rows({4, 4}).empty());
}

TEST(PoolSpec, ErrorsNameTheLayerAndTheField) {
  struct Bad {
    const char* layer;
    std::initializer_list<std::string> parts;
  };
  const Bad cases[] = {
      {R"({"name": "p1", "type": "maxpool2d", "kernel": 2, "padding": 2})",
       {"'p1'", "'padding'", "half the kernel"}},
      {R"({"name": "p1", "type": "avgpool2d", "kernel": 3, "padding": 2})",
       {"'p1'", "avgpool2d", "'padding'"}},
      {R"({"name": "p1", "type": "maxpool2d", "kernel": [3, 1], "padding": [1, 1]})",
       {"'p1'", "'padding'", "[1, 1]", "[3, 1]"}},
      {R"({"name": "p1", "type": "maxpool2d", "kernel": 1, "padding": 1})", {"'p1'", "'padding'"}},
      {R"({"name": "p1", "type": "maxpool2d", "kernel": 0})", {"'p1'", "'kernel'"}},
      {R"({"name": "p1", "type": "avgpool2d", "kernel": [2, 0]})", {"'p1'", "'kernel'"}},
      {R"({"name": "p1", "type": "maxpool2d", "kernel": 2, "stride": 0})", {"'p1'", "'stride'"}},
      {R"({"name": "p1", "type": "maxpool2d", "kernel": 2, "padding": -1})", {"'p1'", "'padding'"}},
      {R"({"name": "p1", "type": "maxpool2d"})", {"'p1'", "missing", "'kernel'"}},
      {R"({"name": "p1", "type": "maxpool2d", "kernel": 2, "dilation": 2})",
       {"'p1'", "unknown field", "'dilation'"}},
      {R"({"name": "p1", "type": "avgpool2d", "kernel": 2, "ceil_mode": true})",
       {"'p1'", "unknown field", "'ceil_mode'"}},
      {R"({"name": "u1", "type": "upsample_nearest", "scale": 0})", {"'u1'", "'scale'"}},
      {R"({"name": "u1", "type": "upsample_nearest", "scale": 1.5})", {"'u1'", "'scale'"}},
      {R"({"name": "u1", "type": "upsample_nearest"})", {"'u1'", "missing", "'scale'"}},
      {R"({"name": "u1", "type": "upsample_nearest", "scale": 2, "mode": "bilinear"})",
       {"'u1'", "unknown field", "'mode'"}},
  };
  for (const Bad& bad : cases) {
    const std::string msg = parse_error(bad.layer);
    expect_mentions(msg, bad.parts);
    expect_mentions(msg, {"net.json"});
  }
}

}  // namespace
}  // namespace tessera
