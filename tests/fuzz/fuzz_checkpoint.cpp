// libFuzzer target: a checkpoint (README.md "Files") through read_checkpoint, as `tessera train
// --resume` loads it, into the model of tests/fuzz/params_model.json and its Adam optimizer,
// expecting the run that wrote the seeds (fuzz_model.hpp). Seeds: checkpoints of that run
// (fuzz_tests.py).
#include <cstdint>

#include "fuzz_model.hpp"
#include "tessera/io/checkpoint.hpp"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tessera::fuzz::init_mpi_and_hdf5();
  (void)tessera::fuzz::seed_model();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = tessera::fuzz::write_input(data, size, ".h5");
  return tessera::fuzz::run_one([&] {
    static const tessera::CheckpointState expect = tessera::fuzz::seed_run();
    tessera::fuzz::SeedModel& m = tessera::fuzz::seed_model();
    (void)tessera::read_checkpoint(path, m.model, m.optimizer, expect);
  });
}
