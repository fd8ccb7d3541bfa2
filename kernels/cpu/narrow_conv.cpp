// The narrow convolution kernels (include/tessera/kernels/narrow_conv.hpp): AVX-512 loops over
// rows of NCHW planes, 16 pixels a vector, split over the kernel threads by rows.
#include "tessera/kernels/narrow_conv.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/kernels/amx_conv.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/nchw_planes.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

bool g_conv_narrow = true;

constexpr std::int64_t kOut = 8;  // output channels whose sums one pass keeps in registers
#if TESSERA_HAS_WIDE_LOOPS
constexpr std::int64_t kLanes = 16;  // floats in a vector
// A pair tap's weights (RowJob::pair_k): those of even and odd lanes.
constexpr std::int64_t kPairLanes = 2;
#endif
constexpr std::int64_t kMaxExtent = 7, kMaxOut = 16, kMaxIn = 64;
constexpr std::int64_t kChunk = 8;  // input channels summed per pass over a row
// Where the input channels lie, kChunk at a time: chunk q's channel i % kChunk at
// chunks[q] + (i % kChunk) * plane. One tensor's chunks are kChunk planes apart; a concat's parts
// (ConvKernel::forward_parts) each hold whole chunks but the last.
using Chunks = std::array<const float*, kMaxIn / kChunk>;

#if TESSERA_HAS_WIDE_LOOPS
// The tap rows [a0, a1) of a kernel of kh rows, dilation dh, whose first reads row `row0` of an
// input in_h rows high, that lie inside it (a0 == a1: none).
struct TapRows {
  std::int64_t a0, a1;
};
inline TapRows tap_rows_inside(std::int64_t row0, std::int64_t kh, std::int64_t dh,
                               std::int64_t in_h) {
  std::int64_t a0 = 0, a1 = kh;
  while (a0 < a1 && row0 + a0 * dh < 0)
    ++a0;
  while (a1 > a0 && row0 + (a1 - 1) * dh >= in_h)
    --a1;
  return {a0, a1};
}

// calls block.template operator()<PV>() for PV = `vectors` (1, 2 or 3): a row's blocks of 1 to 3
// vectors with their count known at compile time.
template <typename Block>
inline void with_vectors(int vectors, Block&& block) {
  if (vectors == 1)
    block.template operator()<1>();
  else if (vectors == 2)
    block.template operator()<2>();
  else
    block.template operator()<3>();
}
#endif

// One output row's sums over the taps of some input channels: for w < out_w and o < outs,
// out[o][w] = start + sum over input channels i, taps (a, b) of
// k[(i * kh * kw + a * kw + b) * kOut + o] * in[i][row0 + a * dh][w + col0 + b * dw] (in[i] at
// in[i / kChunk] + (i % kChunk) * in_plane: row 0 of channel i), where start
// is out[o][w] itself (accumulate), init[o], or 0; input values outside the in_h x in_w planes
// count as 0; with `activate`, the sums go out through elementwise::leaky_relu(sum, slope) (ReLU:
// slope 0), computed alike. The forward reads x from row0 = output row - pad_top, col0 =
// -pad_left (the padding is the reads outside); the backward-data pass reads dy with the kernel
// flipped (correlate_all: row0, col0 <= 0, the edges outside).
struct RowJob {
  Chunks in;  // row 0 of each chunk's first input channel
  std::int64_t in_plane, in_row, in_h, in_w;
  std::int64_t row0, col0;
  const float* k;
  std::int64_t kh, kw, dh, dw;
  float* out;  // output channel 0 of the row
  std::int64_t out_plane, out_w, outs;
  const float* init;  // nullptr: 0
  bool activate = false;
  float slope = 0;
  // Streaming stores for the whole vectors of `out` that start on a 64-byte line (correlate_all
  // asks for them where one pass over the input channels writes an output larger than the caches
  // keep: its lines are then not read in before they are written); the row's blocks then start
  // on the output's lines, not the input's (correlate_row's `head`).
  bool stream = false;
  // Pair taps (ConvShapes::doubled_begin): input channels [pair_begin, pair_end), whole chunks,
  // hold 2x2 blocks of equal values, so a 3x3 kernel's output reads them at tap rows 0 and 2 and
  // tap columns 0 and 2 alone, each with the sum of the taps whose reads it stands for: which
  // taps depends on the parity of the output's centre (its tap (1, 1)) in global coordinates, per
  // row (pair_k is this row's) and per lane (pattern q of pair_k holds the weights of lanes whose
  // centre has parity (q + lane) % 2): pair_k[(((q * pairs + i - pair_begin) * 4 + a * 2 + b) * 8 +
  // o) * 2 + lane % 2], pairs = pair_end - pair_begin; pair_parity: the parity of output column
  // 0's centre. 24 -> 8 channels, 16 of them doubled, 2048x2048, 2 threads of the Intel Xeon with
  // AMX: forward 93-106 -> 72-77 ms, filter gradient 106-123 -> 88-95 ms (less than the products
  // alone, 136 of 216, would give). pair_row0: the pair taps' first row (the centre's block above
  // read at its first row where that lies in the input, so that only one row of each block is
  // read); pair_next: the row the next output row reads first among the pair channels' (asked for
  // ahead), or -1.
  const float* pair_k = nullptr;
  std::int64_t pair_begin = 0, pair_end = 0, pair_parity = 0, pair_row0 = 0, pair_next = -1;
};

