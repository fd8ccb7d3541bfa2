// The CPU backend's softmax cross-entropy (include/tessera/kernels/local_kernels.hpp,
// make_cpu_loss): the reference's per-pixel loop (reference::pixel_cross_entropy_range), or on
// AVX-512 the same arithmetic 8 pixels at a time (wide::cross_entropy_range: elementwise::
// cross_entropy's operations lane by lane, exp_poly and log_poly included, the pixels' losses
// added in pixel order), the pixels split into fixed chunks whose sums are added in chunk order,
// so that the loss does not depend on the thread count. The gradient and the loss are the
// reference's bit for bit on either path; the loss differs from the reference's one sequential sum
// by double rounding. The vector loop is memory-bound; the scalar one spent 265 ms a call on 2
// classes at 2048x2048 on one Skylake-SP core, the step's largest cost outside the layers.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

constexpr std::int64_t kChunk = 1 << 14;  // pixels per partial sum

#if TESSERA_HAS_WIDE_LOOPS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
namespace wide {

using namespace elementwise;

inline __m512d all(double v) {
  return _mm512_set1_pd(v);
}
inline __m512d add(__m512d a, __m512d b) {
  return _mm512_add_pd(a, b);
}
inline __m512d sub(__m512d a, __m512d b) {
  return _mm512_sub_pd(a, b);
}
inline __m512d mul(__m512d a, __m512d b) {
  return _mm512_mul_pd(a, b);
}

// kGroups vectors of 8 lanes side by side: the loops over g below are unrolled, and the groups'
// chains of dependent operations (the polynomials') interleave instead of waiting one for another.
constexpr int kGroups = 4;
using Lanes = __m512d[kGroups];

// elementwise::exp_poly on each lane: its operations in its order.
inline void exp_poly8(const Lanes& a, Lanes& out) {
  for (int g = 0; g < kGroups; ++g) {
    const __m512d t = add(mul(a[g], all(kInvLn2)), all(kRoundToInt));
    const __m512d k = sub(t, all(kRoundToInt));
    const __m512d r = sub(sub(a[g], mul(k, all(kLn2Hi))), mul(k, all(kLn2Lo)));
    const __m512d r2 = mul(r, r), r4 = mul(r2, r2), r8 = mul(r4, r4);
    // c0 + c1 r + (c2 + c3 r) r2, as exp_poly's parentheses say.
    const auto quad = [&](double c0, double c1, double c2, double c3) {
      return add(add(all(c0), mul(all(c1), r)), mul(add(all(c2), mul(all(c3), r)), r2));
    };
    const __m512d tail =
        add(add(quad(kExp2, kExp3, kExp4, kExp5), mul(quad(kExp6, kExp7, kExp8, kExp9), r4)),
            mul(quad(kExp10, kExp11, kExp12, kExp13), r8));
    const __m512d p = add(all(kExp0), add(mul(all(kExp1), r), mul(r2, tail)));
    const __m512i k_bits = _mm512_sub_epi64(
        _mm512_castpd_si512(t), _mm512_set1_epi64(static_cast<long long>(kRoundToIntBits)));
    const __m512i field =
        _mm512_maskz_slli_epi64(0xff, _mm512_add_epi64(k_bits, _mm512_set1_epi64(1023)), 52);
    const __m512d v = mul(p, _mm512_castsi512_pd(field));
    const __m512d low =
        _mm512_mask_blend_pd(_mm512_cmp_pd_mask(a[g], all(kExpLowest), _CMP_LT_OQ), v, all(0.0));
    out[g] = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(a[g], all(kExpHighest), _CMP_GT_OQ), low,
                                  all(kInfinity));
  }
}

