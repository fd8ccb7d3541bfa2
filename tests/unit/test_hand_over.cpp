// Inputs handed over (Layer::hand_over_input / take_input): a batch norm keeps the tensor the
// model moves into it instead of a copy, and a pooling layer whose window is its tile reads its
// input in place, with the same results as the copy; a handed-over batch norm whose input never
// came refuses its backward; the batch handed over to a model (Model::forward(DistTensor&&)) is
// kept by its first layer instead of a copy, with the same results.
// Single process.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "tessera/allocator.hpp"
#include "tessera/batch.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/reference_upsample.hpp"
#include "tessera/layers/batchnorm.hpp"
#include "tessera/layers/pool2d.hpp"
#include "tessera/layers/upsample.hpp"
#include "tessera/random.hpp"

#include "../common/test_helpers.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

constexpr std::uint64_t kSeed = 20261125;

// 4 x 256 x 256 floats: 1 MiB, a large block of the host allocator.
const Shape4 kShape{1, 4, 256, 256};

DistTensor<float> distributed(const Distribution& d, Tensor<float> local) {
  DistTensor<float> t;
  t.dist = d;
  t.local = std::move(local);
  return t;
}

// Elements that differ in any bit.
std::int64_t differences(const Tensor<float>& a, const Tensor<float>& b) {
  std::int64_t n = 0;
  for (std::int64_t k = 0; k < a.numel(); ++k)
    n += std::memcmp(a.data() + k, b.data() + k, sizeof(float)) != 0;
  return n;
}

std::int64_t large_allocations() {
  const HostMemoryStats s = host_memory_stats();
  return s.reused + s.assembled + s.fresh;
}

LayerSpec spec_of(const char* type) {
  LayerSpec spec;
  spec.name = "l";
  spec.type = type;
  spec.where = std::string("layer 'l' (") + type + ")";
  if (std::string(type) == "maxpool2d") spec.fields = {{"kernel", 2}};
  return spec;
}

struct Run {
  Tensor<float> y, dx;
  std::int64_t forward_allocations = 0;
};

// One forward and backward of `layer` on x; with `handed`, x is moved into take_input after the
// forward, as the model does.
template <typename L>
Run run(L& layer, const Distribution& in, const Distribution& out, bool handed,
        const Tensor<float>& x, const Tensor<float>& dy) {
  Run r;
  DistTensor<float> input = distributed(in, x);
  reset_host_memory_stats();
  const std::int64_t before = large_allocations();
  const RunState train{.mode = Mode::train, .seed = 1, .step = 0};
  DistTensor<float> y = layer.forward(input, train);
  r.forward_allocations = large_allocations() - before;
  if (handed) layer.take_input(std::move(input));
  r.y = y.local;
  r.dx = layer.backward_one(distributed(out, dy), train).local;
  return r;
}

// `handed_allocations`: the large blocks a forward allocates when x is handed over;
// `copy_allocations`: how many more when it is not (the copy the layer keeps, if any).
template <typename L, typename Make>
void expect_taken_over(Make make, std::int64_t handed_allocations, std::int64_t copy_allocations) {
  const Runtime& single = test::single_runtime();
  const Distribution in{kShape, single.comm().shape(), single.comm().coords()};
  const Tensor<float> x = test::random_tensor<float>(kShape, kSeed, 1);
  Run runs[2];
  for (bool handed : {false, true}) {
    L layer = make();
    const Distribution out = layer.setup(in);
    layer.hand_over_input(handed);
    layer.bind(single);
    const Tensor<float> dy = test::random_tensor<float>(out.local_shape(), kSeed, 2);
    runs[handed] = run(layer, in, out, handed, x, dy);
  }
  ASSERT_EQ(runs[1].y.shape(), runs[0].y.shape());
  ASSERT_EQ(runs[1].dx.shape(), kShape);
  EXPECT_EQ(differences(runs[0].y, runs[1].y), 0);
  EXPECT_EQ(differences(runs[0].dx, runs[1].dx), 0);
  EXPECT_EQ(runs[1].forward_allocations, handed_allocations);
  EXPECT_EQ(runs[0].forward_allocations - runs[1].forward_allocations, copy_allocations);
}

TEST(HandOver, BatchNormKeepsItsInputInsteadOfACopy) {
  expect_taken_over<BatchNorm2d<float>>(
      [] { return BatchNorm2d<float>("l", parse_batchnorm(spec_of("batchnorm2d"))); }, 1, 1);
}

// Only the output is a new large block (the pool's is below one): handed over or not, a pool whose
// window is its tile reads its input in place (its backward needs only what its kernel keeps).
TEST(HandOver, APoolWhoseWindowIsItsTileReadsItsInputInPlace) {
  expect_taken_over<Pool2d<float>>(
      [] { return Pool2d<float>("l", parse_pool2d(spec_of("maxpool2d")), 1); }, 0, 0);
}

