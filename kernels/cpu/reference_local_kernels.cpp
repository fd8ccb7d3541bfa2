// The reference backend's planned local kernels: kernels/reference_*.hpp behind the interfaces of
// include/tessera/kernels/local_kernels.hpp.
#include "tessera/kernels/local_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/kernels/reference_dense.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

template <typename T>
class ReferenceUpsample final : public UpsampleKernel<T> {
 public:
  explicit ReferenceUpsample(const reference::UpsampleGeometry& g) : g_(g) {}
  std::string name() const override { return "reference"; }
  void forward(const Tensor<T>& x, Tensor<T>& y) const override {
    reference::upsample_nearest_forward(x, y, g_);
  }
  void backward(const Tensor<T>& dy, Tensor<T>& dx) const override {
    reference::upsample_nearest_backward(dy, dx, g_);
  }

 private:
  reference::UpsampleGeometry g_;
};

template <typename T>
class ReferenceSpatialSum final : public SpatialSumKernel<T> {
 public:
  std::string name() const override { return "reference"; }
  void sums(const Tensor<T>& x, std::span<T> sums) const override {
    reference::spatial_sums<T>(x, sums);
  }
  void spread(std::span<const T> g, Tensor<T>& dx) const override {
    reference::broadcast_spatial<T>(g, dx);
  }
};

template <typename T>
class ReferenceLoss final : public LossKernel<T> {
 public:
  std::string name() const override { return "reference"; }
  double cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                       Tensor<T>* dlogits) const override {
    return reference::pixel_cross_entropy(logits, labels, scale, dlogits);
  }
};

template <typename T>
class ReferenceUpdate final : public UpdateKernel<T> {
 public:
  std::string name() const override { return "reference"; }
  void sgd(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars<T>& s) const override {
    for (std::int64_t i = 0; i < n; ++i)
      elementwise::sgd(p[i], g[i], buf ? buf + i : nullptr, s);
  }
  void adam(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars<T>& s) const override {
    for (std::int64_t i = 0; i < n; ++i)
      elementwise::adam(p[i], g[i], m[i], v[i], s);
  }
};

