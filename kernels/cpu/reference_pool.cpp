#include "tessera/kernels/reference_pool.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "tessera/error.hpp"

namespace tessera::reference {
namespace {

void check_shapes(const char* who, const Shape4& x, const Shape4& y, const PoolGeometry& g) {
  TESSERA_CHECK(g.kernel_h > 0 && g.kernel_w > 0 && g.stride_h > 0 && g.stride_w > 0,
                std::string(who) + ": kernel and stride must be positive");
  TESSERA_CHECK(x.n == y.n && x.c == y.c, std::string(who) + ": input " + x.str() + " and output " +
                                              y.str() + " differ in samples or channels");
}

// The image positions of output (oh, ow)'s window, in x's coordinates.
Box window_of(const PoolGeometry& g, std::int64_t oh, std::int64_t ow) {
  const std::int64_t h0 = oh * g.stride_h - g.pad_top, w0 = ow * g.stride_w - g.pad_left;
  return intersect(Box{{h0, h0 + g.kernel_h}, {w0, w0 + g.kernel_w}}, g.image);
}

// `image` restricted to x, so that a window never reads outside the tensor.
PoolGeometry clipped(const PoolGeometry& g, const Shape4& x) {
  PoolGeometry c = g;
  c.image = intersect(g.image, Box{{0, x.h}, {0, x.w}});
  return c;
}

}  // namespace

PoolGeometry pool_geometry(Shape4 x, std::int64_t kernel_h, std::int64_t kernel_w,
                           std::int64_t stride_h, std::int64_t stride_w, std::int64_t pad_top,
                           std::int64_t pad_left) {
  return {.kernel_h = kernel_h,
          .kernel_w = kernel_w,
          .stride_h = stride_h,
          .stride_w = stride_w,
          .pad_top = pad_top,
          .pad_left = pad_left,
          .image = {{0, x.h}, {0, x.w}}};
}

template <typename T>
void maxpool2d_forward(const Tensor<T>& x, Tensor<T>& y, std::span<std::int64_t> argmax,
                       const PoolGeometry& geometry) {
  const Shape4 &xs = x.shape(), &ys = y.shape();
  check_shapes("maxpool2d_forward", xs, ys, geometry);
  TESSERA_CHECK(static_cast<std::int64_t>(argmax.size()) == ys.numel(),
                "maxpool2d_forward: " + std::to_string(argmax.size()) +
                    " argmax slots for output " + ys.str());
  const PoolGeometry g = clipped(geometry, xs);
  std::size_t k = 0;
  for (std::int64_t n = 0; n < ys.n; ++n)
    for (std::int64_t c = 0; c < ys.c; ++c) {
      const T* plane = &x.at(n, c, 0, 0);
      for (std::int64_t oh = 0; oh < ys.h; ++oh)
        for (std::int64_t ow = 0; ow < ys.w; ++ow, ++k) {
          const Box b = window_of(g, oh, ow);
          TESSERA_CHECK(!b.empty(), "maxpool2d_forward: the window of output (" +
                                        std::to_string(oh) + ", " + std::to_string(ow) +
                                        ") holds no image position");
          // PyTorch's scan: start from -inf at the first image position; a strictly greater value
          // or a NaN takes over, so the first maximum wins a tie.
          T best = -std::numeric_limits<T>::infinity();
          std::int64_t at = b.h.begin * xs.w + b.w.begin;
          for (std::int64_t h = b.h.begin; h < b.h.end; ++h)
            for (std::int64_t w = b.w.begin; w < b.w.end; ++w) {
              const T v = plane[h * xs.w + w];
              if (v > best || std::isnan(v)) {
                best = v;
                at = h * xs.w + w;
              }
            }
          y.data()[k] = best;
          argmax[k] = at;
        }
    }
}

template <typename T>
void maxpool2d_backward(const Tensor<T>& dy, std::span<const std::int64_t> argmax, Tensor<T>& dx) {
  const Shape4 &ys = dy.shape(), &xs = dx.shape();
  TESSERA_CHECK(
      ys.n == xs.n && ys.c == xs.c && static_cast<std::int64_t>(argmax.size()) == ys.numel(),
      "maxpool2d_backward: output gradient " + ys.str() + ", " + std::to_string(argmax.size()) +
          " argmax slots and input gradient " + xs.str() + " do not fit");
  dx.fill(T(0));
  const std::int64_t plane = xs.h * xs.w;
  std::size_t k = 0;
  for (std::int64_t n = 0; n < ys.n; ++n)
    for (std::int64_t c = 0; c < ys.c; ++c) {
      T* out = &dx.at(n, c, 0, 0);
      for (std::int64_t o = 0; o < ys.h * ys.w; ++o, ++k) {
        TESSERA_CHECK(argmax[k] >= 0 && argmax[k] < plane,
                      "maxpool2d_backward: argmax " + std::to_string(argmax[k]) +
                          " outside the input plane " + std::to_string(xs.h) + "x" +
                          std::to_string(xs.w));
        out[argmax[k]] += dy.data()[k];
      }
    }
}

template <typename T>
void avgpool2d_forward(const Tensor<T>& x, Tensor<T>& y, const PoolGeometry& geometry) {
  const Shape4 &xs = x.shape(), &ys = y.shape();
  check_shapes("avgpool2d_forward", xs, ys, geometry);
  const PoolGeometry g = clipped(geometry, xs);
  const T area = static_cast<T>(g.kernel_h * g.kernel_w);
  for (std::int64_t n = 0; n < ys.n; ++n)
    for (std::int64_t c = 0; c < ys.c; ++c)
      for (std::int64_t oh = 0; oh < ys.h; ++oh)
        for (std::int64_t ow = 0; ow < ys.w; ++ow) {
          const Box b = window_of(g, oh, ow);
          T sum = 0;
          for (std::int64_t h = b.h.begin; h < b.h.end; ++h)
            for (std::int64_t w = b.w.begin; w < b.w.end; ++w)
              sum += x.at(n, c, h, w);
          // Divide (not multiply by the reciprocal), as PyTorch does, for identical rounding.
          y.at(n, c, oh, ow) = sum / area;
        }
}

template <typename T>
void avgpool2d_backward(const Tensor<T>& dy, Tensor<T>& dx, const PoolGeometry& geometry) {
  const Shape4 &xs = dx.shape(), &ys = dy.shape();
  check_shapes("avgpool2d_backward", xs, ys, geometry);
  const PoolGeometry g = clipped(geometry, xs);
  const T area = static_cast<T>(g.kernel_h * g.kernel_w);
  dx.fill(T(0));
  for (std::int64_t n = 0; n < ys.n; ++n)
    for (std::int64_t c = 0; c < ys.c; ++c)
      for (std::int64_t oh = 0; oh < ys.h; ++oh)
        for (std::int64_t ow = 0; ow < ys.w; ++ow) {
          const Box b = window_of(g, oh, ow);
          const T share = dy.at(n, c, oh, ow) / area;
          for (std::int64_t h = b.h.begin; h < b.h.end; ++h)
            for (std::int64_t w = b.w.begin; w < b.w.end; ++w)
              dx.at(n, c, h, w) += share;
        }
}

template void maxpool2d_forward(const Tensor<float>&, Tensor<float>&, std::span<std::int64_t>,
                                const PoolGeometry&);
template void maxpool2d_forward(const Tensor<double>&, Tensor<double>&, std::span<std::int64_t>,
                                const PoolGeometry&);
template void maxpool2d_backward(const Tensor<float>&, std::span<const std::int64_t>,
                                 Tensor<float>&);
template void maxpool2d_backward(const Tensor<double>&, std::span<const std::int64_t>,
                                 Tensor<double>&);
template void avgpool2d_forward(const Tensor<float>&, Tensor<float>&, const PoolGeometry&);
template void avgpool2d_forward(const Tensor<double>&, Tensor<double>&, const PoolGeometry&);
template void avgpool2d_backward(const Tensor<float>&, Tensor<float>&, const PoolGeometry&);
template void avgpool2d_backward(const Tensor<double>&, Tensor<double>&, const PoolGeometry&);

}  // namespace tessera::reference
