// The CUDA backend's pooling, upsampling, classification-head and batch-norm kernels
// (kernels/cuda/cuda_backend.hpp): the reference's checks on the host, then the launchers of
// kernels/cuda/layers.cu. Batch norm's statistics stay those of the whole batch: the layer
// (src/layers/batchnorm.cpp) reduces the per-channel sums these kernels return over the grid.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "../cpu/batchnorm_checks.hpp"
#include "cuda_backend.hpp"
#include "cuda_context.hpp"
#include "cuda_kernels.hpp"
#include "tessera/error.hpp"

namespace tessera::cuda {
namespace {

void check_nchw(const char* kernel, Layout layout) {
  TESSERA_CHECK(layout == Layout::nchw, std::string(kernel) + " on the GPU: tensors must be NCHW");
}

template <typename T>
class CudaPool final : public PoolKernel<T> {
 public:
  CudaPool(PoolKind kind, const reference::PoolGeometry& g) : kind_(kind), g_(g) {}
  std::string name() const override { return "cuda"; }

  void forward(const Tensor<T>& x, Tensor<T>& y) override {
    const bool max = kind_ == PoolKind::max;
    const PoolWindows w = windows(max ? "maxpool2d_forward" : "avgpool2d_forward", x, y);
    if (!max) {
      avg_pool_forward(device(x), device(y), w, stream());
      return;
    }
    argmax_count_ = y.numel();
    max_pool_forward(device(x), device(y), argmax_.get<std::int64_t>(std::size_t(argmax_count_)), w,
                     stream());
  }

  void backward(const Tensor<T>& dy, Tensor<T>& dx) override {
    const bool max = kind_ == PoolKind::max;
    const PoolWindows w = windows(max ? "maxpool2d_backward" : "avgpool2d_backward", dx, dy);
    if (!max) {
      avg_pool_backward(device(dy), device(dx), w, stream());
      return;
    }
    TESSERA_CHECK(argmax_count_ == dy.numel(), "maxpool2d_backward: output gradient " +
                                                   dy.shape().str() +
                                                   " does not match the last forward's output");
    max_pool_backward(device(dy), argmax_.get<std::int64_t>(std::size_t(argmax_count_)), device(dx),
                      w, stream());
  }

 private:
  PoolWindows windows(const char* who, const Tensor<T>& x, const Tensor<T>& y) const {
    check_nchw(who, x.layout());
    check_nchw(who, y.layout());
    const Shape4 &xs = x.shape(), &ys = y.shape();
    const reference::PoolGeometry g =
        reference::checked_pool_geometry(who, xs, ys, g_, kind_ == PoolKind::max);
    PoolWindows w;
    w.planes = xs.n * xs.c;
    w.x_h = xs.h;
    w.x_w = xs.w;
    w.y_h = ys.h;
    w.y_w = ys.w;
    w.kernel_h = g.kernel_h;
    w.kernel_w = g.kernel_w;
    w.stride_h = g.stride_h;
    w.stride_w = g.stride_w;
    w.pad_top = g.pad_top;
    w.pad_left = g.pad_left;
    w.image_h[0] = g.image.h.begin;
    w.image_h[1] = g.image.h.end;
    w.image_w[0] = g.image.w.begin;
    w.image_w[1] = g.image.w.end;
    return w;
  }

  PoolKind kind_;
  reference::PoolGeometry g_;
  Scratch argmax_;  // max: per output of the last forward, its input within x's plane
  std::int64_t argmax_count_ = -1;
};

template <typename T>
class CudaUpsample final : public UpsampleKernel<T> {
 public:
  explicit CudaUpsample(const reference::UpsampleGeometry& g) : g_(g) {}
  std::string name() const override { return "cuda"; }
  void forward(const Tensor<T>& x, Tensor<T>& y) const override {
    upsample_forward(device(x), device(y), windows("upsample_forward", x, y), stream());
  }
  void backward(const Tensor<T>& dy, Tensor<T>& dx) const override {
    upsample_backward(device(dy), device(dx), windows("upsample_backward", dx, dy), stream());
  }

