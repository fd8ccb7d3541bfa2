// Reference CPU pooling kernels (max and average over 2-D windows, PyTorch semantics with
// dilation 1): plain loops, float and double. They know nothing about ranks. All local.
#pragma once

#include <cstdint>
#include <span>

#include "tessera/box.hpp"
#include "tessera/tensor.hpp"

namespace tessera::reference {

// Output pixel (oh, ow) pools the x rows oh*stride_h - pad_top + [0, kernel_h) and the columns
// ow*stride_w - pad_left + [0, kernel_w). Only the part of x inside `image` (rows x columns of x,
// half-open) is the image; every other position of a window, in x or past its edges, is padding.
// A distributed layer passes its filled window with pad 0 and `image` = the window's part inside
// the global image, so padding never depends on where the tile lies.
struct PoolGeometry {
  std::int64_t kernel_h = 1, kernel_w = 1;
  std::int64_t stride_h = 1, stride_w = 1;
  std::int64_t pad_top = 0, pad_left = 0;
  Box image;
};

// The geometry for an unpadded x of shape `x` pooled with padding (pad_top, pad_left): the image
// is all of x.
PoolGeometry pool_geometry(Shape4 x, std::int64_t kernel_h, std::int64_t kernel_w,
                           std::int64_t stride_h, std::int64_t stride_w, std::int64_t pad_top,
                           std::int64_t pad_left);

// The checks every pooling kernel makes before it touches memory: positive kernel and stride, x and
// y of the same samples and channels, and with `every_window_pools` (max pooling) an image
// position in every output's window; Errors naming `who` and the shapes. Returns `g` with its
// image clipped to x, so that no window reads outside the tensor.
PoolGeometry checked_pool_geometry(const char* who, const Shape4& x, const Shape4& y,
                                   const PoolGeometry& g, bool every_window_pools);

// y[n, c, oh, ow] = the maximum over the image positions of the window; the output extent is
// y's shape. Ties go to the first maximum in row-major order of the window, and a NaN wins over
// every number (a later NaN over an earlier one), as PyTorch's CPU kernel. argmax (one per
// element of y) receives the selected position as h * x.w + w within its (n, c) plane of x.
// Throws when a window holds no image position.
template <typename T>
void maxpool2d_forward(const Tensor<T>& x, Tensor<T>& y, std::span<std::int64_t> argmax,
                       const PoolGeometry& g);

// dx (overwritten; its shape is x's) = dy routed to the argmax of each output.
template <typename T>
void maxpool2d_backward(const Tensor<T>& dy, std::span<const std::int64_t> argmax, Tensor<T>& dx);

// y = the sum of the window's image positions (row-major) divided by kernel_h * kernel_w:
// padding counts in the divisor (count_include_pad), which in floor mode is always the kernel
// area, as in PyTorch.
template <typename T>
void avgpool2d_forward(const Tensor<T>& x, Tensor<T>& y, const PoolGeometry& g);

// dx (overwritten) = for each output, dy / (kernel_h * kernel_w) added into each image position
// of its window.
template <typename T>
void avgpool2d_backward(const Tensor<T>& dy, Tensor<T>& dx, const PoolGeometry& g);

}  // namespace tessera::reference
