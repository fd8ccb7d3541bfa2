#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>

#include "tessera/allocator.hpp"
#include "tessera/batch.hpp"
#include "tessera/drivers/plan.hpp"
#include "tessera/engine/graph.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/layers/registry.hpp"
#include "tessera/layers/window.hpp"
#include "tessera/partition.hpp"
#include "tessera/tensor.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

ModelSpec one_conv(const std::string& fields, int channels = 1) {
  return parse_model(R"({"name": "one", "input_channels": )" + std::to_string(channels) +
                     R"(, "layers": [{"name": "c", "type": "conv2d", )" + fields + "}]}");
}

PlanOptions options(GridShape grid, Shape4 input, const std::string& dtype = "float64") {
  return {.grid = grid, .input = input, .dtype = dtype};
}

void expect_spread(const Spread& s, std::int64_t min, std::int64_t max, const char* what) {
  EXPECT_EQ(s.min, min) << what;
  EXPECT_EQ(s.max, max) << what;
}

TEST(Plan, HaloWidthsOfA3x3ConvOn2x2Ranks) {
  const ModelSpec m = one_conv(R"("out_channels": 4, "kernel": 3, "padding": 1)");
  const Plan p = make_plan(m, options({1, 2, 2}, {1, 1, 16, 16}));
  ASSERT_EQ(p.layers.size(), 1u);
  const LayerPlan& c = p.layers[0];
  EXPECT_TRUE(c.halo);
  expect_spread(c.tile_rows, 8, 8, "tile rows");
  expect_spread(c.tile_cols, 8, 8, "tile cols");
  // One row / column on each interior side, none at the image border (padding is not exchanged).
  expect_spread(c.top, 0, 1, "top");
  expect_spread(c.bottom, 0, 1, "bottom");
  expect_spread(c.left, 0, 1, "left");
  expect_spread(c.right, 0, 1, "right");
  // Each rank receives 8 + 8 + 1 (corner) and sends as much; one channel, one sample, float64.
  EXPECT_EQ(c.forward_bytes, 2 * 17 * 8);
  EXPECT_EQ(c.backward_bytes, c.forward_bytes);
  EXPECT_EQ(p.step_bytes, 2 * c.forward_bytes);
}

TEST(Plan, MiddleRankHasHalosOnBothSides) {
  const ModelSpec m = one_conv(R"("out_channels": 1, "kernel": 5, "padding": 2)");
  const Plan p = make_plan(m, options({1, 3, 1}, {1, 1, 15, 4}));
  const LayerPlan& c = p.layers[0];
  expect_spread(c.top, 0, 2, "top");
  expect_spread(c.bottom, 0, 2, "bottom");
  expect_spread(c.left, 0, 0, "left");
  expect_spread(c.right, 0, 0, "right");
}

TEST(Plan, NegativeHaloWhenTheWindowSkipsOwnedRows) {
  // Kernel 1, stride 2 over 16 rows on 2 ranks: output rows [0, 4) read input rows [0, 7), and
  // [4, 8) read [8, 15): each rank owns one row at its bottom that it does not need.
  const ModelSpec m = one_conv(R"("out_channels": 1, "kernel": 1, "stride": 2)");
  const Plan p = make_plan(m, options({1, 2, 1}, {1, 1, 16, 16}));
  const LayerPlan& c = p.layers[0];
  expect_spread(c.top, 0, 0, "top");
  expect_spread(c.bottom, -1, -1, "bottom");
  EXPECT_EQ(c.forward_bytes, 0);
}

TEST(Plan, PointwiseLayersHaveNoHalo) {
  const ModelSpec m = load_model("convstack-small");
  const Plan p = make_plan(m, options({1, 2, 2}, {2, 3, 32, 32}, "float32"));
  ASSERT_EQ(p.layers.size(), m.layers.size());
  for (std::size_t k = 0; k < p.layers.size(); ++k) {
    EXPECT_EQ(p.layers[k].name, m.layers[k].name);
    EXPECT_EQ(p.layers[k].halo, m.layers[k].type == "conv2d") << p.layers[k].name;
    if (!p.layers[k].halo) {
      EXPECT_EQ(p.layers[k].forward_bytes, 0);
    }
  }
}

