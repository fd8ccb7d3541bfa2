// Half-open index ranges and 2-D boxes in global image coordinates. Local; pure.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

namespace tessera {

// The half-open range [begin, end). An empty range has end <= begin.
struct Range {
  std::int64_t begin = 0;
  std::int64_t end = 0;

  std::int64_t size() const { return end > begin ? end - begin : 0; }
  bool empty() const { return end <= begin; }
  bool contains(std::int64_t i) const { return begin <= i && i < end; }
  friend bool operator==(const Range&, const Range&) = default;
};

inline Range intersect(Range a, Range b) {
  return {std::max(a.begin, b.begin), std::min(a.end, b.end)};
}

// A box of rows x columns: [h.begin, h.end) x [w.begin, w.end).
struct Box {
  Range h;
  Range w;

  std::int64_t size() const { return h.size() * w.size(); }
  bool empty() const { return h.empty() || w.empty(); }
  friend bool operator==(const Box&, const Box&) = default;
};

inline Box intersect(const Box& a, const Box& b) {
  return {intersect(a.h, b.h), intersect(a.w, b.w)};
}

std::string to_string(Range r);
std::string to_string(const Box& b);

}  // namespace tessera
