#include "tessera/dist_tensor.hpp"
#include "tessera/partition.hpp"

namespace tessera {

std::string Shape4::str() const {
  return std::to_string(n) + "x" + std::to_string(c) + "x" + std::to_string(h) + "x" +
         std::to_string(w);
}

Range Distribution::samples() const { return samples_of(me.n); }
Range Distribution::rows() const { return tile_of(me.i, me.j).h; }
Range Distribution::cols() const { return tile_of(me.i, me.j).w; }

Shape4 Distribution::local_shape() const {
  return {samples().size(), global.c, rows().size(), cols().size()};
}

Box Distribution::tile_of(int i, int j) const {
  if (replicated) return {{0, global.h}, {0, global.w}};
  return {block_range(global.h, grid.h, i), block_range(global.w, grid.w, j)};
}

Range Distribution::samples_of(int n) const { return block_range(global.n, grid.n, n); }

bool Distribution::has_empty_tile() const {
  return (!replicated && (global.h < grid.h || global.w < grid.w)) || global.n < grid.n;
}

}  // namespace tessera
