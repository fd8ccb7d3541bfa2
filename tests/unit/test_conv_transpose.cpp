// Transposed convolution on one rank: its window map, the reference kernel and the layer against
// the definition (scatter each input through each tap to q = i*stride - padding + j), the
// adjoint of conv2d, central finite differences, and the field errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/kernels/reference_conv_transpose.hpp"
#include "tessera/layers/conv_transpose2d.hpp"
#include "tessera/random.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

using test::dot;
using test::expect_mentions;
using test::max_abs;
using test::rel_error;

using reference::ConvGeometry;

constexpr std::uint64_t kSeed = 20240612;

// Values already rounded to float, so float and double runs see the same data.
template <typename T>
Tensor<T> random_tensor(Shape4 s, std::uint64_t stream) {
  return test::random_tensor<T>(s, kSeed, stream);
}

// The transposed convolution from its definition, in double: every input x[n, c, i, i'] adds
// w[c, o, j, j'] * x into y[n, group(c) * O/groups + o, i*sh - pt + j*dh, i'*sw - pl + j'*dw],
// dropping positions outside y. `abs_sum` gets |bias| + the sum of |w * x| (the rounding scale).
template <typename T>
void naive_conv_transpose(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias,
                          const ConvGeometry& g, Shape4 ys, std::vector<double>& y,
                          std::vector<double>& abs_sum) {
  const Shape4 xs = x.shape(), ws = w.shape();
  y.assign(static_cast<std::size_t>(ys.numel()), 0.0);
  abs_sum.assign(y.size(), 0.0);
  auto index = [&](std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t v) {
    return static_cast<std::size_t>(((n * ys.c + c) * ys.h + h) * ys.w + v);
  };
  for (std::int64_t n = 0; n < ys.n; ++n)
    for (std::int64_t o = 0; o < ys.c; ++o)
      for (std::int64_t h = 0; h < ys.h; ++h)
        for (std::int64_t v = 0; v < ys.w; ++v) {
          const double b = bias.empty() ? 0.0 : double(bias[std::size_t(o)]);
          y[index(n, o, h, v)] = b;
          abs_sum[index(n, o, h, v)] = std::abs(b);
        }
  const std::int64_t in_per_group = xs.c / g.groups;
  for (std::int64_t n = 0; n < xs.n; ++n)
    for (std::int64_t c = 0; c < xs.c; ++c)
      for (std::int64_t i = 0; i < xs.h; ++i)
        for (std::int64_t i2 = 0; i2 < xs.w; ++i2)
          for (std::int64_t o = 0; o < ws.c; ++o)
            for (std::int64_t j = 0; j < ws.h; ++j)
              for (std::int64_t j2 = 0; j2 < ws.w; ++j2) {
                const std::int64_t q = i * g.stride_h - g.pad_top + j * g.dilation_h;
                const std::int64_t q2 = i2 * g.stride_w - g.pad_left + j2 * g.dilation_w;
                if (q < 0 || q >= ys.h || q2 < 0 || q2 >= ys.w) continue;
                const double term = double(w.at(c, o, j, j2)) * double(x.at(n, c, i, i2));
                const std::size_t at = index(n, (c / in_per_group) * ws.c + o, q, q2);
                y[at] += term;
                abs_sum[at] += std::abs(term);
              }
}

// ---------------------------------------------------------------------------------------------
// The window map.

TEST(ConvTransposeAxis, InputWindowIsExactlyTheInputsThatReachTheOutputs) {
  int checked = 0, empty = 0;
  for (std::int64_t k = 1; k <= 5; ++k)
    for (std::int64_t s = 1; s <= 3; ++s)
      for (std::int64_t p = 0; p <= 3; ++p)
        for (std::int64_t qb = -4; qb <= 12; ++qb)
          for (std::int64_t qe = qb; qe <= qb + 6; ++qe) {
            const ConvTransposeAxis a{.kernel = k, .stride = s, .padding = p};
            // Brute force over a range of inputs wide enough to hold every candidate.
            std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = lo, count = 0;
            for (std::int64_t i = -20; i <= 30; ++i) {
              bool reaches = false;
              for (std::int64_t j = 0; j < k; ++j) {
                const std::int64_t q = i * s - p + j;
                reaches = reaches || (qb <= q && q < qe);
              }
              if (!reaches) continue;
              if (count++ == 0) lo = i;
              hi = i + 1;
            }
            const Range r = a.input_window({qb, qe});
            const std::string what = "k " + std::to_string(k) + " s " + std::to_string(s) + " p " +
                                     std::to_string(p) + " out " + to_string(Range{qb, qe});
            ASSERT_GE(r.end, r.begin) << what;
            if (count == 0) {
              EXPECT_TRUE(r.empty()) << what << ": got " << to_string(r);
              ++empty;
            } else {
              // The reaching inputs are contiguous, so [lo, hi) is exactly them.
              EXPECT_EQ(hi - lo, count) << what;
              EXPECT_EQ(r, (Range{lo, hi})) << what;
            }
            ++checked;
          }
  EXPECT_GT(checked, 5000);
  EXPECT_GT(empty, 100);  // kernel < stride leaves outputs no input reaches
}