#if TESSERA_HAS_WIDE_LOOPS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
namespace wide {

// The lanes l of 16 columns from `first` with 0 <= first + l < limit.
inline __mmask16 columns_within(std::int64_t first, std::int64_t limit) {
  const std::int64_t lo = std::clamp<std::int64_t>(-first, 0, kLanes);
  const std::int64_t hi = std::clamp<std::int64_t>(limit - first, 0, kLanes);
  if (hi <= lo) return 0;
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// p + k as an address, for a masked load whose first lanes lie before p's row (and may lie before
// its allocation): the masked-off lanes are never read, but forming such a pointer by arithmetic
// would be undefined.
inline const float* at(const float* p, std::int64_t k) {
  return reinterpret_cast<const float*>(reinterpret_cast<std::uintptr_t>(p) +
                                        static_cast<std::uintptr_t>(k) * sizeof(float));
}

// A block's sums at its start (RowJob): out's values where `accumulate`, else the bias or 0;
// `store` the lanes of the output columns [w0, end) (all of them unless kMasked).
template <int PV, bool kMasked>
[[gnu::always_inline]] inline void start_block(const RowJob& job, bool accumulate, std::int64_t w0,
                                               std::int64_t end, __mmask16 (&store)[PV],
                                               __m512 (&acc)[kOut][PV]) {
  for (int p = 0; p < PV; ++p)
    store[p] = kMasked ? columns_within(w0 + kLanes * p, end) : __mmask16(0xffff);
  for (std::int64_t o = 0; o < kOut; ++o)
    for (int p = 0; p < PV; ++p) {
      const float* out = job.out + o * job.out_plane + w0 + kLanes * p;
      acc[o][p] = o >= job.outs         ? _mm512_setzero_ps()
                  : accumulate          ? _mm512_maskz_loadu_ps(store[p], out)
                  : job.init != nullptr ? _mm512_set1_ps(job.init[o])
                                        : _mm512_setzero_ps();
    }
}

// A block's sums written to out: through the activation where `finish` and job.activate,
// streamed where job.stream and a vector starts a line.
template <int PV, bool kMasked>
[[gnu::always_inline]] inline void finish_block(const RowJob& job, bool finish, std::int64_t w0,
                                                const __mmask16 (&store)[PV],
                                                __m512 (&acc)[kOut][PV]) {
  if (finish && job.activate) {
    // elementwise::leaky_relu: x > 0 ? x : slope * x, NaN and -0 included.
    const __m512 slope = _mm512_set1_ps(job.slope), zero = _mm512_setzero_ps();
    for (std::int64_t o = 0; o < kOut; ++o)
      for (int p = 0; p < PV; ++p) {
        const __mmask16 positive = _mm512_cmp_ps_mask(acc[o][p], zero, _CMP_GT_OQ);
        acc[o][p] = _mm512_mask_blend_ps(positive, _mm512_mul_ps(slope, acc[o][p]), acc[o][p]);
      }
  }
  for (std::int64_t o = 0; o < kOut; ++o)
    for (int p = 0; p < PV; ++p) {
      float* out = job.out + o * job.out_plane + w0 + kLanes * p;
      if (o >= job.outs)
        continue;
      else if constexpr (kMasked)
        _mm512_mask_storeu_ps(out, store[p], acc[o][p]);
      else if (job.stream && reinterpret_cast<std::uintptr_t>(out) % 64 == 0)
        _mm512_stream_ps(out, acc[o][p]);
      else
        _mm512_storeu_ps(out, acc[o][p]);
    }
}

// Output columns [w0, end) of a RowJob over input channels [i0, i1) and tap rows [a0, a1), end <=
// w0 + 16 * PV; kMasked where end is short of that or some of their reads lie outside the input's.
// KH, KW: the kernel's extent when known at compile time (0: job.kh, job.kw): 3x3 unrolled issues
// the loads of all nine taps of a channel early, 25-30% faster than the loop. kPairs: a job of
// pair taps (correlate_row's `pairs`: 2x2 taps 2 apart), job.k one pattern of RowJob::pair_k,
// whose weights are two values, for even and odd lanes, instead of one.
template <int PV, bool kMasked, int KH, int KW, bool kPairs = false>
void row_block(const RowJob& job, std::int64_t i0, std::int64_t i1, std::int64_t a0,
               std::int64_t a1, bool accumulate, bool finish, std::int64_t w0, std::int64_t end) {
  const std::int64_t kh = KH > 0 ? KH : job.kh, kw = KW > 0 ? KW : job.kw;
  __mmask16 store[PV];
  __m512 acc[kOut][PV];
  start_block<PV, kMasked>(job, accumulate, w0, end, store, acc);
  __mmask16 load[kMaxExtent][PV];
  if constexpr (kMasked)
    for (std::int64_t b = 0; b < kw; ++b)
      for (int p = 0; p < PV; ++p)
        load[b][p] = columns_within(w0 + job.col0 + b * job.dw + kLanes * p, job.in_w);
  const std::int64_t taps = kh * kw;
  // The taps of input channel i; with every tap row inside the input (kAllRows), a loop the
  // compiler unrolls whole for a known extent.
  auto channel = [&](std::int64_t i, auto all_rows) {
    for (std::int64_t a = 0; a < kh; ++a) {
      if constexpr (!decltype(all_rows)::value)
        if (a < a0 || a >= a1) continue;
      const float* row =
          job.in[i / kChunk] + i % kChunk * job.in_plane + (job.row0 + a * job.dh) * job.in_row;
      constexpr std::int64_t kWeight = kPairs ? kOut * kPairLanes : kOut;  // floats a tap
      const float* k = kPairs ? job.k + ((i - job.pair_begin) * kh + a) * kw * kWeight
                              : job.k + (i * taps + a * kw) * kOut;
      for (std::int64_t b = 0; b < kw; ++b, k += kWeight) {
        const std::int64_t c = w0 + job.col0 + b * job.dw;
        __m512 v[PV];
        for (int p = 0; p < PV; ++p)
          v[p] = kMasked ? _mm512_maskz_loadu_ps(load[b][p], at(row, c + kLanes * p))
                         : _mm512_loadu_ps(row + c + kLanes * p);
        for (std::int64_t o = 0; o < kOut; ++o) {
          // A pair tap's weights alternate over the lanes: its two values broadcast as one
          // 64-bit value (the weights of a chunk then stay in the first-level cache: 2 KiB).
          __m512 weight;
          if constexpr (kPairs) {
            std::int64_t two;
            std::memcpy(&two, k + o * kPairLanes, sizeof two);
            weight = _mm512_castsi512_ps(_mm512_set1_epi64(two));
          } else {
            weight = _mm512_set1_ps(k[o]);
          }
          for (int p = 0; p < PV; ++p)
            acc[o][p] = _mm512_fmadd_ps(weight, v[p], acc[o][p]);
        }
      }
    }
  };
  if (a0 == 0 && a1 == kh)
    for (std::int64_t i = i0; i < i1; ++i)
      channel(i, std::true_type{});
  else
    for (std::int64_t i = i0; i < i1; ++i)
      channel(i, std::false_type{});
  finish_block<PV, kMasked>(job, finish, w0, store, acc);
}

// The whole RowJob over `channels` input channels, kChunk of them per pass over the row: 8
// channels x 3 tap rows are as many rows as stream through the caches well at once (24 -> 8
// channels 3x3 at 2048x2048, one Skylake-SP core: 24 channels a pass 34 GFLOP/s, 8 a pass 90).
void correlate_row(const RowJob& job, std::int64_t channels) {
  constexpr int kVectors = 3;  // 8 x 3 sums, 3 inputs and a weight: 28 of 32 registers
  constexpr std::int64_t kStep = kLanes * kVectors;
  // the tap rows inside the input
  const auto [a0, a1] = tap_rows_inside(job.row0, job.kh, job.dh, job.in_h);
  const std::int64_t reach = job.col0 + (job.kw - 1) * job.dw;  // the last tap's column offset
  const bool three = job.kh == 3 && job.kw == 3;
  // The pair taps' job (RowJob::pair_k): 2x2 taps 2 apart from the same first row and column, so
  // the same reach; its k set per block to the pattern of the block's first lane.
  RowJob pairs = job;
  pairs.kh = pairs.kw = pairs.dh = pairs.dw = 2;
  pairs.row0 = job.pair_row0;
  std::int64_t p0 = 0, p1 = 2;
  while (p0 < p1 && pairs.row0 + 2 * p0 < 0)
    ++p0;
  while (p1 > p0 && pairs.row0 + 2 * (p1 - 1) >= job.in_h)
    --p1;
  const std::int64_t pattern = (job.pair_end - job.pair_begin) * 4 * kOut * kPairLanes;
  // The next output row's last tap row: the one input row it reads that this row did not (for
  // dilation 1), asked for into the second-level cache as this row goes: a row reads the rows of
  // every input channel, too many streams for the hardware prefetchers. 24 -> 8 channels at
  // 2048x2048, Skylake-SP, 2 threads: forward 305 -> 225 ms, backward-data 245 -> 210 ms.
  const std::int64_t next = job.row0 + 1 + (job.kh - 1) * job.dh;
  const bool ahead = next >= 0 && next < job.in_h;
  // Where every input row starts at the same place in a 64-byte line (rows and planes a multiple
  // of 16 floats apart: a 2048-column tile) and a block's reads from output column w0 would cross
  // one line more than they need (a 3x3 "same" conv: 50 columns from 1 before a line, 5 lines a
  // row instead of 4), the first block is short, of `head` columns, and the others read from a
  // line's start (their stores then do not start on one). 8 -> 8 channels, pad 1, 2048x2048, one
  // core, best of 25-30 alternated: forward 64-65 -> 61-63 ms. The rest of the gap to a
  // materialised 2050-column window (56 ms) is the tile's 2048-column rows: the same padded
  // forward of the same tile lying in 2050-column rows (a box) takes 56.5.
  std::int64_t head = 0;
  if (!job.stream && a0 < a1 && job.in_row % kLanes == 0 && job.in_plane % kLanes == 0) {
    const auto index = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(job.in[0]) /
                                                 sizeof(float) % kLanes);
    const std::int64_t offset = ((index + job.col0) % kLanes + kLanes) % kLanes;
    const std::int64_t span = kStep + (job.kw - 1) * job.dw;  // a block's input columns
    const auto lines = [](std::int64_t columns) { return (columns + kLanes - 1) / kLanes; };
    if (lines(offset + span) > lines(span)) head = kLanes - offset + kStep - kLanes;
    if (head >= job.out_w) head = 0;
  }
  for (std::int64_t i0 = 0; i0 < channels; i0 += kChunk) {
    const std::int64_t i1 = std::min(channels, i0 + kChunk);
    const bool finish = i1 == channels;
    const bool paired = job.pair_k != nullptr && i0 >= job.pair_begin && i0 < job.pair_end;
    for (std::int64_t w0 = 0, end = 0; w0 < job.out_w; w0 = end) {
      if (const std::int64_t row_ahead = paired ? job.pair_next : next;
          paired ? row_ahead >= 0 && row_ahead < job.in_h : ahead) {
        const std::int64_t first = std::max<std::int64_t>(0, w0 + job.col0);
        const std::int64_t last = std::min(job.in_w, w0 + kStep + reach);
        for (std::int64_t i = i0; i < i1; ++i) {
          const float* row =
              job.in[i / kChunk] + i % kChunk * job.in_plane + row_ahead * job.in_row;
          for (std::int64_t c = first; c < last; c += kLanes)
            _mm_prefetch(reinterpret_cast<const char*>(row + c), _MM_HINT_T1);
        }
      }
      // The row's last columns, where fewer than kStep are left, in as few vectors as cover them.
      const std::int64_t left = (w0 == 0 && head > 0 ? head : job.out_w) - w0;
      const int vectors = left >= kStep ? kVectors : static_cast<int>((left + kLanes - 1) / kLanes);
      const std::int64_t step = kLanes * vectors;
      end = w0 + std::min(step, left);
      const bool inside = w0 + job.col0 >= 0 && w0 + step <= end && w0 + step + reach <= job.in_w;
      const auto block = [&]<int PV>() {
        if (paired) {
          pairs.k = job.pair_k + (job.pair_parity + w0) % 2 * pattern;
          if (inside)
            row_block<PV, false, 2, 2, true>(pairs, i0, i1, p0, p1, i0 > 0, finish, w0, end);
          else
            row_block<PV, true, 2, 2, true>(pairs, i0, i1, p0, p1, i0 > 0, finish, w0, end);
        } else if (inside && three)
          row_block<PV, false, 3, 3>(job, i0, i1, a0, a1, i0 > 0, finish, w0, end);
        else if (inside)
          row_block<PV, false, 0, 0>(job, i0, i1, a0, a1, i0 > 0, finish, w0, end);
        else if (three)
          row_block<PV, true, 3, 3>(job, i0, i1, a0, a1, i0 > 0, finish, w0, end);
        else
          row_block<PV, true, 0, 0>(job, i0, i1, a0, a1, i0 > 0, finish, w0, end);
      };
      with_vectors(vectors, block);
    }
  }
}

constexpr std::int64_t kFilterColumns = 512;

// partial's sums of taps b0 + g (filter_taps) += the sums s0, s1, s2 of g = 0, 1, 2 (g < NB).
template <int NB>
[[gnu::always_inline]] inline void add_partials(const __m512 (&s0)[kOut], const __m512 (&s1)[kOut],
                                                const __m512 (&s2)[kOut], float* partial) {
  for (std::int64_t o = 0; o < kOut; ++o) {
    float* p = partial + o * kLanes;
    constexpr std::int64_t tap = kOut * kLanes;
    _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), s0[o]));
    if constexpr (NB > 1) _mm512_storeu_ps(p + tap, _mm512_add_ps(_mm512_loadu_ps(p + tap), s1[o]));
    if constexpr (NB > 2)
      _mm512_storeu_ps(p + 2 * tap, _mm512_add_ps(_mm512_loadu_ps(p + 2 * tap), s2[o]));
  }
}

// partial[o][g][lane] += the products dy[o][w] * x[col + w + (b0 + g) * dw] over the `vectors` x
// 16 columns w of a piece of a row (dy's column 0 the piece's first), g < NB, summed per lane
// (w % 16) in float: those of tap b0 + g of output channel o at partial + (g * 8 + o) * 16, one
// contiguous block. x: the row of x (its column 0), `col` the piece's first column for tap b0
// (< 0 in the left padding); columns outside [0, in_w) read as zero: the vectors at the row's
// ends with masked loads, the others as they lie. dy: 8 rows of kFilterColumns, copies (zeros past
// the piece and for channels past the last). The sums are three arrays rather than one of two
// dimensions, and dy is one block addressed by constant offsets: GCC 12 at -O3 kept the sums in
// memory otherwise, short of registers for eight row pointers.
template <int NB>
void filter_taps(const float* dy, std::int64_t vectors, const float* x, std::int64_t col,
                 std::int64_t in_w, std::int64_t dw, float* partial) {
  static_assert(NB >= 1 && NB <= 3);
  __m512 s0[kOut], s1[kOut], s2[kOut];
  for (std::int64_t o = 0; o < kOut; ++o)
    s0[o] = s1[o] = s2[o] = _mm512_setzero_ps();
  const auto step = [&](std::int64_t j, auto masked) {
    const std::int64_t c = col + j * kLanes;
    __m512 v0, v1, v2;
    if constexpr (decltype(masked)::value) {
      v0 = _mm512_maskz_loadu_ps(columns_within(c, in_w), at(x, c));
      v1 = NB > 1 ? _mm512_maskz_loadu_ps(columns_within(c + dw, in_w), at(x, c + dw))
                  : _mm512_setzero_ps();
      v2 = NB > 2 ? _mm512_maskz_loadu_ps(columns_within(c + 2 * dw, in_w), at(x, c + 2 * dw))
                  : _mm512_setzero_ps();
    } else {
      const float* xj = x + c;
      v0 = _mm512_loadu_ps(xj);
      v1 = NB > 1 ? _mm512_loadu_ps(xj + dw) : _mm512_setzero_ps();
      v2 = NB > 2 ? _mm512_loadu_ps(xj + 2 * dw) : _mm512_setzero_ps();
    }
    for (std::int64_t o = 0; o < kOut; ++o) {
      __m512 d = _mm512_load_ps(dy + o * kFilterColumns + j * kLanes);
      // One load for the NB products: GCC would fold one into each multiply, 27 loads a step for
      // 24 multiplies instead of 11 (24 -> 8 at 2048x2048, one core: 250-275 -> 228-237 ms).
      asm("" : "+v"(d));
      s0[o] = _mm512_fmadd_ps(d, v0, s0[o]);
      if constexpr (NB > 1) s1[o] = _mm512_fmadd_ps(d, v1, s1[o]);
      if constexpr (NB > 2) s2[o] = _mm512_fmadd_ps(d, v2, s2[o]);
    }
  };
  // Vectors [0, lo) read some columns left of 0, [hi, vectors) some right of in_w - 1 (vector j
  // reads col + 16 j to col + 16 j + 15 + (NB - 1) dw); in the same order as one loop would.
  const std::int64_t lo = col >= 0 ? 0 : std::min(vectors, (kLanes - 1 - col) / kLanes);
  const std::int64_t room = in_w - col - kLanes - (NB - 1) * dw;
  const std::int64_t hi = std::max(lo, room < 0 ? 0 : std::min(vectors, room / kLanes + 1));
  for (std::int64_t j = 0; j < lo; ++j)
    step(j, std::true_type{});
  for (std::int64_t j = lo; j < hi; ++j)
    step(j, std::false_type{});
  for (std::int64_t j = hi; j < vectors; ++j)
    step(j, std::true_type{});
  add_partials<NB>(s0, s1, s2, partial);
}

// n values from `from` into `to`, and zeros after them up to `to_length`.
void copy_padded(const float* from, std::int64_t n, float* to, std::int64_t to_length) {
  std::copy(from, from + n, to);
  std::fill(to + n, to + to_length, 0.0f);
}

