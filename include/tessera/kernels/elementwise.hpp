// The per-element arithmetic of the pointwise kernels, written once for every backend: the CPU
// loops (kernels/cpu/) and the CUDA kernels (kernels/cuda/*.cu) call these same functions, so the
// CPU tests exercise the arithmetic the GPU runs (AMReX's ParallelFor pattern). The CUDA kernels
// are compiled without FMA contraction (meson.build), so everything here but sigmoid's exp rounds
// the same on both: the GPU tests compare bit for bit. The cross-entropy's exp and log are
// Tessera's own (exp_poly, log_poly: additions, multiplies and one division), so that they too
// round alike everywhere, and the CPU's AVX-512 loss computes them 8 lanes at a time, bit for bit.
// Plain C++ that nvcc also compiles: no engine headers. Local; pure.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "tessera/random.hpp"

#if defined(__CUDACC__)
#define TESSERA_HD __host__ __device__
#else
#define TESSERA_HD
#endif

namespace tessera {

// The optimizers' scalars for one parameter, computed in double by the caller and rounded to T
// once (torch's order of operations).
template <typename T>
struct SgdScalars {
  T weight_decay = 0, momentum = 0, neg_lr = 0;
  bool decay = false, first_step = false;  // first_step: the momentum buffer starts as d
};
template <typename T>
struct AdamScalars {
  T weight_decay = 0, beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0, eps = 0;
  T neg_step_size = 0, bias_correction2_sqrt = 1;
  bool decay = false;
};

// Where a tile lies in its global NCHW tensor: the tile's extents, the global channels, rows and
// columns, and the tile's first sample, row and column.
struct TileIndex {
  std::int64_t n = 0, c = 0, h = 0, w = 0;
  std::int64_t global_c = 0, global_h = 0, global_w = 0;
  std::int64_t n0 = 0, h0 = 0, w0 = 0;
};

namespace elementwise {

// Leaky ReLU (ReLU: slope 0). The product is taken unconditionally, so that GCC turns the select
// into a vector blend (a multiply under the condition is not if-converted).
template <typename T>
TESSERA_HD inline T leaky_relu(T x, T slope) {
  const T scaled = slope * x;
  return x > T(0) ? x : scaled;
}
// Its derivative applied to dy, from whether x was positive.
template <typename T>
TESSERA_HD inline T leaky_relu_grad(bool positive, T dy, T slope) {
  const T scaled = slope * dy;
  return positive ? dy : scaled;
}
// grad[k] *= its derivative for k < n, read from the output y = leaky_relu(x) (y > 0 where x
// was): the activation's backward from its output, and the same applied inside the kernels that
// fuse it (the narrow convolutions' backward, a conv's border boxes). Host loop.
template <typename T>
inline void leaky_relu_grad_from_output(const T* y, T* grad, std::int64_t n, T slope) {
  for (std::int64_t k = 0; k < n; ++k)
    grad[k] = leaky_relu_grad(y[k] > T(0), grad[k], slope);
}

// exp of a non-positive number only: large |x| neither overflows nor loses the tail.
template <typename T>
TESSERA_HD inline T sigmoid(T x) {
  using std::abs, std::exp;
  const T e = exp(-abs(x));
  return x >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
}
// dx from sigmoid's output y and dy.
template <typename T>
TESSERA_HD inline T sigmoid_grad(T y, T dy) {
  return dy * y * (T(1) - y);
}

// What dropout with probability p scales a kept element by: 1 / (1 - p), or 0 when p = 1 (every
// element dropped).
template <typename T>
inline T dropout_keep(double p) {
  return p < 1 ? static_cast<T>(1 / (1 - p)) : T(0);
}

// Dropout's scale of element `index` of the global tensor: 0 (dropped, with probability p) or
// `keep` = 1 / (1 - p), drawn from (seed, stream, index) alone, so every grid and every backend
// drops the same elements.
template <typename T>
TESSERA_HD constexpr T dropout_scale(std::uint64_t seed, std::uint64_t stream, std::uint64_t index,
                                     double p, T keep) {
  return uniform01(seed, stream, index) >= p ? keep : T(0);
}

// The global index of element k (row-major NCHW) of the tile `t`.
TESSERA_HD inline std::uint64_t global_index(const TileIndex& t, std::int64_t k) {
  const std::int64_t w = k % t.w, h = k / t.w % t.h, c = k / (t.w * t.h) % t.c,
                     n = k / (t.w * t.h * t.c);
  return static_cast<std::uint64_t>(((t.n0 + n) * t.global_c + c) * t.global_h + t.h0 + h) *
             static_cast<std::uint64_t>(t.global_w) +
         static_cast<std::uint64_t>(t.w0 + w);
}

// SGD on one element: d = g (+ wd * p); with a momentum buffer (buf non-null):
// buf = first_step ? d : buf * momentum + d, d = buf; p += -lr * d.
template <typename T>
TESSERA_HD inline void sgd(T& p, T g, T* buf, const SgdScalars<T>& s) {
  T d = s.decay ? g + s.weight_decay * p : g;
  if (buf) {
    *buf = s.first_step ? d : *buf * s.momentum + d;
    d = *buf;
  }
  p = p + s.neg_lr * d;
}

// Adam on one element: d = g (+ wd * p); m = m * beta1 + (1 - beta1) d;
// v = v * beta2 + (1 - beta2) d^2; p += -step_size * m / (sqrt(v) / sqrt(bias_correction2) + eps).
template <typename T>
TESSERA_HD inline void adam(T& p, T g, T& m, T& v, const AdamScalars<T>& s) {
  using std::sqrt;
  const T d = s.decay ? g + s.weight_decay * p : g;
  m = m * s.beta1 + s.one_minus_beta1 * d;
  v = v * s.beta2 + s.one_minus_beta2 * d * d;
  const T denom = sqrt(v) / s.bias_correction2_sqrt + s.eps;
  p = p + s.neg_step_size * m / denom;
}

// The bits of a double and back (memcpy on the host, the intrinsics on the device: defined
// behaviour either way).
TESSERA_HD inline std::uint64_t bits_of(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(x));
#else
  std::uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
#endif
}
TESSERA_HD inline double from_bits(std::uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(b));
#else
  double x;
  std::memcpy(&x, &b, sizeof x);
  return x;
#endif
}

