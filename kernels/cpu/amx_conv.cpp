// The AMX convolution kernels (include/tessera/kernels/amx_conv.hpp).
//
// Tiles (palette 1, eight registers of 16 rows x 64 bytes): tmm0-3 sum 2 x 2 tiles in float32,
// tmm4-5 hold two first factors, tmm6-7 two second factors (multiply_2x2).
// - The correlation (Conv): the sums are 16 output pixels x 16 channels, the first factors 16
//   pixels x 32 input channels of the input in bfloat16 (two runs of 16 pixels), the second the
//   weights of 32 input x 16 output channels of one tap in AMX's pair-interleaved order (two blocks
//   of 16 output channels). A thread owns a run of output rows; for each it converts the one input
//   row it has not seen yet into its ring (the rows of one output row's taps, channels-last, 32
//   channels a chunk, zeros where the padding is).
// - NCHW planes (plan_nchw, the narrow convolutions): the ring converts 16 pixels of 16 channel
//   planes at a time through a 16 x 16 transpose; a pixel holds its channels rounded up to even,
//   and a first factor is 16 pixels x one tap's channels, or a whole tap row's (RingGeometry).
//   Output tiles are transposed back and written as runs of their channels' rows.
// - Backward-weights (ConvWeights): the sums are 16 input x 16 output channels of one tap, the
//   first factors 16 input channels x 32 pixels of x (channel-major rows, transposed from the
//   blocks), the second 32 pixels of dy in interleaved pairs x 16 output channels.
#include "tessera/kernels/amx_conv.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "tessera/error.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/parallel.hpp"

#if TESSERA_HAS_WIDE_LOOPS
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tessera::amx {
namespace {

constexpr std::int64_t kChunk = 32;      // input channels of one tile row (64 bytes of bfloat16)
constexpr std::int64_t kOutBlock = 16;   // output channels of one tile (its columns)
constexpr std::int64_t kTile = 16 * 32;  // bfloat16 values of one weight tile

#if TESSERA_HAS_WIDE_LOOPS

constexpr std::int64_t kPixels = 16;  // output pixels of one tile (its rows)

bool env_off() {
  const char* v = std::getenv("TESSERA_AMX");
  return v != nullptr && std::string(v) == "0";
}

bool cpu_and_os_allow() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  const bool avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1;
  if (!amx_bf16 || !amx_tile || !avx512f || !avx512bw) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return false;  // AVX512_BF16
  // Linux hands out the tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA), once per process.
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")

// The compiler does not see the tile loads and stores (inline assembly without a memory operand):
// a barrier keeps the row conversions before the loads and the bias pass after the stores.
inline void memory_barrier() {
  asm volatile("" ::: "memory");
}

struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// The tile registers: eight tiles of 16 rows x 64 bytes, or, with `k` < 32 (RingGeometry::k),
// first factors (tmm4, 5, 7) of 16 rows x k bfloat16 and second ones (tmm6, and tmm7 for
// multiply_2x2) of k / 2 rows; k < 32 only with multiply_4x1 (tmm7 a first factor).
void load_tile_config(std::int64_t k = kChunk) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kPixels;
    config.colsb[t] = 64;
  }
  if (k < kChunk) {
    for (int t : {4, 5, 7})
      config.colsb[t] = static_cast<std::uint16_t>(2 * k);
    config.rows[6] = static_cast<std::uint8_t>(k / 2);
  }
  _tile_loadconfig(&config);
}

