// Distributed 2-D max and average pooling: the window machinery of conv2d (fill the input
// window, pool locally, accumulate window gradients back into their owners), no parameters.
#pragma once

#include <optional>
#include <vector>

#include "tessera/kernels/reference_pool.hpp"
#include "tessera/layers/fields.hpp"
#include "tessera/layers/window.hpp"
#include "tessera/partition.hpp"

namespace tessera {

enum class PoolKind { max, avg };

// PyTorch's MaxPool2d / AvgPool2d with dilation 1, ceil_mode=False and (avg)
// count_include_pad=True.
struct Pool2dSpec {
  PoolKind kind = PoolKind::max;
  Pair kernel{1, 1};
  Pair stride{1, 1};
  Pair padding{0, 0};  // both sides

  WindowAxis axis(int a) const;  // 0: rows, 1: columns
};

// Types maxpool2d, avgpool2d. Fields: kernel (required), stride=kernel, padding=0, each an int or
// [h, w]; padding at most kernel / 2 (PyTorch's rule). Local; throws an Error naming the layer
// and the field.
Pool2dSpec parse_pool2d(const LayerSpec& spec);

template <typename T>
class Pool2d final : public WindowLayer<T> {
 public:
  Pool2d(std::string name, const Pool2dSpec& spec, int tag);

  using WindowLayer<T>::setup;
  Distribution setup(const Distribution& in) override;
  // forward and backward: neighbour-wise collective over the spatial communicator (halos).
  using WindowLayer<T>::forward;
  DistTensor<T> forward(const DistTensor<T>& x, const RunState&) override;
  DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState&) override;
  std::optional<WindowMap> window() const override;

 private:
  void bind_kernel(const Box& window) override;

  Pool2dSpec spec_;
  reference::PoolGeometry geometry_;  // on the window: no padding, the image part marked
  std::vector<std::int64_t> argmax_;  // max: per output, its input within the window's plane
};

}  // namespace tessera
