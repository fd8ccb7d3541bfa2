// The CUDA backend's pointwise kernels, merges and halo copies (kernels/cuda/cuda_backend.hpp):
// checks on the host, then one launcher of kernels/cuda/cuda_kernels.hpp each.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "cuda_backend.hpp"
#include "cuda_context.hpp"
#include "cuda_kernels.hpp"
#include "tessera/error.hpp"

namespace tessera::cuda {
namespace {

template <typename T>
class CudaActivation final : public ActivationKernel<T> {
 public:
  CudaActivation(ActivationKind kind, double slope)
      : kind_(kind), slope_(kind == ActivationKind::leaky_relu ? static_cast<T>(slope) : T(0)) {}
  std::string name() const override { return "cuda"; }

  void forward(const Tensor<T>& x, Tensor<T>& y) override {
    TESSERA_CHECK(y.size() == x.size(), "activation: y's storage is not x's");
    const auto n = static_cast<std::int64_t>(x.size());
    if (kind_ == ActivationKind::sigmoid) {
      sigmoid_forward(device(x), device(y), n, stream());
      y_ = y;  // a device-to-device copy on the stream
      return;
    }
    if (!(positive_.shape() == x.shape()) || positive_.layout() != x.layout())
      positive_ = Tensor<std::uint8_t>(x.shape(), x.layout(), uninitialized, *device_allocator());
    leaky_relu_forward(device(x), device(y), device(positive_), n, slope_, stream());
  }

  void backward(const Tensor<T>& dy, Tensor<T>& dx) const override {
    const auto n = static_cast<std::int64_t>(dx.size());
    if (kind_ == ActivationKind::sigmoid) {
      TESSERA_CHECK(y_.size() == dx.size(), "activation: backward without its forward");
      sigmoid_backward(device(y_), device(dy), device(dx), n, stream());
      return;
    }
    TESSERA_CHECK(positive_.size() == dx.size() && dy.size() == dx.size(),
                  "activation: backward without its forward");
    leaky_relu_backward(device(dy), device(positive_), device(dx), n, slope_, stream());
  }

 private:
  ActivationKind kind_;
  T slope_;
  Tensor<T> y_;                    // sigmoid's output
  Tensor<std::uint8_t> positive_;  // (leaky) ReLU: x > 0
};

template <typename T>
class CudaDropout final : public DropoutKernel<T> {
 public:
  explicit CudaDropout(double p) : p_(p), keep_(elementwise::dropout_keep<T>(p)) {}
  std::string name() const override { return "cuda"; }

  void forward(const Tensor<T>& x, const TileOrigin& at, std::uint64_t seed, std::uint64_t id,
               Tensor<T>& mask, Tensor<T>& y) const override {
    const Shape4& s = x.shape();
    check_dropout_tile(s, x.layout(), at, mask.shape(), y.shape());
    dropout_forward(device(x), device(mask), device(y), tile_index(at, s), seed, id, p_, keep_,
                    stream());
  }

  void backward(const Tensor<T>& dy, const Tensor<T>& mask, Tensor<T>& dx) const override {
    check_dropout_backward(dy.shape(), mask.shape(), dx.shape());
    multiply(device(dy), device(mask), device(dx), dy.numel(), stream());
  }

 private:
  double p_;
  T keep_;
};

template <typename T>
class CudaUpdate final : public UpdateKernel<T> {
 public:
  std::string name() const override { return "cuda"; }
  void sgd(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars<T>& s) const override {
    cuda::sgd(p, g, buf, n, s, stream());
  }
  void adam(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars<T>& s) const override {
    cuda::adam(p, g, m, v, n, s, stream());
  }
};

template <typename T>
class CudaMerge final : public MergeKernel<T> {
 public:
  std::string name() const override { return "cuda"; }
  void put_channels(const Tensor<T>& x, Tensor<T>& y, std::int64_t offset) const override {
    const Shape4 xs = x.shape(), ys = y.shape();
    check_concat(xs, ys, offset);
    copy_box(device(x), device(y) + offset * ys.h * ys.w, blocks(xs, xs.c, ys.c), false, stream());
  }
  void take_channels(const Tensor<T>& y, std::int64_t offset, Tensor<T>& x) const override {
    const Shape4 xs = x.shape(), ys = y.shape();
    check_concat(xs, ys, offset);
    copy_box(device(y) + offset * ys.h * ys.w, device(x), blocks(xs, ys.c, xs.c), false, stream());
  }
  void add(const Tensor<T>& b, Tensor<T>& a) const override {
    TESSERA_CHECK(a.shape() == b.shape() && a.layout() == b.layout(),
                  "add: shapes " + a.shape().str() + " and " + b.shape().str() + " differ");
    cuda::add(device(b), device(a), a.numel(), stream());
  }
  void add_bias(std::span<const T> bias, Tensor<T>& y) const override {
    const Shape4& s = y.shape();
    check_bias_shape(bias.size(), s, y.layout(), "bias");
    cuda::add_bias(bias.data(), device(y), s.n * s.c, s.c, s.h * s.w, stream());
  }
  void add_bias_grad(const Tensor<T>& dy, std::span<T> dbias) const override {
    const Shape4& s = dy.shape();
    check_bias_shape(dbias.size(), s, dy.layout(), "bias gradient");
    double* sums =
        sums_.get<double>(static_cast<std::size_t>(plane_sums_size(s.n * s.c, s.h * s.w, 1)));
    cuda::add_bias_grad(device(dy), dbias.data(), s.n, s.c, s.h * s.w, sums, stream());
  }

