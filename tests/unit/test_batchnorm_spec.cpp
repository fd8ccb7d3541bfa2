// batchnorm2d's fields and set-up checks: defaults as PyTorch, errors naming the layer and the
// field, and the single-value batch refused before any work; training alone (the statistics kept
// by the kernel, BatchNormKernel::trains_alone) on the emulated device, against the host's
// statistics.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/batch.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/layers/batchnorm.hpp"
#include "tessera/mpi_comm.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

using test::expect_mentions;

std::string model_with(const std::string& layers) {
  return R"({"name": "t", "input_channels": 2, "layers": [)" + layers + "]}";
}

BatchNormSpec spec_of(const std::string& layer) {
  const ModelSpec m = parse_model(model_with(layer));
  return parse_batchnorm(m.layers.at(0));
}

TEST(BatchNormSpec, DefaultsAreTorchs) {
  const BatchNormSpec d = spec_of(R"({"name": "bn1", "type": "batchnorm2d"})");
  EXPECT_EQ(d.eps, 1e-5);
  EXPECT_EQ(d.momentum, 0.1);
  const BatchNormSpec s =
      spec_of(R"({"name": "bn1", "type": "batchnorm2d", "eps": 0.001, "momentum": 1})");
  EXPECT_EQ(s.eps, 1e-3);
  EXPECT_EQ(s.momentum, 1.0);
  EXPECT_EQ(spec_of(R"({"type": "batchnorm2d", "momentum": 0})").momentum, 0.0);
}

TEST(BatchNormSpec, ErrorsNameTheLayerAndTheField) {
  struct Bad {
    const char* layer;
    std::initializer_list<std::string> parts;
  };
  const Bad cases[] = {
      {R"({"name": "bn1", "type": "batchnorm2d", "eps": 0})", {"'bn1'", "'eps'", "> 0"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "eps": -1e-5})", {"'bn1'", "'eps'", "> 0"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "eps": "1e-5"})", {"'bn1'", "'eps'"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "momentum": 1.5})",
       {"'bn1'", "'momentum'", "1.5"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "momentum": -0.1})", {"'bn1'", "'momentum'"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "momentum": null})", {"'bn1'", "'momentum'"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "affine": false})",
       {"'bn1'", "unknown field", "'affine'"}},
      {R"({"name": "bn1", "type": "batchnorm2d", "num_features": 2})",
       {"'bn1'", "unknown field", "'num_features'"}},
  };
  for (const Bad& bad : cases) {
    try {
      parse_model(model_with(bad.layer), "net.json");
      ADD_FAILURE() << "accepted " << bad.layer;
    } catch (const Error& e) {
      expect_mentions(e.what(), bad.parts);
      expect_mentions(e.what(), {"net.json", "batchnorm2d"});
    }
  }
}

TEST(BatchNormSpec, OneValuePerChannelEvaluatesButDoesNotTrain) {
  const ModelSpec spec = parse_model(model_with(R"({"name": "bn1", "type": "batchnorm2d"})"));
  const Runtime& single = test::single_runtime();
  Model<double> m(spec, single, {1, 2, 1, 1});
  m.init_params(1);
  const auto refused = [](const std::function<void()>& f) {
    try {
      f();
      ADD_FAILURE() << "trained on a batch of one value per channel";
    } catch (const Error& e) {
      expect_mentions(e.what(), {"'bn1'", "batchnorm2d", "more than 1 value per channel"});
    }
  };
  refused([&] { m.check_trainable(); });
  DistTensor<double> x(m.input_distribution());
  x.local.data()[0] = 3;
  x.local.data()[1] = -2;
  m.state().mode = Mode::train;
  refused([&] { m.forward(x); });
  // Evaluation normalises with the running statistics (mean 0, variance 1 at the start).
  m.state().mode = Mode::eval;
  const DistTensor<double> y = m.forward(x);
  EXPECT_NEAR(y.local.data()[0], 3 / std::sqrt(1 + 1e-5), 1e-12);
  EXPECT_NEAR(y.local.data()[1], -2 / std::sqrt(1 + 1e-5), 1e-12);
  // Two values, in samples or in pixels, are enough.
  EXPECT_NO_THROW(Model<double>(spec, single, {2, 2, 1, 1}).check_trainable());
  EXPECT_NO_THROW(Model<double>(spec, single, {1, 2, 1, 2}).check_trainable());
}

