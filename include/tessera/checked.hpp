// Size arithmetic that cannot wrap around. Element and byte counts are std::int64_t; a product or
// sum of sizes (all >= 0) past 2^63 - 1 is held at kSizeMax, which estimates (tessera plan's, the
// memory check before a run) show as "more than 8 EiB" and which no machine fits. Where a size
// is about to be allocated, __builtin_mul_overflow refuses it with an Error instead (Tensor,
// Layer::make_param). Local; pure.
#pragma once

#include <cstdint>
#include <limits>

namespace tessera {

inline constexpr std::int64_t kSizeMax = std::numeric_limits<std::int64_t>::max();

constexpr std::int64_t saturating_mul(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? kSizeMax : r;
}
constexpr std::int64_t saturating_add(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? kSizeMax : r;
}

}  // namespace tessera
