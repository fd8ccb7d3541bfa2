// SGD, Adam and the learning-rate schedules against values computed by torch 1.13 (CPU), and a
// restored optimizer (slots and step count) continuing exactly where the saved one was.
//
// The expected values came from a script outside the repository: the same 8 parameters and the
// same per-step gradients as `initial` and `gradient` below, as float64 (and float32) tensors,
// 5 calls of torch.optim.SGD / Adam .step() with the settings named in each test, setting
// param_groups[0]['lr'] before each step where the learning rate varies; the schedules are
// CosineAnnealingLR(T_max=10) and StepLR(step_size=3, gamma=0.1) on SGD(lr=0.1), read before
// each scheduler.step() (get_last_lr, "stepped") and from _get_closed_form_lr ("closed").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <numbers>
#include <string>
#include <vector>

#include "tessera/engine/model.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/engine/optimizer.hpp"
#include "tessera/error.hpp"
#include "tessera/process_grid.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

constexpr int kSteps = 5;

// Parameters c1/weight [2,2,1,1], c1/bias [2], c2/weight [1,2,1,1]: 8 values numbered `i` in
// that order. Initial values and gradients are exact in float32 and float64 alike, so both
// precisions start from the same numbers as torch did.
const char* const kModel = R"({"name": "t", "input_channels": 2, "layers": [
  {"name": "c1", "type": "conv2d", "out_channels": 2, "kernel": 1},
  {"name": "c2", "type": "conv2d", "out_channels": 1, "kernel": 1, "bias": false}]})";

double initial(int i) {
  return ((i * 3) % 7 - 3) / 8.0;
}
double gradient(int i, int k) {
  return ((i * 5 + k * 3) % 11 - 5) / 4.0;
}  // step k, 0-based

using LearningRate = std::function<double(int)>;  // of step k, 0-based

template <typename T>
struct Net {
  Model<T> model{parse_model(kModel), test::single_runtime(), Shape4{1, 2, 1, 1}};

  Net() {
    int i = 0;
    for (NamedParam<T>& p : model.params())
      for (T& v : p.param->value.span())
        v = static_cast<T>(initial(i++));
  }
  void set_gradients(int k) {
    int i = 0;
    for (NamedParam<T>& p : model.params())
      for (T& g : p.param->grad.span())
        g = static_cast<T>(gradient(i++, k));
  }
  std::vector<double> values() {
    std::vector<double> out;
    for (NamedParam<T>& p : model.params())
      for (T v : p.param->value.span())
        out.push_back(v);
    return out;
  }
  // Steps k in [from, to) of the run, with gradients `gradient(., k)`.
  void run(Optimizer<T>& opt, const LearningRate& lr, int from, int to) {
    for (int k = from; k < to; ++k) {
      set_gradients(k);
      opt.step(lr(k));
    }
  }
};

template <typename T>
std::vector<double> run(const OptimizerOptions& options, const LearningRate& lr) {
  Net<T> net;
  Optimizer<T> opt(options, net.model);
  net.run(opt, lr, 0, kSteps);
  EXPECT_EQ(opt.steps(), kSteps);
  return net.values();
}

void expect_near(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol) << "value " << i;
}

// float64 agrees with torch to rounding: a few ulps of values below 1.
constexpr double kTol64 = 1e-15;
constexpr double kTol32 = 1e-6;

LearningRate constant(double lr) {
  return [lr](int) { return lr; };
}
// Varies per step, so that each step must use the rate it is given.
LearningRate falling(double base) {
  return [base](int k) { return base * (5 - k) / 5; };
}

OptimizerOptions sgd(double momentum, double weight_decay) {
  return {.kind = OptimizerKind::sgd, .momentum = momentum, .weight_decay = weight_decay};
}
OptimizerOptions adam(double beta1, double beta2, double eps, double weight_decay) {
  return {.kind = OptimizerKind::adam,
          .weight_decay = weight_decay,
          .beta1 = beta1,
          .beta2 = beta2,
          .eps = eps};
}

