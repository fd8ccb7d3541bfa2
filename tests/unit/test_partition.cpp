#include <gtest/gtest.h>

#include <vector>

#include "tessera/error.hpp"
#include "tessera/partition.hpp"
#include "tessera/process_grid.hpp"

namespace tessera {
namespace {

TEST(BlockPartition, TilesEveryExtentInOrderWithSizesDifferingByAtMostOne) {
  for (std::int64_t extent = 0; extent <= 40; ++extent)
    for (int parts = 1; parts <= 7; ++parts) {
      std::int64_t next = 0;
      for (int i = 0; i < parts; ++i) {
        const Range r = block_range(extent, parts, i);
        EXPECT_EQ(r.begin, next) << extent << "/" << parts << " part " << i;
        const std::int64_t expect = extent / parts + (i < extent % parts ? 1 : 0);
        EXPECT_EQ(r.size(), expect) << extent << "/" << parts << " part " << i;
        for (std::int64_t k = r.begin; k < r.end; ++k)
          EXPECT_EQ(block_owner(extent, parts, k), i);
        next = r.end;
      }
      EXPECT_EQ(next, extent);
    }
}

TEST(BlockPartition, MatchesTheDesignFormula) {
  // 17 over 3: q = 5, r = 2 -> [0,6) [6,12) [12,17)
  EXPECT_EQ(block_range(17, 3, 0), (Range{0, 6}));
  EXPECT_EQ(block_range(17, 3, 1), (Range{6, 12}));
  EXPECT_EQ(block_range(17, 3, 2), (Range{12, 17}));
}

// Split in units: in order, covering the extent, each part whole units (ceil or floor of
// units / parts), the owner of every element the part that holds it; block_range where the units
// do not divide the extent.
TEST(SplitRange, CutsWholeUnitsInOrderAndOwnsEveryElement) {
  for (std::int64_t units = 0; units <= 12; ++units)
    for (std::int64_t length = 1; length <= 4; ++length)
      for (std::int64_t extent : {units * length, units * length + 1})
        for (int parts = 1; parts <= 5; ++parts) {
          if (extent < parts) continue;
          const bool whole = units > 0 && extent % units == 0;
          std::int64_t next = 0;
          for (int i = 0; i < parts; ++i) {
            const Range r = split_range(extent, units, parts, i);
            SCOPED_TRACE(std::to_string(extent) + " in " + std::to_string(units) + " units over " +
                         std::to_string(parts) + ", part " + std::to_string(i));
            EXPECT_EQ(r.begin, next);
            if (whole) {
              const std::int64_t unit = extent / units;
              EXPECT_EQ(r.size(), (units / parts + (i < units % parts ? 1 : 0)) * unit);
            } else {
              EXPECT_EQ(r, block_range(extent, parts, i));
            }
            for (std::int64_t k = r.begin; k < r.end; ++k)
              EXPECT_EQ(split_owner(extent, units, parts, k), i);
            next = r.end;
          }
          EXPECT_EQ(next, extent);
        }
}

TEST(SplitRange, LinesUpTheResolutionsOfAModel) {
  // unet-small at 2048 rows over 3 ranks: 512 units of 4, 2 and 1 rows.
  EXPECT_EQ(split_range(2048, 512, 3, 1), (Range{684, 1368}));
  EXPECT_EQ(split_range(1024, 512, 3, 1), (Range{342, 684}));
  EXPECT_EQ(split_range(512, 512, 3, 1), (Range{171, 342}));
  EXPECT_EQ(split_range(2048, 512, 3, 2), (Range{1368, 2048}));
  // block_range cuts 2048 at 683 and 1366, 1024 at 342 and 683: an odd row and pooling halos.
  EXPECT_EQ(block_range(2048, 3, 1), (Range{683, 1366}));
}

TEST(AlignedUnits, TheCommonDivisorWhereItCostsLittleBalance) {
  EXPECT_EQ(aligned_units({2048, 1024, 512}, 3), 512);
  EXPECT_EQ(aligned_units({2048, 1024, 512}, 7), 512);  // 296 rows against 293: 1.0%
  EXPECT_EQ(aligned_units({70, 35}, 3), 35);            // 24, 24, 22 against 24, 23, 23
  // A deeper net: down to 128 rows (64 would cost 3.1%: 704 rows against 683); the 64-row level
  // is then split on its own (split_range falls back where the units do not divide).
  EXPECT_EQ(aligned_units({2048, 1024, 512, 256, 128, 64, 128, 2048}, 3), 128);
  EXPECT_EQ(split_range(64, 128, 3, 1), block_range(64, 3, 1));
  EXPECT_EQ(aligned_units({160, 80, 40, 20}, 3), 80);  // 40 in 40 units would cost 3.7%
  // Splits that divide the units are block_range's anyway.
  EXPECT_EQ(aligned_units({2048, 1024, 512}, 2), 512);
  for (int i = 0; i < 2; ++i)
    EXPECT_EQ(split_range(2048, 512, 2, i), block_range(2048, 2, i));
  // 64, 32, 16 over 3: 32 units (22, 22, 20 rows, as even at most), not 16 (24, 20, 20: 9%).
  EXPECT_EQ(aligned_units({64, 32, 16}, 3), 32);
  EXPECT_EQ(aligned_units({20, 10}, 3), 0);      // 10 units: 8 rows against 7
  EXPECT_EQ(aligned_units({2048}, 3), 0);        // one extent: nothing to line up
  EXPECT_EQ(aligned_units({2048, 2046}, 3), 0);  // a valid conv: units of 2 rows, fewer than 3
  EXPECT_EQ(aligned_units({17, 9}, 2), 0);       // a stride-2 layer of an odd extent
  EXPECT_EQ(aligned_units({2048, 1024}, 1), 0);  // one part
  EXPECT_EQ(aligned_units({}, 3), 0);
  EXPECT_EQ(aligned_units({2048, 0}, 3), 0);
}

// The window must be exactly the hull of the input rows the outputs read.
TEST(InputWindow, IsTheHullOfEveryTapOfEveryOutputRow) {
  for (std::int64_t extent = 1; extent <= 24; ++extent)
    for (std::int64_t k = 1; k <= 5; ++k)
      for (std::int64_t s = 1; s <= 3; ++s)
        for (std::int64_t d = 1; d <= 2; ++d)
          for (std::int64_t p = 0; p <= 3; ++p)
            for (std::int64_t pe = 0; pe <= 3; pe += 3) {
              const WindowAxis a{
                  .kernel = k, .stride = s, .pad_begin = p, .pad_end = pe, .dilation = d};
              const std::int64_t out = window_output_extent(extent, a);
              // Brute force: the outputs are those whose taps all fit in the padded input.
              std::int64_t brute = 0;
              while (brute * s + d * (k - 1) < extent + p + pe)
                ++brute;
              ASSERT_EQ(out, brute) << extent << " k" << k << " s" << s << " d" << d << " p" << p;
              for (int parts = 1; parts <= 5 && parts <= out; ++parts)
                for (int i = 0; i < parts; ++i) {
                  const Range o = block_range(out, parts, i);
                  std::int64_t lo = INT64_MAX, hi = INT64_MIN;
                  for (std::int64_t q = o.begin; q < o.end; ++q)
                    for (std::int64_t t = 0; t < k; ++t) {
                      lo = std::min(lo, q * s - p + t * d);
                      hi = std::max(hi, q * s - p + t * d);
                    }
                  EXPECT_EQ(input_window(o, a), (Range{lo, hi + 1}));
                }
            }
}

TEST(InputWindow, EmptyOutputsNeedNothing) {
  EXPECT_TRUE(input_window({3, 3}, WindowAxis{.kernel = 3}).empty());
}

// The message of an image too small for the grid names the largest grid that fits and, where
// one fits, a split of the same ranks (the default grid cuts rows: a low, wide image needs
// columns).
TEST(CheckSplittable, NamesTheSameRanksSplitThatFits) {
  EXPECT_NO_THROW(check_splittable("the image", 4, 4, 4, 1));
  const auto message = [](std::int64_t h, std::int64_t w, int gh, int gw) {
    try {
      check_splittable("the image", h, w, gh, gw);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(1, 32, 2, 1),
            "the image cannot be split over 2x1 spatial ranks: a tile would have no rows (use a "
            "spatial grid of at most 1x1; 1x2 takes the same 2 ranks)");
  // The most rows that fit: 2x3, not 1x6.
  EXPECT_NE(message(2, 64, 6, 1).find("at most 2x1; 2x3 takes the same 6 ranks)"),
            std::string::npos);
  // None fits: the largest grid alone.
  EXPECT_NE(message(2, 2, 5, 1).find("no rows (use a spatial grid of at most 2x1)"),
            std::string::npos);
  EXPECT_NE(message(3, 1, 2, 2).find("no columns (use a spatial grid of at most 2x1)"),
            std::string::npos)
      << message(3, 1, 2, 2);
}

TEST(ParseGrid, AcceptsNxHxW) {
  EXPECT_EQ(parse_grid("1x2x3"), (GridShape{1, 2, 3}));
  EXPECT_EQ(parse_grid("2X1x2"), (GridShape{2, 1, 2}));
}

TEST(ParseGrid, RejectsEverythingElseWithTheNotation) {
  for (const char* bad :
       {"", "2x2", "1x2x3x4", "0x1x1", "1x-1x2", "axbxc", "1x2x", "1 x2x2", "1x2x2 "}) {
    try {
      parse_grid(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("NxHxW"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace tessera
