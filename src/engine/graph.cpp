#include "tessera/engine/graph.hpp"

#include <algorithm>

#include "tessera/layers/registry.hpp"
#include "tessera/partition.hpp"

namespace tessera {

template <typename T>
std::vector<LayerNode<T>> set_up_layers(const ModelSpec& spec, const Distribution& input,
                                        Parameters parameters) {
  std::vector<LayerNode<T>> nodes;
  int tag = 0;  // halo exchanges of different layers tell their messages apart by it
  for (const LayerSpec& l : spec.layers) {
    LayerNode<T> node;
    node.layer = make_layer<T>(l, ++tag);
    node.layer->set_parameters(parameters);
    for (const std::string& name : l.inputs) {
      int index = -1;
      for (std::size_t k = 0; k < nodes.size(); ++k)
        if (nodes[k].layer->name() == name) index = static_cast<int>(k);
      node.inputs.push_back(index);
      node.in.push_back(index >= 0 ? nodes[static_cast<std::size_t>(index)].out : input);
    }
    node.out = node.layer->setup(node.in);
    nodes.push_back(std::move(node));
  }
  // The loss reads the last layer's output.
  const Distribution& out = nodes.back().out;
  const std::string who = "model '" + spec.name + "'";
  if (spec.loss == LossKind::pixel_cross_entropy)
    TESSERA_CHECK(!out.replicated, who +
                                       ": the loss pixel_cross_entropy needs per-pixel logits, "
                                       "but the last layer '" +
                                       spec.layers.back().name +
                                       "' gives one vector per sample (use cross_entropy)");
  else
    TESSERA_CHECK(out.replicated, who +
                                      ": the loss cross_entropy needs one vector of logits per "
                                      "sample (after global_avgpool and linear), but the last "
                                      "layer '" +
                                      spec.layers.back().name +
                                      "' gives an image (use pixel_cross_entropy)");
  return nodes;
}

Distribution with_aligned_split(const ModelSpec& spec, Distribution input) {
  input.row_units = input.col_units = 0;
  std::vector<std::int64_t> heights{input.global.h}, widths{input.global.w};
  for (const LayerNode<double>& node : set_up_layers<double>(spec, input, Parameters::count))
    if (!node.out.replicated) {
      heights.push_back(node.out.global.h);
      widths.push_back(node.out.global.w);
    }
  input.row_units = aligned_units(heights, input.grid.h);
  input.col_units = aligned_units(widths, input.grid.w);
  return input;
}

std::string split_units_text(const Distribution& in) {
  // Units that change the tiles (with_aligned_split), and their length in the input's rows.
  const auto axis = [](std::int64_t units, std::int64_t extent, int parts, const char* what) {
    if (units <= 0 || units % parts == 0) return std::string();
    std::string s = std::string(what) + " cut in " + std::to_string(units) + " units";
    if (extent % units == 0) s += " of " + std::to_string(extent / units);
    return s;
  };
  const std::string rows = axis(in.row_units, in.global.h, in.grid.h, "rows");
  const std::string cols = axis(in.col_units, in.global.w, in.grid.w, "columns");
  if (rows.empty() && cols.empty()) return {};
  return (rows.empty()   ? cols
          : cols.empty() ? rows
                         : rows + ", " + cols) +
         " to line up the resolutions";
}

std::string tile_spread_text(const Distribution& in) {
  // Uneven tiles: the smallest and the largest, rows x columns.
  std::int64_t rows_min = in.global.h, rows_max = 0, cols_min = in.global.w, cols_max = 0;
  for (int i = 0; i < in.grid.h; ++i)
    for (int j = 0; j < in.grid.w; ++j) {
      const Box b = in.tile_of(i, j);
      rows_min = std::min(rows_min, b.h.size());
      rows_max = std::max(rows_max, b.h.size());
      cols_min = std::min(cols_min, b.w.size());
      cols_max = std::max(cols_max, b.w.size());
    }
  std::string s;
  if (rows_min != rows_max || cols_min != cols_max)
    s = "tiles from " + std::to_string(rows_min) + "x" + std::to_string(cols_min) + " to " +
        std::to_string(rows_max) + "x" + std::to_string(cols_max);
  if (const std::string units = split_units_text(in); !units.empty())
    s += (s.empty() ? "" : ", ") + units;
  return s;
}

std::string tiles_text(const Distribution& in) {
  std::string s = "tile rows " + to_string(in.rows()) + ", columns " + to_string(in.cols()) +
                  " of " + std::to_string(in.global.h) + "x" + std::to_string(in.global.w);
  if (const std::string spread = tile_spread_text(in); !spread.empty()) s += "; " + spread;
  return s;
}

template std::vector<LayerNode<float>> set_up_layers(const ModelSpec&, const Distribution&,
                                                     Parameters);
template std::vector<LayerNode<double>> set_up_layers(const ModelSpec&, const Distribution&,
                                                      Parameters);

}  // namespace tessera
