// Device memory behind the Allocator interface (include/tessera/gpu.hpp). Built only with CUDA.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda_check.hpp"
#include "tessera/gpu.hpp"

namespace tessera {
namespace {

std::string mib(std::size_t bytes) {
  return std::to_string((bytes + (std::size_t{1} << 19)) >> 20) + " MiB";
}

cudaMemcpyKind kind_of(MemorySpace to, MemorySpace from) {
  if (from == MemorySpace::host)
    return to == MemorySpace::host ? cudaMemcpyHostToHost : cudaMemcpyHostToDevice;
  return to == MemorySpace::host ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
}

class CudaAllocator final : public Allocator {
 public:
  MemorySpace space() const override { return MemorySpace::device; }

  void* allocate(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t rc = cudaMalloc(&p, bytes);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // resets this thread's last error: the failure is reported here
      std::size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      int device = -1;
      cudaGetDevice(&device);
      throw Error("out of device memory on GPU " + std::to_string(device) + ": asked " +
                  std::to_string(bytes) + " bytes (" + mib(bytes) + "), " + mib(free) +
                  " free of " + mib(total) +
                  "; a larger spatial grid gives each rank a smaller tile (tessera plan)");
    }
    TESSERA_CHECK_CUDA(rc);
    return p;  // cudaMalloc aligns to 256 bytes
  }

  void deallocate(void* p, std::size_t) noexcept override {
    if (p != nullptr)
      cudaFree(p);  // a failure here is a lost device; nothing to do in a destructor
  }

  void copy(void* dst, const void* src, std::size_t bytes) const override {
    if (bytes > 0) TESSERA_CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
  }
};

}  // namespace

Allocator* device_allocator() {
  static CudaAllocator* const allocator = [] {
    int devices = 0;
    return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 ? new CudaAllocator : nullptr;
  }();
  return allocator;
}

void copy_bytes(void* dst, MemorySpace to, const void* src, MemorySpace from, std::size_t bytes) {
  if (bytes == 0) return;
  TESSERA_CHECK_CUDA(cudaMemcpy(dst, src, bytes, kind_of(to, from)));
}

}  // namespace tessera
