// Nearest upsampling by 2 across the columns (include/tessera/kernels/local_kernels.hpp,
// make_cpu_upsample), in NCHW or a blocked layout: each input value written to two neighbouring
// outputs, and each input gradient summed from its outputs, with contiguous loops GCC vectorises
// (the reference gathers through a column table). Same results as
// reference::upsample_nearest_forward / _backward bit for bit: the backward adds each input's
// gradients in the reference's order (row-major over the outputs), one input row at a time.
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference_upsample.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

// Where an output row of `count` columns reads at scale 2 with phase `phase`: output q reads
// input (q + phase) / 2, so the row starts at input phase / 2 and, for an odd phase, its first
// output is alone with its input; after that outputs come in pairs.
struct Pairs {
  std::int64_t first_input = 0;
  bool single_first = false;  // output 0 alone (odd phase)
  std::int64_t pairs = 0;     // then pairs of outputs, one input each
  bool single_last = false;   // and one output left over
};

Pairs pairs_of(std::int64_t count, std::int64_t phase) {
  Pairs p;
  p.first_input = phase / 2;
  p.single_first = phase % 2 == 1 && count > 0;
  const std::int64_t rest = count - (p.single_first ? 1 : 0);
  p.pairs = rest / 2;
  p.single_last = rest % 2 == 1;
  return p;
}

// A row of pixels of V values each (V channels side by side in a blocked layout, one in NCHW):
// output pixel pairs from input pixels.
template <std::int64_t V, typename T>
void widen_row(const T* __restrict in, T* __restrict out, const Pairs& p) {
  in += p.first_input * V;
  if (p.single_first) {
    std::copy(in, in + V, out);
    in += V;
    out += V;
  }
  for (std::int64_t i = 0; i < p.pairs; ++i)
    for (std::int64_t v = 0; v < V; ++v) {
      out[2 * i * V + v] = in[i * V + v];
      out[(2 * i + 1) * V + v] = in[i * V + v];
    }
  if (p.single_last) std::copy(in + p.pairs * V, in + (p.pairs + 1) * V, out + 2 * p.pairs * V);
}

// in[i] += out[2i], then += out[2i + 1]: the reference's order within an output row.
template <std::int64_t V, typename T>
void narrow_row_into(const T* __restrict out, T* __restrict in, const Pairs& p) {
  in += p.first_input * V;
  if (p.single_first) {
    for (std::int64_t v = 0; v < V; ++v)
      in[v] += out[v];
    in += V;
    out += V;
  }
  for (std::int64_t i = 0; i < p.pairs; ++i)
    for (std::int64_t v = 0; v < V; ++v)
      in[i * V + v] = (in[i * V + v] + out[2 * i * V + v]) + out[(2 * i + 1) * V + v];
  if (p.single_last)
    for (std::int64_t v = 0; v < V; ++v)
      in[p.pairs * V + v] += out[2 * p.pairs * V + v];
}

// The V channels of a blocked row of `count` pixels into V rows of `count` values (`stride`
// apart) and back: dst[j * stride + w] = src[w * V + j], and src[w * V + j] = dst[j * stride + w].
template <typename T>
void block_to_rows(const T* __restrict block, T* __restrict rows, std::int64_t count,
                   std::int64_t v, std::int64_t stride) {
  for (std::int64_t w = 0; w < count; ++w)
    for (std::int64_t j = 0; j < v; ++j)
      rows[j * stride + w] = block[w * v + j];
}
template <typename T>
void rows_to_block(const T* __restrict rows, T* __restrict block, std::int64_t count,
                   std::int64_t v, std::int64_t stride) {
  for (std::int64_t w = 0; w < count; ++w)
    for (std::int64_t j = 0; j < v; ++j)
      block[w * v + j] = rows[j * stride + w];
}

#if TESSERA_HAS_WIDE_LOOPS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
#include "transpose16.inc"

// widen_row<1> on float, 16 inputs at a time into 32 outputs by two lane permutes, with
// streaming stores when `stream` and the pairs start 64-byte aligned: an upsampled image is
// several times the cache and written once, so nothing reads its lines in first (the caller
// fences). The same values as widen_row<1>.
void widen_row_wide(const float* __restrict in, float* __restrict out, const Pairs& p,
                    bool stream) {
  in += p.first_input;
  if (p.single_first) *out++ = *in++;
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  stream = stream && reinterpret_cast<std::uintptr_t>(out) % 64 == 0;
  std::int64_t i = 0;
  for (; i + 16 <= p.pairs; i += 16) {
    const __m512 v = _mm512_loadu_ps(in + i);
    // The maskz forms: GCC 12's unmasked ones start from an "undefined" vector that
    // -Wmaybe-uninitialized flags (as in kernels/cpu/narrow_conv.cpp).
    const __m512 a = _mm512_maskz_permutexvar_ps(0xffff, first, v);
    const __m512 b = _mm512_maskz_permutexvar_ps(0xffff, second, v);
    if (stream) {
      _mm512_stream_ps(out + 2 * i, a);
      _mm512_stream_ps(out + 2 * i + 16, b);
    } else {
      _mm512_storeu_ps(out + 2 * i, a);
      _mm512_storeu_ps(out + 2 * i + 16, b);
    }
  }
  widen_row<1, float>(in + i, out + 2 * i, {.pairs = p.pairs - i, .single_last = p.single_last});
}

