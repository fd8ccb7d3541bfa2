// The emulated device backend (backend.hpp, KernelBackend::emulated): the reference backend's
// kernels computing in emulated device memory (allocator.hpp). Each kernel call opens an
// EmulatedKernelScope, so inside a kernel the memory reads as host memory and outside it every
// host accessor refuses it: a model that trains here reaches its device tensors only through
// kernels and copies, as a GPU needs.
#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/batchnorm_kernel.hpp"

namespace tessera {
namespace {

// Calls f with emulated device memory open to the host.
template <typename F>
decltype(auto) in_kernel(F&& f) {
  EmulatedKernelScope scope;
  return std::forward<F>(f)();
}

template <typename T>
class EmulatedConv final : public ConvKernel<T> {
 public:
  explicit EmulatedConv(std::unique_ptr<ConvKernel<T>> k) : k_(std::move(k)) {}
  void forward(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias,
               Tensor<T>& y) override {
    in_kernel([&] { k_->forward(x, w, bias, y); });
  }
  void backward_data(const Tensor<T>& dy, const Tensor<T>& w, Tensor<T>& dx) override {
    in_kernel([&] { k_->backward_data(dy, w, dx); });
  }
  void backward_filter(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& dw,
                       std::span<T> dbias) override {
    in_kernel([&] { k_->backward_filter(x, dy, dw, dbias); });
  }
  void forward_box(const Tensor<T>& x, BoxAt x_at, const Tensor<T>& w, std::span<const T> bias,
                   Tensor<T>& y, BoxAt y_at) override {
    in_kernel([&] { k_->forward_box(x, x_at, w, bias, y, y_at); });
  }
  std::string name() const override { return "emulated " + k_->name(); }
  bool applies_activation() const override { return k_->applies_activation(); }

 private:
  std::unique_ptr<ConvKernel<T>> k_;
};

template <typename T>
class EmulatedPool final : public PoolKernel<T> {
 public:
  explicit EmulatedPool(std::unique_ptr<PoolKernel<T>> k) : k_(std::move(k)) {}
  void forward(const Tensor<T>& x, Tensor<T>& y) override {
    in_kernel([&] { k_->forward(x, y); });
  }
  void backward(const Tensor<T>& dy, Tensor<T>& dx) override {
    in_kernel([&] { k_->backward(dy, dx); });
  }
  T window_padding() const override { return k_->window_padding(); }
  std::string name() const override { return "emulated " + k_->name(); }

