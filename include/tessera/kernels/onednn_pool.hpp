// oneDNN (libdnnl) 2-D max and average pooling, float32: forward (training) and backward
// primitives planned once for fixed shapes, executed every step. Built only when
// TESSERA_HAVE_ONEDNN; layers reach it through Backend::pool (kernels/backend.hpp).
//
// The primitives read the whole window with no padding of their own, so that oneDNN's fast
// (dense-only) implementations take it: average pooling counts the zeros outside the image as
// PyTorch's count_include_pad does; max pooling asks for -infinity there (window_padding), which
// never wins over an image value. oneDNN's max keeps the first maximum of a window in row-major
// order, as the reference does, but a NaN does not win, a window of -infinity gives the lowest
// float, and a window of only the lowest float keeps its first position even where that is
// padding: a forward whose image part holds a NaN, an infinity or the lowest float therefore runs
// the reference instead (one scan of the window), and so does the backward after it. Same results
// as the reference: max bit for bit, average to float rounding.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "tessera/kernels/pool_kernel.hpp"

namespace tessera {

class OneDnnPool final : public PoolKernel<float> {
 public:
  // Plans the primitives, or returns nullptr when oneDNN does not take the case: geometry padding
  // (the layer's windows have none), an image box that is empty or not inside the window, a window
  // with more unread trailing rows or columns than one stride, nchw16c with channels not a multiple
  // of 16, or a case none of oneDNN's JIT implementations takes (its plain-loop ones are slower
  // than Tessera's reference; NCHW gets those on this machine). Never throws for a case it
  // declines. Local.
  static std::unique_ptr<OneDnnPool> create(PoolKind kind, const PoolShapes& shapes,
                                            const reference::PoolGeometry& g);
  ~OneDnnPool() override;

  void forward(const Tensor<float>& x, Tensor<float>& y) override;
  void backward(const Tensor<float>& dy, Tensor<float>& dx) override;
  float window_padding() const override;
  // "onednn " and oneDNN's forward / backward implementations, e.g.
  // "onednn jit:avx512_core/jit:avx512_core".
  std::string name() const override;
  // Whether the last forward ran the reference (the window held a NaN, an infinity or the lowest
  // float). Local.
  bool last_forward_was_reference() const { return fallback_.has_value(); }

 private:
  struct Plan;
  explicit OneDnnPool(std::unique_ptr<Plan> plan);
  std::unique_ptr<Plan> plan_;
  // Set by a forward that ran the reference, for its backward.
  std::optional<ReferencePool<float>> fallback_;
};

}  // namespace tessera
