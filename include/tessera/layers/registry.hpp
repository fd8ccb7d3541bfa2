// Every layer type Tessera knows: its JSON name, how many inputs it takes, how its fields are
// validated, and how it is built. The one place a new layer type is added. Local.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tessera/engine/layer.hpp"
#include "tessera/engine/model_spec.hpp"

namespace tessera {

struct LayerKind {
  std::string type;
  int min_inputs = 1;
  int max_inputs = 1;
  void (*validate)(const LayerSpec&);  // throws an Error naming the layer and the field
};

const std::vector<LayerKind>& layer_kinds();
const LayerKind* find_layer_kind(const std::string& type);
std::string layer_type_list();  // "conv2d, relu, ..."

// `tag` is unique per layer in a model: it keeps the layer's halo messages apart.
template <typename T>
std::unique_ptr<Layer<T>> make_layer(const LayerSpec& spec, int tag);

}  // namespace tessera
