// Helpers shared by the MPI tests: the grid under test and a reference run on one rank.
#pragma once

#include <mpi.h>

#include <cmath>
#include <span>

#include "tessera/dist_tensor.hpp"
#include "tessera/process_grid.hpp"
#include "tessera/tensor.hpp"

namespace tessera::test {

// The grid this test process runs on: --grid=NxHxW on the command line (default 1x1xP).
GridShape test_grid();
// That grid over MPI_COMM_WORLD, built once: creating communicators is a blocking collective,
// which costs milliseconds when ranks outnumber cores.
const ProcessGrid& world_grid();

// Largest |a - b| over the largest |b|: b is the single-rank reference.
template <typename A, typename B>
double rel_error(std::span<const A> a, std::span<const B> b, double scale) {
  double diff = 0;
  for (std::size_t k = 0; k < a.size(); ++k)
    diff = std::max(diff, std::abs(double(a[k]) - double(b[k])));
  return scale > 0 ? diff / scale : diff;
}

template <typename T>
double max_abs(std::span<const T> v) {
  double m = 0;
  for (T x : v)
    m = std::max(m, std::abs(double(x)));
  return m;
}

// max |tile - whole's part| / max |whole|.
template <typename S, typename R>
double tile_error(const DistTensor<S>& tile, const Tensor<R>& whole) {
  const Range ns = tile.dist.samples(), hs = tile.dist.rows(), ws = tile.dist.cols();
  const Shape4& g = tile.dist.global;
  double diff = 0;
  for (std::int64_t n = ns.begin; n < ns.end; ++n)
    for (std::int64_t c = 0; c < g.c; ++c)
      for (std::int64_t h = hs.begin; h < hs.end; ++h)
        for (std::int64_t w = ws.begin; w < ws.end; ++w)
          diff = std::max(
              diff, std::abs(double(tile.local.at(n - ns.begin, c, h - hs.begin, w - ws.begin)) -
                             double(whole.at(n, c, h, w))));
  const double scale = max_abs<R>(whole.span());
  return scale > 0 ? diff / scale : diff;
}

}  // namespace tessera::test
