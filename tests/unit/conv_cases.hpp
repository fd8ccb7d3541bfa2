// Convolution cases for the kernel tests (tests/unit/test_onednn_conv.cpp,
// tests/unit/test_narrow_conv.cpp, tests/unit/test_amx_conv.cpp): a sweep of shapes and geometries,
// and the checks of a kernel's three passes and of its box kernels against the float64 reference.
// Single process.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/kernels/conv_kernel.hpp"
#include "tessera/kernels/narrow_conv.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/tensor.hpp"

#include "../common/test_helpers.hpp"

namespace tessera::conv_cases {

using reference::ConvGeometry;
using test::rel_error;

constexpr std::uint64_t kSeed = 20240923;
constexpr double kTolerance = 1e-4;  // float32, relative to the largest reference value

inline Tensor<float> random_tensor(Shape4 s, std::uint64_t stream) {
  return test::random_tensor<float>(s, kSeed, stream);
}

inline Tensor<double> to_double(const Tensor<float>& t) {
  Tensor<double> out(t.shape());
  for (std::int64_t k = 0; k < t.numel(); ++k)
    out.data()[k] = t.data()[k];
  return out;
}

// bfloat16 rounding (to nearest, ties to even) of a finite float, as the kernels' conversions
// (vcvtneps2bf16); and of every value of a tensor.
inline double bf16(float v) {
  const auto bits = std::bit_cast<std::uint32_t>(v);
  const std::uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  return std::bit_cast<float>(rounded);
}

inline Tensor<double> rounded(const Tensor<float>& t) {
  Tensor<double> out(t.shape());
  for (std::int64_t k = 0; k < t.numel(); ++k)
    out.data()[k] = bf16(t.data()[k]);
  return out;
}

struct Case {
  std::int64_t n, c, o, groups, kernel, stride, dilation, pad;
  std::int64_t out_h, out_w;
  std::int64_t trailing;  // unread input rows and columns past the last window, < stride
  bool bias;
  // The padding after the last input row and column where it differs from `pad` (before the
  // first): "same" padding of an even span pads one more after. kSymmetric: `pad`.
  static constexpr std::int64_t kSymmetric = -1000;
  std::int64_t pad_after = kSymmetric;

