// A model as described by its JSON file (README.md "Models (JSON)"), validated, dtype-free. Local.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tessera {

struct LayerSpec {
  std::string name;
  std::string type;                 // the JSON "type"
  std::vector<std::string> inputs;  // earlier layers' names; "input" is the model's input
  nlohmann::json fields;            // the layer's JSON object, validated by its type
  std::string where;                // "m.json: layer 'c1' (conv2d)", for messages
};

enum class LossKind {
  pixel_cross_entropy,  // logits [N, C, H, W], labels [N, H, W]
  cross_entropy,        // logits [N, C] (after global pooling), labels [N]
};

struct ModelSpec {
  std::string name;
  std::int64_t input_channels = 0;
  std::vector<LayerSpec> layers;  // in order; every input names an earlier layer
  LossKind loss = LossKind::pixel_cross_entropy;
  std::string json;  // canonical text, for hashing and dumps
};

const char* to_string(LossKind k);

// Parses and validates a model. Errors name the layer and the field. Local.
ModelSpec parse_model(const std::string& json_text, const std::string& source = "model");

// `name_or_path`: a built-in model name (see builtin_model_names) or a JSON file. Local.
ModelSpec load_model(const std::string& name_or_path);

std::vector<std::string> builtin_model_names();

}  // namespace tessera