 private:
  std::unique_ptr<PoolKernel<T>> k_;
};

template <typename T>
class EmulatedBatchNorm final : public BatchNormKernel<T> {
 public:
  explicit EmulatedBatchNorm(std::unique_ptr<BatchNormKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  void sum(const Tensor<T>& x, Layout layout, std::span<double> sum) const override {
    in_kernel([&] { k_->sum(x, layout, sum); });
  }
  void centered_square_sum(const Tensor<T>& x, Layout layout, std::span<const double> mean,
                           std::span<double> sum) const override {
    in_kernel([&] { k_->centered_square_sum(x, layout, mean, sum); });
  }
  // The wrapped kernel's one pass (the layer's path on the CPU), not the two-pass default.
  void shifted_sums(const Tensor<T>& x, Layout layout, std::span<const double> shift,
                    std::span<double> sum, std::span<double> square_sum) const override {
    in_kernel([&] { k_->shifted_sums(x, layout, shift, sum, square_sum); });
  }
  void forward(const Tensor<T>& x, Layout layout, const reference::BatchNormStats& stats,
               std::span<const T> weight, std::span<const T> bias, Tensor<T>& y) const override {
    in_kernel([&] { k_->forward(x, layout, stats, weight, bias, y); });
  }
  bool applies(const FusedActivation& f) const override { return k_->applies(f); }
  void forward_activated(const Tensor<T>& x, Layout layout, const reference::BatchNormStats& stats,
                         std::span<const T> weight, std::span<const T> bias,
                         const FusedActivation& f, Tensor<T>& y) const override {
    in_kernel([&] { k_->forward_activated(x, layout, stats, weight, bias, f, y); });
  }
  void backward_sums(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                     const reference::BatchNormStats& stats, std::span<double> sum_dy,
                     std::span<double> sum_dy_xhat) const override {
    in_kernel([&] { k_->backward_sums(x, dy, layout, stats, sum_dy, sum_dy_xhat); });
  }
  void backward_data(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                     const reference::BatchNormStats& stats, std::span<const T> weight,
                     std::span<const double> mean_dy, std::span<const double> mean_dy_xhat,
                     Tensor<T>& dx) const override {
    in_kernel([&] { k_->backward_data(x, dy, layout, stats, weight, mean_dy, mean_dy_xhat, dx); });
  }
  void backward_sums_activated(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                               const reference::BatchNormStats& stats,
                               const ForwardActivation<T>& a, std::span<double> sum_dy,
                               std::span<double> sum_dy_xhat) const override {
    in_kernel([&] { k_->backward_sums_activated(x, dy, layout, stats, a, sum_dy, sum_dy_xhat); });
  }
  void backward_data_activated(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                               const reference::BatchNormStats& stats,
                               const ForwardActivation<T>& a, std::span<const double> mean_dy,
                               std::span<const double> mean_dy_xhat, Tensor<T>& dx) const override {
    in_kernel(
        [&] { k_->backward_data_activated(x, dy, layout, stats, a, mean_dy, mean_dy_xhat, dx); });
  }

  // Trains alone as the CUDA kernel does (kernels/cuda/cuda_layer_kernels.cpp), with the wrapped
  // kernel's passes: the statistics and the running statistics stay in the kernel, which the host
  // then reads only through store_running (BatchNorm2d's bookkeeping checked without a GPU).
  bool trains_alone() const override { return true; }
  void train_forward_alone(const Tensor<T>& x, Layout layout, const BatchNormTraining& training,
                           std::span<const T> running_mean, std::span<const T> running_var,
                           bool load_running, std::span<const T> weight, std::span<const T> bias,
                           Tensor<T>& y) const override {
    const std::size_t channels = running_mean.size();
    if (load_running) {
      running_.assign(running_mean.begin(), running_mean.end());
      running_.insert(running_.end(), running_var.begin(), running_var.end());
    }
    TESSERA_CHECK(running_.size() == 2 * channels,
                  "emulated batch norm: its running statistics were never loaded");
    mean_.assign(channels, 0.0);
    invstd_.assign(channels, 0.0);
    in_kernel([&] {
      const std::span<T> running(running_);
      batch_statistics(*k_, x, layout, training, running.first(channels), running.last(channels),
                       std::span<double>(mean_), std::span<double>(invstd_),
                       [](std::span<double>) {});
      k_->forward(x, layout, {mean_, invstd_}, weight, bias, y);
    });
    count_ = training.count;
  }
  void train_backward_alone(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                            std::span<const T> weight, Tensor<T>& bias_grad, Tensor<T>& weight_grad,
                            Tensor<T>& dx) const override {
    TESSERA_CHECK(count_ > 0, "emulated batch norm: a backward alone without its forward");
    const std::size_t channels = mean_.size();
    std::vector<double> sum_dy(channels), sum_dy_xhat(channels);
    const reference::BatchNormStats stats{mean_, invstd_};
    in_kernel([&] {
      k_->backward_sums(x, dy, layout, stats, sum_dy, sum_dy_xhat);
      for (std::size_t c = 0; c < channels; ++c) {
        bias_grad.data()[c] += static_cast<T>(sum_dy[c]);
        weight_grad.data()[c] += static_cast<T>(sum_dy_xhat[c]);
        sum_dy[c] /= count_;
        sum_dy_xhat[c] /= count_;
      }
      k_->backward_data(x, dy, layout, stats, weight, sum_dy, sum_dy_xhat, dx);
    });
  }
  void store_running(std::span<T> running_mean, std::span<T> running_var) const override {
    const std::size_t channels = running_mean.size();
    TESSERA_CHECK(running_.size() == 2 * channels && running_var.size() == channels,
                  "emulated batch norm: no running statistics of that length");
    std::copy(running_.begin(), running_.begin() + static_cast<std::ptrdiff_t>(channels),
              running_mean.begin());
    std::copy(running_.begin() + static_cast<std::ptrdiff_t>(channels), running_.end(),
              running_var.begin());
  }

 private:
  std::unique_ptr<BatchNormKernel<T>> k_;
  // Training alone: the running mean then variance, the batch's statistics, its count.
  mutable std::vector<T> running_;
  mutable std::vector<double> mean_, invstd_;
  mutable double count_ = 0;
};

template <typename T>
class EmulatedActivation final : public ActivationKernel<T> {
 public:
  explicit EmulatedActivation(std::unique_ptr<ActivationKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  void forward(const Tensor<T>& x, Tensor<T>& y) override {
    in_kernel([&] { k_->forward(x, y); });
  }
  void backward(const Tensor<T>& dy, Tensor<T>& dx) const override {
    in_kernel([&] { k_->backward(dy, dx); });
  }
  bool works_from_output() const override { return k_->works_from_output(); }
  void forward_unkept(const Tensor<T>& x, Tensor<T>& y) override {
    in_kernel([&] { k_->forward_unkept(x, y); });
  }
  void keep_output(const Tensor<T>& y) override {
    in_kernel([&] { k_->keep_output(y); });
  }
  void backward_from_output(const Tensor<T>& y, Tensor<T>& grad) const override {
    in_kernel([&] { k_->backward_from_output(y, grad); });
  }

 private:
  std::unique_ptr<ActivationKernel<T>> k_;
};

template <typename T>
class EmulatedLoss final : public LossKernel<T> {
 public:
  explicit EmulatedLoss(std::unique_ptr<LossKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  double cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                       Tensor<T>* dlogits) const override {
    return in_kernel([&] { return k_->cross_entropy(logits, labels, scale, dlogits); });
  }

