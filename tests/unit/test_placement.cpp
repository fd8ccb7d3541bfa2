// One GPU per node-local rank (include/tessera/placement.hpp): the choice, and its refusals.
#include <gtest/gtest.h>

#include "../common/test_helpers.hpp"
#include "tessera/error.hpp"
#include "tessera/placement.hpp"

namespace tessera {
namespace {

TEST(Placement, EachRankOfANodeTakesItsOwnDevice) {
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(device_for(r, 4, 4, false), r);
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(device_for(r, 2, 8, false), r);
}

TEST(Placement, SharingDealsRanksOutInTurn) {
  EXPECT_EQ(device_for(0, 4, 2, true), 0);
  EXPECT_EQ(device_for(1, 4, 2, true), 1);
  EXPECT_EQ(device_for(2, 4, 2, true), 0);
  EXPECT_EQ(device_for(3, 4, 2, true), 1);
}

TEST(Placement, TooFewDevicesOrNoneIsAnErrorNamingTheCounts) {
  try {
    (void)device_for(0, 4, 2, false);
    ADD_FAILURE() << "4 ranks placed on 2 GPUs without sharing";
  } catch (const Error& e) {
    test::expect_mentions(e.what(), {"4 ranks on this node", "2 GPU(s)", "--share-devices"});
  }
  try {
    (void)device_for(0, 1, 0, true);
    ADD_FAILURE() << "a rank placed on a node without GPUs";
  } catch (const Error& e) {
    test::expect_mentions(e.what(), {"no usable GPU", "--device cpu"});
  }
}

TEST(Placement, DefaultGridIsOneDataParallelGroupPerNode) {
  EXPECT_EQ(default_grid(4, 1, true), (GridShape{1, 4, 1}));   // one node: bands of rows
  EXPECT_EQ(default_grid(8, 2, true), (GridShape{2, 4, 1}));   // a group's halos stay on its node
  EXPECT_EQ(default_grid(6, 6, true), (GridShape{6, 1, 1}));   // one rank per node: data parallel
  EXPECT_EQ(default_grid(8, 2, false), (GridShape{1, 8, 1}));  // uneven or interleaved nodes
  EXPECT_EQ(default_grid(7, 2, true), (GridShape{1, 7, 1}));
  EXPECT_EQ(default_grid(1, 1, true), (GridShape{1, 1, 1}));
}

}  // namespace
}  // namespace tessera