TEST(Optimizer, ParameterOrderIsTheOneTheExpectedValuesAssume) {
  Net<double> net;
  std::vector<std::string> keys;
  std::vector<std::int64_t> sizes;
  for (NamedParam<double>& p : net.model.params()) {
    keys.push_back(p.key());
    sizes.push_back(p.param->value.numel());
  }
  EXPECT_EQ(keys, (std::vector<std::string>{"c1/weight", "c1/bias", "c2/weight"}));
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{4, 2, 2}));
}

// torch.optim.SGD(lr=0.1)
TEST(Optimizer, SgdPlainMatchesTorch) {
  expect_near(run<double>(sgd(0, 0), constant(0.1)),
              {-0.225, 0.07500000000000001, 0.375, -0.2, 0.10000000000000003, -0.2,
               0.09999999999999998, -0.2},
              kTol64);
}

// torch.optim.SGD(lr=0.1, weight_decay=0.01)
TEST(Optimizer, SgdWeightDecayMatchesTorch) {
  expect_near(
      run<double>(sgd(0, 0.01), constant(0.1)),
      {-0.22362787180174962, 0.074924900075, 0.37347822167674966, -0.1991513738005999,
       0.09885222280114976, -0.19877737267619977, 0.09922622392554985, -0.19840337155179957},
      kTol64);
}

// torch.optim.SGD(lr=0.1, momentum=0.9)
TEST(Optimizer, SgdMomentumMatchesTorch) {
  expect_near(run<double>(sgd(0.9, 0), constant(0.1)),
              {0.15108750000000004, 0.15082500000000001, 0.1035375, -0.3908225, 0.03213999999999999,
               -0.18722, 0.23574250000000005, 0.016382500000000046},
              kTol64);
}

// torch.optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.01), lr 0.05 * (5 - k) / 5 at step k.
const std::vector<double> kSgdMomentumDecay64{
    -0.19748277293280156, 0.014277263195180004, 0.26826441870750156, -0.1853577316552929,
    0.1953673005070287,   -0.23075484985576578, 0.14997018230655582, -0.27615196805623865};
const std::vector<double> kSgdMomentumDecay32{
    -0.19748279452323914, 0.014277268201112747, 0.26826444268226624, -0.1853577345609665,
    0.19536729156970978,  -0.23075485229492188, 0.1499701738357544,  -0.27615195512771606};

TEST(Optimizer, SgdMomentumWeightDecayVaryingRateMatchesTorch) {
  expect_near(run<double>(sgd(0.9, 0.01), falling(0.05)), kSgdMomentumDecay64, kTol64);
}

TEST(Optimizer, SgdFloat32MatchesTorch) {
  expect_near(run<float>(sgd(0.9, 0.01), falling(0.05)), kSgdMomentumDecay32, kTol32);
  // torch.optim.SGD(lr=0.1) on float32 tensors.
  expect_near(
      run<float>(sgd(0, 0), constant(0.1)),
      {-0.2250000238418579, 0.07499999552965164, 0.375, -0.20000000298023224, 0.10000000894069672,
       -0.20000001788139343, 0.09999998658895493, -0.20000000298023224},
      kTol32);
}

// torch.optim.Adam(lr=0.01): betas (0.9, 0.999), eps 1e-8, no weight decay.
TEST(Optimizer, AdamMatchesTorch) {
  expect_near(
      run<double>(adam(0.9, 0.999, 1e-8, 0), constant(0.01)),
      {-0.34703771937855066, 0.001246265797222544, 0.3586642081400518, -0.12975535061237284,
       0.23734615156629585, -0.23918725948018885, 0.12345576657361271, -0.35037141409196493},
      kTol64);
}

// torch.optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), lr 0.01 * (5 - k) / 5
// at step k.
const std::vector<double> kAdamDecay64{
    -0.35437283881397913, -0.0021019180304938014, 0.3614054846686468,  -0.12369366888836736,
    0.24032120057151987,  -0.2398092065842032,    0.12097200642838465, -0.3574518636469419};