// One output row of the filter gradient's products: dy's row of output channels [0, outs), x's
// planes of `channels` input channels. Output row h's tap (a, b) reads x's row row0 + a * dh,
// columns col0 + b * dw on (row0 = h - pad_top, col0 = -pad_left); rows outside [0, in_h) are
// skipped, columns outside [0, in_w) read as zero.
struct FilterJob {
  const float* dy;  // output channel 0 of the row
  std::int64_t dy_plane, outs, out_w;
  Chunks x;  // row 0 of each chunk's first input channel (RowJob::in)
  std::int64_t x_plane, x_row, in_h, in_w, channels;
  std::int64_t row0, col0;
  std::int64_t kh, kw, dh, dw;
  // Pair taps (RowJob::pair_k) for input channels [pair_begin, pair_end): tap rows 0 and 2 and
  // columns 0 and 2 alone, their products summed into the channel's taps pair_row * 4 + a * 2 + b
  // (pair_row: the parity of the row's centre; FilterSums::add_into gives them to the 3x3 taps).
  std::int64_t pair_begin = 0, pair_end = 0, pair_row = 0;
  std::int64_t pair_row0 = 0;  // the pair taps' first row (RowJob::pair_row0)
  // Twin tap rows (dot::filter_row): for input channels [twin_begin, twin_end), bit a of twin_rows
  // is set where tap rows a and a + 1 read one 2x2 block's two rows (ConvShapes::doubled_begin,
  // dilation 1), which hold the same values: tap row a's products are added into both rows' sums.
  std::int64_t twin_begin = 0, twin_end = 0, twin_rows = 0;
};

// The filter-gradient products of a FilterJob added into float partial sums per lane: for output
// channels o < outs, input channels c and taps (a, b), partial[(((c * kh + a) * kw + b) * 8 + o) *
// 16 + lane]. The row goes in pieces of kFilterColumns columns, each through every channel and tap
// with its 8 rows of dy copied into a block that stays in the first-level cache (whole 2048-column
// rows came from the second). x is read as it lies, its columns outside the row (the padding, and
// past a last piece that is not whole vectors) as zeros by masked loads of the vectors at the
// row's ends (filter_taps).
void filter_row(const FilterJob& job, float* partial) {
  const auto [a0, a1] = tap_rows_inside(job.row0, job.kh, job.dh, job.in_h);  // inside x
  alignas(64) float dy_block[kOut * kFilterColumns];
  for (std::int64_t w0 = 0; w0 < job.out_w; w0 += kFilterColumns) {
    const std::int64_t n = std::min(kFilterColumns, job.out_w - w0);
    const std::int64_t vectors = (n + kLanes - 1) / kLanes;
    // Up to the piece's last vector, which is all filter_taps reads: a narrow row (a border
    // strip's column) copies and zeroes a vector, not the whole block.
    for (std::int64_t o = 0; o < kOut; ++o)
      copy_padded(job.dy + o * job.dy_plane + w0, o < job.outs ? n : 0,
                  dy_block + o * kFilterColumns, vectors * kLanes);
    const std::int64_t col = w0 + job.col0;  // the piece's first column for tap 0
    // Row `row` of x's channel c, its next piece asked for now: the 8 x 3 rows a piece reads are
    // too many streams for the prefetchers to follow.
    const auto x_row = [&](std::int64_t c, std::int64_t row) {
      const float* xr = job.x[c / kChunk] + c % kChunk * job.x_plane + row * job.x_row;
      if (w0 + kFilterColumns < job.out_w)
        for (std::int64_t l = 0; l < kFilterColumns; l += kLanes)
          _mm_prefetch(reinterpret_cast<const char*>(at(xr, col + kFilterColumns + l)),
                       _MM_HINT_T0);
      return xr;
    };
    constexpr std::int64_t kTap = kOut * kLanes;  // the partial sums of one tap
    for (std::int64_t c = 0; c < job.channels; ++c) {
      if (c >= job.pair_begin && c < job.pair_end) {
        float* pc = partial + (c * job.kh * job.kw + job.pair_row * 4) * kTap;
        for (std::int64_t a = 0; a < 2; ++a)
          if (const std::int64_t row = job.pair_row0 + 2 * a; row >= 0 && row < job.in_h)
            filter_taps<2>(dy_block, vectors, x_row(c, row), col, job.in_w, 2, pc + a * 2 * kTap);
        continue;
      }
      for (std::int64_t a = a0; a < a1; ++a) {
        const float* xr = x_row(c, job.row0 + a * job.dh);
        float* pa = partial + (c * job.kh + a) * job.kw * kTap;
        for (std::int64_t b0 = 0; b0 < job.kw; b0 += 3) {
          const std::int64_t cb = col + b0 * job.dw;
          float* pb = pa + b0 * kTap;
          switch (std::min<std::int64_t>(3, job.kw - b0)) {
            case 1:
              filter_taps<1>(dy_block, vectors, xr, cb, job.in_w, job.dw, pb);
              break;
            case 2:
              filter_taps<2>(dy_block, vectors, xr, cb, job.in_w, job.dw, pb);
              break;
            default:
              filter_taps<3>(dy_block, vectors, xr, cb, job.in_w, job.dw, pb);
          }
        }
      }
    }
  }
}

// sums[j] += partial[j] in double and partial[j] = 0, for j < n (a multiple of 16).
void flush(float* partial, double* sums, std::int64_t n) {
  for (std::int64_t j = 0; j < n; j += kLanes) {
    // The maskz forms: GCC 12's unmasked ones start from an "undefined" vector that
    // -Wmaybe-uninitialized flags.
    const __m512 v = _mm512_loadu_ps(partial + j);
    const __m512d low = _mm512_maskz_cvtps_pd(0xff, _mm512_maskz_extractf32x8_ps(0xff, v, 0));
    const __m512d high = _mm512_maskz_cvtps_pd(0xff, _mm512_maskz_extractf32x8_ps(0xff, v, 1));
    _mm512_storeu_pd(sums + j, _mm512_add_pd(_mm512_loadu_pd(sums + j), low));
    _mm512_storeu_pd(sums + j + 8, _mm512_add_pd(_mm512_loadu_pd(sums + j + 8), high));
    _mm512_storeu_ps(partial + j, _mm512_setzero_ps());
  }
}

// The sum of p[0, n) in double: per lane in float over the row, then the lanes in double.
double row_sum(const float* p, std::int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (std::int64_t w0 = 0; w0 < n; w0 += kLanes)
    acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(columns_within(w0, n), p + w0));
  alignas(64) float lanes[kLanes];
  _mm512_store_ps(lanes, acc);
  double s = 0;
  for (float v : lanes)
    s += v;
  return s;
}

}  // namespace wide
#pragma GCC pop_options

