// Sharded forward and backward against the single-rank run, over the convolution matrix of
// DESIGN.md section 8: every rank compares its own tiles with the reference it computes itself.
#include <gtest/gtest.h>

#include <sstream>

#include "mpi_test.hpp"
#include "tessera/batch.hpp"
#include "tessera/error.hpp"
#include "tessera/model.hpp"

namespace tessera {
namespace {

struct ConvCase {
  std::int64_t kernel, stride, dilation;
  std::string padding;  // JSON: 0, "same", or [2, 1]
  std::int64_t height, width;

  std::string str() const {
    std::ostringstream s;
    s << "kernel " << kernel << " stride " << stride << " dilation " << dilation << " padding "
      << padding << " image " << height << "x" << width;
    return s.str();
  }
  // conv (the case) -> relu -> 1x1 conv head to 3 classes.
  std::string model() const {
    std::ostringstream s;
    s << R"({"name": "case", "input_channels": 2, "layers": [)"
      << R"({"name": "c", "type": "conv2d", "out_channels": 4, "kernel": )" << kernel
      << ", \"stride\": " << stride << ", \"dilation\": " << dilation
      << ", \"padding\": " << padding << "},"
      << R"({"name": "r", "type": "relu"},)"
      << R"({"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";
    return s.str();
  }
};

std::vector<ConvCase> conv_cases() {
  std::vector<ConvCase> out;
  for (auto [h, w] : {std::pair{17, 15}, std::pair{10, 9}})
    for (std::int64_t k : {1, 2, 3, 5, 7})
      for (std::int64_t s : {1, 2, 3})
        for (std::int64_t d : {1, 2})
          for (std::string p : {"0", "\"same\"", "[2, 1]"}) {
            if (p == "\"same\"" && s != 1) continue;  // PyTorch's rule, enforced by the parser
            out.push_back({k, s, d, p, h, w});
          }
  return out;
}

template <typename T>
struct Run {
  StepResult<T> result;
  std::vector<NamedParam<T>> params;
};

// Compares a sharded tile with the matching part of the whole reference tensor.
template <typename T>
double tile_error(const DistTensor<T>& tile, const Tensor<T>& whole) {
  const Range ns = tile.dist.samples(), hs = tile.dist.rows(), ws = tile.dist.cols();
  const Shape4& g = tile.dist.global;
  double diff = 0;
  for (std::int64_t n = ns.begin; n < ns.end; ++n)
    for (std::int64_t c = 0; c < g.c; ++c)
      for (std::int64_t h = hs.begin; h < hs.end; ++h)
        for (std::int64_t w = ws.begin; w < ws.end; ++w)
          diff = std::max(
              diff, std::abs(double(tile.local.at(n - ns.begin, c, h - hs.begin, w - ws.begin)) -
                             double(whole.at(n, c, h, w))));
  const double scale = test::max_abs<T>(whole.span());
  return scale > 0 ? diff / scale : diff;
}

template <typename T>
void check_model(const ModelSpec& spec, Shape4 input, const std::string& what) {
  const double tol = std::is_same_v<T, double> ? 1e-10 : 1e-4;
  const ProcessGrid& grid = test::world_grid();
  ProcessGrid single(MPI_COMM_SELF, GridShape{1, 1, 1});

  std::optional<Model<T>> sharded, reference;
  try {
    sharded.emplace(spec, grid, input);
  } catch (const Error& e) {
    // Only shapes this grid cannot split (or no grid can) may be refused, and the reason must
    // name the layer.
    EXPECT_NE(std::string(e.what()).find("layer '"), std::string::npos) << e.what();
    try {
      reference.emplace(spec, single, input);
    } catch (const Error& e1) {
      EXPECT_NE(std::string(e1.what()).find("reach"), std::string::npos) << e1.what();
      return;
    }
    const Shape4 out = reference->output_distribution().global;
    EXPECT_TRUE(out.h < grid.shape().h || out.w < grid.shape().w) << what << ": " << e.what();
    return;
  }
  reference.emplace(spec, single, input);
  sharded->init_params(7);
  reference->init_params(7);

  DistTensor<T> x(sharded->input_distribution()), rx(reference->input_distribution());
  x.local = random_image_tile<T>(x.dist, 3);
  rx.local = random_image_tile<T>(rx.dist, 3);
  const auto labels = random_label_tile(sharded->output_distribution(), 3);
  const auto rlabels = random_label_tile(reference->output_distribution(), 3);

  StepResult<T> s = forward_backward(*sharded, x, labels, grid);
  StepResult<T> r = forward_backward(*reference, rx, rlabels, single);

  EXPECT_NEAR(s.loss, r.loss, tol * std::abs(r.loss)) << what;
  EXPECT_LE(tile_error(s.output, r.output.local), tol) << what << ": output";
  EXPECT_LE(tile_error(s.input_grad, r.input_grad.local), tol) << what << ": input gradient";
  auto ps = sharded->params(), pr = reference->params();
  ASSERT_EQ(ps.size(), pr.size());
  for (std::size_t k = 0; k < ps.size(); ++k) {
    const std::span<const T> ref = pr[k].param->grad.span();
    EXPECT_LE((test::rel_error<T, T>(std::as_const(ps[k].param->grad).span(), ref,
                                     test::max_abs<T>(ref))),
              tol)
        << what << ": gradient of " << ps[k].key();
  }
}

TEST(ConvGrad, MatrixFloat64) {
  for (const ConvCase& c : conv_cases())
    check_model<double>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str());
}

TEST(ConvGrad, MatrixFloat32) {
  for (const ConvCase& c : conv_cases())
    check_model<float>(parse_model(c.model()), {3, 2, c.height, c.width}, c.str());
}

TEST(ConvGrad, BuiltinModelBothDtypes) {
  const ModelSpec spec = load_model("convstack-small");
  check_model<double>(spec, {3, 3, 33, 31}, "convstack-small float64");
  check_model<float>(spec, {3, 3, 33, 31}, "convstack-small float32");
}

TEST(ConvGrad, NonSquareKernelsStridesAndNoBias) {
  const ModelSpec spec = parse_model(R"({"input_channels": 2, "layers": [
    {"type": "conv2d", "out_channels": 3, "kernel": [3, 5], "stride": [2, 1], "dilation": [1, 2], "padding": [1, 4], "bias": false},
    {"type": "relu"},
    {"type": "conv2d", "out_channels": 3, "kernel": [2, 1], "stride": [1, 3], "padding": [0, 2]},
    {"type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  check_model<double>(spec, {2, 2, 19, 23}, "non-square float64");
  check_model<float>(spec, {2, 2, 19, 23}, "non-square float32");
}

TEST(ConvGrad, FewerSamplesThanGroupsIsAnError) {
  const GridShape g = test::test_grid();
  if (g.n == 1) GTEST_SKIP() << "needs a data-parallel grid";
  const ProcessGrid& grid = test::world_grid();
  const ModelSpec spec = load_model("convstack-small");
  try {
    Model<double> m(spec, grid, {g.n - 1, 3, 33, 31});
    ADD_FAILURE() << "accepted a batch smaller than the sample groups";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data-parallel groups"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
