// What a layer asks of a 2-D convolution kernel: one object planned for fixed shapes at bind time,
// executed every step. The reference kernel is one implementation; faster ones (oneDNN) are
// others, handed out by make_conv_kernel (kernels/backend.hpp). All local: kernels know nothing
// about ranks.
#pragma once

#include <span>
#include <string>

#include "tessera/kernels/reference.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

// The shapes a kernel is planned for: input x [N, C, H, W], weight [O, C/groups, KH, KW] (PyTorch
// layout), output y [N, O, OH, OW]; `bias` says whether the layer has one.
struct ConvShapes {
  Shape4 x, w, y;
  bool bias = true;
};

// Same contracts as the reference functions of the same names (kernels/reference.hpp): forward
// and backward_data overwrite their output, backward_filter adds into dw and dbias. Tensors must
// have the planned shapes. Local.
template <typename T>
class ConvKernel {
 public:
  virtual ~ConvKernel() = default;
  virtual void forward(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias,
                       Tensor<T>& y) = 0;
  virtual void backward_data(const Tensor<T>& dy, const Tensor<T>& w, Tensor<T>& dx) = 0;
  virtual void backward_filter(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& dw,
                               std::span<T> dbias) = 0;
  // Which implementation runs ("reference", "onednn jit:avx512_core", ...), for logs and tests.
  virtual std::string name() const = 0;
};

// The plain-loop oracle; it accepts every case.
template <typename T>
class ReferenceConv final : public ConvKernel<T> {
 public:
  explicit ReferenceConv(const reference::ConvGeometry& g) : g_(g) {}
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
  std::string name() const override { return "reference"; }

 private:
  reference::ConvGeometry g_;
};

}  // namespace tessera
