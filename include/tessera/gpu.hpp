// What the build knows about GPUs, and device memory. The CUDA backend (cuDNN, NCCL) is not built
// yet; this reports whether the CUDA runtime was linked and what it sees (`tessera --version`),
// and hands out the current device's memory as an Allocator. Local.
#pragma once

#include <cstddef>
#include <string>

#include "tessera/allocator.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

struct GpuInfo {
  bool built = false;       // compiled with the CUDA runtime
  int runtime_version = 0;  // e.g. 13000 for 13.0
  int devices = 0;
  std::string error;  // why no device is usable, if none is
};

GpuInfo gpu_info();

// The memory of the current CUDA device (cudaMalloc / cudaFree; copies with cudaMemcpy), one per
// process like host_allocator(); null in a build without CUDA or when no device is usable. An
// allocation that does not fit throws an Error naming the bytes asked and the bytes free.
Allocator* device_allocator();

// Copies `bytes` from `src` in `from` to `dst` in `to` (host or device). Throws an Error in a
// build without CUDA when either side is the device.
void copy_bytes(void* dst, MemorySpace to, const void* src, MemorySpace from, std::size_t bytes);

// `t` with its shape and layout in the memory of `allocator`. Local.
template <typename T>
Tensor<T> copy_to(const Tensor<T>& t, Allocator& allocator) {
  Tensor<T> out(t.shape(), t.layout(), uninitialized, allocator);
  copy_bytes(out.data_in(out.space()), out.space(), t.data_in(t.space()), t.space(),
             t.size() * sizeof(T));
  return out;
}

}  // namespace tessera
