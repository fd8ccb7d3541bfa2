// gtest main for tests run under mpiexec: every rank runs every test; rank 0 prints the report;
// a test fails on every rank if it failed on any rank, and the exit code says so on all ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>

#include "mpi_test.hpp"
#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera/io/hdf5.hpp"
#include "tessera/mpi_comm.hpp"

namespace tessera::test {
namespace {

GridShape g_grid;
std::optional<Runtime> g_world, g_single;

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
    const int any = allreduce_max(world(), mine);
    if (any && !mine) ADD_FAILURE() << "failed on another rank";
  }
};

}  // namespace

GridShape test_grid() {
  return g_grid;
}
const Runtime& world_runtime() {
  return *g_world;
}
const Runtime& single_runtime() {
  return *g_single;
}
const Comm& world() {
  return g_world->comm();
}
Runtime make_test_runtime(const RuntimeOptions& options) {
  return make_runtime(world(), g_grid, options);
}

}  // namespace tessera::test

int main(int argc, char** argv) {
  using namespace tessera;
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  h5::quiet();
  testing::InitGoogleTest(&argc, argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  test::g_grid = {1, 1, size};
  for (int k = 1; k < argc; ++k)
    if (std::strncmp(argv[k], "--grid=", 7) == 0) test::g_grid = parse_grid(argv[k] + 7);
  // The runtime the tests share, from the environment as main builds it (TESSERA_KERNELS=reference
  // runs the suite on the reference kernels).
  const RuntimeOptions options = runtime_options_from_environment();
  // TESSERA_KERNELS=cuda (tests/meson.build's gpu_mpi_*): skipped, with the reason, without a GPU.
  if (options.kernels == KernelBackend::cuda && cuda_backend() == nullptr) {
    if (rank == 0) std::printf("SKIP: no usable GPU (%s)\n", gpu_info().error.c_str());
    MPI_Finalize();
    return 77;
  }
  set_kernel_threads(options.threads);
  const WaitSettings wait{options.wait.value_or(MpiComm::detect_wait_policy(MPI_COMM_WORLD)),
                          options.timeout};
  test::g_world.emplace(
      with_transport(std::make_unique<MpiComm>(MPI_COMM_WORLD, test::g_grid, wait),
                     options.transport),
      options);
  // The single-rank reference computes on the host: a device backend (TESSERA_KERNELS=emulated,
  // or cuda) is checked against the CPU's reference kernels.
  if (test::g_world->allocator().space() == MemorySpace::host) {
    test::g_single.emplace(test::g_world->single());
  } else {
    RuntimeOptions host = options;
    host.kernels = KernelBackend::reference;
    test::g_single.emplace(test::g_world->comm().make_single(), host);
  }

  // Combining must run before the printer reports a test, so the printer is re-appended after it.
  auto& listeners = testing::UnitTest::GetInstance()->listeners();
  testing::TestEventListener* printer = listeners.Release(listeners.default_result_printer());
  listeners.Append(new test::CombineRanks());
  if (rank != 0) {
    delete printer;
    listeners.Append(new test::RankFailurePrinter(rank));
  } else {
    listeners.Append(printer);
    std::cout << "grid " << test::g_grid.str() << " on " << size
              << " ranks, waiting: " << to_string(wait.policy)
              << ", kernels: " << to_string(options.kernels)
              << ", transport: " << to_string(options.transport) << std::endl;
  }
  int rc = RUN_ALL_TESTS();
  rc = allreduce_max(test::world(), rc);
  test::g_single.reset();
  test::g_world.reset();
  MPI_Finalize();
  return rc;
}