template <typename T>
class CpuMerge final : public MergeKernel<T> {
 public:
  std::string name() const override { return "threaded"; }
  void put_channels(const Tensor<T>& x, Tensor<T>& y, std::int64_t offset) const override {
    const Shape4 xs = x.shape(), ys = y.shape();
    check_concat(xs, ys, offset);
    const std::int64_t plane = xs.h * xs.w, block = xs.c * plane;
    for (std::int64_t n = 0; n < xs.n; ++n)
      parallel_copy(x.data() + n * block, block, y.data() + (n * ys.c + offset) * plane);
  }
  void take_channels(const Tensor<T>& y, std::int64_t offset, Tensor<T>& x) const override {
    const Shape4 xs = x.shape(), ys = y.shape();
    check_concat(xs, ys, offset);
    const std::int64_t plane = xs.h * xs.w, block = xs.c * plane;
    for (std::int64_t n = 0; n < xs.n; ++n)
      parallel_copy(y.data() + (n * ys.c + offset) * plane, block, x.data() + n * block);
  }
  void add(const Tensor<T>& b, Tensor<T>& a) const override {
    TESSERA_CHECK(a.shape() == b.shape() && a.layout() == b.layout(),
                  "add: shapes " + a.shape().str() + " in " + to_string(a.layout()) + " and " +
                      b.shape().str() + " in " + to_string(b.layout()) + " differ");
    parallel_for(static_cast<std::int64_t>(a.size()), [&](std::int64_t begin, std::int64_t end) {
      T* __restrict pa = a.data();
      const T* __restrict pb = b.data();
      for (std::int64_t k = begin; k < end; ++k)
        pa[k] += pb[k];
    });
  }
  // In a blocked layout a unit (sample, block of B channels) holds its pixels' B channels side by
  // side; the padding channels of a last partial block stay as they are. Each channel's values
  // are visited in the plane's order in either layout, so the gradient sums are the same. Both
  // loops split every unit into pieces of kPiece pixels, so that one block of channels (a 16-
  // channel transposed conv's output in nchw16c) still spreads over the threads (it ran on one).
  void add_bias(std::span<const T> bias, Tensor<T>& y) const override {
    const Shape4& s = y.shape();
    check_bias(bias.size(), y, "bias");
    const std::int64_t b = block_of(y.layout()), blocks = channel_blocks(s.c, b);
    const std::int64_t pixels = s.h * s.w, pieces = ceil_div(pixels, kPiece);
    parallel_for(
        s.n * blocks * pieces,
        [&](std::int64_t first, std::int64_t last) {
          for (std::int64_t u = first; u < last; ++u) {
            const std::int64_t k = u / pieces, begin = u % pieces * kPiece;
            const std::int64_t end = std::min(pixels, begin + kPiece);
            const std::int64_t c0 = k % blocks * b, lanes = std::min(b, s.c - c0);
            T* out = y.data() + k * pixels * b;
            for (std::int64_t i = begin; i < end; ++i)
              for (std::int64_t j = 0; j < lanes; ++j)
                out[i * b + j] += bias[static_cast<std::size_t>(c0 + j)];
          }
        },
        grain_for(kPiece * b));
  }
  void add_bias_grad(const Tensor<T>& dy, std::span<T> dbias) const override {
    const Shape4& s = dy.shape();
    check_bias(dbias.size(), dy, "bias gradient");
    const std::int64_t b = block_of(dy.layout()), blocks = channel_blocks(s.c, b);
    const std::int64_t pixels = s.h * s.w, pieces = ceil_div(pixels, kPiece);
    // Per (unit, piece), b channel sums; added piece by piece in order below, so the result does
    // not depend on the thread count.
    std::vector<double> sums(static_cast<std::size_t>(s.n * blocks * pieces * b), 0.0);
    parallel_for(
        s.n * blocks * pieces,
        [&](std::int64_t first, std::int64_t last) {
          // Per channel, in double, kInterleave partial sums (pixel i into sum i % kInterleave,
          // added in that order at the end): a float running sum of a 2048x2048 plane was both
          // a dependency chain and 4M roundings. Pixel order decides, so both layouts agree.
          constexpr std::int64_t kInterleave = 8;
          std::vector<double> acc(static_cast<std::size_t>(kInterleave * b));
          for (std::int64_t u = first; u < last; ++u) {
            const std::int64_t k = u / pieces, begin = u % pieces * kPiece;
            const std::int64_t end = std::min(pixels, begin + kPiece);
            const T* grad = dy.data() + k * pixels * b;
            std::fill(acc.begin(), acc.end(), 0.0);
            double* __restrict a = acc.data();
            std::int64_t i = begin;
            for (; i + kInterleave <= end; i += kInterleave)
              for (std::int64_t r = 0; r < kInterleave * b; ++r)
                a[r] += static_cast<double>(grad[i * b + r]);
            for (std::int64_t r = 0; i < end; ++i, ++r)
              for (std::int64_t j = 0; j < b; ++j)
                a[r * b + j] += static_cast<double>(grad[i * b + j]);
            for (std::int64_t j = 0; j < b; ++j) {
              double sum = 0;
              for (std::int64_t r = 0; r < kInterleave; ++r)
                sum += a[r * b + j];
              sums[static_cast<std::size_t>(u * b + j)] = sum;
            }
          }
        },
        grain_for(kPiece * b));
    for (std::int64_t n = 0; n < s.n; ++n)
      for (std::int64_t c = 0; c < s.c; ++c) {
        const std::int64_t k = n * blocks + c / b;
        double sum = 0;
        for (std::int64_t p = 0; p < pieces; ++p)
          sum += sums[static_cast<std::size_t>((k * pieces + p) * b + c % b)];
        dbias[static_cast<std::size_t>(c)] += static_cast<T>(sum);
      }
  }

