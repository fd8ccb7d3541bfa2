// Where tensors' storage comes from: an Allocator per memory space, and the host's, which keeps
// the pages of freed large blocks and moves them into the next block asked for (README
// "Memory"). Local; every function here is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera {

// Host memory is what the CPU reads; device memory belongs to an accelerator and is reached only
// through its backend's kernels and copies.
enum class MemorySpace { host, device };
const char* to_string(MemorySpace space);

// Throws the Error of a host accessor used on a tensor in another memory space.
[[noreturn]] void not_on_host(MemorySpace space);

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual MemorySpace space() const = 0;
  // `bytes` of uninitialised storage, aligned to 64 bytes; nullptr for 0 bytes. Throws an Error
  // naming the bytes when the memory cannot be had.
  virtual void* allocate(std::size_t bytes) = 0;
  // Returns what allocate(bytes) gave.
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
  // Copies `bytes` between two blocks of this allocator.
  virtual void copy(void* dst, const void* src, std::size_t bytes) const = 0;
  // Copies `bytes` from host memory into a block of this allocator (upload) and from a block into
  // host memory (download), finished on return: the host side may be pageable memory the caller
  // reads or frees next. memcpy unless overridden.
  virtual void upload(void* dst, const void* host_src, std::size_t bytes) const;
  virtual void download(void* host_dst, const void* src, std::size_t bytes) const;
  // Copies between a block and host memory of staging() in the order of this allocator's queue of
  // work (a GPU's stream: after the kernels queued before, before those queued after), returning
  // before they are done. The host side of an ordered download may be read, and that of an ordered
  // upload written, only after wait_ordered() returned; it waits for every ordered copy made so
  // far (and so for the work queued before them), not for work queued after. upload and download
  // (finished on return) unless overridden; wait_ordered then has nothing to wait for.
  virtual void upload_ordered(void* dst, const void* host_src, std::size_t bytes) const {
    upload(dst, host_src, bytes);
  }
  virtual void download_ordered(void* host_dst, const void* src, std::size_t bytes) const {
    download(host_dst, src, bytes);
  }
  virtual void wait_ordered() const {}
  // wait_ordered for a destructor: an error (a lost device) is swallowed, since nothing is left
  // to protect then. Local.
  void wait_ordered_quietly() const noexcept {
    try {
      wait_ordered();
    } catch (...) {
    }
  }
  // Sets `bytes` of a block to zero bits (0.0 for float and double). memset unless overridden.
  virtual void zero(void* dst, std::size_t bytes) const;
  // Whether host code may read and write this allocator's blocks directly (Tensor's host
  // accessors ask): host memory yes; device memory no, except emulated device memory while one
  // of its kernels runs.
  virtual bool host_accessible() const { return space() == MemorySpace::host; }
  // The host memory for buffers this allocator's upload and download copy from and into
  // often (the halo exchange's and the gradient buckets' host staging under the MPI transport):
  // page-locked memory for a GPU, which its copy engines reach directly (no bounce through a
  // driver buffer); host_allocator() unless overridden.
  virtual Allocator& staging() const;
};

// Device memory emulated in host memory, for checking on a machine without a GPU that Tessera
// reaches device tensors only through kernels and copies: its blocks are in the device space, so
// every host accessor refuses them, except while an EmulatedKernelScope is open (the emulated
// backend's kernels open one around each call; backend.hpp). One per process. Local.
Allocator& emulated_device_allocator();
// While alive, the host may reach emulated device memory (from any thread: the kernels' loops
// run on the kernel threads). Scopes nest. Local.
class EmulatedKernelScope {
 public:
  EmulatedKernelScope();
  ~EmulatedKernelScope();
  EmulatedKernelScope(const EmulatedKernelScope&) = delete;
  EmulatedKernelScope& operator=(const EmulatedKernelScope&) = delete;
};

