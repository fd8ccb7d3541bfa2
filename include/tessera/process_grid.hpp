// The n x h x w process grid: n data-parallel groups, each an h x w spatial grid. Its
// communicators are a Comm (comm.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

// The grid's extent, written "NxHxW" on the command line (e.g. 1x2x2). Local.
struct GridShape {
  int n = 1;
  int h = 1;
  int w = 1;

  int size() const { return n * h * w; }
  std::string str() const;
  friend bool operator==(const GridShape&, const GridShape&) = default;
};

// Parses "NxHxW" (three positive integers). Local; throws Error explaining the notation.
GridShape parse_grid(const std::string& text);

// Parses `count` positive integers joined by 'x' ("3x1024x1024"); throws Error(help) otherwise.
// Local.
std::vector<std::int64_t> parse_sizes(const std::string& text, std::size_t count,
                                      const std::string& help);

// A rank's place in the grid: sample group `n`, spatial row `i`, spatial column `j`.
struct GridCoords {
  int n = 0;
  int i = 0;
  int j = 0;
};

}  // namespace tessera