// The plan's byte counts and halo widths are exactly those of every rank's window_plan (the
// exchange's own plan): elements x input channels x the largest group's samples x sizeof(dtype),
// forward and backward, summed over layers per rank. Swept over grids including tiles smaller
// than the halo (peers beyond the nearest neighbour), uneven tiles and uneven sample groups.
void check_against_window_plans(const ModelSpec& m, GridShape g, Shape4 input) {
  SCOPED_TRACE("model " + m.name + ", grid " + g.str() + ", input " + input.str());
  const Plan p = make_plan(m, options(g, input, "float32"));
  const std::int64_t samples = (input.n + g.n - 1) / g.n;  // the first group's
  expect_spread(p.samples, input.n / g.n, samples, "samples");
  // The layers set up here as the model does, each asked for its own window map.
  std::vector<std::unique_ptr<Layer<double>>> layers;
  std::vector<Distribution> outs;
  const Distribution input_dist = with_aligned_split(m, {input, g, {}});
  std::vector<std::int64_t> per_rank(g.h * g.w, 0);
  ASSERT_EQ(p.layers.size(), m.layers.size());
  for (std::size_t l = 0; l < m.layers.size(); ++l) {
    layers.push_back(make_layer<double>(m.layers[l], static_cast<int>(l) + 1));
    std::vector<Distribution> ins;
    for (const std::string& name : m.layers[l].inputs) {
      std::size_t k = 0;
      while (k < l && m.layers[k].name != name)
        ++k;
      ins.push_back(k < l ? outs[k] : input_dist);
    }
    outs.push_back(layers.back()->setup(ins));
    const LayerPlan& lp = p.layers[l];
    EXPECT_EQ(lp.output, outs.back().global);
    const std::optional<WindowMap> map = layers.back()->window();
    EXPECT_EQ(lp.halo, map.has_value()) << lp.name;
    if (!map) continue;
    const Distribution& in = ins.front();
    std::int64_t layer_max = 0;
    Spread sides[4];
    for (int i = 0; i < g.h; ++i)
      for (int j = 0; j < g.w; ++j) {
        const HaloPlan hp = window_plan(in, outs.back(), *map, i, j);
        std::int64_t elements = 0;
        for (const auto& t : hp.recv)
          elements += t.box.size();
        for (const auto& t : hp.send)
          elements += t.box.size();
        const std::int64_t bytes = elements * in.global.c * samples * 4;
        layer_max = std::max(layer_max, bytes);
        per_rank[i * g.w + j] += 2 * bytes;
        // The received boxes and the kept part tile the window inside the image, so the halo
        // widths are the hull of self and received boxes around the owned tile.
        Box hull = hp.self;
        for (const auto& t : hp.recv) {
          hull.h = {std::min(hull.h.begin, t.box.h.begin), std::max(hull.h.end, t.box.h.end)};
          hull.w = {std::min(hull.w.begin, t.box.w.begin), std::max(hull.w.end, t.box.w.end)};
        }
        const std::int64_t v[4] = {hp.owned.h.begin - hull.h.begin, hull.h.end - hp.owned.h.end,
                                   hp.owned.w.begin - hull.w.begin, hull.w.end - hp.owned.w.end};
        for (int s = 0; s < 4; ++s) {
          sides[s].min = i + j == 0 ? v[s] : std::min(sides[s].min, v[s]);
          sides[s].max = i + j == 0 ? v[s] : std::max(sides[s].max, v[s]);
        }
      }
    EXPECT_EQ(lp.forward_bytes, layer_max) << lp.name;
    EXPECT_EQ(lp.backward_bytes, layer_max) << lp.name;
    expect_spread(lp.top, sides[0].min, sides[0].max, "top");
    expect_spread(lp.bottom, sides[1].min, sides[1].max, "bottom");
    expect_spread(lp.left, sides[2].min, sides[2].max, "left");
    expect_spread(lp.right, sides[3].min, sides[3].max, "right");
  }
  EXPECT_EQ(p.step_bytes, *std::max_element(per_rank.begin(), per_rank.end()));
}

