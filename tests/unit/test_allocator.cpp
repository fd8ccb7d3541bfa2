// The host pool (allocator.hpp): a step that allocates what the last one freed reuses its pages
// with no fresh page and no page fault; blocks assembled from kept pages hold their own pages (no
// two live blocks share memory); resident memory stays at the peak of live blocks; tensors own
// their storage, layout and memory space; blocks are whole huge pages, moved whole.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/allocator.hpp"
#include "tessera/error.hpp"
#include "tessera/tensor.hpp"

namespace tessera {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Sets the policy for one test and puts the process's back afterwards.
class HostPool : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = host_memory();
    set_host_memory(HostMemory::pool);
  }
  void TearDown() override { set_host_memory(saved_); }

 private:
  HostMemory saved_ = HostMemory::pool;
};

// One "step": blocks of these sizes, written whole, freed in another order than allocated.
void run_step(const std::vector<std::size_t>& sizes) {
  Allocator& a = host_allocator();
  std::vector<void*> blocks;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    blocks.push_back(a.allocate(sizes[k]));
    std::memset(blocks.back(), static_cast<int>(k + 1), sizes[k]);
    if (k % 3 == 2) {  // a temporary freed mid-step, as a reorder buffer is
      a.deallocate(blocks.back(), sizes[k]);
      blocks.back() = nullptr;
    }
  }
  for (std::size_t k = sizes.size(); k-- > 0;)
    if (blocks[k] != nullptr) a.deallocate(blocks[k], sizes[k]);
}

TEST_F(HostPool, ASecondStepReusesTheFirstStepsPagesWithoutFaults) {
  const std::vector<std::size_t> sizes{24 * kMiB,      8 * kMiB + 4096, 3 * kMiB, 24 * kMiB,
                                       5 * kMiB + 100, 12 * kMiB,       2 * kMiB, 9 * kMiB};
  run_step(sizes);
  reset_host_memory_stats();
  const long faults = minor_faults();
  for (int step = 0; step < 3; ++step)
    run_step(sizes);
  const HostMemoryStats s = host_memory_stats();
  EXPECT_EQ(s.fresh_bytes, 0) << "a repeated step mapped fresh pages";
  EXPECT_EQ(s.fresh, 0);
  EXPECT_EQ(s.reused + s.assembled, 3 * static_cast<std::int64_t>(sizes.size()));
  // 88 MiB written per step would be ~22 500 faults without reuse; a few stray ones (the test
  // framework's own memory) are allowed.
  EXPECT_LT(minor_faults() - faults, 500) << "the repeated steps faulted their pages in again";
}

TEST_F(HostPool, AssembledBlocksNeverShareMemoryWithLiveOnes) {
  Allocator& a = host_allocator();
  release_kept_host_memory();
  // Keep blocks of awkward sizes, then ask for sizes no kept block has: each is assembled from
  // pieces of several kept blocks (moved with mremap), and some blocks stay live meanwhile.
  const std::vector<std::size_t> first{7 * kMiB, 3 * kMiB + 8192, 11 * kMiB, 2 * kMiB};
  std::vector<void*> kept;
  for (std::size_t n : first) {
    kept.push_back(a.allocate(n));
    std::memset(kept.back(), 0x5a, n);
  }
  void* live = a.allocate(4 * kMiB);
  std::memset(live, 0x11, 4 * kMiB);
  for (std::size_t k = 0; k < first.size(); ++k)
    a.deallocate(kept[k], first[k]);
  reset_host_memory_stats();

  // (Blocks are rounded to 2 MiB: 8, 4, 12 and 2 MiB kept; 14, 10 and 6 asked.)
  const std::vector<std::size_t> second{13 * kMiB, 9 * kMiB + 4096, 5 * kMiB};
  std::vector<unsigned char*> blocks;
  for (std::size_t k = 0; k < second.size(); ++k) {
    blocks.push_back(static_cast<unsigned char*>(a.allocate(second[k])));
    std::memset(blocks.back(), static_cast<int>(0x20 + k), second[k]);
  }
  const HostMemoryStats s = host_memory_stats();
  EXPECT_GE(s.assembled, 2) << "expected blocks assembled from kept pages";
  EXPECT_GT(s.moved_bytes, 0);
  for (std::size_t k = 0; k < second.size(); ++k)
    for (std::size_t i = 0; i < second[k]; i += 4096)
      ASSERT_EQ(blocks[k][i], 0x20 + k) << "block " << k << " overwritten at byte " << i;
  const auto* l = static_cast<const unsigned char*>(live);
  for (std::size_t i = 0; i < 4 * kMiB; i += 4096)
    ASSERT_EQ(l[i], 0x11) << "a live block was overwritten at byte " << i;
  for (std::size_t k = 0; k < second.size(); ++k)
    a.deallocate(blocks[k], second[k]);
  a.deallocate(live, 4 * kMiB);
}