 private:
  // Pixels of one unit a thread takes at a time (a multiple of add_bias_grad's kInterleave).
  static constexpr std::int64_t kPiece = 8192;
  static std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
  static void check_bias(std::size_t size, const Tensor<T>& t, const char* what) {
    check_bias_shape(size, t.shape(), t.layout(), what, /*blocked_ok=*/true);
  }
};

template <typename T>
class ReferenceLinear final : public LinearKernel<T> {
 public:
  ReferenceLinear(std::int64_t in, std::int64_t out) : in_(in), out_(out) {}
  std::string name() const override { return "reference"; }
  void forward(std::span<const T> x, std::span<const T> w, std::span<const T> bias, std::span<T> y,
               std::int64_t n) const override {
    reference::linear_forward<T>(x, w, bias, y, n, in_, out_);
  }
  void backward_data(std::span<const T> dy, std::span<const T> w, std::span<T> dx,
                     std::int64_t n) const override {
    reference::linear_backward_data<T>(dy, w, dx, n, in_, out_);
  }
  void backward_weights(std::span<const T> x, std::span<const T> dy, std::span<T> dw,
                        std::span<T> dbias, std::int64_t n) const override {
    reference::linear_backward_weights<T>(x, dy, dw, dbias, n, in_, out_);
  }

 private:
  std::int64_t in_, out_;
};

template <typename T>
class CpuDropout final : public DropoutKernel<T> {
 public:
  explicit CpuDropout(double p) : p_(p), keep_(elementwise::dropout_keep<T>(p)) {}
  std::string name() const override { return "threaded"; }

  void forward(const Tensor<T>& x, const TileOrigin& at, std::uint64_t seed, std::uint64_t stream,
               Tensor<T>& mask, Tensor<T>& y) const override {
    const Shape4& s = x.shape();
    check_dropout_tile(s, x.layout(), at, mask.shape(), y.shape());
    const T* in = x.data();
    T* m = mask.data();
    T* out = y.data();
    const TileIndex tile = tile_index(at, s);
    // One item per row (n, c, h) of the tile.
    parallel_for(
        s.n * s.c * s.h,
        [&](std::int64_t begin, std::int64_t end) {
          for (std::int64_t row = begin; row < end; ++row) {
            const std::int64_t k0 = row * s.w;
            const std::uint64_t first = elementwise::global_index(tile, k0);
            for (std::int64_t w = 0; w < s.w; ++w) {
              m[k0 + w] =
                  dropout_scale(seed, stream, first + static_cast<std::uint64_t>(w), p_, keep_);
              out[k0 + w] = in[k0 + w] * m[k0 + w];
            }
          }
        },
        grain_for(s.w));
  }

  void backward(const Tensor<T>& dy, const Tensor<T>& mask, Tensor<T>& dx) const override {
    check_dropout_backward(dy.shape(), mask.shape(), dx.shape());
    const T* g = dy.data();
    const T* m = mask.data();
    T* out = dx.data();
    parallel_for(dy.numel(), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t k = begin; k < end; ++k)
        out[k] = g[k] * m[k];
    });
  }

 private:
  double p_;
  T keep_;
};

}  // namespace

void check_concat(const Shape4& x, const Shape4& y, std::int64_t offset) {
  TESSERA_CHECK(x.n == y.n && x.h == y.h && x.w == y.w && offset >= 0 && offset + x.c <= y.c,
                "concat: channels [" + std::to_string(offset) + ", " +
                    std::to_string(offset + x.c) + ") of " + y.str() + " do not fit " + x.str());
}

void check_cross_entropy_shapes(const Shape4& s, std::size_t labels, const Shape4* dlogits) {
  TESSERA_CHECK(static_cast<std::int64_t>(labels) == s.n * s.h * s.w,
                "pixel_cross_entropy: labels do not match the logits " + s.str());
  TESSERA_CHECK(dlogits == nullptr || *dlogits == s, "pixel_cross_entropy: gradient " +
                                                         (dlogits ? dlogits->str() : "") +
                                                         " does not match the logits " + s.str());
}

