// TiledMaxPool (include/tessera/kernels/pool_kernel.hpp): max pooling over windows that tile the
// image, one band of kernel_h input rows per output row, split over the kernel threads.
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "tessera/error.hpp"
#include "tessera/kernels/pool_kernel.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

// One step of elementwise::window_max's scan: a strictly greater value or a NaN takes over.
// Branch-free, so that GCC vectorises the 2x2 loop (winners change at random).
template <typename T>
inline void scan(T v, std::uint8_t place, T& best, std::uint8_t& at) {
  const bool take = v > best || v != v;
  best = take ? v : best;
  at = take ? place : at;
}

// The 2x2 windows of the input rows r0, r1 into `count` outputs.
template <typename T>
void pool_2x2(const T* __restrict r0, const T* __restrict r1, T* __restrict out,
              std::uint8_t* __restrict place, std::int64_t count) {
  for (std::int64_t ow = 0; ow < count; ++ow) {
    T best = r0[2 * ow];  // the scan's first step: from -infinity, the first value takes over
    std::uint8_t at = 0;
    scan(r0[2 * ow + 1], 1, best, at);
    scan(r1[2 * ow], 2, best, at);
    scan(r1[2 * ow + 1], 3, best, at);
    out[ow] = best;
    place[ow] = at;
  }
}

// The gradients of `count` 2x2 windows into the input rows r0, r1: each input gets its window's
// gradient where it won, else 0, written once (no fill, no scattered add: branch-free, so that
// GCC vectorises it). 0 + g, as the reference's sum into zeros (-0 becomes +0 there too).
template <typename T>
void unpool_2x2(const T* __restrict grad, const std::uint8_t* __restrict place, T* __restrict r0,
                T* __restrict r1, std::int64_t count) {
  for (std::int64_t ow = 0; ow < count; ++ow) {
    const T g = T(0) + grad[ow];
    const std::uint8_t at = place[ow];
    r0[2 * ow] = at == 0 ? g : T(0);
    r0[2 * ow + 1] = at == 1 ? g : T(0);
    r1[2 * ow] = at == 2 ? g : T(0);
    r1[2 * ow + 1] = at == 3 ? g : T(0);
  }
}

#if TESSERA_HAS_WIDE_LOOPS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
// pool_2x2 on float in AVX-512, 16 windows at a time: each row's 32 values split into the
// windows' left and right inputs by lane permutes, then scan's four steps on 16 lanes (a strictly
// greater value or a NaN takes over: the same winners and values as pool_2x2).
void pool_2x2_wide(const float* __restrict r0, const float* __restrict r1, float* __restrict out,
                   std::uint8_t* __restrict place, std::int64_t count) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  std::int64_t ow = 0;
  for (; ow + 16 <= count; ow += 16) {
    __m512 v[4];
    for (int row = 0; row < 2; ++row) {
      const float* r = (row == 0 ? r0 : r1) + 2 * ow;
      const __m512 lo = _mm512_loadu_ps(r), hi = _mm512_loadu_ps(r + 16);
      // The maskz forms: GCC 12's unmasked ones start from an "undefined" vector that
      // -Wmaybe-uninitialized flags (as in kernels/cpu/narrow_conv.cpp).
      v[2 * row] = _mm512_maskz_permutex2var_ps(0xffff, lo, even, hi);
      v[2 * row + 1] = _mm512_maskz_permutex2var_ps(0xffff, lo, odd, hi);
    }
    __m512 best = v[0];
    __m512i at = _mm512_setzero_si512();
    for (int k = 1; k < 4; ++k) {
      const __mmask16 take =
          _mm512_cmp_ps_mask(v[k], best, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v[k], v[k], _CMP_UNORD_Q);
      best = _mm512_mask_mov_ps(best, take, v[k]);
      at = _mm512_mask_mov_epi32(at, take, _mm512_set1_epi32(k));
    }
    _mm512_storeu_ps(out + ow, best);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(place + ow),
                     _mm512_maskz_cvtepi32_epi8(0xffff, at));
  }
  pool_2x2(r0 + 2 * ow, r1 + 2 * ow, out + ow, place + ow, count - ow);
}

