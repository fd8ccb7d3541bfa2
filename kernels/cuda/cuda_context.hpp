// The process's CUDA state, private to kernels/cuda: the one stream every kernel, cuDNN call and
// device allocation of this process is ordered on, its cuDNN handle, and the convolutions' shared
// workspace. Created on first use, on the device current then (placement chose it: gpu.hpp).
// The stream is a blocking one, so copies on the legacy default stream wait for the kernels
// before them. Local; one thread uses it at a time (the engine's).
#pragma once

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstddef>

#include "tessera/allocator.hpp"
#include "tessera/gpu.hpp"
#include "tessera/tensor.hpp"

namespace tessera::cuda {

class Context {
 public:
  // The calling process's context; throws an Error when no device is usable.
  static Context& get();

  cudaStream_t stream() const { return stream_; }
  cudnnHandle_t cudnn() const { return cudnn_; }
  // Device scratch of at least `bytes` for one call on the stream (the largest asked so far is
  // kept: the convolutions of a model share it, one after another). Valid until the next call.
  void* workspace(std::size_t bytes);
  // Waits for everything enqueued on the stream.
  void synchronize() const;

  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

 private:
  Context();
  cudaStream_t stream_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  Storage workspace_;
};

// The process's stream (Context::get().stream()).
inline cudaStream_t stream() {
  return Context::get().stream();
}

// A device tensor's memory, for a kernel launch (the host accessors refuse it).
template <typename T>
const T* device(const Tensor<T>& t) {
  return t.data_in(MemorySpace::device);
}
template <typename T>
T* device(Tensor<T>& t) {
  return t.data_in(MemorySpace::device);
}

// Device scratch of one kernel object, reused from call to call: grown when a call needs more
// (the old block is freed in the stream's order, after the kernels that read it). Local.
class Scratch {
 public:
  template <typename U>
  U* get(std::size_t count) {
    const std::size_t bytes = count * sizeof(U);
    if (storage_.bytes() < bytes) storage_ = Storage(*device_allocator(), bytes);
    return static_cast<U*>(storage_.data());
  }

 private:
  Storage storage_;
};

}  // namespace tessera::cuda