const std::vector<double> kAdamDecay32{
    -0.35437285900115967, -0.0021019182167947292, 0.36140549182891846, -0.12369366735219955,
    0.24032120406627655,  -0.23980921506881714,   0.12097200751304626, -0.3574518859386444};

TEST(Optimizer, AdamWeightDecayVaryingRateMatchesTorch) {
  expect_near(run<double>(adam(0.8, 0.99, 1e-6, 0.1), falling(0.01)), kAdamDecay64, kTol64);
}

TEST(Optimizer, AdamFloat32MatchesTorch) {
  expect_near(run<float>(adam(0.8, 0.99, 1e-6, 0.1), falling(0.01)), kAdamDecay32, kTol32);
  // torch.optim.Adam(lr=0.01) on float32 tensors.
  expect_near(
      run<float>(adam(0.9, 0.999, 1e-8, 0), constant(0.01)),
      {-0.34703773260116577, 0.00124626443721354, 0.35866424441337585, -0.12975534796714783,
       0.23734614253044128, -0.23918725550174713, 0.12345577031373978, -0.35037142038345337},
      kTol32);
}

std::vector<std::string> slot_names(const OptimizerOptions& options) {
  Net<double> net;
  Optimizer<double> opt(options, net.model);
  std::map<std::string, Shape4> shapes;
  for (NamedParam<double>& p : net.model.params())
    shapes[p.key()] = p.param->value.shape();
  std::vector<std::string> names;
  for (const OptimizerSlot<double>& s : opt.slots()) {
    names.push_back(s.name);
    // A slot has its parameter's shape, and starts at zero.
    const auto it = shapes.find(s.name.substr(s.name.find('/') + 1));
    if (it == shapes.end()) {
      ADD_FAILURE() << "slot " << s.name << " names no parameter";
      continue;
    }
    EXPECT_EQ(s.tensor->shape(), it->second) << s.name;
    for (double v : s.tensor->span())
      EXPECT_EQ(v, 0.0) << s.name;
  }
  return names;
}

TEST(Optimizer, SlotsAreNamedBySlotLayerAndParam) {
  EXPECT_TRUE(slot_names(sgd(0, 0.01)).empty());
  EXPECT_EQ(
      slot_names(sgd(0.9, 0)),
      (std::vector<std::string>{"momentum/c1/weight", "momentum/c1/bias", "momentum/c2/weight"}));
  EXPECT_EQ(slot_names(adam(0.9, 0.999, 1e-8, 0)),
            (std::vector<std::string>{"exp_avg/c1/weight", "exp_avg/c1/bias", "exp_avg/c2/weight",
                                      "exp_avg_sq/c1/weight", "exp_avg_sq/c1/bias",
                                      "exp_avg_sq/c2/weight"}));
}

// Runs `split` steps, saves the parameters, slots (by name) and step count, restores them into a
// fresh model and optimizer and runs the rest; returns the final values. With `restore_steps`
// false the step count is left at 0, as a checkpoint that forgot it would.
template <typename T>
std::vector<double> resumed(const OptimizerOptions& options, const LearningRate& lr, int split,
                            bool restore_steps) {
  Net<T> first;
  Optimizer<T> saved(options, first.model);
  first.run(saved, lr, 0, split);
  std::map<std::string, std::vector<T>> slots;
  for (const OptimizerSlot<T>& s : saved.slots())
    slots[s.name].assign(s.tensor->span().begin(), s.tensor->span().end());

  Net<T> second;
  auto from = first.model.params();
  auto to = second.model.params();
  for (std::size_t k = 0; k < from.size(); ++k)
    to[k].param->value = from[k].param->value;
  Optimizer<T> restored(options, second.model);
  std::size_t found = 0;
  for (const OptimizerSlot<T>& s : restored.slots()) {
    const auto it = slots.find(s.name);
    if (it == slots.end()) {
      ADD_FAILURE() << "slot " << s.name << " was not saved";
      continue;
    }
    EXPECT_EQ(it->second.size(), static_cast<std::size_t>(s.tensor->numel())) << s.name;
    std::copy(it->second.begin(), it->second.end(), s.tensor->data());
    ++found;
  }
  EXPECT_EQ(found, slots.size());
  if (restore_steps) restored.set_steps(saved.steps());
  second.run(restored, lr, split, kSteps);
  return second.values();
}