TEST(BatchNormSpec, ParamsAndBuffersStartAsTorchs) {
  const ModelSpec spec = parse_model(model_with(R"({"name": "bn1", "type": "batchnorm2d"})"));
  const Runtime& single = test::single_runtime();
  Model<float> m(spec, single, {2, 2, 3, 3});
  m.init_params(5);
  auto ps = m.params();
  ASSERT_EQ(ps.size(), 2u);
  EXPECT_EQ(ps[0].key(), "bn1/weight");
  EXPECT_EQ(ps[1].key(), "bn1/bias");
  auto bs = m.buffers();
  ASSERT_EQ(bs.size(), 2u);
  EXPECT_EQ(bs[0].key(), "bn1/running_mean");
  EXPECT_EQ(bs[1].key(), "bn1/running_var");
  for (int c = 0; c < 2; ++c) {
    EXPECT_EQ(ps[0].param->value.data()[c], 1.0f);
    EXPECT_EQ(ps[1].param->value.data()[c], 0.0f);
    EXPECT_EQ(bs[0].buffer->value.data()[c], 0.0f);
    EXPECT_EQ(bs[1].buffer->value.data()[c], 1.0f);
  }
}

// A 1x1x1 runtime on the emulated device (whose batch norm trains alone as the CUDA one does),
// with batch norm's statistics kept by the kernel or not (TESSERA_BN_ALONE).
Runtime emulated_runtime(bool alone) {
  RuntimeOptions options;
  options.kernels = KernelBackend::emulated;
  options.batchnorm_alone = alone;
  return Runtime(std::make_unique<MpiComm>(MPI_COMM_SELF, GridShape{1, 1, 1}, WaitSettings{}),
                 options);
}

template <typename T>
std::vector<T> values_of(const Tensor<T>& t) {
  const Tensor<T> h = to_host(t);
  return std::vector<T>(h.data(), h.data() + h.size());
}

// Training alone gives the host path's results bit for bit, step after step; its running
// statistics reach buffers() (and evaluation) when asked for, and values written into buffers()
// are the ones the next training step starts from. bn0 normalises the input, whose mean lies far
// from its running mean (the second pass), bn a convolution's output. (No activation after a batch
// norm: the CPU
// kernel the emulated one wraps would apply it, and a batch norm that applies its activation
// does not train alone; the CUDA kernel applies none.)
TEST(BatchNormAlone, GivesTheHostStatisticsAndKeepsTheBuffersTrue) {
  const ModelSpec spec = parse_model(model_with(
      R"({"name": "bn0", "type": "batchnorm2d", "momentum": 0.3},
         {"name": "c1", "type": "conv2d", "out_channels": 3, "kernel": 3, "padding": 1},
         {"name": "r", "type": "relu"},
         {"name": "bn", "type": "batchnorm2d", "momentum": 0.3},
         {"name": "c2", "type": "conv2d", "out_channels": 2, "kernel": 1})"));
  const Shape4 input{2, 2, 6, 5};
  const Runtime alone_rt = emulated_runtime(true), host_rt = emulated_runtime(false);
  Model<double> alone(spec, alone_rt, input), host(spec, host_rt, input);
  alone.init_params(3);
  host.init_params(3);
  const auto step = [&](Model<double>& m, std::uint64_t seed) {
    DistTensor<double> x(m.input_distribution());
    x.local = random_image_tile<double>(x.dist, seed);
    for (double& v : x.local.span())
      v = 500 + 3 * v;  // bn0: far from the running mean (0, then 150, ...): the second pass
    const Labels labels = random_label_tile(m.output_distribution(), seed);
    return forward_backward(m, x, labels);
  };
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE("step " + std::to_string(seed));
    const StepResult<double> a = step(alone, seed), h = step(host, seed);
    EXPECT_EQ(a.loss, h.loss);
    EXPECT_EQ(values_of(a.output.local), values_of(h.output.local));
    EXPECT_EQ(values_of(a.input_grad.local), values_of(h.input_grad.local));
    const auto pa = alone.params(), ph = host.params();
    for (std::size_t k = 0; k < pa.size(); ++k)
      EXPECT_EQ(values_of(pa[k].param->grad), values_of(ph[k].param->grad)) << pa[k].key();
    if (seed == 2) {  // read and written between steps, as a checkpoint's save and load do
      auto ba = alone.buffers(), bh = host.buffers();
      ASSERT_EQ(ba.size(), 4u);
      for (std::size_t k = 0; k < ba.size(); ++k) {
        EXPECT_EQ(values_of(ba[k].buffer->value), values_of(bh[k].buffer->value)) << ba[k].key();
        for (double* b : {ba[k].buffer->value.data(), bh[k].buffer->value.data()})
          b[1] = 0.25 * (1 + double(k));
      }
    }
  }
  auto ba = alone.buffers(), bh = host.buffers();
  for (std::size_t k = 0; k < ba.size(); ++k)
    EXPECT_EQ(values_of(ba[k].buffer->value), values_of(bh[k].buffer->value)) << ba[k].key();
  // Evaluation normalises with the running statistics: the kernel's, brought back.
  step(alone, 4);
  step(host, 4);
  alone.state().mode = Mode::eval;
  host.state().mode = Mode::eval;
  DistTensor<double> x(alone.input_distribution());
  x.local = random_image_tile<double>(x.dist, 9);
  EXPECT_EQ(values_of(alone.forward(x).local), values_of(host.forward(x).local));
}

}  // namespace
}  // namespace tessera
