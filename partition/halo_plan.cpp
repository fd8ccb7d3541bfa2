#include "tessera/halo_plan.hpp"

#include "tessera/error.hpp"

namespace tessera {

std::int64_t HaloPlan::recv_elements() const {
  std::int64_t n = 0;
  for (const auto& t : recv)
    n += t.box.size();
  return n;
}

std::int64_t HaloPlan::send_elements() const {
  std::int64_t n = 0;
  for (const auto& t : send)
    n += t.box.size();
  return n;
}

HaloPlan make_halo_plan(std::span<const Box> owned, std::span<const Box> windows, int me) {
  TESSERA_CHECK(
      owned.size() == windows.size() && me >= 0 && static_cast<std::size_t>(me) < owned.size(),
      "make_halo_plan: owned and windows must list every spatial rank");
  HaloPlan plan;
  plan.owned = owned[me];
  plan.window = windows[me];
  plan.self = intersect(owned[me], windows[me]);
  for (int peer = 0; peer < static_cast<int>(owned.size()); ++peer) {
    if (peer == me) continue;
    if (!windows[me].empty()) {
      const Box in = intersect(owned[peer], windows[me]);
      if (!in.empty()) plan.recv.push_back({peer, in});
    }
    if (!windows[peer].empty()) {
      const Box out = intersect(owned[me], windows[peer]);
      if (!out.empty()) plan.send.push_back({peer, out});
    }
  }
  return plan;
}

}  // namespace tessera
