// The process's CUDA stream, cuDNN handle and workspace (kernels/cuda/cuda_context.hpp).
#include "cuda_context.hpp"

#include <string>

#include "cuda_check.hpp"
#include "cuda_kernels.hpp"
#include "tessera/gpu.hpp"

namespace tessera::cuda {

void check_launch(const char* kernel) {
  const cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess)
    throw Error(std::string("CUDA: kernel ") + kernel + " did not launch: " + cudaGetErrorName(rc) +
                ": " + cudaGetErrorString(rc));
}

Context::Context() {
  TESSERA_CHECK(device_allocator() != nullptr,
                "CUDA: no usable GPU in this process (" + gpu_info().error + ")");
  TESSERA_CHECK_CUDA(cudaStreamCreate(&stream_));
  TESSERA_CHECK_CUDNN(cudnnCreate(&cudnn_));
  TESSERA_CHECK_CUDNN(cudnnSetStream(cudnn_, stream_));
}

Context& Context::get() {
  // Never destroyed: the CUDA runtime may already be torn down when static destructors run.
  static Context* const context = new Context;
  return *context;
}

void* Context::workspace(std::size_t bytes) {
  if (bytes > workspace_.bytes()) {
    // The old block may still be read by kernels on the stream; the stream-ordered device
    // allocator frees it after them.
    workspace_ = Storage();
    workspace_ = Storage(*device_allocator(), bytes);
  }
  return workspace_.data();
}

void Context::synchronize() const {
  TESSERA_CHECK_CUDA(cudaStreamSynchronize(stream_));
}

}  // namespace tessera::cuda
