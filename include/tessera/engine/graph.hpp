// The layers of a model, made from its spec and set up for an input distribution: shapes and
// parameters, no runtime. The one place a model's layer list becomes a graph: Model binds what it
// returns to a runtime; `tessera plan` reads its shapes.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tessera/engine/layer.hpp"
#include "tessera/engine/model_spec.hpp"

namespace tessera {

template <typename T>
struct LayerNode {
  std::unique_ptr<Layer<T>> layer;
  std::vector<int> inputs;       // node indices; -1 is the model's input
  std::vector<Distribution> in;  // the inputs' distributions
  Distribution out;
};

// Every layer of `spec` (made as registry.hpp says, in order) set up for its inputs, the model's
// input distributed as `input`; with Parameters::count the parameters are counted, not allocated
// (shapes only). Local and pure; throws an Error naming the layer, or the model when its last
// layer's output does not suit its loss.
template <typename T>
std::vector<LayerNode<T>> set_up_layers(const ModelSpec& spec, const Distribution& input,
                                        Parameters parameters = Parameters::allocate);

// `input` with the split units that line up the tiles of every tensor of `spec`'s model
// (Distribution::row_units, col_units: aligned_units of the heights and of the widths of the
// input and of every layer's output that is not replicated), so that a pooling, an upsampling
// or a strided layer finds the rows its tile needs on its own rank wherever the resolutions
// allow (README.md "The grid"). Sets the layers up once on `input` to learn the extents: throws
// what set_up_layers throws. Local and pure.
Distribution with_aligned_split(const ModelSpec& spec, Distribution input);

// Where `in`'s split units make its tiles differ from an even split: "rows cut in 512 units of 4
// to line up the resolutions" (rows, columns or both: "rows cut in ..., columns cut in ..."); else
// empty. For tessera plan, and through tile_spread_text for train, bench and gradcheck. Local
// and pure.
std::string split_units_text(const Distribution& in);

// Where the tiles of `in` differ: the smallest and the largest and the split units, "tiles from
// 680x2048 to 684x2048, rows cut in 512 units of 4 to line up the resolutions"; else empty. Local
// and pure.
std::string tile_spread_text(const Distribution& in);

// This rank's tile of `in` and, where the tiles differ, the smallest and the largest and the split
// units: "tile rows [0, 684), columns [0, 2048) of 2048x2048; tiles from 680x2048 to 684x2048,
// rows cut in 512 units of 4 to line up the resolutions" (tile_spread_text). For the start-up
// reports of tessera train and tessera bench. Local and pure.
std::string tiles_text(const Distribution& in);

}  // namespace tessera