TEST(Plan, BytesAndHalosAreThoseOfTheHaloPlans) {
  const ModelSpec m = parse_model(R"({"name": "three", "input_channels": 2, "layers": [
    {"name": "a", "type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 1},
    {"name": "b", "type": "conv2d", "out_channels": 2, "kernel": [4, 2], "stride": 2,
     "dilation": [1, 2], "padding": [1, 0]},
    {"name": "c", "type": "conv2d", "out_channels": 2, "kernel": 5, "dilation": 2,
     "padding": "same"}]})");
  EXPECT_EQ(make_plan(m, options({1, 1, 1}, {1, 2, 8, 8})).params,
            (3 * 2 * 9 + 3) + (2 * 3 * 4 * 2 + 2) + (2 * 2 * 25 + 2));
  for (GridShape g : {GridShape{1, 1, 2}, GridShape{2, 2, 3}, GridShape{1, 3, 2},
                      GridShape{3, 4, 4}, GridShape{1, 8, 1}, GridShape{1, 1, 7}})
    check_against_window_plans(m, g, {5, 2, 17, 15});
}

// Other window maps than a convolution's (pooling, the transposed map) and a skip connection.
TEST(Plan, BytesAndHalosOfOtherHaloLayers) {
  const ModelSpec m = parse_model(R"({"name": "unet-like", "input_channels": 1, "layers": [
    {"name": "c1", "type": "conv2d", "out_channels": 2, "kernel": 3, "padding": 1},
    {"name": "p1", "type": "maxpool2d", "kernel": 3, "stride": 2, "padding": 1},
    {"name": "t1", "type": "conv_transpose2d", "out_channels": 2, "kernel": 3, "stride": 2,
     "padding": 1, "output_padding": 1},
    {"name": "k1", "type": "concat", "inputs": ["t1", "c1"]},
    {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  for (GridShape g : {GridShape{1, 2, 2}, GridShape{2, 3, 2}, GridShape{1, 1, 8}})
    check_against_window_plans(m, g, {3, 1, 18, 16});
  // 70 and 35 rows in 35 units over 3: tiles of 24, 24, 22 and 12, 12, 11 rows.
  for (GridShape g : {GridShape{1, 3, 1}, GridShape{1, 3, 2}})
    check_against_window_plans(m, g, {3, 1, 70, 16});
}

// unet-small on grids whose rank count is no power of two: every tensor's tiles cut where the
// coarsest level's are (with_aligned_split), so pooling and upsampling need no halos, and every
// full-resolution tile starts at a multiple of 4 rows. A 4-rank grid is cut as block_range cuts.
TEST(Plan, AlignedSplitLinesUpTheResolutionsOfUnetSmall) {
  const ModelSpec m = load_model("unet-small");
  for (GridShape g : {GridShape{1, 3, 1}, GridShape{1, 1, 3}, GridShape{1, 6, 1},
                      GridShape{2, 3, 5}, GridShape{1, 4, 1}}) {
    SCOPED_TRACE(g.str());
    const Distribution in = with_aligned_split(m, {{1, 3, 2048, 2048}, g, {}});
    EXPECT_EQ(in.row_units, g.h > 1 ? 512 : 0);
    EXPECT_EQ(in.col_units, g.w > 1 ? 512 : 0);
    for (int i = 0; i < g.h; ++i)
      for (int j = 0; j < g.w; ++j) {
        const Box t = in.tile_of(i, j);
        EXPECT_EQ(t.h.begin % 4, 0);
        EXPECT_EQ(t.w.begin % 4, 0);
        if (g.h == 4) {
          EXPECT_EQ(t.h, block_range(2048, 4, i));
        }
      }
    const Plan p = make_plan(m, options(g, {g.n, 3, 2048, 2048}, "float32"));
    for (const LayerPlan& l : p.layers) {
      if (l.type != "maxpool2d" && l.type != "conv_transpose2d" && l.type != "upsample_nearest")
        continue;
      SCOPED_TRACE(l.name);
      EXPECT_EQ(l.forward_bytes, 0);
      EXPECT_EQ(l.backward_bytes, 0);
    }
  }
}

// The GPU's sum on a case small enough to count by hand: one 3x3 conv (padding 1), 1 -> 1
// channel, a 1x1x4x4 input on one rank, float64.
TEST(Plan, DeviceSumFollowsItsModel) {
  const ModelSpec m = one_conv(R"("out_channels": 1, "kernel": 3, "padding": 1)");
  const Plan p = make_plan(m, options({1, 1, 1}, {1, 1, 4, 4}));
  EXPECT_EQ(p.memory.activations, (16 + 16) * 8);  // input + output
  EXPECT_EQ(p.memory.windows, 6 * 6 * 8);          // padding materialised
  EXPECT_EQ(p.memory.gradients, (16 + 36 + 16) * 8);
  EXPECT_EQ(p.memory.params, 2 * 10 * 8);
  EXPECT_EQ(p.single.device_total(), p.memory.device_total());
}

// The host walk on the same case: parameters and their gradients 2 x 10 x 8 bytes, the input
// 16 x 8, the labels 16 x 4, the window (padding materialised) 36 x 8, the output 16 x 8, then the
// loss gradient and its copy, 16 x 8 each (the first layer computes no input gradient).
TEST(Plan, HostWalkCountsACaseByHand) {
  const ModelSpec m = one_conv(R"("out_channels": 1, "kernel": 3, "padding": 1)");
  const Plan p = make_plan(m, options({1, 1, 1}, {1, 1, 4, 4}));
  EXPECT_EQ(p.memory.step, 160 + 128 + 64 + 288 + 128 + 128 + 128);
  EXPECT_EQ(p.memory.step_at, "the loss gradient's copy");
  // Two forward passes, no labels: the first pass's output goes when it ends, its window when the
  // second pass's conv starts (before that one allocates its own).
  EXPECT_EQ(p.memory.evaluation, 160 + 128 + 288 + 128);
  EXPECT_EQ(p.memory.loss_gradient, 128);
  EXPECT_EQ(p.memory.halo, 0);
  EXPECT_EQ(p.memory.training(false), p.memory.step + kHostFixed);
  EXPECT_EQ(p.memory.total(), p.memory.step + kHostFixed);  // the step holds more
  EXPECT_EQ(p.memory.inference(), p.memory.evaluation + kHostFixed);
  EXPECT_EQ(p.single.total(), p.memory.total());
}

// The walk against the engine: each built-in model on one rank, a training step and two forward
// passes in eval mode, each from a model just made (what is allocated at first use counts), the
// host pool's
// peak of large blocks (rounded to 2 MiB, as the walk rounds them) against the walk's, which
// counts small blocks too. Never below; above by at most 10% and 8 MiB, and oneDNN's float32
// scratchpad (up to 16 MiB for Winograd, not from the pool).
template <typename T>
void expect_walk_bounds_the_engine(const std::string& model, KernelBackend kernels) {
  SCOPED_TRACE(model + ", " + to_string(kernels) + ", " + (sizeof(T) == 4 ? "float32" : "float64"));
  const Runtime& single = test::single_runtime(kernels);
  const ModelSpec spec = load_model(model);
  const Shape4 input{1, 3, 256, 256};
  PlanOptions o = options({1, 1, 1}, input, sizeof(T) == 4 ? "float32" : "float64");
  o.engine = plan_engine(single.options());
  const MemoryEstimate e = make_plan(spec, o).memory;
  const std::int64_t slack =
      (kernels == KernelBackend::onednn && sizeof(T) == 4 ? 24 : 8) * (std::int64_t{1} << 20);
  const auto expect_bounded = [slack](std::int64_t walked, std::int64_t peak, const char* what) {
    EXPECT_GE(walked, peak) << what;
    EXPECT_LE(walked, peak + peak / 10 + slack) << what;
  };
  {
    Model<T> m(spec, single, input);
    m.init_params(7);
    DistTensor<T> x(m.input_distribution());
    x.local = random_image_tile<T>(x.dist, 7);
    const Labels labels = random_label_tile(m.output_distribution(), 7);
    reset_host_memory_stats();
    forward_backward(m, x, labels);
    expect_bounded(e.step, host_memory_stats().peak_live_bytes, "training step");
  }
  Model<T> m(spec, single, input);
  m.init_params(7);
  m.state().mode = Mode::eval;
  DistTensor<T> x(m.input_distribution());
  x.local = random_image_tile<T>(x.dist, 7);
  reset_host_memory_stats();
  for (int pass = 0; pass < 2; ++pass)
    m.forward(x);
  expect_bounded(e.evaluation, host_memory_stats().peak_live_bytes, "two forward passes");
}

TEST(Plan, HostWalkBoundsTheEnginesPeak) {
  for (const char* model : {"convstack-small", "conv-bench", "convnet-small", "unet-small"}) {
    for (KernelBackend kernels : test::built_backends())
      expect_walk_bounds_the_engine<float>(model, kernels);
    expect_walk_bounds_the_engine<double>(model, KernelBackend::reference);
  }
}

TEST(Plan, ShardingShrinksThePerRankEstimate) {
  const ModelSpec m = load_model("convstack-small");
  const Plan p = make_plan(m, options({1, 4, 4}, {2, 3, 256, 256}, "float32"));
  EXPECT_LT(p.memory.total(), p.single.total());
  EXPECT_GT(p.memory.total() * 16, p.single.total());  // halos and windows cost something
  EXPECT_EQ(p.memory.params, p.single.params);         // replicated
}

// --device cuda: the CUDA kernels' masks and indices (a ReLU's byte per element, a max pool's
// 8-byte index per output) and the halo buffers come on top of the host estimate.
TEST(Plan, DeviceEstimateAddsMasksIndicesAndHaloBuffers) {
  const ModelSpec m = parse_model(R"({"name": "d", "input_channels": 1, "layers": [
      {"name": "c", "type": "conv2d", "out_channels": 2, "kernel": 3, "padding": 1},
      {"name": "r", "type": "relu"},
      {"name": "p", "type": "maxpool2d", "kernel": 2}]})");
  PlanOptions o = options({1, 1, 1}, {1, 1, 8, 8}, "float32");
  const Plan host = make_plan(m, o);
  EXPECT_EQ(host.memory.device_buffers, 2 * 64 * 1 + 2 * 16 * 8);  // one grid: no halo buffers
  o.device = true;
  const Plan one = make_plan(m, o);
  const MemoryEstimate& e = one.memory;
  EXPECT_EQ(e.device_total(),
            e.activations + e.windows + e.gradients + e.params + 2 * 64 + 2 * 16 * 8);
  o.grid = {1, 2, 1};
  const Plan two = make_plan(m, o);
  // Each rank sends and receives one row of the 1-channel input for the conv.
  EXPECT_EQ(two.memory.device_buffers, 2 * 32 + 2 * 8 * 8 + (8 + 8) * 4);
}