  std::int64_t after() const { return pad_after == kSymmetric ? pad : pad_after; }
  Shape4 x() const {
    const std::int64_t span = dilation * (kernel - 1) + 1;
    return {n, c, (out_h - 1) * stride + span - pad - after() + trailing,
            (out_w - 1) * stride + span - pad - after() + trailing};
  }
  Shape4 w() const { return {o, c / groups, kernel, kernel}; }
  Shape4 y() const { return {n, o, out_h, out_w}; }
  ConvGeometry geometry() const {
    return {.stride_h = stride,
            .stride_w = stride,
            .dilation_h = dilation,
            .dilation_w = dilation,
            .pad_top = pad,
            .pad_left = pad,
            .groups = groups};
  }
  ConvShapes shapes() const { return {.x = x(), .w = w(), .y = y(), .bias = bias}; }
  std::string str() const {
    return "n" + std::to_string(n) + " c" + std::to_string(c) + " o" + std::to_string(o) + " g" +
           std::to_string(groups) + " k" + std::to_string(kernel) + " s" + std::to_string(stride) +
           " d" + std::to_string(dilation) + " p" + std::to_string(pad) +
           (after() != pad ? "/" + std::to_string(after()) : "") + " x" + x().str() +
           (bias ? " bias" : "");
  }
};

// Kernels 1/2/3/5 x strides 1/2/3 x dilations 1/2 x groups 1/2/depthwise; the other sizes cycle
// so that every combination sees a different one.
inline std::vector<Case> sweep() {
  const std::int64_t plain[] = {3, 5, 8, 16, 32}, plain_out[] = {4, 7, 16, 32, 3};
  const std::int64_t paired[] = {4, 6, 16, 32}, paired_out[] = {2, 6, 32, 8};
  const std::int64_t depthwise[] = {3, 8, 16, 32};
  std::vector<Case> cases;
  std::int64_t i = 0;
  for (std::int64_t kernel : {1, 2, 3, 5})
    for (std::int64_t stride : {1, 2, 3})
      for (std::int64_t dilation : {1, 2})
        for (int kind = 0; kind < 3; ++kind, ++i) {
          Case c{};
          c.n = 1 + i % 3;
          if (kind == 0) {
            c.c = plain[i % 5], c.o = plain_out[(i / 5) % 5], c.groups = 1;
          } else if (kind == 1) {
            c.c = paired[i % 4], c.o = paired_out[(i / 4) % 4], c.groups = 2;
          } else {
            c.c = depthwise[i % 4], c.o = c.c * (1 + i % 2), c.groups = c.c;
          }
          c.kernel = kernel, c.stride = stride, c.dilation = dilation;
          // Most layers see a window with the padding materialised; some pad inside the kernel.
          c.pad = (i % 4 == 3 && kernel > 1) ? 1 : 0;
          c.out_h = 3 + 2 * (i % 4);
          c.out_w = 5 + 2 * (i % 3);
          c.trailing = i % stride;
          c.bias = i % 5 != 2;
          cases.push_back(c);
        }
  return cases;
}

// Runs `kernel` on the case's seeded data and compares forward, backward-data and
// backward-weights (which must add into what dw and dbias held) with the float64 reference, within
// `tolerance` of the largest reference value (float32's by default).
inline void expect_matches_reference(ConvKernel<float>& kernel, const Case& c,
                                     Layout x_layout = Layout::nchw,
                                     double tolerance = kTolerance) {
  const ConvGeometry g = c.geometry();
  const Tensor<float> x_plain = random_tensor(c.x(), 1), w = random_tensor(c.w(), 2);
  const Tensor<float> x = to_layout(x_plain, x_layout);
  const Tensor<float> dy = random_tensor(c.y(), 3);
  const Tensor<float> b = c.bias ? random_tensor({c.o, 1, 1, 1}, 4) : Tensor<float>();
  const Tensor<double> xd = to_double(x_plain), wd = to_double(w), dyd = to_double(dy);
  const Tensor<double> bd = to_double(b);

  Tensor<float> y(c.y(), 7.0f);
  kernel.forward(x, w, b.span(), y);
  Tensor<double> yd(c.y());
  reference::conv2d_forward(xd, wd, bd.span(), yd, g);
  EXPECT_LE(rel_error(y.span(), yd.span()), tolerance) << "forward, " << c.str();

  Tensor<float> dx_in(c.x(), x_layout, 7.0f);
  kernel.backward_data(dy, w, dx_in);
  Tensor<double> dxd(c.x());
  reference::conv2d_backward_data(dyd, wd, dxd, g);
  const Tensor<float> dx = to_layout(dx_in, Layout::nchw);
  EXPECT_LE(rel_error(dx.span(), dxd.span()), tolerance) << "backward-data, " << c.str();

  Tensor<float> dw = random_tensor(c.w(), 5);
  Tensor<double> dwd = to_double(dw);
  Tensor<float> db = c.bias ? random_tensor({c.o, 1, 1, 1}, 6) : Tensor<float>();
  Tensor<double> dbd = to_double(db);
  kernel.backward_filter(x, dy, dw, db.span());
  reference::conv2d_backward_filter(xd, dyd, dwd, dbd.span(), g);
  EXPECT_LE(rel_error(dw.span(), dwd.span()), tolerance) << "backward-weights, " << c.str();
  EXPECT_LE(rel_error(db.span(), dbd.span()), tolerance) << "backward-bias, " << c.str();
}

// A box kernel reads its input from a box of a larger tensor and writes its output into a box of
// another, leaving the rest untouched; the box's values equal the whole-tensor reference's.
inline void expect_box_kernel_matches(
    const Case& c, const std::function<std::unique_ptr<ConvKernel<float>>(const ConvShapes&)>& make,
    double tolerance = kTolerance) {
  const ConvGeometry g = c.geometry();
  const Tensor<float> x = random_tensor(c.x(), 1), w = random_tensor(c.w(), 2);
  const Tensor<float> b = c.bias ? random_tensor({c.o, 1, 1, 1}, 4) : Tensor<float>();
  // x and y sit at offsets (2, 3) and (1, 4) of tensors 5 rows and 7 columns larger.
  const BoxAt x_at{2, 3}, y_at{1, 4};
  const Shape4 xs = c.x(), ys = c.y();
  Tensor<float> x_outer = random_tensor({xs.n, xs.c, xs.h + 5, xs.w + 7}, 8);
  copy_box_in(x, x_outer, x_at);
  Tensor<float> y_outer({ys.n, ys.c, ys.h + 5, ys.w + 7}, -3.0f);
  ConvShapes shapes = c.shapes();
  shapes.x_outer = x_outer.shape();
  shapes.y_outer = y_outer.shape();
  std::unique_ptr<ConvKernel<float>> k = make(shapes);
  if (!k) return;  // declined
  k->forward_box(x_outer, x_at, w, b.span(), y_outer, y_at);

  Tensor<double> yd(ys);
  const Tensor<double> bd = to_double(b);
  reference::conv2d_forward(to_double(x), to_double(w), bd.span(), yd, g);
  Tensor<float> y(ys);
  copy_box_out(y_outer, y_at, y);
  EXPECT_LE(rel_error(y.span(), yd.span()), tolerance) << k->name() << " box, " << c.str();
  // Outside the box nothing changed.
  Tensor<float> blank(ys, -3.0f);
  copy_box_in(blank, y_outer, y_at);
  for (float v : y_outer.span())
    ASSERT_EQ(v, -3.0f) << k->name() << " wrote outside its box, " << c.str();
}

// The narrow kernels (set_conv_narrow) on or off for a scope; as before after it.
struct NarrowSwitch {
  const bool before = conv_narrow();
  explicit NarrowSwitch(bool on) { set_conv_narrow(on); }
  ~NarrowSwitch() { set_conv_narrow(before); }
  NarrowSwitch(const NarrowSwitch&) = delete;
  NarrowSwitch& operator=(const NarrowSwitch&) = delete;
};

}  // namespace tessera::conv_cases
