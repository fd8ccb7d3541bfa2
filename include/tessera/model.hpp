// A model distributed over a process grid: its layers, set up for one global input shape.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tessera/layer.hpp"
#include "tessera/model_spec.hpp"

namespace tessera {

template <typename T>
struct NamedParam {
  std::string layer;
  Param<T>* param;
  std::string key() const { return layer + "/" + param->name; }  // "c1/weight"
};

template <typename T>
class Model {
 public:
  // Builds every layer for a global input [N, C, H, W] on `grid` and checks that every tile is
  // non-empty. Local (pure index math); throws an Error naming the layer at fault.
  Model(const ModelSpec& spec, const ProcessGrid& grid, Shape4 input);

  const ModelSpec& spec() const { return spec_; }
  const Distribution& input_distribution() const { return input_; }
  const Distribution& output_distribution() const { return output_; }

  // Collective over the spatial communicator.
  DistTensor<T> forward(const DistTensor<T>& x);
  // Returns dL/dinput; parameter gradients hold this rank's partial sums. Collective over the
  // spatial communicator.
  DistTensor<T> backward(const DistTensor<T>& dy);

  void zero_grad();  // local
  // Sums every parameter gradient over all ranks of the grid (spatial and sample), so that each
  // rank holds the gradient of the global loss. Collective over the grid's communicator.
  void reduce_gradients();

  std::vector<NamedParam<T>> params();
  std::int64_t parameter_count();

  // Seeded uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases, as PyTorch's
  // default; the same on every rank and every grid. Local.
  void init_params(std::uint64_t seed);

 private:
  ModelSpec spec_;
  const ProcessGrid& grid_;
  Distribution input_, output_;
  std::vector<std::unique_ptr<Layer<T>>> layers_;
};

// Mean per-pixel softmax cross-entropy over the global batch. `labels` is this rank's tile of
// [N, H, W] for the logits' distribution, values checked beforehand to lie in [0, C).
template <typename T>
struct LossResult {
  double loss = 0;     // the global mean, identical on every rank
  DistTensor<T> grad;  // dL/dlogits on this rank's tile
};

// Collective over `comm` (every rank of the grid).
template <typename T>
LossResult<T> pixel_cross_entropy(const DistTensor<T>& logits, std::span<const std::int32_t> labels,
                                  MPI_Comm comm);

// One evaluation of the loss and every gradient: zero_grad, forward, loss, backward and the
// gradient reduction. Collective over the grid's communicator.
template <typename T>
struct StepResult {
  double loss = 0;
  DistTensor<T> output;      // logits
  DistTensor<T> input_grad;  // dL/dinput
};
template <typename T>
StepResult<T> forward_backward(Model<T>& model, const DistTensor<T>& input,
                               std::span<const std::int32_t> labels, const ProcessGrid& grid);

}  // namespace tessera
