// Helpers shared by the MPI tests: the grid under test and a reference run on one rank.
#pragma once

#include <cmath>
#include <span>

#include "../common/test_helpers.hpp"
#include "tessera/dist_tensor.hpp"
#include "tessera/runtime.hpp"
#include "tessera/tensor.hpp"

namespace tessera::test {

// The grid this test process runs on: --grid=NxHxW on the command line (default 1x1xP).
GridShape test_grid();
// That grid over MPI_COMM_WORLD with the environment's options, built once: creating
// communicators is a blocking collective, which costs milliseconds when ranks outnumber cores.
const Runtime& world_runtime();
// The same options on a 1x1x1 grid of this rank alone: the single-rank reference.
const Runtime& single_runtime();
// world_runtime().comm().
const Comm& world();
// A runtime on the test grid with other options (both backends, or no overlap, in one process):
// start from world_runtime().options(). Collective over the world.
Runtime make_test_runtime(const RuntimeOptions& options);

// max |tile - whole's part| / max |whole|, in host copies (either may lie on a device).
template <typename S, typename R>
double tile_error(const DistTensor<S>& tile_on_any, const Tensor<R>& whole_on_any) {
  DistTensor<S> tile;
  tile.dist = tile_on_any.dist;
  tile.local = to_host(tile_on_any.local);
  const Tensor<R> whole = to_host(whole_on_any);
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
  const double scale = max_abs(whole.span());
  return scale > 0 ? diff / scale : diff;
}

}  // namespace tessera::test
