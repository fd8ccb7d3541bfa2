// Pointwise layers and the model graph on the test grid against one rank.
#include <gtest/gtest.h>

#include <functional>

#include "check_model.hpp"
#include "mpi_test.hpp"
#include "tessera/batch.hpp"
#include "tessera/kernels/narrow_conv.hpp"

namespace tessera {
namespace {

const char* kPointwise = R"({"input_channels": 2, "layers": [
  {"name": "c1", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1},
  {"name": "a1", "type": "leaky_relu", "slope": 0.2},
  {"name": "c2", "type": "conv2d", "out_channels": 4, "kernel": 3, "stride": 2},
  {"name": "a2", "type": "sigmoid"},
  {"name": "d1", "type": "dropout", "p": 0.3},
  {"name": "c3", "type": "conv2d", "out_channels": 4, "kernel": 2, "dilation": 2, "padding": "same"},
  {"name": "a3", "type": "leaky_relu"},
  {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}]})";

TEST(Pointwise, LeakyReluSigmoidAndDropoutInTrainingAndEvaluation) {
  const ModelSpec spec = parse_model(kPointwise);
  for (Mode mode : {Mode::train, Mode::eval}) {
    const std::string what = mode == Mode::train ? "train" : "eval";
    test::check_model<double>(spec, {3, 2, 17, 15}, what + " float64", {.mode = mode});
    test::check_model<float>(spec, {3, 2, 17, 15}, what + " float32", {.mode = mode});
  }
}

TEST(Pointwise, DropoutDropsTheSameElementsOnEveryGrid) {
  // p = 1 drops everything; a trained model's output then no longer depends on the input.
  const ModelSpec all = parse_model(R"({"input_channels": 2, "layers": [
    {"type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 1},
    {"type": "dropout", "p": 1.0},
    {"type": "conv2d", "out_channels": 2, "kernel": 1}]})");
  test::check_model<double>(all, {2, 2, 9, 10}, "p = 1", {.zero_input_grad = true});
  const ModelSpec half = parse_model(R"({"input_channels": 2, "layers": [
    {"type": "dropout", "p": 0.5},
    {"type": "conv2d", "out_channels": 2, "kernel": 3, "padding": 1}]})");
  for (std::uint64_t seed : {1, 2, 3})
    test::check_model<double>(half, {2, 2, 13, 11}, "p = 0.5, seed " + std::to_string(seed),
                              {.seed = seed});
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

TEST(BuiltinModels, UnetSmallAndConvnetSmallMatchOneRankInTrainingAndEvaluation) {
  const ModelSpec unet = load_model("unet-small");
  const ModelSpec convnet = load_model("convnet-small");
  for (Mode mode : {Mode::train, Mode::eval}) {
    const std::string m = mode == Mode::train ? " train" : " eval";
    test::check_model<double>(unet, {3, 3, 36, 44}, "unet-small float64" + m, {.mode = mode});
    test::check_model<float>(unet, {2, 3, 24, 20}, "unet-small float32" + m, {.mode = mode});
    test::check_model<double>(convnet, {3, 3, 33, 31}, "convnet-small float64" + m, {.mode = mode});
    test::check_model<float>(convnet, {4, 3, 17, 20}, "convnet-small float32" + m, {.mode = mode});
  }
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// Activations fused into their neighbours: (leaky) ReLU after a conv applied by the conv's kernel
// (oneDNN, float32) and after a batch norm by its normalisation (CPU backends), f' applied by the
// halo layer that consumes it (conv, pooling, transposed conv) or else by the batch norm before
// it, and the cases that stay apart: a producer that is neither (pooling), an activation with two
// consumers, the last layer. The same results, on the test grid, as with fusion off.
const char* kFusions = R"({"input_channels": 3, "layers": [
  {"name": "c1", "type": "conv2d", "out_channels": 6, "kernel": 3, "padding": 1},
  {"name": "a1", "type": "leaky_relu", "slope": 0.2},
  {"name": "c2", "type": "conv2d", "out_channels": 16, "kernel": 3, "stride": 2, "padding": 1},
  {"name": "a2", "type": "relu"},
  {"name": "p1", "type": "maxpool2d", "kernel": 2},
  {"name": "a3", "type": "relu"},
  {"name": "t1", "type": "conv_transpose2d", "out_channels": 5, "kernel": 2, "stride": 2},
  {"name": "a4", "type": "relu"},
  {"name": "c3", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1},
  {"name": "b1", "type": "batchnorm2d"},
  {"name": "a6", "type": "leaky_relu", "slope": 0.1},
  {"name": "c5", "type": "conv2d", "out_channels": 2, "kernel": 3, "padding": 1},
  {"name": "cat", "type": "concat", "inputs": ["a4", "a6", "c5"]},
  {"name": "c4", "type": "conv2d", "out_channels": 3, "kernel": 1},
  {"name": "a5", "type": "relu"}],
  "loss": "pixel_cross_entropy"})";

