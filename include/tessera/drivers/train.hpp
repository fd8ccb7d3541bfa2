// `tessera train`: the training loop over a process grid, with validation, checkpoints,
// progress and metrics.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "tessera/engine/optimizer.hpp"
#include "tessera/runtime.hpp"

namespace tessera {

struct TrainOptions {
  std::string model = "unet-small";
  std::string data;         // HDF5 dataset; empty: the built-in synthetic one
  std::string val_data;     // HDF5 validation set
  double val_fraction = 0;  // or: the last fraction of --data's samples
  GridShape grid;
  std::int64_t epochs = 1;  // steps = epochs * batches per epoch, unless --steps
  std::int64_t steps = 0;
  std::int64_t batch = 8;  // global: split over the data-parallel groups
  OptimizerOptions optimizer;
  double lr = 1e-3;
  ScheduleOptions schedule;  // total_steps is filled in from the run's length
  std::string dtype = "float32";
  std::uint64_t seed = 1;
  std::string init;  // initial parameters and buffers (a params file); empty: seeded random
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;  // steps; 0: only at the end (when a directory is given)
  std::int64_t keep_checkpoints = 3;  // newest checkpoints kept; 0: all
  bool resume = false;
  bool allow_changes = false;  // resume although the computation's options changed
  bool verify_data = false;    // read every sample of --data and --val-data before training
  std::string metrics;         // .csv, or .jsonl / .json for JSON lines
  std::int64_t log_every = 10;
  // The built-in synthetic dataset.
  std::int64_t samples = 512, height = 128, width = 128, val_samples = 32;
  bool progress_line = false;  // one updating line (a terminal) instead of plain lines
};

// Collective over the world group of `world`; trains on a grid of options.grid built with
// `runtime`. Rank 0 prints to `out`. Returns 0 on success; bad input throws an
// agreed Error on every rank.
int run_train(const TrainOptions& options, const Comm& world, const RuntimeOptions& runtime,
              std::ostream& out);

}  // namespace tessera
