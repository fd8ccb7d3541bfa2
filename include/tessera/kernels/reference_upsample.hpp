// Reference CPU nearest-neighbour upsampling by integer factors: plain loops (rows or planes split
// over the kernel threads), float and double. They know nothing about ranks. All local.
#pragma once

#include <cstdint>

#include "tessera/tensor.hpp"

namespace tessera::reference {

// Output row r of y reads x row floor((r + phase_h) / scale_h), columns likewise. A whole image
// has phase 0 (output q reads input floor(q / scale), as PyTorch's nearest mode for an integer
// scale_factor); a tile whose first output row is global row qb, given the input window starting
// at global row floor(qb / scale), has phase qb mod scale.
struct UpsampleGeometry {
  std::int64_t scale_h = 1, scale_w = 1;
  std::int64_t phase_h = 0, phase_w = 0;
};

// The checks every upsampling kernel makes before it touches memory: positive scales, non-negative
// phases, x and y of the same samples and channels, and x holding every row and column y reads;
// Errors naming `who` and the shapes.
void check_upsample(const char* who, const Shape4& x, const Shape4& y, const UpsampleGeometry& g);

// y (its shape gives the output extent) from x; x must hold every row and column y reads.
template <typename T>
void upsample_nearest_forward(const Tensor<T>& x, Tensor<T>& y, const UpsampleGeometry& g);

// dx (overwritten; its shape is x's) = for each input, the sum of the gradients of the outputs
// that read it, added in row-major order of the outputs (as PyTorch).
template <typename T>
void upsample_nearest_backward(const Tensor<T>& dy, Tensor<T>& dx, const UpsampleGeometry& g);

}  // namespace tessera::reference
