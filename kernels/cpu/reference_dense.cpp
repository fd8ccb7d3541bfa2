#include "tessera/kernels/reference_dense.hpp"

namespace tessera::reference {

template <typename T>
void spatial_sums(const Tensor<T>& x, std::span<T> sums) {
  const Shape4& s = x.shape();
  const std::int64_t plane = s.h * s.w;
  for (std::int64_t p = 0; p < s.n * s.c; ++p) {
    T total = T(0);
    const T* v = x.data() + p * plane;
    for (std::int64_t k = 0; k < plane; ++k)
      total += v[k];
    sums[static_cast<std::size_t>(p)] = total;
  }
}

template <typename T>
void broadcast_spatial(std::span<const T> g, Tensor<T>& dx) {
  const Shape4& s = dx.shape();
  const std::int64_t plane = s.h * s.w;
  for (std::int64_t p = 0; p < s.n * s.c; ++p)
    std::fill_n(dx.data() + p * plane, plane, g[static_cast<std::size_t>(p)]);
}

template <typename T>
void linear_forward(std::span<const T> x, std::span<const T> w, std::span<const T> bias,
                    std::span<T> y, std::int64_t n, std::int64_t in, std::int64_t out) {
  for (std::int64_t s = 0; s < n; ++s)
    for (std::int64_t o = 0; o < out; ++o) {
      T acc = bias.empty() ? T(0) : bias[static_cast<std::size_t>(o)];
      for (std::int64_t i = 0; i < in; ++i)
        acc += x[static_cast<std::size_t>(s * in + i)] * w[static_cast<std::size_t>(o * in + i)];
      y[static_cast<std::size_t>(s * out + o)] = acc;
    }
}

template <typename T>
void linear_backward_data(std::span<const T> dy, std::span<const T> w, std::span<T> dx,
                          std::int64_t n, std::int64_t in, std::int64_t out) {
  for (std::int64_t s = 0; s < n; ++s)
    for (std::int64_t i = 0; i < in; ++i) {
      T acc = T(0);
      for (std::int64_t o = 0; o < out; ++o)
        acc += dy[static_cast<std::size_t>(s * out + o)] * w[static_cast<std::size_t>(o * in + i)];
      dx[static_cast<std::size_t>(s * in + i)] = acc;
    }
}

template <typename T>
void linear_backward_weights(std::span<const T> x, std::span<const T> dy, std::span<T> dw,
                             std::span<T> dbias, std::int64_t n, std::int64_t in,
                             std::int64_t out) {
  for (std::int64_t o = 0; o < out; ++o) {
    for (std::int64_t i = 0; i < in; ++i) {
      T acc = T(0);
      for (std::int64_t s = 0; s < n; ++s)
        acc += dy[static_cast<std::size_t>(s * out + o)] * x[static_cast<std::size_t>(s * in + i)];
      dw[static_cast<std::size_t>(o * in + i)] += acc;
    }
    if (!dbias.empty()) {
      T acc = T(0);
      for (std::int64_t s = 0; s < n; ++s)
        acc += dy[static_cast<std::size_t>(s * out + o)];
      dbias[static_cast<std::size_t>(o)] += acc;
    }
  }
}

#define TESSERA_INSTANTIATE(T)                                                                   \
  template void spatial_sums<T>(const Tensor<T>&, std::span<T>);                                 \
  template void broadcast_spatial<T>(std::span<const T>, Tensor<T>&);                            \
  template void linear_forward<T>(std::span<const T>, std::span<const T>, std::span<const T>,    \
                                  std::span<T>, std::int64_t, std::int64_t, std::int64_t);       \
  template void linear_backward_data<T>(std::span<const T>, std::span<const T>, std::span<T>,    \
                                        std::int64_t, std::int64_t, std::int64_t);               \
  template void linear_backward_weights<T>(std::span<const T>, std::span<const T>, std::span<T>, \
                                           std::span<T>, std::int64_t, std::int64_t,             \
                                           std::int64_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::reference
