#include <algorithm>

#include "tessera/box.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/reference.hpp"

namespace tessera::reference {
namespace {

// Output positions o in [0, out) whose input index o*stride + offset lies in [0, in).
Range valid_outputs(std::int64_t out, std::int64_t in, std::int64_t stride, std::int64_t offset) {
  // o >= ceil(-offset / stride) and o <= floor((in - 1 - offset) / stride).
  auto floor_div = [](std::int64_t a, std::int64_t b) {
    return a >= 0 ? a / b : -((-a + b - 1) / b);
  };
  const std::int64_t lo = std::max<std::int64_t>(0, -floor_div(offset, stride));
  const std::int64_t hi = std::min<std::int64_t>(out, floor_div(in - 1 - offset, stride) + 1);
  return {lo, hi};
}

void check_shapes(const Shape4& x, const Shape4& w, const Shape4& y, const ConvGeometry& g) {
  TESSERA_CHECK(g.groups > 0 && x.c % g.groups == 0 && w.n % g.groups == 0 &&
                    w.c * g.groups == x.c && y.c == w.n && y.n == x.n,
                "conv2d kernel: input " + x.str() + ", weight " + w.str() + " and output " +
                    y.str() + " do not fit groups=" + std::to_string(g.groups));
}

// Calls body(n, oc, ic, kh, kw, oh, ow_range, iw0) for each tap row; ow_range are the outputs
// whose input column ow*stride_w + iw0 is inside the input.
template <typename Body>
void for_each_tap_row(const Shape4& x, const Shape4& w, const Shape4& y, const ConvGeometry& g,
                      Body&& body) {
  const std::int64_t out_per_group = w.n / g.groups;
  for (std::int64_t n = 0; n < y.n; ++n)
    for (std::int64_t oc = 0; oc < y.c; ++oc) {
      const std::int64_t group = oc / out_per_group;
      for (std::int64_t icg = 0; icg < w.c; ++icg) {
        const std::int64_t ic = group * w.c + icg;
        for (std::int64_t kh = 0; kh < w.h; ++kh) {
          const std::int64_t ih0 = kh * g.dilation_h - g.pad_top;
          const Range rows = valid_outputs(y.h, x.h, g.stride_h, ih0);
          for (std::int64_t kw = 0; kw < w.w; ++kw) {
            const std::int64_t iw0 = kw * g.dilation_w - g.pad_left;
            const Range cols = valid_outputs(y.w, x.w, g.stride_w, iw0);
            if (cols.empty()) continue;
            for (std::int64_t oh = rows.begin; oh < rows.end; ++oh)
              body(n, oc, ic, icg, kh, kw, oh, oh * g.stride_h + ih0, cols, iw0);
          }
        }
      }
    }
}

}  // namespace

template <typename T>
void conv2d_forward(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias, Tensor<T>& y,
                    const ConvGeometry& g) {
  check_shapes(x.shape(), w.shape(), y.shape(), g);
  TESSERA_CHECK(bias.empty() || static_cast<std::int64_t>(bias.size()) == w.shape().n,
                "conv2d_forward: bias of " + std::to_string(bias.size()) + " values for " +
                    std::to_string(w.shape().n) + " output channels");
  const Shape4& ys = y.shape();
  for (std::int64_t n = 0; n < ys.n; ++n)
    for (std::int64_t oc = 0; oc < ys.c; ++oc) {
      const T b = bias.empty() ? T(0) : bias[static_cast<std::size_t>(oc)];
      std::fill_n(&y.at(n, oc, 0, 0), ys.h * ys.w, b);
    }
  // Every output pixel sums its taps in the order (ic, kh, kw), whatever tile it lies in.
  for_each_tap_row(
      x.shape(), w.shape(), ys, g,
      [&](std::int64_t n, std::int64_t oc, std::int64_t ic, std::int64_t icg, std::int64_t kh,
          std::int64_t kw, std::int64_t oh, std::int64_t ih, Range cols, std::int64_t iw0) {
        const T wv = w.at(oc, icg, kh, kw);
        T* out = &y.at(n, oc, oh, 0);
        const T* in = &x.at(n, ic, ih, 0);
        for (std::int64_t ow = cols.begin; ow < cols.end; ++ow)
          out[ow] += wv * in[ow * g.stride_w + iw0];
      });
}

template <typename T>
void conv2d_backward_data(const Tensor<T>& dy, const Tensor<T>& w, Tensor<T>& dx,
                          const ConvGeometry& g) {
  check_shapes(dx.shape(), w.shape(), dy.shape(), g);
  dx.fill(T(0));
  for_each_tap_row(
      dx.shape(), w.shape(), dy.shape(), g,
      [&](std::int64_t n, std::int64_t oc, std::int64_t ic, std::int64_t icg, std::int64_t kh,
          std::int64_t kw, std::int64_t oh, std::int64_t ih, Range cols, std::int64_t iw0) {
        const T wv = w.at(oc, icg, kh, kw);
        const T* grad = &dy.at(n, oc, oh, 0);
        T* out = &dx.at(n, ic, ih, 0);
        for (std::int64_t ow = cols.begin; ow < cols.end; ++ow)
          out[ow * g.stride_w + iw0] += wv * grad[ow];
      });
}

template <typename T>
void conv2d_backward_filter(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& dw,
                            std::span<T> dbias, const ConvGeometry& g) {
  check_shapes(x.shape(), dw.shape(), dy.shape(), g);
  TESSERA_CHECK(dbias.empty() || static_cast<std::int64_t>(dbias.size()) == dw.shape().n,
                "conv2d_backward_filter: bias gradient of " + std::to_string(dbias.size()) +
                    " values for " + std::to_string(dw.shape().n) + " output channels");
  for_each_tap_row(
      x.shape(), dw.shape(), dy.shape(), g,
      [&](std::int64_t n, std::int64_t oc, std::int64_t ic, std::int64_t icg, std::int64_t kh,
          std::int64_t kw, std::int64_t oh, std::int64_t ih, Range cols, std::int64_t iw0) {
        const T* grad = &dy.at(n, oc, oh, 0);
        const T* in = &x.at(n, ic, ih, 0);
        T sum = T(0);
        for (std::int64_t ow = cols.begin; ow < cols.end; ++ow)
          sum += grad[ow] * in[ow * g.stride_w + iw0];
        dw.at(oc, icg, kh, kw) += sum;
      });
  if (dbias.empty()) return;
  const Shape4& s = dy.shape();
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t oc = 0; oc < s.c; ++oc) {
      const T* grad = &dy.at(n, oc, 0, 0);
      T sum = T(0);
      for (std::int64_t k = 0; k < s.h * s.w; ++k)
        sum += grad[k];
      dbias[static_cast<std::size_t>(oc)] += sum;
    }
}

#define TESSERA_INSTANTIATE(T)                                                            \
  template void conv2d_forward<T>(const Tensor<T>&, const Tensor<T>&, std::span<const T>, \
                                  Tensor<T>&, const ConvGeometry&);                       \
  template void conv2d_backward_data<T>(const Tensor<T>&, const Tensor<T>&, Tensor<T>&,   \
                                        const ConvGeometry&);                             \
  template void conv2d_backward_filter<T>(const Tensor<T>&, const Tensor<T>&, Tensor<T>&, \
                                          std::span<T>, const ConvGeometry&);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::reference