// Under --precision bf16 on CPUs with AVX512_BF16 and no AMX (AMD Zen 4 and Zen 5, Intel Cooper
// Lake): the narrow kernels in bfloat16 dot products (vdpbf16ps: each of 16 float lanes adds two
// products of bfloat16 pairs, as many multiplies an instruction as two float FMAs). The forward
// and backward-data put input channels 2q and 2q + 1 of a pixel in a lane: each input row is
// converted once into a staged row of such pairs, kept while the output rows that read it are
// computed (a ring of the kernel's rows, in the second-level cache) and zero-padded at both ends,
// so that no load is masked; every output is then written once, from all its input channels in
// one pass. The filter gradient puts two neighbouring columns in a lane: dy's pieces of rows
// converted as they are read, x's rows staged in bfloat16 in the same kind of ring.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,prefer-vector-width=512")
namespace dot {

using wide::at;
using wide::columns_within;
using wide::kFilterColumns;

// Two bfloat16 values: channel 2q's in the low half, 2q + 1's in the high one.
using Pair = std::uint32_t;
constexpr std::int64_t kPairColumns = 2 * kLanes;  // bfloat16 values in a vector

inline __m512bh bh(const __m512i& v) {
  return reinterpret_cast<const __m512bh&>(v);
}

// bfloat16 (round to nearest even) of row[first + j] for j < n (a multiple of 32) into out[j],
// zero where first + j lies outside [0, limit).
void to_bf16(const float* row, std::int64_t first, std::int64_t limit, std::int64_t n,
             std::uint16_t* out) {
  for (std::int64_t j = 0; j < n; j += kPairColumns) {
    const std::int64_t c = first + j;
    const bool inside = c >= 0 && c + kPairColumns <= limit;
    const __m512 l = inside ? _mm512_loadu_ps(row + c)
                            : _mm512_maskz_loadu_ps(columns_within(c, limit), at(row, c));
    const __m512 h =
        inside ? _mm512_loadu_ps(row + c + kLanes)
               : _mm512_maskz_loadu_ps(columns_within(c + kLanes, limit), at(row, c + kLanes));
    const __m512bh v = _mm512_cvtne2ps_pbh(h, l);  // l's 16 values, then h's
    _mm512_storeu_si512(out + j, reinterpret_cast<const __m512i&>(v));
  }
}

// A staged row: out[j] for j < width (a multiple of 16) the pair of lo's and hi's (nullptr: zeros)
// column j - lpad, zero outside [0, in_w).
void stage_row(const float* lo, const float* hi, std::int64_t in_w, std::int64_t lpad,
               std::int64_t width, Pair* out) {
  // Word 2l of a pair vector from word l of the conversion (lo's), word 2l + 1 from word 16 + l.
  static constexpr auto kInterleave = [] {
    std::array<std::uint16_t, kPairColumns> order{};
    for (std::size_t l = 0; l < order.size() / 2; ++l) {
      order[2 * l] = static_cast<std::uint16_t>(l);
      order[2 * l + 1] = static_cast<std::uint16_t>(kLanes + static_cast<std::int64_t>(l));
    }
    return order;
  }();
  const __m512i interleave = _mm512_loadu_si512(kInterleave.data());
  for (std::int64_t j = 0; j < width; j += kLanes) {
    const std::int64_t c = j - lpad;
    const __mmask16 m = c >= 0 && c + kLanes <= in_w ? __mmask16(0xffff) : columns_within(c, in_w);
    const __m512 l = _mm512_maskz_loadu_ps(m, at(lo, c));
    const __m512 h = hi != nullptr ? _mm512_maskz_loadu_ps(m, at(hi, c)) : _mm512_setzero_ps();
    const __m512bh v = _mm512_cvtne2ps_pbh(h, l);
    _mm512_storeu_si512(out + j,
                        _mm512_permutexvar_epi16(interleave, reinterpret_cast<const __m512i&>(v)));
  }
}

// The staged rows an output row reads (RowJob's geometry and output): tap row a's at rows[a]
// (a in [a0, a1): the rows inside the input), pair q's pair_stride further on; output column w's
// tap b at index w + b * dw. k: the weights as pairs, k[((q * kh + a) * kw + b) * 8 + o].
// ahead: the input row the next output row stages first (its channels' rows; `aheads` of them),
// asked for into the second-level cache as this row's blocks go (columns from col0 on, of in_w):
// staging reads the input from memory, unlike the dot products, which read the staged rows.
struct Staged {
  std::array<const Pair*, kMaxExtent> rows{};
  std::int64_t a0 = 0, a1 = 0, pairs = 0, pair_stride = 0;
  const Pair* k = nullptr;
  std::array<const float*, kMaxIn> ahead{};
  std::int64_t aheads = 0, col0 = 0, in_w = 0;
};

// Asks for columns [first, last) of `count` rows into the second-level cache.
inline void prefetch_rows(const float* const* rows, std::int64_t count, std::int64_t first,
                          std::int64_t last) {
  for (std::int64_t i = 0; i < count; ++i)
    for (std::int64_t c = first; c < last; c += kLanes)
      _mm_prefetch(reinterpret_cast<const char*>(rows[i] + c), _MM_HINT_T1);
}

// Output columns [w0, end) of a RowJob from staged rows; end <= w0 + 16 * PV, kMasked where
// short of that. KH, KW as wide::row_block's.
template <int PV, bool kMasked, int KH, int KW>
void row_block(const RowJob& job, const Staged& in, std::int64_t w0, std::int64_t end) {
  const std::int64_t kh = KH > 0 ? KH : job.kh, kw = KW > 0 ? KW : job.kw;
  __mmask16 store[PV];
  __m512 acc[kOut][PV];
  wide::start_block<PV, kMasked>(job, false, w0, end, store, acc);
  const auto pair = [&](std::int64_t q, auto all_rows) {
    for (std::int64_t a = 0; a < kh; ++a) {
      if constexpr (!decltype(all_rows)::value)
        if (a < in.a0 || a >= in.a1) continue;
      const Pair* row = in.rows[static_cast<std::size_t>(a)] + q * in.pair_stride + w0;
      const Pair* k = in.k + (q * kh + a) * kw * kOut;
      for (std::int64_t b = 0; b < kw; ++b, k += kOut) {
        __m512i v[PV];
        for (int p = 0; p < PV; ++p)
          v[p] = _mm512_loadu_si512(row + b * job.dw + kLanes * p);
        for (std::int64_t o = 0; o < kOut; ++o) {
          const __m512i weight = _mm512_set1_epi32(static_cast<int>(k[o]));
          for (int p = 0; p < PV; ++p)
            acc[o][p] = _mm512_dpbf16_ps(acc[o][p], bh(v[p]), bh(weight));
        }
      }
    }
  };
  if (in.a0 == 0 && in.a1 == kh)
    for (std::int64_t q = 0; q < in.pairs; ++q)
      pair(q, std::true_type{});
  else
    for (std::int64_t q = 0; q < in.pairs; ++q)
      pair(q, std::false_type{});
  wide::finish_block<PV, kMasked>(job, true, w0, store, acc);
}

// One output row of a RowJob (its output fields and geometry) from staged rows, 48 columns a
// block.
void correlate_row(const RowJob& job, const Staged& in) {
  constexpr int kVectors = 3;
  constexpr std::int64_t kStep = kLanes * kVectors;
  const bool three = job.kh == 3 && job.kw == 3;
  for (std::int64_t w0 = 0, end = 0; w0 < job.out_w; w0 = end) {
    const std::int64_t left = job.out_w - w0;
    const int vectors = left >= kStep ? kVectors : static_cast<int>((left + kLanes - 1) / kLanes);
    end = w0 + std::min(kLanes * vectors, left);
    const bool whole = end == w0 + kLanes * vectors;
    prefetch_rows(in.ahead.data(), in.aheads, std::max<std::int64_t>(0, w0 + in.col0),
                  std::min(in.in_w, end + in.col0 + (job.kw - 1) * job.dw));
    const auto block = [&]<int PV>() {
      if (whole && three)
        row_block<PV, false, 3, 3>(job, in, w0, end);
      else if (whole)
        row_block<PV, false, 0, 0>(job, in, w0, end);
      else if (three)
        row_block<PV, true, 3, 3>(job, in, w0, end);
      else
        row_block<PV, true, 0, 0>(job, in, w0, end);
    };
    with_vectors(vectors, block);
  }
}

// wide::filter_taps in bfloat16: partial[(g * 8 + o) * 16 + lane] += the products dy[o][w] *
// x[w + g * dw] over `vectors` x 32 columns w, lane w % 32 / 2. dy: 8 rows of kFilterColumns
// bfloat16 values; x: the piece's bfloat16 values from tap b0's first column on.
template <int NB>
void filter_taps(const std::uint16_t* dy, std::int64_t vectors, const std::uint16_t* x,
                 std::int64_t dw, float* partial, float* twin) {
  static_assert(NB >= 1 && NB <= 3);
  __m512 s0[kOut], s1[kOut], s2[kOut];
  for (std::int64_t o = 0; o < kOut; ++o)
    s0[o] = s1[o] = s2[o] = _mm512_setzero_ps();
  for (std::int64_t j = 0; j < vectors; ++j) {
    const std::uint16_t* xj = x + j * kPairColumns;
    const __m512i v0 = _mm512_loadu_si512(xj);
    const __m512i v1 = NB > 1 ? _mm512_loadu_si512(xj + dw) : _mm512_setzero_si512();
    const __m512i v2 = NB > 2 ? _mm512_loadu_si512(xj + 2 * dw) : _mm512_setzero_si512();
    for (std::int64_t o = 0; o < kOut; ++o) {
      __m512i d = _mm512_load_si512(dy + o * kFilterColumns + j * kPairColumns);
      asm("" : "+v"(d));  // one load for the NB products (wide::filter_taps)
      s0[o] = _mm512_dpbf16_ps(s0[o], bh(d), bh(v0));
      if constexpr (NB > 1) s1[o] = _mm512_dpbf16_ps(s1[o], bh(d), bh(v1));
      if constexpr (NB > 2) s2[o] = _mm512_dpbf16_ps(s2[o], bh(d), bh(v2));
    }
  }
  wide::add_partials<NB>(s0, s1, s2, partial);
  if (twin != nullptr) wide::add_partials<NB>(s0, s1, s2, twin);
}

// wide::filter_row in bfloat16: the same partial sums, each lane two columns' products. dy's 8
// rows of a piece converted into a block in the first-level cache; x's rows staged (in bfloat16,
// zero-padded: column w's tap b at rows[a] + c * x_stride + w + b * dw for channel c, tap row a).
// dy_ahead, x_ahead: the next rows of dy (8, or none) and of x (job.channels, or none) the next
// call reads, asked for into the second-level cache piece by piece.
void filter_row(const wide::FilterJob& job,
                const std::array<const std::uint16_t*, kMaxExtent>& rows, std::int64_t x_stride,
                float* partial, const float* const* dy_ahead, const float* const* x_ahead) {
  const auto [a0, a1] = tap_rows_inside(job.row0, job.kh, job.dh, job.in_h);  // inside x
  alignas(64) std::uint16_t dy_block[kOut * kFilterColumns];
  constexpr std::int64_t kTap = kOut * kLanes;  // the partial sums of one tap
  for (std::int64_t w0 = 0; w0 < job.out_w; w0 += kFilterColumns) {
    const std::int64_t n = std::min(kFilterColumns, job.out_w - w0);
    const std::int64_t vectors = (n + kPairColumns - 1) / kPairColumns;
    for (std::int64_t o = 0; o < kOut; ++o)
      to_bf16(job.dy + o * job.dy_plane + w0, 0, o < job.outs ? n : 0, vectors * kPairColumns,
              dy_block + o * kFilterColumns);
    if (dy_ahead != nullptr) prefetch_rows(dy_ahead, job.outs, w0, w0 + n);
    if (x_ahead != nullptr)
      prefetch_rows(x_ahead, job.channels, std::max<std::int64_t>(0, w0 + job.col0),
                    std::min(job.in_w, w0 + n + job.col0 + (job.kw - 1) * job.dw));
    for (std::int64_t c = 0; c < job.channels; ++c) {
      const std::int64_t twins = c >= job.twin_begin && c < job.twin_end ? job.twin_rows : 0;
      for (std::int64_t a = a0; a < a1; ++a) {
        if (a > 0 && (twins >> (a - 1) & 1) != 0) continue;  // tap row a - 1 added them
        const std::uint16_t* xr = rows[static_cast<std::size_t>(a)] + c * x_stride + w0;
        float* pa = partial + (c * job.kh + a) * job.kw * kTap;
        float* twin = (twins >> a & 1) != 0 ? pa + job.kw * kTap : nullptr;
        for (std::int64_t b0 = 0; b0 < job.kw; b0 += 3) {
          const std::uint16_t* xb = xr + b0 * job.dw;
          float* pb = pa + b0 * kTap;
          float* tb = twin != nullptr ? twin + b0 * kTap : nullptr;
          switch (std::min<std::int64_t>(3, job.kw - b0)) {
            case 1:
              filter_taps<1>(dy_block, vectors, xb, job.dw, pb, tb);
              break;
            case 2:
              filter_taps<2>(dy_block, vectors, xb, job.dw, pb, tb);
              break;
            default:
              filter_taps<3>(dy_block, vectors, xb, job.dw, pb, tb);
          }
        }
      }
    }
  }
}

}  // namespace dot
#pragma GCC pop_options
#endif

#if TESSERA_HAS_WIDE_LOOPS
// The side of a pair tap (RowJob::pair_k; 0: tap 0, 1: tap 2) whose read stands for 3x3 tap `tap`
// (0, 1, 2) along an axis, where the centre has parity `parity`: an even centre's block is it and
// the next (tap 1 reads tap 2's value), an odd centre's it and the one before (tap 1 reads tap
// 0's).
constexpr std::int64_t pair_side(std::int64_t parity, std::int64_t tap) {
  return parity == 0 ? (tap > 0 ? 1 : 0) : (tap == 2 ? 1 : 0);
}

// Row 0 of the first channel of each chunk of sample n's `channels` channels (RowJob::in).
Chunks chunks_of(const ChannelPlanes<const float>& p, std::int64_t n, std::int64_t channels) {
  Chunks q{};
  for (std::int64_t c = 0; c < channels; c += kChunk)
    q[static_cast<std::size_t>(c / kChunk)] = p.at(n, c, 0);
  return q;
}
#endif

// The planes of a box of `outer` at `at`.
template <typename F>
ChannelPlanes<F> channel_planes(F* data, const Shape4& outer, BoxAt at) {
  return channel_planes(data, outer, at.h, at.w);
}

#if TESSERA_HAS_WIDE_LOOPS
// Input rows converted once for the several output rows that read them (namespace dot): `count`
// slots of `size` values (64-byte aligned), the row `row` of sample n kept in slot row % count
// until another row of that slot replaces it; count = the rows an output row's taps span, so
// that an output row's rows never share a slot. Local to one thread.
template <typename T>
class RowRing {
 public:
  RowRing(std::int64_t count, std::int64_t size)
      : count_(count),
        size_(size),
        buffer_(std::make_unique_for_overwrite<T[]>(
            static_cast<std::size_t>(count * size + 64 / std::int64_t(sizeof(T))))),
        held_(static_cast<std::size_t>(count), -1) {}
  // The slot holding row `row` of sample n of a tensor `height` rows high, filled by stage(slot)
  // unless it holds that row already.
  template <typename Stage>
  const T* row(std::int64_t n, std::int64_t height, std::int64_t row, Stage&& stage) {
    const auto at = static_cast<std::size_t>(row % count_);
    T* slot = reinterpret_cast<T*>((reinterpret_cast<std::uintptr_t>(buffer_.get()) + 63) &
                                   ~std::uintptr_t{63}) +
              static_cast<std::int64_t>(at) * size_;
    if (held_[at] != n * height + row) {
      stage(slot);
      held_[at] = n * height + row;
    }
    return slot;
  }

 private:
  std::int64_t count_, size_;
  std::unique_ptr<T[]> buffer_;     // not zeroed: a slot is staged whole before it is read
  std::vector<std::int64_t> held_;  // n * height + row of each slot, or -1
};

