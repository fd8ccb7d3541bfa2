// The CUDA backend's pointwise kernels, merges and halo copies (kernels/cuda/cuda_backend.hpp):
// checks on the host, then one launcher of kernels/cuda/cuda_kernels.hpp each.
#include <cstdint>
#include <cstring>
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
  // x's channel block of each sample: samples x (channels * pixels) x 1, between tensors of
  // `from` and `to` channels (the same pixels).
  static Box3 blocks(const Shape4& xs, std::int64_t from, std::int64_t to) {
    const std::int64_t plane = xs.h * xs.w;
    return make_box3(xs.n, xs.c * plane, 1, {from * plane, 1, 0}, {to * plane, 1, 0});
  }
  mutable Scratch sums_;  // add_bias_grad's plane sums
};

// Softmax cross-entropy: labels checked on the host and copied in, one loss per pixel computed on
// the device and summed there in chunks (sum_values: a fixed order, deterministic), so that only
// the total comes back. It differs from the CPU's sum in pixel order by double rounding.
template <typename T>
class CudaLoss final : public LossKernel<T> {
 public:
  CudaLoss() = default;
  CudaLoss(const CudaLoss&) = delete;
  CudaLoss& operator=(const CudaLoss&) = delete;
  ~CudaLoss() override {
    // A call that threw after queueing the labels' upload left it unwaited for.
    if (upload_queued_) device_allocator()->wait_ordered_quietly();
  }
  std::string name() const override { return "cuda"; }
  double cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                       Tensor<T>* dlogits) const override {
    const Shape4& s = logits.shape();
    check_cross_entropy(s, labels, dlogits != nullptr ? &dlogits->shape() : nullptr);
    const std::size_t pixels = labels.size();
    if (pixels == 0) return 0;
    Allocator& memory = *device_allocator();
    // Only after a call that threw between queueing the labels' upload and the download below.
    if (upload_queued_) memory.wait_ordered();
    if (labels_.bytes() != pixels * sizeof(std::int32_t)) {
      labels_ = Storage(memory, pixels * sizeof(std::int32_t));
      staged_labels_ = Storage(memory.staging(), labels_.bytes());
      losses_ = Storage(memory, pixels * sizeof(double));
    }
    // Through page-locked memory, queued behind the forward pass's kernels (the host does not
    // wait for them here); the download of the total below waits for this copy too.
    std::memcpy(staged_labels_.data(), labels.data(), labels_.bytes());
    upload_queued_ = true;
    memory.upload_ordered(labels_.data(), staged_labels_.data(), labels_.bytes());
    cuda::cross_entropy(device(logits), static_cast<const std::int32_t*>(labels_.data()), scale,
                        dlogits != nullptr ? device(*dlogits) : nullptr,
                        static_cast<double*>(losses_.data()), s.n, s.c, s.h * s.w, stream());
    const auto n = static_cast<std::int64_t>(pixels);
    double* sums = sums_.get<double>(static_cast<std::size_t>(plane_sums_size(1, n, 1)));
    sum_values(static_cast<const double*>(losses_.data()), n, sums, stream());
    double total = 0;
    memory.download(&total, sums, sizeof(double));  // after the kernels and the upload
    upload_queued_ = false;
    return total;
  }

 private:
  // Reused from call to call (the same tile every step).
  mutable Storage labels_, staged_labels_, losses_;
  mutable bool upload_queued_ = false;  // the labels' upload may still read staged_labels_
  mutable Scratch sums_;
};

// Halo boxes on NCHW tensors (the CPU's nchw16c is oneDNN's layout; cuDNN computes in NCHW).
template <typename T>
class CudaHaloCopy final : public HaloCopyKernel<T> {
 public:
  std::string name() const override { return "cuda"; }
  MemorySpace space() const override { return MemorySpace::device; }

  void move(const Planes<const T>& from, const Planes<T>& to, const Box& box,
            Direction how) const override {
    check_nchw(from.layout);
    check_nchw(to.layout);
    TESSERA_CHECK(
        from.shape.n * from.shape.c == to.shape.n * to.shape.c,
        "halo copy: " + from.shape.str() + " and " + to.shape.str() + " have different planes");
    if (box.empty()) return;
    copy_box(from.at(0, box.h.begin, box.w.begin), to.at(0, box.h.begin, box.w.begin),
             planes_box(from.shape, box, strides(from.shape), strides(to.shape)),
             how == Direction::accumulate, stream());
  }

  void pack(const Planes<const T>& t, const Box& box, T* message) const override {
    check_nchw(t.layout);
    if (box.empty()) return;
    copy_box(t.at(0, box.h.begin, box.w.begin), message,
             planes_box(t.shape, box, strides(t.shape), strides(box)), false, stream());
  }

  void unpack(const T* message, const Box& box, const Planes<T>& t, Direction how) const override {
    check_nchw(t.layout);
    if (box.empty()) return;
    copy_box(message, t.at(0, box.h.begin, box.w.begin),
             planes_box(t.shape, box, strides(box), strides(t.shape)), how == Direction::accumulate,
             stream());
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
  // Planes of a tensor, or of a message holding `box` of each plane.
  static Strides3 strides(const Shape4& s) { return plane_strides(s.h, s.w); }
  static Strides3 strides(const Box& box) { return plane_strides(box.h.size(), box.w.size()); }
  // `box` of every plane of a tensor of `shape`.
  static Box3 planes_box(const Shape4& shape, const Box& box, const Strides3& src,
                         const Strides3& dst) {
    return make_box3(shape.n * shape.c, box.h.size(), box.w.size(), src, dst);
  }
  static void fill_region(const Planes<T>& t, const Box& region, T value) {
    if (region.empty()) return;
    fill_box(t.at(0, region.h.begin, region.w.begin),
             planes_box(t.shape, region, {}, strides(t.shape)), value, stream());
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
