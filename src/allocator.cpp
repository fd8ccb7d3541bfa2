#include "tessera/allocator.hpp"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tessera/error.hpp"

namespace tessera {
namespace {

std::size_t round_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

std::string mib(std::size_t bytes) {
  return std::to_string(bytes >> 20) + " MiB";
}

[[noreturn]] void out_of_memory(std::size_t bytes, const char* how) {
  throw Error("out of host memory: " + std::to_string(bytes) + " bytes (" + mib(bytes) +
              ") could not be had (" + how + ": " + std::strerror(errno) +
              "); a larger spatial grid gives each rank a smaller tile (tessera plan)");
}

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4  // Linux 5.7
#endif

// Moves the pages of [from, from + bytes) to `to`, replacing what was there. Returns 0, or -1
// with errno set (the kernel may then have unmapped `to`: the caller maps it again).
// Through the system call itself: MPICH's UCX transport overrides libc's mremap (libucm's
// ucm_override_mremap, to watch mappings for its registration cache), and through it a move to a
// fixed address failed with EINVAL or left the pages elsewhere. So that such hooks still see the
// source go, the move leaves it mapped and empty (MREMAP_DONTUNMAP) and libc's munmap, which they
// do watch, removes it; a kernel without MREMAP_DONTUNMAP moves it away directly.
int move_pages(char* from, std::size_t bytes, char* to) {
  constexpr long kMove = MREMAP_MAYMOVE | MREMAP_FIXED;
  long r = syscall(SYS_mremap, from, bytes, bytes, kMove | MREMAP_DONTUNMAP, to);
  if (r == -1 && errno == EINVAL) {
    r = syscall(SYS_mremap, from, bytes, bytes, kMove, to);
  } else if (r != -1) {
    munmap(from, bytes);
  }
  if (r == -1) return -1;
  if (reinterpret_cast<char*>(r) == to) return 0;
  munmap(reinterpret_cast<void*>(r), bytes);  // never with MREMAP_FIXED; nothing may stay elsewhere
  errno = EFAULT;
  return -1;
}

// A run of pages that is one mapping of its own: mremap moves all or a leading part of one
// mapping, never a range across two, so a block remembers the mappings it is made of.
struct Piece {
  char* addr;
  std::size_t bytes;
};

struct Block {
  std::size_t bytes = 0;
  std::vector<Piece> pieces;  // in address order, covering the block
};

// A block assembled from more mappings than this is unmapped when freed rather than kept: the
// kernel limits a process's mappings (vm.max_map_count, 65530 by default).
constexpr std::size_t kMaxPieces = 64;

// Large blocks are mapped on 2 MiB boundaries, in whole 2 MiB units, and advised to the kernel's
// transparent huge pages, so that every move between them is of whole huge pages. Why: on a
// virtual machine whose hypervisor shadows the guest's page tables (the PVM guests this project's
// AMD EPYC Zen 5 machines run in, 2026-11-27), each 4 KiB page moved by mremap costs a fault in
// the hypervisor when it is next touched, invisible to the guest's fault counters: writing 256 MiB
// after a move took 270-360 ms against 10 ms for the same pages in place (4 KiB pages), and
// 10.5 ms when the pages were huge ones moved whole (a standalone program, 2026-11-27).
// unet-small's 1-rank step at 2048x2048 moved 1.6 GiB of kept pages so and spent 4.4-5.3 s of its
// 6.2-7.1 s in such faults. Every block, not only large ones: at 512x512 (most blocks 1-8 MiB) a
// first version that kept blocks under 8 MiB in 4 KiB pages took 0.18-0.22 s a step against
// 0.08-0.11 s (the 2 MiB rounding adds 0.7 MiB to its 184 MiB peak).
constexpr std::size_t kHugePage = std::size_t{2} << 20;

class HostAllocator final : public Allocator {
 public:
  MemorySpace space() const override { return MemorySpace::host; }

  void* allocate(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    if (bytes < kLargeBlock || policy_ == HostMemory::system) {
      void* p = std::aligned_alloc(64, round_up(bytes, 64));
      if (p == nullptr) out_of_memory(bytes, "malloc");
      return p;
    }
    const std::size_t n = round_up(bytes, kHugePage);
    std::lock_guard lock(mutex_);
    live_.reserve(live_.size() + 1);  // nothing to throw once the block is taken
    Block block = take(n);
    char* addr = block.pieces.front().addr;
    stats_.live_bytes += static_cast<std::int64_t>(n);
    stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
    live_.emplace(addr, std::move(block));
    return addr;
  }

  void deallocate(void* p, std::size_t bytes) noexcept override {
    if (p == nullptr) return;
    if (bytes >= kLargeBlock) {
      std::lock_guard lock(mutex_);
      if (auto it = live_.find(p); it != live_.end()) {
        Block block = std::move(it->second);
        live_.erase(it);
        stats_.live_bytes -= static_cast<std::int64_t>(block.bytes);
        if (policy_ == HostMemory::pool && block.pieces.size() <= kMaxPieces) {
          try {
            const std::size_t size = block.bytes;
            kept_.emplace(size, std::move(block));
            stats_.kept_bytes += static_cast<std::int64_t>(size);
            return;
          } catch (...) {  // no memory for the bookkeeping: give the pages back instead
          }
        }
        unmap(block);
        return;
      }
    }
    std::free(p);
  }