// unpool_2x2 on float in AVX-512, 16 windows at a time: each window's gradient and place are
// spread over the two inputs of each of its rows by lane permutes, and each input takes the
// gradient where its place is the winner's, else +0 (the same values as unpool_2x2). With
// `stream` (and both rows 64-byte aligned), streaming stores: the input gradient is several times
// the cache and written once, so nothing reads its lines in first.
void unpool_2x2_wide(const float* __restrict grad, const std::uint8_t* __restrict place,
                     float* __restrict r0, float* __restrict r1, std::int64_t count, bool stream) {
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512i top = _mm512_set_epi32(1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  const __m512i bottom = _mm512_add_epi32(top, _mm512_set1_epi32(2));
  stream = stream && reinterpret_cast<std::uintptr_t>(r0) % 64 == 0 &&
           reinterpret_cast<std::uintptr_t>(r1) % 64 == 0;
  const auto store = [stream](float* q, __m512 v) {
    if (stream)
      _mm512_stream_ps(q, v);
    else
      _mm512_storeu_ps(q, v);
  };
  std::int64_t ow = 0;
  for (; ow + 16 <= count; ow += 16) {
    const __m512 g = _mm512_add_ps(_mm512_setzero_ps(), _mm512_loadu_ps(grad + ow));  // 0 + g
    // The maskz forms: GCC 12's unmasked ones start from an "undefined" vector that
    // -Wmaybe-uninitialized flags (as in kernels/cpu/narrow_conv.cpp).
    const __m512i at = _mm512_maskz_cvtepu8_epi32(
        0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i*>(place + ow)));
    for (int half = 0; half < 2; ++half) {
      const __m512i spread = half == 0 ? first : second;
      const __m512 gs = _mm512_maskz_permutexvar_ps(0xffff, spread, g);
      const __m512i as = _mm512_maskz_permutexvar_epi32(0xffff, spread, at);
      store(r0 + 2 * ow + 16 * half, _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(as, top), gs));
      store(r1 + 2 * ow + 16 * half, _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(as, bottom), gs));
    }
  }
  if (stream) _mm_sfence();
  unpool_2x2(grad + ow, place + ow, r0 + 2 * ow, r1 + 2 * ow, count - ow);
}
#pragma GCC pop_options
#endif

// Any kernel: the scan over each window in row-major order.
template <typename T>
void pool_any(const T* in, std::int64_t row, std::int64_t kh, std::int64_t kw, T* out,
              std::uint8_t* place, std::int64_t count) {
  for (std::int64_t ow = 0; ow < count; ++ow) {
    T best = in[ow * kw];
    std::uint8_t at = 0;
    for (std::int64_t i = 0; i < kh; ++i)
      for (std::int64_t j = 0; j < kw; ++j)
        if (i + j > 0) scan(in[i * row + ow * kw + j], std::uint8_t(i * kw + j), best, at);
    out[ow] = best;
    place[ow] = at;
  }
}

// Throws unless a pass gets the tensors it was planned for: `from` -> `to` in NCHW.
template <typename T>
void check_call(const PoolShapes& planned, const Tensor<T>& from, const Tensor<T>& to,
                const Shape4& from_shape, const Shape4& to_shape, const char* pass) {
  TESSERA_CHECK(from.shape() == from_shape && to.shape() == to_shape &&
                    from.layout() == Layout::nchw && to.layout() == Layout::nchw,
                "tiled max pooling planned for " + planned.x.str() + " -> " + planned.y.str() +
                    " in NCHW, " + pass + " called with " + from.shape().str() + " -> " +
                    to.shape().str());
}

// body(b, plane, oh) for every output row oh of every plane (b = plane * rows + oh), split over
// the kernel threads.
template <typename Body>
void for_each_band(const Shape4& y, std::int64_t work_per_band, Body&& body) {
  parallel_for(
      y.n * y.c * y.h,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t b = first; b < last; ++b)
          body(b, b / y.h, b % y.h);
      },
      grain_for(work_per_band));
}

}  // namespace

template <typename T>
std::unique_ptr<TiledMaxPool<T>> TiledMaxPool<T>::create(PoolKind kind, const PoolShapes& shapes,
                                                         const reference::PoolGeometry& g) {
  const Shape4 &x = shapes.x, &y = shapes.y;
  const std::int64_t kh = g.kernel_h, kw = g.kernel_w;
  if (kind != PoolKind::max || shapes.layout != Layout::nchw || kh <= 0 || kw <= 0 ||
      g.stride_h != kh || g.stride_w != kw || kh * kw > 256 || g.pad_top != 0 || g.pad_left != 0 ||
      x.n != y.n || x.c != y.c || y.numel() == 0)
    return nullptr;
  // Every window inside x and inside the image.
  const Box windows{{0, y.h * kh}, {0, y.w * kw}};
  if (x.h < windows.h.end || x.w < windows.w.end || intersect(g.image, windows) != windows)
    return nullptr;
  return std::unique_ptr<TiledMaxPool>(new TiledMaxPool(shapes, kh, kw));
}