TEST(Plan, GridThatFitsIsTheSmallestThatFits) {
  const ModelSpec m = load_model("unet-small");
  PlanOptions o = options({1, 1, 1}, {1, 3, 512, 512}, "float32");
  o.device = true;
  const std::int64_t one = make_plan(m, o).memory.device_total();
  EXPECT_EQ(grid_that_fits(m, o, one + kDeviceReserve), (GridShape{1, 1, 1}));
  // Half the memory: more ranks, each of which fits, and no smaller grid fits.
  const std::optional<GridShape> g = grid_that_fits(m, o, one / 2 + kDeviceReserve);
  ASSERT_TRUE(g);
  PlanOptions at = o;
  at.grid = *g;
  EXPECT_LE(make_plan(m, at).memory.device_total() + kDeviceReserve, one / 2 + kDeviceReserve);
  EXPECT_GT(g->h * g->w, 1);
  // No grid of fewer spatial ranks fits.
  for (int h = 1; h <= g->h * g->w; ++h)
    for (int w = 1; h * w < g->h * g->w; ++w) {
      at.grid = {1, h, w};
      EXPECT_GT(make_plan(m, at).memory.device_total(), one / 2) << h << "x" << w;
    }
  EXPECT_FALSE(grid_that_fits(m, o, kDeviceReserve));  // nothing is left for the parameters
}

