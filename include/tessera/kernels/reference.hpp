// Reference CPU kernels: plain loops, float and double, the oracle every faster kernel is checked
// against. They know nothing about ranks. All local.
#pragma once

#include <cstdint>
#include <span>

#include "tessera/tensor.hpp"

namespace tessera::reference {

// Geometry of a 2-D convolution. The output extent is taken from the output tensor's shape;
// input reads outside the input tensor (above pad_top / left of pad_left, or past its end)
// are zeros.
struct ConvGeometry {
  std::int64_t stride_h = 1, stride_w = 1;
  std::int64_t dilation_h = 1, dilation_w = 1;
  std::int64_t pad_top = 0, pad_left = 0;
  std::int64_t groups = 1;
};

// y = conv(x, w) + bias. x [N, C, H, W], w [O, C/groups, KH, KW], bias [O] or empty,
// y [N, O, OH, OW] (overwritten).
template <typename T>
void conv2d_forward(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias, Tensor<T>& y,
                    const ConvGeometry& g);

// dx = conv^T(dy, w): the gradient with respect to x (overwritten; its shape says H, W).
template <typename T>
void conv2d_backward_data(const Tensor<T>& dy, const Tensor<T>& w, Tensor<T>& dx,
                          const ConvGeometry& g);

// dw += dL/dw and dbias += sum of dy (dbias may be empty). Accumulates: the caller zeroes.
template <typename T>
void conv2d_backward_filter(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& dw,
                            std::span<T> dbias, const ConvGeometry& g);

// y = x where x > 0 else slope * x (slope 0: ReLU); dx = dy where y > 0 else slope * dy.
template <typename T>
void leaky_relu_forward(std::span<const T> x, T slope, std::span<T> y);
template <typename T>
void leaky_relu_backward(std::span<const T> y, std::span<const T> dy, T slope, std::span<T> dx);

// y = 1 / (1 + exp(-x)); dx = dy * y * (1 - y).
template <typename T>
void sigmoid_forward(std::span<const T> x, std::span<T> y);
template <typename T>
void sigmoid_backward(std::span<const T> y, std::span<const T> dy, std::span<T> dx);

// Per-pixel softmax cross-entropy over the channels of logits [N, C, H, W] with labels [N, H, W]
// (values in [0, C), checked). Returns the sum of -log softmax(logits)[label] over the pixels
// (in double); when `dlogits` is given, writes scale * (softmax - onehot(label)) into it.
template <typename T>
double pixel_cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                           Tensor<T>* dlogits);
// The same over the pixels [first, last) of the batch in linear order (n * H * W + row * W + col),
// their sum in that order; unchecked: the caller has checked the whole (check_cross_entropy).
template <typename T>
double pixel_cross_entropy_range(const Tensor<T>& logits, std::span<const std::int32_t> labels,
                                 T scale, Tensor<T>* dlogits, std::int64_t first,
                                 std::int64_t last);

}  // namespace tessera::reference