TEST_F(HostPool, ResidentMemoryStaysAtThePeakOfLiveBlocks) {
  Allocator& a = host_allocator();
  release_kept_host_memory();
  reset_host_memory_stats();
  // Alternating sizes: glibc's heap or a size-keyed cache would hold both; the pool moves the
  // 64 MiB block's pages into the 48 MiB one and back.
  for (int round = 0; round < 5; ++round)
    for (std::size_t n : {64 * kMiB, 48 * kMiB, 40 * kMiB + 4096}) {
      void* p = a.allocate(n);
      std::memset(p, 1, n);
      a.deallocate(p, n);
    }
  const HostMemoryStats s = host_memory_stats();
  EXPECT_EQ(s.fresh_bytes, static_cast<std::int64_t>(64 * kMiB));
  EXPECT_EQ(s.kept_bytes, static_cast<std::int64_t>(64 * kMiB));
  EXPECT_EQ(s.peak_live_bytes, static_cast<std::int64_t>(64 * kMiB));
  EXPECT_LE(s.mappings, 8) << "the kept pages split into ever more mappings";
  release_kept_host_memory();
  EXPECT_EQ(host_memory_stats().kept_bytes, 0);
}

// Bytes in transparent huge pages among the mappings that overlap [addr, addr + n), each
// mapping's count capped at its overlap (/proc/self/smaps counts per mapping).
std::size_t huge_bytes_in(const void* addr, std::size_t n) {
  std::ifstream smaps("/proc/self/smaps");
  const auto lo = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t hi = lo + n;
  std::size_t total = 0;
  std::size_t overlap = 0;
  std::string line;
  while (std::getline(smaps, line)) {
    std::uintptr_t start = 0;
    std::uintptr_t end = 0;
    const std::string first_word = line.substr(0, line.find(' '));
    if (!first_word.empty() &&
        first_word.back() != ':' &&  // a mapping's line, not one of its fields
        std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR, &start, &end) == 2) {
      overlap = start < hi && end > lo ? std::min(end, hi) - std::max(start, lo) : 0;
    } else if (line.rfind("AnonHugePages:", 0) == 0 && overlap > 0) {
      const std::size_t kib = std::stoull(line.substr(std::strlen("AnonHugePages:")));
      total += std::min(kib * 1024, overlap);
    }
  }
  return total;
}

TEST_F(HostPool, LargeBlocksAreWholeHugePagesAndMovedWhole) {
  Allocator& a = host_allocator();
  release_kept_host_memory();
  reset_host_memory_stats();
  constexpr std::size_t kHuge = 2 * kMiB;
  // 20 and 11 MiB + 1 byte (rounded to 12 MiB): then 30 MiB is assembled from all of the first
  // and 10 MiB of the second, whose last 2 MiB stay kept.
  char* first = static_cast<char*>(a.allocate(20 * kMiB));
  char* second = static_cast<char*>(a.allocate(11 * kMiB + 1));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % kHuge, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(second) % kHuge, 0u);
  EXPECT_EQ(host_memory_stats().live_bytes, static_cast<std::int64_t>(32 * kMiB))
      << "blocks are whole 2 MiB units";
  std::memset(first, 1, 20 * kMiB);
  std::memset(second, 2, 11 * kMiB + 1);
  // Where the kernel offers transparent huge pages (always, or to mappings advised so), the
  // pool's blocks get them.
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes;
  std::getline(thp, modes);
  const bool kernel_gives_huge_pages = !modes.empty() && modes.find("[never]") == std::string::npos;
  const std::size_t huge_first = huge_bytes_in(first, 20 * kMiB);
  const std::size_t huge_second = huge_bytes_in(second, 12 * kMiB);
  if (kernel_gives_huge_pages) {
    EXPECT_GT(huge_first, 0u) << "no huge pages in a 20 MiB block, the kernel offering them ("
                              << modes << ")";
  }
  a.deallocate(first, 20 * kMiB);
  a.deallocate(second, 11 * kMiB + 1);

  char* third = static_cast<char*>(a.allocate(30 * kMiB));
  std::memset(third, 3, 30 * kMiB);
  const HostMemoryStats s = host_memory_stats();
  EXPECT_EQ(s.assembled, 1);
  EXPECT_EQ(s.fresh_bytes, static_cast<std::int64_t>(32 * kMiB)) << "the 30 MiB took fresh pages";
  EXPECT_EQ(s.kept_bytes, static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(third) % kHuge, 0u);
  for (std::size_t i = 0; i < 30 * kMiB; i += 4096)
    ASSERT_EQ(third[i], 3) << "byte " << i;
  // Moves of whole huge pages keep them huge; one that split a huge page would leave 4 KiB pages.
  // (What the kernel gave the first two blocks, less the 2 MiB of the second still kept.)
  if (kernel_gives_huge_pages) {
    EXPECT_GE(huge_bytes_in(third, 30 * kMiB),
              huge_first + (huge_second > 2 * kMiB ? huge_second - 2 * kMiB : 0))
        << "a move split a huge page";
  } else {
    std::printf("(no transparent huge pages from this kernel: their survival not checked)\n");
  }
  a.deallocate(third, 30 * kMiB);

  // A block just over the large-block threshold takes a whole huge page too.
  reset_host_memory_stats();
  void* small = a.allocate(kMiB + 1);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small) % kHuge, 0u);
  EXPECT_EQ(host_memory_stats().live_bytes, static_cast<std::int64_t>(2 * kMiB));
  a.deallocate(small, kMiB + 1);
  release_kept_host_memory();
}