// narrow_row_into<1> on float, 16 inputs at a time: each from its two outputs, split into even and
// odd lanes, added in the same order (the same values). `next`, where not null, is the output row
// read after this one: its lines are prefetched as this row's are read (rows of different
// channels lie a plane apart, and each is too short for the hardware's prefetcher to find).
void narrow_row_wide(const float* __restrict out, float* __restrict in, const Pairs& p,
                     const float* next) {
  in += p.first_input;
  if (p.single_first) {
    *in++ += *out++;
    if (next != nullptr) ++next;
  }
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  std::int64_t i = 0;
  for (; i + 16 <= p.pairs; i += 16) {
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + 2 * i), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + 2 * i + 16), _MM_HINT_T1);
    }
    const __m512 a = _mm512_loadu_ps(out + 2 * i), b = _mm512_loadu_ps(out + 2 * i + 16);
    const __m512 e = _mm512_maskz_permutex2var_ps(0xffff, a, even, b);
    const __m512 o = _mm512_maskz_permutex2var_ps(0xffff, a, odd, b);
    _mm512_storeu_ps(in + i, _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(in + i), e), o));
  }
  narrow_row_into<1, float>(out + 2 * i, in + i,
                            {.pairs = p.pairs - i, .single_last = p.single_last});
}

// block_to_rows and rows_to_block for float in 16-channel blocks, 16 pixels at a time.
void block_to_rows_wide(const float* __restrict block, float* __restrict rows, std::int64_t count,
                        std::int64_t stride) {
  std::int64_t w = 0;
  for (; w + 16 <= count; w += 16)
    transpose16(block + w * 16, 16, rows + w, stride);
  block_to_rows(block + w * 16, rows + w, count - w, 16, stride);
}
void rows_to_block_wide(const float* __restrict rows, float* __restrict block, std::int64_t count,
                        std::int64_t stride) {
  std::int64_t w = 0;
  for (; w + 16 <= count; w += 16)
    transpose16(rows + w, stride, block + w * 16, 16);
  rows_to_block(rows + w, block + w * 16, count - w, 16, stride);
}
#pragma GCC pop_options
#endif

// NCHW, or a blocked layout: then a row is a block's row of pixels of V values (the padding
// channels of a last partial block upsampled with the rest: zeros stay zeros). Or a blocked window
// (and its gradient) with an NCHW output (and its gradient): each block row of the window gives
// the output rows of its channels, one channel at a time while the block row is in cache, so the
// layout is converted with no pass of its own (a consumer that computes in NCHW after a producer
// that writes blocks, as unet-small's d1 after d2).
template <typename T>
class PairedUpsample final : public UpsampleKernel<T> {
 public:
  explicit PairedUpsample(const reference::UpsampleGeometry& g) : g_(g) {}
  std::string name() const override { return "threaded pairs"; }
  bool takes_blocked() const override { return true; }
  bool converts_blocked_to_nchw() const override { return true; }

  void forward(const Tensor<T>& x, Tensor<T>& y) const override {
    const Shape4 &xs = x.shape(), &ys = y.shape();
    reference::check_upsample("upsample_nearest_forward", xs, ys, g_);
    check_layouts(x, y);
    if (x.layout() != y.layout()) return forward_to_nchw(x, y);
    const std::int64_t v = block_of(x.layout()), planes = xs.n * channel_blocks(xs.c, v);
    const Pairs p = pairs_of(ys.w, g_.phase_w);
    const auto widen = v == 8 ? widen_row<8, T> : widen_row<kBlock, T>;
    const bool stream = streams(y);
    parallel_for(
        planes * ys.h,
        [&](std::int64_t first, std::int64_t last) {
          for (std::int64_t k = first; k < last; ++k) {
            const std::int64_t plane = k / ys.h, r = k % ys.h;
            const std::int64_t source = elementwise::upsample_source(r, g_.scale_h, g_.phase_h);
            const T* in = x.data() + (plane * xs.h + source) * xs.w * v;
            T* out = y.data() + k * ys.w * v;
            if (v == 1)
              widen_plane_row(in, out, p, stream);
            else
              widen(in, out, p);
          }
          if (stream) fence();
        },
        grain_for(ys.w * v));
  }

