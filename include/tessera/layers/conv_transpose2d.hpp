// Distributed transposed 2-D convolution (PyTorch's ConvTranspose2d): the same window machinery
// as conv2d with the transposed index map. Each rank fills the input window its output tile
// receives from, computes its tile locally, and in the backward pass accumulates the window
// gradients back into their owners.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "tessera/kernels/conv_kernel.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/layers/fields.hpp"
#include "tessera/layers/window.hpp"

namespace tessera {

// One spatial axis of a transposed convolution (dilation 1): output q receives input i through
// tap j in [0, kernel) when q = i*stride - padding + j. Local and pure.
struct ConvTransposeAxis {
  std::int64_t kernel = 1;
  std::int64_t stride = 1;
  std::int64_t padding = 0;
  std::int64_t output_padding = 0;

  // (in - 1)*stride - 2*padding + (kernel - 1) + output_padding + 1; may be <= 0.
  std::int64_t output_extent(std::int64_t in) const;
  // The input rows that output rows `out` = [qb, qe) receive from, not clipped to the image:
  // [ceil((qb + padding - (kernel - 1)) / stride), floor((qe - 1 + padding) / stride) + 1).
  // Empty when `out` is empty or no input reaches it (kernel < stride leaves gaps).
  Range input_window(Range out) const;
};

struct ConvTranspose2dSpec {
  std::int64_t out_channels = 0;
  Pair kernel{1, 1};
  Pair stride{1, 1};
  Pair padding{0, 0};
  Pair output_padding{0, 0};
  bool bias = true;

  ConvTransposeAxis axis(int a) const;  // 0: rows, 1: columns
};

// Fields: out_channels, kernel, stride=1, padding=0, output_padding=0 (each an int or [h, w];
// output_padding < stride, as PyTorch requires), bias=true. Local; throws an Error naming the
// layer and the field.
ConvTranspose2dSpec parse_conv_transpose2d(const LayerSpec& spec);

template <typename T>
class ConvTranspose2d final : public WindowLayer<T> {
 public:
  ConvTranspose2d(std::string name, const ConvTranspose2dSpec& spec, int tag);

  using WindowLayer<T>::setup;
  Distribution setup(const Distribution& in) override;
  using WindowLayer<T>::forward;
  DistTensor<T> forward(const DistTensor<T>& x, const RunState&) override;
  DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState&) override;
  std::vector<Param<T>*> params() override;
  std::optional<WindowMap> window() const override;
  // Any input layout: the exchange converts into the window's (nchw16c when the kernel reads
  // it). The output is nchw16c where the model allows it and the kernel writes it, else NCHW.
  bool takes_blocked() const override { return true; }
  // The conv kernel that runs the adjoint ("reference", "onednn ..."), or "none" for a tile no
  // input reaches; valid after bind(). Local.
  std::string kernel_name() const { return kernel_ ? kernel_->name() : "none"; }
  // For bench listings: "adjoint <kernel_name()>" (its passes in the adjoint conv's order:
  // forward / backward-data / backward-filter, this layer's backward-data / forward / filter
  // gradient), or "<patch kernel>, input gradient <kernel_name()>". Local.
  std::string kernel_summary() const override;

 private:
  void bind_kernel(const Box& window, const Backend& backend) override;

  ConvTranspose2dSpec spec_;
  // The kernel's map from the window to the output tile: padding shifted by both origins.
  reference::ConvGeometry geometry_;
  Param<T> weight_, bias_;
  // The convolution this layer is the adjoint of, from the output tile to the window, with the
  // same weight: its backward-data is this layer's forward, its forward this layer's
  // backward-data, its backward-filter (roles swapped) this layer's. Null when the window or
  // the tile is empty: no input reaches an output then, and the output is the bias alone.
  std::unique_ptr<ConvKernel<T>> kernel_;
  Layout out_layout_ = Layout::nchw;  // of the output and its gradient: bind_kernel's
  // The bias and its gradient (the adjoint conv has none of its own).
  std::unique_ptr<MergeKernel<T>> bias_kernel_;
  // Where the backend has one for the case (float32, 2x2 stride 2, nchw16c window and output):
  // the forward and the filter gradient, each with its bias in the same pass; kernel_ then runs
  // the backward-data pass alone.
  std::unique_ptr<PatchDeconvKernel> patch_;
};

}  // namespace tessera