 private:
  UpsampleWindows windows(const char* who, const Tensor<T>& x, const Tensor<T>& y) const {
    check_nchw(who, x.layout());
    check_nchw(who, y.layout());
    const Shape4 &xs = x.shape(), &ys = y.shape();
    reference::check_upsample(who, xs, ys, g_);
    return {.planes = xs.n * xs.c,
            .x_h = xs.h,
            .x_w = xs.w,
            .y_h = ys.h,
            .y_w = ys.w,
            .scale_h = g_.scale_h,
            .scale_w = g_.scale_w,
            .phase_h = g_.phase_h,
            .phase_w = g_.phase_w};
  }
  reference::UpsampleGeometry g_;
};

template <typename T>
class CudaSpatialSum final : public SpatialSumKernel<T> {
 public:
  std::string name() const override { return "cuda"; }
  void sums(const Tensor<T>& x, std::span<T> sums) const override {
    const Shape4& s = x.shape();
    check(s, sums.size());
    spatial_sums(device(x), sums.data(), s.n * s.c, s.h * s.w, stream());
  }
  void spread(std::span<const T> g, Tensor<T>& dx) const override {
    const Shape4& s = dx.shape();
    check(s, g.size());
    cuda::spread(g.data(), device(dx), s.n * s.c, s.h * s.w, stream());
  }

 private:
  static void check(const Shape4& s, std::size_t values) {
    TESSERA_CHECK(static_cast<std::int64_t>(values) == s.n * s.c,
                  "global average pooling: " + std::to_string(values) + " sums for the " +
                      std::to_string(s.n * s.c) + " planes of " + s.str());
  }
};

template <typename T>
class CudaLinear final : public LinearKernel<T> {
 public:
  CudaLinear(std::int64_t in, std::int64_t out) : in_(in), out_(out) {}
  std::string name() const override { return "cuda"; }
  void forward(std::span<const T> x, std::span<const T> w, std::span<const T> bias, std::span<T> y,
               std::int64_t n) const override {
    check(x.size(), w.size(), bias.size(), y.size(), n);
    linear_forward(x.data(), w.data(), bias.empty() ? nullptr : bias.data(), y.data(), n, in_, out_,
                   stream());
  }
  void backward_data(std::span<const T> dy, std::span<const T> w, std::span<T> dx,
                     std::int64_t n) const override {
    check(dx.size(), w.size(), 0, dy.size(), n);
    linear_backward_data(dy.data(), w.data(), dx.data(), n, in_, out_, stream());
  }
  void backward_weights(std::span<const T> x, std::span<const T> dy, std::span<T> dw,
                        std::span<T> dbias, std::int64_t n) const override {
    check(x.size(), dw.size(), dbias.size(), dy.size(), n);
    linear_backward_weights(x.data(), dy.data(), dw.data(), dbias.empty() ? nullptr : dbias.data(),
                            n, in_, out_, stream());
  }

 private:
  // Sizes of the inputs (or their gradient), the weights, the bias (0: none) and the outputs.
  void check(std::size_t x, std::size_t w, std::size_t bias, std::size_t y, std::int64_t n) const {
    const auto size = [](std::int64_t v) { return static_cast<std::size_t>(v); };
    TESSERA_CHECK(x == size(n * in_) && w == size(in_ * out_) &&
                      (bias == 0 || bias == size(out_)) && y == size(n * out_),
                  "linear " + std::to_string(in_) + " -> " + std::to_string(out_) + " of " +
                      std::to_string(n) + " samples: given " + std::to_string(x) + " inputs, " +
                      std::to_string(w) + " weights, " + std::to_string(bias) + " biases, " +
                      std::to_string(y) + " outputs");
  }
  std::int64_t in_, out_;
};

// Per-channel sums are taken per plane on the device (kernels/cuda/layers.cu), copied out and
// added over the samples in order on the host, as the reference adds its plane sums.
template <typename T>
class CudaBatchNorm final : public BatchNormKernel<T> {
 public:
  CudaBatchNorm() = default;
  CudaBatchNorm(const CudaBatchNorm&) = delete;
  CudaBatchNorm& operator=(const CudaBatchNorm&) = delete;
  ~CudaBatchNorm() override {
    // A queued upload may still read staged_.
    if (staged_.bytes() != 0) device_allocator()->wait_ordered_quietly();
  }
  std::string name() const override { return "cuda"; }

