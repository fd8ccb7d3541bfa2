#include "tessera/kernels/reference_pool.hpp"

#include <algorithm>
#include <atomic>
#include <string>

#include "tessera/error.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/parallel.hpp"

namespace tessera::reference {
namespace {

void check_shapes(const char* who, const Shape4& x, const Shape4& y, const PoolGeometry& g) {
  TESSERA_CHECK(g.kernel_h > 0 && g.kernel_w > 0 && g.stride_h > 0 && g.stride_w > 0,
                std::string(who) + ": kernel and stride must be positive");
  TESSERA_CHECK(x.n == y.n && x.c == y.c, std::string(who) + ": input " + x.str() + " and output " +
                                              y.str() + " differ in samples or channels");
}

// The image rows of output row oh's windows and the image columns of output column ow's, in x's
// coordinates (kernels/window_arithmetic.hpp, shared with the CUDA kernels).
elementwise::Span1 rows_of(const PoolGeometry& g, std::int64_t oh) {
  return elementwise::pool_window(oh, g.stride_h, g.pad_top, g.kernel_h, g.image.h.begin,
                                  g.image.h.end);
}
elementwise::Span1 cols_of(const PoolGeometry& g, std::int64_t ow) {
  return elementwise::pool_window(ow, g.stride_w, g.pad_left, g.kernel_w, g.image.w.begin,
                                  g.image.w.end);
}
// Output (oh, ow)'s window as a box.
Box window_of(const PoolGeometry& g, std::int64_t oh, std::int64_t ow) {
  const elementwise::Span1 r = rows_of(g, oh), c = cols_of(g, ow);
  return {{r.begin, r.end}, {c.begin, c.end}};
}

// `image` restricted to x, so that a window never reads outside the tensor.
PoolGeometry clipped(const PoolGeometry& g, const Shape4& x) {
  PoolGeometry c = g;
  c.image = intersect(g.image, Box{{0, x.h}, {0, x.w}});
  return c;
}

// Throws unless every window of an output of shape `y` holds an image position. Windows move
// monotonically along each axis, so each axis is checked on its own.
void check_windows(const char* who, const PoolGeometry& g, const Shape4& y) {
  auto check = [&](std::int64_t count, std::int64_t stride, std::int64_t pad, std::int64_t kernel,
                   Range image, const char* axis) {
    for (std::int64_t o = 0; o < count; ++o) {
      const std::int64_t begin = o * stride - pad;
      TESSERA_CHECK(!intersect(Range{begin, begin + kernel}, image).empty(),
                    std::string(who) + ": the window of output " + axis + " " + std::to_string(o) +
                        " holds no image position");
    }
  };
  if (y.numel() == 0) return;
  check(y.h, g.stride_h, g.pad_top, g.kernel_h, g.image.h, "row");
  check(y.w, g.stride_w, g.pad_left, g.kernel_w, g.image.w, "column");
}

// Calls body(plane) for every (sample, channel) plane of `s`, split over the kernel threads:
// planes are independent, so results do not depend on the thread count.
template <typename Body>
void for_each_plane(const Shape4& s, std::int64_t work_per_plane, Body&& body) {
  parallel_for(
      s.n * s.c,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t p = first; p < last; ++p)
          body(p);
      },
      grain_for(work_per_plane));
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

PoolGeometry checked_pool_geometry(const char* who, const Shape4& x, const Shape4& y,
                                   const PoolGeometry& g, bool every_window_pools) {
  check_shapes(who, x, y, g);
  const PoolGeometry c = clipped(g, x);
  if (every_window_pools) check_windows(who, c, y);
  return c;
}

template <typename T>
void maxpool2d_forward(const Tensor<T>& x, Tensor<T>& y, std::span<std::int64_t> argmax,
                       const PoolGeometry& geometry) {
  const Shape4 &xs = x.shape(), &ys = y.shape();
  TESSERA_CHECK(static_cast<std::int64_t>(argmax.size()) == ys.numel(),
                "maxpool2d_forward: " + std::to_string(argmax.size()) +
                    " argmax slots for output " + ys.str());
  const PoolGeometry g = checked_pool_geometry("maxpool2d_forward", xs, ys, geometry, true);
  const std::int64_t out_plane = ys.h * ys.w;
  for_each_plane(ys, out_plane * g.kernel_h * g.kernel_w, [&](std::int64_t p) {
    const T* plane = x.data() + p * xs.h * xs.w;
    std::int64_t k = p * out_plane;
    for (std::int64_t oh = 0; oh < ys.h; ++oh)
      for (std::int64_t ow = 0; ow < ys.w; ++ow, ++k) {
        std::int64_t at = 0;
        const T best = elementwise::window_max(plane, xs.w, rows_of(g, oh), cols_of(g, ow), at);
        y.data()[k] = best;
        argmax[std::size_t(k)] = at;
      }
  });
}

template <typename T>
void maxpool2d_backward(const Tensor<T>& dy, std::span<const std::int64_t> argmax, Tensor<T>& dx) {
  const Shape4 &ys = dy.shape(), &xs = dx.shape();
  TESSERA_CHECK(
      ys.n == xs.n && ys.c == xs.c && static_cast<std::int64_t>(argmax.size()) == ys.numel(),
      "maxpool2d_backward: output gradient " + ys.str() + ", " + std::to_string(argmax.size()) +
          " argmax slots and input gradient " + xs.str() + " do not fit");
  const std::int64_t plane = xs.h * xs.w, out_plane = ys.h * ys.w;
  for (std::int64_t k = 0; k < ys.numel(); ++k)
    TESSERA_CHECK(argmax[std::size_t(k)] >= 0 && argmax[std::size_t(k)] < plane,
                  "maxpool2d_backward: argmax " + std::to_string(argmax[std::size_t(k)]) +
                      " outside the input plane " + std::to_string(xs.h) + "x" +
                      std::to_string(xs.w));
  for_each_plane(ys, out_plane + plane, [&](std::int64_t p) {
    T* out = dx.data() + p * plane;
    std::fill(out, out + plane, T(0));
    for (std::int64_t k = p * out_plane; k < (p + 1) * out_plane; ++k)
      out[argmax[std::size_t(k)]] += dy.data()[k];
  });
}

template <typename T>
void avgpool2d_forward(const Tensor<T>& x, Tensor<T>& y, const PoolGeometry& geometry) {
  const Shape4 &xs = x.shape(), &ys = y.shape();
  const PoolGeometry g = checked_pool_geometry("avgpool2d_forward", xs, ys, geometry, false);
  const T area = static_cast<T>(g.kernel_h * g.kernel_w);
  for_each_plane(ys, ys.h * ys.w * g.kernel_h * g.kernel_w, [&](std::int64_t p) {
    const T* in = x.data() + p * xs.h * xs.w;
    T* out = y.data() + p * ys.h * ys.w;
    for (std::int64_t oh = 0; oh < ys.h; ++oh)
      for (std::int64_t ow = 0; ow < ys.w; ++ow) {
        out[oh * ys.w + ow] =
            elementwise::window_mean(in, xs.w, rows_of(g, oh), cols_of(g, ow), area);
      }
  });
}

template <typename T>
void avgpool2d_backward(const Tensor<T>& dy, Tensor<T>& dx, const PoolGeometry& geometry) {
  const Shape4 &xs = dx.shape(), &ys = dy.shape();
  const PoolGeometry g = checked_pool_geometry("avgpool2d_backward", xs, ys, geometry, false);
  const T area = static_cast<T>(g.kernel_h * g.kernel_w);
  for_each_plane(ys, ys.h * ys.w * g.kernel_h * g.kernel_w + xs.h * xs.w, [&](std::int64_t p) {
    T* in = dx.data() + p * xs.h * xs.w;
    const T* grad = dy.data() + p * ys.h * ys.w;
    std::fill(in, in + xs.h * xs.w, T(0));
    for (std::int64_t oh = 0; oh < ys.h; ++oh)
      for (std::int64_t ow = 0; ow < ys.w; ++ow) {
        const Box b = window_of(g, oh, ow);
        const T share = grad[oh * ys.w + ow] / area;
        for (std::int64_t h = b.h.begin; h < b.h.end; ++h)
          for (std::int64_t w = b.w.begin; w < b.w.end; ++w)
            in[h * xs.w + w] += share;
      }
  });
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
