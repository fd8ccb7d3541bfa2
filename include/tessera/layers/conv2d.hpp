// Distributed 2-D convolution: fills its input window from the neighbours, convolves locally,
// and in the backward pass accumulates window gradients back into their owners.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "tessera/kernels/conv_kernel.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/layers/fields.hpp"
#include "tessera/layers/window.hpp"
#include "tessera/partition.hpp"

namespace tessera {

struct Conv2dSpec {
  std::int64_t out_channels = 0;
  Pair kernel{1, 1};
  Pair stride{1, 1};
  Pair dilation{1, 1};
  Pair pad_begin{0, 0};  // top, left
  Pair pad_end{0, 0};    // bottom, right ("same" may be asymmetric)
  std::int64_t groups = 1;
  bool bias = true;

  WindowAxis axis(int a) const;  // 0: rows, 1: columns
};

// Fields: out_channels, kernel, stride=1, padding=0 (int, [h, w], "same", "valid"), dilation=1,
// groups=1, bias=true. Local; throws an Error naming the layer and the field.
Conv2dSpec parse_conv2d(const LayerSpec& spec);

template <typename T>
class Conv2d final : public WindowLayer<T> {
 public:
  Conv2d(std::string name, const Conv2dSpec& spec, int tag);

  using WindowLayer<T>::setup;
  Distribution setup(const Distribution& in) override;
  using WindowLayer<T>::forward;
  DistTensor<T> forward(const DistTensor<T>& x, const RunState&) override;
  DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState&) override;
  std::vector<Param<T>*> params() override;
  std::optional<WindowMap> window() const override;
  // Forward 2 * N * O * OH * OW * (C / groups) * KH * KW on this rank's output tile; backward
  // twice that (backward-data and backward-filter), or once without an input gradient.
  LayerFlops flops() const override;
  // The kernel's name, with ", windowless" where windowless(). Local.
  std::string kernel_summary() const override;
  // Any input layout: the exchange converts into the window's.
  bool takes_blocked() const override { return true; }
  // Whether the backend computes this conv with NCHW kernels only (Backend::conv_in_nchw), decided
  // from the global shapes, so the same on every rank. Valid after setup(). Local.
  bool computes_in_nchw(const Backend& backend) const override;
  // (Leaky) ReLU as the kernels' post-op, where they take it (oneDNN). Local.
  void offer_output_activation(const FusedActivation& f) override { offered_ = f; }
  // Every kernel of the layer is told which input channels come in 2x2 blocks
  // (ConvShapes::doubled_begin: the first run of channels of doubled inputs); the tile's kernel
  // also where its input lies and where its own rows start. Local.
  void offer_doubled_inputs(std::vector<bool> doubled) override { doubled_ = std::move(doubled); }
  bool output_activation_fused() const override { return activation_.has_value(); }
  // The kernel bind() planned for this rank's shapes (oneDNN or the reference), for logs and
  // tests; null before bind(). Local.
  const ConvKernel<T>* kernel() const { return kernel_.get(); }
  // How many passes the forward computes on the window path: 0 when it computes the whole tile
  // after the halos arrived; else 1 for the whole tile while they travel, plus the border strips
  // after. 0 for a windowless conv (border_strips). Local.
  std::size_t overlap_regions() const { return regions_.empty() ? 0 : 1 + regions_.size(); }
  // Whether bind() planned the conv without a window (Runtime::windowless): the whole tile from
  // the tile itself with the kernel's zero padding, then the border strips that read halos again
  // from strip buffers of their own (exchanged per side, with their own kernels), and in backward
  // the strips' gradients into the neighbours' tiles and their filter-gradient terms. Taken by
  // stride-1 convolutions larger than 1x1 whose input and output tiles coincide on every rank,
  // with an interior that reads no halo on every rank, at most 16 input channels or a multiple of
  // 16 (any number from a concat's inputs), in host memory; the same on every rank. With a concat
  // taken (offer_concat), where the kernel computes from the concat's inputs as they lie, or is
  // the reference (Backend::conv_takes_parts): the tile's passes take each input's tile
  // (ConvKernel::forward_parts; the reference gathers them, inputs in another layout than the
  // kernel's are copied), and each input fills its channels of the strip buffers and takes its
  // part of their gradient. The strips'
  // exchanges always overlap the tile's pass (Runtime::overlap does not apply). Local.
  bool windowless() const { return windowless_; }
  // The windowless border strips this rank computes (the sides with neighbours). Local.
  std::size_t border_strips() const;

