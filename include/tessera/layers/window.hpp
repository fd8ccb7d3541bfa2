// The window machinery shared by every halo layer (conv, pooling, transposed conv, upsampling):
// from a map "output range -> input range" to the halo plan of each rank.
#pragma once

#include <string>

#include "tessera/dist_tensor.hpp"
#include "tessera/halo_exchange.hpp"
#include "tessera/layer.hpp"
#include "tessera/partition.hpp"

namespace tessera {

// The conv-like map of `a` on each axis.
WindowMap conv_window(const WindowAxis& rows, const WindowAxis& cols);

// Rank (i, j)'s plan for a layer from `in` to `out` through `map`. Local and pure: it intersects
// the rank's window with every rank's tile, O(spatial ranks).
HaloPlan window_plan(const Distribution& in, const Distribution& out, const WindowMap& map, int i,
                     int j);

// This rank's exchange on the grid's spatial communicator. Local.
template <typename T>
HaloExchange<T> window_exchange(const Distribution& in, const Distribution& out,
                                const WindowMap& map, const ProcessGrid& grid, int tag);

// Shape of the local window buffer: my samples and channels, the plan's window box.
Shape4 window_shape(const Distribution& in, const HaloPlan& plan);

// Setup checks with messages naming the layer (`who` = "layer 'c1' (conv2d)"):
// the input must be an image (not the N x C output of global pooling) ...
void require_spatial(const std::string& who, const Distribution& in);
// ... and the output must leave every spatial rank at least one row and one column.
void require_tiles(const std::string& who, const Distribution& out);

}  // namespace tessera
