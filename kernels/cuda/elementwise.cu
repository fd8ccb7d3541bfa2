// The pointwise CUDA kernels: a grid-stride loop over the elements calling the per-element
// functions of include/tessera/kernels/elementwise.hpp (shared with the CPU loops). Compiled
// without FMA contraction (meson.build) so they round as the CPU does.
#include <cstdint>

#include "launch.cuh"

namespace tessera::cuda {

template <typename T>
void leaky_relu_forward(const T* x, T* y, std::uint8_t* positive, std::int64_t n, T slope,
                        cudaStream_t stream) {
  launch("leaky_relu_forward", n, stream, [=] __device__(std::int64_t k) {
    positive[k] = x[k] > T(0);
    y[k] = elementwise::leaky_relu(x[k], slope);
  });
}

template <typename T>
void leaky_relu_backward(const T* dy, const std::uint8_t* positive, T* dx, std::int64_t n, T slope,
                         cudaStream_t stream) {
  launch("leaky_relu_backward", n, stream, [=] __device__(std::int64_t k) {
    dx[k] = elementwise::leaky_relu_grad(positive[k] != 0, dy[k], slope);
  });
}

template <typename T>
void sigmoid_forward(const T* x, T* y, std::int64_t n, cudaStream_t stream) {
  launch("sigmoid_forward", n, stream,
         [=] __device__(std::int64_t k) { y[k] = elementwise::sigmoid(x[k]); });
}

template <typename T>
void sigmoid_backward(const T* y, const T* dy, T* dx, std::int64_t n, cudaStream_t stream) {
  launch("sigmoid_backward", n, stream,
         [=] __device__(std::int64_t k) { dx[k] = elementwise::sigmoid_grad(y[k], dy[k]); });
}

template <typename T>
void dropout_forward(const T* x, T* mask, T* y, const TileIndex& tile, std::uint64_t seed,
                     std::uint64_t stream_id, double p, T keep, cudaStream_t stream) {
  const TileIndex t = tile;
  launch("dropout_forward", t.n * t.c * t.h * t.w, stream, [=] __device__(std::int64_t k) {
    mask[k] = elementwise::dropout_scale(seed, stream_id, elementwise::global_index(t, k), p, keep);
    y[k] = x[k] * mask[k];
  });
}

template <typename T>
void multiply(const T* a, const T* b, T* out, std::int64_t n, cudaStream_t stream) {
  launch("multiply", n, stream, [=] __device__(std::int64_t k) { out[k] = a[k] * b[k]; });
}

template <typename T>
void add(const T* b, T* a, std::int64_t n, cudaStream_t stream) {
  launch("add", n, stream, [=] __device__(std::int64_t k) { a[k] = a[k] + b[k]; });
}

template <typename T>
void fill(T* a, std::int64_t n, T value, cudaStream_t stream) {
  launch("fill", n, stream, [=] __device__(std::int64_t k) { a[k] = value; });
}

template <typename T>
void sgd(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars<T>& s, cudaStream_t stream) {
  const SgdScalars<T> scalars = s;
  launch("sgd", n, stream, [=] __device__(std::int64_t k) {
    elementwise::sgd(p[k], g[k], buf ? buf + k : nullptr, scalars);
  });
}

template <typename T>
void adam(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars<T>& s,
          cudaStream_t stream) {
  const AdamScalars<T> scalars = s;
  launch("adam", n, stream,
         [=] __device__(std::int64_t k) { elementwise::adam(p[k], g[k], m[k], v[k], scalars); });
}

template <typename T>
void add_bias(const T* bias, T* y, std::int64_t planes, std::int64_t channels, std::int64_t plane,
              cudaStream_t stream) {
  launch("add_bias", planes * plane, stream,
         [=] __device__(std::int64_t k) { y[k] = y[k] + bias[(k / plane) % channels]; });
}

template <typename T>
void cross_entropy(const T* logits, const std::int32_t* labels, T scale, T* dlogits, double* losses,
                   std::int64_t samples, std::int64_t channels, std::int64_t plane,
                   cudaStream_t stream) {
  launch("cross_entropy", samples * plane, stream, [=] __device__(std::int64_t k) {
    const std::int64_t at = k / plane * channels * plane + k % plane;
    const std::int32_t label = labels[k];
    if (label < 0 || label >= channels) {
      // Not a class: a NaN loss (the host then finds the label and names it) and no read of a
      // logit that is not there.
      losses[k] = __longlong_as_double(0x7ff8000000000000LL);
      if (dlogits != nullptr)
        for (std::int64_t c = 0; c < channels; ++c)
          dlogits[at + c * plane] = T(0);
      return;
    }
    losses[k] = elementwise::cross_entropy(logits + at, channels, plane, label, scale,
                                           dlogits != nullptr ? dlogits + at : nullptr);
  });
}

#define TESSERA_CUDA_ELEMENTWISE(T)                                                                \
  template void leaky_relu_forward<T>(const T*, T*, std::uint8_t*, std::int64_t, T, cudaStream_t); \
  template void leaky_relu_backward<T>(const T*, const std::uint8_t*, T*, std::int64_t, T,         \
                                       cudaStream_t);                                              \
  template void sigmoid_forward<T>(const T*, T*, std::int64_t, cudaStream_t);                      \
  template void sigmoid_backward<T>(const T*, const T*, T*, std::int64_t, cudaStream_t);           \
  template void dropout_forward<T>(const T*, T*, T*, const TileIndex&, std::uint64_t,              \
                                   std::uint64_t, double, T, cudaStream_t);                        \
  template void multiply<T>(const T*, const T*, T*, std::int64_t, cudaStream_t);                   \
  template void add<T>(const T*, T*, std::int64_t, cudaStream_t);                                  \
  template void fill<T>(T*, std::int64_t, T, cudaStream_t);                                        \
  template void cross_entropy<T>(const T*, const std::int32_t*, T, T*, double*, std::int64_t,      \
                                 std::int64_t, std::int64_t, cudaStream_t);                        \
  template void add_bias<T>(const T*, T*, std::int64_t, std::int64_t, std::int64_t, cudaStream_t); \
  template void sgd<T>(T*, const T*, T*, std::int64_t, const SgdScalars<T>&, cudaStream_t);        \
  template void adam<T>(T*, const T*, T*, T*, std::int64_t, const AdamScalars<T>&, cudaStream_t);
TESSERA_CUDA_ELEMENTWISE(float)
TESSERA_CUDA_ELEMENTWISE(double)
#undef TESSERA_CUDA_ELEMENTWISE

}  // namespace tessera::cuda