// The host's: the fewest spatial ranks whose walked estimate fits; nothing when even the grid of
// the most ranks the model plans on does not.
TEST(Plan, HostGridThatFitsIsTheSmallestThatFits) {
  const ModelSpec m = load_model("unet-small");
  const PlanOptions o = options({1, 1, 1}, {1, 3, 4096, 4096}, "float32");
  const auto total = [](const Plan& p) { return p.memory.total(); };
  const std::int64_t one = make_plan(m, o).memory.total();
  EXPECT_EQ(host_grid_that_fits(m, o, one, total), (GridShape{1, 1, 1}));
  const std::int64_t budget = one / 5;
  const std::optional<GridShape> g = host_grid_that_fits(m, o, budget, total);
  ASSERT_TRUE(g);
  PlanOptions at = o;
  at.grid = *g;
  EXPECT_LE(make_plan(m, at).memory.total(), budget);
  EXPECT_GE(g->h * g->w, 5);
  for (int h = 1; h <= g->h * g->w; ++h)
    for (int w = 1; h * w < g->h * g->w; ++w) {
      at.grid = {1, h, w};
      EXPECT_GT(make_plan(m, at).memory.total(), budget) << h << "x" << w;
    }
  // Parameters fit, the fixed part alone does not: no grid, found at once.
  EXPECT_FALSE(host_grid_that_fits(m, o, kHostFixed, total));
}

