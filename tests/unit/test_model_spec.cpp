#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <variant>
#include <vector>

#include <unistd.h>

#include "../common/test_helpers.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/layers/conv2d.hpp"

namespace tessera {
namespace {

using test::expect_mentions;

// A model with the given layers (JSON text of the list's items) and the defaults otherwise.
std::string model_with(const std::string& layers, const std::string& extra = "") {
  return R"({"name": "t", "input_channels": 3, "layers": [)" + layers + "]" + extra + "}";
}

// The one conv2d layer of `model_with(layer)`.
Conv2dSpec conv_of(const std::string& layer) {
  const ModelSpec m = parse_model(model_with(layer));
  EXPECT_EQ(m.layers.size(), 1u);
  EXPECT_EQ(m.layers.at(0).type, "conv2d");
  return parse_conv2d(m.layers.at(0));
}

// The message of the tessera::Error that parse_model(json) throws ("" and a failure if none).
std::string parse_error(const std::string& json, const std::string& source = "model") {
  try {
    parse_model(json, source);
    ADD_FAILURE() << "accepted " << json;
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a tessera::Error (" << e.what() << ") for " << json;
  }
  return "";
}

TEST(ModelSpec, BuiltinConvstackSmallLoads) {
  const std::vector<std::string> names = builtin_model_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "convstack-small"), names.end());

  const ModelSpec m = load_model("convstack-small");
  EXPECT_EQ(m.name, "convstack-small");
  EXPECT_EQ(m.input_channels, 3);
  EXPECT_EQ(m.loss, LossKind::pixel_cross_entropy);
  EXPECT_FALSE(m.json.empty());
  const std::vector<std::string> expect_names = {"c1", "r1", "c2", "r2",  "c3",
                                                 "r3", "c4", "r4", "head"};
  ASSERT_EQ(m.layers.size(), expect_names.size());
  for (std::size_t i = 0; i < m.layers.size(); ++i) {
    EXPECT_EQ(m.layers[i].name, expect_names[i]);
    const bool conv = expect_names[i][0] != 'r';
    EXPECT_EQ(m.layers[i].type, conv ? "conv2d" : "relu");
    EXPECT_EQ(m.layers[i].inputs, std::vector<std::string>{i == 0 ? "input" : expect_names[i - 1]});
  }
  const Conv2dSpec c2 = parse_conv2d(m.layers[2]);
  EXPECT_EQ(c2.out_channels, 8);
  EXPECT_EQ(c2.kernel, (Pair{4, 4}));
  EXPECT_EQ(c2.stride, (Pair{2, 2}));
  EXPECT_EQ(c2.pad_begin, (Pair{1, 1}));
  EXPECT_EQ(c2.pad_end, (Pair{1, 1}));
  const Conv2dSpec c3 = parse_conv2d(m.layers[4]);  // kernel 3, dilation 2, "same"
  EXPECT_EQ(c3.dilation, (Pair{2, 2}));
  EXPECT_EQ(c3.pad_begin, (Pair{2, 2}));
  EXPECT_EQ(c3.pad_end, (Pair{2, 2}));
  const Conv2dSpec c4 = parse_conv2d(m.layers[6]);  // kernel [5, 2], "same"
  EXPECT_EQ(c4.kernel, (Pair{5, 2}));
  EXPECT_EQ(c4.pad_begin, (Pair{2, 0}));
  EXPECT_EQ(c4.pad_end, (Pair{2, 1}));
  const Conv2dSpec head = parse_conv2d(m.layers[8]);
  EXPECT_EQ(head.out_channels, 2);
  EXPECT_EQ(head.kernel, (Pair{1, 1}));
  EXPECT_TRUE(head.bias);

  // The canonical text parses to the same model.
  const ModelSpec again = parse_model(m.json);
  EXPECT_EQ(again.json, m.json);
  EXPECT_EQ(again.layers.size(), m.layers.size());
}