  // One input row at a time: zeros, then the output rows that read it in increasing order.
  void backward(const Tensor<T>& dy, Tensor<T>& dx) const override {
    const Shape4 &xs = dx.shape(), &ys = dy.shape();
    reference::check_upsample("upsample_nearest_backward", xs, ys, g_);
    check_layouts(dx, dy);
    if (dx.layout() != dy.layout()) return backward_from_nchw(dy, dx);
    const std::int64_t v = block_of(dx.layout()), planes = xs.n * channel_blocks(xs.c, v);
    const Pairs p = pairs_of(ys.w, g_.phase_w);
    const auto narrow = v == 8 ? narrow_row_into<8, T> : narrow_row_into<kBlock, T>;
    const std::int64_t sh = g_.scale_h, ph = g_.phase_h;
    parallel_for(
        planes * xs.h,
        [&](std::int64_t first, std::int64_t last) {
          for (std::int64_t k = first; k < last; ++k) {
            const std::int64_t plane = k / xs.h, row = k % xs.h;
            T* in = dx.data() + k * xs.w * v;
            std::fill(in, in + xs.w * v, T(0));
            // Output rows r with (r + ph) / sh == row.
            const std::int64_t begin = std::max<std::int64_t>(row * sh - ph, 0);
            const std::int64_t end = std::min<std::int64_t>(row * sh - ph + sh, ys.h);
            for (std::int64_t r = begin; r < end; ++r) {
              const T* out = dy.data() + (plane * ys.h + r) * ys.w * v;
              if (v == 1)
                narrow_plane_row(out, in, p, nullptr);  // the next row follows: prefetched anyway
              else
                narrow(out, in, p);
            }
          }
        },
        grain_for(xs.w * v * sh * 2));
  }

 private:
  // `window` (x or dx) and `image` (y or dy): the same layout, or a blocked window and NCHW.
  static void check_layouts(const Tensor<T>& window, const Tensor<T>& image) {
    TESSERA_CHECK(window.layout() == image.layout() || image.layout() == Layout::nchw,
                  std::string("upsample_nearest: ") + to_string(window.layout()) + " and " +
                      to_string(image.layout()) + " tensors");
  }

  // A blocked window into NCHW outputs: each block row of x into V rows of its channels in a
  // scratch buffer, widened from there into every output row that reads it.
  void forward_to_nchw(const Tensor<T>& x, Tensor<T>& y) const {
    const Shape4& xs = x.shape();
    const std::int64_t v = block_of(x.layout());
    const Pairs p = pairs_of(y.shape().w, g_.phase_w);
    const bool stream = streams(y);
    for_each_block_row(xs, y.shape(), v, [&](const BlockRow& b, T* rows) {
      if (b.begin >= b.end) return;
      to_rows(x.data() + b.k * xs.w * v, rows, xs.w, v);
      for (std::int64_t j = 0; j < b.channels; ++j)
        for (std::int64_t r = b.begin; r < b.end; ++r)
          widen_plane_row(rows + j * xs.w, y.data() + b.image_row(j, r), p, stream);
      if (stream) fence();
    });
  }

  // Each block row of dx from its channels' rows in a scratch buffer: zeros (the padding
  // channels' stay so), then each channel's output rows that read it in increasing order, as
  // backward adds them.
  void backward_from_nchw(const Tensor<T>& dy, Tensor<T>& dx) const {
    const Shape4& xs = dx.shape();
    const std::int64_t v = block_of(dx.layout());
    const Pairs p = pairs_of(dy.shape().w, g_.phase_w);
    for_each_block_row(xs, dy.shape(), v, [&](const BlockRow& b, T* rows) {
      std::fill(rows, rows + v * xs.w, T(0));
      for (std::int64_t j = 0; j < b.channels; ++j)
        for (std::int64_t r = b.begin; r < b.end; ++r) {
          // The row read after this one: the next of this channel, or the next channel's first.
          const T* next = r + 1 < b.end        ? dy.data() + b.image_row(j, r + 1)
                          : j + 1 < b.channels ? dy.data() + b.image_row(j + 1, b.begin)
                                               : nullptr;
          narrow_plane_row(dy.data() + b.image_row(j, r), rows + j * xs.w, p, next);
        }
      from_rows(rows, dx.data() + b.k * xs.w * v, xs.w, v);
    });
  }

