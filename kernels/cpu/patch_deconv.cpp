// The 2x2 stride-2 transposed convolution in AVX-512 (include/tessera/kernels/patch_deconv.hpp):
// nchw16c rows, one 16-channel output block a vector, the input's channels broadcast.
#include "tessera/kernels/patch_deconv.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

constexpr std::int64_t kLanes = 16;  // channels in a block, floats in a vector
#if TESSERA_HAS_WIDE_LOOPS
constexpr std::int64_t kPixels = 8;  // input pixels one forward block computes (2 x 8 sums)
constexpr std::int64_t kGroup = 8;   // input channels one filter sweep sums (8 x 2 sums)

// Where a row of outputs meets its inputs: output column c is patch column (c + pad_left) % 2 of
// input column (c + pad_left) / 2. Input columns [0, end) reach some output; [lo, hi) reach two.
struct Columns {
  std::int64_t lo, hi, end;
};
Columns columns_of(std::int64_t out_w, std::int64_t pad_left) {
  const std::int64_t end = (out_w - 1 + pad_left) / 2 + 1;
  const std::int64_t lo = std::min(pad_left, end);
  return {.lo = lo, .hi = std::max(lo, (out_w + pad_left) / 2), .end = end};
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
namespace wide {

// One output row's block: input columns [j0, j0 + P) of the window row `x` (its first block; the
// blocks `block` floats apart), into output columns 2j + b - pad_left of `y` (the row of one
// output block), each within [0, out_w). `wa` holds the weights of the row's patch row a:
// wa[(b * C + c) * 16 + o] = w[c][o][a][b] for the block's 16 outputs o.
template <int P>
void forward_block(const float* x, std::int64_t block, std::int64_t channels, const float* wa,
                   const float* bias, float* y, std::int64_t j0, std::int64_t out_w,
                   std::int64_t pad_left, bool stream) {
  __m512 acc[P][2];
  const __m512 start = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int p = 0; p < P; ++p)
    acc[p][0] = acc[p][1] = start;
  const float* w0 = wa;
  const float* w1 = wa + channels * kLanes;
  for (std::int64_t cb = 0; cb < channels / kLanes; ++cb) {
    const float* xb = x + cb * block + j0 * kLanes;
    for (std::int64_t k = 0; k < kLanes; ++k) {
      const std::int64_t c = cb * kLanes + k;
      const __m512 v0 = _mm512_loadu_ps(w0 + c * kLanes), v1 = _mm512_loadu_ps(w1 + c * kLanes);
      for (int p = 0; p < P; ++p) {
        const __m512 s = _mm512_set1_ps(xb[p * kLanes + k]);
        acc[p][0] = _mm512_fmadd_ps(s, v0, acc[p][0]);
        acc[p][1] = _mm512_fmadd_ps(s, v1, acc[p][1]);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int b = 0; b < 2; ++b) {
      const std::int64_t c = 2 * (j0 + p) + b - pad_left;
      if (c < 0 || c >= out_w) continue;
      if (stream)
        _mm512_stream_ps(y + c * kLanes, acc[p][b]);
      else
        _mm512_storeu_ps(y + c * kLanes, acc[p][b]);
    }
}

// The filter-gradient sums of one output row (patch row a of window row `x`) against one block of
// dy's row `dy`, for input channels [k0, k0 + kGroup) of channel block `xb` (x's block, at x's
// first column): acc[k][b] += x[k0 + k][j] * dy[2j + b - pad_left] over input columns j, and
// with `bias`, bias_acc += dy over the row's outputs.
struct FilterSums {
  __m512 acc[kGroup][2];
  __m512 bias;
};

inline void filter_column(const float* xb, std::int64_t j, __m512 d0, __m512 d1, FilterSums& s,
                          bool with_bias) {
  for (std::int64_t k = 0; k < kGroup; ++k) {
    const __m512 v = _mm512_set1_ps(xb[j * kLanes + k]);
    s.acc[k][0] = _mm512_fmadd_ps(v, d0, s.acc[k][0]);
    s.acc[k][1] = _mm512_fmadd_ps(v, d1, s.acc[k][1]);
  }
  if (with_bias) s.bias = _mm512_add_ps(s.bias, _mm512_add_ps(d0, d1));
}

void filter_row(const float* xb, const float* dy, const Columns& cols, std::int64_t out_w,
                std::int64_t pad_left, FilterSums& s, bool with_bias) {
  const auto load = [&](std::int64_t c) {
    return c >= 0 && c < out_w ? _mm512_loadu_ps(dy + c * kLanes) : _mm512_setzero_ps();
  };
  const auto edge = [&](std::int64_t j) {
    filter_column(xb, j, load(2 * j - pad_left), load(2 * j + 1 - pad_left), s, with_bias);
  };
  for (std::int64_t j = 0; j < cols.lo; ++j)
    edge(j);
  const float* d = dy + (2 * cols.lo - pad_left) * kLanes;
  for (std::int64_t j = cols.lo; j < cols.hi; ++j, d += 2 * kLanes)
    filter_column(xb, j, _mm512_loadu_ps(d), _mm512_loadu_ps(d + kLanes), s, with_bias);
  for (std::int64_t j = cols.hi; j < cols.end; ++j)
    edge(j);
}

// sums[i] += lane i of v, in double (once a row: not worth the lane conversions' code).
inline void flush(double* sums, __m512 v) {
  alignas(64) float lanes[kLanes];
  _mm512_store_ps(lanes, v);
  for (std::int64_t i = 0; i < kLanes; ++i)
    sums[i] += lanes[i];
}

// Every output row of the forward (a thread's rows, then its stores fenced).
void forward_rows(const PatchDeconvShapes& s, const float* xd, const float* packed,
                  std::span<const float> bias, float* yd, bool stream) {
  const Shape4 &xs = s.x, &ys = s.y;
  const std::int64_t C = xs.c, OB = ys.c / kLanes, CB = C / kLanes;
  const Columns cols = columns_of(ys.w, s.pad_left);
  const std::int64_t block = xs.h * xs.w * kLanes;  // x's channel blocks apart
  parallel_for(
      ys.n * OB * ys.h,
      [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t q = begin; q < end; ++q) {
          const std::int64_t r = q % ys.h, ob = q / ys.h % OB, n = q / ys.h / OB;
          const std::int64_t a = (r + s.pad_top) % 2, l = (r + s.pad_top) / 2;
          const float* xr = xd + ((n * CB) * xs.h + l) * xs.w * kLanes;
          const float* wa = packed + (ob * 2 + a) * 2 * C * kLanes;
          const float* bb = bias.empty() ? nullptr : bias.data() + ob * kLanes;
          float* yr = yd + ((n * OB + ob) * ys.h + r) * ys.w * kLanes;
          std::int64_t j = 0;
          for (; j + kPixels <= cols.end; j += kPixels)
            forward_block<kPixels>(xr, block, C, wa, bb, yr, j, ys.w, s.pad_left, stream);
          for (; j < cols.end; ++j)
            forward_block<1>(xr, block, C, wa, bb, yr, j, ys.w, s.pad_left, stream);
        }
        if (stream) _mm_sfence();
      },
      grain_for(ys.w * kLanes));
}

// The filter gradient's sums per band: band t sums window rows [t * band, (t + 1) * band) of all
// samples (row n * H + l) into its own doubles at partial + t * per_band (zeroed first):
// [c][a][b][o], then the bias's [o] (with_bias).
void filter_bands(const PatchDeconvShapes& s, const float* xd, const float* dyd, std::int64_t band,
                  std::int64_t bands, std::int64_t per_band, bool with_bias, double* partial) {
  const Shape4 &xs = s.x, &ys = s.y;
  const std::int64_t C = xs.c, O = ys.c, OB = O / kLanes, CB = C / kLanes;
  const Columns cols = columns_of(ys.w, s.pad_left);
  parallel_for(
      bands,
      [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t t = begin; t < end; ++t) {
          double* part = partial + t * per_band;
          std::fill(part, part + per_band, 0.0);
          const std::int64_t last = std::min(xs.n * xs.h, (t + 1) * band);
          for (std::int64_t row = t * band; row < last; ++row) {
            const std::int64_t n = row / xs.h, l = row % xs.h;
            for (std::int64_t a = 0; a < 2; ++a) {
              const std::int64_t r = 2 * l + a - s.pad_top;
              if (r < 0 || r >= ys.h) continue;
              for (std::int64_t ob = 0; ob < OB; ++ob) {
                const float* dr = dyd + ((n * OB + ob) * ys.h + r) * ys.w * kLanes;
                for (std::int64_t g = 0; g < C / kGroup; ++g) {
                  const std::int64_t cb = g * kGroup / kLanes, k0 = g * kGroup % kLanes;
                  const float* xb = xd + ((n * CB + cb) * xs.h + l) * xs.w * kLanes + k0;
                  FilterSums sums;
                  for (auto& pair : sums.acc)
                    pair[0] = pair[1] = _mm512_setzero_ps();
                  sums.bias = _mm512_setzero_ps();
                  const bool bias_here = with_bias && g == 0;
                  filter_row(xb, dr, cols, ys.w, s.pad_left, sums, bias_here);
                  for (std::int64_t k = 0; k < kGroup; ++k)
                    for (std::int64_t b = 0; b < 2; ++b)
                      flush(part + (((g * kGroup + k) * 2 + a) * 2 + b) * O + ob * kLanes,
                            sums.acc[k][b]);
                  if (bias_here) flush(part + 4 * C * O + ob * kLanes, sums.bias);
                }
              }
            }
          }
        }
      },
      1);
}

}  // namespace wide
#pragma GCC pop_options
#endif