// exp_poly and log_poly's constants (the AVX-512 loss, kernels/cpu/loss_kernels.cpp, uses the
// same).
inline constexpr double kInfinity = std::numeric_limits<double>::infinity();
// x * (1 / ln 2) + kRoundToInt - kRoundToInt is x / ln 2 rounded to the nearest integer k, and
// k is in the low bits of the sum (|k| < 2^51).
inline constexpr double kRoundToInt = 0x1.8p52;
inline constexpr std::uint64_t kRoundToIntBits = 0x4338000000000000;
inline constexpr double kInvLn2 = 0x1.71547652b82fep+0;
// ln 2 = kLn2Hi + kLn2Lo, kLn2Hi with 32 significant bits: k * kLn2Hi is exact for |k| < 2^21.
inline constexpr double kLn2Hi = 0x1.62e42fee00000p-1, kLn2Lo = 0x1.a39ef35793c76p-33;
// e^x is 0 in double below about -745.1, and below kExpLowest under 2^-1021 (2^k would be
// subnormal): exp_poly gives 0 there. Above kExpHighest (e^709 = 8.2e307) it gives +inf: 2^k would
// need k = 1024.
inline constexpr double kExpLowest = -708.0, kExpHighest = 709.0;
// 1 / n! for n = 0..13: the Taylor polynomial of e^r, |r| <= ln 2 / 2 (the remainder under
// 5e-18 of e^r).
inline constexpr double kExp0 = 1.0, kExp1 = 1.0, kExp2 = 0x1p-1, kExp3 = 0x1.5555555555555p-3,
                        kExp4 = 0x1.5555555555555p-5, kExp5 = 0x1.1111111111111p-7,
                        kExp6 = 0x1.6c16c16c16c17p-10, kExp7 = 0x1.a01a01a01a01ap-13,
                        kExp8 = 0x1.a01a01a01a01ap-16, kExp9 = 0x1.71de3a556c734p-19,
                        kExp10 = 0x1.27e4fb7789f5cp-22, kExp11 = 0x1.ae64567f544e4p-26,
                        kExp12 = 0x1.1eed8eff8d898p-29, kExp13 = 0x1.6124613a86d09p-33;
inline constexpr double kSqrt2 = 0x1.6a09e667f3bcdp+0;
inline constexpr std::uint64_t kMantissaBits = 0x000fffffffffffff, kOneBits = 0x3ff0000000000000;
// 2 / (2k + 1) for k = 1..11: ln m = 2 atanh(s) = 2s + s z (2/3 + z (2/5 + ...)), s = (m - 1) /
// (m + 1), z = s^2 <= 0.0295 for m in [sqrt(1/2), sqrt(2)] (the remainder under 1e-18 of ln m).
inline constexpr double kLog1 = 0x1.5555555555555p-1, kLog2 = 0x1.999999999999ap-2,
                        kLog3 = 0x1.2492492492492p-2, kLog4 = 0x1.c71c71c71c71cp-3,
                        kLog5 = 0x1.745d1745d1746p-3, kLog6 = 0x1.3b13b13b13b14p-3,
                        kLog7 = 0x1.1111111111111p-3, kLog8 = 0x1.e1e1e1e1e1e1ep-4,
                        kLog9 = 0x1.af286bca1af28p-4, kLog10 = 0x1.8618618618618p-4,
                        kLog11 = 0x1.642c8590b2164p-4;

