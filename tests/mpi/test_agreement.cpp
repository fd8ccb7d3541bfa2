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

TEST(AgreeOnFields, SameFieldsPass) {
  EXPECT_NO_THROW(agree_on_fields(test::world(), {{"the command", "train"}, {"--dtype", ""}}));
}

TEST(AgreeOnFields, NamesTheFieldTheRanksAndTheirValues) {
  const int rank = world_rank();
  try {
    agree_on_fields(test::world(), {{"the command", "train"},
                                    {"--dtype", rank >= 1 ? "float64" : "float32"},
                                    {"--grid", rank == 0 ? "1x1x2" : ""}});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_TRUE(e.agreed());
    const std::string what = e.what();
    const int size = test::world().size(Group::world);
    const std::string others = size == 2 ? "rank 1" : "ranks 1-" + std::to_string(size - 1);
    EXPECT_NE(what.find("ranks disagree on --dtype: rank 0 float32, " + others + " float64"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("--grid: rank 0 1x1x2, " + others + " (not given)"), std::string::npos)
        << what;
    EXPECT_EQ(what.find("the command"), std::string::npos) << what;
  }
}

// Different field lists (other commands, other builds) are refused before any value is compared.
TEST(AgreeOnFields, DifferentFieldNamesAreRefused) {
  const int rank = world_rank();
  std::vector<Field> fields{{"--dtype", "float32"}};
  if (rank == 1) fields.push_back({"--mode", "train"});
  try {
    agree_on_fields(test::world(), fields);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("rank 1 differ"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