class NarrowConv final : public ConvKernel<float> {
 public:
  NarrowConv(const ConvShapes& shapes, const reference::ConvGeometry& g)
      : s_(shapes),
        dh_(g.dilation_h),
        dw_(g.dilation_w),
        pad_top_(g.pad_top),
        pad_left_(g.pad_left) {
    // Under --precision bf16 on CPUs with AMX: Tessera's AMX kernels, reading and writing the
    // planes as they lie (all three passes or none; a box kernel's forward alone), where a pixel
    // has at least 128 products a tap (input x output channels). With fewer the float32 kernels
    // here are as fast or faster: the AMX kernels' time goes into transposing the planes into and
    // out of their tiles (one thread of an Intel Xeon with AMX, 2026-11-28, the three passes at
    // 2048x2048, ms: 24 -> 8 78 + 79 + 107 against 124 + 124 + 156, 8 -> 16 51 + 58 + 63 against
    // 85 + 82 + 97; 8 -> 8 44 + 43 + 56 against 41 + 41 + 55; at 1024x1024 3 -> 8 9 + 10 + 12
    // against 5 + 9 + 7).
    // Pair taps where x holds 2x2 blocks (ConvShapes::doubled_begin): in float32 even under
    // --precision bf16, where the AMX kernels would compute the 9 taps (unet-small's d1 in tessera
    // bench on the Intel Xeon with AMX, 3 runs alternated: forward 80-92 ms on AMX, 73-76 with
    // pair taps; backward 189-205 and 184-203); and so the layer's other kernels too (its border
    // strips, a tile whose blocks its edges split): a layer's kernels agree on the precision, or
    // the border outputs of a sharded run would be bf16's products where one rank's are float32's.
    // Under --precision bf16 on CPUs with AVX512_BF16 and no AMX: bfloat16 dot products
    // (namespace dot) in every pass of every kernel of the layer, the 9 taps where pair taps would
    // fit: their weights, sums of taps rounded to bfloat16, differ from the border strips' (box
    // kernels, each tap rounded alone), which put a sharded run's borders apart from one rank's
    // (gradcheck --precision bf16 on 1x1x2: d1's weight gradient 3.7e-2 apart; without pair taps
    // the output is the same bit for bit). TESSERA_NARROW_BF16=0: the float32 kernels.
    if (conv_bf16() && narrow_conv_bf16_dot()) {
      dot_ = true;
      return;
    }
    if (plan_pairs() || s_.doubled_end > s_.doubled_begin) return;
    if (!conv_bf16() || !amx::available() || shapes.x.c * shapes.y.c < 128) return;
    const amx::Correlation c{.in = s_.x,
                             .out = s_.y,
                             .kh = s_.w.h,
                             .kw = s_.w.w,
                             .pad_top = pad_top_,
                             .pad_left = pad_left_,
                             .dil_h = dh_,
                             .dil_w = dw_};
    amx_forward_ = amx::Conv::plan_nchw(c);
    if (!shapes.is_box()) {
      amx_data_ = amx::Conv::plan_nchw(amx::adjoint(c));
      amx_weights_ = amx::ConvWeights::plan_nchw(c);
      if (!amx_data_ || !amx_weights_) amx_forward_.reset();
    }
    if (!amx_forward_) {
      amx_data_.reset();
      amx_weights_.reset();
    }
  }
  // Planned with ConvShapes::activation: the forward applies it as it writes y.
  bool applies_activation() const override { return s_.activation.has_value(); }

  void forward(const Tensor<float>& x, const Tensor<float>& w, std::span<const float> bias,
               Tensor<float>& y) override {
    check("forward", x, s_.x, w, y, s_.y, bias);
    correlate_all(channel_planes(x.data(), s_.x), s_.x, channel_planes(y.data(), s_.y), s_.y, false,
                  w, bias);
  }

  void forward_box(const Tensor<float>& x, BoxAt x_at, const Tensor<float>& w,
                   std::span<const float> bias, Tensor<float>& y, BoxAt y_at) override {
    TESSERA_CHECK(s_.is_box(), "narrow conv: forward_box of a kernel planned for whole tensors");
    check("forward_box", x, s_.x_outer, w, y, s_.y_outer, bias);
    const auto fits = [](BoxAt at, const Shape4& box, const Shape4& outer) {
      return at.h >= 0 && at.w >= 0 && at.h + box.h <= outer.h && at.w + box.w <= outer.w;
    };
    TESSERA_CHECK(fits(x_at, s_.x, s_.x_outer) && fits(y_at, s_.y, s_.y_outer),
                  "narrow conv: forward_box called with boxes outside their tensors");
    correlate_all(channel_planes(x.data(), s_.x_outer, x_at), s_.x,
                  channel_planes(y.data(), s_.y_outer, y_at), s_.y, false, w, bias);
  }

  // dx is dy correlated with the flipped kernel, input and output channels swapped.
  void backward_data(const Tensor<float>& dy, const Tensor<float>& w, Tensor<float>& dx) override {
    check("backward_data", dx, s_.x, w, dy, s_.y, {});
    correlate_all(channel_planes(dy.data(), s_.y), s_.y, channel_planes(dx.data(), s_.x), s_.x,
                  true, w, {});
  }

  void backward_filter(const Tensor<float>& x, const Tensor<float>& dy, Tensor<float>& dw,
                       std::span<float> dbias) override {
    check("backward_filter", x, s_.x, dw, dy, s_.y, dbias);
    filter(channel_planes(x.data(), s_.x), dy, dw, dbias);
  }

  // Both passes and f' in one sweep over bands of rows that stay in the core's L2 (float32
  // kernels, x and y of one height, no box): a band's dx rows from dy, f' read from x's rows, then
  // the filter sums of the band's dy rows against x's; x and dy are read from memory once, and dx
  // written once, not streamed and read back for f'. Bit for bit the separate passes: the same
  // rows, and the filter sums' parts and flushes as filter()'s.
  bool backward_fused(const Tensor<float>& x, const Tensor<float>& dy, const Tensor<float>& w,
                      const std::optional<FusedActivation>& f, Tensor<float>& dx, Tensor<float>& dw,
                      std::span<float> dbias) override {
    if (amx_forward_ || s_.is_box() || s_.x.h != s_.y.h ||
        (f && f->kind == ActivationKind::sigmoid))
      return false;
    check("backward_fused", x, s_.x, dw, dy, s_.y, dbias);
    check("backward_fused", dx, s_.x, w, dy, s_.y, {});
    const ChannelPlanes<const float> in = channel_planes(x.data(), s_.x);
    const ChannelPlanes<const float> grad = channel_planes(dy.data(), s_.y);
    const Correlate data =
        correlation(grad, s_.y, channel_planes(dx.data(), s_.x), s_.x, true, w, {}, false);
    const std::optional<DotCorrelate> dot_data =
        dot_ ? std::optional(dot_correlation(data, false)) : std::nullopt;
    const float slope =
        f && f->kind == ActivationKind::leaky_relu ? static_cast<float>(f->slope) : 0.0f;
    FilterSums sums(s_, !dbias.empty(), pair_begin_, pair_end_, centre_.w);
    // Rows a band: its dx, x and dy rows within kBandBytes (half of a 2 MiB L2; the rows the taps
    // reach past the band are the next band's).
    constexpr std::int64_t kBandBytes = std::int64_t{768} << 10;
    const std::int64_t row_bytes =
        (2 * s_.x.c * s_.x.w + s_.y.c * s_.y.w) * std::int64_t(sizeof(float));
    const std::int64_t band = std::clamp<std::int64_t>(kBandBytes / row_bytes, 1, 64);
    parallel_for(
        sums.parts,
        [&](std::int64_t first, std::int64_t last) {
          std::vector<float> partial(sums.partial_size(), 0.0f);
          std::optional<RowRing<dot::Pair>> data_ring;
          std::optional<RowRing<std::uint16_t>> x_ring;
          if (dot_data) {
            data_ring.emplace(dot_data->ring());
            x_ring.emplace(dot_filter_ring());
          }
          for (std::int64_t part = first; part < last; ++part)
            for (std::int64_t r0 = sums.begin(part); r0 < sums.end(part); r0 += band) {
              const std::int64_t r1 = std::min(sums.end(part), r0 + band);
              if (dot_data)
                dot_correlate_rows(data, *dot_data, *data_ring, r0, r1);
              else
                correlate_rows(data, r0, r1);
              if (f) gate_rows(in, data.out, r0, r1, slope);
              filter_rows(in, grad, sums, part, r0, r1, partial, x_ring ? &*x_ring : nullptr);
            }
        },
        1);
    sums.add_into(dw, dbias);
    return true;
  }

  // A concat's parts, read and written where they lie.
  bool reads_parts() const override { return true; }
  void forward_parts(std::span<const Tensor<float>* const> x, const Tensor<float>& w,
                     std::span<const float> bias, Tensor<float>& y) override {
    check("forward_parts", s_.x, w, y, s_.y, bias);
    correlate_all(parts_planes<const float>(x, "forward_parts"), s_.x,
                  channel_planes(y.data(), s_.y), s_.y, false, w, bias);
  }
  void backward_data_parts(const Tensor<float>& dy, const Tensor<float>& w,
                           std::span<Tensor<float>* const> dx) override {
    check("backward_data_parts", s_.x, w, dy, s_.y, {});
    correlate_all(channel_planes(dy.data(), s_.y), s_.y,
                  parts_planes<float>(dx, "backward_data_parts"), s_.x, true, w, {});
  }
  void backward_filter_parts(std::span<const Tensor<float>* const> x, const Tensor<float>& dy,
                             Tensor<float>& dw, std::span<float> dbias) override {
    check("backward_filter_parts", s_.x, dw, dy, s_.y, dbias);
    filter(parts_planes<const float>(x, "backward_filter_parts"), dy, dw, dbias);
  }

  std::string name() const override {
    return amx_forward_ ? "narrow tessera amx"
           : dot_       ? "narrow avx512 bf16"
           : pairs()    ? "narrow avx512, pair taps"
                        : "narrow avx512";
  }

 private:
  // The filter gradient's sums from x's planes `in` (backward_filter).
  void filter(const ChannelPlanes<const float>& in, const Tensor<float>& dy, Tensor<float>& dw,
              std::span<float> dbias) {
    if (amx_weights_) {
      amx_weights_->run_planes(in, channel_planes(dy.data(), s_.y), dw.data(), dbias);
      return;
    }
    FilterSums f(s_, !dbias.empty(), pair_begin_, pair_end_, centre_.w);
    const ChannelPlanes<const float> grad = channel_planes(dy.data(), s_.y);
    parallel_for(
        f.parts,
        [&](std::int64_t first, std::int64_t last) {
          std::vector<float> partial(f.partial_size(), 0.0f);
          std::optional<RowRing<std::uint16_t>> ring;
          if (dot_) ring.emplace(dot_filter_ring());
          for (std::int64_t part = first; part < last; ++part)
            filter_rows(in, grad, f, part, f.begin(part), f.end(part), partial,
                        ring ? &*ring : nullptr);
        },
        1);
    f.add_into(dw, dbias);
  }

