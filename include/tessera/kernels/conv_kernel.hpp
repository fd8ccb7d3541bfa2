// What a layer asks of a 2-D convolution kernel: one object planned for fixed shapes at bind time,
// executed every step. The reference kernel is one implementation; faster ones (oneDNN) are
// others, handed out by Backend::conv (kernels/backend.hpp). All local: kernels know nothing
// about ranks.
#pragma once

#include <optional>
#include <span>
#include <string>

#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

// The shapes a kernel is planned for: input x [N, C, H, W], weight [O, C/groups, KH, KW] (PyTorch
// layout), output y [N, O, OH, OW]; `bias` says whether the layer has one.
//
// A box kernel (forward_box) reads x from a box of a larger tensor of shape `x_outer` and writes y
// into a box of one of shape `y_outer` (same N and channels, larger or equal H and W): a conv
// recomputes the border strips of its tile that way once the halos arrived. Box kernels serve the
// forward pass only.
//
// `x_layout` is the layout of x and of dx (a halo layer's window and its gradient), `y_layout` of
// y and dy: nchw16c lets oneDNN read and write them with no reorder. Only fast kernels take it
// (Backend::conv).

// Where a box starts in its outer tensor: local row and column (half-open boxes of the planned
// shape from there).
struct BoxAt {
  std::int64_t h = 0;
  std::int64_t w = 0;
  friend bool operator==(const BoxAt&, const BoxAt&) = default;
};

struct ConvShapes {
  Shape4 x, w, y;
  bool bias = true;
  Shape4 x_outer{}, y_outer{};  // box kernels only; empty otherwise
  Layout x_layout = Layout::nchw, y_layout = Layout::nchw;
  // Box kernels with nchw16c boxes: where the boxes are (fixed when planned).
  BoxAt x_at{}, y_at{};
  // (Leaky) ReLU applied to y as the forward writes it (a fused activation, engine/model.cpp);
  // the backward passes take dy of the conv's own output (the activation's backward is done).
  // Only kernels whose applies_activation() says so take it (Backend::conv).
  std::optional<FusedActivation> activation{};
  // Input channels [doubled_begin, doubled_end) of the layer's input hold 2x2 blocks of equal
  // values that start at even global rows and columns (a nearest upsampling by an even factor:
  // Layer::output_doubled); empty: nothing known. All kernels of a layer are told, so that they
  // agree on their precision (the narrow kernels compute such a conv in float32 under
  // --precision bf16). Where x holds those blocks as they are (a tile or a window, not a border
  // strip's partial footprint), doubled_parity says at which parities of global rows and columns
  // x's row 0 and column 0 lie, and a kernel may read one row and one column of a block for all
  // four (the narrow kernel's pair taps: 4 products instead of 9 a 3x3 tap set); it checks that
  // the blocks its outputs read lie inside x. x's rows before doubled_ready_row may be halos that
  // arrive while the kernel computes (a window under Conv2d's overlap: the outputs whose taps
  // read them are computed again): a kernel reads no such row for an output whose taps do not.
  std::int64_t doubled_begin = 0, doubled_end = 0;
  std::optional<BoxAt> doubled_parity{};
  std::int64_t doubled_ready_row = 0;
  // x comes in NCHW whichever kernel computes the conv: the layer's input is produced by one that
  // computes in NCHW (Layer::expect_nchw_input), so a kernel that takes channel blocks would
  // convert it first. The narrow kernels then also take 16 outputs from 16 inputs, which oneDNN
  // computes faster only from nchw16c.
  bool x_nchw = false;
  bool is_box() const { return x_outer.numel() > 0; }
};

