// The check macros for CUDA runtime, cuDNN and NCCL calls (private to kernels/cuda): a failed
// call becomes Tessera's Error with the library's own error string, the call and file:line.
#pragma once

#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <nccl.h>

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

[[noreturn]] inline void fail_cudnn(cudnnStatus_t code, const char* call,
                                    std::source_location where = std::source_location::current()) {
  throw Error(std::string("cuDNN: ") + call + " failed: " + cudnnGetErrorString(code), where);
}

[[noreturn]] inline void fail_nccl(ncclResult_t code, const char* call,
                                   std::source_location where = std::source_location::current()) {
  throw Error(std::string("NCCL: ") + call + " failed: " + ncclGetErrorString(code) +
                  (code == ncclSystemError || code == ncclRemoteError || code == ncclInternalError
                       ? std::string(" (set NCCL_DEBUG=WARN for NCCL's own account)")
                       : std::string()),
              where);
}

}  // namespace tessera

#define TESSERA_CHECK_CUDA(call)                                                      \
  do {                                                                                \
    const cudaError_t tessera_cuda_rc_ = (call);                                      \
    if (tessera_cuda_rc_ != cudaSuccess)                                              \
      ::tessera::fail_cuda(tessera_cuda_rc_, #call, std::source_location::current()); \
  } while (0)

#define TESSERA_CHECK_CUDNN(call)                                                       \
  do {                                                                                  \
    const cudnnStatus_t tessera_cudnn_rc_ = (call);                                     \
    if (tessera_cudnn_rc_ != CUDNN_STATUS_SUCCESS)                                      \
      ::tessera::fail_cudnn(tessera_cudnn_rc_, #call, std::source_location::current()); \
  } while (0)

#define TESSERA_CHECK_NCCL(call)                                                      \
  do {                                                                                \
    const ncclResult_t tessera_nccl_rc_ = (call);                                     \
    if (tessera_nccl_rc_ != ncclSuccess)                                              \
      ::tessera::fail_nccl(tessera_nccl_rc_, #call, std::source_location::current()); \
  } while (0)