TEST(ConvTransposeAxis, OutputExtentIsPyTorchs) {
  // torch.nn.ConvTranspose2d(1, 1, k, stride=s, padding=p, output_padding=op)(ones(1, 1, n, n))
  struct Case {
    std::int64_t in, k, s, p, op, out;
  };
  for (const Case& c : {Case{5, 3, 2, 1, 1, 10}, Case{5, 3, 2, 1, 0, 9}, Case{7, 2, 2, 0, 0, 14},
                        Case{4, 4, 2, 1, 0, 8}, Case{1, 1, 1, 0, 0, 1}, Case{3, 5, 3, 2, 2, 9},
                        Case{9, 1, 3, 0, 2, 27}, Case{2, 1, 1, 1, 0, 0}}) {
    const ConvTransposeAxis a{.kernel = c.k, .stride = c.s, .padding = c.p, .output_padding = c.op};
    EXPECT_EQ(a.output_extent(c.in), c.out) << c.in << " " << c.k << " " << c.s << " " << c.p;
  }
}

// ---------------------------------------------------------------------------------------------
// The reference kernel.

struct KernelCase {
  std::int64_t n = 2, c = 4, o = 6, h = 5, w = 4, kh = 3, kw = 3;
  std::int64_t oh = 0, ow = 0;  // output extent (any: the kernel drops what falls outside)
  ConvGeometry g;

  Shape4 x_shape() const { return {n, c, h, w}; }
  Shape4 w_shape() const { return {c, o / g.groups, kh, kw}; }
  Shape4 y_shape() const { return {n, o, oh, ow}; }
  std::string str() const {
    std::ostringstream s;
    s << "x " << x_shape().str() << " w " << w_shape().str() << " y " << y_shape().str()
      << " groups " << g.groups << " stride " << g.stride_h << "x" << g.stride_w << " dilation "
      << g.dilation_h << "x" << g.dilation_w << " pad " << g.pad_top << "," << g.pad_left;
    return s.str();
  }
};

// Kernels 1..5 and non-square, strides 1..3, dilations 1..2, groups 1, 2 and depthwise, and
// paddings from -3 to 2: the distributed layer shifts the padding by its tile's origin, so
// negative ones are normal. Outputs from the formula, plus 0..2 rows and columns of output
// padding, plus some cropped ones.
std::vector<KernelCase> kernel_sweep() {
  struct P {
    std::int64_t h, w;
  };
  std::vector<KernelCase> out;
  for (P k : {P{1, 1}, P{2, 2}, P{3, 3}, P{4, 4}, P{5, 5}, P{3, 2}})
    for (P s : {P{1, 1}, P{2, 2}, P{3, 3}, P{2, 1}})
      for (P d : {P{1, 1}, P{2, 1}})
        for (std::int64_t pad = -3; pad <= 2; ++pad)
          for (std::int64_t groups : {1, 2, 4})
            for (std::int64_t extra : {0, 2, -3}) {
              KernelCase c;
              c.kh = k.h;
              c.kw = k.w;
              c.g = {.stride_h = s.h,
                     .stride_w = s.w,
                     .dilation_h = d.h,
                     .dilation_w = d.w,
                     .pad_top = pad,
                     .pad_left = 1 - pad,
                     .groups = groups};
              c.o = groups == 4 ? 8 : 6;
              c.oh = (c.h - 1) * s.h - 2 * pad + d.h * (k.h - 1) + 1 + extra;
              c.ow = (c.w - 1) * s.w - 2 * (1 - pad) + d.w * (k.w - 1) + 1 + (extra + 1) % 3;
              if (c.oh > 0 && c.ow > 0) out.push_back(c);
            }
  return out;
}

