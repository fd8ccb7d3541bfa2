#include "tessera/process_grid.hpp"

#include <charconv>
#include <vector>

#include "tessera/error.hpp"

namespace tessera {

std::string GridShape::str() const {
  return std::to_string(n) + "x" + std::to_string(h) + "x" + std::to_string(w);
}

std::vector<std::int64_t> parse_sizes(const std::string& text, std::size_t count,
                                      const std::string& help) {
  std::vector<std::int64_t> v(count, 0);
  const char* p = text.data();
  const char* end = text.data() + text.size();
  for (std::size_t k = 0; k < count; ++k) {
    auto [next, ec] = std::from_chars(p, end, v[k]);
    TESSERA_CHECK(ec == std::errc() && next != p && v[k] > 0, help);
    p = next;
    if (k + 1 < count) {
      TESSERA_CHECK(p != end && (*p == 'x' || *p == 'X'), help);
      ++p;
    }
  }
  TESSERA_CHECK(p == end, help);
  return v;
}

GridShape parse_grid(const std::string& text) {
  const std::string help = "bad grid '" + text +
                           "': expected NxHxW, three positive integers (data-parallel groups x "
                           "spatial rows x spatial columns), e.g. 1x2x2";
  const std::vector<std::int64_t> v = parse_sizes(text, 3, help);
  for (std::int64_t x : v)
    TESSERA_CHECK(x <= (1 << 30), help);
  return {static_cast<int>(v[0]), static_cast<int>(v[1]), static_cast<int>(v[2])};
}

}  // namespace tessera