inline void zero_2x2() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// tmm0..3 += (A0, A1) x (B0, B1) as tmm0 = A0 B0, tmm1 = A0 B1, tmm2 = A1 B0, tmm3 = A1 B1: the A
// tiles from a0 and a1 (`a_stride` bytes from row to row), the B tiles from b0 and b1 (64 bytes);
// without `second_a` (`second_b`) A1 (B1) is not read and its products are skipped.
inline void multiply_2x2(const std::uint16_t* a0, const std::uint16_t* a1, std::int64_t a_stride,
                         const std::uint16_t* b0, const std::uint16_t* b1, bool second_a,
                         bool second_b) {
  _tile_loadd(4, a0, a_stride);
  _tile_loadd(6, b0, 64);
  _tile_dpbf16ps(0, 4, 6);
  if (second_b) {
    _tile_loadd(7, b1, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  if (second_a) {
    _tile_loadd(5, a1, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    if (second_b) _tile_dpbf16ps(3, 5, 7);
  }
}

// tmm0..3 += (A0, A1, A2, A3) x B: four first factors from a0..a3 (`a_stride` bytes from row to
// row) against one second from b (64 bytes); only the first `count` (1 to 4).
inline void multiply_4x1(const std::uint16_t* a0, const std::uint16_t* a1, const std::uint16_t* a2,
                         const std::uint16_t* a3, std::int64_t a_stride, const std::uint16_t* b,
                         std::size_t count) {
  _tile_loadd(6, b, 64);
  _tile_loadd(4, a0, a_stride);
  _tile_dpbf16ps(0, 4, 6);
  if (count > 1) {
    _tile_loadd(5, a1, a_stride);
    _tile_dpbf16ps(1, 5, 6);
  }
  if (count > 2) {
    _tile_loadd(7, a2, a_stride);
    _tile_dpbf16ps(2, 7, 6);
  }
  if (count > 3) {
    _tile_loadd(4, a3, a_stride);
    _tile_dpbf16ps(3, 4, 6);
  }
}

// tmm0..3 into tiles[0..3], 16 rows of 16 floats each.
inline void store_2x2(float (&tiles)[4][kPixels * kOutBlock]) {
  _tile_stored(0, tiles[0], 64);
  _tile_stored(1, tiles[1], 64);
  _tile_stored(2, tiles[2], 64);
  _tile_stored(3, tiles[3], 64);
  memory_barrier();
}

// The zeros of a channels-last ring row of `pixel` values a column (convert_row,
// convert_row_planes): all of it where input row `r` is outside the input (false), else the
// columns before `begin` and from `end` on; [begin, end) hold input columns (true; pad_left < 0,
// an adjoint's, starts inside).
bool zero_ring_padding(const Shape4& s, std::int64_t r, std::int64_t pad_left, std::int64_t cols,
                       std::int64_t pixel, std::uint16_t* row, std::int64_t& begin,
                       std::int64_t& end) {
  if (r < 0 || r >= s.h) {
    std::memset(row, 0, static_cast<std::size_t>(cols * pixel) * sizeof(std::uint16_t));
    return false;
  }
  begin = std::clamp<std::int64_t>(pad_left, 0, cols);
  end = std::clamp<std::int64_t>(pad_left + s.w, begin, cols);
  std::memset(row, 0, static_cast<std::size_t>(begin * pixel) * sizeof(std::uint16_t));
  if (end < cols)
    std::memset(row + end * pixel, 0,
                static_cast<std::size_t>((cols - end) * pixel) * sizeof(std::uint16_t));
  return true;
}

// One ring row: input row `r` of sample `n` as bfloat16, channels-last, `cols` columns from input
// column -pad_left, `pixel` values a column: chunks of 32 channels, or one block of 16
// (RingGeometry; the channels past in.c zero).
void convert_row(const float* in, const Shape4& s, std::int64_t n, std::int64_t r,
                 std::int64_t pad_left, std::int64_t cols, std::int64_t pixel, std::uint16_t* row) {
  const std::int64_t chunks = pixel / kChunk;
  std::int64_t begin = 0, end = 0;
  if (!zero_ring_padding(s, r, pad_left, cols, pixel, row, begin, end)) return;
  const std::int64_t blocks = s.c / kBlock;
  if (pixel == kBlock) {  // one block, 16 channels a pixel (RingGeometry)
    const float* lo = in + ((n * blocks) * s.h + r) * s.w * kBlock;
    for (std::int64_t c = begin; c < end; ++c) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(lo + (c - pad_left) * kBlock));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + c * pixel),
                          reinterpret_cast<const __m256i&>(v));
    }
    return;
  }
  for (std::int64_t q = 0; q < chunks; ++q) {
    const std::int64_t b0 = 2 * q, b1 = 2 * q + 1;
    const float* lo = in + ((n * blocks + b0) * s.h + r) * s.w * kBlock;
    const float* hi = b1 < blocks ? in + ((n * blocks + b1) * s.h + r) * s.w * kBlock : nullptr;
    std::uint16_t* out = row + q * kChunk;
    for (std::int64_t c = begin; c < end; ++c) {
      const std::int64_t x = (c - pad_left) * kBlock;
      const __m512 l = _mm512_loadu_ps(lo + x);
      const __m512 h = hi != nullptr ? _mm512_loadu_ps(hi + x) : _mm512_setzero_ps();
      const __m512bh v = _mm512_cvtne2ps_pbh(h, l);
      _mm512_storeu_si512(out + c * pixel, reinterpret_cast<const __m512i&>(v));
    }
  }
}

// One output tile from `tile` (16 pixels of 16 channels, as the tile store wrote them) to `y`:
// its first `pixels` pixels, plus bias, through the activation where `activate`, times the
// derivative of a (leaky) ReLU of slope `gate_slope` whose output `gate` holds at y's place where
// `gate` is given; streaming stores (the caller fences) when `stream` and y lies on a 64-byte line.
void finish_tile(const float* tile, float* y, std::int64_t pixels, const float* bias, bool activate,
                 float slope, const float* gate, float gate_slope, bool stream) {
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 s = _mm512_set1_ps(slope), zero = _mm512_setzero_ps();
  const __m512 gs = _mm512_set1_ps(gate_slope);
  stream = stream && reinterpret_cast<std::uintptr_t>(y) % 64 == 0;
  for (std::int64_t p = 0; p < pixels; ++p) {
    __m512 v = _mm512_add_ps(_mm512_load_ps(tile + p * kBlock), b);
    if (activate) {  // elementwise::leaky_relu: v > 0 ? v : slope * v
      const __mmask16 positive = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
      v = _mm512_mask_mov_ps(_mm512_mul_ps(v, s), positive, v);
    }
    if (gate != nullptr) {  // elementwise::leaky_relu_grad(gate > 0, v, gate_slope)
      const __mmask16 positive =
          _mm512_cmp_ps_mask(_mm512_loadu_ps(gate + p * kBlock), zero, _CMP_GT_OQ);
      v = _mm512_mask_mov_ps(_mm512_mul_ps(v, gs), positive, v);
    }
    if (stream)
      _mm512_stream_ps(y + p * kBlock, v);
    else
      _mm512_storeu_ps(y + p * kBlock, v);
  }
}

#include "transpose16.inc"

// convert_row for NCHW planes: each 16 pixels of 16 channels transposed in L1 (channels past
// s.c zero).
void convert_row_planes(const ChannelPlanes<const float>& in, const Shape4& s, std::int64_t n,
                        std::int64_t r, std::int64_t pad_left, std::int64_t cols,
                        std::int64_t pixel, std::uint16_t* row) {
  const std::int64_t chunks = (pixel + kChunk - 1) / kChunk;
  std::int64_t begin = 0, end = 0;
  if (!zero_ring_padding(s, r, pad_left, cols, pixel, row, begin, end)) return;
  alignas(64) float channels[16 * 16], pixels[2][16 * 16];
  for (std::int64_t q = 0; q < chunks; ++q) {
    // Where the chunk's channels' rows start (nullptr past s.c).
    const float* rows[2][16];
    for (int half = 0; half < 2; ++half)
      for (std::int64_t k = 0; k < 16; ++k) {
        const std::int64_t ch = q * kChunk + half * 16 + k;
        rows[half][k] = ch < s.c ? in.at(n, ch, r) : nullptr;
      }
    for (std::int64_t c = begin; c < end; c += 16) {
      const std::int64_t count = std::min<std::int64_t>(16, end - c);
      const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1u);
      // pixels[half][p * 16 + k]: channel q * 32 + half * 16 + k at pixel p (0 past s.c).
      for (int half = 0; half < 2; ++half) {
        if (rows[half][0] == nullptr) {
          std::fill(pixels[half], pixels[half] + 16 * 16, 0.0f);
          continue;
        }
        for (std::int64_t k = 0; k < 16; ++k) {
          const float* from = rows[half][k];
          if (from != nullptr) {
            // Four lines ahead: the rows of many planes at once are more streams than the
            // hardware's prefetchers follow.
            const float* at = from + (c - pad_left);
            if (c + 64 < end) _mm_prefetch(reinterpret_cast<const char*>(at + 64), _MM_HINT_T0);
            _mm512_store_ps(channels + k * 16, _mm512_maskz_loadu_ps(keep, at));
          } else {
            _mm512_store_ps(channels + k * 16, _mm512_setzero_ps());
          }
        }
        transpose16(channels, 16, pixels[half], 16);
      }
      // The chunk's values of each pixel: 32, or the `pixel` (< 32) of a ring without chunks.
      const __mmask32 values =
          static_cast<__mmask32>((std::uint64_t{1} << std::min(kChunk, pixel - q * kChunk)) - 1);
      std::uint16_t* out = row + c * pixel + q * kChunk;
      for (std::int64_t p = 0; p < count; ++p) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(pixels[1] + p * 16),
                                               _mm512_load_ps(pixels[0] + p * 16));
        _mm512_mask_storeu_epi16(out + p * pixel, values, reinterpret_cast<const __m512i&>(v));
      }
    }
  }
}

