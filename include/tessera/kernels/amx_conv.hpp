// Convolutions on Intel AMX (the tdpbf16ps tile multiply: bfloat16 products, float32 sums) that
// read and write Tessera's float32 nchw16c tensors as they lie. oneDNN 2.6's AMX kernels read and
// write only NHWC, so under --precision bf16 each convolution had converted its input to it and its
// output back, about as long as the AMX multiplies themselves (README.md "Mixed precision"). Here
// the input is converted to bfloat16 row by row as the kernel reaches it, into a ring of a few
// rows per thread in the channels-last order AMX's tiles read, and each output tile (16 pixels x
// 16 channels of float32) is one run of an nchw16c row, stored where it lies. The same kernels
// read and write NCHW planes (plan_nchw: the narrow convolutions of kernels/cpu/narrow_conv.cpp,
// any channel counts), transposing 16 x 16 pieces in L1 on the way in and out.
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
#include "tessera/kernels/nchw_planes.hpp"
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

// How a correlation's input rows lie in its ring and are read as first factors: `pixel` bfloat16
// values a pixel (its channels, padded), each tap row's products in `segments` tile multiplies of
// `k` values (a tile row's K); segment s starts offset(s) values after an output pixel's place
// in the row. Chunks of 32 channels (pixel = 32 x chunks, k = 32) for nchw16c and wide NCHW
// inputs; for NCHW inputs of up to 32 channels `pixel` is their count rounded up to even, one
// segment a tap (k = pixel), or, at column dilation 1 where a row's taps fit in 32 values, one
// segment for the whole tap row (`joined`: its taps' pixels lie side by side). Local.
struct RingGeometry {
  std::int64_t pixel = 32, k = 32, segments = 1, chunks = 1;
  bool joined = false;
  std::int64_t offset(std::int64_t s, std::int64_t dil_w) const {
    return joined ? 0 : (s / chunks) * dil_w * pixel + (s % chunks) * k;
  }
};

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

  // A kernel for `c` between NCHW planes (run_planes), or nullptr where AMX is not available():
  // any channel counts (the input's in chunks of 32, the output's in blocks of 16, each padded
  // with zeros), the rest as plan(). Local.
  static std::unique_ptr<Conv> plan_nchw(const Correlation& c);

  // run() for a kernel from plan_nchw: `in` and `out` NCHW planes (a tensor, a box of one, a
  // concat's parts) of c.in's and c.out's N, C, H and W, values outside `in`'s c.in.h x c.in.w
  // counting as 0; each output tile (16 pixels x 16 channels) transposed in L1 and written as runs
  // of its channels' rows. No gate. Local.
  void run_planes(const ChannelPlanes<const float>& in, std::span<const float> bias,
                  const std::optional<FusedActivation>& f, const ChannelPlanes<float>& out) const;

  const Correlation& shape() const { return c_; }

 private:
  Conv(const Correlation& c, bool nchw);
  void run_any(const float* in, const ChannelPlanes<const float>* in_planes,
               std::span<const float> bias, const std::optional<FusedActivation>& f, float* out,
               const ChannelPlanes<float>* out_planes, const float* gate,
               const std::optional<FusedActivation>& gate_f) const;
  Correlation c_;
  bool nchw_ = false;  // planned by plan_nchw
  RingGeometry ring_;
  std::int64_t out_blocks_ = 0;        // output channels in blocks of 16, the last padded
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

  // The same for NCHW planes of x and dy (Conv::plan_nchw's channel counts): x's rows converted
  // to bfloat16 as they lie, dy's transposed into pixel pairs in L1. Local.
  static std::unique_ptr<ConvWeights> plan_nchw(const Correlation& c);
  void run_planes(const ChannelPlanes<const float>& x, const ChannelPlanes<const float>& dy,
                  float* dw, std::span<float> dbias) const;

 private:
  ConvWeights(const Correlation& c, bool nchw) : c_(c), nchw_(nchw) {}
  void run_any(const float* x, const float* dy, const ChannelPlanes<const float>* x_planes,
               const ChannelPlanes<const float>* dy_planes, float* dw,
               std::span<float> dbias) const;
  Correlation c_;
  bool nchw_ = false;
};

}  // namespace tessera::amx