class PatchDeconv final : public PatchDeconvKernel {
 public:
  explicit PatchDeconv(const PatchDeconvShapes& s) : s_(s) {
    // Bands of at least 4 rows, at most 64 of them (the threads share them), and no more than
    // 32 MiB of partial sums hold (at least one band: a 512 -> 256 conv's 4 MiB a band gives 7).
    // Fixed by the shape alone, so the sums do not depend on the thread count.
    const std::int64_t rows = s.x.n * s.x.h;
    const std::int64_t most = std::clamp<std::int64_t>(
        (std::int64_t{32} << 20) / (per_band() * std::int64_t(sizeof(double))), 1, 64);
    band_ = std::max<std::int64_t>(4, (rows + most - 1) / most);
    bands_ = (rows + band_ - 1) / band_;
    partial_.resize(static_cast<std::size_t>(bands_ * per_band()));
    packed_.resize(static_cast<std::size_t>(s.w.numel()));
  }

  void forward(const Tensor<float>& x, const Tensor<float>& w, std::span<const float> bias,
               Tensor<float>& y) override {
    check(x, "x", s_.x);
    check(y, "y", s_.y);
    TESSERA_CHECK(w.shape() == s_.w && w.layout() == Layout::nchw,
                  "patch_deconv forward: w is " + w.shape().str() + ", planned " + s_.w.str());
    TESSERA_CHECK(bias.empty() || static_cast<std::int64_t>(bias.size()) == s_.y.c,
                  "patch_deconv forward: " + std::to_string(bias.size()) + " biases for " +
                      std::to_string(s_.y.c) + " channels");
#if TESSERA_HAS_WIDE_LOOPS
    const std::int64_t C = s_.x.c, O = s_.y.c;
    // packed_[((ob * 2 + a) * 2 + b) * C * 16 + c * 16 + o] = w[c][ob * 16 + o][a][b].
    const float* wd = w.data();
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t o = 0; o < O; ++o)
        for (std::int64_t a = 0; a < 2; ++a)
          for (std::int64_t b = 0; b < 2; ++b)
            packed_[static_cast<std::size_t>((((o / kLanes) * 2 + a) * 2 + b) * C * kLanes +
                                             c * kLanes + o % kLanes)] =
                wd[((c * O + o) * 2 + a) * 2 + b];
    const bool stream = reinterpret_cast<std::uintptr_t>(y.data()) % 64 == 0 &&
                        y.size() * sizeof(float) > (std::size_t{8} << 20);
    wide::forward_rows(s_, x.data(), packed_.data(), bias, y.data(), stream);
#else
    (void)x;
    (void)y;
    TESSERA_CHECK(false, "patch_deconv: built without the AVX-512 loops");
#endif
  }

  void backward_filter(const Tensor<float>& x, const Tensor<float>& dy, Tensor<float>& dw,
                       std::span<float> dbias) override {
    check(x, "x", s_.x);
    check(dy, "dy", s_.y);
    TESSERA_CHECK(
        dw.shape() == s_.w && dw.layout() == Layout::nchw,
        "patch_deconv backward_filter: dw is " + dw.shape().str() + ", planned " + s_.w.str());
    TESSERA_CHECK(dbias.empty() || static_cast<std::int64_t>(dbias.size()) == s_.y.c,
                  "patch_deconv backward_filter: " + std::to_string(dbias.size()) +
                      " bias gradients for " + std::to_string(s_.y.c) + " channels");
#if TESSERA_HAS_WIDE_LOOPS
    const std::int64_t C = s_.x.c, O = s_.y.c;
    const bool with_bias = !dbias.empty();
    wide::filter_bands(s_, x.data(), dy.data(), band_, bands_, per_band(), with_bias,
                       partial_.data());
    // The bands in order (into the first band's sums), then into dw [c][o][a][b] and dbias.
    double* total = partial_.data();
    for (std::int64_t t = 1; t < bands_; ++t) {
      const double* part = partial_.data() + t * per_band();
      for (std::int64_t i = 0; i < per_band(); ++i)
        total[i] += part[i];
    }
    float* dwd = dw.data();
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t o = 0; o < O; ++o)
        for (std::int64_t a = 0; a < 2; ++a)
          for (std::int64_t b = 0; b < 2; ++b) {
            float& d = dwd[((c * O + o) * 2 + a) * 2 + b];
            d = static_cast<float>(d + total[((c * 2 + a) * 2 + b) * O + o]);
          }
    if (with_bias)
      for (std::int64_t o = 0; o < O; ++o)
        dbias[static_cast<std::size_t>(o)] =
            static_cast<float>(dbias[static_cast<std::size_t>(o)] + total[4 * C * O + o]);