template <typename T>
void check_kernel_forward() {
  int checked = 0;
  for (const KernelCase& c : kernel_sweep()) {
    const Tensor<T> x = random_tensor<T>(c.x_shape(), 1);
    const Tensor<T> w = random_tensor<T>(c.w_shape(), 2);
    const Tensor<T> b = random_tensor<T>({c.o, 1, 1, 1}, 3);
    for (bool with_bias : {true, false}) {
      const std::span<const T> bias = with_bias ? b.span() : std::span<const T>();
      Tensor<T> y(c.y_shape(), std::numeric_limits<T>::quiet_NaN());  // must be overwritten
      reference::conv_transpose2d_forward(x, w, bias, y, c.g);
      std::vector<double> ref, mag;
      naive_conv_transpose(x, w, bias, c.g, c.y_shape(), ref, mag);
      const double terms = double(1 + c.c * c.kh * c.kw);
      const double eps = std::numeric_limits<T>::epsilon();
      for (std::size_t k = 0; k < ref.size(); ++k)
        ASSERT_NEAR(double(y.data()[k]), ref[k], 2 * terms * eps * mag[k] + 1e-300)
            << c.str() << " bias " << with_bias << " at " << k;
      ++checked;
    }
  }
  EXPECT_GT(checked, 2000);
}

TEST(ReferenceConvTranspose, ForwardMatchesTheDefinitionDouble) {
  check_kernel_forward<double>();
}
TEST(ReferenceConvTranspose, ForwardMatchesTheDefinitionFloat) {
  check_kernel_forward<float>();
}

// <convT(x), r> == <x, convT^T(r)> and the filter gradient of <convT(x), r> is the same as the
// one the definition gives (x scattered times r, summed).
TEST(ReferenceConvTranspose, BackwardKernelsAreTheAdjointsOfForward) {
  int checked = 0;
  for (const KernelCase& c : kernel_sweep()) {
    const Tensor<double> x = random_tensor<double>(c.x_shape(), 11);
    const Tensor<double> w = random_tensor<double>(c.w_shape(), 12);
    const Tensor<double> r = random_tensor<double>(c.y_shape(), 13);
    Tensor<double> y(c.y_shape());
    reference::conv_transpose2d_forward<double>(x, w, {}, y, c.g);
    Tensor<double> dx(c.x_shape(), std::numeric_limits<double>::quiet_NaN());
    reference::conv_transpose2d_backward_data(r, w, dx, c.g);
    const double lhs = dot(y.span(), r.span());
    const double rhs = dot(x.span(), dx.span());
    ASSERT_NEAR(lhs, rhs, 1e-12 * (1 + std::abs(lhs))) << c.str();

    // dL/dw[c, o, j, j'] = sum of x * r over the pairs the definition links through that tap:
    // L is linear in w, so <dw, w> == L.
    Tensor<double> dw(c.w_shape());
    Tensor<double> db({c.o, 1, 1, 1});
    reference::conv_transpose2d_backward_filter<double>(x, r, dw, db.span(), c.g);
    ASSERT_NEAR(dot(dw.span(), w.span()), lhs, 1e-12 * (1 + std::abs(lhs))) << c.str();
    // ... and dL/dbias is the sum of r per channel.
    for (std::int64_t o = 0; o < c.o; ++o) {
      double sum = 0;
      for (std::int64_t n = 0; n < c.n; ++n)
        for (std::int64_t h = 0; h < c.oh; ++h)
          for (std::int64_t v = 0; v < c.ow; ++v)
            sum += r.at(n, o, h, v);
      ASSERT_NEAR(db.at(o, 0, 0, 0), sum, 1e-12 * (1 + std::abs(sum))) << c.str();
    }
    ++checked;
  }
  EXPECT_GT(checked, 1000);
}

