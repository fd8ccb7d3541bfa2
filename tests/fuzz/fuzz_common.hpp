// What the libFuzzer targets share (tests/fuzz/fuzz_tests.py builds and runs them; README
// "Tests"). Each target feeds one input to one of Tessera's readers: a tessera::Error is the
// expected answer to a bad input; anything else (a crash, a sanitizer report, any other exception
// escaping, a leak) is a finding.
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "tessera/error.hpp"
#include "tessera/io/hdf5.hpp"
#include "tessera/mpi_comm.hpp"

namespace tessera::fuzz {

// The one-rank world the targets read files over (H5Dataset, cli::parse). Call it first from
// LLVMFuzzerInitialize, after init_mpi_and_hdf5.
inline const Comm& world() {
  static const MpiComm comm(MPI_COMM_WORLD, {1, 1, 1}, {});
  return comm;
}

// Whether every input must be read without an Error: TESSERA_FUZZ_SEEDS_VALID=1, set by
// fuzz_tests.py while it replays the seeds it generated, so that a seed the reader refuses (one
// that drifted from what the target expects, such as a checkpoint of another model) fails the
// test instead of leaving the fuzzer to explore only the first check.
inline bool seeds_must_be_valid() {
  static const bool valid = [] {
    const char* v = std::getenv("TESSERA_FUZZ_SEEDS_VALID");
    return v != nullptr && std::string(v) == "1";
  }();
  return valid;
}

// Runs `body` on one input: an Error is caught (a refusal, as the command line reports it);
// other exceptions escape, and libFuzzer reports them as a crash ("deadly signal" after
// std::terminate). Afterwards no HDF5 file or object may be open: one left open would keep HDF5's
// cache of the file, and the next input, written to the same path, would be read through it.
template <typename Body>
int run_one(Body&& body) {
  try {
    body();
  } catch (const Error& e) {
    if (seeds_must_be_valid()) {
      std::cerr << "fuzz: a seed was refused: " << e.what() << "\n";
      std::abort();
    }
  }
  const ssize_t open = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
  if (open != 0) {
    std::cerr << "fuzz: " << open << " HDF5 files or objects left open after the input\n";
    std::abort();
  }
  return 0;
}

// The input as a file (HDF5 and Boost.Program_options read paths): one per process, rewritten for
// every input, in /dev/shm when there is one (no disk traffic), removed at exit. The name is never
// destroyed: the atexit handler runs after the destructors of statics constructed later.
inline const std::string& input_path(const char* suffix) {
  static const std::string* const path = [suffix] {
    const std::filesystem::path dir = std::filesystem::is_directory("/dev/shm")
                                          ? "/dev/shm"
                                          : std::filesystem::temp_directory_path();
    auto* p =
        new std::string((dir / ("tessera-fuzz-" + std::to_string(::getpid()) + suffix)).string());
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove(input_path(""), ignored);
    });
    return p;
  }();
  return *path;
}

inline const std::string& write_input(const std::uint8_t* data, std::size_t size,
                                      const char* suffix) {
  const std::string& path = input_path(suffix);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.close();
  if (!out) {
    std::cerr << "fuzz: cannot write " << path << "\n";
    std::abort();
  }
  return path;
}

// MPI (the Comm of a runtime needs it; a single process, MPICH's singleton) and a quiet HDF5.
// For LLVMFuzzerInitialize. MPI_Finalize is never called: libFuzzer ends the process with exit().
inline void init_mpi_and_hdf5() {
  int argc = 0;
  char** argv = nullptr;
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  h5::quiet();
}

}  // namespace tessera::fuzz