 private:
  std::unique_ptr<LossKernel<T>> k_;
};

template <typename T>
class EmulatedUpdate final : public UpdateKernel<T> {
 public:
  explicit EmulatedUpdate(std::unique_ptr<UpdateKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  void sgd(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars<T>& s) const override {
    in_kernel([&] { k_->sgd(p, g, buf, n, s); });
  }
  void adam(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars<T>& s) const override {
    in_kernel([&] { k_->adam(p, g, m, v, n, s); });
  }

 private:
  std::unique_ptr<UpdateKernel<T>> k_;
};

template <typename T>
class EmulatedMerge final : public MergeKernel<T> {
 public:
  explicit EmulatedMerge(std::unique_ptr<MergeKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  void put_channels(const Tensor<T>& x, Tensor<T>& y, std::int64_t offset) const override {
    in_kernel([&] { k_->put_channels(x, y, offset); });
  }
  void take_channels(const Tensor<T>& y, std::int64_t offset, Tensor<T>& x) const override {
    in_kernel([&] { k_->take_channels(y, offset, x); });
  }
  void add(const Tensor<T>& b, Tensor<T>& a) const override {
    in_kernel([&] { k_->add(b, a); });
  }
  void add_bias(std::span<const T> bias, Tensor<T>& y) const override {
    in_kernel([&] { k_->add_bias(bias, y); });
  }
  void add_bias_grad(const Tensor<T>& dy, std::span<T> dbias) const override {
    in_kernel([&] { k_->add_bias_grad(dy, dbias); });
  }

 private:
  std::unique_ptr<MergeKernel<T>> k_;
};

template <typename T>
class EmulatedDropout final : public DropoutKernel<T> {
 public:
  explicit EmulatedDropout(std::unique_ptr<DropoutKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  void forward(const Tensor<T>& x, const TileOrigin& origin, std::uint64_t seed,
               std::uint64_t stream, Tensor<T>& mask, Tensor<T>& y) const override {
    in_kernel([&] { k_->forward(x, origin, seed, stream, mask, y); });
  }
  void backward(const Tensor<T>& dy, const Tensor<T>& mask, Tensor<T>& dx) const override {
    in_kernel([&] { k_->backward(dy, mask, dx); });
  }

 private:
  std::unique_ptr<DropoutKernel<T>> k_;
};

template <typename T>
class EmulatedUpsample final : public UpsampleKernel<T> {
 public:
  explicit EmulatedUpsample(std::unique_ptr<UpsampleKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  bool takes_blocked() const override { return k_->takes_blocked(); }
  bool converts_blocked_to_nchw() const override { return k_->converts_blocked_to_nchw(); }
  void forward(const Tensor<T>& x, Tensor<T>& y) const override {
    in_kernel([&] { k_->forward(x, y); });
  }
  void backward(const Tensor<T>& dy, Tensor<T>& dx) const override {
    in_kernel([&] { k_->backward(dy, dx); });
  }

 private:
  std::unique_ptr<UpsampleKernel<T>> k_;
};

template <typename T>
class EmulatedSpatialSum final : public SpatialSumKernel<T> {
 public:
  explicit EmulatedSpatialSum(std::unique_ptr<SpatialSumKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  void sums(const Tensor<T>& x, std::span<T> sums) const override {
    in_kernel([&] { k_->sums(x, sums); });
  }
  void spread(std::span<const T> g, Tensor<T>& dx) const override {
    in_kernel([&] { k_->spread(g, dx); });
  }

 private:
  std::unique_ptr<SpatialSumKernel<T>> k_;
};

template <typename T>
class EmulatedLinear final : public LinearKernel<T> {
 public:
  explicit EmulatedLinear(std::unique_ptr<LinearKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  void forward(std::span<const T> x, std::span<const T> w, std::span<const T> bias, std::span<T> y,
               std::int64_t n) const override {
    in_kernel([&] { k_->forward(x, w, bias, y, n); });
  }
  void backward_data(std::span<const T> dy, std::span<const T> w, std::span<T> dx,
                     std::int64_t n) const override {
    in_kernel([&] { k_->backward_data(dy, w, dx, n); });
  }
  void backward_weights(std::span<const T> x, std::span<const T> dy, std::span<T> dw,
                        std::span<T> dbias, std::int64_t n) const override {
    in_kernel([&] { k_->backward_weights(x, dy, dw, dbias, n); });
  }

 private:
  std::unique_ptr<LinearKernel<T>> k_;
};

// The halo copies work on raw pointers into the tensors (Planes), which no accessor checks; the
// exchange checks their space against space() and packs into device buffers.
template <typename T>
class EmulatedHaloCopy final : public HaloCopyKernel<T> {
 public:
  explicit EmulatedHaloCopy(std::unique_ptr<HaloCopyKernel<T>> k) : k_(std::move(k)) {}
  std::string name() const override { return "emulated " + k_->name(); }
  MemorySpace space() const override { return MemorySpace::device; }
  void move(const Planes<const T>& from, const Planes<T>& to, const Box& box,
            Direction how) const override {
    in_kernel([&] { k_->move(from, to, box, how); });
  }
  void pack(const Planes<const T>& t, const Box& box, T* message) const override {
    in_kernel([&] { k_->pack(t, box, message); });
  }
  void unpack(const T* message, const Box& box, const Planes<T>& t, Direction how) const override {
    in_kernel([&] { k_->unpack(message, box, t, how); });
  }
  void fill_outside(const Planes<T>& t, const Box& keep, T value) const override {
    in_kernel([&] { k_->fill_outside(t, keep, value); });
  }
  bool takes_channel_slices() const override { return k_->takes_channel_slices(); }

