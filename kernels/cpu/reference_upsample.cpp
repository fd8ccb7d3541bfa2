#include "tessera/kernels/reference_upsample.hpp"

#include <string>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/parallel.hpp"

namespace tessera::reference {
namespace {}  // namespace

void check_upsample(const char* who, const Shape4& x, const Shape4& y, const UpsampleGeometry& g) {
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

namespace {

// The input column each output column reads.
std::vector<std::int64_t> column_map(std::int64_t out_w, const UpsampleGeometry& g) {
  std::vector<std::int64_t> map(static_cast<std::size_t>(out_w));
  for (std::int64_t q = 0; q < out_w; ++q)
    map[static_cast<std::size_t>(q)] = elementwise::upsample_source(q, g.scale_w, g.phase_w);
  return map;
}

}  // namespace

// Rows are independent (forward) and planes are (backward): split over the kernel threads, each
// plane's sums in the same order whatever the thread count.
template <typename T>
void upsample_nearest_forward(const Tensor<T>& x, Tensor<T>& y, const UpsampleGeometry& g) {
  const Shape4 &xs = x.shape(), &ys = y.shape();
  check_upsample("upsample_nearest_forward", xs, ys, g);
  const std::vector<std::int64_t> cols = column_map(ys.w, g);
  parallel_for(
      ys.n * ys.c * ys.h,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t k = first; k < last; ++k) {
          const std::int64_t plane = k / ys.h, r = k % ys.h;
          const T* in =
              x.data() +
              (plane * xs.h + elementwise::upsample_source(r, g.scale_h, g.phase_h)) * xs.w;
          T* out = y.data() + k * ys.w;
          for (std::int64_t q = 0; q < ys.w; ++q)
            out[q] = in[cols[static_cast<std::size_t>(q)]];
        }
      },
      grain_for(ys.w));
}

template <typename T>
void upsample_nearest_backward(const Tensor<T>& dy, Tensor<T>& dx, const UpsampleGeometry& g) {
  const Shape4 &xs = dx.shape(), &ys = dy.shape();
  check_upsample("upsample_nearest_backward", xs, ys, g);
  const std::vector<std::int64_t> cols = column_map(ys.w, g);
  parallel_for(
      ys.n * ys.c,
      [&](std::int64_t first, std::int64_t last) {
        std::fill(dx.data() + first * xs.h * xs.w, dx.data() + last * xs.h * xs.w, T(0));
        for (std::int64_t plane = first; plane < last; ++plane)
          for (std::int64_t r = 0; r < ys.h; ++r) {
            T* in = dx.data() +
                    (plane * xs.h + elementwise::upsample_source(r, g.scale_h, g.phase_h)) * xs.w;
            const T* out = dy.data() + (plane * ys.h + r) * ys.w;
            for (std::int64_t q = 0; q < ys.w; ++q)
              in[cols[static_cast<std::size_t>(q)]] += out[q];
          }
      },
      grain_for(ys.h * ys.w));
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
