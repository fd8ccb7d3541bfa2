// Transposed convolutions whose kernel is their stride, 2x2 stride 2 (unet-small's `up2`): each
// input pixel writes its own 2x2 patch of outputs, y[o][2i + a][2j + b] = bias[o] + sum over c of
// x[c][i][j] w[c][o][a][b], a matrix product per pixel with no overlap between pixels. The
// ConvTranspose2d layer runs its forward and its filter gradient here where the case fits, with
// the bias added as the outputs are written and the bias gradient summed in the filter gradient's
// pass over dy; oneDNN's adjoint convolution (conv_transpose2d.cpp) took a pass of its own for
// each (add_bias, add_bias_grad: 4.6 and 5.3 ms of unet-small's `up2` at 2048x2048 on 2 threads,
// whose oneDNN passes took 9.8 and 10.2). Its input gradient stays the adjoint convolution's (a
// oneDNN forward pass that runs at the memory's speed).
//
// AVX-512, float32, input (the layer's window) and output in nchw16c with channels multiples of
// 16; the window starts at the input of the tile's first output row and column, which are patch
// row and column pad_top and pad_left (0 or 1) of that input's patch (uneven tiles start inside
// a patch). Local.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "tessera/tensor.hpp"

namespace tessera {

struct PatchDeconvShapes {
  Shape4 x;                                // the window [N, C, H, W]
  Shape4 w;                                // PyTorch's transposed weight [C, O, 2, 2]
  Shape4 y;                                // the output tile [N, O, OH, OW]
  std::int64_t pad_top = 0, pad_left = 0;  // local output r reads window row (r + pad_top) / 2
};

class PatchDeconvKernel {
 public:
  virtual ~PatchDeconvKernel() = default;
  // y = the transposed convolution of x with w, plus bias (empty: none); overwrites y. Local.
  virtual void forward(const Tensor<float>& x, const Tensor<float>& w, std::span<const float> bias,
                       Tensor<float>& y) = 0;
  // Adds the filter gradient of dy against x into dw ([C, O, 2, 2]) and, where dbias is not
  // empty, the sum of dy per output channel into dbias. Sums in float over a row, in double over
  // fixed bands of rows added in order: the same bits on every run with any thread count. Local.
  virtual void backward_filter(const Tensor<float>& x, const Tensor<float>& dy, Tensor<float>& dw,
                               std::span<float> dbias) = 0;
  virtual std::string name() const = 0;
};

// Whether make_patch_deconv takes the case: AVX-512 chosen (simd_level()), w [C, O, 2, 2] for x's
// C and y's O channels, both multiples of 16, x and y of the same samples, pad_top and pad_left 0
// or 1, and every output reading a window pixel: (OH - 1 + pad_top) / 2 < H and (OW - 1 +
// pad_left) / 2 < W. Local and pure.
bool patch_deconv_fits(const PatchDeconvShapes& shapes);

// The kernel for `shapes`, or nullptr where patch_deconv_fits says no. Local.
std::unique_ptr<PatchDeconvKernel> make_patch_deconv(const PatchDeconvShapes& shapes);

}  // namespace tessera