TEST(ReferenceConvTranspose, ShapeMismatchesThrow) {
  const Tensor<double> x({2, 4, 5, 5}), w({4, 3, 3, 3});
  Tensor<double> y({2, 3, 7, 7}), dx({2, 4, 5, 5}), dw({4, 3, 3, 3});
  std::vector<double> bias(3, 0.0), db(3, 0.0);
  reference::conv_transpose2d_forward<double>(x, w, bias, y, {});  // consistent
  reference::conv_transpose2d_backward_data(y, w, dx, {});
  reference::conv_transpose2d_backward_filter<double>(x, y, dw, db, {});
  auto expect_error = [](auto&& fn, const std::string& what) {
    try {
      fn();
      ADD_FAILURE() << "no tessera::Error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("conv_transpose2d"), std::string::npos) << e.what();
    }
  };
  const Tensor<double> w_in({3, 3, 3, 3});  // weight dim 0 is the input channels
  Tensor<double> y_out({2, 4, 7, 7});       // output channels != weight dim 1
  std::vector<double> short_bias(2, 0.0);
  expect_error([&] { reference::conv_transpose2d_forward<double>(x, w_in, {}, y, {}); }, "w in");
  expect_error([&] { reference::conv_transpose2d_forward<double>(x, w, {}, y_out, {}); }, "y c");
  expect_error([&] { reference::conv_transpose2d_forward<double>(x, w, short_bias, y, {}); },
               "bias");
  expect_error([&] { reference::conv_transpose2d_backward_data(y_out, w, dx, {}); }, "dy c");
  expect_error(
      [&] { reference::conv_transpose2d_backward_filter<double>(x, y, dw, short_bias, {}); },
      "dbias");
}

// ---------------------------------------------------------------------------------------------
// The layer on one rank: setup, bind (window with its shifted padding), forward, backward.

struct LayerCase {
  Pair kernel, stride, padding, output_padding;
  std::int64_t h, w;
  bool bias = true;

  std::string json() const {
    auto pair = [](const Pair& p) {
      return "[" + std::to_string(p[0]) + ", " + std::to_string(p[1]) + "]";
    };
    return R"({"name": "t", "type": "conv_transpose2d", "out_channels": 2, "kernel": )" +
           pair(kernel) + ", \"stride\": " + pair(stride) + ", \"padding\": " + pair(padding) +
           ", \"output_padding\": " + pair(output_padding) +
           ", \"bias\": " + (bias ? "true" : "false") + "}";
  }
  ConvTranspose2dSpec spec() const {
    const ModelSpec m =
        parse_model(R"({"name": "m", "input_channels": 3, "layers": [)" + json() + "]}");
    return parse_conv_transpose2d(m.layers.at(0));
  }
  std::int64_t out_h() const { return spec().axis(0).output_extent(h); }
  std::int64_t out_w() const { return spec().axis(1).output_extent(w); }
};

// Kernels 1..5 and non-square; strides 1..3 and mixed; paddings 0..2 and mixed; every output
// padding below the stride; odd images. Impossible shapes (empty outputs) are left out.
std::vector<LayerCase> layer_sweep() {
  std::vector<LayerCase> out;
  for (Pair k : {Pair{1, 1}, Pair{2, 2}, Pair{3, 3}, Pair{4, 4}, Pair{5, 5}, Pair{3, 2}})
    for (Pair s : {Pair{1, 1}, Pair{2, 2}, Pair{3, 3}, Pair{2, 1}})
      for (Pair p : {Pair{0, 0}, Pair{1, 1}, Pair{2, 2}, Pair{2, 0}})
        for (std::int64_t op = 0; op < std::max(s[0], s[1]); ++op)
          for (auto [h, w] : {std::pair{7, 9}, std::pair{2, 3}}) {
            LayerCase c{k, s, p, {std::min(op, s[0] - 1), std::min(op, s[1] - 1)}, h, w, h == 7};
            if (c.out_h() > 0 && c.out_w() > 0) out.push_back(c);
          }
  return out;
}

// One layer on a 1x1x1 grid with seeded parameters.
struct SingleRankLayer {
  ConvTranspose2d<double> layer;
  Distribution in;

  SingleRankLayer(const LayerCase& c, std::int64_t batch)
      : layer("t", c.spec(), 1), in{{batch, 3, c.h, c.w}, GridShape{1, 1, 1}, GridCoords{}} {
    layer.setup(in);
    layer.bind(test::single_runtime());
    std::uint64_t stream = 100;
    for (Param<double>* p : layer.params())
      p->value = random_tensor<double>(p->value.shape(), ++stream);
  }
  Tensor<double>& weight() { return layer.params()[0]->value; }
  std::span<const double> bias() {
    auto ps = layer.params();
    return ps.size() > 1 ? std::span<const double>(ps[1]->value.span()) : std::span<const double>();
  }
  DistTensor<double> forward(const Tensor<double>& x) {
    DistTensor<double> xt(in);
    xt.local = x;
    return layer.forward(xt, RunState{});
  }
};

