// The MPI implementation of Comm on the test grid: groups follow the coordinates, a wrong grid
// is one agreed error, an MPI failure is a Tessera Error, and a wait that outlives its deadline
// ends with a message naming the operation, the step and the peer it waited for.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mpi_test.hpp"
#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/mpi_comm.hpp"

namespace tessera {
namespace {

TEST(MpiComm, AWrongGridIsAnAgreedErrorOnEveryRank) {
  GridShape g = test::test_grid();
  g.w += 1;
  try {
    test::world().make_grid(g, test::world().wait_settings());
    ADD_FAILURE() << "accepted a grid of the wrong size";
  } catch (const Error& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_TRUE(test::contains(e.what(), "mpiexec -n")) << e.what();
  }
}

TEST(MpiComm, GroupsFollowTheCoordinates) {
  const Comm& comm = test::world();
  const GridCoords c = comm.coords();
  const GridShape g = comm.shape();
  EXPECT_EQ(comm.rank(Group::world), comm.rank());
  EXPECT_EQ(comm.rank(Group::spatial), comm.spatial_rank(c.i, c.j));
  EXPECT_EQ(comm.rank(Group::sample), c.n);
  EXPECT_EQ(comm.size(Group::world), g.size());
  EXPECT_EQ(comm.size(Group::spatial), g.h * g.w);
  EXPECT_EQ(comm.size(Group::sample), g.n);
  const GridCoords back = comm.coords_of(comm.rank());
  EXPECT_TRUE(back.n == c.n && back.i == c.i && back.j == c.j);
  for (Group group : {Group::world, Group::spatial, Group::sample}) {
    SCOPED_TRACE(to_string(group));
    int mpi_rank = -1;
    MPI_Comm_rank(mpi_comm(comm, group), &mpi_rank);
    EXPECT_EQ(mpi_rank, comm.rank(group));
    // Every rank of the group names its world rank: world_rank() must agree with each.
    std::vector<long long> all(static_cast<std::size_t>(comm.size(group)));
    Request r = comm.start_allgather(comm.rank(), all, group, "world ranks");
    comm.wait(r);
    for (int k = 0; k < comm.size(group); ++k)
      EXPECT_EQ(comm.world_rank(group, k), all[static_cast<std::size_t>(k)]) << "rank " << k;
  }
}

TEST(MpiComm, AnMpiFailureIsATesseraError) {
  const Comm& comm = test::world();
  std::vector<double> buffer(4);
  const Message<double> bad[] = {{comm.size(Group::world) + 3, buffer.data(), 4}};
  try {
    Request r = comm.start_exchange(Group::world, 5, bad, {}, "a receive from no rank");
    ADD_FAILURE() << "MPI accepted a receive from rank " << bad[0].peer;
  } catch (const Error& e) {
    EXPECT_FALSE(e.agreed());  // one rank's failure: main ends the job
    EXPECT_TRUE(test::contains(e.what(), "MPI_Irecv")) << e.what();
  }
}

// Rank 0 waits for a message rank 1 never sends; every other rank waits in the next collective
// and so answers the watchdog. Rank 0's wait ends after its deadline with the message.
TEST(MpiComm, AWaitPastItsDeadlineNamesTheOperationTheStepAndThePeer) {
  const Comm& world = test::world();
  if (world.size(Group::world) < 2) GTEST_SKIP() << "needs two ranks";
  const double timeout = 0.4;
  const std::unique_ptr<Comm> comm =
      world.make_grid(world.shape(), {world.wait_settings().policy, timeout});
  if (comm->rank() == 0) {
    comm->set_step(17);
    // Static: the abandoned receive still owns it when rank 1 sends below.
    static std::vector<float> buffer(8);
    const Message<float> from_1[] = {{1, buffer.data(), 8}};
    const auto start = std::chrono::steady_clock::now();
    try {
      Request r = comm->start_exchange(Group::world, 9, from_1, {}, "halo fill of layer 'c3'");
      comm->wait(r);
      ADD_FAILURE() << "a message that was never sent arrived";
    } catch (const Error& e) {
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_GE(waited, timeout);
      EXPECT_LT(waited, timeout + 5);
      EXPECT_FALSE(e.agreed());
      EXPECT_TRUE(e.fatal());
      for (const char* part : {"timeout: rank 0 waited", "halo fill of layer 'c3'", "at step 17",
                               "no message yet from rank(s) 1",
                               "every other rank answered the watchdog", "--timeout 0.4 s"})
        EXPECT_TRUE(test::contains(e.what(), part)) << part << " not in: " << e.what();
    }
  }
  // The others wait here for rank 0, answering its watchdog meanwhile (the grids share it).
  EXPECT_EQ(allreduce_max(world, comm->rank()), world.size(Group::world) - 1);
  // The late message completes the abandoned receive, so MPI ends with nothing pending.
  if (comm->rank() == 1) {
    const std::vector<float> late(8, 1.0f);
    const Message<const float> to_0[] = {{0, late.data(), 8}};
    Request r = comm->start_exchange(Group::world, 9, {}, to_0, "the late message");
    comm->wait(r);
  }
  allreduce_max(world, 0);
}

// A deadline long enough for a slow peer is no error.
TEST(MpiComm, ASlowPeerWithinTheDeadlineIsNoError) {
  const Comm& world = test::world();
  if (world.size(Group::world) < 2) GTEST_SKIP() << "needs two ranks";
  const std::unique_ptr<Comm> comm =
      world.make_grid(world.shape(), {world.wait_settings().policy, 30});
  std::vector<double> value{double(comm->rank())};
  if (comm->rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  Request r = comm->start_allreduce(value, ReduceOp::sum, Group::world, "a sum");
  EXPECT_NO_THROW(comm->wait(r));
  const int p = world.size(Group::world);
  EXPECT_EQ(value[0], double(p * (p - 1) / 2));
}

TEST(Comm, TimeoutsAreSecondsAboveZero) {
  EXPECT_EQ(check_timeout(2.5), 2.5);
  for (double bad : {0.0, -1.0, std::nan(""), kNoTimeout, 1e10})
    EXPECT_THROW(check_timeout(bad), Error) << bad;
}

}  // namespace
}  // namespace tessera
