#include <cmath>

#include "tessera/error.hpp"
#include "tessera/kernels/elementwise.hpp"
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
double pixel_cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                           Tensor<T>* dlogits) {
  const Shape4& s = logits.shape();
  const std::int64_t plane = s.h * s.w;
  TESSERA_CHECK(static_cast<std::int64_t>(labels.size()) == s.n * plane,
                "pixel_cross_entropy: labels do not match the logits " + s.str());
  TESSERA_CHECK(dlogits == nullptr || dlogits->shape() == s,
                "pixel_cross_entropy: gradient " + (dlogits ? dlogits->shape().str() : "") +
                    " does not match the logits " + s.str());
  double total = 0;
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t p = 0; p < plane; ++p) {
      const std::int32_t label = labels[static_cast<std::size_t>(n * plane + p)];
      TESSERA_CHECK(label >= 0 && label < s.c,
                    "label " + std::to_string(label) + " is outside [0, " + std::to_string(s.c) +
                        "): the model has " + std::to_string(s.c) + " output channels");
      const T* x = logits.data() + n * s.c * plane + p;
      double top = x[0];
      for (std::int64_t c = 1; c < s.c; ++c)
        top = std::max<double>(top, x[c * plane]);
      double sum = 0;
      for (std::int64_t c = 0; c < s.c; ++c)
        sum += std::exp(double(x[c * plane]) - top);
      const double log_sum = std::log(sum) + top;
      total += log_sum - double(x[label * plane]);
      if (dlogits != nullptr) {
        T* d = dlogits->data() + n * s.c * plane + p;
        for (std::int64_t c = 0; c < s.c; ++c) {
          const double prob = std::exp(double(x[c * plane]) - log_sum);
          d[c * plane] = static_cast<T>(scale * (prob - (c == label ? 1.0 : 0.0)));
        }
      }
    }
  return total;
}

#define TESSERA_INSTANTIATE(T)                                                                   \
  template void leaky_relu_forward<T>(std::span<const T>, T, std::span<T>);                      \
  template void leaky_relu_backward<T>(std::span<const T>, std::span<const T>, T, std::span<T>); \
  template void sigmoid_forward<T>(std::span<const T>, std::span<T>);                            \
  template void sigmoid_backward<T>(std::span<const T>, std::span<const T>, std::span<T>);       \
  template double pixel_cross_entropy<T>(const Tensor<T>&, std::span<const std::int32_t>, T,     \
                                         Tensor<T>*);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::reference
