// The n x h x w process grid: n data-parallel groups, each an h x w spatial grid.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

// The grid's extent, written "NxHxW" on the command line (e.g. 1x2x2). Local.
struct GridShape {
  int n = 1;
  int h = 1;
  int w = 1;

  int size() const { return n * h * w; }
  std::string str() const;
  friend bool operator==(const GridShape&, const GridShape&) = default;
};

// Parses "NxHxW" (three positive integers). Local; throws Error explaining the notation.
GridShape parse_grid(const std::string& text);

// Parses `count` positive integers joined by 'x' ("3x1024x1024"); throws Error(help) otherwise.
// Local.
std::vector<std::int64_t> parse_sizes(const std::string& text, std::size_t count,
                                      const std::string& help);

// A rank's place in the grid: sample group `n`, spatial row `i`, spatial column `j`.
struct GridCoords {
  int n = 0;
  int i = 0;
  int j = 0;
};

// The grid over a communicator, with sub-communicators:
//   spatial: the h*w ranks of my sample group (rank = i*w + j)
//   sample:  the n ranks that hold the same tile of different samples (rank = n)
// Ranks are not reordered: rank in `comm` = n*h*w + i*w + j.
class ProcessGrid {
 public:
  // Collective over `comm`. Throws an agreed Error if shape.size() != size of `comm`.
  ProcessGrid(MPI_Comm comm, GridShape shape);
  ~ProcessGrid();
  ProcessGrid(const ProcessGrid&) = delete;
  ProcessGrid& operator=(const ProcessGrid&) = delete;

  const GridShape& shape() const { return shape_; }
  const GridCoords& coords() const { return coords_; }
  int rank() const { return rank_; }
  MPI_Comm comm() const { return cart_; }
  MPI_Comm spatial() const { return spatial_; }
  MPI_Comm sample() const { return sample_; }

  int spatial_rank(int i, int j) const { return i * shape_.w + j; }
  GridCoords coords_of(int rank) const;

 private:
  GridShape shape_;
  GridCoords coords_;
  int rank_ = 0;
  MPI_Comm cart_ = MPI_COMM_NULL;
  MPI_Comm spatial_ = MPI_COMM_NULL;
  MPI_Comm sample_ = MPI_COMM_NULL;
};

}  // namespace tessera
