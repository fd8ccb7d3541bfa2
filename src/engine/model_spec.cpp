#include "tessera/engine/model_spec.hpp"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "tessera/error.hpp"
#include "tessera/layers/registry.hpp"

namespace tessera {
namespace {

using nlohmann::json;

// A stack of convolutions that exercises every window feature: odd/even kernels, stride,
// dilation, asymmetric "same" padding. Segmentation with two classes.
constexpr const char* kConvstackSmall = R"({
  "name": "convstack-small", "input_channels": 3,
  "layers": [
    {"name": "c1", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv2d", "out_channels": 8, "kernel": 4, "stride": 2, "padding": 1},
    {"name": "r2", "type": "relu"},
    {"name": "c3", "type": "conv2d", "out_channels": 8, "kernel": 3, "dilation": 2, "padding": "same"},
    {"name": "r3", "type": "relu"},
    {"name": "c4", "type": "conv2d", "out_channels": 8, "kernel": [5, 2], "padding": "same"},
    {"name": "r4", "type": "relu"},
    {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 1}],
  "loss": "pixel_cross_entropy" })";

// Three levels (full, 1/2 and 1/4 resolution) with batch norm, max pooling down, a transposed
// convolution and a nearest upsampling up, and concat skip connections. Image sides must be
// multiples of 4 so that the skips line up.
constexpr const char* kUnetSmall = R"({
  "name": "unet-small", "input_channels": 3,
  "layers": [
    {"name": "e1a", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1, "bias": false},
    {"name": "e1a_bn", "type": "batchnorm2d"},
    {"name": "e1a_relu", "type": "relu"},
    {"name": "e1b", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1, "bias": false},
    {"name": "e1b_bn", "type": "batchnorm2d"},
    {"name": "e1", "type": "relu"},
    {"name": "pool1", "type": "maxpool2d", "kernel": 2},
    {"name": "e2a", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1, "bias": false},
    {"name": "e2a_bn", "type": "batchnorm2d"},
    {"name": "e2a_relu", "type": "relu"},
    {"name": "e2b", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1, "bias": false},
    {"name": "e2b_bn", "type": "batchnorm2d"},
    {"name": "e2", "type": "relu"},
    {"name": "pool2", "type": "maxpool2d", "kernel": 2},
    {"name": "m1", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": 1, "bias": false},
    {"name": "m1_bn", "type": "batchnorm2d"},
    {"name": "m1_relu", "type": "relu"},
    {"name": "m2", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": 1, "bias": false},
    {"name": "m2_bn", "type": "batchnorm2d"},
    {"name": "m", "type": "relu"},
    {"name": "up2", "type": "conv_transpose2d", "out_channels": 16, "kernel": 2, "stride": 2},
    {"name": "cat2", "type": "concat", "inputs": ["up2", "e2"]},
    {"name": "d2", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1, "bias": false},
    {"name": "d2_bn", "type": "batchnorm2d"},
    {"name": "d2_relu", "type": "relu"},
    {"name": "up1", "type": "upsample_nearest", "scale": 2},
    {"name": "cat1", "type": "concat", "inputs": ["up1", "e1"]},
    {"name": "d1", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1, "bias": false},
    {"name": "d1_bn", "type": "batchnorm2d"},
    {"name": "d1_relu", "type": "relu"},
    {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 1}],
  "loss": "pixel_cross_entropy" })";

// Strided convolutions with batch norm, global average pooling and a linear head over ten
// classes.
constexpr const char* kConvnetSmall = R"({
  "name": "convnet-small", "input_channels": 3,
  "layers": [
    {"name": "c1", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1, "bias": false},
    {"name": "bn1", "type": "batchnorm2d"},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv2d", "out_channels": 32, "kernel": 3, "stride": 2, "padding": 1, "bias": false},
    {"name": "bn2", "type": "batchnorm2d"},
    {"name": "r2", "type": "relu"},
    {"name": "c3", "type": "conv2d", "out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "bias": false},
    {"name": "bn3", "type": "batchnorm2d"},
    {"name": "r3", "type": "relu"},
    {"name": "gap", "type": "global_avgpool"},
    {"name": "fc", "type": "linear", "out_features": 10}],
  "loss": "cross_entropy" })";

// The speed benchmark of `tessera bench` and scripts/bench/: four 3x3 convolutions to 32
// channels with ReLU and a 1x1 head, the model PyTorch is timed on beside it.
constexpr const char* kConvBench = R"({
  "name": "conv-bench", "input_channels": 3,
  "layers": [
    {"name": "c1", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": 1},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": 1},
    {"name": "r2", "type": "relu"},
    {"name": "c3", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": 1},
    {"name": "r3", "type": "relu"},
    {"name": "c4", "type": "conv2d", "out_channels": 32, "kernel": 3, "padding": 1},
    {"name": "r4", "type": "relu"},
    {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 1}],
  "loss": "pixel_cross_entropy" })";

const std::map<std::string, const char*>& builtins() {
  static const std::map<std::string, const char*> models = {{"convstack-small", kConvstackSmall},
                                                            {"unet-small", kUnetSmall},
                                                            {"convnet-small", kConvnetSmall},
                                                            {"conv-bench", kConvBench}};
  return models;
}

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw Error(where + ": " + what);
}

std::int64_t positive_int(const std::string& where, const json& v, const std::string& field) {
  if (!v.is_number_integer() || v.get<std::int64_t>() < 1)
    fail(where, "field '" + field + "' must be an integer >= 1, got " + v.dump());
  return v.get<std::int64_t>();
}

