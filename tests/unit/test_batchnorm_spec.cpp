// batchnorm2d's fields and set-up checks: defaults as PyTorch, errors naming the layer and the
// field, and the single-value batch refused before any work.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "../common/test_helpers.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/layers/batchnorm.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

using test::expect_mentions;

std::string model_with(const std::string& layers) {
  return R"({"name": "t", "input_channels": 2, "layers": [)" + layers + "]}";
}

BatchNormSpec spec_of(const std::string& layer) {
  const ModelSpec m = parse_model(model_with(layer));
  return parse_batchnorm(m.layers.at(0));
}

TEST(BatchNormSpec, DefaultsAreTorchs) {
  const BatchNormSpec d = spec_of(R"({"name": "bn1", "type": "batchnorm2d"})");
  EXPECT_EQ(d.eps, 1e-5);
  EXPECT_EQ(d.momentum, 0.1);
  const BatchNormSpec s =
      spec_of(R"({"name": "bn1", "type": "batchnorm2d", "eps": 0.001, "momentum": 1})");
  EXPECT_EQ(s.eps, 1e-3);
  EXPECT_EQ(s.momentum, 1.0);
  EXPECT_EQ(spec_of(R"({"type": "batchnorm2d", "momentum": 0})").momentum, 0.0);
}

TEST(BatchNormSpec, ErrorsNameTheLayerAndTheField) {
  struct Bad {
    const char* layer;
    std::initializer_list<std::string> parts;
  };
  const Bad cases[] = {
      {R"({"name": "bn1", "type": "batchnorm2d", "eps": 0})", {"'bn1'", "'eps'", "> 0"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "eps": -1e-5})", {"'bn1'", "'eps'", "> 0"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "eps": "1e-5"})", {"'bn1'", "'eps'"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "momentum": 1.5})",
       {"'bn1'", "'momentum'", "1.5"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "momentum": -0.1})", {"'bn1'", "'momentum'"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "momentum": null})", {"'bn1'", "'momentum'"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "affine": false})",
       {"'bn1'", "unknown field", "'affine'"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "num_features": 2})",
       {"'bn1'", "unknown field", "'num_features'"}},
  };
  for (const Bad& bad : cases) {
    try {
      parse_model(model_with(bad.layer), "net.json");
      ADD_FAILURE() << "accepted " << bad.layer;
    } catch (const Error& e) {
      expect_mentions(e.what(), bad.parts);
      expect_mentions(e.what(), {"net.json", "batchnorm2d"});
    }
  }
}

TEST(BatchNormSpec, OneValuePerChannelIsRefusedAtSetUp) {
  const ModelSpec spec = parse_model(model_with(R"({"name": "bn1", "type": "batchnorm2d"})"));
  const Runtime& single = test::single_runtime();
  try {
    Model<double> m(spec, single, {1, 2, 1, 1});
    ADD_FAILURE() << "accepted a batch of one value per channel";
  } catch (const Error& e) {
    expect_mentions(e.what(), {"'bn1'", "batchnorm2d", "more than 1 value per channel"});
  }
  // Two values, in samples or in pixels, are enough.
  EXPECT_NO_THROW(Model<double>(spec, single, {2, 2, 1, 1}));
  EXPECT_NO_THROW(Model<double>(spec, single, {1, 2, 1, 2}));
}

TEST(BatchNormSpec, ParamsAndBuffersStartAsTorchs) {
  const ModelSpec spec = parse_model(model_with(R"({"name": "bn1", "type": "batchnorm2d"})"));
  const Runtime& single = test::single_runtime();
  Model<float> m(spec, single, {2, 2, 3, 3});
  m.init_params(5);
  auto ps = m.params();
  ASSERT_EQ(ps.size(), 2u);
  EXPECT_EQ(ps[0].key(), "bn1/weight");
  EXPECT_EQ(ps[1].key(), "bn1/bias");
  auto bs = m.buffers();
  ASSERT_EQ(bs.size(), 2u);
  EXPECT_EQ(bs[0].key(), "bn1/running_mean");
  EXPECT_EQ(bs[1].key(), "bn1/running_var");
  for (int c = 0; c < 2; ++c) {
    EXPECT_EQ(ps[0].param->value.data()[c], 1.0f);
    EXPECT_EQ(ps[1].param->value.data()[c], 0.0f);
    EXPECT_EQ(bs[0].buffer->value.data()[c], 0.0f);
    EXPECT_EQ(bs[1].buffer->value.data()[c], 1.0f);
  }
}

}  // namespace
}  // namespace tessera