  void copy(void* dst, const void* src, std::size_t bytes) const override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }

  void set_policy(HostMemory m) {
    std::lock_guard lock(mutex_);
    policy_ = m;
    if (m == HostMemory::system) release_locked();
  }
  HostMemory policy() {
    std::lock_guard lock(mutex_);
    return policy_;
  }
  HostMemoryStats stats() {
    std::lock_guard lock(mutex_);
    HostMemoryStats s = stats_;
    s.mappings = 0;
    for (const auto& [addr, b] : live_)
      s.mappings += static_cast<std::int64_t>(b.pieces.size());
    for (const auto& [bytes, b] : kept_)
      s.mappings += static_cast<std::int64_t>(b.pieces.size());
    return s;
  }
  void reset_stats() {
    std::lock_guard lock(mutex_);
    stats_ = HostMemoryStats{.live_bytes = stats_.live_bytes,
                             .peak_live_bytes = stats_.live_bytes,
                             .kept_bytes = stats_.kept_bytes};
  }
  void release() {
    std::lock_guard lock(mutex_);
    release_locked();
  }

 private:
  // A block of n bytes (a multiple of kHugePage): a kept one of that size, else kept pages moved
  // into a fresh mapping (largest-first from the smallest kept block that covers what is left),
  // fresh pages for the rest.
  Block take(std::size_t n) {
    if (auto it = kept_.find(n); it != kept_.end()) {
      Block b = std::move(it->second);
      kept_.erase(it);
      stats_.kept_bytes -= static_cast<std::int64_t>(n);
      ++stats_.reused;
      return b;
    }
    char* base = map_huge(n);
    Block out{n, {}};
    std::size_t filled = 0;
    bool refused = false;
    while (filled < n && !kept_.empty()) {
      auto it = kept_.lower_bound(n - filled);
      if (it == kept_.end()) it = std::prev(it);
      Block from = std::move(it->second);
      kept_.erase(it);
      stats_.kept_bytes -= static_cast<std::int64_t>(from.bytes);
      const std::size_t want = std::min(from.bytes, n - filled);
      const std::size_t moved = move_front(from, want, base + filled, out.pieces);
      filled += moved;
      stats_.moved_bytes += static_cast<std::int64_t>(moved);
      if (from.bytes > 0) {
        stats_.kept_bytes += static_cast<std::int64_t>(from.bytes);
        kept_.emplace(from.bytes, std::move(from));
      }
      if (moved < want) {  // the kernel refused a move: the rest is fresh
        refused = true;
        break;
      }
    }
    if (filled < n) {
      // A refused move may have unmapped its target: map the rest afresh.
      if (refused) {
        if (mmap(base + filled, n - filled, PROT_READ | PROT_WRITE,
                 MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
          unmap(out);
          munmap(base + filled, n - filled);
          out_of_memory(n, "mmap");
        }
        advise_huge(base + filled, n - filled);
      }
      out.pieces.push_back({base + filled, n - filled});
      stats_.fresh_bytes += static_cast<std::int64_t>(n - filled);
    }
    ++(filled > 0 ? stats_.assembled : stats_.fresh);
    return out;
  }

  // Moves the first `want` bytes of `from` to `to` (pieces appended to `into`); `from` keeps the
  // rest. Returns the bytes moved: fewer when the kernel refuses a move.
  static std::size_t move_front(Block& from, std::size_t want, char* to, std::vector<Piece>& into) {
    std::size_t moved = 0;
    std::size_t whole = 0;                           // leading pieces of `from` moved entirely
    into.reserve(into.size() + from.pieces.size());  // no allocation between a move and its record
    while (whole < from.pieces.size() && moved < want) {
      Piece& p = from.pieces[whole];
      const std::size_t len = std::min(p.bytes, want - moved);
      if (move_pages(p.addr, len, to + moved) != 0) break;
      into.push_back({to + moved, len});
      moved += len;
      if (len < p.bytes) {  // the piece's tail stays with `from`
        p.addr += len;
        p.bytes -= len;
        break;
      }
      ++whole;
    }
    from.pieces.erase(from.pieces.begin(),
                      from.pieces.begin() + static_cast<std::ptrdiff_t>(whole));
    from.bytes -= moved;
    return moved;
  }

  static char* map(std::size_t n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) out_of_memory(n, "mmap");
    return static_cast<char*>(p);
  }