 private:
  // Plans the kernel for this rank's fixed shapes (window, local samples, output tile), once.
  void bind_kernel(const Box& window, const Backend& backend) override;
  bool reads_input_through_window() const override { return true; }
  // Plans regions_ for the window (box `window`, local shape `x`) and the output tile (local shape
  // `y`) in these layouts; false when some box kernel declines them.
  bool plan_regions(const Box& window, const Shape4& x, const Shape4& y, Layout x_layout,
                    Layout y_layout, const Backend& backend);
  // Whether every rank can compute this conv windowless (see windowless()): pure in the
  // distributions and the spec. Local.
  bool windowless_fits(const Backend& backend) const;
  // Plans strips_ for the layouts; false when some strip kernel declines them.
  bool plan_strips(const Shape4& x, const Shape4& y, Layout x_layout, Layout y_layout,
                   const Backend& backend);
  // The first run of input channels that come in 2x2 blocks (offer_doubled_inputs), [first,
  // second): ConvShapes::doubled_begin for every kernel of the layer. Local.
  std::pair<std::int64_t, std::int64_t> doubled_channels() const;
  // The shapes every kernel of the layer is planned with: x, the weights, y and the bias, with
  // what the model told the layer about its input (doubled_channels, nchw_input_expected), so
  // that the tile's, the regions' and the strips' kernels agree; each call site adds its layouts,
  // boxes and activation. Local.
  ConvShapes layer_shapes(const Shape4& x, const Shape4& y, bool bias) const;
  DistTensor<T> forward_windowless(const DistTensor<T>& x);
  DistTensor<T> backward_windowless(const DistTensor<T>& dy);
  // Whether backward_windowless may apply a ReLU's f' in the tile's fused backward and again on
  // the boxes its neighbours' strips add into (strips, a fused ReLU, NCHW in host memory). Local.
  bool relu_gate_fusable() const;
  // dx *= ReLU's f' read from x (its output), on `box` (global coordinates) of the tile. Local.
  void gate_box(const Tensor<T>& x, Tensor<T>& dx, const Box& box) const;

  Conv2dSpec spec_;
  reference::ConvGeometry geometry_;
  Param<T> weight_, bias_;
  std::unique_ptr<ConvKernel<T>> kernel_;
  // With overlap(), halos to receive and an interior that needs none: the border strips of
  // the output tile (top, bottom, left, right; the empty ones left out), computed again after the
  // halos arrived, each by a box kernel planned at bind. Empty: no overlap.
  struct Region {
    BoxAt in, out;  // local offsets in the window and in the output tile
    std::unique_ptr<ConvKernel<T>> kernel;
  };
  std::vector<Region> regions_;
  // Windowless: one per side (top, bottom, left, right) where some rank has a neighbour, in that
  // order on every rank. `box`: this rank's output strip there (global; may be empty while
  // others' are not: the exchanges run all the same); `footprint`: the input it reads.
  struct Strip {
    Box box, footprint;
    BoxAt at;  // box within the output tile
    // The footprint's values from their owners (fill); its gradient's parts that other ranks own
    // back to them (accumulate: the plan without its own part, which the tile's pass computes).
    // One of each per input: x, or each of a concat's inputs into its channels (firsts_).
    std::vector<HaloExchange<T>> fill, accumulate;
    Tensor<T> x;                              // fill's buffer, kept for the filter gradient
    std::unique_ptr<ConvKernel<T>> forward;   // box kernel: x -> the strip of y (with bias)
    std::unique_ptr<ConvKernel<T>> backward;  // dy's strip -> x's gradient; filter, no bias
    Tensor<T> dy, grad;  // backward's: dy's strip (a copy), the footprint's gradient
  };
  bool windowless_ = false;
  reference::ConvGeometry padded_;  // the tile's kernel's geometry when windowless
  Layout x_layout_ = Layout::nchw;  // the layout the tile's kernel reads x in when windowless
  std::vector<Strip> strips_;
  std::vector<std::int64_t> firsts_;  // windowless: each input's first channel in x
  Layout out_layout_ = Layout::nchw;
  std::optional<FusedActivation> offered_, activation_;  // activation_: taken by the kernels
  std::vector<bool> doubled_;                            // offer_doubled_inputs
};

}  // namespace tessera