  void sum(const Tensor<T>& x, Layout layout, std::span<double> sum) const override {
    const Shape4& s = x.shape();
    check_nchw("batchnorm_sum", layout);
    batchnorm_checks::channels("batchnorm_sum", s, sum.size(), "sum");
    double* planes = plane_sums(s.n * s.c, s.h * s.w, 1);
    batchnorm_sums(device(x), static_cast<const double*>(nullptr), planes, s.n * s.c, s.c,
                   s.h * s.w, stream());
    add_planes(s, planes, 1, {sum});
  }

  void centered_square_sum(const Tensor<T>& x, Layout layout, std::span<const double> mean,
                           std::span<double> sum) const override {
    const Shape4& s = x.shape();
    const char* who = "batchnorm_centered_square_sum";
    check_nchw(who, layout);
    batchnorm_checks::channels(who, s, mean.size(), "mean");
    batchnorm_checks::channels(who, s, sum.size(), "sum");
    const double* m = upload_channels({mean});
    double* planes = plane_sums(s.n * s.c, s.h * s.w, 1);
    batchnorm_sums(device(x), m, planes, s.n * s.c, s.c, s.h * s.w, stream());
    add_planes(s, planes, 1, {sum});
  }

  // Both sums in one pass over x (batchnorm_shifted_sums), each as sum() and
  // centered_square_sum() take it.
  void shifted_sums(const Tensor<T>& x, Layout layout, std::span<const double> shift,
                    std::span<double> sum, std::span<double> square_sum) const override {
    const Shape4& s = x.shape();
    const char* who = "batchnorm_shifted_sums";
    check_nchw(who, layout);
    batchnorm_checks::channels(who, s, shift.size(), "shift");
    batchnorm_checks::channels(who, s, sum.size(), "sum");
    batchnorm_checks::channels(who, s, square_sum.size(), "square_sum");
    const double* k = upload_channels({shift});
    double* planes = plane_sums(s.n * s.c, s.h * s.w, 2);
    batchnorm_shifted_sums(device(x), k, planes, s.n * s.c, s.c, s.h * s.w, stream());
    add_planes(s, planes, 2, {sum, square_sum});
    const double count = static_cast<double>(s.n * s.h * s.w);
    for (std::size_t c = 0; c < sum.size(); ++c)
      sum[c] -= count * shift[c];
  }

  void forward(const Tensor<T>& x, Layout layout, const reference::BatchNormStats& stats,
               std::span<const T> weight, std::span<const T> bias, Tensor<T>& y) const override {
    const Shape4& s = x.shape();
    const char* who = "batchnorm_forward";
    check_nchw(who, layout);
    batchnorm_checks::statistics(who, s, stats);
    batchnorm_checks::channels(who, s, weight.size(), "weight");
    batchnorm_checks::channels(who, s, bias.size(), "bias");
    batchnorm_checks::same(who, s, y.shape(), "output");
    const double* c = upload_channels({stats.mean, stats.invstd});
    batchnorm_forward(device(x), c, c + s.c, weight.data(), bias.data(), device(y), s.n * s.c, s.c,
                      s.h * s.w, stream());
  }