// One training step of `json` on the test grid with fusion on (the test runtime) and off: the
// same loss, output, input gradient and parameter gradients (to rounding: leaky ReLU's f' on a
// window gradient applies to each contribution to an element of a halo rather than to their sum).
// `inspect` looks at both models after their construction.
template <typename T>
void same_step_as_unfused(const char* json, const Shape4& input, const std::string& what,
                          const std::function<void(Model<T>&, Model<T>&)>& inspect) {
  const ModelSpec spec = parse_model(json);
  RuntimeOptions off = test::world_runtime().options();
  off.fuse = false;
  const Runtime unfused_runtime = test::make_test_runtime(off);
  Model<T> fused(spec, test::world_runtime(), input), unfused(spec, unfused_runtime, input);
  inspect(fused, unfused);
  std::vector<StepResult<T>> results;
  for (Model<T>* m : {&fused, &unfused}) {
    m->init_params(5);
    DistTensor<T> x(m->input_distribution());
    x.local = random_image_tile<T>(x.dist, 5);
    results.push_back(forward_backward(*m, x, random_label_tile(m->output_distribution(), 5)));
  }
  const double tolerance = std::is_same_v<T, double> ? 1e-14 : 1e-6;
  EXPECT_NEAR(results[0].loss, results[1].loss, tolerance * std::abs(results[1].loss)) << what;
  const auto same = [&](const Tensor<T>& a, const Tensor<T>& b) {
    const Tensor<T> ha = to_host(a), hb = to_host(b);
    return ha.shape() == hb.shape() && test::rel_error(ha.span(), hb.span()) <= tolerance;
  };
  EXPECT_TRUE(same(results[0].output.local, results[1].output.local)) << what << ": output";
  EXPECT_TRUE(same(results[0].input_grad.local, results[1].input_grad.local))
      << what << ": input gradient";
  auto pf = fused.params(), pu = unfused.params();
  ASSERT_EQ(pf.size(), pu.size());
  for (std::size_t k = 0; k < pf.size(); ++k)
    EXPECT_TRUE(same(pf[k].param->grad, pu[k].param->grad)) << what << ": " << pf[k].key();
}

template <typename T>
void check_fusions(const std::vector<typename Model<T>::ActivationFusion>& expected,
                   const std::string& what) {
  // p1's output is 4x5.
  same_step_as_unfused<T>(kFusions, {2, 3, 18, 22}, what, [&](Model<T>& fused, Model<T>& unfused) {
    EXPECT_TRUE(unfused.fused_activations().empty()) << what;
    const auto& got = fused.fused_activations();
    ASSERT_EQ(got.size(), expected.size()) << what;
    for (std::size_t k = 0; k < got.size(); ++k) {
      EXPECT_EQ(got[k].activation, expected[k].activation) << what;
      EXPECT_EQ(got[k].producer, expected[k].producer) << what << ": " << got[k].activation;
      EXPECT_EQ(got[k].consumer, expected[k].consumer) << what << ": " << got[k].activation;
    }
  });
}

TEST(FusedActivations, WhereTheyFuseAndTheSameResultsAsApart) {
  const KernelBackend kind = test::world_runtime().backend().kind();
  // a1: leaky ReLU after c1 into c2; a2 after c2 into the pooling; a3 after pooling (no producer
  // fuses) into the transposed conv; a4 has two consumers; a6 after a batch norm has two (a conv
  // and a concat: the batch norm's backward applies f'); a5 is the last layer. CPU activations work
  // from outputs (f' fused everywhere but cuda); only oneDNN's convs apply f, and every CPU batch
  // norm.
  const bool f_prime = kind != KernelBackend::cuda;
  const bool by_batch_norm = kind != KernelBackend::cuda;
  const auto expect = [&](bool f) {
    using F = Model<float>::ActivationFusion;
    std::vector<F> v;
    if (f || f_prime) {
      v = {F{"a1", f ? "c1" : "", f_prime ? "c2" : ""},
           F{"a2", f ? "c2" : "", f_prime ? "p1" : ""}};
      if (f_prime) v.push_back(F{"a3", "", "t1"});
    }
    if (by_batch_norm) v.push_back(F{"a6", "b1", "b1"});
    if (f) v.push_back(F{"a5", "c4", ""});
    return v;
  };
  std::vector<Model<double>::ActivationFusion> f64;
  for (const auto& f : expect(false))
    f64.push_back({f.activation, f.producer, f.consumer});
  check_fusions<double>(f64, "float64");
  check_fusions<float>(expect(kind == KernelBackend::onednn), "float32");
}

