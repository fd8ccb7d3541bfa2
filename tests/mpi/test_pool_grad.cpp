// Max and average pooling and nearest upsampling, sharded against the single-rank run: odd
// images (a 17-pixel side pooled by 2), uneven tiles after pooling, tiles that pooling shrinks to
// one row, output tiles of an upsample that read inputs their rank does not own.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "check_model.hpp"
#include "mpi_test.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/reference_pool.hpp"
#include "tessera/kernels/reference_upsample.hpp"
#include "tessera/layers/pool2d.hpp"
#include "tessera/layers/upsample.hpp"

namespace tessera {
namespace {

struct PoolCase {
  std::string type;  // maxpool2d or avgpool2d
  std::int64_t kernel, stride, padding;
  std::int64_t upsample;  // 0: none
  std::int64_t height, width;

  std::string str() const {
    std::ostringstream s;
    s << type << " kernel " << kernel << " stride " << stride << " padding " << padding;
    if (upsample > 0) s << " then upsample " << upsample;
    s << " image " << height << "x" << width;
    return s.str();
  }
  // The pooling's output rows and columns (upsampling only grows them).
  test::CheckOptions options() const {
    return {.smallest_h = test::window_rows(height, kernel, stride, 1, padding),
            .smallest_w = test::window_rows(width, kernel, stride, 1, padding)};
  }
  // conv (so that the input gradient flows through a halo layer) -> pool -> [upsample] -> 1x1
  // conv head to 3 classes.
  std::string model() const {
    std::ostringstream s;
    s << R"({"name": "case", "input_channels": 2, "layers": [)"
      << R"({"name": "c", "type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 1},)"
      << R"({"name": "p", "type": ")" << type << R"(", "kernel": )" << kernel
      << ", \"stride\": " << stride << ", \"padding\": " << padding << "},";
    if (upsample > 0)
      s << R"({"name": "u", "type": "upsample_nearest", "scale": )" << upsample << "},";
    s << R"({"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";
    return s.str();
  }
};

// Kernels 1 to 4, strides 1 to 3, every padding PyTorch allows, on 17x15 and 10x9.
std::vector<PoolCase> pool_cases() {
  std::vector<PoolCase> out;
  for (const char* type : {"maxpool2d", "avgpool2d"})
    for (auto [h, w] : {std::pair{17, 15}, std::pair{10, 9}})
      for (std::int64_t k : {1, 2, 3, 4})
        for (std::int64_t s : {1, 2, 3})
          for (std::int64_t p = 0; p <= k / 2; ++p)
            out.push_back({type, k, s, p, 0, h, w});
  return out;
}

// Pooling then upsampling by 1, 2, 3: the upsample's output tiles are cut afresh over its own
// extent, so they need not line up with its input's.
std::vector<PoolCase> pool_upsample_cases() {
  std::vector<PoolCase> out;
  for (const char* type : {"maxpool2d", "avgpool2d"})
    for (auto [h, w] : {std::pair{17, 15}, std::pair{10, 9}})
      for (auto [k, s, p] :
           {std::tuple{2, 2, 0}, std::tuple{3, 2, 1}, std::tuple{3, 3, 0}, std::tuple{1, 1, 0}})
        for (std::int64_t u : {1, 2, 3})
          out.push_back({type, k, s, p, u, h, w});
  return out;
}

TEST(PoolGrad, MatrixFloat64) {
  for (const PoolCase& c : pool_cases())
    test::check_model<double>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                              c.options());
}

TEST(PoolGrad, MatrixFloat32) {
  for (const PoolCase& c : pool_cases())
    test::check_model<float>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                             c.options());
}

TEST(PoolGrad, PoolThenUpsampleFloat64) {
  for (const PoolCase& c : pool_upsample_cases())
    test::check_model<double>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                              c.options());
}

TEST(PoolGrad, PoolThenUpsampleFloat32) {
  for (const PoolCase& c : pool_upsample_cases())
    test::check_model<float>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                             c.options());
}

