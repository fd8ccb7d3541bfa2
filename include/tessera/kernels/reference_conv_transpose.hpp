// Reference transposed 2-D convolution (PyTorch's ConvTranspose2d): the adjoint of the
// convolution with the same geometry, built on the conv kernels of reference.hpp. Plain loops,
// float and double; they know nothing about ranks. All local.
//
// Index map, per axis: output q receives input i through tap j when q = i*stride - pad +
// j*dilation. `pad` may be any integer, negative included (a distributed layer computes a tile of
// the output from a window of the input, shifting the map); outputs the map sends outside the
// output tensor are dropped. The weight is PyTorch's [in, out/groups, KH, KW], which is the weight
// of the convolution this is the adjoint of ([O, I/groups, KH, KW] with O = our in, I = our out).
#pragma once

#include <span>

#include "tessera/kernels/reference.hpp"
#include "tessera/tensor.hpp"

namespace tessera::reference {

// y = conv_transpose(x, w) + bias. x [N, C, H, W], w [C, O/groups, KH, KW], bias [O] or empty,
// y [N, O, OH, OW] (overwritten; its shape says OH, OW, so output padding is the caller's).
template <typename T>
void conv_transpose2d_forward(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias,
                              Tensor<T>& y, const ConvGeometry& g);

// dx = the gradient with respect to x (overwritten): the convolution of dy with w.
template <typename T>
void conv_transpose2d_backward_data(const Tensor<T>& dy, const Tensor<T>& w, Tensor<T>& dx,
                                    const ConvGeometry& g);

// dw += dL/dw and dbias += the sum of dy per output channel (dbias may be empty). Accumulates:
// the caller zeroes.
template <typename T>
void conv_transpose2d_backward_filter(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& dw,
                                      std::span<T> dbias, const ConvGeometry& g);

}  // namespace tessera::reference
