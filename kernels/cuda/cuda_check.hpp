// The check macro for CUDA runtime calls (private to kernels/cuda): a failed call becomes
// Tessera's Error with the library's own error string, the call and file:line.
#pragma once

#include <cuda_runtime_api.h>

#include <source_location>
#include <string>

#include "tessera/error.hpp"

namespace tessera {

[[noreturn]] inline void fail_cuda(cudaError_t code, const char* call,
                                   std::source_location where = std::source_location::current()) {
  throw Error(std::string("CUDA: ") + call + " failed: " + cudaGetErrorName(code) + ": " +
                  cudaGetErrorString(code),
              where);
}

}  // namespace tessera

#define TESSERA_CHECK_CUDA(call)                                                      \
  do {                                                                                \
    const cudaError_t tessera_cuda_rc_ = (call);                                      \
    if (tessera_cuda_rc_ != cudaSuccess)                                              \
      ::tessera::fail_cuda(tessera_cuda_rc_, #call, std::source_location::current()); \
  } while (0)
