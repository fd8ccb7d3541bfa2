// A tensor distributed over a process grid: N block-partitioned over the grid's n sample groups,
// H over its h rows and W over its w columns (README.md "Design", Distribution). Local.
#pragma once

#include "tessera/box.hpp"
#include "tessera/process_grid.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

struct Distribution {
  Shape4 global;  // the whole tensor
  GridShape grid;
  GridCoords me;
  // A spatially replicated tensor (after global pooling: N x C x 1 x 1) is whole on every rank
  // of a sample group: its rows and columns are not split. Samples are still split over groups.
  bool replicated = false;
  // The model's split units (Model: with_aligned_split): rows cut as split_range(global.h,
  // row_units, grid.h, i), so that every tensor whose height is a multiple of row_units has its
  // tile boundaries at the same image rows; 0 (the default), or a height they do not divide: as
  // block_range(global.h, grid.h, i). Columns likewise.
  std::int64_t row_units = 0, col_units = 0;

  Range samples() const;  // my samples, [begin, end) of global.n
  Range rows() const;     // my rows of global.h
  Range cols() const;     // my columns of global.w
  Box tile() const { return {rows(), cols()}; }
  Shape4 local_shape() const;

  // The tile of spatial rank (i, j); the samples of group n.
  Box tile_of(int i, int j) const;
  Range samples_of(int n) const;

  // The spatial rank (i, j) that owns global row `row` / column `col` (not replicated).
  int row_owner(std::int64_t row) const;
  int col_owner(std::int64_t col) const;

  // Same grid, rank and split units, another global shape.
  Distribution with_shape(Shape4 s) const {
    return {s, grid, me, replicated, row_units, col_units};
  }
  Distribution replicated_with_shape(Shape4 s) const {
    return {s, grid, me, true, row_units, col_units};
  }
  // The same distribution as rank `c` holds it.
  Distribution at(GridCoords c) const {
    return {global, grid, c, replicated, row_units, col_units};
  }
  // Empty tiles (fewer rows or columns than grid parts) are an impossible distribution.
  bool has_empty_tile() const;
};

template <typename T>
struct DistTensor {
  Distribution dist;
  Tensor<T> local;

  DistTensor() = default;
  explicit DistTensor(const Distribution& d) : dist(d), local(d.local_shape()) {}
  DistTensor(const Distribution& d, Uninitialized)
      : dist(d), local(d.local_shape(), uninitialized) {}
  DistTensor(const Distribution& d, Layout layout, Uninitialized,
             Allocator& allocator = host_allocator())
      : dist(d), local(d.local_shape(), layout, uninitialized, allocator) {}
  // Zeros in the memory of `allocator`.
  DistTensor(const Distribution& d, Layout layout, Allocator& allocator)
      : dist(d), local(d.local_shape(), layout, allocator) {}

  // How `local` lies in memory. Convolutions with 16k output channels may give nchw16c (float32,
  // oneDNN) where the model allows it: only where every consumer takes it (Layer::takes_blocked).
  // A gradient has the layout of the tensor it is the gradient of.
  Layout layout() const { return local.layout(); }
};

}  // namespace tessera
