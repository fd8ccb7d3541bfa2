// Unit tests are single-process; runtimes (a grid on MPI_COMM_SELF) still need MPI.
#include <gtest/gtest.h>
#include <mpi.h>

#include <map>
#include <memory>

#include "tessera/mpi_comm.hpp"
#include "unit_test.hpp"

namespace tessera::test {
namespace {

std::map<KernelBackend, std::unique_ptr<Runtime>>& runtimes() {
  static std::map<KernelBackend, std::unique_ptr<Runtime>> r;
  return r;
}

}  // namespace

const Runtime& single_runtime(KernelBackend kernels) {
  std::unique_ptr<Runtime>& r = runtimes()[kernels];
  if (!r) {
    RuntimeOptions options;
    options.kernels = kernels;
    r = std::make_unique<Runtime>(
        std::make_unique<MpiComm>(MPI_COMM_SELF, GridShape{1, 1, 1}, WaitSettings{}), options);
  }
  return *r;
}

std::vector<KernelBackend> built_backends() {
  if (default_kernel_backend() == KernelBackend::onednn)
    return {KernelBackend::reference, KernelBackend::onednn};
  return {KernelBackend::reference};
}

}  // namespace tessera::test

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  tessera::test::runtimes().clear();  // communicators are freed before MPI_Finalize
  MPI_Finalize();
  return rc;
}