void check_labels(std::span<const std::int32_t> labels, std::int64_t classes) {
  // The smallest and largest label first, in a loop with no branch that the compiler vectorises
  // (a check per label ran at about 1 GB/s: 15 ms a step for a 2048x2048 image), then the first
  // label out of range for the message.
  std::int32_t low = 0, high = 0;
  if (!labels.empty()) low = high = labels[0];
  for (const std::int32_t label : labels) {
    low = std::min(low, label);
    high = std::max(high, label);
  }
  if (low >= 0 && high < classes) return;
  for (const std::int32_t label : labels)
    TESSERA_CHECK(label >= 0 && label < classes,
                  "label " + std::to_string(label) + " is outside [0, " + std::to_string(classes) +
                      "): the model has " + std::to_string(classes) + " output channels");
}

void check_cross_entropy(const Shape4& s, std::span<const std::int32_t> labels,
                         const Shape4* dlogits) {
  check_cross_entropy_shapes(s, labels.size(), dlogits);
  check_labels(labels, s.c);
}

void check_bias_shape(std::size_t size, const Shape4& t, Layout layout, const char* what,
                      bool blocked_ok) {
  TESSERA_CHECK(static_cast<std::int64_t>(size) == t.c && (blocked_ok || layout == Layout::nchw),
                std::string(what) + " of " + std::to_string(size) + " values for " + t.str() +
                    " in " + to_string(layout) + " (expected one per channel, NCHW)");
}

void check_dropout_tile(const Shape4& x, Layout layout, const TileOrigin& at, const Shape4& mask,
                        const Shape4& y) {
  TESSERA_CHECK(mask == x && y == x && layout == Layout::nchw && at.n + x.n <= at.global.n &&
                    at.h + x.h <= at.global.h && at.w + x.w <= at.global.w && x.c == at.global.c,
                "dropout: tile " + x.str() + " does not fit its tensor " + at.global.str());
}

void check_dropout_backward(const Shape4& dy, const Shape4& mask, const Shape4& dx) {
  TESSERA_CHECK(mask == dy && dx == dy, "dropout backward: mask " + mask.str() + ", gradient " +
                                            dy.str() + ", input gradient " + dx.str());
}

template <typename T>
std::unique_ptr<DropoutKernel<T>> make_cpu_dropout(double p) {
  return std::make_unique<CpuDropout<T>>(p);
}

template <typename T>
std::unique_ptr<UpsampleKernel<T>> make_reference_upsample(const reference::UpsampleGeometry& g) {
  return std::make_unique<ReferenceUpsample<T>>(g);
}
template <typename T>
std::unique_ptr<SpatialSumKernel<T>> make_reference_spatial_sum() {
  return std::make_unique<ReferenceSpatialSum<T>>();
}
template <typename T>
std::unique_ptr<UpdateKernel<T>> make_reference_update() {
  return std::make_unique<ReferenceUpdate<T>>();
}
template <typename T>
std::unique_ptr<MergeKernel<T>> make_cpu_merge() {
  return std::make_unique<CpuMerge<T>>();
}
template <typename T>
std::unique_ptr<LossKernel<T>> make_reference_loss() {
  return std::make_unique<ReferenceLoss<T>>();
}
template <typename T>
std::unique_ptr<LinearKernel<T>> make_reference_linear(std::int64_t in, std::int64_t out) {
  return std::make_unique<ReferenceLinear<T>>(in, out);
}

#define TESSERA_INSTANTIATE(T)                                                   \
  template std::unique_ptr<UpsampleKernel<T>> make_reference_upsample<T>(        \
      const reference::UpsampleGeometry&);                                       \
  template std::unique_ptr<SpatialSumKernel<T>> make_reference_spatial_sum<T>(); \
  template std::unique_ptr<LossKernel<T>> make_reference_loss<T>();              \
  template std::unique_ptr<UpdateKernel<T>> make_reference_update<T>();          \
  template std::unique_ptr<MergeKernel<T>> make_cpu_merge<T>();                  \
  template std::unique_ptr<DropoutKernel<T>> make_cpu_dropout<T>(double);        \
  template std::unique_ptr<LinearKernel<T>> make_reference_linear<T>(std::int64_t, std::int64_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera
