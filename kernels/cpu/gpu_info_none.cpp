// Built when CUDA is disabled or not found.
#include "tessera/gpu.hpp"

#include <cstring>

#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"

namespace tessera {

GpuInfo gpu_info() {
  return {.built = false, .error = "built without CUDA"};
}

Allocator* device_allocator() {
  return nullptr;
}

void copy_bytes(void* dst, MemorySpace to, const void* src, MemorySpace from, std::size_t bytes) {
  TESSERA_CHECK(to == MemorySpace::host && from == MemorySpace::host,
                "a copy to or from device memory in a build without CUDA");
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

void set_current_device(int device) {
  throw Error("GPU " + std::to_string(device) + " asked for, but this build has no CUDA");
}

std::string device_name(int) {
  return "no CUDA in this build";
}

const Backend* cuda_backend() {
  return nullptr;
}

}  // namespace tessera
