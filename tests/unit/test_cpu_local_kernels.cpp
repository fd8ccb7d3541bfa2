// The CPU backend's threaded local kernels against the reference: nearest upsampling by 2 across
// the columns (bit for bit, every phase and row scale, odd widths, NCHW and the blocked layouts)
// and the threaded softmax cross-entropy (gradient bit for bit, loss to double rounding and the
// same on 1 and 2 threads and in its AVX-512 loop). The CPU batch norm's normalisation with the
// following (leaky) ReLU applied as it writes: bit for bit the two passes apart, both layouts.
// Single process.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/batchnorm_kernel.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/kernels/reference_upsample.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/random.hpp"
#include "tessera/tensor.hpp"

#include "../common/test_helpers.hpp"

namespace tessera {
namespace {

using reference::UpsampleGeometry;

constexpr std::uint64_t kSeed = 20261125;

// Bit for bit: the same value and sign, or NaN both.
template <typename T>
std::int64_t mismatches(const Tensor<T>& got, const Tensor<T>& want) {
  std::int64_t wrong = 0;
  for (std::int64_t k = 0; k < want.numel(); ++k) {
    const T a = got.data()[k], b = want.data()[k];
    wrong += !((a == b && std::signbit(a) == std::signbit(b)) || (std::isnan(a) && std::isnan(b)));
  }
  return wrong;
}

// The kernel's threads for one scope.
struct Threads {
  KernelThreads before = kernel_threads();
  explicit Threads(int n) { set_kernel_threads({n, "test"}); }
  ~Threads() { set_kernel_threads(before); }
};

// In `layout` (its last block padded for 3 channels in nchw8c or nchw16c), or with `nchw_image`
// the window x and dx in `layout` and y and dy in NCHW: converted back to NCHW, the results are
// the reference's.
template <typename T>
void expect_upsample_matches(std::int64_t sh, std::int64_t ph, std::int64_t pw, std::int64_t out_h,
                             std::int64_t out_w, std::uint64_t stream, Layout layout = Layout::nchw,
                             std::int64_t channels = 3, bool nchw_image = false) {
  const UpsampleGeometry g{.scale_h = sh, .scale_w = 2, .phase_h = ph, .phase_w = pw};
  // x holds exactly the rows and columns y reads, plus one unread column.
  const Shape4 x{2, channels, (out_h - 1 + ph) / sh + 1, (out_w - 1 + pw) / 2 + 2};
  const Shape4 y{2, channels, out_h, out_w};
  const Layout image = nchw_image ? Layout::nchw : layout;
  const std::string what = "scale " + std::to_string(sh) + "x2, phase " + std::to_string(ph) + "," +
                           std::to_string(pw) + ", y " + y.str() + " in " + to_string(image) +
                           ", x in " + to_string(layout);
  std::unique_ptr<UpsampleKernel<T>> k = make_cpu_upsample<T>(g);
  ASSERT_EQ(k->name(), "threaded pairs");
  ASSERT_TRUE(k->takes_blocked());
  ASSERT_TRUE(k->converts_blocked_to_nchw());
  const Tensor<T> xv = test::random_tensor<T>(x, kSeed, stream);
  const Tensor<T> dy = test::random_tensor<T>(y, kSeed, stream + 1);
  Tensor<T> got_y(y, image, T(7)), got_dx(x, layout, T(7)), want_y(y), want_dx(x);
  k->forward(to_layout(xv, layout), got_y);
  k->backward(to_layout(dy, image), got_dx);
  reference::upsample_nearest_forward(xv, want_y, g);
  reference::upsample_nearest_backward(dy, want_dx, g);
  EXPECT_EQ(mismatches(to_layout(got_y, Layout::nchw), want_y), 0) << "forward, " << what;
  EXPECT_EQ(mismatches(to_layout(got_dx, Layout::nchw), want_dx), 0) << "backward, " << what;
  // A last partial block's padding channels hold zeros, as to_layout leaves them: all of the
  // storage as to_layout writes it.
  const Tensor<T> padded = to_layout(want_dx, layout);
  ASSERT_EQ(got_dx.span().size(), padded.span().size()) << what;
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < padded.span().size(); ++i)
    wrong += std::memcmp(&got_dx.span()[i], &padded.span()[i], sizeof(T)) != 0;
  EXPECT_EQ(wrong, 0) << "backward, storage with padding channels, " << what;
}

TEST(CpuUpsample, ByTwoAcrossColumnsGivesTheReferenceBitForBit) {
  std::uint64_t stream = 0;
  for (std::int64_t sh : {1, 2, 3})
    for (std::int64_t ph = 0; ph <= sh; ++ph)
      for (std::int64_t pw : {0, 1, 2, 3})
        for (std::int64_t out_w : {1, 2, 7, 40}) {
          stream += 2;
          expect_upsample_matches<float>(sh, ph, pw, 5 + ph, out_w, stream);
          expect_upsample_matches<double>(sh, ph, pw, 4, out_w, stream);
        }
}

TEST(CpuUpsample, BlockedLayoutsGiveTheReferenceBitForBit) {
  std::uint64_t stream = 1000;
  for (const Layout layout : {Layout::nchw8c, Layout::nchw16c})
    for (std::int64_t channels : {3, 16, 20})
      for (std::int64_t pw : {0, 1})
        for (std::int64_t out_w : {1, 7, 40}) {
          stream += 2;
          expect_upsample_matches<float>(2, 1, pw, 6, out_w, stream, layout, channels);
          expect_upsample_matches<double>(1, 0, pw, 3, out_w, stream, layout, channels);
        }
}

TEST(CpuUpsample, BlockedWindowsIntoNchwImagesGiveTheReferenceBitForBit) {
  std::uint64_t stream = 2000;
  for (const Layout layout : {Layout::nchw8c, Layout::nchw16c})
    for (std::int64_t channels : {3, 16, 20})
      for (std::int64_t pw : {0, 1})
        for (std::int64_t out_w : {1, 7, 40}) {
          stream += 2;
          expect_upsample_matches<float>(2, 1, pw, 6, out_w, stream, layout, channels, true);
          expect_upsample_matches<double>(3, 2, pw, 5, out_w, stream, layout, channels, true);
        }
}

// The AVX-512 rows (16 inputs at a time, the rest as the plain loop does) and the baseline ones,
// with and without streaming stores (aligned or not: an odd phase starts the pairs one value in),
// in NCHW and from blocked windows into NCHW images: the reference's results bit for bit.
TEST(CpuUpsample, GivesTheReferenceAtEverySimdLevelWithAndWithoutStreaming) {
  std::uint64_t stream = 3000;
  test::at_every_simd_level_streaming_or_not([&] {
    for (std::int64_t pw : {0, 1})
      for (std::int64_t out_w : {32, 64, 97}) {
        stream += 2;
        expect_upsample_matches<float>(2, 0, pw, 4, out_w, stream);
        expect_upsample_matches<float>(2, 1, pw, 5, out_w, stream, Layout::nchw16c, 20, true);
        expect_upsample_matches<float>(2, 0, pw, 4, out_w, stream, Layout::nchw8c, 3, true);
      }
  });
}

TEST(CpuUpsample, OtherScalesAndTheReferenceBackendKeepTheReference) {
  EXPECT_EQ(make_cpu_upsample<float>(UpsampleGeometry{.scale_h = 2, .scale_w = 3})->name(),
            "reference");
  EXPECT_EQ(backend_of(KernelBackend::reference)
                .upsample<float>(UpsampleGeometry{.scale_h = 2, .scale_w = 2})
                ->name(),
            "reference");
}

// Bias gradients (the narrow heads' and the transposed convolutions'): per channel the sum over
// samples and pixels, in double whatever T is (a float running sum over a 257 x 263 plane of
// values near 1 is off by about 1e-4), added to what dbias held; the same in NCHW and in
// channel blocks (the last one padded), at any thread count.
TEST(CpuMerge, BiasGradientsAreSummedInDoubleInEveryLayout) {
  const Shape4 s{2, 20, 257, 263};
  Tensor<float> dy = test::random_tensor<float>(s, kSeed, 3, -1, 1);
  for (float& v : dy.span())
    v = 1.0f + v / 1024;
  std::vector<double> want(20, 0.5);
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t c = 0; c < s.c; ++c)
      for (std::int64_t i = 0; i < s.h; ++i)
        for (std::int64_t j = 0; j < s.w; ++j)
          want[static_cast<std::size_t>(c)] += static_cast<double>(dy.at(n, c, i, j));
  const std::unique_ptr<MergeKernel<float>> k = make_cpu_merge<float>();
  std::vector<float> nchw;
  for (Layout layout : {Layout::nchw, Layout::nchw16c, Layout::nchw8c}) {
    for (int threads : {1, 2}) {
      Threads scope(threads);
      std::vector<float> got(20, 0.5f);
      k->add_bias_grad(to_layout(dy, layout), std::span<float>(got));
      for (std::size_t c = 0; c < got.size(); ++c)
        EXPECT_NEAR(got[c], want[c], 1e-7 * want[c]) << to_string(layout) << ", channel " << c;
      if (nchw.empty()) nchw = got;
      EXPECT_EQ(got, nchw) << to_string(layout) << ", " << threads << " threads";
    }
  }
}

