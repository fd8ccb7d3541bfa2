// Distributed 2-D max and average pooling: the window machinery of conv2d (fill the input
// window, pool locally, accumulate window gradients back into their owners), no parameters.
#pragma once

#include <memory>
#include <optional>

#include "tessera/kernels/pool_kernel.hpp"
#include "tessera/layers/fields.hpp"
#include "tessera/layers/window.hpp"
#include "tessera/partition.hpp"

namespace tessera {

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
  // Where the window is the tile (nothing to exchange) and the kernel adds in place
  // (PoolKernel::backward_add): dL/dx added into `grad`, which lies as the window does. Local.
  bool backward_adding(const DistTensor<T>& dy, const RunState&, DistTensor<T>& grad) override;
  std::optional<WindowMap> window() const override;
  // Any input layout: the exchange converts into the window's (nchw16c, or nchw8c for 8, 24, ...
  // channels, when a fast kernel pools it and the model allows the output in it too; NCHW inputs
  // stay NCHW where the backend has a fast NCHW kernel too, so that no conversion runs at the
  // larger resolution).
  bool takes_blocked() const override { return true; }
  // Which kernel pools an input in the layout it prefers ("reference", "onednn ...", "tiled
  // max"), and the one for NCHW inputs where that differs ("none" without); valid after bind().
  // Local.
  std::string kernel_name() const { return kernel_ ? kernel_->name() : "none"; }
  std::string nchw_kernel_name() const { return nchw_kernel_ ? nchw_kernel_->name() : "none"; }

 private:
  void bind_kernel(const Box& window, const Backend& backend) override;
  bool backward_reads_window() const override { return false; }
  // Points active_ at the kernel for an input in `layout` and sets the window up for it.
  void choose_kernel(Layout layout);

  Pool2dSpec spec_;
  std::unique_ptr<PoolKernel<T>> kernel_;
  Layout out_layout_ = Layout::nchw;
  // With kernel_ on a blocked layout: the backend's NCHW kernel when that one is not plain loops.
  std::unique_ptr<PoolKernel<T>> nchw_kernel_;
  PoolKernel<T>* active_ = nullptr;  // the last forward's, for its backward
  // The layout active_ pools in. After bind().
  Layout active_layout() const {
    return active_ == nchw_kernel_.get() ? Layout::nchw : out_layout_;
  }
};

}  // namespace tessera
