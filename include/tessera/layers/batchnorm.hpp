// Distributed 2-D batch normalisation, exact on every grid: in training the statistics are those
// of the whole global batch (every sample and every pixel, over all spatial and sample ranks),
// as on one device, not per tile.
#pragma once

#include <optional>
#include <vector>

#include "tessera/engine/layer.hpp"
#include "tessera/layers/fields.hpp"

namespace tessera {

struct BatchNormSpec {
  double eps = 1e-5;      // > 0
  double momentum = 0.1;  // in [0, 1]; PyTorch's momentum=None (cumulative average) is not offered
};

// Fields: eps=1e-5 (> 0), momentum=0.1 (in [0, 1]). Local; throws an Error naming the layer and
// the field.
BatchNormSpec parse_batchnorm(const LayerSpec& spec);

// As torch.nn.BatchNorm2d(C, eps, momentum) with affine=True and track_running_stats=True.
// Params weight [C] (init 1) and bias [C] (init 0); buffers running_mean [C] (init 0) and
// running_var [C] (init 1), the same on every rank.
// Training: normalises with the batch mean and biased variance (one pass summing x - K and
// (x - K)^2 around the running mean K, one allreduce; a second pass and allreduce summing
// (x - mean)^2 where that lost precision: elementwise::batchnorm_moments), and updates
// running = (1 - momentum) * running + momentum * batch statistic, with the unbiased variance.
// Its backward needs one more allreduce (the sums of dy and dy * xhat). Forward and backward are
// then collective over the world group. With a world of one rank and a kernel that trains alone
// (the CUDA kernel: BatchNormKernel::trains_alone) the kernel computes the same statistics where
// it computes and keeps them, and the running statistics, there until buffers() asks for them.
// Evaluation: normalises with the running statistics; pointwise and local.
template <typename T>
class BatchNorm2d final : public UnaryLayer<T> {
 public:
  BatchNorm2d(std::string name, const BatchNormSpec& spec)
      : UnaryLayer<T>(std::move(name)), spec_(spec) {}

  using UnaryLayer<T>::setup;
  Distribution setup(const Distribution& in) override;
  // Refuses a batch with one value per channel (N * H * W = 1), which has no variance to train
  // with (PyTorch: "Expected more than 1 value per channel when training"); a training forward
  // asks too.
  void check_trainable() const override;
  // Takes the Comm its statistics are reduced over and the backend's batch-norm kernel. Local.
  void bind(const Runtime& runtime) override {
    store_running();
    comm_ = &runtime.comm();
    kernel_ = runtime.backend().batch_norm<T>();
    may_train_alone_ = runtime.options().batchnorm_alone && kernel_->trains_alone();
    activation_.reset();
    activation_grad_ = false;
    if (offered_ && kernel_->applies(*offered_)) activation_ = offered_;
  }
  // The (leaky) ReLU that follows, applied as the normalised values are written where the
  // backend's kernel can (CPU); its derivative goes with the consumer where that takes it (a halo
  // layer, from its window), else with this layer's backward passes
  // (BatchNormKernel::backward_sums_activated), which compute f's output again from the kept
  // input: the activation then keeps no mask and makes no pass. Local.
  void offer_output_activation(const FusedActivation& f) override { offered_ = f; }
  bool output_activation_fused() const override { return activation_.has_value(); }
  bool take_output_activation_grad() override {
    activation_grad_ = activation_.has_value();
    return activation_grad_;
  }
  using UnaryLayer<T>::forward;
  DistTensor<T> forward(const DistTensor<T>& x, const RunState& state) override;
  DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState& state) override;
  // Keeps a handed-over input for backward instead of the forward's copy. Local.
  void take_input(DistTensor<T>&& x) override;
  std::vector<Param<T>*> params() override { return {&weight_, &bias_}; }
  // The running statistics, in host memory: copied there first where the kernel trains alone
  // (BatchNormKernel::trains_alone); the next training forward takes them from there. A snapshot
  // then: once a training forward has run, the kernel's are newer, what the pointers read is
  // stale and what is written through them is overwritten by the next call (read or write them
  // right away, as checkpoints do). Local.
  std::vector<Buffer<T>*> buffers() override {
    store_running();
    return {&running_mean_, &running_var_};
  }
  // Pointwise: takes nchw16c and gives its output (and input gradient) in its input's layout.
  bool takes_blocked() const override { return true; }
  bool passes_layout() const override { return true; }

 private:
  BatchNormSpec spec_;
  const Comm* comm_ = nullptr;
  std::unique_ptr<BatchNormKernel<T>> kernel_;
  std::optional<FusedActivation> offered_, activation_;  // offered; taken at bind
  bool activation_grad_ = false;                         // backward applies activation_'s f'
  std::int64_t count_ = 0;  // values per channel in the global batch: N * H * W
  Shape4 shape_;            // the global input
  Param<T> weight_, bias_;
  Buffer<T> running_mean_, running_var_;
  // What the forward normalised with, for backward: its input, the statistics, and whether they
  // were the batch's (training) or the running ones (evaluation).
  Tensor<T> x_;
  Layout layout_ = Layout::nchw;
  std::vector<double> mean_, invstd_;
  Mode mode_ = Mode::train;
  // Whether the last forward trained alone (its statistics are the kernel's), and whether the
  // kernel's running statistics are newer than running_mean_ and running_var_.
  bool may_train_alone_ = false, alone_ = false, running_in_kernel_ = false;
  // Brings the kernel's running statistics into running_mean_ and running_var_ where they are
  // newer. Local.
  void store_running();
  BatchNormTraining training() const {
    return {.count = static_cast<double>(count_), .eps = spec_.eps, .momentum = spec_.momentum};
  }
};

}  // namespace tessera
