// Transposed and grouped convolutions sharded over the test grid against one rank: loss, output,
// input gradient and every parameter gradient, float64 within 1e-10 and float32 within 1e-4.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "check_model.hpp"
#include "mpi_test.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/layers/conv_transpose2d.hpp"

namespace tessera {
namespace {

struct TransposeCase {
  std::int64_t kernel, stride, padding, output_padding;
  std::int64_t height, width;

  std::string str() const {
    std::ostringstream s;
    s << "conv_transpose2d kernel " << kernel << " stride " << stride << " padding " << padding
      << " output_padding " << output_padding << " image " << height << "x" << width;
    return s.str();
  }
  // The smaller of the image and the transposed conv's output (the conv before keeps the
  // image's extent).
  test::CheckOptions options() const {
    const ConvTransposeAxis a{
        .kernel = kernel, .stride = stride, .padding = padding, .output_padding = output_padding};
    return {.smallest_h = std::min(height, a.output_extent(height)),
            .smallest_w = std::min(width, a.output_extent(width))};
  }
  std::string layer() const {
    std::ostringstream s;
    s << R"({"name": "up", "type": "conv_transpose2d", "out_channels": 4, "kernel": )" << kernel
      << ", \"stride\": " << stride << ", \"padding\": " << padding
      << ", \"output_padding\": " << output_padding << "}";
    return s.str();
  }
  // conv -> the case -> relu -> 1x1 conv head to 3 classes: the transposed conv's input and
  // output gradients both pass through halo layers.
  std::string model() const {
    return R"({"name": "case", "input_channels": 2, "layers": [
      {"name": "c", "type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 1},)" +
           layer() + R"(, {"name": "r", "type": "relu"},
      {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";
  }
};

// Kernels 1..5, strides 1..3, paddings 0..2, every output padding below the stride, on odd
// images whose outputs split unevenly over every grid. Kernels smaller than the stride leave
// output rows no input reaches; paddings larger than kernel - 1 crop into the first input rows.
std::vector<TransposeCase> transpose_cases() {
  std::vector<TransposeCase> out;
  for (auto [h, w] : {std::pair{7, 9}, std::pair{5, 4}})
    for (std::int64_t k = 1; k <= 5; ++k)
      for (std::int64_t s = 1; s <= 3; ++s)
        for (std::int64_t p = 0; p <= 2; ++p)
          for (std::int64_t op = 0; op < s; ++op) {
            const TransposeCase c{k, s, p, op, h, w};
            const ConvTransposeAxis a{.kernel = k, .stride = s, .padding = p, .output_padding = op};
            // PyTorch refuses an empty output as well.
            if (a.output_extent(h) > 0 && a.output_extent(w) > 0) out.push_back(c);
          }
  return out;
}

TEST(ConvTransposeGrad, MatrixFloat64) {
  for (const TransposeCase& c : transpose_cases())
    test::check_model<double>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                              c.options());
}

TEST(ConvTransposeGrad, MatrixFloat32) {
  for (const TransposeCase& c : transpose_cases())
    test::check_model<float>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                             c.options());
}

// A tile whose outputs no input reaches has an empty window: kernel 1, stride 3, padding 1,
// output padding 2 turn 3 rows into 7, of which only rows 2 and 5 receive an input. Split 3
// ways ([0, 3), [3, 5), [5, 7)) the middle tile receives nothing, yet its outputs (the bias) and
// its neighbours' windows must still be right.
TEST(ConvTransposeGrad, TilesThatNoInputReaches) {
  const TransposeCase c{1, 3, 1, 2, 3, 4};
  for (std::int64_t w : {3, 4, 11}) {
    const std::string what = c.str() + ", width " + std::to_string(w);
    test::check_model<double>(parse_model(c.model()), {2, 2, 3, w}, what + " float64");
    test::check_model<float>(parse_model(c.model()), {2, 2, 3, w}, what + " float32");
  }
}

// Down and up again, as in a U-Net: conv stride 2 -> relu -> transposed conv stride 2 -> head.
TEST(ConvTransposeGrad, DownUp) {
  struct Up {
    std::int64_t kernel, padding, output_padding;
  };
  for (auto [h, w] : {std::pair{17, 15}, std::pair{10, 9}, std::pair{16, 13}})
    for (Up up : {Up{2, 0, 0}, Up{2, 0, 1}, Up{3, 1, 1}, Up{3, 1, 0}, Up{3, 0, 1}})
      for (std::int64_t down_kernel : {2, 3}) {
        std::ostringstream s;
        s << R"({"name": "down-up", "input_channels": 3, "layers": [)"
          << R"({"name": "down", "type": "conv2d", "out_channels": 4, "kernel": )" << down_kernel
          << R"(, "stride": 2, "padding": )" << down_kernel / 2 << "},"
          << R"({"name": "r1", "type": "relu"},)"
          << R"({"name": "up", "type": "conv_transpose2d", "out_channels": 3, "kernel": )"
          << up.kernel << R"(, "stride": 2, "padding": )" << up.padding << R"(, "output_padding": )"
          << up.output_padding << "},"
          << R"({"name": "r2", "type": "relu"},)"
          << R"({"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 1}]})";
        std::ostringstream what;
        what << "down kernel " << down_kernel << ", up kernel " << up.kernel << " padding "
             << up.padding << " output_padding " << up.output_padding << ", image " << h << "x"
             << w;
        const ModelSpec spec = parse_model(s.str());
        test::check_model<double>(spec, {3, 3, h, w}, what.str() + " float64");
        test::check_model<float>(spec, {3, 3, h, w}, what.str() + " float32");
      }
}