template <typename T>
void TiledMaxPool<T>::forward(const Tensor<T>& x, Tensor<T>& y) {
  const Shape4 &xs = shapes_.x, &ys = shapes_.y;
  check_call(shapes_, x, y, xs, ys, "forward");
  place_.resize(static_cast<std::size_t>(ys.numel()));
  const std::int64_t kh = kernel_h_, kw = kernel_w_;
  [[maybe_unused]] const bool wide = simd_level() == SimdLevel::avx512;
  for_each_band(ys, kh * xs.w, [&](std::int64_t b, std::int64_t plane, std::int64_t oh) {
    const T* in = x.data() + (plane * xs.h + oh * kh) * xs.w;
    T* out = y.data() + b * ys.w;
    std::uint8_t* place = place_.data() + b * ys.w;
    if (kh == 2 && kw == 2) {
#if TESSERA_HAS_WIDE_LOOPS
      if constexpr (std::is_same_v<T, float>)
        if (wide) return pool_2x2_wide(in, in + xs.w, out, place, ys.w);
#endif
      pool_2x2(in, in + xs.w, out, place, ys.w);
    } else
      pool_any(in, xs.w, kh, kw, out, place, ys.w);
  });
}

template <typename T>
void TiledMaxPool<T>::backward(const Tensor<T>& dy, Tensor<T>& dx) {
  const Shape4 &xs = shapes_.x, &ys = shapes_.y;
  check_call(shapes_, dy, dx, ys, xs, "backward");
  TESSERA_CHECK(static_cast<std::int64_t>(place_.size()) == ys.numel(),
                "tiled max pooling: backward before any forward");
  const std::int64_t kh = kernel_h_, kw = kernel_w_;
  [[maybe_unused]] const bool wide = simd_level() == SimdLevel::avx512,
                              stream =
                                  dx.numel() * std::int64_t(sizeof(T)) >= streaming_store_bytes();
  for_each_band(ys, kh * xs.w, [&](std::int64_t b, std::int64_t plane, std::int64_t oh) {
    T* out = dx.data() + (plane * xs.h + oh * kh) * xs.w;
    const T* grad = dy.data() + b * ys.w;
    const std::uint8_t* place = place_.data() + b * ys.w;
    if (kh == 2 && kw == 2) {
#if TESSERA_HAS_WIDE_LOOPS
      if constexpr (std::is_same_v<T, float>) {
        if (wide)
          unpool_2x2_wide(grad, place, out, out + xs.w, ys.w, stream);
        else
          unpool_2x2(grad, place, out, out + xs.w, ys.w);
      } else {
        unpool_2x2(grad, place, out, out + xs.w, ys.w);
      }
#else
      unpool_2x2(grad, place, out, out + xs.w, ys.w);
#endif
      for (T* row : {out, out + xs.w})  // the column under no window (an odd width)
        std::fill(row + 2 * ys.w, row + xs.w, T(0));
      return;
    }
    std::fill(out, out + kh * xs.w, T(0));  // the band, trailing columns included
    // 0 + g, as the reference's sum into zeros (-0 becomes +0 there too).
    for (std::int64_t ow = 0; ow < ys.w; ++ow)
      out[(place[ow] / kw) * xs.w + ow * kw + place[ow] % kw] += grad[ow];
  });
  // The rows under no window (a tile of odd height pooled by 2).
  const std::int64_t tail = xs.h - ys.h * kh;
  if (tail > 0)
    parallel_for(
        xs.n * xs.c,
        [&](std::int64_t first, std::int64_t last) {
          for (std::int64_t p = first; p < last; ++p) {
            T* rows = dx.data() + (p * xs.h + ys.h * kh) * xs.w;
            std::fill(rows, rows + tail * xs.w, T(0));
          }
        },
        grain_for(tail * xs.w));
}

template class TiledMaxPool<float>;
template class TiledMaxPool<double>;

}  // namespace tessera
