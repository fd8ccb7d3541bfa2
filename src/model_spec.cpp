#include "tessera/model_spec.hpp"

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tessera/error.hpp"

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

const std::map<std::string, const char*>& builtins() {
  static const std::map<std::string, const char*> models = {{"convstack-small", kConvstackSmall}};
  return models;
}

struct Context {
  std::string where;  // "model.json: layer 'c1' (conv2d)"
  [[noreturn]] void fail(const std::string& what) const { throw Error(where + ": " + what); }
};

std::int64_t positive_int(const Context& ctx, const json& v, const std::string& field,
                          std::int64_t min_value) {
  if (!v.is_number_integer() || v.get<std::int64_t>() < min_value)
    ctx.fail("field '" + field + "' must be an integer >= " + std::to_string(min_value) + ", got " +
             v.dump());
  return v.get<std::int64_t>();
}

// An int or [h, w].
std::array<std::int64_t, 2> pair(const Context& ctx, const json& v, const std::string& field,
                                 std::int64_t min_value) {
  if (v.is_array()) {
    if (v.size() != 2)
      ctx.fail("field '" + field + "' must be an integer or [h, w], got " + v.dump());
    return {positive_int(ctx, v[0], field, min_value), positive_int(ctx, v[1], field, min_value)};
  }
  const std::int64_t x = positive_int(ctx, v, field, min_value);
  return {x, x};
}

void check_fields(const Context& ctx, const json& layer, const std::set<std::string>& allowed) {
  for (const auto& [key, value] : layer.items()) {
    if (key == "inputs")
      ctx.fail(
          "field 'inputs' (skip connections) is not available yet: layers take the previous "
          "layer's output");
    if (!allowed.count(key)) {
      std::string list;
      for (const auto& a : allowed)
        list += (list.empty() ? "" : ", ") + a;
      ctx.fail("unknown field '" + key + "' (allowed: " + list + ")");
    }
  }
}

Conv2dSpec parse_conv2d(const Context& ctx, const json& j) {
  check_fields(ctx, j,
               {"name", "type", "out_channels", "kernel", "stride", "padding", "dilation", "bias"});
  Conv2dSpec s;
  if (!j.contains("out_channels")) ctx.fail("missing field 'out_channels'");
  if (!j.contains("kernel")) ctx.fail("missing field 'kernel'");
  s.out_channels = positive_int(ctx, j["out_channels"], "out_channels", 1);
  s.kernel = pair(ctx, j["kernel"], "kernel", 1);
  if (j.contains("stride")) s.stride = pair(ctx, j["stride"], "stride", 1);
  if (j.contains("dilation")) s.dilation = pair(ctx, j["dilation"], "dilation", 1);
  if (j.contains("padding")) {
    const json& p = j["padding"];
    if (p.is_string()) {
      if (p.get<std::string>() == "valid") {
        // zero padding: the defaults
      } else if (p.get<std::string>() == "same") {
        if (s.stride != std::array<std::int64_t, 2>{1, 1})
          ctx.fail("padding 'same' needs stride 1 (as in PyTorch)");
        for (int a = 0; a < 2; ++a) {
          // PyTorch: total = dilation * (kernel - 1), the smaller half first.
          const std::int64_t total = s.dilation[a] * (s.kernel[a] - 1);
          s.pad_begin[a] = total / 2;
          s.pad_end[a] = total - total / 2;
        }
      } else {
        ctx.fail("field 'padding' must be an integer, [h, w], \"same\" or \"valid\", got " +
                 p.dump());
      }
    } else {
      s.pad_begin = s.pad_end = pair(ctx, p, "padding", 0);
    }
  }
  if (j.contains("bias")) {
    if (!j["bias"].is_boolean()) ctx.fail("field 'bias' must be true or false");
    s.bias = j["bias"].get<bool>();
  }
  return s;
}

}  // namespace

ModelSpec parse_model(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw Error(source + ": not valid JSON: " + e.what());
  }
  const Context top{source};
  if (!root.is_object()) top.fail("the model must be a JSON object");
  for (const auto& [key, value] : root.items())
    if (key != "name" && key != "input_channels" && key != "layers" && key != "loss")
      top.fail("unknown field '" + key + "' (allowed: name, input_channels, layers, loss)");
  ModelSpec spec;
  if (root.contains("name") && !root["name"].is_string())
    top.fail("field 'name' must be a string, got " + root["name"].dump());
  spec.name = root.value("name", std::string("model"));
  if (!root.contains("input_channels")) top.fail("missing field 'input_channels'");
  spec.input_channels = positive_int(top, root["input_channels"], "input_channels", 1);
  if (!root.contains("layers") || !root["layers"].is_array() || root["layers"].empty())
    top.fail("field 'layers' must be a non-empty list");
  std::set<std::string> names = {"input"};
  int index = 0;
  for (const json& layer : root["layers"]) {
    ++index;
    Context ctx{source + ": layer " + std::to_string(index)};
    if (!layer.is_object()) ctx.fail("must be a JSON object");
    if (!layer.contains("type") || !layer["type"].is_string()) ctx.fail("missing field 'type'");
    LayerSpec l;
    l.type = layer["type"].get<std::string>();
    l.name = l.type + std::to_string(index);
    if (layer.contains("name")) {
      if (!layer["name"].is_string() || layer["name"].get<std::string>().empty())
        ctx.fail("field 'name' must be a non-empty string");
      l.name = layer["name"].get<std::string>();
    }
    ctx.where = source + ": layer '" + l.name + "' (" + l.type + ")";
    if (!names.insert(l.name).second) ctx.fail("the name is used twice");
    if (l.type == "conv2d") {
      l.config = parse_conv2d(ctx, layer);
    } else if (l.type == "relu") {
      check_fields(ctx, layer, {"name", "type"});
      l.config = ReluSpec{};
    } else {
      ctx.fail("unknown layer type '" + l.type + "' (available: conv2d, relu)");
    }
    spec.layers.push_back(std::move(l));
  }
  if (root.contains("loss") && !root["loss"].is_string())
    top.fail("field 'loss' must be a string, got " + root["loss"].dump());
  const std::string loss = root.value("loss", std::string("pixel_cross_entropy"));
  if (loss != "pixel_cross_entropy")
    top.fail("unknown loss '" + loss + "' (available: pixel_cross_entropy)");
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
