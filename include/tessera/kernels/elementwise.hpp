// The per-element arithmetic of the pointwise kernels, written once for every backend: the CPU
// loops (kernels/cpu/) and the CUDA kernels (kernels/cuda/*.cu) call these same functions, so the
// CPU tests exercise the arithmetic the GPU runs (AMReX's ParallelFor pattern). The CUDA kernels
// are compiled without FMA contraction (meson.build), so everything here but sigmoid's exp rounds
// the same on both: the GPU tests compare bit for bit. Plain C++ that nvcc also compiles: no
// engine headers. Local; pure.
#pragma once

#include <cmath>
#include <cstdint>

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

// Softmax cross-entropy of one pixel: its `channels` logits lie `stride` apart from x, its label
// is in [0, channels) (the caller checks). Returns -log softmax(x)[label], in double; with d
// (laid out as x), d = scale * (softmax(x) - onehot(label)). The max is subtracted first, so no
// exp overflows. Each exp(x - max) is taken once where there are at most kCachedClasses
// channels (softmax = those / their sum; a segmentation head's few classes: half the exps of
// recomputing them, the step's largest scalar cost), else again for the gradient; the largest
// logit's is 1 without a call. (2 classes at 2048x2048, 1 thread: 148 -> 74 ms a call.)
inline constexpr std::int64_t kCachedClasses = 8;

template <typename T>
TESSERA_HD inline double cross_entropy(const T* x, std::int64_t channels, std::int64_t stride,
                                       std::int32_t label, T scale, T* d) {
  using std::exp, std::log;
  double top = x[0];
  for (std::int64_t c = 1; c < channels; ++c)
    top = top < double(x[c * stride]) ? double(x[c * stride]) : top;
  double e[kCachedClasses];
  const bool cached = channels <= kCachedClasses;
  double sum = 0;
  for (std::int64_t c = 0; c < channels; ++c) {
    const double a = double(x[c * stride]) - top;
    const double v = a == 0.0 ? 1.0 : exp(a);  // exp(0) is 1 exactly: the largest's is free
    if (cached) e[c] = v;
    sum += v;
  }
  if (d != nullptr)
    for (std::int64_t c = 0; c < channels; ++c) {
      const double prob = (cached ? e[c] : exp(double(x[c * stride]) - top)) / sum;
      d[c * stride] = static_cast<T>(scale * (prob - (c == label ? 1.0 : 0.0)));
    }
  return log(sum) + top - double(x[label * stride]);
}

}  // namespace elementwise
}  // namespace tessera