  // The filter gradient's sums, split into `parts` (one a kernel thread) of dy's rows: each part
  // sums into its own doubles, added part by part in order, so the result is the same on every
  // run with the same thread count. Within a part, products go into float partial sums per lane
  // that are added into the doubles every kFlushVectors products per lane (4 rows of 2048
  // columns; more rows of narrower ones, so that a border strip of one column flushes every 512
  // rows, not every 4).
  struct FilterSums {
    static constexpr std::int64_t kFlushVectors = 512;
    const Shape4 xs, ys, ws;
    const std::int64_t taps, rows, per_block, blocks, flush_rows, parts;
    std::vector<double> sums, bias_sums;
    // The pair taps' channels and the parity of column 0's centre (FilterJob::pair_begin).
    std::int64_t pair_begin = 0, pair_end = 0, pair_parity = 0;
    FilterSums(const ConvShapes& s, bool bias, std::int64_t pb, std::int64_t pe, std::int64_t pp)
        : xs(s.x),
          ys(s.y),
          ws(s.w),
          taps(ws.h * ws.w),
          rows(ys.n * ys.h),
          per_block(kOut * ws.c * taps * kLanes),
          blocks((ys.c + kOut - 1) / kOut),
          flush_rows(std::max<std::int64_t>(1, kFlushVectors / ((ys.w + kLanes - 1) / kLanes))),
          parts(
              std::clamp<std::int64_t>(kernel_threads().count, 1, std::max<std::int64_t>(rows, 1))),
          sums(static_cast<std::size_t>(parts * blocks * per_block), 0.0),
          bias_sums(bias ? static_cast<std::size_t>(parts * ys.c) : 0, 0.0),
          pair_begin(pb),
          pair_end(pe),
          pair_parity(pp) {}
    std::int64_t begin(std::int64_t part) const { return rows * part / parts; }
    std::int64_t end(std::int64_t part) const { return rows * (part + 1) / parts; }
    std::size_t partial_size() const { return static_cast<std::size_t>(blocks * per_block); }
    // dw and dbias += the parts' sums, in part order. sums of part p, block: [c][tap][o % 8][lane];
    // a pair channel's tap (a, b) sums, per row parity pr, its pair tap (pair_side(pr, a),
    // pair_side(pc, b)) over the lanes, pc each lane's column parity (pieces of rows start at
    // multiples of 16 columns).
    void add_into(Tensor<float>& dw, std::span<float> dbias) const {
      for (std::int64_t o = 0; o < ys.c; ++o)
        for (std::int64_t c = 0; c < xs.c; ++c)
          for (std::int64_t t = 0; t < taps; ++t) {
            const bool paired = c >= pair_begin && c < pair_end;
            double total = 0;
            for (std::int64_t part = 0; part < parts; ++part) {
              const double* s = sums.data() + (part * blocks + o / kOut) * per_block +
                                (c * taps * kOut + o % kOut) * kLanes;
              if (!paired) {
                for (std::int64_t lane = 0; lane < kLanes; ++lane)
                  total += s[t * kOut * kLanes + lane];
                continue;
              }
              for (std::int64_t pr = 0; pr < 2; ++pr)
                for (std::int64_t lane = 0; lane < kLanes; ++lane) {
                  const std::int64_t pair_tap = pr * 4 + pair_side(pr, t / ws.w) * 2 +
                                                pair_side((pair_parity + lane) % 2, t % ws.w);
                  total += s[pair_tap * kOut * kLanes + lane];
                }
            }
            dw.data()[(o * xs.c + c) * taps + t] += static_cast<float>(total);
          }
      for (std::int64_t o = 0; o < static_cast<std::int64_t>(dbias.size()); ++o) {
        double total = 0;
        for (std::int64_t part = 0; part < parts; ++part)
          total += bias_sums[static_cast<std::size_t>(part * ys.c + o)];
        dbias[static_cast<std::size_t>(o)] += static_cast<float>(total);
      }
    }
  };

