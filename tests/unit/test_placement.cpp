// One GPU per node-local rank (include/tessera/placement.hpp): the choice, and its refusals.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/error.hpp"
#include "tessera/placement.hpp"

namespace tessera {
namespace {

// What `ranks` ranks see when each sees all of the node's `gpus` GPUs.
std::vector<std::vector<std::string>> all_see(int ranks, int gpus) {
  std::vector<std::string> ids;
  for (int d = 0; d < gpus; ++d)
    ids.push_back("GPU-" + std::to_string(d));
  return std::vector<std::vector<std::string>>(static_cast<std::size_t>(ranks), ids);
}

TEST(Placement, EachRankOfANodeTakesItsOwnDevice) {
  const DeviceAssignment four = assign_devices(all_see(4, 4), false);
  EXPECT_EQ(four.device, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_FALSE(four.shared);
  EXPECT_EQ(assign_devices(all_see(2, 8), false).device, (std::vector<int>{0, 1}));
}

TEST(Placement, RanksThatSeeOneGpuEachTakeIt) {
  // srun --gpus-per-task=1: every rank's only device is its index 0, a different GPU in each.
  const DeviceAssignment a = assign_devices({{"GPU-a"}, {"GPU-b"}, {"GPU-c"}}, false);
  EXPECT_EQ(a.device, (std::vector<int>{0, 0, 0}));
  EXPECT_FALSE(a.shared);
  // CUDA_VISIBLE_DEVICES=0,1 on rank 0 and 1,0 on rank 1: two GPUs, each rank on its own.
  EXPECT_EQ(assign_devices({{"GPU-a", "GPU-b"}, {"GPU-b", "GPU-a"}}, false).device,
            (std::vector<int>{0, 0}));
  // A mix: rank 0 sees both, rank 1 only the one rank 0 would not take.
  EXPECT_EQ(assign_devices({{"GPU-a", "GPU-b"}, {"GPU-b"}}, false).device,
            (std::vector<int>{0, 0}));
  // Rank 1 sees only the GPU rank 0 would take first: rank 0 moves to its other one.
  const DeviceAssignment moved = assign_devices({{"GPU-a", "GPU-b"}, {"GPU-a"}}, false);
  EXPECT_EQ(moved.device, (std::vector<int>{1, 0}));
  EXPECT_FALSE(moved.shared);
  // A longer path: rank 2 takes c from rank 1, which takes b from rank 0, which takes a.
  EXPECT_EQ(assign_devices({{"GPU-b", "GPU-a"}, {"GPU-c", "GPU-b"}, {"GPU-c"}}, false).device,
            (std::vector<int>{1, 1, 0}));
}

TEST(Placement, SharingDealsRanksOutInTurn) {
  const DeviceAssignment a = assign_devices(all_see(4, 2), true);
  EXPECT_EQ(a.device, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_TRUE(a.shared);
  EXPECT_EQ(assign_devices(all_see(5, 2), true).device, (std::vector<int>{0, 1, 0, 1, 0}));
  // Sharing only those that cannot have their own: rank 2 shares, the others keep theirs.
  const DeviceAssignment some = assign_devices({{"GPU-a"}, {"GPU-b"}, {"GPU-a", "GPU-b"}}, true);
  EXPECT_EQ(some.device, (std::vector<int>{0, 0, 0}));
  EXPECT_TRUE(some.shared);
  // Two ranks bound to one GPU may share it when asked.
  const DeviceAssignment b = assign_devices({{"GPU-a"}, {"GPU-a"}, {"GPU-b"}}, true);
  EXPECT_EQ(b.device, (std::vector<int>{0, 0, 0}));
  EXPECT_TRUE(b.shared);
}

TEST(Placement, TooFewDevicesOrNoneIsAnErrorNamingTheCounts) {
  try {
    (void)assign_devices(all_see(4, 2), false);
    ADD_FAILURE() << "4 ranks placed on 2 GPUs without sharing";
  } catch (const Error& e) {
    test::expect_mentions(e.what(), {"4 ranks on this node", "2 GPU(s)", "--share-devices"});
  }
  try {
    (void)assign_devices({{"GPU-a"}, {"GPU-a"}, {"GPU-b", "GPU-c"}}, false);
    ADD_FAILURE() << "two ranks bound to one GPU placed there without sharing";
  } catch (const Error& e) {
    test::expect_mentions(e.what(), {"node-local rank 1", "GPU-a", "CUDA_VISIBLE_DEVICES", "3 GPUs",
                                     "3 ranks", "--share-devices"});
  }
  try {
    (void)assign_devices({{"GPU-a"}, {}}, true);
    ADD_FAILURE() << "a rank placed on a node without GPUs";
  } catch (const Error& e) {
    test::expect_mentions(e.what(), {"no usable GPU", "rank 1 of 2", "--device cpu"});
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