TEST(Optimizer, RestoredSlotsAndStepsContinueExactly) {
  for (const OptimizerOptions& o :
       {sgd(0.9, 0.01), sgd(0, 0.01), adam(0.8, 0.99, 1e-6, 0.1), adam(0.9, 0.999, 1e-8, 0)}) {
    const std::vector<double> straight = run<double>(o, falling(0.05));
    for (int split = 1; split < kSteps; ++split) {
      EXPECT_EQ(resumed<double>(o, falling(0.05), split, true), straight) << "split " << split;
      EXPECT_EQ(resumed<float>(o, falling(0.05), split, true), run<float>(o, falling(0.05)))
          << "split " << split;
    }
  }
}

// The step count is part of the state, so the test above also checks that it is restored: left
// at 0, momentum restarts from the gradient and Adam's bias correction from step 1.
TEST(Optimizer, ForgettingTheStepCountChangesTheRun) {
  for (const OptimizerOptions& o : {sgd(0.9, 0.01), adam(0.8, 0.99, 1e-6, 0.1)})
    EXPECT_NE(resumed<double>(o, falling(0.05), 2, false), run<double>(o, falling(0.05)));
}

void expect_error(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no Error thrown";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

TEST(Optimizer, RefusesWhatTorchRefuses) {
  Net<double> net;
  auto make = [&net](const OptimizerOptions& o) {
    return [&net, o] { Optimizer<double>(o, net.model); };
  };
  expect_error(make(sgd(-0.1, 0)), {"momentum", "-0.1"});
  expect_error(make(sgd(0.9, -0.01)), {"weight_decay", "-0.01"});
  expect_error(make(sgd(0.9, std::numeric_limits<double>::quiet_NaN())), {"weight_decay"});
  expect_error(make(adam(1, 0.999, 1e-8, 0)), {"beta1", "[0, 1)"});
  expect_error(make(adam(0.9, -0.5, 1e-8, 0)), {"beta2"});
  expect_error(make(adam(0.9, 0.999, -1e-8, 0)), {"eps"});
  Optimizer<double> opt(sgd(0.9, 0), net.model);
  expect_error([&opt] { opt.step(-0.1); }, {"learning rate", "-0.1"});
  expect_error([&opt] { opt.step(std::numeric_limits<double>::infinity()); }, {"learning rate"});
  EXPECT_EQ(opt.steps(), 0);
}

TEST(Optimizer, ParsesNamesAndListsTheValidOnes) {
  EXPECT_EQ(parse_optimizer("sgd"), OptimizerKind::sgd);
  EXPECT_EQ(parse_optimizer("adam"), OptimizerKind::adam);
  expect_error([] { parse_optimizer("rmsprop"); }, {"'rmsprop'", "sgd", "adam"});
  expect_error([] { parse_optimizer("SGD"); }, {"'SGD'", "sgd, adam"});
  EXPECT_EQ(parse_schedule("constant"), ScheduleKind::constant);
  EXPECT_EQ(parse_schedule("cosine"), ScheduleKind::cosine);
  EXPECT_EQ(parse_schedule("step"), ScheduleKind::step);
  expect_error([] { parse_schedule("linear"); }, {"'linear'", "constant, cosine, step"});
  expect_error([] { parse_schedule(""); }, {"''", "constant, cosine, step"});
}

TEST(Schedule, ConstantIsTheBase) {
  const ScheduleOptions s{.kind = ScheduleKind::constant};
  for (std::int64_t step : {0, 1, 7, 1000000})
    EXPECT_EQ(learning_rate(s, 0.25, step), 0.25);
}

// CosineAnnealingLR(T_max=10) on lr 0.1, steps 0..12.
TEST(Schedule, CosineMatchesTorch) {
  const ScheduleOptions s{.kind = ScheduleKind::cosine, .total_steps = 10};
  const std::vector<double> closed{
      0.1,  0.09755282581475769,   0.09045084971874738, 0.07938926261462366,  0.06545084971874737,
      0.05, 0.03454915028125263,   0.02061073738537635, 0.009549150281252633, 0.0024471741852423235,
      0.0,  0.0024471741852423127, 0.009549150281252623};
  const std::vector<double> stepped{0.1,
                                    0.09755282581475769,
                                    0.09045084971874738,
                                    0.07938926261462367,
                                    0.06545084971874739,
                                    0.05000000000000001,
                                    0.03454915028125264,
                                    0.020610737385376353,
                                    0.009549150281252635,
                                    0.002447174185242324,
                                    0.0,
                                    0.0024471741852423235,
                                    0.009549150281252666};
  for (std::size_t k = 0; k < closed.size(); ++k) {
    const double lr = learning_rate(s, 0.1, static_cast<std::int64_t>(k));
    EXPECT_DOUBLE_EQ(lr, closed[k]) << "step " << k;
    EXPECT_NEAR(lr, stepped[k], 1e-16) << "step " << k;
    EXPECT_NEAR(lr, 0.1 * (1 + std::cos(std::numbers::pi * static_cast<double>(k) / 10)) / 2,
                1e-17);
  }
  EXPECT_EQ(learning_rate(s, 0.1, 10), 0.0);  // exactly 0 at total_steps
}

// StepLR(step_size=3, gamma=0.1) on lr 0.1, steps 0..10; the stepped and closed forms agree.
TEST(Schedule, StepMatchesTorch) {
  const ScheduleOptions s{.kind = ScheduleKind::step, .step_size = 3, .gamma = 0.1};
  const std::vector<double> torch{0.1,
                                  0.1,
                                  0.1,
                                  0.010000000000000002,
                                  0.010000000000000002,
                                  0.010000000000000002,
                                  0.0010000000000000002,
                                  0.0010000000000000002,
                                  0.0010000000000000002,
                                  0.00010000000000000003,
                                  0.00010000000000000003};
  for (std::size_t k = 0; k < torch.size(); ++k) {
    const double lr = learning_rate(s, 0.1, static_cast<std::int64_t>(k));
    EXPECT_DOUBLE_EQ(lr, torch[k]) << "step " << k;
    EXPECT_DOUBLE_EQ(lr, 0.1 * std::pow(0.1, static_cast<double>(k / 3))) << "step " << k;
  }
  const ScheduleOptions half{.kind = ScheduleKind::step, .step_size = 2, .gamma = 0.5};
  EXPECT_EQ(learning_rate(half, 1.0, 0), 1.0);
  EXPECT_EQ(learning_rate(half, 1.0, 1), 1.0);
  EXPECT_EQ(learning_rate(half, 1.0, 2), 0.5);
  EXPECT_EQ(learning_rate(half, 1.0, 7), 0.125);
}

TEST(Schedule, RefusesBadSettings) {
  const ScheduleOptions constant_s{.kind = ScheduleKind::constant};
  expect_error([&] { learning_rate(constant_s, 0.1, -1); }, {"step -1"});
  const ScheduleOptions cosine_s{.kind = ScheduleKind::cosine, .total_steps = 0};
  expect_error([&] { learning_rate(cosine_s, 0.1, 0); }, {"total_steps", "0"});
  const ScheduleOptions step_s{.kind = ScheduleKind::step, .step_size = 0};
  expect_error([&] { learning_rate(step_s, 0.1, 0); }, {"step_size", "0"});
  const ScheduleOptions gamma_s{.kind = ScheduleKind::step, .gamma = -0.5};
  expect_error([&] { learning_rate(gamma_s, 0.1, 0); }, {"gamma", "-0.5"});
}

}  // namespace
}  // namespace tessera
