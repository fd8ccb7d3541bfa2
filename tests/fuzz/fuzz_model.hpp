// The model whose parameter files and checkpoints the HDF5 targets read: tests/fuzz/
// params_model.json (a convolution, batch norm with its buffers, a transposed convolution without
// bias, a linear head), on one rank with the reference kernels, and the run that fuzz_tests.py
// trains it with to write the seed checkpoints (the two must agree, or every seed checkpoint is
// refused as another run's, which the seed replay reports).
#pragma once

#include <memory>
#include <string>

#include "fuzz_common.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/engine/optimizer.hpp"
#include "tessera/io/checkpoint.hpp"
#include "tessera/mpi_comm.hpp"
#include "tessera/runtime.hpp"

namespace tessera::fuzz {

// fuzz_tests.py: tessera train --model params_model.json --seed 7 --batch 2 --optimizer adam
// --dtype float32 on a dataset of 4 samples (2x8x8 images).
inline CheckpointState seed_run() {
  return {.seed = 7,
          .model = load_model(TESSERA_FUZZ_SOURCE_DIR "/params_model.json").json,
          .dtype = "float32",
          .optimizer = "adam",
          .batch = 2,
          .samples = 4,
          .window_counts = std::vector<std::int64_t>(3 * 3)};  // 3 classes
}

struct SeedModel {
  Runtime runtime;
  Model<float> model;
  Optimizer<float> optimizer;

  SeedModel()
      : runtime(std::make_unique<MpiComm>(MPI_COMM_WORLD, GridShape{1, 1, 1}, WaitSettings{}),
                [] {
                  RuntimeOptions o;
                  o.kernels = KernelBackend::reference;
                  return o;
                }()),
        model(load_model(TESSERA_FUZZ_SOURCE_DIR "/params_model.json"), runtime, {2, 2, 8, 8}),
        optimizer({.kind = OptimizerKind::adam}, model) {}
};

// Built once (in LLVMFuzzerInitialize): every input overwrites the same model's values.
inline SeedModel& seed_model() {
  static SeedModel m;
  return m;
}

}  // namespace tessera::fuzz
