// gtest main for tests run under mpiexec: every rank runs every test; rank 0 prints the report;
// a test fails on every rank if it failed on any rank, and the exit code says so on all ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <iostream>
#include <memory>

#include "mpi_test.hpp"
#include "tessera/collectives.hpp"
#include "tessera/hdf5.hpp"
#include "tessera/wait.hpp"

namespace tessera::test {
namespace {

GridShape g_grid;
std::unique_ptr<ProcessGrid> g_world_grid;

// Prints the failures of a non-root rank, tagged with the rank (the root prints everything).
class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed())
      std::cerr << "[rank " << rank_ << "] " << (r.file_name() ? r.file_name() : "") << ":"
                << r.line_number() << ": " << r.summary() << std::endl;
  }

 private:
  int rank_;
};

// Makes a test fail on every rank when it failed on any, so rank 0's report is complete.
class CombineRanks : public testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const testing::TestInfo& info) override {
    const int mine = info.result()->Failed() ? 1 : 0;
    const int any = allreduce_max(mine, MPI_COMM_WORLD);
    if (any && !mine) ADD_FAILURE() << "failed on another rank";
  }
};

}  // namespace

GridShape test_grid() {
  return g_grid;
}
const ProcessGrid& world_grid() {
  return *g_world_grid;
}

}  // namespace tessera::test

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  tessera::h5::quiet();
  testing::InitGoogleTest(&argc, argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  tessera::test::g_grid = {1, 1, size};
  for (int k = 1; k < argc; ++k)
    if (std::strncmp(argv[k], "--grid=", 7) == 0)
      tessera::test::g_grid = tessera::parse_grid(argv[k] + 7);
  tessera::set_wait_policy(tessera::detect_wait_policy(MPI_COMM_WORLD));
  tessera::test::g_world_grid =
      std::make_unique<tessera::ProcessGrid>(MPI_COMM_WORLD, tessera::test::g_grid);

  // Combining must run before the printer reports a test, so the printer is re-appended after it.
  auto& listeners = testing::UnitTest::GetInstance()->listeners();
  testing::TestEventListener* printer = listeners.Release(listeners.default_result_printer());
  listeners.Append(new tessera::test::CombineRanks());
  if (rank != 0) {
    delete printer;
    listeners.Append(new tessera::test::RankFailurePrinter(rank));
  } else {
    listeners.Append(printer);
    std::cout << "grid " << tessera::test::g_grid.str() << " on " << size
              << " ranks, waiting: " << tessera::to_string(tessera::wait_policy()) << std::endl;
  }
  int rc = RUN_ALL_TESTS();
  rc = tessera::allreduce_max(rc, MPI_COMM_WORLD);
  tessera::test::g_world_grid.reset();
  MPI_Finalize();
  return rc;
}