// finish_tile for NCHW planes: the tile's `pixels` pixels of output channels [c0, c0 + channels)
// of row h of sample n, from column w0 on (`bias` the block's, nullptr: none); streaming stores
// for whole runs on 64-byte lines when `stream`.
void finish_planes(const float* tile, const ChannelPlanes<float>& out, std::int64_t n,
                   std::int64_t c0, std::int64_t channels, std::int64_t h, std::int64_t w0,
                   std::int64_t pixels, const float* bias, bool activate, float slope,
                   bool stream) {
  alignas(64) float rows[16 * 16];  // rows[o * 16 + p]
  transpose16(tile, kBlock, rows, 16);
  const __m512 s = _mm512_set1_ps(slope), zero = _mm512_setzero_ps();
  const __mmask16 keep = static_cast<__mmask16>((1u << pixels) - 1u);
  for (std::int64_t o = 0; o < channels; ++o) {
    __m512 v = _mm512_load_ps(rows + o * 16);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_set1_ps(bias[o]));
    if (activate) {  // elementwise::leaky_relu: v > 0 ? v : slope * v
      const __mmask16 positive = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
      v = _mm512_mask_mov_ps(_mm512_mul_ps(v, s), positive, v);
    }
    float* y = out.at(n, c0 + o, h) + w0;
    if (stream && pixels == 16 && reinterpret_cast<std::uintptr_t>(y) % 64 == 0)
      _mm512_stream_ps(y, v);
    else
      _mm512_mask_storeu_ps(y, keep, v);
  }
}

struct RunArgs {
  const Correlation& c;
  const RingGeometry& ring;
  std::int64_t blocks;
  const std::uint16_t* packed;
  const float* in;
  const float* bias;  // nullptr: none
  bool activate;
  float slope;
  float* out;
  const float* gate;  // nullptr: none
  float gate_slope;
  // NCHW planes (Conv::run_planes) in place of `in` and `out`; nullptr: nchw16c.
  const ChannelPlanes<const float>* in_planes = nullptr;
  const ChannelPlanes<float>* out_planes = nullptr;
};