TEST(ModelSpec, WindowFieldsTakeAnIntOrAPair) {
  const Conv2dSpec ints = conv_of(
      R"({"name": "c", "type": "conv2d", "out_channels": 5, "kernel": 3, "stride": 2,
          "dilation": 3, "padding": 1})");
  EXPECT_EQ(ints.out_channels, 5);
  EXPECT_EQ(ints.kernel, (Pair{3, 3}));
  EXPECT_EQ(ints.stride, (Pair{2, 2}));
  EXPECT_EQ(ints.dilation, (Pair{3, 3}));
  EXPECT_EQ(ints.pad_begin, (Pair{1, 1}));
  EXPECT_EQ(ints.pad_end, (Pair{1, 1}));

  const Conv2dSpec pairs = conv_of(
      R"({"name": "c", "type": "conv2d", "out_channels": 5, "kernel": [3, 5], "stride": [2, 1],
          "dilation": [1, 2], "padding": [0, 2]})");
  EXPECT_EQ(pairs.kernel, (Pair{3, 5}));
  EXPECT_EQ(pairs.stride, (Pair{2, 1}));
  EXPECT_EQ(pairs.dilation, (Pair{1, 2}));
  EXPECT_EQ(pairs.pad_begin, (Pair{0, 2}));
  EXPECT_EQ(pairs.pad_end, (Pair{0, 2}));

  // Defaults: stride 1, dilation 1, no padding, a bias.
  const Conv2dSpec defaults = conv_of(R"({"type": "conv2d", "out_channels": 1, "kernel": 2})");
  EXPECT_EQ(defaults.stride, (Pair{1, 1}));
  EXPECT_EQ(defaults.dilation, (Pair{1, 1}));
  EXPECT_EQ(defaults.pad_begin, (Pair{0, 0}));
  EXPECT_EQ(defaults.pad_end, (Pair{0, 0}));
  EXPECT_TRUE(defaults.bias);

  const Conv2dSpec valid =
      conv_of(R"({"type": "conv2d", "out_channels": 1, "kernel": 3, "padding": "valid"})");
  EXPECT_EQ(valid.pad_begin, (Pair{0, 0}));
  EXPECT_EQ(valid.pad_end, (Pair{0, 0}));
  EXPECT_FALSE(
      conv_of(R"({"type": "conv2d", "out_channels": 1, "kernel": 3, "bias": false})").bias);
}

TEST(ModelSpec, SamePaddingSplitsLikePyTorch) {
  // total = d*(k-1), begin = total/2, end = total - begin.
  const Conv2dSpec k4 =
      conv_of(R"({"type": "conv2d", "out_channels": 1, "kernel": 4, "padding": "same"})");
  EXPECT_EQ(k4.pad_begin, (Pair{1, 1}));
  EXPECT_EQ(k4.pad_end, (Pair{2, 2}));

  for (int k = 1; k <= 7; ++k)
    for (int d = 1; d <= 3; ++d) {
      const Conv2dSpec c = conv_of(
          R"({"type": "conv2d", "out_channels": 1, "padding": "same", "stride": 1, "kernel": [)" +
          std::to_string(k) + ", " + std::to_string(k + 1) + R"(], "dilation": [)" +
          std::to_string(d) + ", 1]}");
      const std::int64_t th = d * (k - 1), tw = k;  // the width: kernel k + 1, dilation 1
      EXPECT_EQ(c.pad_begin, (Pair{th / 2, tw / 2})) << "k " << k << " d " << d;
      EXPECT_EQ(c.pad_end, (Pair{th - th / 2, tw - tw / 2})) << "k " << k << " d " << d;
    }
}

TEST(ModelSpec, SamePaddingNeedsStrideOne) {
  for (const char* stride : {"2", "[1, 2]", "[3, 1]"}) {
    // The stride written after the padding is still seen.
    const std::string msg = parse_error(model_with(
        R"({"name": "down", "type": "conv2d", "out_channels": 1, "kernel": 3, "padding": "same",
            "stride": )" +
        std::string(stride) + "}"));
    expect_mentions(msg, {"'down'", "same", "stride"});
  }
}

TEST(ModelSpec, ErrorsNameTheLayerAndTheField) {
  struct Bad {
    const char* layer;
    std::initializer_list<std::string> parts;
  };
  const Bad cases[] = {
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "kernal": 3})",
       {"'c1'", "unknown field", "'kernal'"}},
      {R"({"name": "p1", "type": "maxpool", "kernel": 2})",
       {"'p1'", "unknown layer type", "maxpool"}},
      {R"({"name": "c1", "type": "conv2d", "kernel": 3})", {"'c1'", "missing", "'out_channels'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4})", {"'c1'", "missing", "'kernel'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 0})", {"'c1'", "'kernel'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": [3, 0]})",
       {"'c1'", "'kernel'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 0, "kernel": 3})",
       {"'c1'", "'out_channels'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "stride": 0})",
       {"'c1'", "'stride'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "dilation": 0})",
       {"'c1'", "'dilation'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": -1})",
       {"'c1'", "'padding'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": [1, -2]})",
       {"'c1'", "'padding'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": "full"})",
       {"'c1'", "'padding'", "full"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": [3, 3, 3]})",
       {"'c1'", "'kernel'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 2.5})",
       {"'c1'", "'kernel'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": "3"})",
       {"'c1'", "'kernel'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "bias": 1})",
       {"'c1'", "'bias'"}},
      {R"({"name": "r1", "type": "relu", "kernel": 3})", {"'r1'", "unknown field", "'kernel'"}},
      {R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "inputs": ["x"]})",
       {"'c1'", "'inputs'"}},
      {R"({"name": "r1", "type": "relu", "inputs": ["c1"]})", {"'r1'", "'inputs'"}},
      {R"({"name": "", "type": "relu"})", {"'name'"}},
      {R"({"name": "r1"})", {"'type'"}},
  };
  for (const Bad& bad : cases) {
    const std::string msg = parse_error(model_with(bad.layer), "net.json");
    expect_mentions(msg, bad.parts);
    expect_mentions(msg, {"net.json"});
  }
}