TEST(ConvTranspose2dLayer, ForwardMatchesTheDefinition) {
  int checked = 0;
  for (const LayerCase& c : layer_sweep()) {
    SingleRankLayer l(c, 2);
    const Tensor<double> x = random_tensor<double>({2, 3, c.h, c.w}, 1);
    const DistTensor<double> y = l.forward(x);
    const Shape4 ys{2, 2, c.out_h(), c.out_w()};
    ASSERT_EQ(y.local.shape(), ys) << c.json();
    std::vector<double> ref, mag;
    naive_conv_transpose<double>(x, l.weight(), l.bias(),
                                 {.stride_h = c.stride[0],
                                  .stride_w = c.stride[1],
                                  .pad_top = c.padding[0],
                                  .pad_left = c.padding[1]},
                                 ys, ref, mag);
    const double terms = double(1 + 3 * c.kernel[0] * c.kernel[1]);
    for (std::size_t k = 0; k < ref.size(); ++k)
      ASSERT_NEAR(y.local.data()[k], ref[k],
                  2 * terms * std::numeric_limits<double>::epsilon() * mag[k] + 1e-300)
          << c.json() << " at " << k;
    ++checked;
  }
  EXPECT_GT(checked, 300);
}

// <convT(x), y> == <x, conv(y)>: conv2d with the same stride and padding, its weight [O, I, k, k]
// being our [in, out, k, k] as it is.
TEST(ConvTranspose2dLayer, IsTheAdjointOfConv2d) {
  int checked = 0;
  for (LayerCase c : layer_sweep()) {
    c.bias = false;
    SingleRankLayer l(c, 2);
    const Tensor<double> x = random_tensor<double>({2, 3, c.h, c.w}, 21);
    const Tensor<double> y = random_tensor<double>({2, 2, c.out_h(), c.out_w()}, 22);
    const DistTensor<double> tx = l.forward(x);
    // The conv of the output extent gives back the input extent: output_padding < stride only
    // adds rows the last window does not reach.
    Tensor<double> cy({2, 3, c.h, c.w});
    reference::conv2d_forward<double>(y, l.weight(), {}, cy,
                                      {.stride_h = c.stride[0],
                                       .stride_w = c.stride[1],
                                       .pad_top = c.padding[0],
                                       .pad_left = c.padding[1]});
    const double lhs = dot(tx.local.span(), y.span());
    const double rhs = dot(x.span(), cy.span());
    ASSERT_NEAR(lhs, rhs, 1e-12 * (1 + std::abs(lhs))) << c.json();
    ++checked;
  }
  EXPECT_GT(checked, 300);
}

// L = <convT(x; w, b), r>, linear in each of x, w and b: central differences are exact up to
// rounding.
TEST(ConvTranspose2dLayer, BackwardMatchesCentralFiniteDifferences) {
  int checked = 0;
  int nonzero = 0;
  const std::vector<LayerCase> all = layer_sweep();
  for (std::size_t at = 0; at < all.size(); at += 2) {
    const LayerCase& c = all[at];
    SingleRankLayer l(c, 1);
    Tensor<double> x = random_tensor<double>({1, 3, c.h, c.w}, 31);
    const Tensor<double> r = random_tensor<double>({1, 2, c.out_h(), c.out_w()}, 32);
    auto loss = [&] { return dot(l.forward(x).local.span(), r.span()); };

    DistTensor<double> dy(l.in.with_shape(r.shape()));
    dy.local = r;
    loss();  // keeps the window for backward-filter
    for (Param<double>* p : l.layer.params())
      p->grad.fill(0);
    const DistTensor<double> dx = l.layer.backward_one(dy, RunState{});

    auto central = [&](std::span<double> v) {
      constexpr double h = 1e-3;
      std::vector<double> g(v.size());
      for (std::size_t k = 0; k < v.size(); ++k) {
        const double saved = v[k];
        v[k] = saved + h;
        const double up = loss();
        v[k] = saved - h;
        const double down = loss();
        v[k] = saved;
        g[k] = (up - down) / (2 * h);
      }
      return g;
    };
    // Some cases reach no output (kernel 1 under stride 2, padding 1, 2 rows): a zero gradient.
    if (max_abs(dx.local.span()) > 0) ++nonzero;
    EXPECT_LT(rel_error(dx.local.span(), central(x.span())), 1e-7) << "dx " << c.json();
    for (Param<double>* p : l.layer.params())
      EXPECT_LT(rel_error(p->grad.span(), central(p->value.span())), 1e-7)
          << p->name << " " << c.json();
    ++checked;
  }
  EXPECT_GT(checked, 150);
  EXPECT_GT(nonzero, checked - 10);
}