// Bias added in place: each value plus its channel's bias (float's one rounding), in NCHW and in
// channel blocks, a single block (16 channels in nchw16c, spread over the threads by pixels) and a
// padded last one, at any thread count; the padding channels stay as they were.
TEST(CpuMerge, BiasIsAddedToEveryChannelInEveryLayout) {
  const std::unique_ptr<MergeKernel<float>> k = make_cpu_merge<float>();
  for (const Shape4 s : {Shape4{1, 16, 301, 299}, Shape4{2, 20, 67, 129}}) {
    const Tensor<float> y = test::random_tensor<float>(s, kSeed, 4, -1, 1);
    const Tensor<float> bias = test::random_tensor<float>({1, s.c, 1, 1}, kSeed, 5, -1, 1);
    Tensor<float> want = y;
    for (std::int64_t n = 0; n < s.n; ++n)
      for (std::int64_t c = 0; c < s.c; ++c)
        for (std::int64_t i = 0; i < s.h; ++i)
          for (std::int64_t j = 0; j < s.w; ++j)
            want.at(n, c, i, j) += bias.span()[static_cast<std::size_t>(c)];
    for (Layout layout : {Layout::nchw, Layout::nchw16c, Layout::nchw8c}) {
      for (int threads : {1, 2}) {
        Threads scope(threads);
        Tensor<float> got = to_layout(y, layout);
        k->add_bias(bias.span(), got);
        EXPECT_EQ(mismatches(to_layout(got, Layout::nchw), want), 0)
            << s.str() << " in " << to_string(layout) << ", " << threads << " threads";
        if (layout == Layout::nchw16c && s.c % 16 != 0) {
          // The last block's padding channels (16..31 of 20) stay zero.
          const std::int64_t plane = s.h * s.w;
          for (std::int64_t n = 0; n < s.n; ++n)
            for (std::int64_t i = 0; i < plane; ++i)
              for (std::int64_t j = s.c % 16; j < 16; ++j)
                ASSERT_EQ(got.data()[((n * 2 + 1) * plane + i) * 16 + j], 0.0f);
        }
      }
    }
  }
}

