// Device placement over the job (include/tessera/placement.hpp): the node-local ranks of a job on
// one host, and where no GPU is usable, one agreed error on every rank.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mpi_test.hpp"
#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera/placement.hpp"

namespace tessera {
namespace {

TEST(Placement, RanksOnOneHostAreNumberedByWorldRank) {
  const Comm& comm = test::world();
  const NodeRank r = node_rank(comm);
  // The MPI tests run on one machine.
  EXPECT_EQ(r.local_size, comm.size(Group::world));
  EXPECT_EQ(r.local_rank, comm.rank(Group::world));
  EXPECT_FALSE(r.host.empty());
}

TEST(Placement, TheReportHoldsEveryRanksLineInRankOrder) {
  const Comm& comm = test::world();
  const int rank = comm.rank(Group::world);
  Placement mine;
  // Lines of different lengths, one of them empty, with bytes above 127.
  mine.line = rank == 1 ? "" : "rank " + std::to_string(rank) + std::string(rank, '*') + "\xc3\xa9";
  const std::vector<std::string> lines = placement_report(comm, mine);
  if (rank != 0) {
    EXPECT_TRUE(lines.empty());
    return;
  }
  ASSERT_EQ(static_cast<int>(lines.size()), comm.size(Group::world));
  for (int k = 0; k < comm.size(Group::world); ++k)
    EXPECT_EQ(lines[static_cast<std::size_t>(k)],
              k == 1 ? "" : "rank " + std::to_string(k) + std::string(k, '*') + "\xc3\xa9");
}

TEST(Placement, EveryRankSeesWhatTheRanksOfItsNodeSee) {
  const Comm& comm = test::world();
  const NodeRank me = node_rank(comm);
  // Rank r sees r + 1 GPUs (none on rank 0), as CUDA_VISIBLE_DEVICES could set them.
  std::vector<std::string> mine;
  for (int d = 0; d < comm.rank(Group::world); ++d)
    mine.push_back("GPU-" + std::to_string(comm.rank(Group::world)) + "-" + std::to_string(d));
  const std::vector<std::vector<std::string>> node = node_devices(comm, me, mine);
  ASSERT_EQ(static_cast<int>(node.size()), comm.size(Group::world));  // one host
  for (std::size_t k = 0; k < node.size(); ++k) {
    ASSERT_EQ(node[k].size(), k);
    for (std::size_t d = 0; d < k; ++d)
      EXPECT_EQ(node[k][d], "GPU-" + std::to_string(k) + "-" + std::to_string(d));
  }
  // A host name no other rank reports: its node would hold one rank, not local_size of them.
  if (comm.size(Group::world) > 1) {
    NodeRank odd = me;
    if (comm.rank(Group::world) == 1) odd.host += "-renamed";
    try {
      agree(comm, [&] { (void)node_devices(comm, odd, mine); });
      ADD_FAILURE() << "ranks placed although their hosts and nodes disagree";
    } catch (const Error& e) {
      EXPECT_TRUE(e.agreed());
      EXPECT_TRUE(test::contains(e.what(), "share a host name")) << e.what();
    }
  }
}

TEST(Placement, EveryRankGetsADeviceOrTheSameError) {
  const Comm& comm = test::world();
  if (gpu_info().devices == 0) {
    try {
      (void)place_on_device(comm, true);
      ADD_FAILURE() << "placed on a GPU where none is usable";
    } catch (const Error& e) {
      EXPECT_TRUE(e.agreed());
      EXPECT_TRUE(test::contains(e.what(), "--device cuda")) << e.what();
    }
    return;
  }
  const Placement p = place_on_device(comm, true);
  EXPECT_EQ(p.device, p.node.local_rank % gpu_info().devices);
  const std::vector<std::string> lines = placement_report(comm, p);
  if (comm.rank(Group::world) == 0) {
    ASSERT_EQ(static_cast<int>(lines.size()), comm.size(Group::world));
    EXPECT_TRUE(test::contains(lines[0], "rank 0 -> ")) << lines[0];
  } else {
    EXPECT_TRUE(lines.empty());
  }
}

}  // namespace
}  // namespace tessera