  void backward_sums(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                     const reference::BatchNormStats& stats, std::span<double> sum_dy,
                     std::span<double> sum_dy_xhat) const override {
    const Shape4& s = x.shape();
    const char* who = "batchnorm_backward_sums";
    check_nchw(who, layout);
    batchnorm_checks::statistics(who, s, stats);
    batchnorm_checks::same(who, s, dy.shape(), "output gradient");
    batchnorm_checks::channels(who, s, sum_dy.size(), "sum_dy");
    batchnorm_checks::channels(who, s, sum_dy_xhat.size(), "sum_dy_xhat");
    const double* c = upload_channels({stats.mean, stats.invstd});
    double* planes = plane_sums(s.n * s.c, s.h * s.w, 2);
    batchnorm_backward_sums(device(x), device(dy), c, c + s.c, planes, s.n * s.c, s.c, s.h * s.w,
                            stream());
    add_planes(s, planes, 2, {sum_dy, sum_dy_xhat});
  }

  void backward_data(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                     const reference::BatchNormStats& stats, std::span<const T> weight,
                     std::span<const double> mean_dy, std::span<const double> mean_dy_xhat,
                     Tensor<T>& dx) const override {
    const Shape4& s = x.shape();
    check_nchw("batchnorm_backward_data", layout);
    batchnorm_checks::backward_data("batchnorm_backward_data", x, dy, stats, weight.size(),
                                    mean_dy.size(), mean_dy_xhat.size(), dx);
    const double* c = upload_channels({stats.mean, stats.invstd, mean_dy, mean_dy_xhat});
    batchnorm_backward_data(device(x), device(dy), c, c + s.c, weight.data(), c + 2 * s.c,
                            c + 3 * s.c, device(dx), s.n * s.c, s.c, s.h * s.w, stream());
  }

  // Training alone: every statistic stays on the device, each step's kernels queued without the
  // host waiting (the statistics' kernels run a thread per channel).
  bool trains_alone() const override { return true; }

  void train_forward_alone(const Tensor<T>& x, Layout layout, const BatchNormTraining& training,
                           std::span<const T> running_mean, std::span<const T> running_var,
                           bool load_running, std::span<const T> weight, std::span<const T> bias,
                           Tensor<T>& y) const override {
    const Shape4& s = x.shape();
    const char* who = "batchnorm_train_forward_alone";
    check_nchw(who, layout);
    batchnorm_checks::channels(who, s, running_mean.size(), "running mean");
    batchnorm_checks::channels(who, s, running_var.size(), "running variance");
    batchnorm_checks::channels(who, s, weight.size(), "weight");
    batchnorm_checks::channels(who, s, bias.size(), "bias");
    batchnorm_checks::same(who, s, y.shape(), "output");
    TESSERA_CHECK(training.count == static_cast<double>(s.n * s.h * s.w),
                  std::string(who) + ": the batch must lie wholly in x (" + s.str() + "), not " +
                      std::to_string(training.count) + " values per channel");
    const std::size_t c = static_cast<std::size_t>(s.c);
    T* running = running_.get<T>(2 * c);
    if (load_running) {  // rare (the first step, a checkpoint's values): the host waits here
      std::vector<T> both(running_mean.begin(), running_mean.end());
      both.insert(both.end(), running_var.begin(), running_var.end());
      device_allocator()->upload(running, both.data(), both.size() * sizeof(T));
      loaded_ = c;
    }
    TESSERA_CHECK(loaded_ == c, std::string(who) + ": the running statistics of " +
                                    std::to_string(c) + " channels were never loaded");
    // mean, var, invstd, mean_dy, mean_dy_xhat (C each), then the flag.
    double* at = statistics_.get<double>(5 * c + 1);
    double *mean = at, *var = at + c, *invstd = at + 2 * c;
    int* unconditioned = reinterpret_cast<int*>(at + 5 * c);
    const std::int64_t planes = s.n * s.c, plane = s.h * s.w;
    double* sums = plane_sums(planes, plane, 2);
    batchnorm_shifted_sums(device(x), static_cast<const T*>(running), sums, planes, s.c, plane,
                           stream());
    batchnorm_moments(sums, running, training.count, mean, var, unconditioned, s.n, s.c, stream());
    // The second pass's sums in the same buffer: batchnorm_moments has read the first's by then.
    batchnorm_centered_square_sums_if(device(x), mean, unconditioned, sums, planes, s.c, plane,
                                      stream());
    batchnorm_finish(sums, unconditioned, training.count, training.eps, training.momentum, mean,
                     var, invstd, running, running + c, s.n, s.c, stream());
    batchnorm_forward(device(x), mean, invstd, weight.data(), bias.data(), device(y), planes, s.c,
                      plane, stream());
    count_ = training.count;
  }

