#include "tessera/kernels/reference_upsample.hpp"

#include <string>

#include "tessera/error.hpp"

namespace tessera::reference {
namespace {

void check_shapes(const char* who, const Shape4& x, const Shape4& y, const UpsampleGeometry& g) {
  TESSERA_CHECK(g.scale_h > 0 && g.scale_w > 0 && g.phase_h >= 0 && g.phase_w >= 0,
                std::string(who) + ": scales must be positive and phases non-negative");
  TESSERA_CHECK(x.n == y.n && x.c == y.c, std::string(who) + ": input " + x.str() + " and output " +
                                              y.str() + " differ in samples or channels");
  // The last output row and column must read inside x.
  TESSERA_CHECK((y.h == 0 || (y.h - 1 + g.phase_h) / g.scale_h < x.h) &&
                    (y.w == 0 || (y.w - 1 + g.phase_w) / g.scale_w < x.w),
                std::string(who) + ": input " + x.str() + " does not cover output " + y.str() +
                    " at scale " + std::to_string(g.scale_h) + "x" + std::to_string(g.scale_w));
}

}  // namespace

template <typename T>
void upsample_nearest_forward(const Tensor<T>& x, Tensor<T>& y, const UpsampleGeometry& g) {
  const Shape4 &xs = x.shape(), &ys = y.shape();
  check_shapes("upsample_nearest_forward", xs, ys, g);
  for (std::int64_t n = 0; n < ys.n; ++n)
    for (std::int64_t c = 0; c < ys.c; ++c)
      for (std::int64_t r = 0; r < ys.h; ++r) {
        const T* in = &x.at(n, c, (r + g.phase_h) / g.scale_h, 0);
        T* out = &y.at(n, c, r, 0);
        for (std::int64_t q = 0; q < ys.w; ++q)
          out[q] = in[(q + g.phase_w) / g.scale_w];
      }
}

template <typename T>
void upsample_nearest_backward(const Tensor<T>& dy, Tensor<T>& dx, const UpsampleGeometry& g) {
  const Shape4 &xs = dx.shape(), &ys = dy.shape();
  check_shapes("upsample_nearest_backward", xs, ys, g);
  dx.fill(T(0));
  for (std::int64_t n = 0; n < ys.n; ++n)
    for (std::int64_t c = 0; c < ys.c; ++c)
      for (std::int64_t r = 0; r < ys.h; ++r) {
        T* in = &dx.at(n, c, (r + g.phase_h) / g.scale_h, 0);
        const T* out = &dy.at(n, c, r, 0);
        for (std::int64_t q = 0; q < ys.w; ++q)
          in[(q + g.phase_w) / g.scale_w] += out[q];
      }
}

template void upsample_nearest_forward(const Tensor<float>&, Tensor<float>&,
                                       const UpsampleGeometry&);
template void upsample_nearest_forward(const Tensor<double>&, Tensor<double>&,
                                       const UpsampleGeometry&);
template void upsample_nearest_backward(const Tensor<float>&, Tensor<float>&,
                                        const UpsampleGeometry&);
template void upsample_nearest_backward(const Tensor<double>&, Tensor<double>&,
                                        const UpsampleGeometry&);

}  // namespace tessera::reference
