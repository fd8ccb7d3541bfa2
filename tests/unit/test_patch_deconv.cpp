// The 2x2 stride-2 transposed convolution kernel (kernels/patch_deconv.hpp) against its definition
// in double: forward with and without a bias, the filter and bias gradients added into what they
// hold, over channel counts of one to 32 blocks, batches, outputs that start inside a patch
// (pad_top, pad_left 1) and end inside one (odd sizes), rows around its 8-pixel blocks, an
// output large enough for streaming stores; the same bits on every run and thread count; the
// cases it declines. (OneDnnConv.TransposedConvLayersGiveTheReferenceResults checks that
// ConvTranspose2d runs it where it fits.) Skipped where the loops do not run at AVX-512.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/patch_deconv.hpp"
#include "tessera/kernels/simd.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

#define REQUIRE_AVX512()                 \
  if (simd_level() != SimdLevel::avx512) \
  GTEST_SKIP() << "the loops do not run at AVX-512 here: the patch kernel declines"

struct PatchCase {
  std::int64_t n, c, o, out_h, out_w, pad_top, pad_left;
  std::string str() const {
    return std::to_string(n) + "x" + std::to_string(c) + " -> " + std::to_string(o) + " at " +
           std::to_string(out_h) + "x" + std::to_string(out_w) + ", pad " +
           std::to_string(pad_top) + "," + std::to_string(pad_left);
  }
  // The window: the inputs of the outputs, exactly.
  PatchDeconvShapes shapes() const {
    return {.x = {n, c, (out_h - 1 + pad_top) / 2 + 1, (out_w - 1 + pad_left) / 2 + 1},
            .w = {c, o, 2, 2},
            .y = {n, o, out_h, out_w},
            .pad_top = pad_top,
            .pad_left = pad_left};
  }
};

std::vector<PatchCase> cases() {
  std::vector<PatchCase> all;
  for (const std::int64_t width : {1, 2, 3, 15, 16, 17, 18, 33, 40})
    for (const std::int64_t pad : {0, 1})
      all.push_back(
          {.n = 1, .c = 32, .o = 16, .out_h = 5, .out_w = width, .pad_top = pad, .pad_left = pad});
  all.push_back({.n = 2, .c = 16, .o = 32, .out_h = 7, .out_w = 9, .pad_top = 1, .pad_left = 0});
  all.push_back({.n = 3, .c = 48, .o = 16, .out_h = 6, .out_w = 20, .pad_top = 0, .pad_left = 1});
  // 4 MiB of filter sums a band: 7 bands of 6 rows (the bands' memory is capped).
  all.push_back({.n = 1, .c = 512, .o = 256, .out_h = 80, .out_w = 3, .pad_top = 1, .pad_left = 0});
  // 9.4 MiB of output: written with streaming stores.
  all.push_back(
      {.n = 1, .c = 16, .o = 16, .out_h = 512, .out_w = 301, .pad_top = 0, .pad_left = 1});
  return all;
}

// Tensors in nchw16c from NCHW values (test::random_tensor draws NCHW).
Tensor<float> blocked(const Tensor<float>& t) {
  return to_layout(t, Layout::nchw16c);
}

TEST(PatchDeconv, MatchesItsDefinition) {
  REQUIRE_AVX512();
  for (const PatchCase& pc : cases()) {
    SCOPED_TRACE(pc.str());
    const PatchDeconvShapes s = pc.shapes();
    auto k = make_patch_deconv(s);
    ASSERT_TRUE(k);
    EXPECT_EQ(k->name(), "tessera patch avx512");
    const Tensor<float> x = test::random_tensor<float>(s.x, 41, 1);
    const Tensor<float> w = test::random_tensor<float>(s.w, 41, 2);
    const Tensor<float> bias = test::random_tensor<float>({s.y.c, 1, 1, 1}, 41, 3);
    const Tensor<float> dy = test::random_tensor<float>(s.y, 41, 4);
    // The definition, in double: output (r, c) reads window pixel ((r + pt) / 2, (c + pl) / 2)
    // through tap ((r + pt) % 2, (c + pl) % 2).
    std::vector<double> y(static_cast<std::size_t>(s.y.numel()));
    std::vector<double> dw(static_cast<std::size_t>(s.w.numel()), 0.0), db(s.y.c, 0.0);
    double scale = 0, dscale = 0;
    for (std::int64_t n = 0; n < s.y.n; ++n)
      for (std::int64_t o = 0; o < s.y.c; ++o)
        for (std::int64_t r = 0; r < s.y.h; ++r)
          for (std::int64_t c = 0; c < s.y.w; ++c) {
            const std::int64_t l = (r + s.pad_top) / 2, a = (r + s.pad_top) % 2;
            const std::int64_t j = (c + s.pad_left) / 2, b = (c + s.pad_left) % 2;
            double sum = bias.data()[o];
            const double g = dy.at(n, o, r, c);
            db[static_cast<std::size_t>(o)] += g;
            for (std::int64_t ci = 0; ci < s.x.c; ++ci) {
              const double wv = w.at(ci, o, a, b), xv = x.at(n, ci, l, j);
              sum += xv * wv;
              dw[static_cast<std::size_t>(w.offset(ci, o, a, b))] += xv * g;
            }
            y[static_cast<std::size_t>(((n * s.y.c + o) * s.y.h + r) * s.y.w + c)] = sum;
            scale = std::max(scale, std::abs(sum));
          }
    for (const double v : dw)
      dscale = std::max(dscale, std::abs(v));
    const Tensor<float> xb = blocked(x);
    for (const bool with_bias : {true, false}) {
      Tensor<float> yb(s.y, Layout::nchw16c, std::nanf(""));
      k->forward(xb, w, with_bias ? std::as_const(bias).span() : std::span<const float>(), yb);
      const Tensor<float> got = to_layout(yb, Layout::nchw);
      double err = 0;
      for (std::int64_t n = 0; n < s.y.n; ++n)
        for (std::int64_t o = 0; o < s.y.c; ++o)
          for (std::int64_t r = 0; r < s.y.h; ++r)
            for (std::int64_t c = 0; c < s.y.w; ++c) {
              const double want =
                  y[static_cast<std::size_t>(((n * s.y.c + o) * s.y.h + r) * s.y.w + c)] -
                  (with_bias ? 0.0 : double(bias.data()[o]));
              err = std::max(err, std::abs(got.at(n, o, r, c) - want));
            }
      EXPECT_LE(err, 1e-5 * std::max(scale, 1.0)) << (with_bias ? "with bias" : "without");
    }
    // The gradients add into what dw and dbias hold.
    Tensor<float> gw(s.w, Layout::nchw, 0.5f);
    std::vector<float> gb(static_cast<std::size_t>(s.y.c), -0.25f);
    k->backward_filter(xb, blocked(dy), gw, gb);
    double werr = 0, berr = 0;
    for (std::size_t i = 0; i < dw.size(); ++i)
      werr = std::max(werr, std::abs(gw.data()[i] - 0.5 - dw[i]));
    for (std::size_t o = 0; o < db.size(); ++o)
      berr = std::max(berr, std::abs(gb[o] + 0.25 - db[o]));
    EXPECT_LE(werr, 1e-5 * std::max(dscale, 1.0));
    EXPECT_LE(berr, 1e-5 * std::max(s.y.numel() / double(s.y.c), 1.0));
    // Without a bias gradient: dw alone, the same values.
    Tensor<float> gw2(s.w, Layout::nchw, 0.5f);
    k->backward_filter(xb, blocked(dy), gw2, {});
    EXPECT_TRUE(std::equal(gw.span().begin(), gw.span().end(), gw2.span().begin()));
  }
}

