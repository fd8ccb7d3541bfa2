// The launchers of Tessera's own CUDA kernels (kernels/cuda/*.cu), private to kernels/cuda. Each
// enqueues one kernel on `stream` and returns at once; pointers are device memory. The
// per-element arithmetic is include/tessera/kernels/elementwise.hpp's, shared with the CPU.
// A launch that fails throws an Error (the CUDA error string). Local.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

#include "tessera/kernels/elementwise.hpp"

namespace tessera::cuda {

// Throws an Error naming `kernel` and the CUDA error when its launch failed (cudaGetLastError;
// kernels/cuda/cuda_context.cpp: the .cu files include no engine header).
void check_launch(const char* kernel);

// y = leaky_relu(x, slope), positive = x > 0 (a byte each).
template <typename T>
void leaky_relu_forward(const T* x, T* y, std::uint8_t* positive, std::int64_t n, T slope,
                        cudaStream_t stream);
// dx = leaky_relu_grad(positive, dy, slope).
template <typename T>
void leaky_relu_backward(const T* dy, const std::uint8_t* positive, T* dx, std::int64_t n, T slope,
                         cudaStream_t stream);
template <typename T>
void sigmoid_forward(const T* x, T* y, std::int64_t n, cudaStream_t stream);
template <typename T>
void sigmoid_backward(const T* y, const T* dy, T* dx, std::int64_t n, cudaStream_t stream);

// mask[k] = dropout_scale(seed, stream_id, global_index(tile, k), p, keep), y[k] = x[k] * mask[k]
// for the tile's elements.
template <typename T>
void dropout_forward(const T* x, T* mask, T* y, const TileIndex& tile, std::uint64_t seed,
                     std::uint64_t stream_id, double p, T keep, cudaStream_t stream);
// out[k] = a[k] * b[k].
template <typename T>
void multiply(const T* a, const T* b, T* out, std::int64_t n, cudaStream_t stream);
// a[k] += b[k].
template <typename T>
void add(const T* b, T* a, std::int64_t n, cudaStream_t stream);
// a[k] = value.
template <typename T>
void fill(T* a, std::int64_t n, T value, cudaStream_t stream);
// y[(n * channels + c) * plane + i] += bias[c] over `planes` = N * channels planes.
template <typename T>
void add_bias(const T* bias, T* y, std::int64_t planes, std::int64_t channels, std::int64_t plane,
              cudaStream_t stream);
// dbias[c] += the sum of the planes of channel c: each plane summed in double in chunks
// (plane_sums_size, kernels/cuda/layers.cu), the planes added in sample order; `sums` holds
// plane_sums_size(samples * channels, plane, 1) doubles. Deterministic; it differs from the CPU's
// sums in T by the CPU's rounding.
template <typename T>
void add_bias_grad(const T* dy, T* dbias, std::int64_t samples, std::int64_t channels,
                   std::int64_t plane, double* sums, cudaStream_t stream);
// The filter gradient of a pointwise (1x1, stride 1, unpadded) convolution of NCHW x [samples,
// in, plane] to dy [samples, out, plane]: dw[o, c] += the sum over samples and pixels of
// dy[n, o, p] x[n, c, p], in double in chunks (a fixed order); `sums` holds
// plane_sums_size(out * in, samples * plane, 1) doubles.
template <typename T>
void pointwise_filter_grad(const T* x, const T* dy, T* dw, std::int64_t samples, std::int64_t in,
                           std::int64_t out, std::int64_t plane, double* sums, cudaStream_t stream);
// sums[0] = the sum of values[0, n), in chunks (a fixed order); `sums` holds
// plane_sums_size(1, n, 1) doubles.
void sum_values(const double* values, std::int64_t n, double* sums, cudaStream_t stream);

// losses[k] = elementwise::cross_entropy of pixel k (sample k / plane) of `samples` x
// `channels` x `plane` NCHW logits with labels[k], and its gradient into dlogits unless null.
template <typename T>
void cross_entropy(const T* logits, const std::int32_t* labels, T scale, T* dlogits, double* losses,
                   std::int64_t samples, std::int64_t channels, std::int64_t plane,
                   cudaStream_t stream);

// The optimizers' updates (elementwise::sgd, elementwise::adam); buf may be null.
template <typename T>
void sgd(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars<T>& s, cudaStream_t stream);
template <typename T>
void adam(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars<T>& s,
          cudaStream_t stream);

// The windows of a pooling over `planes` planes of x (x_h x x_w) into y (y_h x y_w): output
// (oh, ow) pools the image positions (rows image_h, columns image_w, half-open, within x) of rows
// oh * stride_h - pad_top + [0, kernel_h) and the columns likewise (reference::PoolGeometry).
struct PoolWindows {
  std::int64_t planes = 0, x_h = 0, x_w = 0, y_h = 0, y_w = 0;
  std::int64_t kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1, pad_top = 0, pad_left = 0;
  std::int64_t image_h[2] = {0, 0}, image_w[2] = {0, 0};
};
// y = the window maxima (ties and NaN as the reference), argmax = each one's h * x_w + w.
template <typename T>
void max_pool_forward(const T* x, T* y, std::int64_t* argmax, const PoolWindows& g,
                      cudaStream_t stream);
// dx (overwritten) = each input's sum of the dy of the outputs whose argmax it is.
template <typename T>
void max_pool_backward(const T* dy, const std::int64_t* argmax, T* dx, const PoolWindows& g,
                       cudaStream_t stream);
// y = the window sums divided by kernel_h * kernel_w (padding counts).
template <typename T>
void avg_pool_forward(const T* x, T* y, const PoolWindows& g, cudaStream_t stream);
// dx (overwritten) = each image input's sum of dy / area over the windows holding it.
template <typename T>
void avg_pool_backward(const T* dy, T* dx, const PoolWindows& g, cudaStream_t stream);

// Nearest upsampling of `planes` planes x (x_h x x_w) into y (y_h x y_w): output row r reads
// x row (r + phase_h) / scale_h, columns likewise (reference::UpsampleGeometry).
struct UpsampleWindows {
  std::int64_t planes = 0, x_h = 0, x_w = 0, y_h = 0, y_w = 0;
  std::int64_t scale_h = 1, scale_w = 1, phase_h = 0, phase_w = 0;
};
template <typename T>
void upsample_forward(const T* x, T* y, const UpsampleWindows& g, cudaStream_t stream);
// dx (overwritten) = each input's sum of the dy that read it, in row-major order.
template <typename T>
void upsample_backward(const T* dy, T* dx, const UpsampleWindows& g, cudaStream_t stream);

// sums[p] = the sum of plane p (`plane` values, in order); dx[p * plane + i] = g[p].
template <typename T>
void spatial_sums(const T* x, T* sums, std::int64_t planes, std::int64_t plane,
                  cudaStream_t stream);
template <typename T>
void spread(const T* g, T* dx, std::int64_t planes, std::int64_t plane, cudaStream_t stream);

// The linear layer's three products (reference::linear_*), each output a sequential dot product;
// bias and dbias may be null.
template <typename T>
void linear_forward(const T* x, const T* w, const T* bias, T* y, std::int64_t n, std::int64_t in,
                    std::int64_t out, cudaStream_t stream);
template <typename T>
void linear_backward_data(const T* dy, const T* w, T* dx, std::int64_t n, std::int64_t in,
                          std::int64_t out, cudaStream_t stream);
template <typename T>
void linear_backward_weights(const T* x, const T* dy, T* dw, T* dbias, std::int64_t n,
                             std::int64_t in, std::int64_t out, cudaStream_t stream);

// The sums of a plane are taken in chunks (kernels/cuda/layers.cu): how many for `plane` values.
std::int64_t plane_chunks(std::int64_t plane);
// Doubles of the `sums` buffer of K sums per plane: the sums and the chunks' partial sums.
inline std::int64_t plane_sums_size(std::int64_t planes, std::int64_t plane, int k) {
  return k * planes * (1 + plane_chunks(plane));
}
// Batch norm on `planes` = N * channels NCHW planes of `plane` values; per-channel statistics
// (double) and parameters (T) in device memory. sums[p] (double, per plane) = the sum of x, or
// with `mean` the sum of (x - mean[c])^2. `sums` holds plane_sums_size(planes, plane, 1) doubles
// (the plane sums, then scratch).
template <typename T>
void batchnorm_sums(const T* x, const double* mean, double* sums, std::int64_t planes,
                    std::int64_t channels, std::int64_t plane, cudaStream_t stream);
// sums[2p] = the sum of dy, sums[2p + 1] = the sum of dy * xhat over plane p; `sums` holds
// plane_sums_size(planes, plane, 2) doubles.
template <typename T>
void batchnorm_backward_sums(const T* x, const T* dy, const double* mean, const double* invstd,
                             double* sums, std::int64_t planes, std::int64_t channels,
                             std::int64_t plane, cudaStream_t stream);
// sums[2p] = the sum of x, sums[2p + 1] = the sum of (x - shift[c])^2 over plane p (c = p %
// channels), each bit for bit as batchnorm_sums takes it alone, in one pass over x; `sums` holds
// plane_sums_size(planes, plane, 2) doubles. S: double (shifts from the host) or T (the running
// mean on the device).
template <typename T, typename S>
void batchnorm_shifted_sums(const T* x, const S* shift, double* sums, std::int64_t planes,
                            std::int64_t channels, std::int64_t plane, cudaStream_t stream);
// batchnorm_sums with `mean`, where `needed` is null or *needed != 0; else x is not read and the
// sums are zeros (the caller then ignores them).
template <typename T>
void batchnorm_centered_square_sums_if(const T* x, const double* mean, const int* needed,
                                       double* sums, std::int64_t planes, std::int64_t channels,
                                       std::int64_t plane, cudaStream_t stream);
// Batch norm's training statistics kept on the device (a thread per channel): the plane sums of
// `samples` x `channels` planes added over the samples in order, as the host adds them
// (kernels/cuda/cuda_layer_kernels.cpp), and elementwise::batchnorm_moments.
// moments: from batchnorm_shifted_sums' sums around the running mean, mean[c] and var[c], and
// *unconditioned = 1 where any channel's moments are not conditioned, else 0.
template <typename T>
void batchnorm_moments(const double* sums, const T* running_mean, double count, double* mean,
                       double* var, int* unconditioned, std::int64_t samples, std::int64_t channels,
                       cudaStream_t stream);
// finish: where *unconditioned, var[c] = batchnorm_centered_square_sums_if's sums / count; then
// invstd[c] (elementwise::batchnorm_invstd) and the running statistics updated
// (elementwise::batchnorm_update_running).
template <typename T>
void batchnorm_finish(const double* centered, const int* unconditioned, double count, double eps,
                      double momentum, const double* mean, double* var, double* invstd,
                      T* running_mean, T* running_var, std::int64_t samples, std::int64_t channels,
                      cudaStream_t stream);
// gradients: from batchnorm_backward_sums' sums, bias_grad[c] += T(sum of dy), weight_grad[c] +=
// T(sum of dy * xhat), and mean_dy[c], mean_dy_xhat[c] those sums / count.
template <typename T>
void batchnorm_gradients(const double* sums, double count, T* bias_grad, T* weight_grad,
                         double* mean_dy, double* mean_dy_xhat, std::int64_t samples,
                         std::int64_t channels, cudaStream_t stream);
// y = elementwise::batchnorm_apply; dx = elementwise::batchnorm_grad.
template <typename T>
void batchnorm_forward(const T* x, const double* mean, const double* invstd, const T* weight,
                       const T* bias, T* y, std::int64_t planes, std::int64_t channels,
                       std::int64_t plane, cudaStream_t stream);
template <typename T>
void batchnorm_backward_data(const T* x, const T* dy, const double* mean, const double* invstd,
                             const T* weight, const double* mean_dy, const double* mean_dy_xhat,
                             T* dx, std::int64_t planes, std::int64_t channels, std::int64_t plane,
                             cudaStream_t stream);

// A 3-D strided box: dst[i * ds0 + j * ds1 + k * ds2] = (or +=) src[i * ss0 + j * ss1 + k * ss2]
// for i < e0, j < e1, k < e2 (strides in elements). Halo boxes (planes x rows x columns),
// messages and channel blocks are all such boxes.
struct Box3 {
  std::int64_t extent[3] = {0, 0, 0};
  std::int64_t src_stride[3] = {0, 0, 0};
  std::int64_t dst_stride[3] = {0, 0, 0};
};
using Strides3 = std::array<std::int64_t, 3>;
// The strides of planes x rows x columns of row-major planes of `rows` x `cols`: an NCHW tensor,
// or a message of one box per plane.
inline Strides3 plane_strides(std::int64_t rows, std::int64_t cols) {
  return {rows * cols, cols, 1};
}
inline Box3 make_box3(std::int64_t e0, std::int64_t e1, std::int64_t e2, const Strides3& src,
                      const Strides3& dst) {
  Box3 b;
  const std::int64_t extent[3] = {e0, e1, e2};
  for (int i = 0; i < 3; ++i) {
    b.extent[i] = extent[i];
    b.src_stride[i] = src[i];
    b.dst_stride[i] = dst[i];
  }
  return b;
}
template <typename T>
void copy_box(const T* src, T* dst, const Box3& box, bool accumulate, cudaStream_t stream);
// dst[i * s0 + j * s1 + k * s2] = value over the box's extents (its dst strides).
template <typename T>
void fill_box(T* dst, const Box3& box, T value, cudaStream_t stream);

}  // namespace tessera::cuda
