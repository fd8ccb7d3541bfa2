// What a halo exchange moves: boxes found by intersecting windows with owned tiles.
// Every function here is local and pure; halo/ moves the bytes.
#pragma once

#include <span>
#include <vector>

#include "tessera/box.hpp"

namespace tessera {

// One message of an exchange: `box` (global image coordinates) travels between this rank and
// `peer` (a rank of the spatial communicator).
struct HaloTransfer {
  int peer = 0;
  Box box;
  friend bool operator==(const HaloTransfer&, const HaloTransfer&) = default;
};

// The exchange of one layer on one rank. `window` is the unclipped input box the rank needs
// (parts outside the image are zero padding and never exchanged); `owned` is its own tile.
// fill:       owned values -> peers' windows   (send: my owned box pieces; recv: peers' pieces)
// accumulate: window gradients -> owners, added (the same messages, reversed; the adjoint)
struct HaloPlan {
  Box owned;
  Box window;
  Box self;                        // owned ∩ window: copied locally, never sent
  std::vector<HaloTransfer> recv;  // for fill: peer's owned ∩ my window, ascending peer
  std::vector<HaloTransfer> send;  // for fill: my owned ∩ peer's window, ascending peer

  // Elements (per channel plane) received and sent in fill; accumulate swaps them.
  std::int64_t recv_elements() const;
  std::int64_t send_elements() const;
};

// Builds rank `me`'s plan from every spatial rank's owned box and window (indexed by spatial
// rank). Corners come from diagonal peers and halos wider than a neighbour's tile from peers
// further away, because every peer's box is intersected.
HaloPlan make_halo_plan(std::span<const Box> owned, std::span<const Box> windows, int me);

}  // namespace tessera
