#include "tessera/layers/registry.hpp"

#include "tessera/error.hpp"
#include "tessera/layers/batchnorm.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/conv_transpose2d.hpp"
#include "tessera/layers/head.hpp"
#include "tessera/layers/merge.hpp"
#include "tessera/layers/pointwise.hpp"
#include "tessera/layers/pool2d.hpp"
#include "tessera/layers/upsample.hpp"

namespace tessera {

const std::vector<LayerKind>& layer_kinds() {
  static const std::vector<LayerKind> kinds = {
      {"conv2d", 1, 1, [](const LayerSpec& s) { parse_conv2d(s); }},
      {"conv_transpose2d", 1, 1, [](const LayerSpec& s) { parse_conv_transpose2d(s); }},
      {"relu", 1, 1, [](const LayerSpec& s) { parse_activation(s); }},
      {"leaky_relu", 1, 1, [](const LayerSpec& s) { parse_activation(s); }},
      {"sigmoid", 1, 1, [](const LayerSpec& s) { parse_activation(s); }},
      {"dropout", 1, 1, [](const LayerSpec& s) { parse_dropout(s); }},
      {"batchnorm2d", 1, 1, [](const LayerSpec& s) { parse_batchnorm(s); }},
      {"maxpool2d", 1, 1, [](const LayerSpec& s) { parse_pool2d(s); }},
      {"avgpool2d", 1, 1, [](const LayerSpec& s) { parse_pool2d(s); }},
      {"upsample_nearest", 1, 1, [](const LayerSpec& s) { parse_upsample(s); }},
      {"concat", 2, 64, [](const LayerSpec& s) { parse_merge(s); }},
      {"add", 2, 64, [](const LayerSpec& s) { parse_merge(s); }},
      {"global_avgpool", 1, 1, [](const LayerSpec& s) { parse_global_avgpool(s); }},
      {"linear", 1, 1, [](const LayerSpec& s) { parse_linear(s); }},
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
  if (s.type == "conv_transpose2d")
    return std::make_unique<ConvTranspose2d<T>>(s.name, parse_conv_transpose2d(s), tag);
  if (s.type == "relu" || s.type == "leaky_relu" || s.type == "sigmoid")
    return std::make_unique<Activation<T>>(s.name, parse_activation(s));
  if (s.type == "dropout") return std::make_unique<Dropout<T>>(s.name, parse_dropout(s));
  if (s.type == "batchnorm2d") return std::make_unique<BatchNorm2d<T>>(s.name, parse_batchnorm(s));
  if (s.type == "maxpool2d" || s.type == "avgpool2d")
    return std::make_unique<Pool2d<T>>(s.name, parse_pool2d(s), tag);
  if (s.type == "upsample_nearest")
    return std::make_unique<UpsampleNearest<T>>(s.name, parse_upsample(s), tag);
  if (s.type == "concat" || s.type == "add")
    return std::make_unique<Merge<T>>(s.name, parse_merge(s));
  if (s.type == "global_avgpool") return std::make_unique<GlobalAvgPool<T>>(s.name);
  if (s.type == "linear") return std::make_unique<Linear<T>>(s.name, parse_linear(s));
  throw Error(s.where + ": unknown layer type '" + s.type + "' (available: " + layer_type_list() +
              ")");
}

template std::unique_ptr<Layer<float>> make_layer(const LayerSpec&, int);
template std::unique_ptr<Layer<double>> make_layer(const LayerSpec&, int);

}  // namespace tessera
