// Helpers every test suite shares (unit and MPI): seeded random data, the error measures the
// checks use, and message matching. One copy, so a fix to one reaches every test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "tessera/kernels/simd.hpp"
#include "tessera/random.hpp"
#include "tessera/tensor.hpp"

namespace tessera::test {

// Uniform in [lo, hi) from (seed, stream, index), rounded to float so that float and double runs
// see the same data.
template <typename T>
Tensor<T> random_tensor(Shape4 s, std::uint64_t seed, std::uint64_t stream, double lo = -1,
                        double hi = 1) {
  Tensor<T> t(s);
  for (std::int64_t k = 0; k < t.numel(); ++k)
    t.data()[k] = static_cast<T>(
        static_cast<float>(lo + (hi - lo) * uniform01(seed, stream, std::uint64_t(k))));
  return t;
}

template <typename T>
std::vector<T> random_vector(std::int64_t n, std::uint64_t seed, std::uint64_t stream,
                             double lo = -1, double hi = 1) {
  std::vector<T> v(static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < v.size(); ++k)
    v[k] = static_cast<T>(static_cast<float>(lo + (hi - lo) * uniform01(seed, stream, k)));
  return v;
}

// max |v|. Any range of numbers (a span, a vector).
template <typename R>
double max_abs(const R& v) {
  double m = 0;
  for (const auto& x : v)
    m = std::max(m, std::abs(double(x)));
  return m;
}

// max |a - b| / scale (scale 0: the absolute difference). Fails the test when the sizes differ,
// so a check never passes by comparing a prefix.
template <typename A, typename B>
double rel_error(const A& a, const B& b, double scale) {
  EXPECT_EQ(std::size(a), std::size(b)) << "compared ranges of different sizes";
  const std::size_t n = std::min(std::size(a), std::size(b));
  double diff = 0;
  for (std::size_t k = 0; k < n; ++k)
    diff = std::max(diff, std::abs(double(a[k]) - double(b[k])));
  return scale > 0 ? diff / scale : diff;
}

// max |a - b| / max |b|: the error of `a` against the reference `b`.
template <typename A, typename B>
double rel_error(const A& a, const B& b) {
  return rel_error(a, b, max_abs(b));
}

// sum a[k] * b[k] in double; fails the test when the sizes differ.
template <typename A, typename B>
double dot(const A& a, const B& b) {
  EXPECT_EQ(std::size(a), std::size(b)) << "dot product of ranges of different sizes";
  const std::size_t n = std::min(std::size(a), std::size(b));
  double s = 0;
  for (std::size_t k = 0; k < n; ++k)
    s += double(a[k]) * double(b[k]);
  return s;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Expects every part in `message` (an error's text), naming the one missing.
inline void expect_mentions(const std::string& message, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts)
    EXPECT_TRUE(contains(message, part)) << "'" << part << "' not in: " << message;
}

// Runs body() at every SIMD level of this CPU and build (baseline, then AVX-512 where there is
// one), each with streaming stores for every output (a threshold of 0) and for none, under a
// SCOPED_TRACE that names both; the level and threshold in force before are restored after, also
// when body throws. Local (it sets the process-wide level and threshold).
template <class Body>
void at_every_simd_level_streaming_or_not(Body&& body) {
  struct Restore {
    SimdLevel level = simd_level();
    std::int64_t bytes = streaming_store_bytes();
    ~Restore() {
      set_simd_level(level);
      set_streaming_store_bytes(bytes);
    }
  } restore;
  std::vector<SimdLevel> levels{SimdLevel::baseline};
  if (simd_available(SimdLevel::avx512)) levels.push_back(SimdLevel::avx512);
  for (SimdLevel l : levels)
    for (std::int64_t bytes : {std::int64_t{0}, std::int64_t{1} << 40}) {
      set_simd_level(l);
      set_streaming_store_bytes(bytes);
      SCOPED_TRACE(std::string(to_string(l)) + (bytes == 0 ? ", streaming" : ", not streaming"));
      body();
    }
}

}  // namespace tessera::test