// e^a in double, within 2 units in the last place of the exact value (unit test
// ExpAndLog.AreWithinTwoUnitsInTheLastPlace): a = k ln 2 + r, e^r from its Taylor polynomial,
// times 2^k from k's bits; 0 below kExpLowest, +inf above kExpHighest, NaN for NaN. Additions
// and multiplies in a fixed order (no library call), so the host, the device and the vector
// lanes of kernels/cpu/loss_kernels.cpp compute the same bits.
TESSERA_HD inline double exp_poly(double a) {
  if (a < kExpLowest) return 0.0;
  if (a > kExpHighest) return kInfinity;
  const double t = a * kInvLn2 + kRoundToInt;
  const double k = t - kRoundToInt;
  const double r = (a - k * kLn2Hi) - k * kLn2Lo;
  // e^r = 1 + (r + r^2 (1/2 + r/6 + ...)), the tail's polynomial by Estrin's scheme: short
  // chains of dependent operations, so that the vector lanes' pipelines stay full.
  const double r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
  const double tail = ((kExp2 + kExp3 * r) + (kExp4 + kExp5 * r) * r2) +
                      ((kExp6 + kExp7 * r) + (kExp8 + kExp9 * r) * r2) * r4 +
                      ((kExp10 + kExp11 * r) + (kExp12 + kExp13 * r) * r2) * r8;
  const double p = kExp0 + (kExp1 * r + r2 * tail);
  // 2^k: k + 1023 as the exponent field (unsigned arithmetic: a NaN's bits give some number, and
  // p is NaN then).
  return p * from_bits((bits_of(t) - kRoundToIntBits + 1023) << 52);
}

// ln x in double for positive normal x (>= 2^-1022), within 2 units in the last place; +inf and
// NaN as they are. x = m 2^e with m = 1 + f in [sqrt(1/2), sqrt(2)), ln x = e ln 2 + 2 atanh(s),
// s = f / (2 + f) (fdlibm's reduction); computed as exp_poly is, for the same bits everywhere.
TESSERA_HD inline double log_poly(double x) {
  if (!(x < kInfinity)) return x;
  const std::uint64_t b = bits_of(x);
  double m = from_bits((b & kMantissaBits) | kOneBits);  // in [1, 2)
  double e = static_cast<double>(static_cast<std::int64_t>((b >> 52) & 0x7ff) - 1023);
  if (m > kSqrt2) {
    m = m * 0.5;
    e = e + 1.0;
  }
  const double f = m - 1.0;  // exact
  const double s = f / (2.0 + f);
  const double z = s * s;
  const double z2 = z * z, z4 = z2 * z2, z8 = z4 * z4;  // Estrin's scheme, as in exp_poly
  const double q = ((kLog1 + kLog2 * z) + (kLog3 + kLog4 * z) * z2) +
                   ((kLog5 + kLog6 * z) + (kLog7 + kLog8 * z) * z2) * z4 +
                   ((kLog9 + kLog10 * z) + kLog11 * z2) * z8;
  // 2s = f - s f, so ln m = f - s (f - z q): f exact, the rest a small correction.
  return e * kLn2Hi + (f + (e * kLn2Lo - s * (f - z * q)));
}

// Softmax cross-entropy of one pixel: its `channels` logits lie `stride` apart from x, its label
// is in [0, channels) (the caller checks). Returns -log softmax(x)[label], in double; with d
// (laid out as x), d = scale * (softmax(x) - onehot(label)). The max is subtracted first, so no
// exp overflows. Each exp(x - max) is taken once where there are at most kCachedClasses
// channels (softmax = those / their sum; a segmentation head's few classes: half the exps of
// recomputing them), else again for the gradient; the largest logit's is 1 without a call.
// exp_poly and log_poly, not std::exp and std::log: the same bits on every backend and in the
// AVX-512 loss (kernels/cpu/loss_kernels.cpp), which mirrors this function lane by lane.
inline constexpr std::int64_t kCachedClasses = 8;

template <typename T>
TESSERA_HD inline double cross_entropy(const T* x, std::int64_t channels, std::int64_t stride,
                                       std::int32_t label, T scale, T* d) {
  double top = x[0];
  for (std::int64_t c = 1; c < channels; ++c)
    top = top < double(x[c * stride]) ? double(x[c * stride]) : top;
  double e[kCachedClasses];
  const bool cached = channels <= kCachedClasses;
  double sum = 0;
  for (std::int64_t c = 0; c < channels; ++c) {
    const double a = double(x[c * stride]) - top;
    const double v = a == 0.0 ? 1.0 : exp_poly(a);  // e^0 is 1: the largest's is free
    if (cached) e[c] = v;
    sum += v;
  }
  if (d != nullptr)
    for (std::int64_t c = 0; c < channels; ++c) {
      const double prob = (cached ? e[c] : exp_poly(double(x[c * stride]) - top)) / sum;
      d[c * stride] = static_cast<T>(scale * (prob - (c == label ? 1.0 : 0.0)));
    }
  return log_poly(sum) + top - double(x[label * stride]);
}

}  // namespace elementwise
}  // namespace tessera