// elementwise::log_poly on each lane.
inline void log_poly8(const Lanes& x, Lanes& out) {
  for (int g = 0; g < kGroups; ++g) {
    const __m512i b = _mm512_castpd_si512(x[g]);
    __m512d m = _mm512_castsi512_pd(_mm512_or_si512(
        _mm512_and_si512(b, _mm512_set1_epi64(static_cast<long long>(kMantissaBits))),
        _mm512_set1_epi64(static_cast<long long>(kOneBits))));
    __m512d e = _mm512_cvtepi64_pd(_mm512_sub_epi64(
        _mm512_and_si512(_mm512_maskz_srli_epi64(0xff, b, 52), _mm512_set1_epi64(0x7ff)),
        _mm512_set1_epi64(1023)));
    const __mmask8 big = _mm512_cmp_pd_mask(m, all(kSqrt2), _CMP_GT_OQ);
    m = _mm512_mask_mul_pd(m, big, m, all(0.5));
    e = _mm512_mask_add_pd(e, big, e, all(1.0));
    const __m512d f = sub(m, all(1.0));
    const __m512d s = _mm512_div_pd(f, add(all(2.0), f));
    const __m512d z = mul(s, s), z2 = mul(z, z), z4 = mul(z2, z2), z8 = mul(z4, z4);
    const auto pair = [&](double c0, double c1) { return add(all(c0), mul(all(c1), z)); };
    const __m512d q = add(add(add(pair(kLog1, kLog2), mul(pair(kLog3, kLog4), z2)),
                              mul(add(pair(kLog5, kLog6), mul(pair(kLog7, kLog8), z2)), z4)),
                          mul(add(pair(kLog9, kLog10), mul(all(kLog11), z2)), z8));
    const __m512d y =
        add(mul(e, all(kLn2Hi)), add(f, sub(mul(e, all(kLn2Lo)), mul(s, sub(f, mul(z, q))))));
    out[g] = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x[g], all(kInfinity), _CMP_LT_OQ), x[g], y);
  }
}

// The lanes of `mask` of 8 values from p, in double (zeros elsewhere). Here and above, the maskz
// forms of the intrinsics: GCC 12's unmasked ones start from an "undefined" vector that
// -Wmaybe-uninitialized flags (as in kernels/cpu/narrow_conv.cpp).
inline __m512d load8(const float* p, __mmask8 mask) {
  return _mm512_maskz_cvtps_pd(0xff, _mm256_maskz_loadu_ps(mask, p));
}
inline __m512d load8(const double* p, __mmask8 mask) {
  return _mm512_maskz_loadu_pd(mask, p);
}
// static_cast<T> of each lane of `mask` into p.
inline void store8(float* p, __mmask8 mask, __m512d v) {
  _mm256_mask_storeu_ps(p, mask, _mm512_maskz_cvtpd_ps(0xff, v));
}
inline void store8(double* p, __mmask8 mask, __m512d v) {
  _mm512_mask_storeu_pd(p, mask, v);
}