// Output rows [begin, end) of the flattened (sample, row) range.
void run_rows(const RunArgs& a, std::int64_t begin, std::int64_t end) {
  const Correlation& c = a.c;
  const std::int64_t span = c.dil_h * (c.kh - 1) + 1;  // input rows one output row reads
  const std::int64_t width = std::max(c.out.w, kPixels);
  const std::int64_t cols = width + c.dil_w * (c.kw - 1);
  const RingGeometry& geometry = a.ring;
  const std::int64_t pixel = geometry.pixel;
  const std::int64_t ring_row = cols * pixel;
  auto* ring = static_cast<std::uint16_t*>(::operator new(
      static_cast<std::size_t>(span * ring_row) * sizeof(std::uint16_t), std::align_val_t(64)));
  const auto ring_at = [&](std::int64_t r) {
    return ring + (((r % span) + span) % span) * ring_row;
  };
  // Tile starts along the row: every 16 pixels, the last one ending at the row's end (it overlaps
  // the one before when the width is not a multiple of 16 and rewrites the same values).
  std::vector<std::int64_t> starts;
  for (std::int64_t w = 0; w + kPixels <= c.out.w; w += kPixels)
    starts.push_back(w);
  if (c.out.w % kPixels != 0) starts.push_back(std::max<std::int64_t>(0, c.out.w - kPixels));
  const std::int64_t valid = std::min(c.out.w, kPixels);  // pixels of a tile that are output
  alignas(64) float spill[4][kPixels * kOutBlock];
  // An output larger than the caches keep is written with streaming stores: its lines are not
  // read in before they are written (tensor.hpp's streaming_store_bytes).
  const bool stream =
      c.out.numel() * static_cast<std::int64_t>(sizeof(float)) >= streaming_store_bytes() &&
      (a.out_planes == nullptr || a.out_planes->lines_aligned());
  const std::int64_t stride = pixel * static_cast<std::int64_t>(sizeof(std::uint16_t));
  const std::int64_t out_blocks = c.out.c / kBlock;

  load_tile_config(geometry.k);

  std::int64_t ring_n = -1, next = 0;  // the ring holds sample ring_n's input rows up to next
  for (std::int64_t item = begin; item < end; ++item) {
    const std::int64_t n = item / c.out.h, h = item % c.out.h;
    const std::int64_t first = h - c.pad_top;  // the first input row this output row reads
    if (n != ring_n || first >= next || first < next - span) {
      ring_n = n;
      next = first;
    }
    for (; next < first + span; ++next)
      if (a.in_planes != nullptr)
        convert_row_planes(*a.in_planes, c.in, n, next, c.pad_left, cols, pixel, ring_at(next));
      else
        convert_row(a.in, c.in, n, next, c.pad_left, cols, pixel, ring_at(next));
    memory_barrier();
    float* y =
        a.out != nullptr ? a.out + (n * out_blocks * c.out.h + h) * c.out.w * kBlock : nullptr;
    const std::int64_t block_stride = c.out.h * c.out.w * kBlock;  // from block to block
    // Four sums at a time (tmm0-3): two blocks of output channels x two runs of pixels, or, with
    // one block left, four runs (a tile multiply's result is ready several multiplies after it
    // issues: two chains of sums alone wait on it; 8 -> 8 at 2048x2048, one thread, forward: 63
    // -> 51 ms in one pair of runs).
    // (Only multiply_4x1 reads tiles of k < 32: load_tile_config.)
    for (std::int64_t ob = 0; ob < a.blocks;) {
      const bool two_blocks = ob + 1 < a.blocks && geometry.k == kChunk;
      const std::size_t per = two_blocks ? 2 : 4;  // runs a step
      for (std::size_t g = 0; g < starts.size(); g += per) {
        const std::size_t runs = std::min(per, starts.size() - g);
        const auto run_at = [&](std::size_t r) { return starts[g + std::min(r, runs - 1)]; };
        zero_2x2();
        for (std::int64_t i = 0; i < c.kh; ++i) {
          const std::uint16_t* row = ring_at(first + i * c.dil_h);
          const std::uint16_t* p[4];
          for (std::size_t r = 0; r < 4; ++r)
            p[r] = row + run_at(r) * pixel;
          for (std::int64_t g2 = 0; g2 < geometry.segments; ++g2) {
            const std::uint16_t* wt =
                a.packed + ((i * geometry.segments + g2) * a.blocks + ob) * kTile;
            const std::int64_t at = geometry.offset(g2, c.dil_w);
            if (two_blocks)
              multiply_2x2(p[0] + at, p[1] + at, stride, wt, wt + kTile, runs > 1, true);
            else
              multiply_4x1(p[0] + at, p[1] + at, p[2] + at, p[3] + at, stride, wt, runs);
          }
        }
        // The tiles go through `spill` (in L1): tile t holds block ob + t % 2 of run t / 2 (two
        // blocks), or block ob of run t.
        store_2x2(spill);
        for (std::size_t t = 0; t < 4; ++t) {
          const std::int64_t block = two_blocks ? ob + static_cast<std::int64_t>(t % 2) : ob;
          const std::size_t r = two_blocks ? t / 2 : t;
          if (r >= runs) continue;
          const std::int64_t w0 = starts[g + r];
          // A run stops where the next starts: a pixel both hold is written once.
          const std::int64_t count = r + 1 < runs ? std::min(valid, starts[g + r + 1] - w0) : valid;
          const std::int64_t c0 = block * kOutBlock;
          const float* bias = a.bias != nullptr ? a.bias + c0 : nullptr;
          if (a.out_planes != nullptr) {
            finish_planes(spill[t], *a.out_planes, n, c0, std::min(kOutBlock, c.out.c - c0), h, w0,
                          count, bias, a.activate, a.slope, stream);
            continue;
          }
          float* at = y + block * block_stride + w0 * kBlock;
          // The gate's values at an output place.
          const float* gate = a.gate != nullptr ? a.gate + (at - a.out) : nullptr;
          finish_tile(spill[t], at, count, bias, a.activate, a.slope, gate, a.gate_slope, stream);
        }
      }
      ob += two_blocks ? 2 : 1;
    }
  }
  if (stream) _mm_sfence();
  _tile_release();
  ::operator delete(ring, std::align_val_t(64));
}

// The zeros of a channel-major ring row (convert_row_channels): all of it where input row `r` is
// outside the input (false), else each channel's columns before `begin` and from `end` on, the
// columns [begin, end) that hold input columns (true).
bool zero_channel_padding(const Shape4& s, std::int64_t r, std::int64_t pad_left, std::int64_t cols,
                          std::uint16_t* row, std::int64_t& begin, std::int64_t& end) {
  if (r < 0 || r >= s.h) {
    std::memset(row, 0, static_cast<std::size_t>(s.c * cols) * sizeof(std::uint16_t));
    return false;
  }
  begin = std::clamp<std::int64_t>(pad_left, 0, cols);
  end = std::clamp<std::int64_t>(pad_left + s.w, begin, cols);
  for (std::int64_t i = 0; i < s.c; ++i) {
    std::uint16_t* ch = row + i * cols;
    std::memset(ch, 0, static_cast<std::size_t>(begin) * sizeof(std::uint16_t));
    std::memset(ch + end, 0, static_cast<std::size_t>(cols - end) * sizeof(std::uint16_t));
  }
  return true;
}

// One ring row for the backward-weights pass: input row `r` of sample `n` as bfloat16,
// channel-major (channel i's `cols` columns at row + i * cols), column c holding input column
// c - pad_left (zeros outside the input).
void convert_row_channels(const float* in, const Shape4& s, std::int64_t n, std::int64_t r,
                          std::int64_t pad_left, std::int64_t cols, std::uint16_t* row) {
  const std::int64_t blocks = s.c / kBlock;
  std::int64_t begin = 0, end = 0;
  if (!zero_channel_padding(s, r, pad_left, cols, row, begin, end)) return;
  alignas(64) float pixels[16 * kBlock], channels[kBlock * 16];
  for (std::int64_t b = 0; b < blocks; ++b) {
    const float* src = in + ((n * blocks + b) * s.h + r) * s.w * kBlock;
    std::uint16_t* dst = row + b * kBlock * cols;
    for (std::int64_t c0 = begin; c0 < end; c0 += 16) {
      // 16 pixels' 16 channels into 16 channels' 16 pixels (a row's last pixels padded with 0).
      const std::int64_t count = std::min<std::int64_t>(16, end - c0);
      const float* at = src + (c0 - pad_left) * kBlock;
      if (count < 16) {
        std::fill(pixels, pixels + 16 * kBlock, 0.0f);
        std::copy(at, at + count * kBlock, pixels);
        at = pixels;
      }
      transpose16(at, kBlock, channels, 16);
      const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1u);
      for (std::int64_t i = 0; i < kBlock; ++i) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_load_ps(channels + i * 16));
        _mm256_mask_storeu_epi16(dst + i * cols + c0, keep, reinterpret_cast<const __m256i&>(h));
      }
    }
  }
}

// convert_row_channels for NCHW planes: each channel's row converted as it lies (the rows past
// s.c are left as they are: zeros from the start).
void convert_row_channels_planes(const ChannelPlanes<const float>& in, const Shape4& s,
                                 std::int64_t n, std::int64_t r, std::int64_t pad_left,
                                 std::int64_t cols, std::uint16_t* row) {
  std::int64_t begin = 0, end = 0;
  if (!zero_channel_padding(s, r, pad_left, cols, row, begin, end)) return;
  for (std::int64_t i = 0; i < s.c; ++i) {
    std::uint16_t* ch = row + i * cols;
    const float* src = in.at(n, i, r);
    for (std::int64_t c = begin; c < end; c += 16) {
      const __mmask16 keep =
          static_cast<__mmask16>((1u << std::min<std::int64_t>(16, end - c)) - 1u);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, src + (c - pad_left)));
      _mm256_mask_storeu_epi16(ch + c, keep, reinterpret_cast<const __m256i&>(h));
    }
  }
}

struct WeightsArgs {
  const Correlation& c;
  const float* x;
  const float* dy;
  // NCHW planes (ConvWeights::run_planes) in place of `x` and `dy`; nullptr: nchw16c.
  const ChannelPlanes<const float>* x_planes = nullptr;
  const ChannelPlanes<const float>* dy_planes = nullptr;
};

// What one run of output rows adds: dw's sums by tap, input block, output block, input channel of
// the block, output channel of the block, and dbias's.
struct WeightsSums {
  std::vector<double> w, b;
};

