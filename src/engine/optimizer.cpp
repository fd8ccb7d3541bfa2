#include "tessera/engine/optimizer.hpp"

#include <cmath>
#include <numbers>
#include <sstream>
#include <utility>

#include "tessera/error.hpp"

namespace tessera {
namespace {

std::string num(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

}  // namespace

OptimizerKind parse_optimizer(const std::string& name) {
  if (name == "sgd") return OptimizerKind::sgd;
  if (name == "adam") return OptimizerKind::adam;
  throw Error("unknown optimizer '" + name + "' (valid: sgd, adam)");
}

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "constant") return ScheduleKind::constant;
  if (name == "cosine") return ScheduleKind::cosine;
  if (name == "step") return ScheduleKind::step;
  throw Error("unknown learning-rate schedule '" + name + "' (valid: constant, cosine, step)");
}

double learning_rate(const ScheduleOptions& s, double base, std::int64_t step) {
  TESSERA_CHECK(step >= 0,
                "learning rate asked for step " + std::to_string(step) + "; steps count from 0");
  switch (s.kind) {
    case ScheduleKind::constant:
      return base;
    case ScheduleKind::cosine: {
      TESSERA_CHECK(s.total_steps >= 1,
                    "cosine schedule needs total_steps >= 1, got " + std::to_string(s.total_steps));
      // CosineAnnealingLR._get_closed_form_lr with eta_min 0, in torch's order of operations so
      // the values agree to the last bit. torch's stepped (recursive) form drifts from it by a
      // few ulps; the closed form is the one a resumed run can reproduce from the step alone.
      const double angle =
          std::numbers::pi * static_cast<double>(step) / static_cast<double>(s.total_steps);
      return base * (1 + std::cos(angle)) / 2;
    }
    case ScheduleKind::step:
      TESSERA_CHECK(s.step_size >= 1,
                    "step schedule needs step_size >= 1, got " + std::to_string(s.step_size));
      TESSERA_CHECK(s.gamma >= 0, "step schedule needs gamma >= 0, got " + num(s.gamma));
      return base * std::pow(s.gamma, static_cast<double>(step / s.step_size));
  }
  throw Error("unknown schedule kind");
}

template <typename T>
Optimizer<T>::Optimizer(const OptimizerOptions& options, Model<T>& model)
    : options_(options),
      params_(model.params()),
      kernel_(model.runtime().backend().template update<T>()) {
  const OptimizerOptions& o = options_;
  // The ranges torch.optim.SGD / Adam accept; `!(x >= 0)` also refuses NaN.
  TESSERA_CHECK(o.weight_decay >= 0,
                "optimizer weight_decay must be >= 0, got " + num(o.weight_decay));
  if (o.kind == OptimizerKind::sgd) {
    TESSERA_CHECK(o.momentum >= 0, "sgd momentum must be >= 0, got " + num(o.momentum));
  } else {
    TESSERA_CHECK(o.beta1 >= 0 && o.beta1 < 1, "adam beta1 must be in [0, 1), got " + num(o.beta1));
    TESSERA_CHECK(o.beta2 >= 0 && o.beta2 < 1, "adam beta2 must be in [0, 1), got " + num(o.beta2));
    TESSERA_CHECK(o.eps >= 0, "adam eps must be >= 0, got " + num(o.eps));
  }
  const bool has_first = o.kind == OptimizerKind::adam || o.momentum != 0;
  for (const NamedParam<T>& p : params_) {
    // Zeros where the parameter lives (the update kernels read the three side by side).
    const Tensor<T>& value = p.param->value;
    if (has_first) first_.emplace_back(value.shape(), Layout::nchw, value.allocator());
    if (o.kind == OptimizerKind::adam)
      second_.emplace_back(value.shape(), Layout::nchw, value.allocator());
  }
}

template <typename T>
void Optimizer<T>::step(double lr) {
  TESSERA_CHECK(std::isfinite(lr) && lr >= 0,
                "learning rate must be finite and >= 0, got " + num(lr));
  const OptimizerOptions& o = options_;
  // Scalars are computed in double and rounded to T once, as torch does when it hands a Python
  // float to a kernel on T tensors; the per-element expressions follow torch's kernels' order.
  const bool decay = o.weight_decay != 0;
  const T wd = static_cast<T>(o.weight_decay);
  if (o.kind == OptimizerKind::sgd) {
    // torch has no momentum buffer before the first step and starts it as a copy of the
    // gradient. With dampening 0 a zero buffer gives the same numbers, but keying on the step
    // count keeps torch's meaning of the state: a step count of 0 is "no buffer", whatever the
    // slot holds, and a checkpoint restores slots and steps together.
    const SgdScalars<T> s{.weight_decay = wd,
                          .momentum = static_cast<T>(o.momentum),
                          .neg_lr = static_cast<T>(-lr),
                          .decay = decay,
                          .first_step = steps_ == 0};
    for (std::size_t k = 0; k < params_.size(); ++k) {
      Param<T>& param = *params_[k].param;
      const MemorySpace space = param.value.space();
      kernel_->sgd(param.value.data_in(space), std::as_const(param.grad).data_in(space),
                   first_.empty() ? nullptr : first_[k].data_in(space), param.value.numel(), s);
    }
  } else {
    const double t = static_cast<double>(steps_ + 1);
    const double bias_correction1 = 1 - std::pow(o.beta1, t);
    const double bias_correction2 = 1 - std::pow(o.beta2, t);
    const AdamScalars<T> s{.weight_decay = wd,
                           .beta1 = static_cast<T>(o.beta1),
                           .one_minus_beta1 = static_cast<T>(1 - o.beta1),
                           .beta2 = static_cast<T>(o.beta2),
                           .one_minus_beta2 = static_cast<T>(1 - o.beta2),
                           .eps = static_cast<T>(o.eps),
                           .neg_step_size = static_cast<T>(-(lr / bias_correction1)),
                           .bias_correction2_sqrt = static_cast<T>(std::sqrt(bias_correction2)),
                           .decay = decay};
    for (std::size_t k = 0; k < params_.size(); ++k) {
      Param<T>& param = *params_[k].param;
      const MemorySpace space = param.value.space();
      kernel_->adam(param.value.data_in(space), std::as_const(param.grad).data_in(space),
                    first_[k].data_in(space), second_[k].data_in(space), param.value.numel(), s);
    }
  }
  ++steps_;
}

template <typename T>
std::vector<OptimizerSlot<T>> Optimizer<T>::slots() {
  std::vector<OptimizerSlot<T>> out;
  const std::string first = options_.kind == OptimizerKind::sgd ? "momentum/" : "exp_avg/";
  for (std::size_t k = 0; k < first_.size(); ++k)
    out.push_back({first + params_[k].key(), &first_[k]});
  for (std::size_t k = 0; k < second_.size(); ++k)
    out.push_back({"exp_avg_sq/" + params_[k].key(), &second_[k]});
  return out;
}

template class Optimizer<float>;
template class Optimizer<double>;

}  // namespace tessera
