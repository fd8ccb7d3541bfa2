// Device placement over the job (include/tessera/placement.hpp): the node-local ranks of a job on
// one host, and where no GPU is usable, one agreed error on every rank.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mpi_test.hpp"
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