// Bands of rows fixed by the shape, summed in order: the same bits on every run and on any number
// of threads, as the filter gradients of the narrow kernels.
TEST(PatchDeconv, FilterGradientsAreTheSameOnEveryRunAndThreadCount) {
  REQUIRE_AVX512();
  const KernelThreads before = kernel_threads();
  const PatchCase pc{
      .n = 2, .c = 32, .o = 16, .out_h = 301, .out_w = 70, .pad_top = 1, .pad_left = 1};
  const PatchDeconvShapes s = pc.shapes();
  auto k = make_patch_deconv(s);
  ASSERT_TRUE(k);
  const Tensor<float> x = blocked(test::random_tensor<float>(s.x, 43, 1));
  const Tensor<float> dy = blocked(test::random_tensor<float>(s.y, 43, 2));
  std::vector<std::vector<float>> results;
  for (const int threads : {1, 2, 3, 2}) {
    set_kernel_threads({threads, "test"});
    Tensor<float> gw(s.w, Layout::nchw, 0.0f);
    std::vector<float> gb(static_cast<std::size_t>(s.y.c), 0.0f);
    k->backward_filter(x, dy, gw, gb);
    std::vector<float> all(gw.span().begin(), gw.span().end());
    all.insert(all.end(), gb.begin(), gb.end());
    results.push_back(all);
  }
  set_kernel_threads(before);
  for (std::size_t r = 1; r < results.size(); ++r)
    EXPECT_EQ(results[r], results[0]) << "run " << r;
}

TEST(PatchDeconv, DeclinesWhatItDoesNotTake) {
  REQUIRE_AVX512();
  const PatchDeconvShapes base = PatchCase{1, 32, 16, 8, 8, 0, 0}.shapes();
  ASSERT_TRUE(patch_deconv_fits(base));
  auto with = [&](auto change) {
    PatchDeconvShapes s = base;
    change(s);
    return s;
  };
  const std::vector<std::pair<std::string, PatchDeconvShapes>> declined = {
      {"8 input channels", with([](auto& s) { s.x.c = s.w.n = 8; })},
      {"24 outputs", with([](auto& s) { s.y.c = s.w.c = 24; })},
      {"3x3 weights", with([](auto& s) { s.w.h = s.w.w = 3; })},
      {"pad_top 2", with([](auto& s) { s.pad_top = 2; })},
      {"pad_left -1", with([](auto& s) { s.pad_left = -1; })},
      {"a window a row short", with([](auto& s) { s.x.h -= 1; })},
      {"a window a column short", with([](auto& s) { s.x.w -= 1; })},
      {"other samples", with([](auto& s) { s.y.n = 2; })},
      {"weights of other channels", with([](auto& s) { s.w.n = 16; })},
  };
  for (const auto& [what, s] : declined) {
    EXPECT_FALSE(patch_deconv_fits(s)) << what;
    EXPECT_EQ(make_patch_deconv(s), nullptr) << what;
  }
  // The baseline instruction set: declined (the adjoint conv runs).
  const SimdLevel level = simd_level();
  set_simd_level(SimdLevel::baseline);
  EXPECT_FALSE(patch_deconv_fits(base));
  set_simd_level(level);
}

}  // namespace
}  // namespace tessera
