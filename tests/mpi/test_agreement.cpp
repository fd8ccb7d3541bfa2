#include <gtest/gtest.h>

#include "mpi_test.hpp"
#include "tessera/collectives.hpp"
#include "tessera/error.hpp"

namespace tessera {
namespace {

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

TEST(Agree, AnErrorOnOneRankIsRaisedOnEveryRankWithItsMessage) {
  const int failing = 1;
  try {
    agree(MPI_COMM_WORLD, [&] {
      if (world_rank() == failing) throw Error("bad tile on this rank");
    });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_EQ(std::string(e.what()), "rank 1: bad tile on this rank");
  }
}

TEST(Agree, TheLowestFailingRankSpeaks) {
  try {
    agree(MPI_COMM_WORLD, [&] { throw Error("failed on " + std::to_string(world_rank())); });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "failed on 0");  // rank 0's message needs no prefix
  }
}

TEST(Agree, NoErrorNoThrow) {
  EXPECT_NO_THROW(agree(MPI_COMM_WORLD, [] {}));
}

TEST(CheckSameEverywhere, NamesTheRanksThatDiffer) {
  EXPECT_NO_THROW(check_same_everywhere("model", "same text", MPI_COMM_WORLD));
  const int rank = world_rank();
  try {
    check_same_everywhere("model", rank == 1 ? "other" : "same", MPI_COMM_WORLD);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("rank(s) 1 differ"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
