// A model distributed over a process grid: a graph of layers, set up for one global input shape.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/engine/layer.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/profile.hpp"

namespace tessera {

template <typename T>
struct NamedParam {
  std::string layer;
  Param<T>* param;
  std::string key() const { return layer + "/" + param->name; }  // "c1/weight"
};

template <typename T>
struct NamedBuffer {
  std::string layer;
  Buffer<T>* buffer;
  std::string key() const { return layer + "/" + buffer->name; }  // "bn1/running_mean"
};

// Wall time of one layer's passes since the last reset_timings(), and the part of it spent on
// windows and communication (profile.hpp); compute is the rest.
struct PassTiming {
  double seconds = 0;
  ActivityTimes activities;
  double compute() const { return seconds - activities.overhead(); }
};
struct LayerTiming {
  std::string name, type;
  LayerFlops flops;  // per call
  PassTiming forward, backward;
};

template <typename T>
class Model {
 public:
  // Builds every layer for a global input [N, C, H, W] on the runtime's grid and checks every
  // shape and tile; the runtime outlives the model. Local (pure index math); throws an Error
  // naming the layer at fault.
  Model(const ModelSpec& spec, const Runtime& runtime, Shape4 input);
  // A reduction abandoned in flight (an exception) leaves its bucket allocated: a late message
  // may still land.
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelSpec& spec() const { return spec_; }
  const Runtime& runtime() const { return runtime_; }
  // The loss kernel of the runtime's backend, planned once with the model. Local.
  const LossKernel<T>& loss_kernel() const { return *loss_kernel_; }
  const Distribution& input_distribution() const { return input_; }
  const Distribution& output_distribution() const { return nodes_.back().out; }

  RunState& state() { return state_; }  // mode (train / eval), seed and step

  // Collective over the world group (halos over the spatial one, batch norm over all). `x` may
  // lie in host memory on any backend (it is copied to the backend's memory); the output, the
  // gradients and the parameters lie in the backend's memory (Runtime::allocator): read them
  // from the host through to_host (tensor.hpp).
  DistTensor<T> forward(const DistTensor<T>& x);
  // The same with the batch handed over: a layer that keeps its input for backward (the first
  // conv's filter gradient reads it) keeps the batch itself where it is the batch's only consumer
  // and the batch lies in the backend's memory, instead of a copy of it (one pass over the image
  // and its bytes fewer; x is moved from either way). Collective as above.
  DistTensor<T> forward(DistTensor<T>&& x);
  // Returns dL/dinput. Parameter gradients are summed over all ranks of the grid (spatial and
  // sample) in buckets of consecutive layers, each started (Comm::start_allreduce) as soon as the
  // backward pass has left its layers, so the reduction overlaps the rest of the backward pass;
  // until reduce_gradients() they hold unspecified values (on a world of one rank nothing is
  // summed: they are final as backward() returns). Collective over the world group.
  DistTensor<T> backward(const DistTensor<T>& dy);

  void zero_grad();  // local

  // Whether backward() computes dL/dinput (default true; gradcheck compares it). Training does
  // not need it: off, the layers that read only the model's input skip their backward-data and
  // its halo exchange, and backward() returns an empty tensor. Local; set the same on every rank.
  void set_input_grad(bool needed);
  // Completes the reductions backward() started: every rank then holds the gradient of the
  // global loss. Collective over the world group.
  void reduce_gradients();

  // Per layer, in model order; and the part of reduce_gradients() that was not hidden. Local.
  const std::vector<LayerTiming>& timings() const { return timings_; }
  const PassTiming& reduce_timing() const { return reduce_timing_; }
  void reset_timings();
  // With true, each timed pass waits for the backend's kernels (Backend::synchronize) when it
  // begins and ends, so that a GPU's per-layer times are the layers' own rather than the time
  // the host took to enqueue them; the GPU then never runs one layer while the host enqueues the
  // next. Off by default (tessera bench --layer-sync). Local.
  void set_synchronized_timings(bool on) { synchronized_timings_ = on; }

  // The activations their neighbours compute (README "Fused activations"), in layer order: the
  // layer that applies f as it writes its output and the one that applies f' (its consumer, to its
  // input gradient; or its producer, a batch norm, to the gradient it receives), each empty where
  // the activation does it itself. Same on every rank. Local.
  struct ActivationFusion {
    std::string activation, producer, consumer;
  };
  const std::vector<ActivationFusion>& fused_activations() const { return fused_; }
  // The concats whose consumer computes from their inputs directly (Layer::offer_concat; README
  // "Memory-bound layers"), in layer order, with that consumer. Same on every rank. Local.
  struct ConcatTaken {
    std::string concat, consumer;
  };
  const std::vector<ConcatTaken>& concats_taken() const { return concats_taken_; }
  // Each layer's Layer::kernel_summary() where it has one, with its name, in layer order: this
  // rank's (kernels are planned for each rank's shapes). Local.
  std::vector<std::pair<std::string, std::string>> kernel_summaries() const;

