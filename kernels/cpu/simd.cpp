#include "tessera/kernels/simd.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/error.hpp"

namespace tessera {
namespace {

bool cpu_has_avx512() {
#if TESSERA_HAS_WIDE_LOOPS
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;  // no wide loops in this build
#endif
}

// The largest cache cpu0 has, from sysfs ("32768K"); 0 where it cannot be read. (glibc's
// sysconf(_SC_LEVEL3_CACHE_SIZE) gives ten times the L3 on AMD EPYC VMs seen here.)
std::int64_t last_level_cache_bytes() {
  std::int64_t largest = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::int64_t size = 0;
    char unit = 0;
    if (!(in >> size)) continue;
    if (in >> unit) size <<= unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0;
    largest = std::max(largest, size);
  }
  return largest;
}

std::atomic<std::int64_t>& streaming_bytes() {
  static std::atomic<std::int64_t> bytes{[] {
    const std::int64_t l3 = last_level_cache_bytes();
    return l3 > 0 ? l3 / 2 : std::int64_t{16} << 20;
  }()};
  return bytes;
}

std::atomic<SimdLevel>& level() {
  static std::atomic<SimdLevel> current{cpu_has_avx512() ? SimdLevel::avx512 : SimdLevel::baseline};
  return current;
}

}  // namespace

const char* to_string(SimdLevel level) {
  return level == SimdLevel::avx512 ? "avx512" : "baseline";
}

SimdLevel parse_simd_level(const std::string& name) {
  if (name == "baseline") return SimdLevel::baseline;
  if (name == "avx512") return SimdLevel::avx512;
  throw Error("unknown instruction set '" + name + "': expected baseline or avx512");
}

bool simd_available(SimdLevel level) {
  return level == SimdLevel::baseline || cpu_has_avx512();
}

SimdLevel simd_level() {
  return level().load(std::memory_order_relaxed);
}

void set_simd_level(SimdLevel l) {
  TESSERA_CHECK(simd_available(l), std::string("the ") + to_string(l) +
                                       " loops are not available on this CPU or in this build");
  level().store(l, std::memory_order_relaxed);
}

std::int64_t streaming_store_bytes() {
  return streaming_bytes().load(std::memory_order_relaxed);
}

void set_streaming_store_bytes(std::int64_t bytes) {
  streaming_bytes().store(bytes, std::memory_order_relaxed);
}

double triad_bandwidth_gbs(std::int64_t bytes_per_array, int repeats) {
  TESSERA_CHECK(bytes_per_array >= 1024 && repeats >= 1,
                "triad_bandwidth_gbs: at least 1 KiB per array and one pass");
  const auto n = static_cast<std::size_t>(bytes_per_array) / sizeof(float);
  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);  // maps every page
  auto pass = [&] {
    float* __restrict out = a.data();
    const float* __restrict x = b.data();
    const float* __restrict y = c.data();
    for (std::size_t i = 0; i < n; ++i)
      out[i] = x[i] + 3.0f * y[i];
    asm volatile("" : : "r"(out) : "memory");  // every pass is done, none merged
  };
  pass();
  std::vector<double> seconds;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    pass();
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + repeats / 2, seconds.end());
  return 3.0 * static_cast<double>(n * sizeof(float)) / std::max(seconds[repeats / 2], 1e-9) / 1e9;
}

}  // namespace tessera