TEST(ModelSpec, ErrorsCountTheLayerWhenItHasNoName) {
  // The second layer, unnamed: the message still says which one.
  const std::string msg = parse_error(
      model_with(R"({"type": "relu"}, {"type": "conv2d", "out_channels": 4, "kernel": -3})"));
  expect_mentions(msg, {"2", "conv2d", "'kernel'"});
}

TEST(ModelSpec, DuplicateLayerNamesAreRejected) {
  const std::string msg = parse_error(model_with(
      R"({"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3},
         {"name": "a", "type": "relu"},
         {"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3})"));
  expect_mentions(msg, {"'c1'", "twice"});
  // "input" names the model's input and is taken.
  expect_mentions(parse_error(model_with(R"({"name": "input", "type": "relu"})")), {"'input'"});
}

TEST(ModelSpec, TopLevelErrors) {
  expect_mentions(parse_error(R"({"name": "t", "input_channels": 3, "layers": [)", "bad.json"),
                  {"bad.json", "JSON"});
  expect_mentions(parse_error("", "empty.json"), {"empty.json", "JSON"});
  expect_mentions(parse_error(model_with(R"({"type": "relu"})", R"(, "optimizer": "sgd")")),
                  {"unknown field", "'optimizer'"});
  expect_mentions(parse_error(model_with(R"({"type": "relu"})", R"(, "loss": "mse")")),
                  {"loss", "mse"});
  expect_mentions(parse_error(R"({"name": "t", "layers": [{"type": "relu"}]})"),
                  {"'input_channels'"});
  expect_mentions(
      parse_error(R"({"name": "t", "input_channels": 0, "layers": [{"type": "relu"}]})"),
      {"'input_channels'"});
  expect_mentions(parse_error(R"({"name": "t", "input_channels": 3, "layers": []})"), {"'layers'"});
  expect_mentions(parse_error(R"({"name": "t", "input_channels": 3})"), {"'layers'"});
  expect_mentions(parse_error(R"([1, 2])"), {"object"});
  // Fields of the wrong JSON type are tessera::Errors too, not JSON library exceptions.
  expect_mentions(parse_error(R"({"name": 5, "input_channels": 3, "layers": [{"type": "relu"}]})"),
                  {"'name'"});
  expect_mentions(parse_error(model_with(R"({"type": "relu"})", R"(, "loss": 1)")), {"'loss'"});
  // The loss may be given explicitly.
  EXPECT_EQ(
      parse_model(model_with(R"({"type": "relu"})", R"(, "loss": "pixel_cross_entropy")")).loss,
      LossKind::pixel_cross_entropy);
}

TEST(ModelSpec, LoadModelReadsFilesAndNamesMissingOnes) {
  const std::string missing = "/nonexistent/tessera-no-such-model.json";
  try {
    load_model(missing);
    ADD_FAILURE() << "loaded " << missing;
  } catch (const Error& e) {
    expect_mentions(e.what(), {missing, "convstack-small"});
  }

  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("tessera-test-model-spec-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string good = (dir / "good.json").string(), bad = (dir / "bad.json").string();
  std::ofstream(good) << model_with(R"({"name": "c", "type": "conv2d", "out_channels": 2,
                                       "kernel": 3, "padding": "same"})");
  std::ofstream(bad) << model_with(R"({"name": "oops", "type": "conv2d", "kernel": 3})");
  const ModelSpec m = load_model(good);
  EXPECT_EQ(m.name, "t");
  ASSERT_EQ(m.layers.size(), 1u);
  EXPECT_EQ(parse_conv2d(m.layers[0]).pad_begin, (Pair{1, 1}));
  try {
    load_model(bad);
    ADD_FAILURE() << "loaded " << bad;
  } catch (const Error& e) {
    expect_mentions(e.what(), {bad, "'oops'", "'out_channels'"});
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera
