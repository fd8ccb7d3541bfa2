#include <gtest/gtest.h>
#include <mpi.h>

// Unit tests are single-process; some (process grid on MPI_COMM_SELF) still need MPI.
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  MPI_Finalize();
  return rc;
}