 private:
  // x's channel block of each sample: samples x 1 x (channels * pixels), one contiguous row a
  // sample, between tensors of `from` and `to` channels (the same pixels).
  static Box3 blocks(const Shape4& xs, std::int64_t from, std::int64_t to) {
    const std::int64_t plane = xs.h * xs.w;
    return make_box3(xs.n, 1, xs.c * plane, {from * plane, 0, 1}, {to * plane, 0, 1});
  }
  mutable Scratch sums_;  // add_bias_grad's plane sums
};

// Softmax cross-entropy: one loss per pixel computed on the device and summed there in chunks
// (sum_values: a fixed order, deterministic), so that only the total comes back. It differs from
// the CPU's sum in pixel order by double rounding. The labels are checked on the device (a label
// that is not a class gives a NaN loss; the host then finds it and names it), not in a pass on
// the host while the GPU waits for the loss, and copied only when they changed since the last
// call: a benchmark's or gradcheck's batch, the same every step, stays on the device. The
// comparison and the copy into page-locked memory run on a thread of their own from prepare()
// (the start of the step) while the host queues the forward pass: on an H200 with unet-small at
// 2048x2048 the host's pass over 16 MiB of labels kept the GPU idle for 3-7 ms a step.
template <typename T>
class CudaLoss final : public LossKernel<T> {
 public:
  CudaLoss() = default;
  CudaLoss(const CudaLoss&) = delete;
  CudaLoss& operator=(const CudaLoss&) = delete;
  ~CudaLoss() override {
    settle();
    // A call that threw after queueing the labels' upload left it unwaited for.
    if (upload_queued_) device_allocator()->wait_ordered_quietly();
  }
  std::string name() const override { return "cuda"; }

  void prepare(std::span<const std::int32_t> labels) const override {
    settle();
    if (labels.empty()) return;
    const std::size_t bytes = labels.size_bytes();
    make_ready(bytes);
    try {
      staged_changed_ =
          std::async(std::launch::async, [this, labels, bytes] { return stage(labels, bytes); });
      prepared_ = labels;
    } catch (const std::exception&) {  // no thread: cross_entropy stages them itself
    }
  }

  void settle() const noexcept override {
    if (staged_changed_.valid()) {
      try {  // a stage not uploaded: stage() cleared on_device_ if it copied
        staged_changed_.get();
      } catch (...) {  // nothing stage() does throws
      }
    }
    prepared_ = {};
  }

  double cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                       Tensor<T>* dlogits) const override {
    const Shape4& s = logits.shape();
    check_cross_entropy_shapes(s, labels.size(), dlogits != nullptr ? &dlogits->shape() : nullptr);
    const std::size_t pixels = labels.size();
    if (pixels == 0) return 0;
    Allocator& memory = *device_allocator();
    const std::size_t bytes = pixels * sizeof(std::int32_t);
    // The labels prepare() staged, or these staged here.
    bool changed = false;
    if (staged_changed_.valid() && prepared_.data() == labels.data() &&
        prepared_.size() == labels.size()) {
      changed = staged_changed_.get();
      prepared_ = {};
    } else {
      settle();
      make_ready(bytes);
      changed = stage(labels, bytes);
    }
    // Through page-locked memory, queued behind the forward pass's kernels (the host does not
    // wait for them here); the download of the total below waits for this copy too.
    if (changed) {
      upload_queued_ = true;
      memory.upload_ordered(labels_.data(), staged_labels_.data(), bytes);
      on_device_ = true;
    }
    cuda::cross_entropy(device(logits), static_cast<const std::int32_t*>(labels_.data()), scale,
                        dlogits != nullptr ? device(*dlogits) : nullptr,
                        static_cast<double*>(losses_.data()), s.n, s.c, s.h * s.w, stream());
    const auto n = static_cast<std::int64_t>(pixels);
    double* sums = sums_.get<double>(static_cast<std::size_t>(plane_sums_size(1, n, 1)));
    sum_values(static_cast<const double*>(losses_.data()), n, sums, stream());
    double total = 0;
    memory.download(&total, sums, sizeof(double));  // after the kernels and the upload
    upload_queued_ = false;
    // A label outside the classes made it NaN: the host's check names it. (Non-finite logits
    // also make it so; their loss is returned for the caller's check.)
    if (!std::isfinite(total)) check_labels(labels, s.c);
    return total;
  }

