// A distributed layer: sets itself up for its input distributions (shapes, parameters), binds to
// a runtime (halo exchanges on its Comm, kernels from its Backend), then runs forward and backward
// on its rank's tiles.
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessera/dist_tensor.hpp"
#include "tessera/error.hpp"
#include "tessera/runtime.hpp"

namespace tessera {

// A trainable tensor in PyTorch layout; `grad` holds this rank's partial sum until the model
// reduces it over all ranks.
template <typename T>
struct Param {
  std::string name;  // "weight" or "bias"
  Tensor<T> value;
  Tensor<T> grad;
};

// A tensor the layer updates itself (batch norm's running statistics), replicated on all ranks.
template <typename T>
struct Buffer {
  std::string name;  // "running_mean", "running_var"
  Tensor<T> value;
};

enum class Mode { train, eval };

// What setup() does with the parameters and buffers it declares: allocates them, or only counts
// their elements (tessera plan and the memory check before a run: neither may allocate what it is
// about to refuse).
enum class Parameters { allocate, count };

// What a step is, for the layers whose behaviour depends on it (batch norm, dropout).
struct RunState {
  Mode mode = Mode::train;
  std::uint64_t seed = 0;  // dropout masks
  std::int64_t step = 0;
};

// Arithmetic of one forward and one backward pass on this rank's tiles, in floating-point
// operations (a multiply-add is 2), for GFLOP/s in `tessera bench`. Zero for layers whose time is
// memory traffic (pointwise, pooling, batch norm).
struct LayerFlops {
  double forward = 0;
  double backward = 0;
};

// For halo layers: the input rows (columns) that a range of output rows (columns) reads, not
// clipped to the image. The same map serves the exchange and `tessera plan`.
struct WindowMap {
  std::function<Range(Range)> rows;
  std::function<Range(Range)> cols;
};

template <typename T>
class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const std::string& name() const { return name_; }

  // Checks the inputs, allocates parameters; returns the output distribution. Local and pure;
  // throws an Error naming the layer.
  virtual Distribution setup(std::span<const Distribution> inputs) = 0;
  // Builds what needs the runtime: halo exchanges on its Comm, kernels from its Backend. The
  // runtime outlives the layer. Local.
  virtual void bind(const Runtime&) {}

  // Collective over the spatial communicator when the layer exchanges halos or reduces
  // statistics (batch norm: over the grid), else local.
  virtual DistTensor<T> forward(std::span<const DistTensor<T>* const> inputs,
                                const RunState& state) = 0;
  // Returns dL/dinput for each input and adds this rank's share of dL/dparam into each
  // Param::grad. Same collectiveness as forward.
  virtual std::vector<DistTensor<T>> backward(const DistTensor<T>& dy, const RunState& state) = 0;
  // backward() for a layer of one input whose gradient another consumer of that input has given
  // already (a U-Net's skip connection: the input goes to a pooling and a concat): adds
  // dL/dinput into `grad` as it computes it, where the layer can (max pooling whose window is
  // its tile: no buffer written for the model to add and free); false, nothing done, otherwise
  // (the default: the model calls backward and adds). Same collectiveness as backward where it
  // returns false; local where it returns true (nothing to exchange).
  virtual bool backward_adding(const DistTensor<T>& /*dy*/, const RunState& /*state*/,
                               DistTensor<T>& /*grad*/) {
    return false;
  }

  virtual std::vector<Param<T>*> params() { return {}; }
  virtual std::vector<Buffer<T>*> buffers() { return {}; }
  // What the last forward drew at random (dropout's mask, scaled), on this rank's tile; for
  // dumps that let other tools replay the step.
  virtual std::vector<Buffer<T>*> masks() { return {}; }
  // Halo layers say which inputs each output reads; pointwise layers return nothing.
  virtual std::optional<WindowMap> window() const { return std::nullopt; }
  // Valid after setup(). Local.
  virtual LayerFlops flops() const { return {}; }
  // Throws an Error naming the layer where its training forward cannot compute from the global
  // shape it was set up for (batch norm: one value per channel); evaluation may still. Valid
  // after setup(). Local.
  virtual void check_trainable() const {}
  // What computes the layer on this rank where it has a choice (a conv's kernel, and whether it
  // runs windowless), for bench listings; empty otherwise. Valid after bind(). Local.
  virtual std::string kernel_summary() const { return {}; }

