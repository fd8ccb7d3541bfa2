#include "tessera/dist_tensor.hpp"
#include "tessera/partition.hpp"

namespace tessera {

std::string Shape4::str() const {
  return std::to_string(n) + "x" + std::to_string(c) + "x" + std::to_string(h) + "x" +
         std::to_string(w);
}

Range Distribution::samples() const {
  return samples_of(me.n);
}
Range Distribution::rows() const {
  return block_range(global.h, grid.h, me.i);
}
Range Distribution::cols() const {
  return block_range(global.w, grid.w, me.j);
}

Shape4 Distribution::local_shape() const {
  return {samples().size(), global.c, rows().size(), cols().size()};
}

Box Distribution::tile_of(int i, int j) const {
  return {block_range(global.h, grid.h, i), block_range(global.w, grid.w, j)};
}

Range Distribution::samples_of(int n) const {
  return block_range(global.n, grid.n, n);
}

bool Distribution::has_empty_tile() const {
  return global.h < grid.h || global.w < grid.w || global.n < grid.n;
}

}  // namespace tessera