 private:
  // The staging buffer free to write (an upload queued by a call that threw before waiting for
  // it is waited for) and buffers for `bytes` of labels (the same tile every step: made once).
  void make_ready(std::size_t bytes) const {
    if (upload_queued_) {
      device_allocator()->wait_ordered();
      upload_queued_ = false;
    }
    if (labels_.bytes() == bytes) return;
    Allocator& memory = *device_allocator();
    labels_ = Storage(memory, bytes);
    staged_labels_ = Storage(memory.staging(), bytes);
    losses_ = Storage(memory, bytes / sizeof(std::int32_t) * sizeof(double));
    on_device_ = false;
  }
  // Whether `labels` must go to the device: staged_labels_ holds what labels_ holds once its
  // upload has run, so labels equal to it are compared, not copied. Else copied into it
  // (on_device_ false until the upload is queued). Touches no device state: runs on prepare()'s
  // thread.
  bool stage(std::span<const std::int32_t> labels, std::size_t bytes) const {
    if (on_device_ && std::memcmp(staged_labels_.data(), labels.data(), bytes) == 0) return false;
    on_device_ = false;
    std::memcpy(staged_labels_.data(), labels.data(), bytes);
    return true;
  }

  mutable Storage labels_, staged_labels_, losses_;
  // labels_ holds (or its queued upload brings) what staged_labels_ holds.
  mutable std::atomic<bool> on_device_ = false;
  mutable bool upload_queued_ = false;        // the labels' upload may still read staged_labels_
  mutable std::future<bool> staged_changed_;  // prepare()'s stage(): whether to upload
  mutable std::span<const std::int32_t> prepared_;  // the labels given to prepare()
  mutable Scratch sums_;
};

// Halo boxes on NCHW tensors (the CPU's nchw16c is oneDNN's layout; cuDNN computes in NCHW), or on
// channel slices of them (Planes with a sample_stride: a taken concat's input in its consumer's
// window): one launch over every plane, or one per sample where a side is a slice.
template <typename T>
class CudaHaloCopy final : public HaloCopyKernel<T> {
 public:
  std::string name() const override { return "cuda"; }
  MemorySpace space() const override { return MemorySpace::device; }
  bool takes_channel_slices() const override { return true; }

  void move(const Planes<const T>& from, const Planes<T>& to, const Box& box,
            Direction how) const override {
    check_nchw(from.layout);
    check_nchw(to.layout);
    TESSERA_CHECK(
        from.shape.n * from.shape.c == to.shape.n * to.shape.c,
        "halo copy: " + from.shape.str() + " and " + to.shape.str() + " have different planes");
    if (box.empty()) return;
    for_each_sample(from, to, [&](std::int64_t first, std::int64_t planes) {
      copy_box(from.at(first, box.h.begin, box.w.begin), to.at(first, box.h.begin, box.w.begin),
               planes_box(planes, box, strides(from.shape), strides(to.shape)),
               how == Direction::accumulate, stream());
    });
  }

  void pack(const Planes<const T>& t, const Box& box, T* message) const override {
    check_nchw(t.layout);
    if (box.empty()) return;
    for_each_sample(t, t, [&](std::int64_t first, std::int64_t planes) {
      copy_box(t.at(first, box.h.begin, box.w.begin), message + first * box.size(),
               planes_box(planes, box, strides(t.shape), strides(box)), false, stream());
    });
  }