  // Memory layouts (DistTensor::layout). A layer that takes nchw16c inputs says so; one whose
  // output lies as its input does (pointwise) says that too. The model allows a layer to give
  // nchw16c output, before bind(), only where every consumer takes it. Local.
  virtual bool takes_blocked() const { return false; }
  virtual bool passes_layout() const { return false; }
  // Whether the layer's kernels on `backend` read and write NCHW only (Backend::conv_in_nchw):
  // the model then gives it NCHW inputs and expects NCHW output from it. Valid after setup().
  // Local.
  virtual bool computes_in_nchw(const Backend& /*backend*/) const { return false; }
  void allow_blocked_output(bool allowed) { blocked_output_allowed_ = allowed; }
  bool blocked_output_allowed() const { return blocked_output_allowed_; }
  // Whether the layer's one input comes from a layer allowed blocked output (set by the model
  // before bind()): a hint for planning (a 1x1 conv plans its window, which is its tile, in the
  // blocked layout of its channels), not a promise; an input in another layout is converted.
  void expect_blocked_input(bool expected) { blocked_input_expected_ = expected; }
  bool blocked_input_expected() const { return blocked_input_expected_; }
  // Whether every input (of the concat the layer reads, every input of the concat) comes in NCHW
  // whatever the layer asks: from the model's batch or a layer that computes in NCHW
  // (computes_in_nchw), through layers that pass their input's layout on. Set by the model before
  // bind(), and before it asks computes_in_nchw and offers concats (a conv that knows its input
  // comes in NCHW may take a kernel that reads NCHW only: ConvShapes::x_nchw). Local.
  void expect_nchw_input(bool expected) { nchw_input_expected_ = expected; }
  bool nchw_input_expected() const { return nchw_input_expected_; }

  // Activations fused into their neighbours (engine/model.cpp decides before bind(); every rank
  // decides the same). A producer offered f applies it to its output as it computes it (oneDNN's
  // post-op) where its kernels can; a halo layer offered f applies f' to its input gradient, read
  // from the window it keeps, which holds f's output. bind() takes what it can; the *_fused()
  // say, after bind(), what it took. Local.
  virtual void offer_output_activation(const FusedActivation&) {}
  virtual bool output_activation_fused() const { return false; }
  virtual void offer_input_activation_grad(const FusedActivation&) {}
  virtual bool input_activation_grad_fused() const { return false; }
  // A producer that applies f may apply f' as well, to the gradient its backward receives, where
  // no consumer does (an activation with several consumers, or one that applies none): batch
  // norm, from f's output computed again from the input it keeps. Asked after bind(), only of a
  // producer whose output_activation_fused(); true when it will. Local.
  virtual bool take_output_activation_grad() { return false; }
  // An activation its neighbours may compute says which (on `backend`'s kernels; before bind),
  // and is told after the neighbours' bind whether its producer applies f and its consumer f'.
  // Local.
  virtual std::optional<FusedActivation> fusable_activation(const Backend&) const {
    return std::nullopt;
  }
  virtual void set_fused(bool /*by_producer*/, bool /*by_consumer*/) {}
  // An activation whose neighbours compute it: with forward_identity(), its output is its one
  // input as it is (the model moves the tensor through and calls keep_forward, where the layer
  // keeps what its backward needs, instead of forward); with backward_identity(), its input
  // gradient is its output gradient as it is (the model moves it through, calling nothing). Fixed
  // after the model's bind. Local.
  virtual bool forward_identity() const { return false; }
  virtual void keep_forward(const DistTensor<T>& /*x*/, const RunState&) {}
  virtual bool backward_identity() const { return false; }

  // Handing over: where this layer is its one input's only consumer (and that input is another
  // layer's output), the model moves the input into take_input() right after forward(), so that a
  // layer keeping its input for backward (batch norm; a window that is the tile itself) takes the
  // tensor over instead of copying it. Set by the model before bind(), the same on every rank;
  // take_input drops the tensor unless the layer keeps it. Local.
  void hand_over_input(bool handed) { input_handed_over_ = handed; }
  bool input_handed_over() const { return input_handed_over_; }
  virtual void take_input(DistTensor<T>&& /*x*/) {}

  // The same for a taken concat's inputs (offer_concat): the model moves input k into
  // take_concat_input(k, x) right after forward() where no layer reads it after this one (the
  // readers of other taken concats included) and it appears once among the concat's inputs. Set by
  // the model after bind(), the same on every rank; take_concat_input drops the tensor unless the
  // layer keeps it. Local.
  void hand_over_concat_inputs(std::vector<bool> handed) { concat_handed_ = std::move(handed); }
  bool concat_input_handed_over(std::size_t k) const {
    return k < concat_handed_.size() && concat_handed_[k];
  }
  virtual void take_concat_input(std::size_t /*k*/, DistTensor<T>&& /*x*/) {}