void weights_rows(const WeightsArgs& a, std::int64_t begin, std::int64_t end, WeightsSums& sums) {
  const Correlation& c = a.c;
  // Channels in blocks of 16, the last padded (NCHW planes: the ring's rows of the padding stay
  // zero, dy's pairs hold zeros there).
  const std::int64_t in_blocks = (c.in.c + kBlock - 1) / kBlock;
  const std::int64_t out_blocks = (c.out.c + kBlock - 1) / kBlock;
  const std::int64_t span = c.dil_h * (c.kh - 1) + 1;
  const std::int64_t chunks = (c.out.w + kChunk - 1) / kChunk;  // of 32 output pixels
  const std::int64_t padded = chunks * kChunk;
  const std::int64_t cols = (padded + c.dil_w * (c.kw - 1) + kChunk - 1) / kChunk * kChunk;
  const std::int64_t ring_row = in_blocks * kBlock * cols;
  const std::int64_t pairs_row = padded / 2 * 32;  // one output block's interleaved pixel pairs
  const std::int64_t dy_row = out_blocks * pairs_row;
  // Up to `group` output rows of one sample at a time: the tiles sum them all before their sums
  // go to double (taps x input x output channels additions a group, which for many channels
  // and few columns cost as much as the products), as long as the group's rows stay within about
  // 1 MiB (the rows of x its taps read, and its rows of dy).
  const std::int64_t row_bytes = (ring_row + dy_row) * 2;
  const std::int64_t group = std::clamp<std::int64_t>(
      (std::int64_t{1} << 20) / std::max<std::int64_t>(row_bytes, 1) - (span - 1), 1, 8);
  const std::int64_t ring_rows = span + group - 1;
  const std::size_t ring_size = static_cast<std::size_t>(ring_rows * ring_row);
  const std::size_t dy_size = static_cast<std::size_t>(group * dy_row);
  auto* ring = static_cast<std::uint16_t*>(
      ::operator new((ring_size + dy_size) * sizeof(std::uint16_t), std::align_val_t(64)));
  std::uint16_t* pairs = ring + ring_size;
  if (a.x_planes != nullptr) std::memset(ring, 0, ring_size * sizeof(std::uint16_t));
  const auto ring_at = [&](std::int64_t r) {
    return ring + (((r % ring_rows) + ring_rows) % ring_rows) * ring_row;
  };
  alignas(64) float tile[4][kPixels * kOutBlock];
  const std::int64_t taps = c.kh * c.kw;
  sums.w.assign(static_cast<std::size_t>(taps * in_blocks * out_blocks * 256), 0.0);
  sums.b.assign(static_cast<std::size_t>(c.out.c), 0.0);
  // (pixel 0 channel 0, pixel 1 channel 0, pixel 0 channel 1, ...) from (pixel 0's 16, pixel 1's)
  alignas(64) std::uint16_t order[32];
  for (int k = 0; k < 16; ++k) {
    order[2 * k] = static_cast<std::uint16_t>(k);
    order[2 * k + 1] = static_cast<std::uint16_t>(16 + k);
  }
  const __m512i interleave = _mm512_load_si512(order);
  const std::int64_t a_stride = cols * static_cast<std::int64_t>(sizeof(std::uint16_t));

  load_tile_config();

  // The ring holds sample ring_n's input rows up to next (the last ring_rows of them).
  std::int64_t ring_n = -1, next = 0;
  for (std::int64_t item = begin; item < end;) {
    const std::int64_t n = item / c.out.h, h = item % c.out.h;
    const std::int64_t rows = std::min({group, end - item, c.out.h - h});  // of sample n
    const std::int64_t first = h - c.pad_top;  // the first input row the group reads
    if (n != ring_n || first >= next || first < next - ring_rows) {
      ring_n = n;
      next = first;
    }
    for (; next < first + rows - 1 + span; ++next)
      if (a.x_planes != nullptr)
        convert_row_channels_planes(*a.x_planes, c.in, n, next, c.pad_left, cols, ring_at(next));
      else
        convert_row_channels(a.x, c.in, n, next, c.pad_left, cols, ring_at(next));
    // dy's rows as pixel pairs, and their sums for dbias.
    for (std::int64_t g = 0; g < rows && a.dy_planes != nullptr; ++g)
      for (std::int64_t ob = 0; ob < out_blocks; ++ob) {
        // 16 pixels of the block's 16 channels (0 past the row and past c.out.c), transposed.
        alignas(64) float channels[16 * 16], pixels[16 * 16];
        std::uint16_t* dst = pairs + g * dy_row + ob * pairs_row;
        __m512 sum = _mm512_setzero_ps();
        for (std::int64_t p = 0; p < padded; p += 16) {
          const std::int64_t count = std::clamp<std::int64_t>(c.out.w - p, 0, 16);
          const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1u);
          for (std::int64_t k = 0; k < 16; ++k) {
            const std::int64_t o = ob * kBlock + k;
            _mm512_store_ps(channels + k * 16,
                            o < c.out.c
                                ? _mm512_maskz_loadu_ps(keep, a.dy_planes->at(n, o, h + g) + p)
                                : _mm512_setzero_ps());
          }
          transpose16(channels, 16, pixels, 16);
          for (std::int64_t q = 0; q < 16; q += 2) {
            const __m512 l = _mm512_load_ps(pixels + q * 16),
                         r = _mm512_load_ps(pixels + (q + 1) * 16);
            sum = _mm512_add_ps(sum, _mm512_add_ps(l, r));
            const __m512bh v = _mm512_cvtne2ps_pbh(r, l);
            _mm512_storeu_si512(
                dst + (p + q) * 16,
                _mm512_permutexvar_epi16(interleave, reinterpret_cast<const __m512i&>(v)));
          }
        }
        alignas(64) float lane[16];
        _mm512_store_ps(lane, sum);
        for (std::int64_t k = 0; k < 16 && ob * kBlock + k < c.out.c; ++k)
          sums.b[static_cast<std::size_t>(ob * kBlock + k)] += lane[k];
      }
    for (std::int64_t g = 0; g < rows && a.dy_planes == nullptr; ++g)
      for (std::int64_t ob = 0; ob < out_blocks; ++ob) {
        const float* src = a.dy + ((n * out_blocks + ob) * c.out.h + h + g) * c.out.w * kBlock;
        std::uint16_t* dst = pairs + g * dy_row + ob * pairs_row;
        __m512 sum = _mm512_setzero_ps();
        for (std::int64_t p = 0; p < padded; p += 2) {
          const __m512 l = p < c.out.w ? _mm512_loadu_ps(src + p * kBlock) : _mm512_setzero_ps();
          const __m512 r =
              p + 1 < c.out.w ? _mm512_loadu_ps(src + (p + 1) * kBlock) : _mm512_setzero_ps();
          sum = _mm512_add_ps(sum, _mm512_add_ps(l, r));
          const __m512bh v = _mm512_cvtne2ps_pbh(r, l);
          _mm512_storeu_si512(dst + p * 16, _mm512_permutexvar_epi16(
                                                interleave, reinterpret_cast<const __m512i&>(v)));
        }
        alignas(64) float lane[16];
        _mm512_store_ps(lane, sum);
        for (int k = 0; k < 16; ++k)
          sums.b[static_cast<std::size_t>(ob * kBlock + k)] += lane[k];
      }
    memory_barrier();
    if (in_blocks < 2 || out_blocks < 2) {
      // Four sums at a time from one block of dy: taps and blocks of x (with one block on either
      // side, 2 x 2 tiles would sum in one or two chains, each waiting on its last multiply).
      const std::int64_t units = taps * in_blocks;  // (tap, block of x), tap-major
      for (std::int64_t ob = 0; ob < out_blocks; ++ob)
        for (std::int64_t u0 = 0; u0 < units; u0 += 4) {
          const std::size_t count = static_cast<std::size_t>(std::min<std::int64_t>(4, units - u0));
          zero_2x2();
          for (std::int64_t g = 0; g < rows; ++g) {
            const std::uint16_t* x[4];
            for (std::size_t u = 0; u < 4; ++u) {
              const std::int64_t unit = u0 + std::min<std::int64_t>(u, count - 1);
              const std::int64_t tap = unit / in_blocks, ib = unit % in_blocks;
              x[u] = ring_at(first + g + tap / c.kw * c.dil_h) + ib * kBlock * cols +
                     tap % c.kw * c.dil_w;
            }
            const std::uint16_t* d = pairs + g * dy_row + ob * pairs_row;
            for (std::int64_t q = 0; q < chunks; ++q)
              multiply_4x1(x[0] + q * kChunk, x[1] + q * kChunk, x[2] + q * kChunk,
                           x[3] + q * kChunk, a_stride, d + q * kChunk * 16, count);
          }
          store_2x2(tile);
          for (std::size_t u = 0; u < count; ++u) {
            const std::int64_t unit = u0 + static_cast<std::int64_t>(u);
            double* out = sums.w.data() + (unit * out_blocks + ob) * 256;
            for (int k = 0; k < 256; ++k)
              out[k] += tile[u][k];
          }
        }
      item += rows;
      continue;
    }
    for (std::int64_t i = 0; i < c.kh; ++i)
      for (std::int64_t j = 0; j < c.kw; ++j) {
        const std::int64_t tap = i * c.kw + j;
        for (std::int64_t ib = 0; ib < in_blocks; ib += 2) {
          const bool two_in = ib + 1 < in_blocks;
          for (std::int64_t ob = 0; ob < out_blocks; ob += 2) {
            const bool two_out = ob + 1 < out_blocks;
            zero_2x2();
            for (std::int64_t g = 0; g < rows; ++g) {
              const std::uint16_t* x0 =
                  ring_at(first + g + i * c.dil_h) + ib * kBlock * cols + j * c.dil_w;
              const std::uint16_t* x1 = x0 + kBlock * cols;
              const std::uint16_t* d0 = pairs + g * dy_row + ob * pairs_row;
              const std::uint16_t* d1 = d0 + pairs_row;
              for (std::int64_t q = 0; q < chunks; ++q)
                multiply_2x2(x0 + q * kChunk, x1 + q * kChunk, a_stride, d0 + q * kChunk * 16,
                             d1 + q * kChunk * 16, two_in, two_out);
            }
            store_2x2(tile);
            // tile[0]: (ib, ob), [1]: (ib, ob + 1), [2]: (ib + 1, ob), [3]: (ib + 1, ob + 1).
            for (int t = 0; t < 4; ++t) {
              const std::int64_t tb = ib + t / 2, to = ob + t % 2;
              if (tb >= in_blocks || to >= out_blocks) continue;
              double* out = sums.w.data() + ((tap * in_blocks + tb) * out_blocks + to) * 256;
              for (int k = 0; k < 256; ++k)
                out[k] += tile[t][k];
            }
          }
        }
      }
    item += rows;
  }
  _tile_release();
  ::operator delete(ring, std::align_val_t(64));
}

