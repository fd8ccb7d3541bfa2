// libFuzzer target: a parameter file (README.md "Files": /params, /buffers, format
// tessera-params-1) through read_params into the model of tests/fuzz/params_model.json. Seeds:
// the parameters and buffers of a checkpoint of that model (fuzz_tests.py).
#include <cstdint>

#include "fuzz_model.hpp"
#include "tessera/io/params_io.hpp"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tessera::fuzz::init_mpi_and_hdf5();
  (void)tessera::fuzz::seed_model();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = tessera::fuzz::write_input(data, size, ".h5");
  return tessera::fuzz::run_one(
      [&] { tessera::read_params(path, tessera::fuzz::seed_model().model); });
}