TEST(Plan, PlansA1024RankGrid) {
  const ModelSpec m = load_model("convstack-small");
  const Plan p = make_plan(m, options({1, 32, 32}, {1, 3, 4096, 4096}, "float32"));
  ASSERT_EQ(p.layers.size(), m.layers.size());
  expect_spread(p.layers[0].tile_rows, 128, 128, "c1 rows");
  expect_spread(p.layers[0].top, 0, 1, "c1 top");
  expect_spread(p.layers.back().tile_cols, 64, 64, "head cols");
  EXPECT_GT(p.step_bytes, 0);
}

TEST(Plan, ImpossibleGridIsRefusedWithAWorkingSuggestion) {
  // convstack-small halves 16 rows to 8 at c2: 16 rows of ranks leave some without rows there.
  const ModelSpec m = load_model("convstack-small");
  const PlanOptions bad = options({2, 16, 3}, {2, 3, 16, 16}, "float32");
  try {
    make_plan(m, bad);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'c2'"), std::string::npos) << what;
    EXPECT_NE(what.find("no rows"), std::string::npos) << what;
  }
  const std::optional<GridShape> better = suggest_grid(m, bad);
  ASSERT_TRUE(better.has_value());
  EXPECT_EQ(*better, (GridShape{2, 8, 3}));
  PlanOptions ok = bad;
  ok.grid = *better;
  EXPECT_NO_THROW(make_plan(m, ok));
  ok.grid.h = 9;  // the suggestion is the largest
  EXPECT_THROW(make_plan(m, ok), Error);
}

