#include "tessera/kernels/reference_conv_transpose.hpp"

#include "tessera/error.hpp"

namespace tessera::reference {
namespace {

// x [N, C, H, W] -> y [N, O, OH, OW] through w [C, O/groups, KH, KW].
void check_shapes(const char* who, const Shape4& x, const Shape4& w, const Shape4& y,
                  const ConvGeometry& g) {
  TESSERA_CHECK(
      g.groups > 0 && x.c == w.n && w.n % g.groups == 0 && y.c == w.c * g.groups && y.n == x.n,
      std::string(who) + ": input " + x.str() + ", weight " + w.str() + " and output " + y.str() +
          " do not fit groups=" + std::to_string(g.groups));
}

void check_bias(const char* who, std::size_t size, std::int64_t out_channels) {
  TESSERA_CHECK(size == 0 || static_cast<std::int64_t>(size) == out_channels,
                std::string(who) + ": bias of " + std::to_string(size) + " values for " +
                    std::to_string(out_channels) + " output channels");
}

}  // namespace

// The transposed convolution is the conv's backward-data with the roles of x and y swapped:
// every output pixel sums its taps in the order (input channel, kh, kw) whatever tile it lies in.
template <typename T>
void conv_transpose2d_forward(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias,
                              Tensor<T>& y, const ConvGeometry& g) {
  check_shapes("conv_transpose2d_forward", x.shape(), w.shape(), y.shape(), g);
  check_bias("conv_transpose2d_forward", bias.size(), y.shape().c);
  conv2d_backward_data(x, w, y, g);
  if (bias.empty()) return;
  const Shape4& s = y.shape();
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t c = 0; c < s.c; ++c) {
      const T b = bias[static_cast<std::size_t>(c)];
      T* out = s.h * s.w > 0 ? &y.at(n, c, 0, 0) : nullptr;
      for (std::int64_t k = 0; k < s.h * s.w; ++k)
        out[k] += b;
    }
}

template <typename T>
void conv_transpose2d_backward_data(const Tensor<T>& dy, const Tensor<T>& w, Tensor<T>& dx,
                                    const ConvGeometry& g) {
  check_shapes("conv_transpose2d_backward_data", dx.shape(), w.shape(), dy.shape(), g);
  // A window with no rows or columns (a tile whose outputs no input reaches) has no gradient.
  if (dx.numel() == 0) return;
  conv2d_forward<T>(dy, w, {}, dx, g);
}

template <typename T>
void conv_transpose2d_backward_filter(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& dw,
                                      std::span<T> dbias, const ConvGeometry& g) {
  check_shapes("conv_transpose2d_backward_filter", x.shape(), dw.shape(), dy.shape(), g);
  check_bias("conv_transpose2d_backward_filter", dbias.size(), dy.shape().c);
  // The conv's filter gradient pairs its output gradient (our x) with its input (our dy).
  conv2d_backward_filter<T>(dy, x, dw, {}, g);
  if (dbias.empty()) return;
  const Shape4& s = dy.shape();
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t c = 0; c < s.c; ++c) {
      const T* grad = s.h * s.w > 0 ? &dy.at(n, c, 0, 0) : nullptr;
      T sum = T(0);
      for (std::int64_t k = 0; k < s.h * s.w; ++k)
        sum += grad[k];
      dbias[static_cast<std::size_t>(c)] += sum;
    }
}

#define TESSERA_INSTANTIATE(T)                                                                    \
  template void conv_transpose2d_forward<T>(const Tensor<T>&, const Tensor<T>&,                   \
                                            std::span<const T>, Tensor<T>&, const ConvGeometry&); \
  template void conv_transpose2d_backward_data<T>(const Tensor<T>&, const Tensor<T>&, Tensor<T>&, \
                                                  const ConvGeometry&);                           \
  template void conv_transpose2d_backward_filter<T>(                                              \
      const Tensor<T>&, const Tensor<T>&, Tensor<T>&, std::span<T>, const ConvGeometry&);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::reference
