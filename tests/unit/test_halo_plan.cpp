#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "tessera/halo_plan.hpp"
#include "tessera/partition.hpp"

namespace tessera {
namespace {

struct Case {
  std::int64_t H, W;
  int ph, pw;
  WindowAxis ah, aw;
};

// For every rank: self + received boxes cover (window ∩ image) exactly once, every received
// box is what its peer sends, and nothing else is sent.
void check_plans(const Case& c) {
  const std::int64_t oh = window_output_extent(c.H, c.ah), ow = window_output_extent(c.W, c.aw);
  if (oh < c.ph || ow < c.pw || c.H < c.ph || c.W < c.pw) return;  // impossible grids
  std::vector<Box> owned, windows;
  for (int i = 0; i < c.ph; ++i)
    for (int j = 0; j < c.pw; ++j) {
      owned.push_back({block_range(c.H, c.ph, i), block_range(c.W, c.pw, j)});
      windows.push_back({input_window(block_range(oh, c.ph, i), c.ah),
                         input_window(block_range(ow, c.pw, j), c.aw)});
    }
  const int ranks = c.ph * c.pw;
  std::vector<HaloPlan> plans;
  for (int r = 0; r < ranks; ++r)
    plans.push_back(make_halo_plan(owned, windows, r));
  const Box image{{0, c.H}, {0, c.W}};
  for (int r = 0; r < ranks; ++r) {
    const HaloPlan& p = plans[r];
    const Box need = intersect(p.window, image);
    std::map<std::pair<std::int64_t, std::int64_t>, int> hits;
    auto mark = [&](const Box& b) {
      for (std::int64_t y = b.h.begin; y < b.h.end; ++y)
        for (std::int64_t x = b.w.begin; x < b.w.end; ++x)
          ++hits[{y, x}];
    };
    mark(p.self);
    for (const auto& t : p.recv) {
      EXPECT_NE(t.peer, r);
      mark(t.box);
      // The peer sends exactly this box to me.
      const auto& sends = plans[t.peer].send;
      auto it = std::find_if(sends.begin(), sends.end(), [&](auto& s) { return s.peer == r; });
      ASSERT_NE(it, sends.end());
      EXPECT_EQ(it->box, t.box);
    }
    EXPECT_EQ(static_cast<std::int64_t>(hits.size()), need.size());
    for (const auto& [at, n] : hits) {
      EXPECT_EQ(n, 1) << "element covered twice";
      EXPECT_TRUE(need.h.contains(at.first) && need.w.contains(at.second));
    }
    for (const auto& s : p.send) {
      const auto& recvs = plans[s.peer].recv;
      EXPECT_TRUE(std::any_of(recvs.begin(), recvs.end(),
                              [&](auto& t) { return t.peer == r && t.box == s.box; }));
    }
  }
}

TEST(HaloPlan, WindowsAreTiledExactlyByOwnedBoxes1D) {
  for (std::int64_t E = 1; E <= 24; ++E)
    for (int parts = 1; parts <= 5; ++parts)
      for (std::int64_t k = 1; k <= 5; ++k)
        for (std::int64_t s = 1; s <= 3; ++s)
          for (std::int64_t d = 1; d <= 2; ++d)
            for (std::int64_t p = 0; p <= 3; ++p) {
              const WindowAxis a{
                  .kernel = k, .stride = s, .pad_begin = p, .pad_end = p, .dilation = d};
              check_plans({E, 1, parts, 1, a, WindowAxis{}});
            }
}

TEST(HaloPlan, TwoDimensionalGridsGetCornersFromDiagonalPeers) {
  for (std::int64_t H : {5, 9, 13})
    for (std::int64_t W : {4, 7, 12})
      for (int ph = 1; ph <= 3; ++ph)
        for (int pw = 1; pw <= 3; ++pw)
          for (std::int64_t k = 1; k <= 5; k += 2)
            for (std::int64_t s = 1; s <= 2; ++s)
              for (std::int64_t d = 1; d <= 2; ++d) {
                const WindowAxis a{
                    .kernel = k, .stride = s, .pad_begin = k / 2, .pad_end = k / 2, .dilation = d};
                check_plans({H, W, ph, pw, a, a});
              }
  // A 3x3 kernel on a 2x2 grid: rank 0 needs one element of rank 3 (the corner).
  const WindowAxis a{.kernel = 3, .pad_begin = 1, .pad_end = 1};
  std::vector<Box> owned, windows;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      owned.push_back({block_range(8, 2, i), block_range(8, 2, j)});
      windows.push_back(
          {input_window(block_range(8, 2, i), a), input_window(block_range(8, 2, j), a)});
    }
  const HaloPlan p = make_halo_plan(owned, windows, 0);
  ASSERT_EQ(p.recv.size(), 3u);
  EXPECT_EQ(p.recv[2].peer, 3);
  EXPECT_EQ(p.recv[2].box, (Box{{4, 5}, {4, 5}}));
}

TEST(HaloPlan, HalosReachPastTheNearestNeighbourOnSmallTiles) {
  // 10 columns over 5 ranks (2 each), kernel 7 dilation 2: a halo of 6 on each side.
  const WindowAxis a{.kernel = 7, .pad_begin = 6, .pad_end = 6, .dilation = 2};
  std::vector<Box> owned, windows;
  for (int j = 0; j < 5; ++j) {
    owned.push_back({{0, 1}, block_range(10, 5, j)});
    windows.push_back({{0, 1}, input_window(block_range(10, 5, j), a)});
  }
  const HaloPlan p = make_halo_plan(owned, windows, 2);
  EXPECT_EQ(p.recv.size(), 4u);  // every other rank
  check_plans({1, 10, 1, 5, WindowAxis{}, a});
}

TEST(HaloPlan, NegativeHalosSendNothingFromUnneededRows) {
  // Stride 3, kernel 1: outputs read rows 0, 3, 6, ...; rank 1 owns rows it does not need.
  const WindowAxis a{.kernel = 1, .stride = 3};
  const std::int64_t out = window_output_extent(12, a);  // 4
  std::vector<Box> owned, windows;
  for (int i = 0; i < 2; ++i) {
    owned.push_back({block_range(12, 2, i), {0, 1}});
    windows.push_back({input_window(block_range(out, 2, i), a), {0, 1}});
  }
  // Rank 1 owns [6, 12) and needs rows 6..9: window [6, 10), so rows 10, 11 are a negative halo.
  const HaloPlan p = make_halo_plan(owned, windows, 1);
  EXPECT_EQ(p.window.h, (Range{6, 10}));
  EXPECT_TRUE(p.recv.empty());
  EXPECT_TRUE(p.send.empty());
}

}  // namespace
}  // namespace tessera
