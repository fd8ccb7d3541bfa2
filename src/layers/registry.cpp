#include "tessera/layers/registry.hpp"

#include "tessera/error.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/pointwise.hpp"

namespace tessera {

const std::vector<LayerKind>& layer_kinds() {
  static const std::vector<LayerKind> kinds = {
      {"conv2d", 1, 1, [](const LayerSpec& s) { parse_conv2d(s); }},
      {"relu", 1, 1, [](const LayerSpec& s) { parse_activation(s); }},
      {"leaky_relu", 1, 1, [](const LayerSpec& s) { parse_activation(s); }},
      {"sigmoid", 1, 1, [](const LayerSpec& s) { parse_activation(s); }},
      {"dropout", 1, 1, [](const LayerSpec& s) { parse_dropout(s); }},
  };
  return kinds;
}

const LayerKind* find_layer_kind(const std::string& type) {
  for (const LayerKind& k : layer_kinds())
    if (k.type == type) return &k;
  return nullptr;
}

std::string layer_type_list() {
  std::string list;
  for (const LayerKind& k : layer_kinds())
    list += (list.empty() ? "" : ", ") + k.type;
  return list;
}

template <typename T>
std::unique_ptr<Layer<T>> make_layer(const LayerSpec& s, int tag) {
  if (s.type == "conv2d") return std::make_unique<Conv2d<T>>(s.name, parse_conv2d(s), tag);
  if (s.type == "relu" || s.type == "leaky_relu" || s.type == "sigmoid")
    return std::make_unique<Activation<T>>(s.name, parse_activation(s));
  if (s.type == "dropout") return std::make_unique<Dropout<T>>(s.name, parse_dropout(s));
  throw Error(s.where + ": unknown layer type '" + s.type + "' (available: " + layer_type_list() +
              ")");
}

template std::unique_ptr<Layer<float>> make_layer(const LayerSpec&, int);
template std::unique_ptr<Layer<double>> make_layer(const LayerSpec&, int);

}  // namespace tessera