// Concats read by their consumer (README "Memory-bound layers"): a conv fills each input into its
// channels of its window, exchanging halos per input, and returns each input's gradient; a concat
// consumed by another layer, or whose inputs do not start on 16-channel blocks, stays a concat. The
// same results, on the test grid, as with every concat computed (fusion off).
const char* kConcats = R"({"input_channels": 3, "layers": [
  {"name": "c1", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1},
  {"name": "c2", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1},
  {"name": "cat1", "type": "concat", "inputs": ["c1", "c2"]},
  {"name": "c3", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1},
  {"name": "cat2", "type": "concat", "inputs": ["c3", "c3"]},
  {"name": "c4", "type": "conv2d", "out_channels": 6, "kernel": 3, "padding": 2, "dilation": 2},
  {"name": "cat3", "type": "concat", "inputs": ["c4", "c1", "c2"]},
  {"name": "p1", "type": "maxpool2d", "kernel": 2},
  {"name": "t1", "type": "conv_transpose2d", "out_channels": 16, "kernel": 2, "stride": 2},
  {"name": "cat5", "type": "concat", "inputs": ["t1", "c1"]},
  {"name": "c5", "type": "conv2d", "out_channels": 6, "kernel": 3, "padding": 1},
  {"name": "p2", "type": "maxpool2d", "kernel": 2},
  {"name": "cat4", "type": "concat", "inputs": ["p1", "p2"]},
  {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 3, "stride": 2, "padding": 1}],
  "loss": "pixel_cross_entropy"})";

template <typename T>
void check_concats(const std::vector<std::string>& expected, const std::string& what) {
  // The consumers (3x3 "same" convs) compute windowless from the inputs where their kernels read
  // them as they lie, in host memory: the narrow kernels (float32 on AVX-512), and the reference
  // (float64, and the reference backend), which gathers them.
  const Runtime& runtime = test::world_runtime();
  const bool windowless =
      runtime.allocator().space() == MemorySpace::host &&
      (std::is_same_v<T, double> || runtime.backend().kind() == KernelBackend::reference ||
       narrow_conv_available());
  same_step_as_unfused<T>(kConcats, {2, 3, 20, 26}, what, [&](Model<T>& fused, Model<T>& unfused) {
    EXPECT_TRUE(unfused.concats_taken().empty()) << what;
    std::vector<std::string> got;
    for (const auto& c : fused.concats_taken())
      got.push_back(c.concat + " -> " + c.consumer);
    EXPECT_EQ(got, expected) << what;
    for (const auto& [layer, kernel] : fused.kernel_summaries())
      for (const std::string& c : expected)
        if (c.ends_with("-> " + layer)) {
          EXPECT_EQ(kernel.ends_with(", windowless"), windowless) << what << ": " << c;
        }
  });
}

TEST(ConcatsTaken, WhereTheyAreAndTheSameResultsAsApart) {
  // cat1 (16 + 8 channels) into c3's window (NCHW in float64, 8-channel blocks on oneDNN), cat2
  // (c3's output twice) into c4's (16-channel blocks on oneDNN; c3 then gives its output in
  // them), cat5 into c5's (the transposed conv t1, with a bias, then gives 16-channel blocks on
  // oneDNN); cat3 feeds a pooling, and cat4's second input would start at channel 30. On every
  // backend: the cuda halo copies take channel slices too.
  const std::vector<std::string> taken = {"cat1 -> c3", "cat2 -> c4", "cat5 -> c5"};
  check_concats<double>(taken, "float64");
  check_concats<float>(taken, "float32");
}

// Two concats sharing an input, their convs in the other order: c1's last reader is dA, so only
// dA may keep it for backward (handed over, Layer::take_concat_input); dB, whose concat comes
// last, copies it.
const char* kCrossedConcats = R"({"input_channels": 3, "layers": [
  {"name": "c1", "type": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1},
  {"name": "c2", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1},
  {"name": "c3", "type": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1, "inputs": "c1"},
  {"name": "catA", "type": "concat", "inputs": ["c1", "c2"]},
  {"name": "catB", "type": "concat", "inputs": ["c1", "c3"]},
  {"name": "dB", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1, "inputs": "catB"},
  {"name": "dA", "type": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1, "inputs": "catA"},
  {"name": "sum", "type": "add", "inputs": ["dA", "dB"]},
  {"name": "head", "type": "conv2d", "out_channels": 3, "kernel": 1}],
  "loss": "pixel_cross_entropy"})";

TEST(ConcatsTaken, AnInputSharedByTwoIsKeptByItsLastReader) {
  const std::vector<std::string> taken = {"catA -> dA", "catB -> dB"};
  const auto inspect = [&](const std::string& what) {
    return [&, what](auto& fused, auto&) {
      std::vector<std::string> got;
      for (const auto& c : fused.concats_taken())
        got.push_back(c.concat + " -> " + c.consumer);
      EXPECT_EQ(got, taken) << what;
    };
  };
  same_step_as_unfused<double>(kCrossedConcats, {2, 3, 20, 26}, "float64", inspect("float64"));
  same_step_as_unfused<float>(kCrossedConcats, {2, 3, 20, 26}, "float32", inspect("float32"));
}

}  // namespace
}  // namespace tessera