// Logits of `s` in [-4, 4) with special values (NaN, +-inf, a tie, large ones) in a few pixels,
// and labels of every class.
template <typename T>
Tensor<T> loss_logits(const Shape4& s, std::vector<std::int32_t>& labels) {
  Tensor<T> logits = test::random_tensor<T>(s, kSeed, 1, -4, 4);
  labels.resize(static_cast<std::size_t>(s.n * s.h * s.w));
  for (std::size_t k = 0; k < labels.size(); ++k)
    labels[k] = static_cast<std::int32_t>(uniform01(kSeed, 2, k) * static_cast<double>(s.c));
  const T inf = std::numeric_limits<T>::infinity();
  logits.at(0, 0, 0, 1) = std::numeric_limits<T>::quiet_NaN();
  logits.at(0, 1, 0, 3) = std::numeric_limits<T>::quiet_NaN();  // not the first channel's
  logits.at(0, 0, 0, 5) = inf;
  logits.at(0, 1, 0, 7) = -inf;
  logits.at(0, 0, 0, 9) = logits.at(0, 1, 0, 9) = T(0.5);  // a tie for the largest
  logits.at(0, 0, 0, 11) = T(800);                         // e^-800 is 0 in double
  logits.at(1, s.c - 1, s.h - 1, s.w - 1) = T(-1000);      // the last pixel
  return logits;
}