#else
    (void)x;
    (void)dy;
    (void)dw;
    (void)dbias;
    TESSERA_CHECK(false, "patch_deconv: built without the AVX-512 loops");
#endif
  }

  std::string name() const override {
    return "tessera patch avx512";
  }

 private:
  PatchDeconvShapes s_;
  std::int64_t band_ = 0, bands_ = 0;  // window rows per band of the filter gradient; bands
  std::vector<double> partial_;        // bands_ x per_band()
  std::vector<float> packed_;          // the forward's weights (forward)

  std::int64_t per_band() const {
    return 4 * s_.x.c * s_.y.c + s_.y.c;
  }

  static void check(const Tensor<float>& t, const char* what, const Shape4& planned) {
    TESSERA_CHECK(t.shape() == planned && t.layout() == Layout::nchw16c,
                  std::string("patch_deconv: ") + what + " is " + t.shape().str() + " in " +
                      to_string(t.layout()) + ", planned " + planned.str() + " in nchw16c");
  }
};

}  // namespace

bool patch_deconv_fits(const PatchDeconvShapes& s) {
  if (!TESSERA_HAS_WIDE_LOOPS || simd_level() != SimdLevel::avx512) return false;
  const Shape4 &x = s.x, &w = s.w, &y = s.y;
  return x.n > 0 && x.n == y.n && x.c > 0 && x.c % kLanes == 0 && y.c > 0 && y.c % kLanes == 0 &&
         w.n == x.c && w.c == y.c && w.h == 2 && w.w == 2 && x.h > 0 && x.w > 0 && y.h > 0 &&
         y.w > 0 && (s.pad_top == 0 || s.pad_top == 1) && (s.pad_left == 0 || s.pad_left == 1) &&
         (y.h - 1 + s.pad_top) / 2 < x.h && (y.w - 1 + s.pad_left) / 2 < x.w;
}

std::unique_ptr<PatchDeconvKernel> make_patch_deconv(const PatchDeconvShapes& shapes) {
  if (!patch_deconv_fits(shapes)) return nullptr;
  return std::make_unique<PatchDeconv>(shapes);
}

}  // namespace tessera