  // Part `part`'s filter sums over dy's rows [r0, r1), a range of the part's rows (which must be
  // summed in order, each once); `partial` zero at the part's start (each flush zeroes it);
  // `ring` where dot_: x's rows in bfloat16, s_.x.c x dot_filter_width() values a slot.
  void filter_rows(const ChannelPlanes<const float>& in, const ChannelPlanes<const float>& grad,
                   FilterSums& f, std::int64_t part, std::int64_t r0, std::int64_t r1,
                   std::vector<float>& partial, RowRing<std::uint16_t>* ring) const {
    const Shape4 &xs = f.xs, &ys = f.ys, &ws = f.ws;
    const std::int64_t begin = f.begin(part), end = f.end(part);
    double* part_sums = f.sums.data() + part * f.blocks * f.per_block;
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int64_t n = r / ys.h, h = r % ys.h;
      std::array<const std::uint16_t*, kMaxExtent> x_rows{};  // dot_: the rows the taps read
      // dot_: the next dy row's channels and the x row the next dy row stages first, where this
      // part goes on in the same sample (dot::filter_row).
      std::array<const float*, kMaxOut> dy_ahead{};
      std::array<const float*, kMaxIn> x_ahead{};
      if (ring != nullptr && r + 1 < r1 && (r + 1) % ys.h != 0) {
        for (std::int64_t o = 0; o < ys.c; ++o)
          dy_ahead[static_cast<std::size_t>(o)] = grad.at(n, o, h + 1);
        if (const std::int64_t next = h + 1 - pad_top_ + (ws.h - 1) * dh_; next >= 0 && next < xs.h)
          for (std::int64_t c = 0; c < xs.c; ++c)
            x_ahead[static_cast<std::size_t>(c)] = in.at(n, c, next);
      }
      if (ring != nullptr) {
        const std::int64_t width = dot_filter_width();
        for (std::int64_t a = 0; a < ws.h; ++a)
          if (const std::int64_t row = h - pad_top_ + a * dh_; row >= 0 && row < xs.h)
            x_rows[static_cast<std::size_t>(a)] = ring->row(n, xs.h, row, [&](std::uint16_t* x) {
              for (std::int64_t c = 0; c < xs.c; ++c)
                dot::to_bf16(in.at(n, c, row), -pad_left_, xs.w, width, x + c * width);
            });
      }
      for (std::int64_t block = 0; block < f.blocks; ++block) {
        const wide::FilterJob job{.dy = grad.at(n, block * kOut, h),
                                  .dy_plane = grad.plane,
                                  .outs = std::min(kOut, ys.c - block * kOut),
                                  .out_w = ys.w,
                                  .x = chunks_of(in, n, xs.c),
                                  .x_plane = in.plane,
                                  .x_row = in.row,
                                  .in_h = xs.h,
                                  .in_w = xs.w,
                                  .channels = xs.c,
                                  .row0 = h - pad_top_,
                                  .col0 = -pad_left_,
                                  .kh = ws.h,
                                  .kw = ws.w,
                                  .dh = dh_,
                                  .dw = dw_,
                                  .pair_begin = pair_begin_,
                                  .pair_end = pair_end_,
                                  .pair_row = (centre_.h + h) % 2,
                                  .pair_row0 = pair_row0(h - pad_top_ + 1, h),
                                  .twin_begin = s_.doubled_begin,
                                  .twin_end = s_.doubled_end,
                                  .twin_rows = twin_rows(h - pad_top_)};
        if (dot_)
          dot::filter_row(job, x_rows, dot_filter_width(), partial.data() + block * f.per_block,
                          dy_ahead[0] != nullptr ? dy_ahead.data() + block * kOut : nullptr,
                          block == 0 && x_ahead[0] != nullptr ? x_ahead.data() : nullptr);
        else
          wide::filter_row(job, partial.data() + block * f.per_block);
      }
      if ((r - begin) % f.flush_rows == f.flush_rows - 1 || r == end - 1)
        wide::flush(partial.data(), part_sums, f.blocks * f.per_block);
      if (!f.bias_sums.empty())
        for (std::int64_t o = 0; o < ys.c; ++o)
          f.bias_sums[static_cast<std::size_t>(part * ys.c + o)] +=
              wide::row_sum(grad.at(n, o, h), ys.w);
    }
  }

  // dx *= f' of a (leaky) ReLU of `slope` read from its output x, in rows [r0, r1) of x's shape.
  void gate_rows(const ChannelPlanes<const float>& x, const ChannelPlanes<float>& dx,
                 std::int64_t r0, std::int64_t r1, float slope) const {
    const Shape4& xs = s_.x;
    for (std::int64_t r = r0; r < r1; ++r)
      for (std::int64_t c = 0; c < xs.c; ++c)
        elementwise::leaky_relu_grad_from_output(x.at(r / xs.h, c, r % xs.h),
                                                 dx.at(r / xs.h, c, r % xs.h), xs.w, slope);
  }

  // The fused activation's slope as elementwise::leaky_relu takes it: ReLU's is 0.
  float activation_slope() const {
    const std::optional<FusedActivation>& f = s_.activation;
    return f && f->kind == ActivationKind::leaky_relu ? static_cast<float>(f->slope) : 0.0f;
  }

  // Throws unless the tensors have the planned shapes in NCHW and the weights and bias fit.
  void check(const char* pass, const Tensor<float>& x, const Shape4& xs, const Tensor<float>& w,
             const Tensor<float>& y, const Shape4& ys, std::span<const float> bias) const {
    TESSERA_CHECK(x.shape() == xs && x.layout() == Layout::nchw,
                  std::string("narrow conv planned for ") + xs.str() + " -> " + ys.str() +
                      " in NCHW, " + pass + " called with " + x.shape().str() + " -> " +
                      y.shape().str());
    check(pass, xs, w, y, ys, bias);
  }
  // The same for all but x (a concat's parts: parts_planes).
  void check(const char* pass, const Shape4& xs, const Tensor<float>& w, const Tensor<float>& y,
             const Shape4& ys, std::span<const float> bias) const {
    TESSERA_CHECK(y.shape() == ys && w.shape() == s_.w && y.layout() == Layout::nchw &&
                      w.layout() == Layout::nchw &&
                      (bias.empty() || static_cast<std::int64_t>(bias.size()) == s_.w.n),
                  std::string("narrow conv planned for ") + xs.str() + " -> " + ys.str() +
                      " (weights " + s_.w.str() + ") in NCHW, " + pass + " called with output " +
                      y.shape().str() + " (weights " + w.shape().str() + ")");
  }
  // The planes of a concat's parts, checked: NCHW, x's planned N, H and W, together x's channels,
  // each but the last whole chunks.
  template <typename F, typename P>
  ChannelPlanes<F> parts_planes(std::span<P* const> parts, const char* pass) const {
    const Shape4& xs = s_.x;
    ChannelPlanes<F> p;
    p.plane = xs.h * xs.w;
    p.row = xs.w;
    std::int64_t first = 0;
    for (P* part : parts) {
      const Shape4& ps = part->shape();
      TESSERA_CHECK(p.count < p.parts.size() && first % kChunk == 0 && ps.n == xs.n &&
                        ps.h == xs.h && ps.w == xs.w && part->layout() == Layout::nchw,
                    std::string("narrow conv planned for ") + xs.str() + " in NCHW: " + pass +
                        " called with a part " + ps.str() + " at channel " + std::to_string(first) +
                        " (parts start on multiples of " + std::to_string(kChunk) +
                        " channels, at most " + std::to_string(p.parts.size()) + " of them)");
      p.parts[p.count++] = {part->data(), first, ps.c};
      first += ps.c;
    }
    TESSERA_CHECK(first == xs.c && p.count > 0,
                  std::string("narrow conv planned for ") + xs.str() + ": " + pass +
                      " called with " + std::to_string(first) + " channels in its parts");
    return p;
  }

  // The weights as correlate_row reads them, k[block][i][tap][j] for blocks of 8 j, zero for j
  // past the last: the forward's, i the input channel and j the output channel; the `adjoint`'s
  // (backward-data), i the output channel, j the input channel and the taps reversed.
  std::vector<float> packed(const Tensor<float>& w, bool adjoint) const {
    const Shape4& ws = s_.w;
    const std::int64_t taps = ws.h * ws.w, is = adjoint ? ws.n : ws.c, js = adjoint ? ws.c : ws.n;
    std::vector<float> k(static_cast<std::size_t>((js + kOut - 1) / kOut * is * taps * kOut), 0.0f);
    for (std::int64_t o = 0; o < ws.n; ++o)
      for (std::int64_t c = 0; c < ws.c; ++c)
        for (std::int64_t t = 0; t < taps; ++t) {
          const std::int64_t i = adjoint ? o : c, j = adjoint ? c : o;
          const std::int64_t tap = adjoint ? taps - 1 - t : t;
          k[static_cast<std::size_t>((((j / kOut) * is + i) * taps + tap) * kOut + j % kOut)] =
              w.data()[(o * ws.c + c) * taps + t];
        }
    return k;
  }

  // Every row of `out` (shape `os`) from `in` (shape `is`) as correlate_row computes it: the
  // forward (x to y, with the bias and the fused activation: output row h reads x's rows from
  // h - pad_top on, columns from -pad_left) or the adjoint (dy to dx). The forward's y[h][w] sums
  // k[a][b] x[h - pad_top + a dh][w - pad_left + b dw], so dx[h][w] sums k[a][b] dy[h + pad_top -
  // a dh][w + pad_left - b dw]; with the flipped kernel's taps a' = kh - 1 - a, b' = kw - 1 - b,
  // that is dy[h + pad_top - (kh - 1) dh + a' dh][w + pad_left - (kw - 1) dw + b' dw]: rows from
  // h + row_shift on, columns from col0, row_shift = pad_top - (kh - 1) dh and col0 = pad_left -
  // (kw - 1) dw (both <= 0: the padding is at most the kernel's span); dy's values outside its
  // planes (past the padding) are zero.
  void correlate_all(const ChannelPlanes<const float>& in, const Shape4& is,
                     const ChannelPlanes<float>& out, const Shape4& os, bool adjoint,
                     const Tensor<float>& w, std::span<const float> bias) {
    if (amx::Conv* k = adjoint ? amx_data_.get() : amx_forward_.get()) {
      k->set_weights(w.data(), adjoint);
      k->run_planes(in, bias, adjoint ? std::nullopt : s_.activation, out);
      return;
    }
    const Correlate c = correlation(in, is, out, os, adjoint, w, bias, true);
    if (dot_) {
      dot_correlate_all(c);
      return;
    }
    parallel_for(
        os.n * os.h,
        [&](std::int64_t first, std::int64_t last) {
          correlate_rows(c, first, last);
          if (c.stream) _mm_sfence();  // the streamed lines reach memory before the join
        },
        grain_for(os.w * is.c * s_.w.h * s_.w.w));
  }

  // One correlate_all: the planes, the packed weights and whether the output is streamed.
  struct Correlate {
    ChannelPlanes<const float> in;
    Shape4 is;
    ChannelPlanes<float> out;
    Shape4 os;
    bool adjoint = false;
    std::vector<float> k;
    std::vector<float> pair_k;  // the forward's pair taps (pair_packed), or empty
    std::span<const float> bias;
    bool stream = false;
    std::int64_t row_shift = 0, col0 = 0;
  };
  // Streaming stores (RowJob::stream), where `may_stream`, one pass over the input channels writes
  // each output once and the output is too large to stay in the caches for its reader (batch norm,
  // the next layer), and its rows start on 64-byte lines. One core of the AMD EPYC Zen 5 VM, runs
  // alternated: unet-small's e1b forward (8 -> 8, 2048x2048) 50.5-55.1 -> 40.7-46.4 ms in a slow
  // phase of the VM, 30.6-38.5 -> 30.6-33.1 ms in a fast one; 8 -> 16 at 2048x2048 65-74 ->
  // 62-66 ms. The lost `head` costs less than the lines read in did.
  Correlate correlation(const ChannelPlanes<const float>& in, const Shape4& is,
                        const ChannelPlanes<float>& out, const Shape4& os, bool adjoint,
                        const Tensor<float>& w, std::span<const float> bias,
                        bool may_stream) const {
    const Shape4& ws = s_.w;
    return {.in = in,
            .is = is,
            .out = out,
            .os = os,
            .adjoint = adjoint,
            .k = packed(w, adjoint),
            .pair_k = pairs() && !adjoint ? pair_packed(w) : std::vector<float>{},
            .bias = bias,
            .stream = may_stream && is.c <= kChunk &&
                      os.numel() * std::int64_t(sizeof(float)) >= streaming_store_bytes() &&
                      out.lines_aligned(),
            .row_shift = adjoint ? pad_top_ - (ws.h - 1) * dh_ : -pad_top_,
            .col0 = adjoint ? pad_left_ - (ws.w - 1) * dw_ : -pad_left_};
  }
  // The RowJob of `c`'s output row h of sample n, its block of 8 output channels `block`: the
  // geometry, the output and its epilogue; where it reads x and the weights is the caller's
  // (correlate_rows: the planes; dot_correlate_rows: staged rows).
  RowJob row_job(const Correlate& c, std::int64_t n, std::int64_t h, std::int64_t block,
                 bool stream) const {
    const Shape4 &ws = s_.w, &is = c.is, &os = c.os;
    return {.in = {},
            .in_plane = c.in.plane,
            .in_row = c.in.row,
            .in_h = is.h,
            .in_w = is.w,
            .row0 = h + c.row_shift,
            .col0 = c.col0,
            .k = nullptr,
            .kh = ws.h,
            .kw = ws.w,
            .dh = dh_,
            .dw = dw_,
            .out = c.out.at(n, block * kOut, h),
            .out_plane = c.out.plane,
            .out_w = os.w,
            .outs = std::min(kOut, os.c - block * kOut),
            .init = c.bias.empty() ? nullptr : c.bias.data() + block * kOut,
            .activate = !c.adjoint && s_.activation.has_value(),
            .slope = activation_slope(),
            .stream = stream};
  }

  // Output rows [r0, r1) of `c` (row r: sample r / os.h, row r % os.h).
  void correlate_rows(const Correlate& c, std::int64_t r0, std::int64_t r1) const {
    const Shape4 &ws = s_.w, &is = c.is, &os = c.os;
    const std::int64_t taps = ws.h * ws.w, blocks = (os.c + kOut - 1) / kOut;
    const std::int64_t pattern = (pair_end_ - pair_begin_) * 4 * kOut * kPairLanes;
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int64_t n = r / os.h, h = r % os.h;
      for (std::int64_t block = 0; block < blocks; ++block) {
        RowJob job = row_job(c, n, h, block, c.stream);
        job.in = chunks_of(c.in, n, is.c);
        job.k = c.k.data() + block * is.c * taps * kOut;
        if (!c.pair_k.empty()) {
          job.pair_k = c.pair_k.data() + (((centre_.h + h) % 2) * blocks + block) * 2 * pattern;
          job.pair_begin = pair_begin_;
          job.pair_end = pair_end_;
          job.pair_parity = centre_.w;
          job.pair_row0 = pair_row0(h + c.row_shift + 1, h);
          job.pair_next = (centre_.h + h) % 2 == 0 ? h + c.row_shift + 3 : -1;
        }
        wide::correlate_row(job, is.c);
      }
    }
  }

  // correlate_all in bfloat16 dot products (dot::correlate_row): each thread stages the input
  // rows its output rows read, all channel pairs of a row at once, in a ring of the (kh - 1) * dh
  // + 1 rows an output row's taps span, so that each row is converted once (a new one an output
  // row). Each output is written once, streamed where one too large for the caches starts on
  // lines.
  void dot_correlate_all(const Correlate& c) const {
    const DotCorrelate d = dot_correlation(c, true);
    parallel_for(
        c.os.n * c.os.h,
        [&](std::int64_t r0, std::int64_t r1) {
          RowRing<dot::Pair> ring = d.ring();
          dot_correlate_rows(c, d, ring, r0, r1);
          if (d.stream) _mm_sfence();
        },
        grain_for(c.os.w * c.is.c * s_.w.h * s_.w.w));
  }

  // A Correlate's bfloat16 side: the weights as pairs, the staged rows' geometry (a staged row's
  // columns: from the first the taps read, lpad = -col0 before column 0 (col0 <= 0: the padding is
  // at most the kernel's span, narrow_conv_fits), to past the last the last block's vectors read;
  // pairs x width values a row, ring_rows of them a thread), streaming or not.
  struct DotCorrelate {
    std::vector<dot::Pair> k;
    std::int64_t pairs = 0, lpad = 0, width = 0, ring_rows = 0;
    bool stream = false;
    RowRing<dot::Pair> ring() const { return RowRing<dot::Pair>(ring_rows, pairs * width); }
  };
  DotCorrelate dot_correlation(const Correlate& c, bool may_stream) const {
    const Shape4 &ws = s_.w, &os = c.os;
    const auto up16 = [](std::int64_t v) { return (v + kLanes - 1) / kLanes * kLanes; };
    DotCorrelate d{.k = dot_pairs(c.k, c.is.c, (os.c + kOut - 1) / kOut),
                   .pairs = (c.is.c + 1) / 2,
                   .lpad = -c.col0,
                   .ring_rows = (ws.h - 1) * dh_ + 1,
                   .stream = may_stream &&
                             os.numel() * std::int64_t(sizeof(float)) >= streaming_store_bytes() &&
                             c.out.lines_aligned()};
    d.width = up16(up16(os.w) + (ws.w - 1) * dw_);
    return d;
  }

  // Output rows [r0, r1) of `c` (correlate_rows' rows) in bfloat16 dot products, their input rows
  // staged in `ring` (d.ring(), this thread's).
  void dot_correlate_rows(const Correlate& c, const DotCorrelate& d, RowRing<dot::Pair>& ring,
                          std::int64_t r0, std::int64_t r1) const {
    const Shape4 &ws = s_.w, &is = c.is, &os = c.os;
    const std::int64_t taps = ws.h * ws.w, blocks = (os.c + kOut - 1) / kOut;
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int64_t n = r / os.h, h = r % os.h, row0 = h + c.row_shift;
      const TapRows inside = tap_rows_inside(row0, ws.h, dh_, is.h);
      dot::Staged in{.a0 = inside.a0, .a1 = inside.a1, .pairs = d.pairs, .pair_stride = d.width};
      // The row the next output row reads that this one does not (dilation 1).
      const std::int64_t next = row0 + 1 + (ws.h - 1) * dh_;
      in.aheads = r + 1 < r1 && (r + 1) % os.h != 0 && next >= 0 && next < is.h ? is.c : 0;
      for (std::int64_t i = 0; i < in.aheads; ++i)
        in.ahead[static_cast<std::size_t>(i)] = c.in.at(n, i, next);
      in.col0 = c.col0;
      in.in_w = is.w;
      for (std::int64_t a = in.a0; a < in.a1; ++a) {
        const std::int64_t row = row0 + a * dh_;
        in.rows[static_cast<std::size_t>(a)] = ring.row(n, is.h, row, [&](dot::Pair* staged) {
          for (std::int64_t q = 0; q < d.pairs; ++q)
            dot::stage_row(c.in.at(n, 2 * q, row),
                           2 * q + 1 < is.c ? c.in.at(n, 2 * q + 1, row) : nullptr, is.w, d.lpad,
                           d.width, staged + q * d.width);
        });
      }
      for (std::int64_t block = 0; block < blocks; ++block) {
        in.k = d.k.data() + block * d.pairs * taps * kOut;
        if (block > 0) in.aheads = 0;
        dot::correlate_row(row_job(c, n, h, block, d.stream), in);
      }
    }
  }

  // x's rows as the filter gradient stages them (filter_rows), a thread's.
  RowRing<std::uint16_t> dot_filter_ring() const {
    return RowRing<std::uint16_t>((s_.w.h - 1) * dh_ + 1, s_.x.c * dot_filter_width());
  }

  // The values of one channel's row of x as the filter gradient stages it in bfloat16
  // (dot::filter_row): from column -pad_left to past the last the taps of its pieces' vectors read.
  std::int64_t dot_filter_width() const {
    const auto up32 = [](std::int64_t v) { return (v + 31) / 32 * 32; };
    return up32(up32(s_.y.w) + (s_.w.w - 1) * dw_);
  }

  // The packed weights (packed(): k[block][i][tap][j], `channels` i) as dot::Pair values of input
  // channels 2q and 2q + 1 rounded to bfloat16: [block][q][tap][j], the high half 0 past the last
  // channel.
  static std::vector<dot::Pair> dot_pairs(const std::vector<float>& k, std::int64_t channels,
                                          std::int64_t blocks) {
    const auto size = static_cast<std::int64_t>(k.size());
    const std::int64_t taps = size / (blocks * channels * kOut), pairs = (channels + 1) / 2;
    std::vector<std::uint16_t> r(static_cast<std::size_t>((size + 31) / 32 * 32));
    dot::to_bf16(k.data(), 0, size, static_cast<std::int64_t>(r.size()), r.data());
    std::vector<dot::Pair> out(static_cast<std::size_t>(blocks * pairs * taps * kOut), 0);
    for (std::int64_t block = 0; block < blocks; ++block)
      for (std::int64_t i = 0; i < channels; ++i)
        for (std::int64_t e = 0; e < taps * kOut; ++e)
          out[static_cast<std::size_t>((block * pairs + i / 2) * taps * kOut + e)] |=
              dot::Pair{r[static_cast<std::size_t>((block * channels + i) * taps * kOut + e)]}
              << (16 * (i % 2));
    return out;
  }

  // Whether the pair taps fit (RowJob::pair_k): a 3x3 kernel of dilation 1, whole tensors, the
  // doubled channels whole chunks, and each output's centre in a 2x2 block that lies inside x
  // (where x's edges split a block, the reads past them are zeros, not the block's values); then
  // sets pair_begin_, pair_end_ and centre_.
  bool plan_pairs() {
    const ConvShapes& s = s_;
    const std::int64_t b = s.doubled_begin, e = s.doubled_end;
    if (!s.doubled_parity || s.w.h != 3 || s.w.w != 3 || dh_ != 1 || dw_ != 1 || s.is_box() ||
        b >= e || b < 0 || e > s.x.c || b % kChunk != 0 || (e % kChunk != 0 && e != s.x.c))
      return false;
    const BoxAt origin = *s.doubled_parity;
    const auto parity = [](std::int64_t v) { return ((v % 2) + 2) % 2; };
    // Output 0's centre is x's row (column) 1 - pad; its block starts at the centre less its
    // parity; the last output's block ends 2 later.
    const auto inside = [&](std::int64_t first_parity, std::int64_t pad, std::int64_t out,
                            std::int64_t in) {
      const std::int64_t first = 1 - pad, last = out - pad;
      return first - parity(first_parity + first) >= 0 &&
             last - parity(first_parity + last) + 2 <= in;
    };
    if (!inside(origin.h, pad_top_, s.y.h, s.x.h) || !inside(origin.w, pad_left_, s.y.w, s.x.w))
      return false;
    pair_begin_ = b;
    pair_end_ = e;
    centre_ = {parity(origin.h + 1 - pad_top_), parity(origin.w + 1 - pad_left_)};
    return true;
  }
  bool pairs() const { return pair_end_ > pair_begin_; }
  // FilterJob::twin_rows of the output row whose tap row 0 is x's row `row0`, where the bfloat16
  // dot products compute the filter gradient (no pair taps there: namespace dot): the doubled
  // channels' tap rows a and a + 1 that read one block's two rows, both inside x (not in a box
  // kernel's partial footprint: boxes take none). Bit for bit the sums of every tap row on its
  // own (the same products, added in the same order), with a third fewer products in those
  // channels: unet-small's d1 (16 of 24 channels doubled, 2048x2048) under --precision bf16, one
  // core of an AMD EPYC Zen 4, 4 alternated pairs: backward 201 -> 187 ms.
  std::int64_t twin_rows(std::int64_t row0) const {
    if (!dot_ || dh_ != 1 || s_.is_box() || !s_.doubled_parity ||
        s_.doubled_end <= s_.doubled_begin)
      return 0;
    std::int64_t bits = 0;
    for (std::int64_t a = 0; a + 1 < s_.w.h; ++a)
      if (const std::int64_t row = row0 + a;
          row >= 0 && row + 1 < s_.x.h && (s_.doubled_parity->h + row) % 2 == 0)
        bits |= std::int64_t{1} << a;
    return bits;
  }
  // The pair taps' first row for output row h, its centre x's row `centre`: an even centre's
  // block above is read at its first row (then every block is read at that row alone: half the
  // rows of the pair channels from memory), else at the row above the centre, which the 3x3 taps
  // read. The former only from ConvShapes::doubled_ready_row on: a window's rows before it may be
  // halos that have not arrived while the tile computes (Conv2d's overlap computes again only the
  // outputs whose 3x3 taps read them; a "valid" conv's window can start two rows above the
  // rank's own, and reading its row 1 for an interior output gave wrong outputs on 1x4x1).
  std::int64_t pair_row0(std::int64_t centre, std::int64_t h) const {
    return (centre_.h + h) % 2 == 0 && centre - 2 >= std::max<std::int64_t>(s_.doubled_ready_row, 1)
               ? centre - 2
               : centre - 1;
  }

  // The pair taps' weights (RowJob::pair_k) of every row parity r and block of 8 output channels:
  // at ((r * blocks + block) * 2 + pattern) * pairs * 4 * 8 * 2. Tap (A, B) of a centre of row
  // parity pr and column parity pc sums the taps (a, b) with a in side pr's A, b in side pc's B
  // (pair_side), in double.
  std::vector<float> pair_packed(const Tensor<float>& w) const {
    const Shape4& ws = s_.w;
    const std::int64_t pairs = pair_end_ - pair_begin_, blocks = (ws.n + kOut - 1) / kOut;
    std::vector<float> k(static_cast<std::size_t>(2 * blocks * 2 * pairs * 4 * kOut * kPairLanes));
    // Pair tap t's weight at centre parities (pr, pc), from the 3x3 taps of one (o, i).
    const auto weight = [](const float* taps, std::int64_t pr, std::int64_t pc, std::int64_t t) {
      double sum = 0;
      for (std::int64_t a = 0; a < 3; ++a)
        for (std::int64_t b = 0; b < 3; ++b)
          if (pair_side(pr, a) == t / 2 && pair_side(pc, b) == t % 2) sum += taps[a * 3 + b];
      return static_cast<float>(sum);
    };
    for (std::int64_t o = 0; o < ws.n; ++o)
      for (std::int64_t i = 0; i < pairs; ++i) {
        const float* taps = w.data() + (o * ws.c + pair_begin_ + i) * 9;
        for (std::int64_t r = 0; r < 2; ++r)
          for (std::int64_t q = 0; q < 2; ++q) {
            float* at =
                k.data() + ((((r * blocks + o / kOut) * 2 + q) * pairs + i) * 4 * kOut + o % kOut) *
                               kPairLanes;
            for (std::int64_t t = 0; t < 4; ++t)
              for (std::int64_t lane = 0; lane < kPairLanes; ++lane)
                at[t * kOut * kPairLanes + lane] = weight(taps, r, (q + lane) % 2, t);
          }
      }
    return k;
  }

  ConvShapes s_;
  std::int64_t dh_, dw_, pad_top_, pad_left_;
  // The pair taps' input channels (none: empty), and the parities of output (0, 0)'s centre.
  std::int64_t pair_begin_ = 0, pair_end_ = 0;
  BoxAt centre_{};
  // bfloat16 dot products (namespace dot) in every pass.
  bool dot_ = false;
  // The AMX kernels (bf16), or none.
  std::unique_ptr<amx::Conv> amx_forward_, amx_data_;
  std::unique_ptr<amx::ConvWeights> amx_weights_;
};
#endif