// Vectors that live from step to step (a batch's labels, the max pooling's winners) come from
// the pool: large ones in its 2 MiB-aligned blocks of huge pages, and a second step's as the
// first's pages; small ones from malloc.
TEST_F(HostPool, HostVectorsTakeLargeBlocksFromThePool) {
  release_kept_host_memory();
  reset_host_memory_stats();
  {
    HostVector<std::int32_t> labels(4 * kMiB, 7);  // 16 MiB
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(labels.data()) % (2 * kMiB), 0u);
    EXPECT_EQ(host_memory_stats().live_bytes, static_cast<std::int64_t>(16 * kMiB));
    EXPECT_EQ(std::count(labels.begin(), labels.end(), 7), static_cast<std::ptrdiff_t>(4 * kMiB));
    const HostVector<std::int32_t> copy = labels;
    EXPECT_EQ(host_memory_stats().live_bytes, static_cast<std::int64_t>(32 * kMiB));
    EXPECT_EQ(copy, labels);
    const HostVector<std::uint8_t> small(1000, 1);
    EXPECT_EQ(host_memory_stats().live_bytes, static_cast<std::int64_t>(32 * kMiB))
        << "a small vector came from the pool";
  }
  EXPECT_EQ(host_memory_stats().live_bytes, 0);
  const HostVector<std::int32_t> next(4 * kMiB, 1);
  EXPECT_EQ(host_memory_stats().reused, 1) << "the next step's labels in the last one's pages";
  EXPECT_EQ(host_memory_stats().fresh_bytes, static_cast<std::int64_t>(32 * kMiB));
}

TEST_F(HostPool, SystemPolicyKeepsNothing) {
  set_host_memory(HostMemory::system);
  reset_host_memory_stats();
  run_step({16 * kMiB, 4 * kMiB});
  const HostMemoryStats s = host_memory_stats();
  EXPECT_EQ(s.kept_bytes, 0);
  EXPECT_EQ(s.reused + s.assembled + s.fresh, 0) << "system blocks come from malloc";
  EXPECT_EQ(parse_host_memory("system"), HostMemory::system);
  EXPECT_EQ(parse_host_memory("pool"), HostMemory::pool);
  EXPECT_THROW(parse_host_memory("heap"), Error);
}

TEST_F(HostPool, TensorsOwnStorageLayoutAndSpace) {
  Tensor<float> t({1, 20, 300, 300}, Layout::nchw16c, 2.5f);
  EXPECT_EQ(t.layout(), Layout::nchw16c);
  EXPECT_EQ(t.space(), MemorySpace::host);
  EXPECT_EQ(t.size(), static_cast<std::size_t>(storage_size(t.shape(), Layout::nchw16c)));
  Tensor<float> copy = t;  // a deep copy, same layout
  EXPECT_NE(copy.data(), t.data());
  EXPECT_EQ(copy.layout(), Layout::nchw16c);
  copy.data()[7] = -1;
  EXPECT_EQ(t.data()[7], 2.5f);
  const float* storage = copy.data();
  copy = t;  // same size: copied in place
  EXPECT_EQ(copy.data(), storage);
  EXPECT_EQ(copy.data()[7], 2.5f);
  Tensor<float> moved = std::move(copy);
  EXPECT_EQ(moved.data(), storage);
  EXPECT_EQ(to_layout(to_layout(moved, Layout::nchw), Layout::nchw16c).layout(), Layout::nchw16c);
}

// An allocator that says its memory is a device's (host memory underneath, for the test).
class FakeDevice final : public Allocator {
 public:
  MemorySpace space() const override { return MemorySpace::device; }
  void* allocate(std::size_t bytes) override { return std::malloc(bytes); }
  void deallocate(void* p, std::size_t) noexcept override { std::free(p); }
  void copy(void* dst, const void* src, std::size_t bytes) const override {
    std::memcpy(dst, src, bytes);
  }
};

TEST_F(HostPool, HostAccessorsRefuseDeviceTensors) {
  FakeDevice device;
  Tensor<double> t({2, 3, 4, 5}, Layout::nchw, uninitialized, device);
  EXPECT_EQ(t.space(), MemorySpace::device);
  try {
    (void)t.data();
    ADD_FAILURE() << "data() on a device tensor did not throw";
  } catch (const Error& e) {
    test::expect_mentions(e.what(), {"host accessor", "device"});
  }
  EXPECT_THROW((void)t.span(), Error);
  EXPECT_THROW((void)t.at(0, 0, 0, 0), Error);
  EXPECT_THROW(t.fill(0), Error);
  EXPECT_NE(t.data_in(MemorySpace::device), nullptr);
  EXPECT_THROW((void)t.data_in(MemorySpace::host), Error);
  const Tensor<double> copy = t;  // copies stay in the device's space
  EXPECT_EQ(copy.space(), MemorySpace::device);
}

}  // namespace
}  // namespace tessera
