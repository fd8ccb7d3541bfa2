// `tessera gradcheck`: the proof that sharding changed nothing. Runs one forward/backward of a
// model sharded over a grid and on a single rank, and compares the loss, the output, the input
// gradient and every parameter gradient.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "tessera/runtime.hpp"

namespace tessera {

struct GradcheckOptions {
  std::string model = "convstack-small";  // built-in name or JSON file
  GridShape grid;
  std::string dtype = "float64";  // float32 | float64
  std::string mode = "train";     // train | eval (batch norm, dropout)
  std::string init;               // params HDF5; empty: seeded random
  std::string input;              // batch HDF5; empty: seeded random batch
  std::string dump;               // write the comparison here (HDF5)
  double rtol = 0;                // 0: 1e-10 for float64, 1e-4 for float32
  std::int64_t batch = 2, channels = 0, height = 36,
               width = 44;  // random batch; channels 0: the model's
  std::uint64_t seed = 1;
};

// Collective over the world group of `world`; runs on a grid of options.grid built from it with
// `runtime`. Rank 0 prints the table to `out`. Returns 0 when every relative error
// is within rtol, 1 otherwise (on every rank). Bad input throws an agreed Error on every rank.
int run_gradcheck(const GradcheckOptions& options, const Comm& world, const RuntimeOptions& runtime,
                  std::ostream& out);

}  // namespace tessera