// Non-square kernels, strides and paddings, and an upsample straight after the input conv.
TEST(PoolGrad, NonSquareWindowsAndUpsampleFirst) {
  const ModelSpec spec = parse_model(R"({"input_channels": 2, "layers": [
    {"type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 1},
    {"type": "upsample_nearest", "scale": 3},
    {"type": "maxpool2d", "kernel": [3, 2], "stride": [2, 3], "padding": [1, 0]},
    {"type": "avgpool2d", "kernel": [2, 4], "stride": [1, 2], "padding": [1, 2]},
    {"type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  test::check_model<double>(spec, {2, 2, 11, 7}, "non-square float64");
  test::check_model<float>(spec, {2, 2, 11, 7}, "non-square float32");
}

// A small encoder-decoder: conv -> maxpool(2) -> conv -> upsample(2) -> conv head, 16x16.
TEST(PoolGrad, ConvPoolConvUpsampleConv) {
  const ModelSpec spec = parse_model(R"({"input_channels": 3, "layers": [
    {"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1},
    {"name": "r1", "type": "relu"},
    {"name": "p1", "type": "maxpool2d", "kernel": 2},
    {"name": "c2", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1},
    {"name": "r2", "type": "relu"},
    {"name": "u1", "type": "upsample_nearest", "scale": 2},
    {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 3, "padding": 1}]})");
  test::check_model<double>(spec, {3, 3, 16, 16}, "encoder-decoder float64");
  test::check_model<float>(spec, {3, 3, 16, 16}, "encoder-decoder float32");
}

// Runs `layer` on the test grid with an input of small integers and the output gradient
// dy_all (a function of the output's global shape), and expects every rank's output and input
// gradient tiles to equal, bit for bit, `whole(x_all, dy_all, y_all, dx_all)` computed by the
// reference kernels on the whole image. Integer data keep every sum exact, so any difference is
// a wrong element, not rounding. Unlike check_model, which compares the layer with itself on one
// rank, this checks the layer's window geometry against the kernels' definition.
template <typename T, typename Whole>
void expect_layer_matches_whole(UnaryLayer<T>& layer, Shape4 shape, Shape4 expected_out,
                                double dy_unit, Whole&& whole, const std::string& what) {
  const Comm& grid = test::world();
  // Declared by the case: a grid with more spatial rows or columns than the output has refuses.
  const bool expect_refusal = expected_out.h < grid.shape().h || expected_out.w < grid.shape().w;
  // {-2, -1, 0}: many equal maxima, and all-negative windows at the border, which must not pick
  // the zero padding.
  auto value = [](std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) {
    return T((h * 7 + w * 3 + n + c) % 3 - 2);
  };
  const Distribution in{shape, grid.shape(), grid.coords()};
  Distribution out;
  try {
    out = layer.setup(in);
  } catch (const Error& e) {
    EXPECT_TRUE(expect_refusal) << what << ": " << e.what();
    EXPECT_TRUE(test::contains(e.what(), "no rows") || test::contains(e.what(), "no columns"))
        << what << ": " << e.what();
    return;
  }
  EXPECT_FALSE(expect_refusal) << what << ": expected the grid to refuse a " << expected_out.h
                               << "x" << expected_out.w << " output";
  EXPECT_EQ(out.global.h, expected_out.h) << what;
  EXPECT_EQ(out.global.w, expected_out.w) << what;
  // In the memory of the test's backend (a device's under TESSERA_KERNELS=emulated), as a model
  // would place it.
  Allocator& memory = test::world_runtime().allocator();
  layer.use_allocator(memory);
  layer.bind(test::world_runtime());

  Tensor<T> x_all(shape);
  for (std::int64_t n = 0; n < shape.n; ++n)
    for (std::int64_t c = 0; c < shape.c; ++c)
      for (std::int64_t h = 0; h < shape.h; ++h)
        for (std::int64_t w = 0; w < shape.w; ++w)
          x_all.at(n, c, h, w) = value(n, c, h, w);
  Tensor<T> y_all(out.global), dy_all(out.global), dx_all(shape);
  for (std::int64_t q = 0; q < dy_all.numel(); ++q)
    dy_all.data()[q] = T(dy_unit * double(q % 5 + 1));
  whole(x_all, dy_all, y_all, dx_all);

  DistTensor<T> x(in), dy(out);
  const Range ns = in.samples(), hs = in.rows(), ws = in.cols();
  const Range oh = out.rows(), ow = out.cols();
  for (std::int64_t n = ns.begin; n < ns.end; ++n)
    for (std::int64_t c = 0; c < shape.c; ++c) {
      for (std::int64_t h = hs.begin; h < hs.end; ++h)
        for (std::int64_t w = ws.begin; w < ws.end; ++w)
          x.local.at(n - ns.begin, c, h - hs.begin, w - ws.begin) = x_all.at(n, c, h, w);
      for (std::int64_t h = oh.begin; h < oh.end; ++h)
        for (std::int64_t w = ow.begin; w < ow.end; ++w)
          dy.local.at(n - ns.begin, c, h - oh.begin, w - ow.begin) = dy_all.at(n, c, h, w);
    }
  x.local = copy_to(x.local, memory);
  dy.local = copy_to(dy.local, memory);
  DistTensor<T> y = layer.forward(x, RunState{});
  DistTensor<T> dx = layer.backward_one(dy, RunState{});
  y.local = to_host(y.local);
  dx.local = to_host(dx.local);

  int wrong_y = 0, wrong_dx = 0;
  for (std::int64_t n = ns.begin; n < ns.end; ++n)
    for (std::int64_t c = 0; c < shape.c; ++c) {
      for (std::int64_t h = oh.begin; h < oh.end; ++h)
        for (std::int64_t w = ow.begin; w < ow.end; ++w)
          wrong_y +=
              y.local.at(n - ns.begin, c, h - oh.begin, w - ow.begin) != y_all.at(n, c, h, w);
      for (std::int64_t h = hs.begin; h < hs.end; ++h)
        for (std::int64_t w = ws.begin; w < ws.end; ++w)
          wrong_dx +=
              dx.local.at(n - ns.begin, c, h - hs.begin, w - ws.begin) != dx_all.at(n, c, h, w);
    }
  EXPECT_EQ(wrong_y, 0) << what << ": output elements that differ";
  EXPECT_EQ(wrong_dx, 0) << what << ": input-gradient elements that differ";
}

LayerSpec layer_spec(const std::string& type, nlohmann::json fields) {
  LayerSpec ls;
  ls.name = "l";
  ls.type = type;
  ls.fields = std::move(fields);
  ls.where = "layer 'l' (" + type + ")";
  return ls;
}

// Ties: most windows hold several maxima, some of them in other tiles. The first maximum in the
// window's global row-major order wins whatever tile holds it, so every grid routes each
// gradient to the same input as one rank does. float32 runs oneDNN's pooling (where built): the
// same maxima, and the same averages (small integers, divided by the kernel area exactly enough
// that the sums of dy / area shares round alike).
template <typename T>
void expect_pool_layers_match_the_kernels(const std::string& dtype) {
  const Shape4 shape{3, 2, 17, 15};
  for (std::int64_t k : {2, 3, 4})
    for (std::int64_t s : {1, 2, 3})
      for (std::int64_t p = 0; p <= k / 2; ++p) {
        const std::string what = dtype + " kernel " + std::to_string(k) + " stride " +
                                 std::to_string(s) + " padding " + std::to_string(p);
        const nlohmann::json fields = {{"kernel", k}, {"stride", s}, {"padding", p}};
        const reference::PoolGeometry g = reference::pool_geometry(shape, k, k, s, s, p, p);
        const Shape4 out{shape.n, shape.c, test::window_rows(shape.h, k, s, 1, p),
                         test::window_rows(shape.w, k, s, 1, p)};
        Pool2d<T> max_layer("l", parse_pool2d(layer_spec("maxpool2d", fields)), 1);
        expect_layer_matches_whole(
            max_layer, shape, out, 1.0,
            [&](const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& y, Tensor<T>& dx) {
              std::vector<std::int64_t> argmax(static_cast<std::size_t>(y.numel()));
              reference::maxpool2d_forward(x, y, std::span<std::int64_t>(argmax), g);
              reference::maxpool2d_backward(dy, std::span<const std::int64_t>(argmax), dx);
            },
            "maxpool2d " + what);
        // Gradients in multiples of the kernel area: every share dy / area is an integer.
        Pool2d<T> avg_layer("l", parse_pool2d(layer_spec("avgpool2d", fields)), 2);
        expect_layer_matches_whole(
            avg_layer, shape, out, double(k * k),
            [&](const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& y, Tensor<T>& dx) {
              reference::avgpool2d_forward(x, y, g);
              reference::avgpool2d_backward(dy, dx, g);
            },
            "avgpool2d " + what);
      }
}

TEST(PoolGrad, LayersMatchTheKernelsOnTheWholeImageTiesIncluded) {
  expect_pool_layers_match_the_kernels<double>("float64");
  expect_pool_layers_match_the_kernels<float>("float32");
  for (std::int64_t s : {1, 2, 3, 4}) {
    UpsampleNearest<double> layer(
        "l", parse_upsample(layer_spec("upsample_nearest", {{"scale", s}})), 3);
    expect_layer_matches_whole(
        layer, {3, 2, 7, 5}, {3, 2, 7 * s, 5 * s}, 1.0,
        [&](const Tensor<double>& x, const Tensor<double>& dy, Tensor<double>& y,
            Tensor<double>& dx) {
          const reference::UpsampleGeometry g{.scale_h = s, .scale_w = s};
          reference::upsample_nearest_forward(x, y, g);
          reference::upsample_nearest_backward(dy, dx, g);
        },
        "upsample_nearest scale " + std::to_string(s));
  }
}

}  // namespace
}  // namespace tessera
