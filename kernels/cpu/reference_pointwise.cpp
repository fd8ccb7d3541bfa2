#include <cmath>

#include "tessera/error.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference.hpp"

namespace tessera::reference {

template <typename T>
void leaky_relu_forward(std::span<const T> x, T slope, std::span<T> y) {
  for (std::size_t k = 0; k < x.size(); ++k)
    y[k] = elementwise::leaky_relu(x[k], slope);
}

// y > 0 exactly where x > 0 (for slope >= 0), so y tells which branch x took.
template <typename T>
void leaky_relu_backward(std::span<const T> y, std::span<const T> dy, T slope, std::span<T> dx) {
  for (std::size_t k = 0; k < y.size(); ++k)
    dx[k] = elementwise::leaky_relu_grad(y[k] > T(0), dy[k], slope);
}

template <typename T>
void sigmoid_forward(std::span<const T> x, std::span<T> y) {
  for (std::size_t k = 0; k < x.size(); ++k)
    y[k] = elementwise::sigmoid(x[k]);
}

template <typename T>
void sigmoid_backward(std::span<const T> y, std::span<const T> dy, std::span<T> dx) {
  for (std::size_t k = 0; k < y.size(); ++k)
    dx[k] = elementwise::sigmoid_grad(y[k], dy[k]);
}

template <typename T>
double pixel_cross_entropy_range(const Tensor<T>& logits, std::span<const std::int32_t> labels,
                                 T scale, Tensor<T>* dlogits, std::int64_t first,
                                 std::int64_t last) {
  const Shape4& s = logits.shape();
  const std::int64_t plane = s.h * s.w;
  double total = 0;
  // Pixel k is at sample k / plane, offset k % plane: one division for the range, not per pixel.
  std::int64_t sample = plane > 0 ? first / plane : 0;
  std::int64_t offset = plane > 0 ? first % plane : 0;
  for (std::int64_t k = first; k < last; ++k) {
    const std::int64_t at = sample * s.c * plane + offset;
    total += elementwise::cross_entropy(logits.data() + at, s.c, plane,
                                        labels[static_cast<std::size_t>(k)], scale,
                                        dlogits != nullptr ? dlogits->data() + at : nullptr);
    if (++offset == plane) {
      offset = 0;
      ++sample;
    }
  }
  return total;
}

template <typename T>
double pixel_cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                           Tensor<T>* dlogits) {
  const Shape4& s = logits.shape();
  check_cross_entropy(s, labels, dlogits != nullptr ? &dlogits->shape() : nullptr);
  return pixel_cross_entropy_range(logits, labels, scale, dlogits, 0, s.n * s.h * s.w);
}

#define TESSERA_INSTANTIATE(T)                                                                     \
  template void leaky_relu_forward<T>(std::span<const T>, T, std::span<T>);                        \
  template void leaky_relu_backward<T>(std::span<const T>, std::span<const T>, T, std::span<T>);   \
  template void sigmoid_forward<T>(std::span<const T>, std::span<T>);                              \
  template void sigmoid_backward<T>(std::span<const T>, std::span<const T>, std::span<T>);         \
  template double pixel_cross_entropy<T>(const Tensor<T>&, std::span<const std::int32_t>, T,       \
                                         Tensor<T>*);                                              \
  template double pixel_cross_entropy_range<T>(const Tensor<T>&, std::span<const std::int32_t>, T, \
                                               Tensor<T>*, std::int64_t, std::int64_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::reference
