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

// The 2x2 windows of the input rows r0, r1 into `count` outputs; each pixel V values (V
// channels side by side in a blocked layout, one in NCHW), each pooled on its own.
template <std::int64_t V, typename T>
void pool_2x2(const T* __restrict r0, const T* __restrict r1, T* __restrict out,
              std::uint8_t* __restrict place, std::int64_t count) {
  for (std::int64_t ow = 0; ow < count; ++ow)
    for (std::int64_t j = 0; j < V; ++j) {
      const std::int64_t left = 2 * ow * V + j, right = left + V;
      T best = r0[left];  // the scan's first step: from -infinity, the first value takes over
      std::uint8_t at = 0;
      scan(r0[right], 1, best, at);
      scan(r1[left], 2, best, at);
      scan(r1[right], 3, best, at);
      out[ow * V + j] = best;
      place[ow * V + j] = at;
    }
}

// The gradients of `count` 2x2 windows into the input rows r0, r1: each input gets its window's
// gradient where it won, else 0, written once (no fill, no scattered add: branch-free, so that
// GCC vectorises it). 0 + g, as the reference's sum into zeros (-0 becomes +0 there too). With
// `add`, each input's value is added to what it held (held + value, as a sum of the tensors).
template <std::int64_t V, typename T>
void unpool_2x2(const T* __restrict grad, const std::uint8_t* __restrict place, T* __restrict r0,
                T* __restrict r1, std::int64_t count, bool add) {
  const auto put = [add](T& q, T value) { q = add ? q + value : value; };
  for (std::int64_t ow = 0; ow < count; ++ow)
    for (std::int64_t j = 0; j < V; ++j) {
      const std::int64_t left = 2 * ow * V + j, right = left + V;
      const T g = T(0) + grad[ow * V + j];
      const std::uint8_t at = place[ow * V + j];
      put(r0[left], at == 0 ? g : T(0));
      put(r0[right], at == 1 ? g : T(0));
      put(r1[left], at == 2 ? g : T(0));
      put(r1[right], at == 3 ? g : T(0));
    }
}

#if TESSERA_HAS_WIDE_LOOPS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
// scan's four steps on 16 lanes, window k's inputs in lanes of v[0..3] (a strictly greater value
// or a NaN takes over: the same winners and values as pool_2x2): the maxima to out, their places
// to place, 16 each.
inline void scan_16(const __m512 (&v)[4], float* out, std::uint8_t* place) {
  __m512 best = v[0];
  __m512i at = _mm512_setzero_si512();
  for (int k = 1; k < 4; ++k) {
    const __mmask16 take =
        _mm512_cmp_ps_mask(v[k], best, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v[k], v[k], _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, take, v[k]);
    at = _mm512_mask_mov_epi32(at, take, _mm512_set1_epi32(k));
  }
  _mm512_storeu_ps(out, best);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(place), _mm512_maskz_cvtepi32_epi8(0xffff, at));
}

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
    scan_16(v, out + ow, place + ow);
  }
  pool_2x2<1>(r0 + 2 * ow, r1 + 2 * ow, out + ow, place + ow, count - ow);
}

// pool_2x2<16> on float in AVX-512 (16-channel blocks): a pixel is a vector, so the four inputs
// of 16 windows are four loads, then scan's steps as above.
void pool_2x2_blocks_wide(const float* __restrict r0, const float* __restrict r1,
                          float* __restrict out, std::uint8_t* __restrict place,
                          std::int64_t count) {
  for (std::int64_t ow = 0; ow < count; ++ow) {
    const __m512 v[4] = {_mm512_loadu_ps(r0 + 32 * ow), _mm512_loadu_ps(r0 + 32 * ow + 16),
                         _mm512_loadu_ps(r1 + 32 * ow), _mm512_loadu_ps(r1 + 32 * ow + 16)};
    scan_16(v, out + 16 * ow, place + 16 * ow);
  }
}

// Whether both rows start on a 64-byte boundary (streaming stores need it).
inline bool both_aligned(const float* r0, const float* r1) {
  return reinterpret_cast<std::uintptr_t>(r0) % 64 == 0 &&
         reinterpret_cast<std::uintptr_t>(r1) % 64 == 0;
}
// 16 floats to q: added to what q held (`add`), streamed (q 64-byte aligned) or stored.
inline void store_16(float* q, __m512 v, bool stream, bool add = false) {
  if (add)
    _mm512_storeu_ps(q, _mm512_add_ps(_mm512_loadu_ps(q), v));
  else if (stream)
    _mm512_stream_ps(q, v);
  else
    _mm512_storeu_ps(q, v);
}