// narrow_conv_channels: where the narrow kernels were faster than oneDNN's (one Skylake-SP core,
// 3x3, the three passes together; README "Narrow convolutions"): up to 8 outputs from up to 64
// inputs (24 -> 8: 618 against 900 ms at 2048x2048; oneDNN's 8-channel kernels are AVX2), and 16
// outputs from fewer than 32 inputs not a multiple of 16 (8 -> 16: 103 against 155 ms at
// 1024x1024). From 16 or 48 inputs to 16 outputs oneDNN's AVX-512 kernels on 16-channel blocks, or
// Winograd, are faster; from 16 inputs in NCHW (ConvShapes::x_nchw: a narrow conv's output) the
// narrow kernels are (16
// -> 16 at 1024x1024, 2 threads of the Intel Xeon with AMX, forward / backward-data /
// backward-filter: 33 / 33-37 / 37-40 ms, oneDNN from NCHW 45-49 / 41-45 / 48-52, from nchw16c
// 31 / 30 / 33-49).
}  // namespace

bool narrow_conv_channels(std::int64_t in, std::int64_t out, bool x_nchw) {
  if (out <= kOut) return in <= kMaxIn;
  return out <= kMaxOut && in < 2 * kMaxOut && (in % kMaxOut != 0 || x_nchw);
}

bool narrow_conv_kernel(std::int64_t groups, std::int64_t kh, std::int64_t kw) {
  return groups == 1 && kh >= 1 && kw >= 1 && kh <= kMaxExtent && kw <= kMaxExtent && kh * kw > 1;
}

bool narrow_conv_bf16_dot() {
#if TESSERA_HAS_WIDE_LOOPS
  static const bool cpu = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1) != 0;  // AVX512_BF16
  }();
  const char* env = std::getenv("TESSERA_NARROW_BF16");
  return cpu && !(env != nullptr && std::string(env) == "0") && !amx::available();
#else
  return false;
#endif
}

bool narrow_conv_available() {
  return TESSERA_HAS_WIDE_LOOPS && g_conv_narrow && simd_level() == SimdLevel::avx512;
}

bool narrow_conv_fits(const ConvShapes& s, const reference::ConvGeometry& g) {
  if (!narrow_conv_available()) return false;
  const Shape4 &x = s.x, &w = s.w, &y = s.y;
  // Zero padding of at most the kernel's span before the input (pad) and after it (the rest of
  // out - (in - span)), along one axis.
  const auto padded = [](std::int64_t in, std::int64_t out, std::int64_t span, std::int64_t pad) {
    const std::int64_t after = out - (in - span) - pad;
    return pad >= 0 && pad <= span && after >= 0 && after <= span;
  };
  return narrow_conv_kernel(g.groups, w.h, w.w) && g.stride_h == 1 && g.stride_w == 1 &&
         g.dilation_h >= 1 && g.dilation_w >= 1 &&
         (!s.activation || s.activation->kind != ActivationKind::sigmoid) && y.c >= 1 && x.c >= 1 &&
         narrow_conv_channels(x.c, y.c, s.x_nchw) && w.n == y.c && w.c == x.c && x.n == y.n &&
         y.n > 0 && y.h > 0 && y.w > 0 && x.h > 0 && x.w > 0 &&
         padded(x.h, y.h, g.dilation_h * (w.h - 1), g.pad_top) &&
         padded(x.w, y.w, g.dilation_w * (w.w - 1), g.pad_left);
}

std::unique_ptr<ConvKernel<float>> make_narrow_conv(const ConvShapes& shapes,
                                                    const reference::ConvGeometry& g) {
  if (!narrow_conv_fits(shapes, g) || shapes.x_layout != Layout::nchw ||
      shapes.y_layout != Layout::nchw)
    return nullptr;
  if (shapes.is_box()) {
    const Shape4 &xo = shapes.x_outer, &yo = shapes.y_outer;
    const bool inside = xo.n == shapes.x.n && xo.c == shapes.x.c && yo.n == shapes.y.n &&
                        yo.c == shapes.y.c && shapes.x_at.h >= 0 && shapes.x_at.w >= 0 &&
                        shapes.y_at.h >= 0 && shapes.y_at.w >= 0 &&
                        shapes.x_at.h + shapes.x.h <= xo.h && shapes.x_at.w + shapes.x.w <= xo.w &&
                        shapes.y_at.h + shapes.y.h <= yo.h && shapes.y_at.w + shapes.y.w <= yo.w;
    if (!inside) return nullptr;
  }
#if TESSERA_HAS_WIDE_LOOPS
  return std::make_unique<NarrowConv>(shapes, g);
#else
  return nullptr;  // narrow_conv_fits said no
#endif
}

void set_conv_narrow(bool on) {
  g_conv_narrow = on;
}
bool conv_narrow() {
  return g_conv_narrow;
}

}  // namespace tessera
