// A model as described by its JSON file (DESIGN.md section 5), validated, dtype-free. Local.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace tessera {

struct Conv2dSpec {
  std::int64_t out_channels = 0;
  std::array<std::int64_t, 2> kernel{1, 1};  // [h, w]
  std::array<std::int64_t, 2> stride{1, 1};
  std::array<std::int64_t, 2> dilation{1, 1};
  std::array<std::int64_t, 2> pad_begin{0, 0};  // top, left
  std::array<std::int64_t, 2> pad_end{0, 0};    // bottom, right ("same" may be asymmetric)
  bool bias = true;
};

struct ReluSpec {};

using LayerConfig = std::variant<Conv2dSpec, ReluSpec>;

struct LayerSpec {
  std::string name;
  std::string type;  // the JSON "type"
  LayerConfig config;
};

enum class LossKind { pixel_cross_entropy };

struct ModelSpec {
  std::string name;
  std::int64_t input_channels = 0;
  std::vector<LayerSpec> layers;
  LossKind loss = LossKind::pixel_cross_entropy;
  std::string json;  // canonical text, for hashing and checkpoints
};

// Parses and validates a model. Errors name the layer and the field. Local.
ModelSpec parse_model(const std::string& json_text, const std::string& source = "model");

// `name_or_path`: a built-in model name (see builtin_model_names) or a JSON file. Local.
ModelSpec load_model(const std::string& name_or_path);

std::vector<std::string> builtin_model_names();

}  // namespace tessera