  std::vector<NamedParam<T>> params();
  std::vector<NamedBuffer<T>> buffers();
  std::vector<NamedBuffer<T>> masks();  // dropout masks of the last forward, this rank's tile
  std::int64_t parameter_count();
  // Throws the Error of the first layer that cannot train on this input (Layer::check_trainable):
  // drivers that train call it as they build the model, inside their agreement. Local.
  void check_trainable() const;

  // Seeded uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases as PyTorch's default
  // for conv and linear layers, (1, 0) for batch norm's weight and bias, the same on every rank
  // and every grid. Local.
  void init_params(std::uint64_t seed);

 private:
  // forward's body: `owned` the batch the model holds (handed over), else `*borrowed`.
  DistTensor<T> run_forward(const DistTensor<T>* borrowed, std::optional<DistTensor<T>> owned);

  int batch_readers_ = 0;  // inputs that name the batch (-1), counted at construction

  struct Node {
    std::unique_ptr<Layer<T>> layer;
    std::vector<int> inputs;  // node indices; -1 is the model's input
    Distribution out;
    int consumers = 0;   // how many inputs name this node (the last node also feeds the loss)
    bool taken = false;  // a concat its consumer computes from the inputs of: never run
  };
  // Gradients of the layers [first, last) of nodes_, reduced as one message.
  struct Bucket {
    std::size_t first = 0, last = 0;
    std::string what;  // the watchdog's name for its reduction, built once
    // The gradients laid end to end for the Comm: in host memory (flat), or, when the gradients
    // lie on a device the Comm reaches (NCCL), in device memory (device_flat), with no host copy.
    Tensor<T> flat;
    Tensor<T> device_flat;
    Request request;
    bool started = false;
  };
  void build_buckets();
  void start_bucket(std::size_t index);
  void poll_buckets();
  // Whether the buckets travel in device memory (device_flat).
  bool buckets_on_device() const;
  const Backend* timing_sync() const {
    return synchronized_timings_ ? &runtime_.backend() : nullptr;
  }

  ModelSpec spec_;
  const Runtime& runtime_;
  std::unique_ptr<LossKernel<T>> loss_kernel_;
  std::unique_ptr<MergeKernel<T>> merge_kernel_;  // sums the gradients of a shared output
  Distribution input_;
  std::vector<Node> nodes_;
  RunState state_;
  bool input_grad_ = true;
  bool synchronized_timings_ = false;
  std::vector<Bucket> buckets_;  // in backward order: the last layers first
  // The memory whose queue holds uploads of reduced gradients from the buckets' staging buffers
  // (reduce_gradients queues them); nullptr before any.
  const Allocator* uploads_queued_in_ = nullptr;
  std::vector<LayerTiming> timings_;
  PassTiming reduce_timing_;
  std::vector<ActivationFusion> fused_;
  std::vector<ConcatTaken> concats_taken_;
};

// The loss over the global batch and its gradient. `labels` is this rank's part of the labels:
// [N, H, W] of its tile for pixel_cross_entropy, [N] of its samples for cross_entropy; values are
// checked beforehand to lie in [0, C).
template <typename T>
struct LossResult {
  double loss = 0;     // the global mean, identical on every rank
  DistTensor<T> grad;  // dL/dlogits on this rank's tile
};

// With `kernel` (Model::loss_kernel), reduced over `comm`. Collective over the world group.
template <typename T>
LossResult<T> compute_loss(LossKind kind, const DistTensor<T>& logits,
                           std::span<const std::int32_t> labels, const Comm& comm,
                           const LossKernel<T>& kernel);

// One evaluation of the loss and every gradient: zero_grad, forward, loss, backward and the
// gradient reduction. Collective over the world group of the model's runtime.
template <typename T>
struct StepResult {
  double loss = 0;
  DistTensor<T> output;      // logits
  DistTensor<T> input_grad;  // dL/dinput
};
template <typename T>
StepResult<T> forward_backward(Model<T>& model, const DistTensor<T>& input,
                               std::span<const std::int32_t> labels);
// The same with the batch handed over (Model::forward(DistTensor&&)).
template <typename T>
StepResult<T> forward_backward(Model<T>& model, DistTensor<T>&& input,
                               std::span<const std::int32_t> labels);

}  // namespace tessera
