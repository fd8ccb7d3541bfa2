// Direct convolutions of few output channels, vectorised over pixels (kernels/cpu/narrow_conv.cpp).
//
// oneDNN 2.6 vectorises a convolution over channels: 8 or 16 output channels fill a vector, one
// input value is broadcast per multiply. With 8 output channels (unet-small's full-resolution
// layers) that is its AVX2 kernels, half an AVX-512 vector wide, at 30-35 GFLOP/s on one Skylake-SP
// core. These kernels put 16 neighbouring pixels of one channel in a vector instead: NCHW rows are
// read as they lie, the weights are broadcast, and 8 output channels x 48 pixels stay in registers
// while the taps of 8 input channels are summed (fewer rows than that would stream past the
// caches' prefetchers at once). The backward-data pass is the same loop over dy with the kernel
// flipped, the backward-filter pass sums dy x the shifted input per tap over a row in float
// vectors and over rows in double. AVX-512 only (simd_level()); float32, NCHW, stride 1, no
// groups, zero padding up to the kernel's span on each side (reads outside the planes are zeros,
// masked at the rows' ends); bias, and a (leaky) ReLU applied as the forward writes y.
//
// Pair taps: where input channels come in 2x2 blocks of equal values (ConvShapes::doubled_begin, a
// nearest upsampling's output: unet-small's d1 reads 16 of its 24 channels so), a 3x3 kernel of
// dilation 1 reads those channels at its corner taps alone, each weighted by the sum of the taps
// whose reads it stands for (which, by the parity of the output's centre in global coordinates),
// and each block at one of its rows: 4 products instead of 9 in the forward and the filter
// gradient (the name says "pair taps"); in float32 under --precision bf16 too, but where the
// bfloat16 dot products take the layer (narrow_conv_bf16_dot), which computes the 9 taps: pair
// weights (sums of taps) rounded to bfloat16 would differ from the border strips' weights, each
// rounded alone (box kernels have no pair taps), and a sharded run's borders would then differ
// from one rank's at bfloat16's rounding; their filter gradient computes the products of two tap
// rows that read one block's two rows once, adding them into both taps' sums (bit for bit the
// separate sums). Backward-data computes all 9 (its output has no blocks).
#pragma once

#include <memory>

#include "tessera/kernels/conv_kernel.hpp"

namespace tessera {

// Whether the narrow kernels may compute any convolution here: built with the AVX-512 loops,
// AVX-512 chosen (simd_level()), switched on (set_conv_narrow). Under --precision bf16 too, where
// they compute in float32 or bfloat16 (below): oneDNN's bf16 kernels take 16-channel blocks, half
// of them padding for 8 channels (unet-small's 1-rank step 1.15 s with its 8-channel convs in
// oneDNN's bf16 kernels, 0.67 s with them narrow; float32 0.71 s; AMD EPYC Zen 5, 2026-11-28); on
// CPUs with AMX a narrow kernel of at least 128 products a pixel and tap computes in bfloat16 on
// Tessera's AMX kernels (amx::Conv::plan_nchw; its name() says "narrow tessera amx"). Local.
bool narrow_conv_available();

// Whether the narrow kernels compute in bfloat16 dot products (vdpbf16ps: each float lane adds
// two products of bfloat16 pairs) under --precision bf16, in all three passes of every layer
// they take (doubled channels too, without pair taps; name() says "narrow avx512 bf16"), so that
// a sharded run's tiles and border strips round alike: built with the wide loops, the CPU
// has AVX512_BF16 (AMD Zen 4 and Zen 5, Intel Cooper Lake) and no AMX (amx::available(): Tessera's
// AMX kernels take the wider ones there), and TESSERA_NARROW_BF16 is not 0 (then they compute in
// float32). The forward and backward-data pair input channels 2q and 2q + 1 in a lane, read from
// rows converted once into a ring of zero-padded rows of such pairs; the filter gradient pairs
// neighbouring columns. Float32 sums of bfloat16-rounded factors, as the AMX kernels. Local.
bool narrow_conv_bf16_dot();

// Whether the narrow kernels compute convolutions of these shapes and geometry, their layouts
// aside (they take NCHW x and y only): narrow_conv_available(), no groups, stride 1, any
// dilation, kernels up to 7x7 other than 1x1, up to 8 output channels from up to 64 inputs or up
// to 16 from fewer than 32 inputs not a multiple of 16 (or 16 of them where ConvShapes::x_nchw),
// no fused sigmoid. Zero padding as the
// reference takes it (input values outside the H x W planes, or outside a box kernel's box, are
// zeros): pad_top in [0, dilation_h * (KH - 1)], and the rows padded after the input, OH - (H -
// dilation_h * (KH - 1)) - pad_top, in the same range; columns alike ("same" convs: pad_top =
// dilation_h * (KH - 1) / 2). A window that holds its padding is pad 0 with OH = H - dilation_h *
// (KH - 1). The oneDNN backend plans NCHW windows and outputs for such convolutions
// (Backend::conv_in_nchw). Local.
bool narrow_conv_fits(const ConvShapes& shapes, const reference::ConvGeometry& g);
// narrow_conv_fits' rules on channels (`x_nchw`: ConvShapes::x_nchw) and on groups and kernel
// extents, whatever the CPU: the memory planner (src/drivers/plan_memory.cpp) asks them of a
// model's specs. Local; pure.
bool narrow_conv_channels(std::int64_t in, std::int64_t out, bool x_nchw);
bool narrow_conv_kernel(std::int64_t groups, std::int64_t kh, std::int64_t kw);

// The narrow kernel for `shapes` (box kernels included), or nullptr where narrow_conv_fits says
// no or a layout is not NCHW. Never throws for a case it declines. Local.
std::unique_ptr<ConvKernel<float>> make_narrow_conv(const ConvShapes& shapes,
                                                    const reference::ConvGeometry& g);

// Whether the oneDNN backend computes the convolutions narrow_conv_fits takes with the narrow
// kernels: on or off (oneDNN's, in its 8-channel blocks). Process-wide like set_conv_winograd
// (kernels/backend.hpp): make_runtime sets it from RuntimeOptions::narrow_conv (default
// on where the CPU has AVX-512, TESSERA_NARROW_CONV=0|1) before a model plans its kernels. Local.
void set_conv_narrow(bool on);
bool conv_narrow();

}  // namespace tessera