  void train_backward_alone(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                            std::span<const T> weight, Tensor<T>& bias_grad, Tensor<T>& weight_grad,
                            Tensor<T>& dx) const override {
    const Shape4& s = x.shape();
    const char* who = "batchnorm_train_backward_alone";
    check_nchw(who, layout);
    batchnorm_checks::same(who, s, dy.shape(), "output gradient");
    batchnorm_checks::same(who, s, dx.shape(), "input gradient");
    batchnorm_checks::channels(who, s, weight.size(), "weight");
    batchnorm_checks::channels(who, s, static_cast<std::size_t>(bias_grad.numel()),
                               "bias gradient");
    batchnorm_checks::channels(who, s, static_cast<std::size_t>(weight_grad.numel()),
                               "weight gradient");
    TESSERA_CHECK(count_ > 0, std::string(who) + ": no training forward before it");
    const std::size_t c = static_cast<std::size_t>(s.c);
    double* at = statistics_.get<double>(5 * c + 1);
    const double *mean = at, *invstd = at + 2 * c;
    double *mean_dy = at + 3 * c, *mean_dy_xhat = at + 4 * c;
    const std::int64_t planes = s.n * s.c, plane = s.h * s.w;
    double* sums = plane_sums(planes, plane, 2);
    batchnorm_backward_sums(device(x), device(dy), mean, invstd, sums, planes, s.c, plane,
                            stream());
    batchnorm_gradients(sums, count_, device(bias_grad), device(weight_grad), mean_dy, mean_dy_xhat,
                        s.n, s.c, stream());
    batchnorm_backward_data(device(x), device(dy), mean, invstd, weight.data(), mean_dy,
                            mean_dy_xhat, device(dx), planes, s.c, plane, stream());
  }

  void store_running(std::span<T> running_mean, std::span<T> running_var) const override {
    TESSERA_CHECK(running_mean.size() == running_var.size(),
                  "batchnorm_store_running: the running mean and variance differ in length");
    const std::size_t c = running_mean.size();
    TESSERA_CHECK(loaded_ == c, "batchnorm_store_running: no running statistics of " +
                                    std::to_string(c) + " channels in the kernel");
    std::vector<T> both(2 * c);
    device_allocator()->download(both.data(), running_.get<T>(2 * c), both.size() * sizeof(T));
    std::copy(both.begin(), both.begin() + static_cast<std::ptrdiff_t>(c), running_mean.begin());
    std::copy(both.begin() + static_cast<std::ptrdiff_t>(c), both.end(), running_var.begin());
  }

