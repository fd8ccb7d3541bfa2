// Convolutions on Intel AMX (the tdpbf16ps tile multiply: bfloat16 products, float32 sums) that
// read and write Tessera's float32 nchw16c tensors as they lie. oneDNN 2.6's AMX kernels read and
// write only NHWC, so under --precision bf16 each convolution had converted its input to it and its
// output back, about as long as the AMX multiplies themselves (README.md "Mixed precision"). Here
// the input is converted to bfloat16 row by row as the kernel reaches it, into a ring of a few
// rows per thread in the channels-last order AMX's tiles read, and each output tile (16 pixels x
// 16 channels of float32) is one run of an nchw16c row, stored where it lies.
//
// One kernel computes a stride-1 correlation: the forward pass of a convolution, and its
// backward-data pass as the correlation of dy with the flipped, transposed weights. Local.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "tessera/kernels/local_kernels.hpp"
#include "tessera/tensor.hpp"

namespace tessera::amx {

// Whether this build has the AMX kernels (GCC on x86-64), this CPU has AMX-BF16 and AVX512_BF16,
// and the kernel let this process use the tile registers (asked once, as Linux requires).
// TESSERA_AMX=0 turns them off (oneDNN's kernels then run, as before). Local.
bool available();

// out[n][o][h][w] = f(bias[o] + sum over i, a, b of
//   bf16(in[n][i][h - pad_top + a * dil_h][w - pad_left + b * dil_w]) * bf16(k[o][i][a][b])),
// reads outside `in` counting as 0; in and out float32 in nchw16c, out.n == in.n.
struct Correlation {
  Shape4 in, out;
  std::int64_t kh = 1, kw = 1, pad_top = 0, pad_left = 0, dil_h = 1, dil_w = 1;
};

// The correlation of a convolution's backward-data pass, whose forward is `c`: dy (c.out) in,
// dx (c.in) out, the same kernel flipped (Conv::set_weights with `adjoint`). Local and pure.
Correlation adjoint(const Correlation& c);

class Conv {
 public:
  // A kernel for `c`, or nullptr where AMX is not available() or `c` does not fit: channels a
  // multiple of 16 on both sides, dilations and kernel sizes >= 1, an output of at least one
  // pixel. Local.
  static std::unique_ptr<Conv> plan(const Correlation& c);

  // Takes the weights, rounded to bfloat16: k[o][i][a][b] from `oihw` (out.c x in.c x kh x kw),
  // or, with `adjoint`, k[o][i][a][b] = oihw[i][o][kh - 1 - a][kw - 1 - b] from the weights of the
  // convolution (in.c x out.c x kh x kw) whose backward-data pass this correlation is. Local.
  void set_weights(const float* oihw, bool adjoint);

  // out = the correlation of `in` with the weights set last, + bias (empty: none), then `f`
  // where one is given; with `gate` (a tensor of out's shape, nchw16c: the output of the (leaky)
  // ReLU `gate_f` that fed the convolution whose backward-data this is), each value multiplied by
  // gate_f's derivative there (elementwise::leaky_relu_grad of gate > 0), as the activation's
  // backward from its output does. `in` and `out` of the planned shapes in nchw16c. Split over
  // the kernel threads by output rows. Local.
  void run(const float* in, std::span<const float> bias, const std::optional<FusedActivation>& f,
           float* out, const float* gate = nullptr,
           const std::optional<FusedActivation>& gate_f = std::nullopt) const;

  const Correlation& shape() const { return c_; }

 private:
  explicit Conv(const Correlation& c);
  Correlation c_;
  std::int64_t in_chunks_ = 0;         // input channels in chunks of 32, the last padded with zeros
  std::int64_t out_blocks_ = 0;        // output channels in blocks of 16
  std::vector<std::uint16_t> packed_;  // bfloat16 weight tiles, 16 x 32 each (set_weights)
  std::vector<float> tiles_;           // the same in float32, before rounding (set_weights)
};

// The backward-weights pass of a stride-1 convolution on AMX: with `c` the forward's correlation
// (in: x, out: dy),
//   dw[o][i][a][b] += sum over n, h, w of
//     bf16(dy[n][o][h][w]) * bf16(x[n][i][h - pad_top + a * dil_h][w - pad_left + b * dil_w])
// and dbias[o] += the float32 sum of dy[n][o] (products and tile sums in float32, each output row's
// sums added in double). x and dy float32 in nchw16c, dw OIHW. Each thread converts its rows of x
// to bfloat16 channel-major rows (the tiles' rows are channels, their columns pixels) and dy's to
// pairs of pixels interleaved (AMX's order for the second factor). Local.
class ConvWeights {
 public:
  // A kernel for `c`, or nullptr (as Conv::plan). Local.
  static std::unique_ptr<ConvWeights> plan(const Correlation& c);
  // Adds the gradients into dw (out.c x in.c x kh x kw) and dbias (empty: none), split over the
  // kernel threads by output rows and summed in the order of the rows. Local.
  void run(const float* x, const float* dy, float* dw, std::span<float> dbias) const;

 private:
  explicit ConvWeights(const Correlation& c) : c_(c) {}
  Correlation c_;
};

}  // namespace tessera::amx