// ---------------------------------------------------------------------------------------------
// Errors name the layer and the field.

std::string error_of(const std::string& layer, Shape4 input = {1, 3, 5, 5}) {
  try {
    const ModelSpec m =
        parse_model(R"({"name": "m", "input_channels": 3, "layers": [)" + layer + "]}", "net.json");
    ConvTranspose2d<double> l(m.layers.at(0).name, parse_conv_transpose2d(m.layers.at(0)), 1);
    l.setup(Distribution{input, GridShape{1, 1, 1}, GridCoords{}});
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted " << layer;
  return "";
}

TEST(ConvTranspose2dLayer, FieldErrorsNameTheLayerAndTheField) {
  const std::string head = R"({"name": "up", "type": "conv_transpose2d", )";
  struct Bad {
    std::string fields;
    std::initializer_list<std::string> parts;
  };
  const Bad cases[] = {
      {R"("out_channels": 2, "kernel": 2, "stride": 2, "output_padding": 2})",
       {"'up'", "'output_padding'", "'stride'"}},
      {R"("out_channels": 2, "kernel": 3, "output_padding": 1})",
       {"'up'", "'output_padding'", "'stride'"}},
      {R"("out_channels": 2, "kernel": 3, "stride": [2, 1], "output_padding": [1, 1]})",
       {"'up'", "'output_padding'", "'stride'"}},
      {R"("out_channels": 2, "kernel": 3, "stride": 2, "output_padding": -1})",
       {"'up'", "'output_padding'"}},
      {R"("out_channels": 2, "kernel": 3, "padding": -1})", {"'up'", "'padding'"}},
      {R"("out_channels": 2, "kernel": 3, "padding": [1, -2]})", {"'up'", "'padding'"}},
      {R"("out_channels": 2, "kernel": 3, "padding": "same"})", {"'up'", "'padding'"}},
      {R"("out_channels": 2, "kernel": 3, "dilation": 2})",
       {"'up'", "unknown field", "'dilation'"}},
      {R"("out_channels": 2, "kernel": 3, "groups": 1})", {"'up'", "unknown field", "'groups'"}},
      {R"("out_channels": 2, "kernel": 3, "outputpadding": 1})",
       {"'up'", "unknown field", "'outputpadding'"}},
      {R"("kernel": 3})", {"'up'", "missing", "'out_channels'"}},
      {R"("out_channels": 2})", {"'up'", "missing", "'kernel'"}},
      {R"("out_channels": 2, "kernel": 0})", {"'up'", "'kernel'"}},
      {R"("out_channels": 2, "kernel": 3, "stride": 0})", {"'up'", "'stride'"}},
      {R"("out_channels": 2, "kernel": 3, "bias": "yes"})", {"'up'", "'bias'"}},
      // 5 rows with kernel 1 and padding 3: (5 - 1) - 6 + 1 < 0 rows out.
      {R"("out_channels": 2, "kernel": 1, "padding": 3})",
       {"'up'", "conv_transpose2d", "'padding'"}},
  };
  for (const Bad& bad : cases) {
    const std::string msg = error_of(head + bad.fields);
    expect_mentions(msg, bad.parts);
  }
  // The largest output padding the stride allows is accepted.
  const ModelSpec ok = parse_model(
      R"({"name": "m", "input_channels": 3, "layers": [)" + head +
      R"("out_channels": 2, "kernel": 3, "stride": [3, 2], "output_padding": [2, 1]}]})");
  EXPECT_EQ(parse_conv_transpose2d(ok.layers.at(0)).output_padding, (Pair{2, 1}));
}

}  // namespace
}  // namespace tessera