// bfloat16 of each float (round to nearest even, as the input conversions): n a multiple of 16.
void to_bf16(const float* from, std::int64_t n, std::uint16_t* to) {
  for (std::int64_t k = 0; k < n; k += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(from + k));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + k), reinterpret_cast<const __m256i&>(v));
  }
}

#pragma GCC pop_options

#endif  // TESSERA_HAS_WIDE_LOOPS

}  // namespace

Correlation adjoint(const Correlation& c) {
  return {.in = c.out,
          .out = c.in,
          .kh = c.kh,
          .kw = c.kw,
          .pad_top = c.dil_h * (c.kh - 1) - c.pad_top,
          .pad_left = c.dil_w * (c.kw - 1) - c.pad_left,
          .dil_h = c.dil_h,
          .dil_w = c.dil_w};
}

bool available() {
#if TESSERA_HAS_WIDE_LOOPS
  static const bool ok = !env_off() && cpu_and_os_allow();
  return ok;
#else
  return false;
#endif
}

namespace {

// Whether the kernels take `c` (Conv::plan; plan_nchw: `nchw`, any channel counts).
bool fits(const Correlation& c, bool nchw) {
  return available() && c.in.n > 0 && c.in.n == c.out.n && c.in.c > 0 && c.out.c > 0 &&
         (nchw || (c.in.c % kBlock == 0 && c.out.c % kBlock == 0)) && c.in.h > 0 && c.in.w > 0 &&
         c.out.h > 0 && c.out.w > 0 && c.kh >= 1 && c.kw >= 1 && c.dil_h >= 1 && c.dil_w >= 1;
}

#if TESSERA_HAS_WIDE_LOOPS
// A fused (leaky) ReLU's slope (ReLU: 0); sigmoid is refused.
float relu_slope(const FusedActivation& f, const char* what) {
  TESSERA_CHECK(f.kind != ActivationKind::sigmoid,
                std::string("AMX convolution: ") + what + " is a (leaky) ReLU only");
  return f.kind == ActivationKind::leaky_relu ? static_cast<float>(f.slope) : 0.0f;
}
#endif

}  // namespace

std::unique_ptr<Conv> Conv::plan(const Correlation& c) {
  return fits(c, false) ? std::unique_ptr<Conv>(new Conv(c, false)) : nullptr;
}

std::unique_ptr<Conv> Conv::plan_nchw(const Correlation& c) {
  return fits(c, true) ? std::unique_ptr<Conv>(new Conv(c, true)) : nullptr;
}

namespace {

RingGeometry ring_geometry(const Correlation& c, bool nchw) {
  RingGeometry g;
  const std::int64_t even = (c.in.c + 1) / 2 * 2;
  if (!nchw && c.in.c == kBlock) {
    // One block: a tap's 16 channels a segment, not half a chunk of zeros.
    g.pixel = g.k = kBlock;
    g.segments = c.kw;
  } else if (!nchw || even > kChunk) {
    g.chunks = (c.in.c + kChunk - 1) / kChunk;
    g.pixel = g.chunks * kChunk;
    g.k = kChunk;
    g.segments = c.kw * g.chunks;
  } else if (c.dil_w == 1 && c.kw * even <= kChunk) {
    g.pixel = even;
    g.k = c.kw * even;
    g.joined = true;
  } else {
    g.pixel = g.k = even;
    g.segments = c.kw;
  }
  return g;
}

}  // namespace

Conv::Conv(const Correlation& c, bool nchw)
    : c_(c),
      nchw_(nchw),
      ring_(ring_geometry(c, nchw)),
      out_blocks_((c.out.c + kOutBlock - 1) / kOutBlock),
      packed_(static_cast<std::size_t>(c.kh * ring_.segments * out_blocks_ * kTile)),
      tiles_(packed_.size(), 0.0f) {}

void Conv::set_weights(const float* oihw, bool adjoint) {
  const std::int64_t O = c_.out.c, I = c_.in.c, kh = c_.kh, kw = c_.kw;
  // k[o][i][a][b] in tile order: tap row, segment (RingGeometry), block of 16 outputs; in a
  // tile, row r holds values 2r and 2r + 1 of the segment for each of the block's 16 outputs,
  // interleaved. The places of inputs past in.c (padding) keep the zeros they were made with.
  std::vector<float>& tiles = tiles_;
  const RingGeometry& g = ring_;
  for (std::int64_t a = 0; a < kh; ++a)
    for (std::int64_t b = 0; b < kw; ++b)
      for (std::int64_t o = 0; o < O; ++o)
        for (std::int64_t i = 0; i < I; ++i) {
          const float v = adjoint ? oihw[((i * O + o) * kh + (kh - 1 - a)) * kw + (kw - 1 - b)]
                                  : oihw[((o * I + i) * kh + a) * kw + b];
          // The segment holding (b, i) and the value's place in it.
          const std::int64_t segment = g.joined ? 0 : b * g.chunks + i / g.k;
          const std::int64_t k = g.joined ? b * g.pixel + i : i % g.k;
          const std::int64_t ob = o / kOutBlock, col = o % kOutBlock;
          const std::int64_t tile = (a * g.segments + segment) * out_blocks_ + ob;
          tiles[static_cast<std::size_t>(tile * kTile + (k / 2) * 32 + col * 2 + k % 2)] = v;
        }
#if TESSERA_HAS_WIDE_LOOPS
  to_bf16(tiles.data(), static_cast<std::int64_t>(tiles.size()), packed_.data());
#else
  TESSERA_CHECK(false, "AMX convolution: not built");
#endif
}