// The threaded kernel on 1 and 2 threads and (where the CPU has it) its AVX-512 loop, 8 pixels a
// vector, against the reference's per-pixel loop: the gradient bit for bit, NaN and infinities
// included; the loss the same on every path (the same per-pixel values, added in the same
// chunks), and the reference's to double rounding (its one sequential sum) where it is finite.
template <typename T>
void expect_threaded_loss_matches(const Shape4& s) {
  std::vector<std::int32_t> labels;
  const Tensor<T> logits = loss_logits<T>(s, labels);
  const T scale = T(1) / static_cast<T>(labels.size());
  Tensor<T> want_d(s);
  const double want = reference::pixel_cross_entropy(logits, labels, scale, &want_d);
  ASSERT_TRUE(std::isnan(want)) << "a NaN logit makes the loss NaN";
  // Without the NaN and infinite pixels: a finite loss to compare.
  Tensor<T> finite = logits;
  for (T& v : finite.span())
    if (!std::isfinite(v)) v = T(1);
  Tensor<T> want_finite_d(s);
  const double want_finite = reference::pixel_cross_entropy(finite, labels, scale, &want_finite_d);
  std::unique_ptr<LossKernel<T>> k = make_cpu_loss<T>();
  const SimdLevel level = simd_level();
  std::vector<SimdLevel> levels{SimdLevel::baseline};
  if (simd_available(SimdLevel::avx512)) levels.push_back(SimdLevel::avx512);
  std::vector<double> got;
  for (SimdLevel l : levels)
    for (int threads : {1, 2}) {
      set_simd_level(l);
      Threads scope(threads);
      const std::string what =
          s.str() + ", " + to_string(l) + ", " + std::to_string(threads) + " threads";
      Tensor<T> d(s, T(7));
      EXPECT_TRUE(std::isnan(k->cross_entropy(logits, labels, scale, &d))) << what;
      EXPECT_EQ(mismatches(d, want_d), 0) << what;
      Tensor<T> fd(s, T(7));
      got.push_back(k->cross_entropy(finite, labels, scale, &fd));
      EXPECT_EQ(mismatches(fd, want_finite_d), 0) << what;
      EXPECT_NEAR(got.back(), want_finite, 1e-12 * std::abs(want_finite)) << what;
      // Without a gradient, the same loss.
      EXPECT_EQ(k->cross_entropy(finite, labels, scale, nullptr), got.back()) << what;
      EXPECT_EQ(got.back(), got.front()) << what << ": the loss differs between the paths";
    }
  set_simd_level(level);
  labels[17] = static_cast<std::int32_t>(s.c);
  EXPECT_THROW(k->cross_entropy(logits, labels, scale, nullptr), Error);
  labels[17] = -1;
  EXPECT_THROW(k->cross_entropy(logits, labels, scale, nullptr), Error);
}

TEST(CpuLoss, ThreadedCrossEntropyMatchesTheReference) {
  // More pixels than one chunk, over two samples (a chunk and a vector of 8 pixels straddle
  // them: 129 x 131 is odd), the classes' exps kept (up to 8) or taken again (10).
  for (const Shape4& s : {Shape4{2, 3, 129, 131}, Shape4{2, 2, 129, 131}, Shape4{2, 10, 37, 29},
                          Shape4{2, 2, 3, 13}}) {
    expect_threaded_loss_matches<float>(s);
    expect_threaded_loss_matches<double>(s);
  }
}