// How the host allocator serves large blocks (at least kLargeBlock bytes; smaller ones always come
// from malloc).
enum class HostMemory {
  // Pages of freed blocks are kept and handed to the next large block: a block of the size asked
  // is reused whole; otherwise the block is assembled from kept pages moved into place (mremap,
  // no copy, no page fault) and fresh pages only for what the kept ones do not cover. Resident
  // memory stays at the peak of live blocks, and a step that allocates what the last one freed
  // faults in nothing. Blocks are whole 2 MiB units on 2 MiB boundaries, in transparent huge
  // pages where the kernel has them, and moved as whole huge pages (src/allocator.cpp says why).
  pool,
  // malloc and free, glibc's way: blocks above 32 MiB are mapped and unmapped per allocation, so
  // each step faults its activations in again.
  system,
};
const char* to_string(HostMemory m);
// "pool" | "system"; throws an Error otherwise. Local.
HostMemory parse_host_memory(const std::string& text);

inline constexpr std::size_t kLargeBlock = std::size_t{1} << 20;

// The process's host memory. One per process, like the heap it replaces: two runtimes in one
// process share it. Its policy is set once by main (set_host_memory) from the runtime options.
Allocator& host_allocator();
void set_host_memory(HostMemory m);
HostMemory host_memory();

// What the host allocator has done with large blocks since the process started (or since
// reset_host_memory_stats). Counts are allocations; bytes are rounded to 2 MiB.
struct HostMemoryStats {
  std::int64_t reused = 0;       // served by a kept block of the same size
  std::int64_t assembled = 0;    // served by kept pages moved into place, fresh pages for the rest
  std::int64_t fresh = 0;        // served by fresh pages only
  std::int64_t moved_bytes = 0;  // kept pages moved into assembled blocks
  std::int64_t fresh_bytes = 0;  // fresh pages mapped (faulted in when first written)
  std::int64_t live_bytes = 0;   // in large blocks now
  std::int64_t peak_live_bytes = 0;
  std::int64_t kept_bytes = 0;  // freed and kept for reuse now
  std::int64_t mappings = 0;    // separate mappings behind the live and kept blocks
};
HostMemoryStats host_memory_stats();
void reset_host_memory_stats();  // zeroes the counts and sets the peak to what is live now
// Returns every kept page to the system.
void release_kept_host_memory();

// An owning block of one allocator: what Tensor and the kernels' scratch buffers hold. Copies
// allocate from the same allocator and copy the bytes.
class Storage {
 public:
  Storage() = default;
  Storage(Allocator& allocator, std::size_t bytes)
      : allocator_(&allocator), bytes_(bytes), data_(allocator.allocate(bytes)) {}
  Storage(const Storage& other);
  Storage(Storage&& other) noexcept
      : allocator_(std::exchange(other.allocator_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        data_(std::exchange(other.data_, nullptr)) {}
  Storage& operator=(const Storage& other);
  Storage& operator=(Storage&& other) noexcept;
  ~Storage() { reset(); }

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Allocator* allocator() const { return allocator_; }
  // Host for an empty block.
  MemorySpace space() const { return allocator_ ? allocator_->space() : MemorySpace::host; }
  // Allocator::host_accessible of the block's allocator; true for an empty block.
  bool host_accessible() const { return allocator_ == nullptr || allocator_->host_accessible(); }
  void reset() noexcept;

 private:
  Allocator* allocator_ = nullptr;
  std::size_t bytes_ = 0;
  void* data_ = nullptr;
};

// The host allocator as a standard allocator, for vectors that live from step to step outside
// tensors (the labels of a batch, the max pooling's winners): large ones in the pool's 2 MiB
// blocks of huge pages. On a VM whose hypervisor shadows the guest's page tables (the AMD EPYC
// machine of the README's "Performance"), reading a vector of 4 KiB pages that were last touched
// a step ago cost a hidden fault per page: 26 ms a step for the 16 MiB of labels of a 2048x2048
// image, 2 ms in huge pages. Local.
template <typename T>
struct HostPoolAllocator {
  using value_type = T;
  HostPoolAllocator() = default;
  template <typename U>
  HostPoolAllocator(const HostPoolAllocator<U>&) noexcept {}  // NOLINT: converts implicitly
  T* allocate(std::size_t n) { return static_cast<T*>(host_allocator().allocate(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { host_allocator().deallocate(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const HostPoolAllocator<U>&) const noexcept {
    return true;
  }
};

template <typename T>
using HostVector = std::vector<T, HostPoolAllocator<T>>;

}  // namespace tessera
