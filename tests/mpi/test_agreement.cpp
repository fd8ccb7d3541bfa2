#include <gtest/gtest.h>

#include "mpi_test.hpp"
#include "tessera/collectives.hpp"
#include "tessera/error.hpp"

namespace tessera {
namespace {

int world_rank() {
  return test::world().rank();
}

TEST(Agree, AnErrorOnOneRankIsRaisedOnEveryRankWithItsMessage) {
  const int failing = 1;
  try {
    agree(test::world(), [&] {
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
    agree(test::world(), [&] { throw Error("failed on " + std::to_string(world_rank())); });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "failed on 0");  // rank 0's message needs no prefix
  }
}

TEST(Agree, NoErrorNoThrow) {
  EXPECT_NO_THROW(agree(test::world(), [] {}));
}

TEST(CheckSameEverywhere, NamesTheRanksThatDiffer) {
  EXPECT_NO_THROW(check_same_everywhere(test::world(), "model", "same text"));
  const int rank = world_rank();
  try {
    check_same_everywhere(test::world(), "model", rank == 1 ? "other" : "same");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("rank(s) 1 differ"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
