// Optimizers and learning-rate schedules, with PyTorch's update rules. Parameters and their
// reduced gradients are identical on every rank, so every rank applies the same update: all
// functions here are local.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/engine/model.hpp"

namespace tessera {

enum class OptimizerKind { sgd, adam };

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::sgd;
  double momentum = 0.9;    // sgd (torch.optim.SGD, dampening 0, no Nesterov)
  double weight_decay = 0;  // both: L2 added to the gradient, as torch.optim.SGD / Adam
  double beta1 = 0.9;       // adam
  double beta2 = 0.999;     // adam
  double eps = 1e-8;        // adam
};

OptimizerKind parse_optimizer(const std::string& name);  // "sgd" | "adam"

enum class ScheduleKind { constant, cosine, step };

struct ScheduleOptions {
  ScheduleKind kind = ScheduleKind::constant;
  std::int64_t total_steps = 1;  // cosine: lr decays from base to 0 at total_steps
  std::int64_t step_size = 1;    // step: multiply by gamma every step_size steps
  double gamma = 0.1;
};

ScheduleKind parse_schedule(const std::string& name);  // "constant" | "cosine" | "step"

// The learning rate of step `step` (0-based): constant: base; cosine: base * (1 + cos(pi *
// step / total_steps)) / 2 (torch CosineAnnealingLR's closed form with eta_min 0; past
// total_steps it rises again, as torch's does); step: base * gamma^(step / step_size), integer
// division (torch StepLR). Throws an Error for step < 0, total_steps < 1, step_size < 1 or
// gamma < 0.
double learning_rate(const ScheduleOptions& s, double base, std::int64_t step);

// State kept per parameter (momentum buffer; Adam's first and second moments), named
// "<slot>/<layer>/<param>" (slots "momentum", "exp_avg", "exp_avg_sq") for checkpoints. SGD
// without momentum has none.
template <typename T>
struct OptimizerSlot {
  std::string name;
  Tensor<T>* tensor;
};

// Keeps pointers to `model`'s parameters: the model must outlive the optimizer.
template <typename T>
class Optimizer {
 public:
  // Throws an Error for options torch.optim refuses (negative weight decay or momentum, betas
  // outside [0, 1), negative eps).
  Optimizer(const OptimizerOptions& options, Model<T>& model);

  // Applies one update with learning rate `lr` (finite, >= 0) from the parameters' (reduced)
  // gradients.
  void step(double lr);

  // Updates applied so far. Adam's bias correction uses it, and SGD's momentum buffer starts as
  // the first gradient when it is 0 (torch's rule); a checkpoint restores it with the slots.
  std::int64_t steps() const { return steps_; }
  void set_steps(std::int64_t s) { steps_ = s; }
  std::vector<OptimizerSlot<T>> slots();
  const OptimizerOptions& options() const { return options_; }

 private:
  OptimizerOptions options_;
  std::vector<NamedParam<T>> params_;
  std::vector<Tensor<T>> first_, second_;    // sgd: momentum in first_; adam: exp_avg, exp_avg_sq
  std::unique_ptr<UpdateKernel<T>> kernel_;  // from the model's runtime
  std::int64_t steps_ = 0;
};

}  // namespace tessera