// unpool_2x2<16> on float in AVX-512, one window's 16 channels at a time, with streaming stores
// as unpool_2x2_wide (`stream` with both rows 64-byte aligned; the caller fences), or added into
// the rows (`add`).
void unpool_2x2_blocks_wide(const float* __restrict grad, const std::uint8_t* __restrict place,
                            float* __restrict r0, float* __restrict r1, std::int64_t count,
                            bool stream, bool add) {
  stream = stream && !add && both_aligned(r0, r1);
  const auto store = [stream, add](float* q, __m512 v) { store_16(q, v, stream, add); };
  for (std::int64_t ow = 0; ow < count; ++ow) {
    const __m512 g = _mm512_add_ps(_mm512_setzero_ps(), _mm512_loadu_ps(grad + 16 * ow));
    const __m512i at = _mm512_maskz_cvtepu8_epi32(
        0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i*>(place + 16 * ow)));
    const auto won = [&](int k) {
      return _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(at, _mm512_set1_epi32(k)), g);
    };
    store(r0 + 32 * ow, won(0));
    store(r0 + 32 * ow + 16, won(1));
    store(r1 + 32 * ow, won(2));
    store(r1 + 32 * ow + 16, won(3));
  }
  if (stream) _mm_sfence();
}

// unpool_2x2 on float in AVX-512, 16 windows at a time: each window's gradient and place are
// spread over the two inputs of each of its rows by lane permutes, and each input takes the
// gradient where its place is the winner's, else +0 (the same values as unpool_2x2). With
// `stream` (and both rows 64-byte aligned), streaming stores: the input gradient is several times
// the cache and written once, so nothing reads its lines in first. With `add`, added into the rows.
void unpool_2x2_wide(const float* __restrict grad, const std::uint8_t* __restrict place,
                     float* __restrict r0, float* __restrict r1, std::int64_t count, bool stream,
                     bool add) {
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512i top = _mm512_set_epi32(1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  const __m512i bottom = _mm512_add_epi32(top, _mm512_set1_epi32(2));
  stream = stream && !add && both_aligned(r0, r1);
  const auto store = [stream, add](float* q, __m512 v) { store_16(q, v, stream, add); };
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
  unpool_2x2<1>(grad + ow, place + ow, r0 + 2 * ow, r1 + 2 * ow, count - ow, add);
}
#pragma GCC pop_options
#endif

// Any kernel: the scan over each window in row-major order (pixels of v values, as pool_2x2).
template <typename T>
void pool_any(const T* in, std::int64_t row, std::int64_t kh, std::int64_t kw, std::int64_t v,
              T* out, std::uint8_t* place, std::int64_t count) {
  for (std::int64_t ow = 0; ow < count; ++ow)
    for (std::int64_t lane = 0; lane < v; ++lane) {
      const T* window = in + ow * kw * v + lane;
      T best = window[0];
      std::uint8_t at = 0;
      for (std::int64_t i = 0; i < kh; ++i)
        for (std::int64_t j = 0; j < kw; ++j)
          if (i + j > 0) scan(window[i * row + j * v], std::uint8_t(i * kw + j), best, at);
      out[ow * v + lane] = best;
      place[ow * v + lane] = at;
    }
}

// One output row of 2x2 windows with pixels of v values: the AVX-512 loops for float where
// chosen, else the plain ones.
template <typename T>
void pool_2x2_row(const T* r0, const T* r1, T* out, std::uint8_t* place, std::int64_t count,
                  std::int64_t v, [[maybe_unused]] bool wide) {
#if TESSERA_HAS_WIDE_LOOPS
  if constexpr (std::is_same_v<T, float>) {
    if (wide && v == 1) return pool_2x2_wide(r0, r1, out, place, count);
    if (wide && v == kBlock) return pool_2x2_blocks_wide(r0, r1, out, place, count);
  }
#endif
  if (v == 1) return pool_2x2<1>(r0, r1, out, place, count);
  if (v == 8) return pool_2x2<8>(r0, r1, out, place, count);
  pool_2x2<kBlock>(r0, r1, out, place, count);
}
template <typename T>
void unpool_2x2_row(const T* grad, const std::uint8_t* place, T* r0, T* r1, std::int64_t count,
                    std::int64_t v, [[maybe_unused]] bool wide, [[maybe_unused]] bool stream,
                    bool add) {
#if TESSERA_HAS_WIDE_LOOPS
  if constexpr (std::is_same_v<T, float>) {
    if (wide && v == 1) return unpool_2x2_wide(grad, place, r0, r1, count, stream, add);
    if (wide && v == kBlock) return unpool_2x2_blocks_wide(grad, place, r0, r1, count, stream, add);
  }
#endif
  if (v == 1) return unpool_2x2<1>(grad, place, r0, r1, count, add);
  if (v == 8) return unpool_2x2<8>(grad, place, r0, r1, count, add);
  unpool_2x2<kBlock>(grad, place, r0, r1, count, add);
}

// Throws unless a pass gets the tensors it was planned for: `from` -> `to` in its layout.
template <typename T>
void check_call(const PoolShapes& planned, const Tensor<T>& from, const Tensor<T>& to,
                const Shape4& from_shape, const Shape4& to_shape, const char* pass) {
  TESSERA_CHECK(from.shape() == from_shape && to.shape() == to_shape &&
                    from.layout() == planned.layout && to.layout() == planned.layout,
                "tiled max pooling planned for " + planned.x.str() + " -> " + planned.y.str() +
                    " in " + to_string(planned.layout) + ", " + pass + " called with " +
                    from.shape().str() + " in " + to_string(from.layout()) + " -> " +
                    to.shape().str() + " in " + to_string(to.layout()));
}

// body(b, plane, oh) for every output row oh of every plane (b = plane * rows + oh; a plane is a
// sample's channel, or its block of v channels), split over the kernel threads.
template <typename Body>
void for_each_band(const Shape4& y, std::int64_t v, std::int64_t work_per_band, Body&& body) {
  parallel_for(
      y.n * channel_blocks(y.c, v) * y.h,
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
  const Layout layout = shapes.layout;
  if (kind != PoolKind::max ||
      (layout != Layout::nchw && layout != Layout::nchw8c && layout != Layout::nchw16c) ||
      kh <= 0 || kw <= 0 || g.stride_h != kh || g.stride_w != kw || kh * kw > 256 ||
      g.pad_top != 0 || g.pad_left != 0 || x.n != y.n || x.c != y.c || y.numel() == 0)
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
  const std::int64_t v = block_of(shapes_.layout), row = xs.w * v;
  place_.resize(static_cast<std::size_t>(ys.n * channel_blocks(ys.c, v) * ys.h * ys.w * v));
  const std::int64_t kh = kernel_h_, kw = kernel_w_;
  const bool wide = simd_level() == SimdLevel::avx512;
  for_each_band(ys, v, kh * row, [&](std::int64_t b, std::int64_t plane, std::int64_t oh) {
    const T* in = x.data() + (plane * xs.h + oh * kh) * row;
    T* out = y.data() + b * ys.w * v;
    std::uint8_t* place = place_.data() + b * ys.w * v;
    if (kh == 2 && kw == 2)
      pool_2x2_row(in, in + row, out, place, ys.w, v, wide);
    else
      pool_any(in, row, kh, kw, v, out, place, ys.w);
  });
}

template <typename T>
void TiledMaxPool<T>::backward(const Tensor<T>& dy, Tensor<T>& dx) {
  unpool(dy, dx, false);
}

template <typename T>
bool TiledMaxPool<T>::backward_add(const Tensor<T>& dy, Tensor<T>& dx) {
  if (kernel_h_ != 2 || kernel_w_ != 2) return false;
  unpool(dy, dx, true);
  return true;
}

template <typename T>
void TiledMaxPool<T>::unpool(const Tensor<T>& dy, Tensor<T>& dx, bool add) {
  const Shape4 &xs = shapes_.x, &ys = shapes_.y;
  check_call(shapes_, dy, dx, ys, xs, add ? "backward_add" : "backward");
  const std::int64_t v = block_of(shapes_.layout), row = xs.w * v;
  const std::int64_t planes = xs.n * channel_blocks(xs.c, v);
  TESSERA_CHECK(static_cast<std::int64_t>(place_.size()) == planes * ys.h * ys.w * v,
                "tiled max pooling: backward before any forward");
  const std::int64_t kh = kernel_h_, kw = kernel_w_;
  const bool wide = simd_level() == SimdLevel::avx512,
             stream = dx.numel() * std::int64_t(sizeof(T)) >= streaming_store_bytes();
  // What the inputs under no window get: 0, or + 0 with `add` (as a sum of the tensors would).
  const auto zero = [add](T* first, T* last) {
    if (add)
      for (T* q = first; q < last; ++q)
        *q += T(0);
    else
      std::fill(first, last, T(0));
  };
  for_each_band(ys, v, kh * row, [&](std::int64_t b, std::int64_t plane, std::int64_t oh) {
    T* out = dx.data() + (plane * xs.h + oh * kh) * row;
    const T* grad = dy.data() + b * ys.w * v;
    const std::uint8_t* place = place_.data() + b * ys.w * v;
    if (kh == 2 && kw == 2) {
      unpool_2x2_row(grad, place, out, out + row, ys.w, v, wide, stream, add);
      for (T* r : {out, out + row})  // the column under no window (an odd width)
        zero(r + 2 * ys.w * v, r + row);
      return;
    }
    std::fill(out, out + kh * row, T(0));  // the band, trailing columns included
    // 0 + g, as the reference's sum into zeros (-0 becomes +0 there too).
    for (std::int64_t ow = 0; ow < ys.w; ++ow)
      for (std::int64_t lane = 0; lane < v; ++lane) {
        const std::uint8_t at = place[ow * v + lane];
        out[(at / kw) * row + (ow * kw + at % kw) * v + lane] += grad[ow * v + lane];
      }
  });
  // The rows under no window (a tile of odd height pooled by 2).
  const std::int64_t tail = xs.h - ys.h * kh;
  if (tail > 0)
    parallel_for(
        planes,
        [&](std::int64_t first, std::int64_t last) {
          for (std::int64_t q = first; q < last; ++q) {
            T* rows = dx.data() + (q * xs.h + ys.h * kh) * row;
            zero(rows, rows + tail * row);
          }
        },
        grain_for(tail * row));
}

template class TiledMaxPool<float>;
template class TiledMaxPool<double>;

}  // namespace tessera