TEST(ConvTransposeGrad, NonSquareAndNoBias) {
  const ModelSpec spec = parse_model(R"({"input_channels": 2, "layers": [
    {"type": "conv2d", "out_channels": 3, "kernel": [3, 1], "padding": [1, 0]},
    {"type": "conv_transpose2d", "out_channels": 3, "kernel": [4, 2], "stride": [3, 1], "padding": [2, 0], "output_padding": [1, 0], "bias": false},
    {"type": "relu"},
    {"type": "conv_transpose2d", "out_channels": 2, "kernel": [1, 5], "stride": [1, 2], "padding": [0, 2], "output_padding": [0, 1]}]})");
  test::check_model<double>(spec, {2, 2, 9, 7}, "non-square float64");
  test::check_model<float>(spec, {2, 2, 9, 7}, "non-square float32");
}

// Grouped convolutions: 2 groups, and depthwise (groups == input channels) with a channel
// multiplier of 2, each between an ordinary conv (so its input gradient crosses halos too) and a
// 1x1 head.
struct GroupCase {
  std::int64_t groups, out_channels, kernel, stride, dilation;
  std::string padding;
  std::int64_t height, width;

  std::string str() const {
    std::ostringstream s;
    s << "conv2d groups " << groups << " out " << out_channels << " kernel " << kernel << " stride "
      << stride << " dilation " << dilation << " padding " << padding << " image " << height << "x"
      << width;
    return s.str();
  }
  // The grouped conv's output rows and columns (the first conv keeps the image's).
  test::CheckOptions options() const {
    if (padding == "\"same\"") return {.smallest_h = height, .smallest_w = width};
    const std::int64_t ph = padding == "0" ? 0 : 2, pw = padding == "0" ? 0 : 1;  // or [2, 1]
    return {.smallest_h = test::window_rows(height, kernel, stride, dilation, ph),
            .smallest_w = test::window_rows(width, kernel, stride, dilation, pw)};
  }
  std::string model() const {
    std::ostringstream s;
    s << R"({"name": "grouped", "input_channels": 2, "layers": [)"
      << R"({"name": "c", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1},)"
      << R"({"name": "g", "type": "conv2d", "out_channels": )" << out_channels
      << ", \"groups\": " << groups << ", \"kernel\": " << kernel << ", \"stride\": " << stride
      << ", \"dilation\": " << dilation << ", \"padding\": " << padding << "},"
      << R"({"name": "r", "type": "relu"},)"
      << R"({"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";
    return s.str();
  }
};

std::vector<GroupCase> group_cases() {
  std::vector<GroupCase> out;
  for (auto [h, w] : {std::pair{17, 15}, std::pair{10, 9}})
    for (auto [groups, outs] : {std::pair{2, 6}, std::pair{4, 8}})  // 4 inputs: 4 is depthwise
      for (std::int64_t k : {3, 5})
        for (std::int64_t s : {1, 2})
          for (std::int64_t d : {1, 2})
            for (std::string p : {"0", "\"same\"", "[2, 1]"}) {
              if (p == "\"same\"" && s != 1) continue;
              const GroupCase c{groups, outs, k, s, d, p, h, w};
              // A kernel reaching past the padded image has no output on any grid.
              if (c.options().smallest_h > 0 && c.options().smallest_w > 0) out.push_back(c);
            }
  return out;
}

TEST(GroupedConvGrad, MatrixFloat64) {
  for (const GroupCase& c : group_cases())
    test::check_model<double>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                              c.options());
}

TEST(GroupedConvGrad, MatrixFloat32) {
  for (const GroupCase& c : group_cases())
    test::check_model<float>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str(),
                             c.options());
}

// A depthwise-separable block (depthwise 3x3 stride 2, pointwise 1x1), back up through
// conv_transpose2d, then a dilated depthwise conv.
TEST(GroupedConvGrad, DepthwiseSeparableDownUp) {
  const ModelSpec spec = parse_model(R"({"input_channels": 3, "layers": [
    {"type": "conv2d", "out_channels": 6, "kernel": 3, "padding": 1},
    {"type": "conv2d", "out_channels": 6, "kernel": 3, "stride": 2, "padding": 1, "groups": 6},
    {"type": "conv2d", "out_channels": 4, "kernel": 1},
    {"type": "relu"},
    {"type": "conv_transpose2d", "out_channels": 4, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1},
    {"type": "conv2d", "out_channels": 4, "kernel": 5, "dilation": 2, "padding": "same", "groups": 4},
    {"type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  test::check_model<double>(spec, {3, 3, 15, 13}, "depthwise separable float64");
  test::check_model<float>(spec, {3, 3, 15, 13}, "depthwise separable float32");
}

}  // namespace
}  // namespace tessera