TEST(Plan, SuggestionShrinksBothAxes) {
  const ModelSpec m = load_model("convstack-small");
  const std::optional<GridShape> better = suggest_grid(m, options({1, 12, 40}, {1, 3, 20, 9}));
  ASSERT_TRUE(better.has_value());
  EXPECT_EQ(*better, (GridShape{1, 10, 4}));  // c2's output is 10x4
}

TEST(Plan, NoSuggestionWhenTheGridIsNotTheProblem) {
  const ModelSpec m = load_model("convstack-small");
  const PlanOptions wrong_channels = options({1, 2, 2}, {1, 4, 64, 64});
  EXPECT_THROW(make_plan(m, wrong_channels), Error);
  EXPECT_FALSE(suggest_grid(m, wrong_channels).has_value());
  const PlanOptions small_batch = options({4, 1, 1}, {2, 3, 64, 64});
  EXPECT_THROW(make_plan(m, small_batch), Error);
  EXPECT_FALSE(suggest_grid(m, small_batch).has_value());
}

TEST(Plan, PrintsEveryLayerWithin100Columns) {
  const ModelSpec m = load_model("convstack-small");
  const Plan p = make_plan(m, options({1, 2, 3}, {2, 3, 1024, 1024}, "float32"));
  std::ostringstream out;
  print_plan(p, out);
  const std::string text = out.str();
  EXPECT_NE(text.find("grid 1x2x3 (6 ranks)"), std::string::npos) << text;
  for (const LayerSpec& l : m.layers)
    EXPECT_NE(text.find("  " + l.name + " "), std::string::npos);
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    EXPECT_LE(line.size(), 100u) << line;
}

// Sizes past 64 bits saturate ("more than 8 EiB") instead of wrapping to negative counts, and the
// parameters are counted without being allocated (2^40 output channels plan in no time).
TEST(Plan, SizesPast64BitsSaturateAndParametersAreOnlyCounted) {
  const ModelSpec m = load_model("unet-small");
  const Plan p = make_plan(m, options({1, 2, 2}, {1, 3, 1000000000, 1000000000}, "float32"));
  EXPECT_EQ(p.memory.total(), kSizeMax);
  EXPECT_EQ(p.single.total(), kSizeMax);
  EXPECT_EQ(human_bytes(p.memory.total()), "more than 8 EiB");
  for (const LayerPlan& l : p.layers) {
    EXPECT_GE(l.forward_bytes, 0) << l.name;
    EXPECT_GE(l.backward_bytes, 0) << l.name;
  }
  std::ostringstream out;
  print_plan(p, out);
  EXPECT_FALSE(std::regex_search(out.str(), std::regex(R"(-\d)"))) << out.str();  // no negative
  const ModelSpec wide = one_conv(R"("out_channels": 1099511627776, "kernel": 3)", 3);
  const Plan w = make_plan(wide, options({1, 1, 1}, {1, 3, 8, 8}, "float32"));
  EXPECT_EQ(w.params, (std::int64_t{1} << 40) * (3 * 9 + 1));
  EXPECT_EQ(w.memory.params, 2 * w.params * 4);
}

TEST(Plan, ATensorWhoseBytesPass64BitsIsRefusedBeforeAllocating) {
  EXPECT_THROW(Tensor<float>(Shape4{std::int64_t{1} << 31, std::int64_t{1} << 31, 2, 1}), Error);
  EXPECT_THROW(Tensor<double>(Shape4{std::int64_t{1} << 62, 1, 1, 1}), Error);
}

}  // namespace
}  // namespace tessera