  // n bytes (a multiple of kHugePage) on a kHugePage boundary, advised to huge pages: a larger
  // mapping with its unaligned head and its tail unmapped.
  static char* map_huge(std::size_t n) {
    char* p = map(n + kHugePage);
    char* aligned =
        reinterpret_cast<char*>(round_up(reinterpret_cast<std::uintptr_t>(p), kHugePage));
    if (aligned > p) munmap(p, static_cast<std::size_t>(aligned - p));
    munmap(aligned + n, static_cast<std::size_t>(p + kHugePage - aligned));
    advise_huge(aligned, n);
    return aligned;
  }

  // Where the kernel has no transparent huge pages (or they are off) the advice fails and the
  // block keeps 4 KiB pages: it works as before.
  static void advise_huge(char* addr, std::size_t n) { madvise(addr, n, MADV_HUGEPAGE); }

  static void unmap(const Block& b) {
    for (const Piece& p : b.pieces)
      munmap(p.addr, p.bytes);
  }

  void release_locked() {
    for (const auto& [bytes, b] : kept_)
      unmap(b);
    kept_.clear();
    stats_.kept_bytes = 0;
  }

  std::mutex mutex_;
  std::atomic<HostMemory> policy_ = HostMemory::pool;  // read without the lock by allocate
  std::multimap<std::size_t, Block> kept_;             // by size
  std::unordered_map<void*, Block> live_;
  HostMemoryStats stats_;
};

HostAllocator& host() {
  // Never destroyed: tensors in static storage may free into it at exit.
  static HostAllocator* const a = new HostAllocator;
  return *a;
}

}  // namespace

const char* to_string(MemorySpace space) {
  return space == MemorySpace::host ? "host" : "device";
}

const char* to_string(HostMemory m) {
  return m == HostMemory::pool ? "pool" : "system";
}

HostMemory parse_host_memory(const std::string& text) {
  if (text == "pool") return HostMemory::pool;
  if (text == "system") return HostMemory::system;
  throw Error("bad host memory '" + text + "': expected pool or system");
}

Allocator& host_allocator() {
  return host();
}
void set_host_memory(HostMemory m) {
  host().set_policy(m);
}
HostMemory host_memory() {
  return host().policy();
}
HostMemoryStats host_memory_stats() {
  return host().stats();
}
void reset_host_memory_stats() {
  host().reset_stats();
}
void release_kept_host_memory() {
  host().release();
}

void Allocator::upload(void* dst, const void* host_src, std::size_t bytes) const {
  if (bytes > 0) std::memcpy(dst, host_src, bytes);
}
void Allocator::download(void* host_dst, const void* src, std::size_t bytes) const {
  if (bytes > 0) std::memcpy(host_dst, src, bytes);
}
void Allocator::zero(void* dst, std::size_t bytes) const {
  if (bytes > 0) std::memset(dst, 0, bytes);
}
Allocator& Allocator::staging() const {
  return host_allocator();
}

namespace {

// Open EmulatedKernelScopes, over all threads.
std::atomic<int> g_emulated_scopes{0};

class EmulatedDeviceAllocator final : public Allocator {
 public:
  MemorySpace space() const override { return MemorySpace::device; }
  void* allocate(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    // Rounded up to the alignment, as aligned_alloc asks.
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == nullptr)
      throw Error("out of emulated device memory: asked " + std::to_string(bytes) + " bytes");
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override { std::free(p); }
  void copy(void* dst, const void* src, std::size_t bytes) const override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  bool host_accessible() const override { return g_emulated_scopes.load() > 0; }
};

}  // namespace

Allocator& emulated_device_allocator() {
  static EmulatedDeviceAllocator* const allocator = new EmulatedDeviceAllocator;
  return *allocator;
}

EmulatedKernelScope::EmulatedKernelScope() {
  ++g_emulated_scopes;
}
EmulatedKernelScope::~EmulatedKernelScope() {
  --g_emulated_scopes;
}

void not_on_host(MemorySpace space) {
  throw Error(std::string("a host accessor was used on a tensor in ") + to_string(space) +
              " memory: device tensors are read and written by their backend's kernels");
}

Storage::Storage(const Storage& other) : allocator_(other.allocator_), bytes_(other.bytes_) {
  if (allocator_ == nullptr) return;
  data_ = allocator_->allocate(bytes_);
  allocator_->copy(data_, other.data_, bytes_);
}

Storage& Storage::operator=(const Storage& other) {
  if (this == &other) return *this;
  if (allocator_ == other.allocator_ && bytes_ == other.bytes_) {
    if (allocator_ != nullptr) allocator_->copy(data_, other.data_, bytes_);
    return *this;
  }
  Storage copy(other);
  *this = std::move(copy);
  return *this;
}

Storage& Storage::operator=(Storage&& other) noexcept {
  if (this == &other) return *this;
  reset();
  allocator_ = std::exchange(other.allocator_, nullptr);
  bytes_ = std::exchange(other.bytes_, 0);
  data_ = std::exchange(other.data_, nullptr);
  return *this;
}

void Storage::reset() noexcept {
  if (allocator_ != nullptr) allocator_->deallocate(data_, bytes_);
  allocator_ = nullptr;
  bytes_ = 0;
  data_ = nullptr;
}

}  // namespace tessera