std::unique_ptr<ConvWeights> ConvWeights::plan(const Correlation& c) {
  return fits(c, false) ? std::unique_ptr<ConvWeights>(new ConvWeights(c, false)) : nullptr;
}

std::unique_ptr<ConvWeights> ConvWeights::plan_nchw(const Correlation& c) {
  return fits(c, true) ? std::unique_ptr<ConvWeights>(new ConvWeights(c, true)) : nullptr;
}

void ConvWeights::run(const float* x, const float* dy, float* dw, std::span<float> dbias) const {
  TESSERA_CHECK(!nchw_, "AMX convolution backward-weights: planned for NCHW planes (run_planes)");
  run_any(x, dy, nullptr, nullptr, dw, dbias);
}

void ConvWeights::run_planes(const ChannelPlanes<const float>& x,
                             const ChannelPlanes<const float>& dy, float* dw,
                             std::span<float> dbias) const {
  TESSERA_CHECK(nchw_, "AMX convolution backward-weights: planned for nchw16c (run)");
  run_any(nullptr, nullptr, &x, &dy, dw, dbias);
}

void ConvWeights::run_any(const float* x, const float* dy,
                          const ChannelPlanes<const float>* x_planes,
                          const ChannelPlanes<const float>* dy_planes, float* dw,
                          std::span<float> dbias) const {
  TESSERA_CHECK(dbias.empty() || static_cast<std::int64_t>(dbias.size()) == c_.out.c,
                "AMX convolution backward-weights: bias gradient of " +
                    std::to_string(dbias.size()) + " values for " + std::to_string(c_.out.c) +
                    " output channels");
#if TESSERA_HAS_WIDE_LOOPS
  const WeightsArgs args{c_, x, dy, x_planes, dy_planes};
  const std::int64_t rows = c_.out.n * c_.out.h;
  // Each thread's run of rows, by its first row: summed in that order, whichever thread ends first.
  std::vector<std::pair<std::int64_t, WeightsSums>> runs;
  std::mutex lock;
  parallel_for(
      rows,
      [&](std::int64_t begin, std::int64_t end) {
        WeightsSums sums;
        weights_rows(args, begin, end, sums);
        const std::lock_guard<std::mutex> hold(lock);
        runs.emplace_back(begin, std::move(sums));
      },
      1);
  std::sort(runs.begin(), runs.end(),
            [](const auto& l, const auto& r) { return l.first < r.first; });
  const std::int64_t O = c_.out.c, I = c_.in.c;
  const std::int64_t in_blocks = (I + kBlock - 1) / kBlock, out_blocks = (O + kBlock - 1) / kBlock;
  const std::int64_t taps = c_.kh * c_.kw;
  for (std::int64_t o = 0; o < O; ++o)
    for (std::int64_t i = 0; i < I; ++i)
      for (std::int64_t t = 0; t < taps; ++t) {
        const std::size_t at = static_cast<std::size_t>(
            (((t * in_blocks + i / kBlock) * out_blocks + o / kBlock) * 16 + i % kBlock) * 16 +
            o % kBlock);
        double sum = 0;
        for (const auto& run : runs)
          sum += run.second.w[at];
        dw[(o * I + i) * taps + t] += static_cast<float>(sum);
      }
  for (std::size_t o = 0; o < dbias.size(); ++o) {
    double sum = 0;
    for (const auto& run : runs)
      sum += run.second.b[o];
    dbias[o] += static_cast<float>(sum);
  }
#else
  (void)x;
  (void)dy;
  (void)x_planes;
  (void)dy_planes;
  (void)dw;
  TESSERA_CHECK(false, "AMX convolution: not built");
#endif
}

void Conv::run(const float* in, std::span<const float> bias,
               const std::optional<FusedActivation>& f, float* out, const float* gate,
               const std::optional<FusedActivation>& gate_f) const {
  TESSERA_CHECK(!nchw_, "AMX convolution: planned for NCHW planes (run_planes)");
  run_any(in, nullptr, bias, f, out, nullptr, gate, gate_f);
}

void Conv::run_planes(const ChannelPlanes<const float>& in, std::span<const float> bias,
                      const std::optional<FusedActivation>& f,
                      const ChannelPlanes<float>& out) const {
  TESSERA_CHECK(nchw_, "AMX convolution: planned for nchw16c (run)");
  run_any(nullptr, &in, bias, f, nullptr, &out, nullptr, std::nullopt);
}

void Conv::run_any(const float* in, const ChannelPlanes<const float>* in_planes,
                   std::span<const float> bias, const std::optional<FusedActivation>& f, float* out,
                   const ChannelPlanes<float>* out_planes, const float* gate,
                   const std::optional<FusedActivation>& gate_f) const {
  TESSERA_CHECK(bias.empty() || static_cast<std::int64_t>(bias.size()) == c_.out.c,
                "AMX convolution: bias of " + std::to_string(bias.size()) + " values for " +
                    std::to_string(c_.out.c) + " output channels");
#if TESSERA_HAS_WIDE_LOOPS
  const bool activate = f.has_value();
  const float slope = activate ? relu_slope(*f, "the fused activation") : 0.0f;
  TESSERA_CHECK(gate == nullptr || gate_f, "AMX convolution: a gate needs its (leaky) ReLU");
  const float gate_slope = gate != nullptr ? relu_slope(*gate_f, "the gate's activation") : 0.0f;
  const RunArgs args{c_,          ring_,
                     out_blocks_, packed_.data(),
                     in,          bias.empty() ? nullptr : bias.data(),
                     activate,    slope,
                     out,         gate,
                     gate_slope,  in_planes,
                     out_planes};
  const std::int64_t rows = c_.out.n * c_.out.h;
  parallel_for(
      rows, [&](std::int64_t begin, std::int64_t end) { run_rows(args, begin, end); }, 1);
#else
  (void)in;
  (void)in_planes;
  (void)out_planes;
  (void)f;
  (void)out;
  (void)gate;
  (void)gate_f;
  TESSERA_CHECK(false, "AMX convolution: not built");
#endif
}

}  // namespace tessera::amx
