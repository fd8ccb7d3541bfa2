// Counter-based random numbers: a value depends only on (seed, stream, index), never on which
// rank computes it or in which order, so every grid generates the same data and parameters.
// Local; pure.
#pragma once

#include <cstdint>
#include <string_view>

namespace tessera {

constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr std::uint64_t hash_string(std::string_view s) {
  std::uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a
  for (char c : s)
    h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
  return h;
}

constexpr std::uint64_t random_bits(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ index);
}

// Uniform in [0, 1) with 53 random bits.
constexpr double uniform01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return static_cast<double>(random_bits(seed, stream, index) >> 11) * 0x1.0p-53;
}

}  // namespace tessera
