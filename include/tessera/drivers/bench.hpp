// `tessera bench`: times training steps (forward, loss, backward, gradient reduction, SGD update)
// of a model on a grid, per layer and per step, split into compute, halo work, waiting for halos
// and exposed reductions, with GFLOP/s of the convolutions against the machine's SGEMM rate.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "tessera/runtime.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

struct BenchOptions {
  std::string model = "conv-bench";
  GridShape grid;
  Shape4 image{1, 3, 2048, 2048};  // n: the global batch
  std::string dtype = "float32";
  std::int64_t steps = 3;   // timed
  std::int64_t warmup = 1;  // untimed, first (plans, page faults, caches)
  std::uint64_t seed = 1;
  double lr = 0.01;
  bool sgemm = true;  // also measure the SGEMM rate
  bool membw = true;  // also measure the memory bandwidth, one rank alone and all at once (cpu)
  // Wait for a GPU's kernels at each layer's pass (Model::set_synchronized_timings): per-layer
  // times are then the GPU's own, at the price of no overlap from one layer to the next.
  bool layer_sync = false;
  std::string json;  // write the results here as JSON
};

// Collective over the world group of `world`; runs on a grid of options.grid built with `runtime`.
// Rank 0 prints to `out`; bad input throws an agreed Error on every rank. Returns 0.
int run_bench(const BenchOptions& options, const Comm& world, const RuntimeOptions& runtime,
              std::ostream& out);

}  // namespace tessera