std::string string_field(const std::string& where, const json& root, const std::string& field,
                         const std::string& fallback) {
  if (!root.contains(field)) return fallback;
  if (!root[field].is_string())
    fail(where, "field '" + field + "' must be a string, got " + root[field].dump());
  return root[field].get<std::string>();
}

// The layer's inputs: "inputs" if given (one name or a list), else the previous layer.
std::vector<std::string> parse_inputs(const std::string& where, const json& layer,
                                      const std::string& previous,
                                      const std::set<std::string>& defined) {
  if (!layer.contains("inputs")) return {previous};
  const json& v = layer["inputs"];
  std::vector<std::string> names;
  if (v.is_string()) {
    names.push_back(v.get<std::string>());
  } else if (v.is_array()) {
    for (const json& n : v) {
      if (!n.is_string()) fail(where, "field 'inputs' must list layer names, got " + v.dump());
      names.push_back(n.get<std::string>());
    }
  } else {
    fail(where, "field 'inputs' must be a layer name or a list of them, got " + v.dump());
  }
  for (const std::string& n : names)
    if (!defined.count(n))
      fail(where, "field 'inputs' names '" + n +
                      "', which is not an earlier layer (layers may only read 'input' and layers "
                      "above them, so the graph has no cycles)");
  return names;
}

}  // namespace

const char* to_string(LossKind k) {
  return k == LossKind::cross_entropy ? "cross_entropy" : "pixel_cross_entropy";
}

ModelSpec parse_model(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e400
    throw Error(source + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) fail(source, "the model must be a JSON object");
  for (const auto& [key, value] : root.items())
    if (key != "name" && key != "input_channels" && key != "layers" && key != "loss")
      fail(source, "unknown field '" + key + "' (allowed: name, input_channels, layers, loss)");
  ModelSpec spec;
  spec.name = string_field(source, root, "name", "model");
  if (!root.contains("input_channels")) fail(source, "missing field 'input_channels'");
  spec.input_channels = positive_int(source, root["input_channels"], "input_channels");
  if (!root.contains("layers") || !root["layers"].is_array() || root["layers"].empty())
    fail(source, "field 'layers' must be a non-empty list");
  std::set<std::string> defined = {"input"};
  std::string previous = "input";
  int index = 0;
  for (const json& layer : root["layers"]) {
    ++index;
    LayerSpec l;
    l.where = source + ": layer " + std::to_string(index);
    if (!layer.is_object()) fail(l.where, "must be a JSON object");
    if (!layer.contains("type") || !layer["type"].is_string())
      fail(l.where, "missing field 'type'");
    l.type = layer["type"].get<std::string>();
    l.name = l.type + std::to_string(index);
    if (layer.contains("name")) {
      if (!layer["name"].is_string() || layer["name"].get<std::string>().empty())
        fail(l.where, "field 'name' must be a non-empty string");
      l.name = layer["name"].get<std::string>();
    }
    l.where = source + ": layer '" + l.name + "' (" + l.type + ")";
    if (defined.count(l.name))
      fail(l.where,
           l.name == "input" ? "the name 'input' is the model's input" : "the name is used twice");
    const LayerKind* kind = find_layer_kind(l.type);
    if (kind == nullptr)
      fail(l.where, "unknown layer type '" + l.type + "' (available: " + layer_type_list() + ")");
    l.inputs = parse_inputs(l.where, layer, previous, defined);
    const int n = static_cast<int>(l.inputs.size());
    if (n < kind->min_inputs || n > kind->max_inputs)
      fail(l.where, "takes " +
                        (kind->min_inputs == kind->max_inputs
                             ? std::to_string(kind->min_inputs)
                             : std::to_string(kind->min_inputs) + " or more") +
                        " input(s), 'inputs' names " + std::to_string(n));
    l.fields = layer;
    kind->validate(l);
    defined.insert(l.name);
    previous = l.name;
    spec.layers.push_back(std::move(l));
  }
  const std::string loss = string_field(source, root, "loss", "pixel_cross_entropy");
  if (loss == "pixel_cross_entropy") {
    spec.loss = LossKind::pixel_cross_entropy;
  } else if (loss == "cross_entropy") {
    spec.loss = LossKind::cross_entropy;
  } else {
    fail(source, "unknown loss '" + loss + "' (available: pixel_cross_entropy, cross_entropy)");
  }
  spec.json = root.dump();
  return spec;
}

ModelSpec load_model(const std::string& name_or_path) {
  if (auto it = builtins().find(name_or_path); it != builtins().end())
    return parse_model(it->second, name_or_path);
  std::string names;
  for (const auto& n : builtin_model_names())
    names += (names.empty() ? "" : ", ") + n;
  TESSERA_CHECK(
      std::filesystem::exists(name_or_path),
      "model '" + name_or_path + "' is neither a file nor a built-in model (" + names + ")");
  TESSERA_CHECK(!std::filesystem::is_directory(name_or_path),
                "model file '" + name_or_path + "' is a directory");
  std::ifstream in(name_or_path);
  TESSERA_CHECK(in.good(), "cannot read model file '" + name_or_path + "'");
  std::stringstream text;
  text << in.rdbuf();
  return parse_model(text.str(), name_or_path);
}

std::vector<std::string> builtin_model_names() {
  std::vector<std::string> names;
  for (const auto& [name, text] : builtins())
    names.push_back(name);
  return names;
}

}  // namespace tessera