 private:
  std::unique_ptr<HaloCopyKernel<T>> k_;
};

// Wraps what `made` returns (null stays null: the layer then tries another layout).
template <template <typename> class Wrapper, typename T, typename Kernel>
std::unique_ptr<Kernel> wrap(std::unique_ptr<Kernel> made) {
  if (!made) return nullptr;
  return std::make_unique<Wrapper<T>>(std::move(made));
}

class EmulatedBackend final : public Backend {
 public:
  KernelBackend kind() const override { return KernelBackend::emulated; }
  std::string description() const override {
    return "emulated device: the reference kernels in device memory emulated in host memory "
           "(checks that nothing reaches device tensors from the host; for tests, slow)";
  }
  Allocator& allocator() const override { return emulated_device_allocator(); }

 protected:
  std::unique_ptr<ConvKernel<float>> conv_float(const ConvShapes& s,
                                                const reference::ConvGeometry& g) const override {
    return wrap<EmulatedConv, float>(Backend::conv_float(s, g));
  }
  std::unique_ptr<ConvKernel<double>> conv_double(const ConvShapes& s,
                                                  const reference::ConvGeometry& g) const override {
    return wrap<EmulatedConv, double>(Backend::conv_double(s, g));
  }
  std::unique_ptr<PoolKernel<float>> pool_float(PoolKind kind, const PoolShapes& s,
                                                const reference::PoolGeometry& g) const override {
    return wrap<EmulatedPool, float>(Backend::pool_float(kind, s, g));
  }
  std::unique_ptr<PoolKernel<double>> pool_double(PoolKind kind, const PoolShapes& s,
                                                  const reference::PoolGeometry& g) const override {
    return wrap<EmulatedPool, double>(Backend::pool_double(kind, s, g));
  }
  std::unique_ptr<BatchNormKernel<float>> batch_norm_float() const override {
    return wrap<EmulatedBatchNorm, float>(Backend::batch_norm_float());
  }
  std::unique_ptr<BatchNormKernel<double>> batch_norm_double() const override {
    return wrap<EmulatedBatchNorm, double>(Backend::batch_norm_double());
  }
  std::unique_ptr<ActivationKernel<float>> make_activation(ActivationKind kind, double slope,
                                                           float t) const override {
    return wrap<EmulatedActivation, float>(Backend::make_activation(kind, slope, t));
  }
  std::unique_ptr<ActivationKernel<double>> make_activation(ActivationKind kind, double slope,
                                                            double t) const override {
    return wrap<EmulatedActivation, double>(Backend::make_activation(kind, slope, t));
  }
  std::unique_ptr<UpsampleKernel<float>> make_upsample(const reference::UpsampleGeometry& g,
                                                       float t) const override {
    return wrap<EmulatedUpsample, float>(Backend::make_upsample(g, t));
  }
  std::unique_ptr<UpsampleKernel<double>> make_upsample(const reference::UpsampleGeometry& g,
                                                        double t) const override {
    return wrap<EmulatedUpsample, double>(Backend::make_upsample(g, t));
  }
  std::unique_ptr<SpatialSumKernel<float>> make_spatial_sum(float t) const override {
    return wrap<EmulatedSpatialSum, float>(Backend::make_spatial_sum(t));
  }
  std::unique_ptr<SpatialSumKernel<double>> make_spatial_sum(double t) const override {
    return wrap<EmulatedSpatialSum, double>(Backend::make_spatial_sum(t));
  }
  std::unique_ptr<MergeKernel<float>> make_merge(float t) const override {
    return wrap<EmulatedMerge, float>(Backend::make_merge(t));
  }
  std::unique_ptr<MergeKernel<double>> make_merge(double t) const override {
    return wrap<EmulatedMerge, double>(Backend::make_merge(t));
  }
  std::unique_ptr<HaloCopyKernel<float>> make_halo_copy(float t) const override {
    return wrap<EmulatedHaloCopy, float>(Backend::make_halo_copy(t));
  }
  std::unique_ptr<HaloCopyKernel<double>> make_halo_copy(double t) const override {
    return wrap<EmulatedHaloCopy, double>(Backend::make_halo_copy(t));
  }
  std::unique_ptr<DropoutKernel<float>> make_dropout(double p, float t) const override {
    return wrap<EmulatedDropout, float>(Backend::make_dropout(p, t));
  }
  std::unique_ptr<DropoutKernel<double>> make_dropout(double p, double t) const override {
    return wrap<EmulatedDropout, double>(Backend::make_dropout(p, t));
  }
  std::unique_ptr<UpdateKernel<float>> make_update(float t) const override {
    return wrap<EmulatedUpdate, float>(Backend::make_update(t));
  }
  std::unique_ptr<UpdateKernel<double>> make_update(double t) const override {
    return wrap<EmulatedUpdate, double>(Backend::make_update(t));
  }
  std::unique_ptr<LossKernel<float>> make_loss(float t) const override {
    return wrap<EmulatedLoss, float>(Backend::make_loss(t));
  }
  std::unique_ptr<LossKernel<double>> make_loss(double t) const override {
    return wrap<EmulatedLoss, double>(Backend::make_loss(t));
  }
  std::unique_ptr<LinearKernel<float>> make_linear(std::int64_t in, std::int64_t out,
                                                   float t) const override {
    return wrap<EmulatedLinear, float>(Backend::make_linear(in, out, t));
  }
  std::unique_ptr<LinearKernel<double>> make_linear(std::int64_t in, std::int64_t out,
                                                    double t) const override {
    return wrap<EmulatedLinear, double>(Backend::make_linear(in, out, t));
  }
};

}  // namespace

const Backend& emulated_backend() {
  static const EmulatedBackend backend;
  return backend;
}

}  // namespace tessera
