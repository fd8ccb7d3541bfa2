// Reference kernels for the classification head: global average pooling and fully connected
// layers. Plain loops, float and double. All local.
#pragma once

#include <cstdint>
#include <span>

#include "tessera/tensor.hpp"

namespace tessera::reference {

// sums[n * C + c] = sum over h, w of x[n, c, h, w] (overwritten).
template <typename T>
void spatial_sums(const Tensor<T>& x, std::span<T> sums);

// dx[n, c, h, w] = g[n * C + c] for every h, w (overwritten).
template <typename T>
void broadcast_spatial(std::span<const T> g, Tensor<T>& dx);

// y [N, O] = x [N, I] * w^T + bias, w [O, I] (PyTorch's layout), bias [O] or empty.
template <typename T>
void linear_forward(std::span<const T> x, std::span<const T> w, std::span<const T> bias,
                    std::span<T> y, std::int64_t n, std::int64_t in, std::int64_t out);

// dx [N, I] = dy [N, O] * w (overwritten).
template <typename T>
void linear_backward_data(std::span<const T> dy, std::span<const T> w, std::span<T> dx,
                          std::int64_t n, std::int64_t in, std::int64_t out);

// dw [O, I] += dy^T * x, dbias [O] += column sums of dy (dbias may be empty).
template <typename T>
void linear_backward_weights(std::span<const T> x, std::span<const T> dy, std::span<T> dw,
                             std::span<T> dbias, std::int64_t n, std::int64_t in, std::int64_t out);

}  // namespace tessera::reference