// reference::pixel_cross_entropy_range over pixels [first, last) of NCHW logits of `channels`
// planes of `plane` pixels: elementwise::cross_entropy for up to 8 x kGroups pixels of one sample
// at a time, each lane as that function computes one pixel; the pixels' losses added in pixel
// order.
template <typename T>
double cross_entropy_range(const T* logits, const std::int32_t* labels, std::int64_t channels,
                           std::int64_t plane, T scale, T* d, std::int64_t first,
                           std::int64_t last) {
  constexpr std::int64_t kPixels = 8 * kGroups;
  const bool cached = channels <= kCachedClasses;
  const __m512d scale8 = all(static_cast<double>(scale)), zero = all(0.0), one = all(1.0);
  double total = 0;
  for (std::int64_t k = first; k < last;) {
    const std::int64_t sample = k / plane, offset = k % plane;
    const std::int64_t count = std::min({last - k, kPixels, plane - offset});  // of this sample
    const T* x0 = logits + sample * channels * plane + offset;
    __mmask8 mask[kGroups];
    __m256i label[kGroups];
    Lanes top, sum, picked, a, v, loss;
    for (int g = 0; g < kGroups; ++g) {
      const std::int64_t n = std::clamp<std::int64_t>(count - 8 * g, 0, 8);
      mask[g] = static_cast<__mmask8>((1u << n) - 1u);
      label[g] = _mm256_maskz_loadu_epi32(mask[g], labels + k + 8 * g);
      top[g] = load8(x0 + 8 * g, mask[g]);
      sum[g] = picked[g] = zero;
    }
    for (std::int64_t c = 1; c < channels; ++c)
      for (int g = 0; g < kGroups; ++g) {
        const __m512d x = load8(x0 + c * plane + 8 * g, mask[g]);
        top[g] = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(top[g], x, _CMP_LT_OQ), top[g], x);
      }
    __m512d e[kCachedClasses][kGroups];
    for (std::int64_t c = 0; c < channels; ++c) {
      const __m256i class_c = _mm256_set1_epi32(static_cast<int>(c));
      for (int g = 0; g < kGroups; ++g) {
        const __m512d x = load8(x0 + c * plane + 8 * g, mask[g]);
        a[g] = sub(x, top[g]);
        picked[g] = _mm512_mask_blend_pd(_mm256_cmpeq_epi32_mask(label[g], class_c), picked[g], x);
      }
      exp_poly8(a, v);
      for (int g = 0; g < kGroups; ++g) {
        v[g] = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(a[g], zero, _CMP_EQ_OQ), v[g], one);
        if (cached) e[c][g] = v[g];
        sum[g] = add(sum[g], v[g]);
      }
    }
    if (d != nullptr)
      for (std::int64_t c = 0; c < channels; ++c) {
        if (!cached) {
          for (int g = 0; g < kGroups; ++g)
            a[g] = sub(load8(x0 + c * plane + 8 * g, mask[g]), top[g]);
          exp_poly8(a, v);
        }
        const __m256i class_c = _mm256_set1_epi32(static_cast<int>(c));
        for (int g = 0; g < kGroups; ++g) {
          const __m512d target =
              _mm512_mask_blend_pd(_mm256_cmpeq_epi32_mask(label[g], class_c), zero, one);
          const __m512d prob = _mm512_div_pd(cached ? e[c][g] : v[g], sum[g]);
          store8(d + (x0 - logits) + c * plane + 8 * g, mask[g], mul(scale8, sub(prob, target)));
        }
      }
    log_poly8(sum, loss);
    alignas(64) double each[kPixels];
    for (int g = 0; g < kGroups; ++g)
      _mm512_store_pd(each + 8 * g, sub(add(loss[g], top[g]), picked[g]));
    for (std::int64_t l = 0; l < count; ++l)
      total += each[l];
    k += count;
  }
  return total;
}

}  // namespace wide
#pragma GCC pop_options
#endif

template <typename T>
class ThreadedLoss final : public LossKernel<T> {
 public:
  std::string name() const override { return "threaded"; }
  double cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                       Tensor<T>* dlogits) const override {
    const Shape4& s = logits.shape();
    check_cross_entropy(s, labels, dlogits != nullptr ? &dlogits->shape() : nullptr);
    const std::int64_t pixels = s.n * s.h * s.w;
    const std::int64_t chunks = (pixels + kChunk - 1) / kChunk;
    std::vector<double> partial(static_cast<std::size_t>(chunks), 0.0);
    auto range = scalar_range;
#if TESSERA_HAS_WIDE_LOOPS
    if (simd_level() == SimdLevel::avx512) range = wide_range;
#endif
    parallel_for(
        chunks,
        [&](std::int64_t first, std::int64_t last) {
          for (std::int64_t chunk = first; chunk < last; ++chunk)
            partial[static_cast<std::size_t>(chunk)] =
                range(logits, labels, scale, dlogits, chunk * kChunk,
                      std::min(pixels, (chunk + 1) * kChunk));
        },
        1);
    double total = 0;
    for (double v : partial)
      total += v;
    return total;
  }

 private:
  static double scalar_range(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                             Tensor<T>* dlogits, std::int64_t first, std::int64_t last) {
    return reference::pixel_cross_entropy_range(logits, labels, scale, dlogits, first, last);
  }
#if TESSERA_HAS_WIDE_LOOPS
  static double wide_range(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                           Tensor<T>* dlogits, std::int64_t first, std::int64_t last) {
    const Shape4& s = logits.shape();
    return wide::cross_entropy_range(logits.data(), labels.data(), s.c, s.h * s.w, scale,
                                     dlogits != nullptr ? dlogits->data() : nullptr, first, last);
  }
#endif
};

}  // namespace

template <typename T>
std::unique_ptr<LossKernel<T>> make_cpu_loss() {
  return std::make_unique<ThreadedLoss<T>>();
}

template std::unique_ptr<LossKernel<float>> make_cpu_loss<float>();
template std::unique_ptr<LossKernel<double>> make_cpu_loss<double>();

}  // namespace tessera