  // A concat whose only consumer is this layer: the model offers the concat's inputs (their
  // distributions, in the concat's order) after setup() and before bind(), with the backend the
  // layer will compute on. A layer that takes them (it says so at once, in the return value and
  // in concat_taken()) computes from them as they are — a halo layer fills each into its channels
  // of the window, so the concatenated tensor is never made — and returns one gradient per input.
  // The model then gives the layer the concat's inputs in place of the concat's output, runs the
  // concat no more, and lets the inputs' producers give the layouts this layer takes. Local.
  virtual bool offer_concat(std::vector<Distribution> /*inputs*/, const Backend& /*backend*/) {
    return false;
  }
  virtual bool concat_taken() const { return false; }

  // Whether every output value lies in a 2x2 block of equal values that starts at an even global
  // row and column (a nearest upsampling by an even factor): a consumer's kernel may read each
  // block once (ConvShapes::doubled_begin). Valid after setup(). Local.
  virtual bool output_doubled() const { return false; }
  // Which of this layer's inputs are such outputs (output_doubled): one flag per input, or per
  // input of the concat it took (offer_concat). The model offers them after the concats and
  // before bind(), the same on every rank. Local.
  virtual void offer_doubled_inputs(std::vector<bool> /*doubled*/) {}

  // Whether backward() must return dL/dinput. The model clears it for the layers that read only
  // the model's input when nobody asks for its gradient (training): such a layer may then return
  // empty tensors (DistTensor{}) for its inputs and skip the work. Every rank sets the same.
  void set_input_grad(bool needed) { input_grad_ = needed; }
  bool input_grad() const { return input_grad_; }

  // Whether setup() allocates its parameters (the default) or only counts them; set by
  // set_up_layers before setup(). Local.
  void set_parameters(Parameters p) { parameters_ = p; }
  // Elements of the parameter values setup() declared (each has a gradient of the same size).
  // Valid after setup(). Local.
  std::int64_t parameter_elements() const { return parameter_elements_; }

  // Where the layer allocates the tensors it computes: its backend's memory (Backend::allocator),
  // set by the model before bind(); host memory by default. Local.
  void use_allocator(Allocator& allocator) { allocator_ = &allocator; }
  Allocator& allocator() const { return *allocator_; }

 protected:
  // For setup(): a parameter of `shape`, its value filled with `fill`, its gradient zeros; with
  // Parameters::count two empty tensors. Counted either way; a shape whose element count does not
  // fit 64 bits is an Error naming the layer.
  Param<T> make_param(std::string name, const Shape4& shape, T fill = T(0)) {
    parameter_elements_ += declared_elements(name, shape);
    if (parameters_ == Parameters::count) return {std::move(name), {}, {}};
    return {std::move(name), Tensor<T>(shape, fill), Tensor<T>(shape)};
  }
  // A buffer of `shape` filled with `fill`; empty with Parameters::count.
  Buffer<T> make_buffer(std::string name, const Shape4& shape, T fill = T(0)) {
    declared_elements(name, shape);
    if (parameters_ == Parameters::count) return {std::move(name), {}};
    return {std::move(name), Tensor<T>(shape, fill)};
  }

 private:
  std::int64_t declared_elements(const std::string& what, const Shape4& s) const {
    std::int64_t n = 0;
    if (__builtin_mul_overflow(s.n, s.c, &n) || __builtin_mul_overflow(n, s.h, &n) ||
        __builtin_mul_overflow(n, s.w, &n) || __builtin_add_overflow(n, parameter_elements_, &n))
      throw Error("layer '" + name_ + "': its " + what + " of shape " + s.str() +
                  " has more elements than 64-bit sizes hold");
    return s.numel();
  }

  Parameters parameters_ = Parameters::allocate;
  std::int64_t parameter_elements_ = 0;
  Allocator* allocator_ = &host_allocator();
  std::string name_;
  bool input_grad_ = true;
  bool blocked_output_allowed_ = false;
  bool blocked_input_expected_ = false;
  bool nchw_input_expected_ = false;
  bool input_handed_over_ = false;
  std::vector<bool> concat_handed_;
};

// A layer with one input.
template <typename T>
class UnaryLayer : public Layer<T> {
 public:
  using Layer<T>::Layer;

  virtual Distribution setup(const Distribution& in) = 0;
  virtual DistTensor<T> forward(const DistTensor<T>& x, const RunState& state) = 0;
  virtual DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState& state) = 0;

  Distribution setup(std::span<const Distribution> inputs) final { return setup(inputs[0]); }
  DistTensor<T> forward(std::span<const DistTensor<T>* const> inputs,
                        const RunState& state) override {
    return forward(*inputs[0], state);
  }
  std::vector<DistTensor<T>> backward(const DistTensor<T>& dy, const RunState& state) override {
    std::vector<DistTensor<T>> out;
    out.push_back(backward_one(dy, state));
    return out;
  }
};

}  // namespace tessera
