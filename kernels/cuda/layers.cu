// The CUDA kernels of the layers that read windows or reduce: pooling, nearest upsampling, the
// classification head (spatial sums, linear layers) and batch normalisation. One thread per
// output, each computing what the CPU reference computes for it with the same arithmetic
// (include/tessera/kernels/window_arithmetic.hpp): gradients are gathered (an input sums the
// outputs that read it, in the order the CPU scatters them), sums run in the CPU's order, so
// the results are the CPU reference's bit for bit. Only batch norm's per-plane sums, in double,
// are taken in chunks, each a tree over a block, then added in order (a fixed order, so
// deterministic): they differ from the CPU's sequential sums by double rounding. Compiled without
// FMA contraction (meson.build).
#include <cstdint>

#include "launch.cuh"
#include "tessera/kernels/window_arithmetic.hpp"

namespace tessera::cuda {
namespace {

using elementwise::covering;
using elementwise::Span1;

// Output (oh, ow)'s window of image positions.
__device__ inline Span1 rows_of(const PoolWindows& g, std::int64_t oh) {
  return elementwise::pool_window(oh, g.stride_h, g.pad_top, g.kernel_h, g.image_h[0],
                                  g.image_h[1]);
}
__device__ inline Span1 cols_of(const PoolWindows& g, std::int64_t ow) {
  return elementwise::pool_window(ow, g.stride_w, g.pad_left, g.kernel_w, g.image_w[0],
                                  g.image_w[1]);
}
__device__ inline bool inside(std::int64_t i, const std::int64_t (&range)[2]) {
  return i >= range[0] && i < range[1];
}

// Per-plane sums in two passes, in an order fixed by the shape alone (so deterministic, and the
// same on every GPU): each block sums one chunk of kChunk values of a plane (each thread a stride
// of it, then the block's threads as a fixed tree), and then one thread per plane adds its chunks'
// sums in chunk order. One block per plane would leave most of the GPU idle: a 2048x2048 plane's
// batch of 8 channels is 8 blocks.
constexpr std::int64_t kChunk = 32 * kThreads;

// K sums of f(plane, i, acc) over the chunk's i, into partials[K * block + j], block = plane *
// chunks + chunk.
template <int K, typename F>
__global__ void chunk_reduce(std::int64_t plane_size, std::int64_t chunks, F f, double* partials) {
  __shared__ double partial[K][kThreads];
  const std::int64_t block = blockIdx.x, plane = block / chunks, chunk = block % chunks;
  const std::int64_t end =
      chunk * kChunk + kChunk < plane_size ? chunk * kChunk + kChunk : plane_size;
  double acc[K] = {};
  for (std::int64_t i = chunk * kChunk + threadIdx.x; i < end; i += kThreads)
    f(plane, i, acc);
  for (int j = 0; j < K; ++j)
    partial[j][threadIdx.x] = acc[j];
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half)
      for (int j = 0; j < K; ++j)
        partial[j][threadIdx.x] += partial[j][threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    for (int j = 0; j < K; ++j)
      partials[K * block + j] = partial[j][0];
}

// K per-plane sums of f(plane, i, acc) over i < plane_size, into sums[K * plane + j]; the chunks'
// sums go to sums[K * planes ...] (plane_sums_size()).
template <int K, typename F>
void launch_plane_reduce(const char* kernel, std::int64_t planes, std::int64_t plane_size, F f,
                         double* sums, cudaStream_t stream) {
  if (planes <= 0) return;
  const std::int64_t chunks = plane_chunks(plane_size);
  double* partials = sums + K * planes;
  if (chunks > 0) {
    chunk_reduce<K><<<static_cast<unsigned>(planes * chunks), kThreads, 0, stream>>>(
        plane_size, chunks, f, partials);
    check_launch(kernel);
  }
  launch(kernel, planes * K, stream, [=] __device__(std::int64_t k) {
    const std::int64_t plane = k / K, j = k % K;
    double total = 0;
    for (std::int64_t c = 0; c < chunks; ++c)
      total += partials[K * (plane * chunks + c) + j];
    sums[k] = total;
  });
}

}  // namespace

std::int64_t plane_chunks(std::int64_t plane_size) {
  return (plane_size + kChunk - 1) / kChunk;
}

template <typename T>
void max_pool_forward(const T* x, T* y, std::int64_t* argmax, const PoolWindows& windows,
                      cudaStream_t stream) {
  const PoolWindows g = windows;
  const std::int64_t out_plane = g.y_h * g.y_w;
  launch_rows("max_pool_forward", g.planes, g.y_h, g.y_w, stream,
              [=] __device__(std::int64_t p, std::int64_t oh, std::int64_t ow) {
                const std::int64_t k = p * out_plane + oh * g.y_w + ow;
                std::int64_t at = 0;
                y[k] = elementwise::window_max(x + p * g.x_h * g.x_w, g.x_w, rows_of(g, oh),
                                               cols_of(g, ow), at);
                argmax[k] = at;
              });
}

template <typename T>
void max_pool_backward(const T* dy, const std::int64_t* argmax, T* dx, const PoolWindows& windows,
                       cudaStream_t stream) {
  const PoolWindows g = windows;
  const std::int64_t out_plane = g.y_h * g.y_w;
  store_rows("max_pool_backward", dx, g.planes, g.x_h, g.x_w, stream,
             [=] __device__(std::int64_t p, std::int64_t h, std::int64_t w) {
               const std::int64_t at = h * g.x_w + w;
               const Span1 rows = covering(h, g.stride_h, g.pad_top, g.kernel_h, g.y_h);
               const Span1 cols = covering(w, g.stride_w, g.pad_left, g.kernel_w, g.y_w);
               T sum = T(0);
               for (std::int64_t oh = rows.begin; oh < rows.end; ++oh)
                 for (std::int64_t ow = cols.begin; ow < cols.end; ++ow) {
                   const std::int64_t o = p * out_plane + oh * g.y_w + ow;
                   if (argmax[o] == at) sum += dy[o];
                 }
               return sum;
             });
}

template <typename T>
void avg_pool_forward(const T* x, T* y, const PoolWindows& windows, cudaStream_t stream) {
  const PoolWindows g = windows;
  const std::int64_t out_plane = g.y_h * g.y_w;
  const T area = static_cast<T>(g.kernel_h * g.kernel_w);
  launch("avg_pool_forward", g.planes * out_plane, stream, [=] __device__(std::int64_t k) {
    const std::int64_t p = k / out_plane, oh = k % out_plane / g.y_w, ow = k % g.y_w;
    y[k] = elementwise::window_mean(x + p * g.x_h * g.x_w, g.x_w, rows_of(g, oh), cols_of(g, ow),
                                    area);
  });
}

template <typename T>
void avg_pool_backward(const T* dy, T* dx, const PoolWindows& windows, cudaStream_t stream) {
  const PoolWindows g = windows;
  const std::int64_t in_plane = g.x_h * g.x_w, out_plane = g.y_h * g.y_w;
  const T area = static_cast<T>(g.kernel_h * g.kernel_w);
  launch("avg_pool_backward", g.planes * in_plane, stream, [=] __device__(std::int64_t k) {
    const std::int64_t p = k / in_plane, h = k % in_plane / g.x_w, w = k % g.x_w;
    T sum = T(0);
    if (inside(h, g.image_h) && inside(w, g.image_w)) {
      const Span1 rows = covering(h, g.stride_h, g.pad_top, g.kernel_h, g.y_h);
      const Span1 cols = covering(w, g.stride_w, g.pad_left, g.kernel_w, g.y_w);
      for (std::int64_t oh = rows.begin; oh < rows.end; ++oh)
        for (std::int64_t ow = cols.begin; ow < cols.end; ++ow)
          sum += dy[p * out_plane + oh * g.y_w + ow] / area;
    }
    dx[k] = sum;
  });
}

template <typename T>
void upsample_forward(const T* x, T* y, const UpsampleWindows& windows, cudaStream_t stream) {
  const UpsampleWindows g = windows;
  store_rows(
      "upsample_forward", y, g.planes, g.y_h, g.y_w, stream,
      [=] __device__(std::int64_t p, std::int64_t r, std::int64_t q) {
        return x[(p * g.x_h + elementwise::upsample_source(r, g.scale_h, g.phase_h)) * g.x_w +
                 elementwise::upsample_source(q, g.scale_w, g.phase_w)];
      });
}

template <typename T>
void upsample_backward(const T* dy, T* dx, const UpsampleWindows& windows, cudaStream_t stream) {
  const UpsampleWindows g = windows;
  const std::int64_t out_plane = g.y_h * g.y_w;
  store_rows("upsample_backward", dx, g.planes, g.x_h, g.x_w, stream,
             [=] __device__(std::int64_t p, std::int64_t h, std::int64_t w) {
               const Span1 rows = elementwise::upsample_readers(h, g.scale_h, g.phase_h, g.y_h);
               const Span1 cols = elementwise::upsample_readers(w, g.scale_w, g.phase_w, g.y_w);
               T sum = T(0);
               for (std::int64_t r = rows.begin; r < rows.end; ++r)
                 for (std::int64_t q = cols.begin; q < cols.end; ++q)
                   sum += dy[p * out_plane + r * g.y_w + q];
               return sum;
             });
}

template <typename T>
void spatial_sums(const T* x, T* sums, std::int64_t planes, std::int64_t plane,
                  cudaStream_t stream) {
  launch("spatial_sums", planes, stream, [=] __device__(std::int64_t p) {
    T total = T(0);
    for (std::int64_t k = 0; k < plane; ++k)
      total += x[p * plane + k];
    sums[p] = total;
  });
}

template <typename T>
void spread(const T* g, T* dx, std::int64_t planes, std::int64_t plane, cudaStream_t stream) {
  launch("spread", planes * plane, stream,
         [=] __device__(std::int64_t k) { dx[k] = g[k / plane]; });
}

template <typename T>
void linear_forward(const T* x, const T* w, const T* bias, T* y, std::int64_t n, std::int64_t in,
                    std::int64_t out, cudaStream_t stream) {
  launch("linear_forward", n * out, stream, [=] __device__(std::int64_t k) {
    const std::int64_t s = k / out, o = k % out;
    T acc = bias != nullptr ? bias[o] : T(0);
    for (std::int64_t i = 0; i < in; ++i)
      acc += x[s * in + i] * w[o * in + i];
    y[k] = acc;
  });
}

template <typename T>
void linear_backward_data(const T* dy, const T* w, T* dx, std::int64_t n, std::int64_t in,
                          std::int64_t out, cudaStream_t stream) {
  launch("linear_backward_data", n * in, stream, [=] __device__(std::int64_t k) {
    const std::int64_t s = k / in, i = k % in;
    T acc = T(0);
    for (std::int64_t o = 0; o < out; ++o)
      acc += dy[s * out + o] * w[o * in + i];
    dx[k] = acc;
  });
}

template <typename T>
void linear_backward_weights(const T* x, const T* dy, T* dw, T* dbias, std::int64_t n,
                             std::int64_t in, std::int64_t out, cudaStream_t stream) {
  launch("linear_backward_weights", out * in, stream, [=] __device__(std::int64_t k) {
    const std::int64_t o = k / in, i = k % in;
    T acc = T(0);
    for (std::int64_t s = 0; s < n; ++s)
      acc += dy[s * out + o] * x[s * in + i];
    dw[k] += acc;
  });
  if (dbias == nullptr) return;
  launch("linear_backward_bias", out, stream, [=] __device__(std::int64_t o) {
    T acc = T(0);
    for (std::int64_t s = 0; s < n; ++s)
      acc += dy[s * out + o];
    dbias[o] += acc;
  });
}

template <typename T>
void add_bias_grad(const T* dy, T* dbias, std::int64_t samples, std::int64_t channels,
                   std::int64_t plane, double* sums, cudaStream_t stream) {
  launch_plane_reduce<1>(
      "add_bias_grad", samples * channels, plane,
      [=] __device__(std::int64_t p, std::int64_t i, double(&acc)[1]) {
        acc[0] += double(dy[p * plane + i]);
      },
      sums, stream);
  launch("add_bias_grad", channels, stream, [=] __device__(std::int64_t c) {
    double total = 0;
    for (std::int64_t n = 0; n < samples; ++n)
      total += sums[n * channels + c];
    dbias[c] = T(double(dbias[c]) + total);
  });
}

template <typename T>
void pointwise_filter_grad(const T* x, const T* dy, T* dw, std::int64_t samples, std::int64_t in,
                           std::int64_t out, std::int64_t plane, double* sums,
                           cudaStream_t stream) {
  // One "plane" per weight (o, c), of samples * plane products.
  launch_plane_reduce<1>(
      "pointwise_filter_grad", out * in, samples * plane,
      [=] __device__(std::int64_t oc, std::int64_t i, double(&acc)[1]) {
        const std::int64_t o = oc / in, c = oc % in, n = i / plane, p = i % plane;
        acc[0] += double(dy[(n * out + o) * plane + p]) * double(x[(n * in + c) * plane + p]);
      },
      sums, stream);
  launch("pointwise_filter_grad", out * in, stream,
         [=] __device__(std::int64_t k) { dw[k] = T(double(dw[k]) + sums[k]); });
}

void sum_values(const double* values, std::int64_t n, double* sums, cudaStream_t stream) {
  launch_plane_reduce<1>(
      "sum_values", 1, n,
      [=] __device__(std::int64_t, std::int64_t i, double(&acc)[1]) { acc[0] += values[i]; }, sums,
      stream);
}

template <typename T>
void batchnorm_sums(const T* x, const double* mean, double* sums, std::int64_t planes,
                    std::int64_t channels, std::int64_t plane, cudaStream_t stream) {
  if (mean == nullptr) {
    launch_plane_reduce<1>(
        "batchnorm_sum", planes, plane,
        [=] __device__(std::int64_t p, std::int64_t i, double(&acc)[1]) {
          acc[0] += double(x[p * plane + i]);
        },
        sums, stream);
    return;
  }
  batchnorm_centered_square_sums_if(x, mean, nullptr, sums, planes, channels, plane, stream);
}

template <typename T, typename S>
void batchnorm_shifted_sums(const T* x, const S* shift, double* sums, std::int64_t planes,
                            std::int64_t channels, std::int64_t plane, cudaStream_t stream) {
  launch_plane_reduce<2>(
      "batchnorm_shifted_sums", planes, plane,
      [=] __device__(std::int64_t p, std::int64_t i, double(&acc)[2]) {
        const double v = double(x[p * plane + i]);
        acc[0] += v;
        const double d = v - double(shift[p % channels]);
        acc[1] += d * d;
      },
      sums, stream);
}

template <typename T>
void batchnorm_centered_square_sums_if(const T* x, const double* mean, const int* needed,
                                       double* sums, std::int64_t planes, std::int64_t channels,
                                       std::int64_t plane, cudaStream_t stream) {
  launch_plane_reduce<1>(
      "batchnorm_centered_square_sum", planes, plane,
      [=] __device__(std::int64_t p, std::int64_t i, double(&acc)[1]) {
        if (needed != nullptr && *needed == 0) return;
        const double d = double(x[p * plane + i]) - mean[p % channels];
        acc[0] += d * d;
      },
      sums, stream);
}

namespace {

// The sum over samples n, in order, of sums[k * (n * channels + c) + j] (the host's order).
__device__ inline double add_samples(const double* sums, int k, int j, std::int64_t c,
                                     std::int64_t samples, std::int64_t channels) {
  double total = 0;
  for (std::int64_t n = 0; n < samples; ++n)
    total += sums[k * (n * channels + c) + j];
  return total;
}

}  // namespace

template <typename T>
void batchnorm_moments(const double* sums, const T* running_mean, double count, double* mean,
                       double* var, int* unconditioned, std::int64_t samples, std::int64_t channels,
                       cudaStream_t stream) {
  // One thread a channel; the flag cleared first in the stream's order, then set by any channel
  // that needs the second pass (all write the same value).
  if (cudaMemsetAsync(unconditioned, 0, sizeof(int), stream) != cudaSuccess)
    check_launch("batchnorm_moments (clearing its flag)");
  launch("batchnorm_moments", channels, stream, [=] __device__(std::int64_t c) {
    const double shift = double(running_mean[c]);
    const double s1 = add_samples(sums, 2, 0, c, samples, channels) - count * shift;
    const double s2 = add_samples(sums, 2, 1, c, samples, channels);
    const elementwise::BatchNormMoments m = elementwise::batchnorm_moments(s1, s2, shift, count);
    mean[c] = m.mean;
    var[c] = m.var;
    if (!m.conditioned) *unconditioned = 1;
  });
}

template <typename T>
void batchnorm_finish(const double* centered, const int* unconditioned, double count, double eps,
                      double momentum, const double* mean, double* var, double* invstd,
                      T* running_mean, T* running_var, std::int64_t samples, std::int64_t channels,
                      cudaStream_t stream) {
  launch("batchnorm_finish", channels, stream, [=] __device__(std::int64_t c) {
    if (*unconditioned != 0) var[c] = add_samples(centered, 1, 0, c, samples, channels) / count;
    invstd[c] = elementwise::batchnorm_invstd(var[c], eps);
    elementwise::batchnorm_update_running(running_mean[c], running_var[c], mean[c], var[c],
                                          momentum, count);
  });
}

template <typename T>
void batchnorm_gradients(const double* sums, double count, T* bias_grad, T* weight_grad,
                         double* mean_dy, double* mean_dy_xhat, std::int64_t samples,
                         std::int64_t channels, cudaStream_t stream) {
  launch("batchnorm_gradients", channels, stream, [=] __device__(std::int64_t c) {
    const double sum_dy = add_samples(sums, 2, 0, c, samples, channels);
    const double sum_dy_xhat = add_samples(sums, 2, 1, c, samples, channels);
    bias_grad[c] += static_cast<T>(sum_dy);
    weight_grad[c] += static_cast<T>(sum_dy_xhat);
    mean_dy[c] = sum_dy / count;
    mean_dy_xhat[c] = sum_dy_xhat / count;
  });
}

template <typename T>
void batchnorm_backward_sums(const T* x, const T* dy, const double* mean, const double* invstd,
                             double* sums, std::int64_t planes, std::int64_t channels,
                             std::int64_t plane, cudaStream_t stream) {
  launch_plane_reduce<2>(
      "batchnorm_backward_sums", planes, plane,
      [=] __device__(std::int64_t p, std::int64_t i, double(&acc)[2]) {
        const std::int64_t c = p % channels;
        const double g = double(dy[p * plane + i]);
        acc[0] += g;
        acc[1] += g * (double(x[p * plane + i]) - mean[c]) * invstd[c];
      },
      sums, stream);
}

template <typename T>
void batchnorm_forward(const T* x, const double* mean, const double* invstd, const T* weight,
                       const T* bias, T* y, std::int64_t planes, std::int64_t channels,
                       std::int64_t plane, cudaStream_t stream) {
  store_rows("batchnorm_forward", y, planes, 1, plane, stream,
             [=] __device__(std::int64_t p, std::int64_t, std::int64_t i) {
               const std::int64_t c = p % channels, k = p * plane + i;
               return elementwise::batchnorm_apply(x[k], mean[c], invstd[c] * double(weight[c]),
                                                   double(bias[c]));
             });
}

template <typename T>
void batchnorm_backward_data(const T* x, const T* dy, const double* mean, const double* invstd,
                             const T* weight, const double* mean_dy, const double* mean_dy_xhat,
                             T* dx, std::int64_t planes, std::int64_t channels, std::int64_t plane,
                             cudaStream_t stream) {
  store_rows("batchnorm_backward_data", dx, planes, 1, plane, stream,
             [=] __device__(std::int64_t p, std::int64_t, std::int64_t i) {
               const std::int64_t c = p % channels, k = p * plane + i;
               return elementwise::batchnorm_grad(dy[k], x[k], mean[c], invstd[c],
                                                  double(weight[c]) * invstd[c], mean_dy[c],
                                                  mean_dy_xhat[c]);
             });
}

#define TESSERA_CUDA_LAYERS(T)                                                                     \
  template void max_pool_forward<T>(const T*, T*, std::int64_t*, const PoolWindows&,               \
                                    cudaStream_t);                                                 \
  template void max_pool_backward<T>(const T*, const std::int64_t*, T*, const PoolWindows&,        \
                                     cudaStream_t);                                                \
  template void avg_pool_forward<T>(const T*, T*, const PoolWindows&, cudaStream_t);               \
  template void avg_pool_backward<T>(const T*, T*, const PoolWindows&, cudaStream_t);              \
  template void upsample_forward<T>(const T*, T*, const UpsampleWindows&, cudaStream_t);           \
  template void upsample_backward<T>(const T*, T*, const UpsampleWindows&, cudaStream_t);          \
  template void spatial_sums<T>(const T*, T*, std::int64_t, std::int64_t, cudaStream_t);           \
  template void spread<T>(const T*, T*, std::int64_t, std::int64_t, cudaStream_t);                 \
  template void linear_forward<T>(const T*, const T*, const T*, T*, std::int64_t, std::int64_t,    \
                                  std::int64_t, cudaStream_t);                                     \
  template void linear_backward_data<T>(const T*, const T*, T*, std::int64_t, std::int64_t,        \
                                        std::int64_t, cudaStream_t);                               \
  template void linear_backward_weights<T>(const T*, const T*, T*, T*, std::int64_t, std::int64_t, \
                                           std::int64_t, cudaStream_t);                            \
  template void add_bias_grad<T>(const T*, T*, std::int64_t, std::int64_t, std::int64_t, double*,  \
                                 cudaStream_t);                                                    \
  template void pointwise_filter_grad<T>(const T*, const T*, T*, std::int64_t, std::int64_t,       \
                                         std::int64_t, std::int64_t, double*, cudaStream_t);       \
  template void batchnorm_sums<T>(const T*, const double*, double*, std::int64_t, std::int64_t,    \
                                  std::int64_t, cudaStream_t);                                     \
  template void batchnorm_shifted_sums<T, T>(const T*, const T*, double*, std::int64_t,            \
                                             std::int64_t, std::int64_t, cudaStream_t);            \
  template void batchnorm_centered_square_sums_if<T>(const T*, const double*, const int*, double*, \
                                                     std::int64_t, std::int64_t, std::int64_t,     \
                                                     cudaStream_t);                                \
  template void batchnorm_moments<T>(const double*, const T*, double, double*, double*, int*,      \
                                     std::int64_t, std::int64_t, cudaStream_t);                    \
  template void batchnorm_finish<T>(const double*, const int*, double, double, double,             \
                                    const double*, double*, double*, T*, T*, std::int64_t,         \
                                    std::int64_t, cudaStream_t);                                   \
  template void batchnorm_gradients<T>(const double*, double, T*, T*, double*, double*,            \
                                       std::int64_t, std::int64_t, cudaStream_t);                  \
  template void batchnorm_backward_sums<T>(const T*, const T*, const double*, const double*,       \
                                           double*, std::int64_t, std::int64_t, std::int64_t,      \
                                           cudaStream_t);                                          \
  template void batchnorm_forward<T>(const T*, const double*, const double*, const T*, const T*,   \
                                     T*, std::int64_t, std::int64_t, std::int64_t, cudaStream_t);  \
  template void batchnorm_backward_data<T>(                                                        \
      const T*, const T*, const double*, const double*, const T*, const double*, const double*,    \
      T*, std::int64_t, std::int64_t, std::int64_t, cudaStream_t);
TESSERA_CUDA_LAYERS(float)
TESSERA_CUDA_LAYERS(double)
#undef TESSERA_CUDA_LAYERS
// Shifts from the host for float data (for double, the macro's <T, T>).
template void batchnorm_shifted_sums<float, double>(const float*, const double*, double*,
                                                    std::int64_t, std::int64_t, std::int64_t,
                                                    cudaStream_t);

}  // namespace tessera::cuda
