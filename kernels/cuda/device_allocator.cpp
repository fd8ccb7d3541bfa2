// Device memory behind the Allocator interface (include/tessera/gpu.hpp). Built only with CUDA.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "cuda_backend.hpp"
#include "cuda_check.hpp"
#include "cuda_context.hpp"
#include "tessera/gpu.hpp"

namespace tessera {
namespace {

std::string mib(std::size_t bytes) {
  return std::to_string((bytes + (std::size_t{1} << 19)) >> 20) + " MiB";
}

// Stream-ordered device memory (cudaMallocAsync on the context's stream, from the device's
// default pool with no release threshold): a freed block is reused by the next allocation of the
// stream without a synchronisation or a cudaMalloc, as the host pool reuses pages. cudaFree would
// wait for the whole device on every freed tensor. Freed blocks are also kept here by size and
// handed out again for the same size (a training step asks for the same sizes in the same order
// every step): on an H200 (2026-11-27) 7 or 8 of unet-small's 80 cudaMallocAsync calls per step
// took 100-180 us each while the GPU waited (scripts/gpu/trace_report.py), where a kept block is
// a lookup. The blocks are returned to the pool when an allocation does not fit.
// The device the allocator (and with it the context's stream) was made on; -1 before.
std::atomic<int> g_bound_device{-1};

// Page-locked host memory (cudaMallocHost): what the MPI transport stages halos and gradient
// buckets through. The copy engines read and write it directly, where pageable memory is copied
// through a driver buffer in chunks.
class PinnedHostAllocator final : public Allocator {
 public:
  MemorySpace space() const override { return MemorySpace::host; }
  void* allocate(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t rc = cudaMallocHost(&p, bytes);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error("page-locked host memory: asked " + std::to_string(bytes) + " bytes (" +
                  mib(bytes) + "): " + cudaGetErrorString(rc));
    }
    return p;  // page-aligned
  }
  void deallocate(void* p, std::size_t) noexcept override {
    if (p != nullptr) cudaFreeHost(p);
  }
  void copy(void* dst, const void* src, std::size_t bytes) const override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
};

class CudaAllocator final : public Allocator {
 public:
  CudaAllocator() {
    int device = 0;
    TESSERA_CHECK_CUDA(cudaGetDevice(&device));
    g_bound_device = device;
    TESSERA_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool_, device));
    std::uint64_t keep_all = UINT64_MAX;
    TESSERA_CHECK_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep_all));
    TESSERA_CHECK_CUDA(cudaEventCreateWithFlags(&ordered_, cudaEventDisableTiming));
  }

  MemorySpace space() const override { return MemorySpace::device; }

  void* allocate(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    {
      const std::lock_guard<std::mutex> lock(kept_lock_);
      const auto hit = kept_.find(bytes);
      if (hit != kept_.end()) {  // freed in the stream's order: reused in it
        void* p = hit->second;
        kept_.erase(hit);
        kept_bytes_ -= bytes;
        return p;
      }
    }
    const cudaStream_t stream = cuda::Context::get().stream();
    void* p = nullptr;
    cudaError_t rc = cudaMallocAsync(&p, bytes, stream);
    if (rc == cudaErrorMemoryAllocation) {
      // Blocks kept here or by the pool that nothing uses may be in the way: return them and try
      // again.
      (void)cudaGetLastError();
      release_kept(stream);
      TESSERA_CHECK_CUDA(cudaStreamSynchronize(stream));
      TESSERA_CHECK_CUDA(cudaMemPoolTrimTo(pool_, 0));
      rc = cudaMallocAsync(&p, bytes, stream);
    }
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // resets this thread's last error: the failure is reported here
      std::size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      int device = -1;
      cudaGetDevice(&device);
      throw OutOfDeviceMemory(
          "out of device memory on GPU " + std::to_string(device) + ": asked " +
          std::to_string(bytes) + " bytes (" + mib(bytes) + "), " + mib(free) + " free of " +
          mib(total) +
          "; a larger spatial grid gives each rank a smaller tile: `tessera plan --device cuda` "
          "with this run's --model, --image, --batch and --grid names one that fits");
    }
    TESSERA_CHECK_CUDA(rc);
    return p;  // aligned to at least 256 bytes
  }

  void deallocate(void* p, std::size_t bytes) noexcept override {
    if (p == nullptr) return;
    try {
      const std::lock_guard<std::mutex> lock(kept_lock_);
      kept_.emplace(bytes, p);
      kept_bytes_ += bytes;
      return;
    } catch (...) {  // no memory for the entry: to the pool instead
    }
    // A failure here is a lost device; nothing to do in a destructor.
    cudaFreeAsync(p, cuda::Context::get().stream());
  }

  void copy(void* dst, const void* src, std::size_t bytes) const override {
    if (bytes > 0)
      TESSERA_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                         cuda::Context::get().stream()));
  }
  // In the stream's order (after the kernels that wrote src), and finished on return: the host
  // side may be pageable memory the caller reads or frees next.
  void upload(void* dst, const void* host_src, std::size_t bytes) const override {
    synchronous_copy(dst, host_src, bytes, cudaMemcpyHostToDevice);
  }
  void download(void* host_dst, const void* src, std::size_t bytes) const override {
    synchronous_copy(host_dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  // Queued on the stream; an event recorded after each marks how far wait_ordered waits (a
  // stream synchronisation would also wait for the kernels queued since).
  void upload_ordered(void* dst, const void* host_src, std::size_t bytes) const override {
    ordered_copy(dst, host_src, bytes, cudaMemcpyHostToDevice);
  }
  void download_ordered(void* host_dst, const void* src, std::size_t bytes) const override {
    ordered_copy(host_dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  void wait_ordered() const override {  // returns at once while nothing was recorded
    TESSERA_CHECK_CUDA(cudaEventSynchronize(ordered_));
  }
  void zero(void* dst, std::size_t bytes) const override {
    if (bytes > 0)
      TESSERA_CHECK_CUDA(cudaMemsetAsync(dst, 0, bytes, cuda::Context::get().stream()));
  }
  Allocator& staging() const override {
    static PinnedHostAllocator* const pinned = new PinnedHostAllocator;
    return *pinned;
  }

 private:
  static void synchronous_copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return;
    const cudaStream_t stream = cuda::Context::get().stream();
    TESSERA_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, stream));
    TESSERA_CHECK_CUDA(cudaStreamSynchronize(stream));
  }

  void ordered_copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) const {
    if (bytes == 0) return;
    const cudaStream_t stream = cuda::Context::get().stream();
    TESSERA_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, stream));
    TESSERA_CHECK_CUDA(cudaEventRecord(ordered_, stream));
  }

  // Returns the kept blocks to the pool (in the stream's order).
  void release_kept(cudaStream_t stream) {
    const std::lock_guard<std::mutex> lock(kept_lock_);
    for (const auto& [bytes, p] : kept_)
      cudaFreeAsync(p, stream);
    kept_.clear();
    kept_bytes_ = 0;
  }

 public:
  // The bytes of the blocks kept for reuse: free to this process, though the pool counts them
  // used.
  std::size_t kept_bytes() {
    const std::lock_guard<std::mutex> lock(kept_lock_);
    return kept_bytes_;
  }

 private:
  cudaMemPool_t pool_ = nullptr;
  cudaEvent_t ordered_ = nullptr;  // recorded after the latest ordered copy
  std::mutex kept_lock_;
  std::unordered_multimap<std::size_t, void*> kept_;  // freed blocks by size
  std::size_t kept_bytes_ = 0;
};

}  // namespace

namespace {

CudaAllocator* the_device_allocator() {
  static CudaAllocator* const allocator = [] {
    int devices = 0;
    return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 ? new CudaAllocator : nullptr;
  }();
  return allocator;
}

}  // namespace

Allocator* device_allocator() {
  return the_device_allocator();
}

namespace cuda {

std::size_t kept_device_bytes() {
  CudaAllocator* allocator = the_device_allocator();
  return allocator != nullptr ? allocator->kept_bytes() : 0;
}

}  // namespace cuda

void set_current_device(int device) {
  const int bound = g_bound_device.load();
  TESSERA_CHECK(bound < 0 || bound == device,
                "GPU " + std::to_string(device) + " asked for after this process began using GPU " +
                    std::to_string(bound) +
                    ": a rank's device is chosen before it takes any device memory");
  TESSERA_CHECK_CUDA(cudaSetDevice(device));
}

}  // namespace tessera