TEST(CpuBatchNorm, AppliesTheFollowingReluAsItWrites) {
  const std::unique_ptr<BatchNormKernel<float>> k = make_cpu_batch_norm<float>();
  const std::vector<double> mean{0.1, -0.2, 0.0, 0.3}, invstd{1.5, 0.5, 2.0, 1.0};
  std::vector<double> mean16(16), invstd16(16);
  for (std::size_t c = 0; c < 16; ++c) {
    mean16[c] = mean[c % 4];
    invstd16[c] = invstd[c % 4];
  }
  EXPECT_FALSE(k->applies({.kind = ActivationKind::sigmoid}));
  for (Layout layout : {Layout::nchw, Layout::nchw16c})
    for (const FusedActivation f :
         {FusedActivation{.kind = ActivationKind::relu},
          FusedActivation{.kind = ActivationKind::leaky_relu, .slope = 0.2}}) {
      const std::int64_t c = layout == Layout::nchw ? 4 : 16;
      const Shape4 s{2, c, 5, 7};
      const std::vector<float> weight(std::size_t(c), 0.5f), bias(std::size_t(c), -0.1f);
      Tensor<float> x = to_layout(test::random_tensor<float>(s, kSeed, 3), layout);
      x.data()[5] = std::numeric_limits<float>::quiet_NaN();
      const reference::BatchNormStats stats{layout == Layout::nchw ? mean : mean16,
                                            layout == Layout::nchw ? invstd : invstd16};
      ASSERT_TRUE(k->applies(f));
      Tensor<float> fused(s, layout, uninitialized), normalised(s, layout, uninitialized),
          apart(s, layout, uninitialized);
      k->forward_activated(x, layout, stats, weight, bias, f, fused);
      k->forward(x, layout, stats, weight, bias, normalised);
      const std::unique_ptr<ActivationKernel<float>> activation =
          make_cpu_activation<float>(f.kind, f.slope);
      activation->forward(normalised, apart);
      const auto mismatched = [](const Tensor<float>& a, const Tensor<float>& b) {
        std::int64_t wrong = 0;
        for (std::size_t i = 0; i < a.span().size(); ++i)
          wrong += std::memcmp(&a.span()[i], &b.span()[i], sizeof(float)) != 0;
        return wrong;
      };
      const std::string what =
          std::string(to_string(layout)) + ", slope " + std::to_string(f.slope);
      EXPECT_EQ(mismatched(fused, apart), 0) << what;
      // Backward with f' (the activation has no consumer to apply it): the batch norm's passes on
      // dy, bit for bit the activation's backward and then the batch norm's.
      const Tensor<float> dy = to_layout(test::random_tensor<float>(s, kSeed + 1, 2), layout);
      Tensor<float> dz(s, layout, uninitialized);
      activation->backward(dy, dz);
      const std::size_t n = std::size_t(c);
      std::vector<double> sums(2 * n), fused_sums(2 * n);
      k->backward_sums(x, dz, layout, stats, std::span(sums).first(n), std::span(sums).last(n));
      const ForwardActivation<float> a{.weight = weight, .bias = bias, .f = f};
      k->backward_sums_activated(x, dy, layout, stats, a, std::span(fused_sums).first(n),
                                 std::span(fused_sums).last(n));
      EXPECT_EQ(std::memcmp(sums.data(), fused_sums.data(), sums.size() * sizeof(double)), 0)
          << what;
      EXPECT_FALSE(std::isnan(sums[1])) << what << ": f' of a NaN is that of its output";
      const std::vector<double> mean_dy(n, 0.25), mean_dy_xhat(n, -0.5);
      Tensor<float> dx(s, layout, uninitialized), fused_dx(s, layout, uninitialized);
      k->backward_data(x, dz, layout, stats, weight, mean_dy, mean_dy_xhat, dx);
      k->backward_data_activated(x, dy, layout, stats, a, mean_dy, mean_dy_xhat, fused_dx);
      EXPECT_EQ(mismatched(dx, fused_dx), 0) << what;
      // Not just dy: f' zeroes (ReLU) or scales (leaky) some of it.
      Tensor<float> plain_dx(s, layout, uninitialized);
      k->backward_data(x, dy, layout, stats, weight, mean_dy, mean_dy_xhat, plain_dx);
      EXPECT_GT(mismatched(plain_dx, fused_dx), 0) << what;
    }
}

}  // namespace
}  // namespace tessera
