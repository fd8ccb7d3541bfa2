// Splits a loop over the threads a rank's kernels use (kernel_threads()), for the memory-bound
// loops outside oneDNN (pointwise layers, window assembly, gradient sums). The threads are the
// ones oneDNN uses (one OpenMP runtime), so the two never run at the same time. Local.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/kernels/backend.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace tessera {

// Calls f(begin, end) on disjoint ranges covering [0, n), in parallel when n is at least `grain`
// per thread; each element belongs to exactly one call, so a loop whose iterations are
// independent gives the same results on any thread count.
template <typename F>
void parallel_for(std::int64_t n, F&& f,
                  [[maybe_unused]] std::int64_t grain = std::int64_t{1} << 16) {
#ifdef _OPENMP
  const int threads = static_cast<int>(
      std::min<std::int64_t>(kernel_threads().count, std::max<std::int64_t>(n / grain, 1)));
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      const std::int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
      const std::int64_t begin = n * t / count, end = n * (t + 1) / count;
      if (begin < end) f(begin, end);
    }
    return;
  }
#endif
  if (n > 0) f(std::int64_t{0}, n);
}

// Copies n values from `from` to `to` (not overlapping), split over the kernel threads. Local.
template <typename T>
void parallel_copy(const T* from, std::int64_t n, T* to) {
  parallel_for(n, [&](std::int64_t begin, std::int64_t end) {
    std::copy(from + begin, from + end, to + begin);
  });
}

// The grain (items per thread) for parallel_for over items of `per_item` elements each: threads
// from 65536 elements per thread.
inline std::int64_t grain_for(std::int64_t per_item) {
  return std::max<std::int64_t>(1, (std::int64_t{1} << 16) / std::max<std::int64_t>(per_item, 1));
}

}  // namespace tessera