// An upsampling whose output goes on in NCHW (its consumer computes in NCHW) from an input that
// comes in 16-channel blocks: its window is the input in place, converted as it is widened, and
// the input gradient comes back in the input's blocks; the reference's results. Without the
// blocked input expected, the window is an NCHW copy.
TEST(HandOver, AnUpsampleIntoNchwReadsABlockedInputInPlace) {
  const Runtime& single = test::single_runtime();
  const Shape4 shape{1, 16, 128, 128};  // 1 MiB: a large block
  const Distribution in{shape, single.comm().shape(), single.comm().coords()};
  const Tensor<float> x = test::random_tensor<float>(shape, kSeed, 3);
  const reference::UpsampleGeometry g{.scale_h = 2, .scale_w = 2};
  for (bool expected : {true, false}) {
    UpsampleNearest<float> up("l", UpsampleSpec{.scale = 2}, 1);
    const Distribution out = up.setup(in);
    up.expect_blocked_input(expected);
    up.hand_over_input(true);
    up.bind(single);
    const Tensor<float> dy = test::random_tensor<float>(out.local_shape(), kSeed, 4);
    const auto r = run(up, in, out, true, to_layout(x, Layout::nchw16c), dy);
    const std::string what = expected ? "blocked input expected" : "not expected";
    // The output alone (1 of 4 MiB, assembled from kept pages or fresh), or also the window.
    EXPECT_EQ(r.forward_allocations, expected ? 1 : 2) << what;
    EXPECT_EQ(r.y.layout(), Layout::nchw) << what;
    EXPECT_EQ(r.dx.layout(), Layout::nchw16c) << what;
    Tensor<float> want_y(out.local_shape()), want_dx(shape);
    reference::upsample_nearest_forward(x, want_y, g);
    reference::upsample_nearest_backward(dy, want_dx, g);
    EXPECT_EQ(differences(r.y, want_y), 0) << what;
    EXPECT_EQ(differences(to_layout(r.dx, Layout::nchw), want_dx), 0) << what;
  }
}

// A training step with the batch handed over to the model (forward_backward with an rvalue) gives
// the step with the batch lent (const&) bit for bit: loss, logits, every parameter gradient and
// dL/dinput; its forward allocates one large block fewer (the first conv keeps the batch itself
// for its filter gradient, not a copy). Built-in models whose first layer is a conv.
TEST(HandOver, TheModelsFirstLayerKeepsTheBatchHandedToIt) {
  const Runtime& single = test::single_runtime();
  const Shape4 input{1, 3, 512, 512};  // 3 MiB: a large block
  for (const char* name : {"convstack-small", "unet-small", "conv-bench"}) {
    const ModelSpec spec = load_model(name);
    Model<float> lent(spec, single, input), handed(spec, single, input);
    lent.init_params(7);
    handed.init_params(7);
    DistTensor<float> x(lent.input_distribution());
    x.local = random_image_tile<float>(x.dist, 7);
    const Labels labels = random_label_tile(lent.output_distribution(), 7);
    reset_host_memory_stats();
    const StepResult<float> a = forward_backward(lent, x, labels);
    const std::int64_t lent_blocks = large_allocations();
    DistTensor<float> batch = x;
    reset_host_memory_stats();
    const StepResult<float> b = forward_backward(handed, std::move(batch), labels);
    const std::int64_t handed_blocks = large_allocations();
    EXPECT_EQ(batch.local.numel(), 0) << name;  // moved from
    EXPECT_EQ(a.loss, b.loss) << name;
    EXPECT_EQ(differences(a.output.local, b.output.local), 0) << name;
    EXPECT_EQ(differences(a.input_grad.local, b.input_grad.local), 0) << name;
    const auto pa = lent.params(), pb = handed.params();
    ASSERT_EQ(pa.size(), pb.size());
    for (std::size_t k = 0; k < pa.size(); ++k)
      EXPECT_EQ(differences(pa[k].param->grad, pb[k].param->grad), 0) << name << " " << pa[k].key();
    EXPECT_EQ(lent_blocks - handed_blocks, 1) << name;
  }
}

TEST(HandOver, ABatchNormWhoseInputNeverCameRefusesItsBackward) {
  const Runtime& single = test::single_runtime();
  const Distribution in{kShape, single.comm().shape(), single.comm().coords()};
  BatchNorm2d<float> bn("l", parse_batchnorm(spec_of("batchnorm2d")));
  bn.setup(in);
  bn.hand_over_input(true);
  bn.bind(single);
  const RunState train{.mode = Mode::train, .seed = 1, .step = 0};
  bn.forward(distributed(in, test::random_tensor<float>(kShape, kSeed, 1)), train);
  EXPECT_THROW(bn.backward_one(distributed(in, Tensor<float>(kShape)), train), Error);
}

}  // namespace
}  // namespace tessera
