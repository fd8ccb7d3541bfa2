// Pointwise layers: no halo, no communication. Local.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "tessera/engine/layer.hpp"
#include "tessera/layers/fields.hpp"

namespace tessera {

struct ActivationSpec {
  ActivationKind kind = ActivationKind::relu;
  double slope = 0;  // leaky_relu: "slope" = 0.01
};

// Types relu, leaky_relu (slope=0.01), sigmoid.
ActivationSpec parse_activation(const LayerSpec& spec);

template <typename T>
class Activation final : public UnaryLayer<T> {
 public:
  Activation(std::string name, const ActivationSpec& spec)
      : UnaryLayer<T>(std::move(name)), spec_(spec) {}
  using UnaryLayer<T>::setup;
  Distribution setup(const Distribution& in) override { return in; }
  using UnaryLayer<T>::forward;
  DistTensor<T> forward(const DistTensor<T>& x, const RunState&) override;
  DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState&) override;
  // Elementwise: any layout, kept.
  bool takes_blocked() const override { return true; }
  bool passes_layout() const override { return true; }
  // Takes the backend's kernel for this activation. Local.
  void bind(const Runtime& runtime) override {
    kernel_ = runtime.backend().activation<T>(spec_.kind, spec_.slope);
  }

  // (Leaky) ReLU, whose f' its output tells, where the backend's kernel works from outputs.
  std::optional<FusedActivation> fusable_activation(const Backend& backend) const override;
  // `by_producer`: its input is already f(x); `by_consumer`: f' is a neighbour's (the gradient it
  // receives is already multiplied by it, or its producer multiplies the gradient it passes on).
  void set_fused(bool by_producer, bool by_consumer) override {
    by_producer_ = by_producer;
    by_consumer_ = by_consumer;
  }
  bool forward_identity() const override { return by_producer_; }
  void keep_forward(const DistTensor<T>& x, const RunState& state) override;
  bool backward_identity() const override { return by_consumer_; }

 private:
  ActivationSpec spec_;
  std::unique_ptr<ActivationKernel<T>> kernel_;
  bool by_producer_ = false, by_consumer_ = false;
};

struct DropoutSpec {
  double p = 0.5;
};

DropoutSpec parse_dropout(const LayerSpec& spec);

// Zeroes each element with probability p in training (scaling the rest by 1 / (1 - p)); the
// identity in evaluation. Whether an element is dropped depends only on (seed, step, layer,
// global sample, channel, global row, global column), never on the grid, so every grid drops
// exactly the elements a single rank would.
template <typename T>
class Dropout final : public UnaryLayer<T> {
 public:
  Dropout(std::string name, const DropoutSpec& spec)
      : UnaryLayer<T>(std::move(name)), spec_(spec) {}
  using UnaryLayer<T>::setup;
  Distribution setup(const Distribution& in) override { return in; }
  void bind(const Runtime& runtime) override { kernel_ = runtime.backend().dropout<T>(spec_.p); }
  using UnaryLayer<T>::forward;
  DistTensor<T> forward(const DistTensor<T>& x, const RunState& state) override;
  DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState& state) override;
  std::vector<Buffer<T>*> masks() override {
    if (mask_.value.numel() == 0) return {};
    return {&mask_};
  }

 private:
  DropoutSpec spec_;
  Buffer<T> mask_{"mask", {}};  // 0 or 1 / (1 - p) per element; empty in evaluation
  std::unique_ptr<DropoutKernel<T>> kernel_;
};

}  // namespace tessera
