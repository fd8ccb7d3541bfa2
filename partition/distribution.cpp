#include "tessera/dist_tensor.hpp"
#include "tessera/error.hpp"
#include "tessera/partition.hpp"

namespace tessera {

std::string Shape4::str() const {
  return std::to_string(n) + "x" + std::to_string(c) + "x" + std::to_string(h) + "x" +
         std::to_string(w);
}

std::size_t checked_storage_size(const Shape4& s, Layout layout, std::size_t element_bytes) {
  const std::int64_t b = block_of(layout), c = channel_blocks(s.c, b) * b;
  std::int64_t n = 0, bytes = 0;
  // The message is built only on failure: this runs for every tensor.
  if (__builtin_mul_overflow(s.n, c, &n) || __builtin_mul_overflow(n, s.h, &n) ||
      __builtin_mul_overflow(n, s.w, &n) ||
      __builtin_mul_overflow(n, static_cast<std::int64_t>(element_bytes), &bytes))
    throw Error("a tensor of shape " + s.str() + " (" + std::to_string(element_bytes) +
                "-byte elements) overflows 64-bit sizes (more than 2^63 - 1 bytes)");
  return static_cast<std::size_t>(n);
}

Range Distribution::samples() const {
  return samples_of(me.n);
}
Range Distribution::rows() const {
  return tile_of(me.i, me.j).h;
}
Range Distribution::cols() const {
  return tile_of(me.i, me.j).w;
}

Shape4 Distribution::local_shape() const {
  return {samples().size(), global.c, rows().size(), cols().size()};
}

Box Distribution::tile_of(int i, int j) const {
  if (replicated) return {{0, global.h}, {0, global.w}};
  return {split_range(global.h, row_units, grid.h, i), split_range(global.w, col_units, grid.w, j)};
}

int Distribution::row_owner(std::int64_t row) const {
  return split_owner(global.h, row_units, grid.h, row);
}
int Distribution::col_owner(std::int64_t col) const {
  return split_owner(global.w, col_units, grid.w, col);
}

Range Distribution::samples_of(int n) const {
  return block_range(global.n, grid.n, n);
}

bool Distribution::has_empty_tile() const {
  return (!replicated && (global.h < grid.h || global.w < grid.w)) || global.n < grid.n;
}

}  // namespace tessera