// Same contracts as the reference functions of the same names (kernels/reference.hpp): forward
// and backward_data overwrite their output, backward_filter adds into dw and dbias. Tensors must
// have the planned shapes. A backward_filter right after backward_data on the same dy tensor may
// reuse what backward_data derived from it, so dy must not change between the two. Local.
template <typename T>
class ConvKernel {
 public:
  virtual ~ConvKernel() = default;
  virtual void forward(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias,
                       Tensor<T>& y) = 0;
  virtual void backward_data(const Tensor<T>& dy, const Tensor<T>& w, Tensor<T>& dx) = 0;
  virtual void backward_filter(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& dw,
                               std::span<T> dbias) = 0;
  // Box kernels: y's box at `y_at` = conv of x's box at `x_at`, + bias; the rest of y is left
  // as it is. x and y have the planned outer shapes.
  virtual void forward_box(const Tensor<T>& x, BoxAt x_at, const Tensor<T>& w,
                           std::span<const T> bias, Tensor<T>& y, BoxAt y_at) = 0;
  // backward_data and backward_filter at once, in one pass over x and dy, where the kernel offers
  // it (false, nothing done, otherwise: the default): dx overwritten as backward_data does, then
  // multiplied by f' of `f` where one is given, read from x as f's output (the fused input
  // activation of a layer whose window is its tile: WindowLayer::accumulate_window's rule); dw
  // and dbias added into as backward_filter does. Same planned shapes as the two passes. Local.
  virtual bool backward_fused(const Tensor<T>& /*x*/, const Tensor<T>& /*dy*/,
                              const Tensor<T>& /*w*/, const std::optional<FusedActivation>& /*f*/,
                              Tensor<T>& /*dx*/, Tensor<T>& /*dw*/, std::span<T> /*dbias*/) {
    return false;
  }
  // A concat's inputs as x (Layer::offer_concat; Conv2d::windowless): x's channels split over
  // `x` tensors of x's N, H and W in the planned x layout, in channel order, every part but the
  // last a multiple of 16 channels (so each starts on a block of every layout). The three passes
  // as above, with x and dx the parts' concatenation; backward_data_parts overwrites each part of
  // dx. The defaults gather the parts into one tensor and call the passes above (backward-data
  // then scatters dx back into its parts); kernels that read and write the parts where they lie
  // say so in reads_parts(). Host memory. Local.
  virtual void forward_parts(std::span<const Tensor<T>* const> x, const Tensor<T>& w,
                             std::span<const T> bias, Tensor<T>& y);
  virtual void backward_data_parts(const Tensor<T>& dy, const Tensor<T>& w,
                                   std::span<Tensor<T>* const> dx);
  virtual void backward_filter_parts(std::span<const Tensor<T>* const> x, const Tensor<T>& dy,
                                     Tensor<T>& dw, std::span<T> dbias);
  virtual bool reads_parts() const { return false; }
  // Which implementation runs ("reference", "onednn jit:avx512_core", ...), for logs and tests.
  virtual std::string name() const = 0;
  // Whether forward and forward_box apply ConvShapes::activation (planned with one). Local.
  virtual bool applies_activation() const { return false; }
};

extern template class ConvKernel<float>;
extern template class ConvKernel<double>;

// The plain-loop oracle; it accepts every case.
template <typename T>
class ReferenceConv final : public ConvKernel<T> {
 public:
  // `shapes` matter to box kernels only.
  ReferenceConv(const reference::ConvGeometry& g, const ConvShapes& shapes)
      : g_(g), shapes_(shapes) {}
  void forward(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias,
               Tensor<T>& y) override {
    reference::conv2d_forward(x, w, bias, y, g_);
  }
  void backward_data(const Tensor<T>& dy, const Tensor<T>& w, Tensor<T>& dx) override {
    reference::conv2d_backward_data(dy, w, dx, g_);
  }
  void backward_filter(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& dw,
                       std::span<T> dbias) override {
    reference::conv2d_backward_filter(x, dy, dw, dbias, g_);
  }
  // The oracle through copies: the box in, the whole conv, the result out. Each output sums its
  // taps in the same order as in the whole tensor, so the values are bit-identical.
  void forward_box(const Tensor<T>& x, BoxAt x_at, const Tensor<T>& w, std::span<const T> bias,
                   Tensor<T>& y, BoxAt y_at) override;
  std::string name() const override { return "reference"; }

 private:
  reference::ConvGeometry g_;
  ConvShapes shapes_;
};

// Copies the box of `outer` at `at` of `box`'s shape into `box`, or back. Local.
template <typename T>
void copy_box_out(const Tensor<T>& outer, BoxAt at, Tensor<T>& box);
template <typename T>
void copy_box_in(const Tensor<T>& box, Tensor<T>& outer, BoxAt at);

}  // namespace tessera