  void unpack(const T* message, const Box& box, const Planes<T>& t, Direction how) const override {
    check_nchw(t.layout);
    if (box.empty()) return;
    for_each_sample(t, t, [&](std::int64_t first, std::int64_t planes) {
      copy_box(message + first * box.size(), t.at(first, box.h.begin, box.w.begin),
               planes_box(planes, box, strides(box), strides(t.shape)),
               how == Direction::accumulate, stream());
    });
  }

  void fill_outside(const Planes<T>& t, const Box& keep, T value) const override {
    check_nchw(t.layout);
    const Box& all = t.origin;
    const Box in = intersect(keep, all);
    if (in.empty()) {
      fill_region(t, all, value);
      return;
    }
    fill_region(t, {{all.h.begin, in.h.begin}, all.w}, value);  // above
    fill_region(t, {{in.h.end, all.h.end}, all.w}, value);      // below
    fill_region(t, {in.h, {all.w.begin, in.w.begin}}, value);   // left
    fill_region(t, {in.h, {in.w.end, all.w.end}}, value);       // right
  }

 private:
  static void check_nchw(Layout layout) {
    TESSERA_CHECK(layout == Layout::nchw, "halo copy on the GPU: tensors must be NCHW");
  }
  // f(first plane, planes) over runs of planes at one stride from each other on both sides:
  // all of them, or each sample's where a side is a channel slice. (Both sides hold the same
  // planes: move checks it.)
  template <typename A, typename B, typename F>
  static void for_each_sample(const Planes<A>& a, const Planes<B>& b, F f) {
    const std::int64_t planes = a.shape.n * a.shape.c;
    if (a.sample_stride == 0 && b.sample_stride == 0) {
      f(0, planes);
      return;
    }
    TESSERA_CHECK(a.shape.n == b.shape.n && a.shape.c == b.shape.c,
                  "halo copy on the GPU: a channel slice of " + a.shape.str() + " and " +
                      b.shape.str() + " hold different samples or channels");
    for (std::int64_t first = 0; first < planes; first += a.shape.c)
      f(first, a.shape.c);
  }
  // Planes of a tensor, or of a message holding `box` of each plane.
  static Strides3 strides(const Shape4& s) { return plane_strides(s.h, s.w); }
  static Strides3 strides(const Box& box) { return plane_strides(box.h.size(), box.w.size()); }
  // `box` of `planes` planes of a tensor.
  static Box3 planes_box(std::int64_t planes, const Box& box, const Strides3& src,
                         const Strides3& dst) {
    return make_box3(planes, box.h.size(), box.w.size(), src, dst);
  }
  static void fill_region(const Planes<T>& t, const Box& region, T value) {
    if (region.empty()) return;
    for_each_sample(t, t, [&](std::int64_t first, std::int64_t planes) {
      fill_box(t.at(first, region.h.begin, region.w.begin),
               planes_box(planes, region, {}, strides(t.shape)), value, stream());
    });
  }
};

}  // namespace

template <typename T>
std::unique_ptr<ActivationKernel<T>> make_activation(ActivationKind kind, double slope) {
  return std::make_unique<CudaActivation<T>>(kind, slope);
}
template <typename T>
std::unique_ptr<DropoutKernel<T>> make_dropout(double p) {
  return std::make_unique<CudaDropout<T>>(p);
}
template <typename T>
std::unique_ptr<UpdateKernel<T>> make_update() {
  return std::make_unique<CudaUpdate<T>>();
}
template <typename T>
std::unique_ptr<MergeKernel<T>> make_merge() {
  return std::make_unique<CudaMerge<T>>();
}
template <typename T>
std::unique_ptr<HaloCopyKernel<T>> make_halo_copy() {
  return std::make_unique<CudaHaloCopy<T>>();
}
template <typename T>
std::unique_ptr<LossKernel<T>> make_loss() {
  return std::make_unique<CudaLoss<T>>();
}

#define TESSERA_CUDA_LOCAL(T)                                                               \
  template std::unique_ptr<ActivationKernel<T>> make_activation<T>(ActivationKind, double); \
  template std::unique_ptr<DropoutKernel<T>> make_dropout<T>(double);                       \
  template std::unique_ptr<UpdateKernel<T>> make_update<T>();                               \
  template std::unique_ptr<MergeKernel<T>> make_merge<T>();                                 \
  template std::unique_ptr<HaloCopyKernel<T>> make_halo_copy<T>();                          \
  template std::unique_ptr<LossKernel<T>> make_loss<T>();
TESSERA_CUDA_LOCAL(float)
TESSERA_CUDA_LOCAL(double)
#undef TESSERA_CUDA_LOCAL

}  // namespace tessera::cuda
