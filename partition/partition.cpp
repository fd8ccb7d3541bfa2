#include "tessera/partition.hpp"

#include <algorithm>
#include <functional>
#include <numeric>

#include "tessera/error.hpp"

namespace tessera {

std::string to_string(Range r) {
  return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
}

std::string to_string(const Box& b) {
  return to_string(b.h) + " x " + to_string(b.w);
}

Range block_range(std::int64_t extent, int parts, int index) {
  TESSERA_CHECK(parts > 0 && index >= 0 && index < parts && extent >= 0,
                "block_range: bad arguments");
  const std::int64_t q = extent / parts;
  const std::int64_t r = extent % parts;
  return {index * q + std::min<std::int64_t>(index, r),
          (index + 1) * q + std::min<std::int64_t>(index + 1, r)};
}

int block_owner(std::int64_t extent, int parts, std::int64_t i) {
  TESSERA_CHECK(parts > 0 && i >= 0 && i < extent, "block_owner: index outside the extent");
  const std::int64_t q = extent / parts;
  const std::int64_t r = extent % parts;
  // The first r parts have q + 1 elements and cover [0, r * (q + 1)).
  const std::int64_t big = r * (q + 1);
  if (i < big) return static_cast<int>(i / (q + 1));
  return static_cast<int>(r + (i - big) / q);
}

Range split_range(std::int64_t extent, std::int64_t units, int parts, int index) {
  if (units <= 0 || extent % units != 0) return block_range(extent, parts, index);
  const Range r = block_range(units, parts, index);
  const std::int64_t length = extent / units;
  return {r.begin * length, r.end * length};
}

int split_owner(std::int64_t extent, std::int64_t units, int parts, std::int64_t i) {
  if (units <= 0 || extent % units != 0) return block_owner(extent, parts, i);
  TESSERA_CHECK(i >= 0 && i < extent, "split_owner: index outside the extent");
  return block_owner(units, parts, i / (extent / units));
}

std::int64_t aligned_units(const std::vector<std::int64_t>& extents, int parts) {
  if (parts <= 1 || extents.empty()) return 0;
  std::vector<std::int64_t> sorted = extents;
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  if (sorted.back() <= 0) return 0;
  const std::int64_t largest = sorted.front(), even = (largest + parts - 1) / parts;
  // The largest extents first, while their common divisor still splits at little cost.
  std::int64_t g = 0, best = 0;
  for (std::size_t k = 0; k < sorted.size(); ++k) {
    const std::int64_t next = std::gcd(g, sorted[k]);
    if (next < parts || (next + parts - 1) / parts * (largest / next) * 100 > even * 103) break;
    g = next;
    if (k > 0) best = g;  // two extents or more line up
  }
  return best;
}

std::int64_t window_output_extent(std::int64_t extent, const WindowAxis& a) {
  const std::int64_t reach = extent + a.pad_begin + a.pad_end - a.span();
  if (reach < 0) return 0;
  return reach / a.stride + 1;
}

Range input_window(Range out, const WindowAxis& a) {
  if (out.empty()) return {0, 0};
  return {out.begin * a.stride - a.pad_begin, (out.end - 1) * a.stride - a.pad_begin + a.span()};
}

void check_splittable(const std::string& what, std::int64_t h, std::int64_t w, int grid_h,
                      int grid_w) {
  if (h >= grid_h && w >= grid_w) return;
  // The same ranks in another split that fits, the most rows of tiles first (the default grid
  // cuts bands of rows: a wide, low image needs columns).
  std::string same_ranks;
  const std::int64_t ranks = std::int64_t{grid_h} * grid_w;
  for (std::int64_t rows = std::min(ranks, h); rows >= 1 && same_ranks.empty(); --rows)
    if (ranks % rows == 0 && ranks / rows <= w)
      same_ranks = "; " + std::to_string(rows) + "x" + std::to_string(ranks / rows) +
                   " takes the same " + std::to_string(ranks) + " ranks";
  throw Error(what + " cannot be split over " + std::to_string(grid_h) + "x" +
              std::to_string(grid_w) + " spatial ranks: a tile would have " +
              (h < grid_h ? (w < grid_w ? "no rows and no columns" : "no rows") : "no columns") +
              " (use a spatial grid of at most " +
              std::to_string(std::min<std::int64_t>(h, grid_h)) + "x" +
              std::to_string(std::min<std::int64_t>(w, grid_w)) + same_ranks + ")");
}

}  // namespace tessera
