// What a pooling layer asks of a pooling kernel: one object planned for fixed shapes at bind
// time, executed every step; it keeps what its backward needs (the max's argmax) from the forward
// before. The reference kernel is one implementation, oneDNN's (kernels/onednn_pool.hpp) another,
// handed out by Backend::pool (kernels/backend.hpp). All local: kernels know nothing about
// ranks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/kernels/reference_pool.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

enum class PoolKind { max, avg };

// The shapes a kernel is planned for: the window x [N, C, H, W] and the output y [N, C, OH, OW],
// both in `layout` (nchw16c only for fast kernels, with C a multiple of 16). The geometry
// (reference::PoolGeometry) says which part of x is the image; the rest holds the kernel's
// window_padding() value, which the layer asks the halo exchange to write there.
struct PoolShapes {
  Shape4 x, y;
  Layout layout = Layout::nchw;
};

// Same results as the reference functions (kernels/reference_pool.hpp): max pooling bit for bit,
// ties and NaN included; average pooling to float rounding. forward overwrites y; backward
// overwrites dx (x's shape) from dy and what the last forward kept. dx outside the image is
// left open (the reference writes 0, oneDNN's average pooling the padding's share): the halo
// exchange drops it. Local.
template <typename T>
class PoolKernel {
 public:
  virtual ~PoolKernel() = default;
  virtual void forward(const Tensor<T>& x, Tensor<T>& y) = 0;
  virtual void backward(const Tensor<T>& dy, Tensor<T>& dx) = 0;
  // dx += what backward(dy, dx) would write (each element the sum dx + that value, as adding the
  // two tensors would give), where the kernel offers it in one pass: false, dx untouched,
  // otherwise (the default). For a layer whose input has another consumer (Layer::backward_adding).
  virtual bool backward_add(const Tensor<T>& /*dy*/, Tensor<T>& /*dx*/) { return false; }
  // What x must hold outside the image: 0, or -infinity for oneDNN's max pooling, which reads
  // the whole window.
  virtual T window_padding() const { return T(0); }
  // Which implementation runs ("reference", "onednn jit:avx512_core", ...), for logs and tests.
  virtual std::string name() const = 0;
  // Whether it is plain per-element loops (the reference), which a layer avoids where a fast
  // kernel takes another layout.
  virtual bool plain_loops() const { return false; }
};

// The plain-loop oracle; it takes every case in NCHW.
template <typename T>
class ReferencePool final : public PoolKernel<T> {
 public:
  ReferencePool(PoolKind kind, const reference::PoolGeometry& g) : kind_(kind), g_(g) {}
  void forward(const Tensor<T>& x, Tensor<T>& y) override;
  void backward(const Tensor<T>& dy, Tensor<T>& dx) override;
  std::string name() const override { return "reference"; }
  bool plain_loops() const override { return true; }

 private:
  PoolKind kind_;
  reference::PoolGeometry g_;
  std::vector<std::int64_t> argmax_;  // max: per output, its input within x's plane
};

// Max pooling whose windows tile the image: kernel == stride on both axes, no padding, every
// window inside the image (NCHW, or nchw8c / nchw16c: each channel of a block pooled on its own;
// a last block's padding channels pooled like the rest). The windows do not overlap, so each output
// row reads its own band of input rows and the backward writes each input gradient once; the kernel
// keeps one byte per output (the winner's place in its window) instead of the reference's 8-byte
// plane index. Same results as reference::maxpool2d_forward / _backward bit for bit, ties and NaN
// included (the scan of elementwise::window_max, unrolled for 2x2). Rows after the last window's (a
// tile of odd height or width) get a zero gradient, as the reference gives them. Local.
template <typename T>
class TiledMaxPool final : public PoolKernel<T> {
 public:
  // The kernel for the case, or nullptr where the windows do not tile the image so (or kernel_h
  // * kernel_w > 256, more places than a byte holds). Never throws for a case it declines.
  static std::unique_ptr<TiledMaxPool> create(PoolKind kind, const PoolShapes& shapes,
                                              const reference::PoolGeometry& g);
  void forward(const Tensor<T>& x, Tensor<T>& y) override;
  void backward(const Tensor<T>& dy, Tensor<T>& dx) override;
  // 2x2 windows: the backward's values added into dx as they are computed (read, add, write:
  // no buffer written and read back). Other windows: false.
  bool backward_add(const Tensor<T>& dy, Tensor<T>& dx) override;
  std::string name() const override { return "tiled max"; }

 private:
  // backward, and backward_add with `add`.
  void unpool(const Tensor<T>& dy, Tensor<T>& dx, bool add);
  TiledMaxPool(const PoolShapes& shapes, std::int64_t kernel_h, std::int64_t kernel_w)
      : shapes_(shapes), kernel_h_(kernel_h), kernel_w_(kernel_w) {}
  PoolShapes shapes_;
  std::int64_t kernel_h_, kernel_w_;
  // Per output value (padding channels included): h * kernel_w + w of its winner in its window.
  HostVector<std::uint8_t> place_;
};

}  // namespace tessera