  // Block row k of a blocked window (sample n, channels cb * V..., row h): its channels that are
  // not padding, the output rows [begin, end) that read it, and where output row r of its
  // channel j starts in the NCHW image.
  struct BlockRow {
    std::int64_t k, n, cb, v, channels, begin, end, image_c, image_h, image_w;
    std::int64_t image_row(std::int64_t j, std::int64_t r) const {
      return ((n * image_c + cb * v + j) * image_h + r) * image_w;
    }
  };
  // body(block row, scratch of V x W values) for every block row of a window of shape xs in
  // blocks of v channels, over the kernel threads.
  template <typename Body>
  void for_each_block_row(const Shape4& xs, const Shape4& ys, std::int64_t v, Body&& body) const {
    const std::int64_t blocks = channel_blocks(xs.c, v);
    parallel_for(
        xs.n * blocks * xs.h,
        [&](std::int64_t first, std::int64_t last) {
          std::vector<T> rows(static_cast<std::size_t>(v * xs.w));
          for (std::int64_t k = first; k < last; ++k) {
            const std::int64_t bp = k / xs.h, cb = bp % blocks;
            const auto [begin, end] = readers(k % xs.h, ys.h);
            body(BlockRow{.k = k,
                          .n = bp / blocks,
                          .cb = cb,
                          .v = v,
                          .channels = std::min(v, xs.c - cb * v),
                          .begin = begin,
                          .end = end,
                          .image_c = ys.c,
                          .image_h = ys.h,
                          .image_w = ys.w},
                 rows.data());
          }
        },
        grain_for(xs.w * v * g_.scale_h * 2));
  }

  // The output rows [begin, end) that read input row h: (r + phase) / scale == h.
  std::pair<std::int64_t, std::int64_t> readers(std::int64_t h, std::int64_t rows) const {
    const std::int64_t sh = g_.scale_h, ph = g_.phase_h;
    return {std::max<std::int64_t>(h * sh - ph, 0), std::min<std::int64_t>(h * sh - ph + sh, rows)};
  }
  // Whether outputs of `y`'s size are written with streaming stores (tessera/kernels/simd.hpp).
  static bool streams(const Tensor<T>& y) {
    return y.numel() * std::int64_t(sizeof(T)) >= streaming_store_bytes();
  }
  // Orders a thread's streaming stores before what follows (its part of the loop ending).
  static void fence() {
#if TESSERA_HAS_WIDE_LOOPS
    _mm_sfence();
#endif
  }
  // widen_row<1> and narrow_row_into<1>, in AVX-512 for float where chosen (the same values).
  static void widen_plane_row(const T* in, T* out, const Pairs& p, [[maybe_unused]] bool stream) {
#if TESSERA_HAS_WIDE_LOOPS
    if constexpr (std::is_same_v<T, float>)
      if (simd_level() == SimdLevel::avx512) return widen_row_wide(in, out, p, stream);
#endif
    widen_row<1, T>(in, out, p);
  }
  static void narrow_plane_row(const T* out, T* in, const Pairs& p,
                               [[maybe_unused]] const T* next) {
#if TESSERA_HAS_WIDE_LOOPS
    if constexpr (std::is_same_v<T, float>)
      if (simd_level() == SimdLevel::avx512) return narrow_row_wide(out, in, p, next);
#endif
    narrow_row_into<1, T>(out, in, p);
  }
  static void to_rows(const T* block, T* rows, std::int64_t count, std::int64_t v) {
#if TESSERA_HAS_WIDE_LOOPS
    if constexpr (std::is_same_v<T, float>)
      if (v == 16 && simd_level() == SimdLevel::avx512)
        return block_to_rows_wide(block, rows, count, count);
#endif
    block_to_rows(block, rows, count, v, count);
  }
  static void from_rows(const T* rows, T* block, std::int64_t count, std::int64_t v) {
#if TESSERA_HAS_WIDE_LOOPS
    if constexpr (std::is_same_v<T, float>)
      if (v == 16 && simd_level() == SimdLevel::avx512)
        return rows_to_block_wide(rows, block, count, count);
#endif
    rows_to_block(rows, block, count, v, count);
  }
  reference::UpsampleGeometry g_;
};

}  // namespace

template <typename T>
std::unique_ptr<UpsampleKernel<T>> make_cpu_upsample(const reference::UpsampleGeometry& g) {
  if (g.scale_w == 2) return std::make_unique<PairedUpsample<T>>(g);
  return make_reference_upsample<T>(g);
}

template std::unique_ptr<UpsampleKernel<float>> make_cpu_upsample<float>(
    const reference::UpsampleGeometry&);
template std::unique_ptr<UpsampleKernel<double>> make_cpu_upsample<double>(
    const reference::UpsampleGeometry&);

}  // namespace tessera
