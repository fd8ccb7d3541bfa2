// A distributed layer: sets itself up for an input distribution (shapes, halo plans), then runs
// forward and backward on its rank's tiles.
#pragma once

#include <string>
#include <vector>

#include "tessera/dist_tensor.hpp"
#include "tessera/process_grid.hpp"

namespace tessera {

// A trainable tensor in PyTorch layout; `grad` holds this rank's partial sum until the model
// reduces it over all ranks.
template <typename T>
struct Param {
  std::string name;  // "weight" or "bias"
  Tensor<T> value;
  Tensor<T> grad;
};

template <typename T>
class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const std::string& name() const { return name_; }

  // Checks the input, allocates parameters, builds halo plans; returns the output distribution.
  // Local (plans are pure index math); throws an Error naming the layer.
  virtual Distribution setup(const Distribution& in, const ProcessGrid& grid) = 0;

  // Collective over the spatial communicator when the layer exchanges halos, else local.
  virtual DistTensor<T> forward(const DistTensor<T>& x) = 0;
  // Returns dL/dx and adds this rank's share of dL/dparam into each Param::grad.
  // Collective over the spatial communicator when the layer exchanges halos, else local.
  virtual DistTensor<T> backward(const DistTensor<T>& dy) = 0;

  virtual std::vector<Param<T>*> params() { return {}; }

 private:
  std::string name_;
};

}  // namespace tessera