 private:
  // Copies per-channel vectors (C values each) one after another into device memory, through
  // page-locked memory and queued: the host does not wait here for the kernels before (a copy
  // from pageable memory would). Before it writes the staging buffer again it waits for the
  // allocator's latest ordered copy (and so for this kernel's last one); here that costs nothing,
  // as the sums before (add_planes) have just waited for the whole stream.
  const double* upload_channels(std::initializer_list<std::span<const double>> vectors) const {
    Allocator& memory = *device_allocator();
    std::size_t count = 0;
    for (const std::span<const double> v : vectors)
      count += v.size();
    memory.wait_ordered();
    if (staged_.bytes() < count * sizeof(double))
      staged_ = Storage(memory.staging(), count * sizeof(double));
    auto* at = static_cast<double*>(staged_.data());
    for (const std::span<const double> v : vectors)
      at = std::copy(v.begin(), v.end(), at);
    double* d = channels_.get<double>(count);
    memory.upload_ordered(d, staged_.data(), count * sizeof(double));
    return d;
  }
  // out[j][c] = the sum over samples n, in order, of planes[k * (n * C + c) + j].
  void add_planes(const Shape4& s, const double* planes, int k,
                  std::initializer_list<std::span<double>> out) const {
    host_.resize(std::size_t(k * s.n * s.c));
    device_allocator()->download(host_.data(), planes, host_.size() * sizeof(double));
    int j = 0;
    for (const std::span<double> o : out) {
      std::fill(o.begin(), o.end(), 0.0);
      for (std::int64_t n = 0; n < s.n; ++n)
        for (std::int64_t c = 0; c < s.c; ++c)
          o[std::size_t(c)] += host_[std::size_t(k * (n * s.c + c) + j)];
      ++j;
    }
  }

  // The K sums per plane of x's planes (plane_sums_size), in plane_sums_.
  double* plane_sums(std::int64_t planes, std::int64_t plane, int k) const {
    return plane_sums_.get<double>(static_cast<std::size_t>(plane_sums_size(planes, plane, k)));
  }

  mutable Scratch channels_, plane_sums_;
  // Training alone: the running mean and variance (T, C each), the batch's statistics, and the
  // forward's count for the backward.
  mutable Scratch running_, statistics_;
  mutable double count_ = 0;
  mutable std::size_t loaded_ = 0;    // channels of the running statistics in running_
  mutable std::vector<double> host_;  // add_planes' download
  mutable Storage staged_;            // upload_channels' page-locked buffer
};

}  // namespace

template <typename T>
std::unique_ptr<PoolKernel<T>> make_pool(PoolKind kind, const PoolShapes& shapes,
                                         const reference::PoolGeometry& g) {
  if (shapes.layout != Layout::nchw) return nullptr;  // nchw16c is the CPU's fast layout
  return std::make_unique<CudaPool<T>>(kind, g);
}
template <typename T>
std::unique_ptr<UpsampleKernel<T>> make_upsample(const reference::UpsampleGeometry& g) {
  return std::make_unique<CudaUpsample<T>>(g);
}
template <typename T>
std::unique_ptr<SpatialSumKernel<T>> make_spatial_sum() {
  return std::make_unique<CudaSpatialSum<T>>();
}
template <typename T>
std::unique_ptr<LinearKernel<T>> make_linear(std::int64_t in, std::int64_t out) {
  return std::make_unique<CudaLinear<T>>(in, out);
}
template <typename T>
std::unique_ptr<BatchNormKernel<T>> make_batch_norm() {
  return std::make_unique<CudaBatchNorm<T>>();
}

#define TESSERA_CUDA_LAYER_KERNELS(T)                                                   \
  template std::unique_ptr<PoolKernel<T>> make_pool<T>(PoolKind, const PoolShapes&,     \
                                                       const reference::PoolGeometry&); \
  template std::unique_ptr<UpsampleKernel<T>> make_upsample<T>(                         \
      const reference::UpsampleGeometry&);                                              \
  template std::unique_ptr<SpatialSumKernel<T>> make_spatial_sum<T>();                  \
  template std::unique_ptr<LinearKernel<T>> make_linear<T>(std::int64_t, std::int64_t); \
  template std::unique_ptr<BatchNormKernel<T>> make_batch_norm<T>();
TESSERA_CUDA_LAYER_KERNELS(float)
TESSERA_CUDA_LAYER_KERNELS(double)
#undef TESSERA_CUDA_LAYER_KERNELS

}  // namespace tessera::cuda
