#include "tessera/kernels/batchnorm_kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "batchnorm_checks.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/batchnorm_kernel.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/parallel.hpp"

namespace tessera::fast {
namespace {

constexpr std::int64_t kLanes = 16;  // values handled side by side: nchw16c's channel block
using Lanes = std::array<double, kLanes>;
// Units are cut into pieces of this many elements (a multiple of kLanes), the work of one call:
// the threads share the pieces of a unit too (8 or 16 channels of one sample are one unit), and
// the sums add per-piece partial sums in piece order, whatever the thread count.
constexpr std::int64_t kPiece = std::int64_t{1} << 16;

// Elements [begin, end) of one unit.
struct Piece {
  std::int64_t begin = 0, end = 0;
};

// A tensor as contiguous units: (sample, channel) planes in NCHW, (sample, block of B channels)
// planes in nchw16c (B = 16) and nchw8c (B = 8), where element k of a unit belongs to channel
// first_channel + k % B: lane j = k % 16 holds channel first_channel + j % B.
struct Units {
  std::int64_t count = 0, length = 0, channels = 0;
  std::int64_t block = 1;  // B; 1 in NCHW

  bool blocked() const { return block > 1; }
  std::int64_t first_channel(std::int64_t unit) const {
    return blocked() ? (unit % (channels / block)) * block : unit % channels;
  }
  // The channel of lane j.
  std::int64_t channel(std::int64_t unit, std::int64_t j) const {
    return first_channel(unit) + (blocked() ? j % block : 0);
  }
  // Elements in whole groups of 16 lanes.
  std::int64_t full() const { return length / kLanes * kLanes; }
  std::int64_t pieces() const { return std::max<std::int64_t>(1, (length + kPiece - 1) / kPiece); }
  Piece piece(std::int64_t k) const { return {k * kPiece, std::min(length, (k + 1) * kPiece)}; }
  // Per lane j, f(channel of lane j); in NCHW every lane is the unit's one channel.
  template <typename F>
  Lanes per_lane(std::int64_t unit, F&& f) const {
    Lanes out{};
    for (std::int64_t j = 0; j < kLanes; ++j)
      out[std::size_t(j)] = f(static_cast<std::size_t>(channel(unit, j)));
    return out;
  }
};

Units units_of(const Shape4& s, Layout layout) {
  const std::int64_t b = block_of(layout);
  if (b == 1) return {.count = s.n * s.c, .length = s.h * s.w, .channels = s.c, .block = 1};
  TESSERA_CHECK(s.c % b == 0, std::string("batch norm: ") + to_string(layout) +
                                  " needs channels divisible by " + std::to_string(b) + ", got " +
                                  s.str());
  return {.count = s.n * s.c / b, .length = s.h * s.w * b, .channels = s.c, .block = b};
}

// Whether an output of `numel` values of T is written with streaming stores.
template <typename T>
bool streams(std::int64_t numel) {
  return numel * std::int64_t(sizeof(T)) >= streaming_store_bytes();
}

using batchnorm_checks::channels;
using batchnorm_checks::same;
using batchnorm_checks::statistics;

// T's values in their order as unsigned integers: -inf, ..., -0, +0, ..., +inf (NaNs beyond).
template <typename T>
using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
template <typename T>
Bits<T> ordered(T v) {
  const Bits<T> b = std::bit_cast<Bits<T>>(v), sign = Bits<T>(1) << (8 * sizeof(T) - 1);
  return (b & sign) != 0 ? ~b : b | sign;
}
template <typename T>
T from_ordered(Bits<T> k) {
  const Bits<T> sign = Bits<T>(1) << (8 * sizeof(T) - 1);
  return std::bit_cast<T>((k & sign) != 0 ? k & ~sign : ~k);
}

// The scale forward normalises channel c with (batchnorm_loops.inc's normalise_lanes), and the
// f' masks (OutputMask) compute their intervals with: one expression, so that both round alike.
template <typename T>
double normalise_scale(const BatchNormStats& stats, const T* weight, std::size_t c) {
  return stats.invstd[c] * double(weight[c]);
}

// Where a forward-applied activation's f' is 1, per channel: lo[c] <= x <= hi[c]
// (batchnorm_positive_range), its slope elsewhere. Built once per backward pass (C bisections),
// read by the loops as they go.
template <typename T>
struct OutputMask {
  std::vector<T> lo, hi;
  T slope;
};

namespace base {
#define TESSERA_WIDE_LOOPS 0
#include "batchnorm_loops.inc"
#undef TESSERA_WIDE_LOOPS
}  // namespace base

// The wide loops (kernels/simd.hpp): batchnorm_loops.inc compiled a second time, for AVX-512.
#if TESSERA_HAS_WIDE_LOOPS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
namespace wide {
#define TESSERA_WIDE_LOOPS 1
#include "batchnorm_loops.inc"
#undef TESSERA_WIDE_LOOPS
}  // namespace wide
#pragma GCC pop_options
bool use_wide() {
  return simd_level() == SimdLevel::avx512;
}
// Runs loop `name` of the widest available instruction set with the arguments that follow.
#define TESSERA_LOOPS(name, ...) (use_wide() ? wide::name(__VA_ARGS__) : base::name(__VA_ARGS__))
#else
#define TESSERA_LOOPS(name, ...) base::name(__VA_ARGS__)
#endif

}  // namespace

template <typename T>
PositiveRange<T> batchnorm_positive_range(double mean, double scale, double shift) {
  constexpr T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  const auto positive = [&](T x) {
    return elementwise::batchnorm_apply(x, mean, scale, shift) > T(0);
  };
  if (scale == 0) {
    if (!positive(T(0))) return {nan, nan};
    return {-std::numeric_limits<T>::max(), std::numeric_limits<T>::max()};
  }
  if (!(scale > 0) && !(scale < 0)) return {nan, nan};  // NaN
  // Positive from some value on (scale > 0) or up to some value (scale < 0): bisect the ordered
  // values between the infinities for the boundary, holding `inside` (positive) and `outside`.
  const bool rising = scale > 0;
  const T far = rising ? inf : -inf;
  if (!positive(far)) return {nan, nan};  // nowhere (a NaN or infinite mean or shift)
  if (positive(-far)) return {-inf, inf};
  Bits<T> inside = ordered(far), outside = ordered(-far);
  while ((rising ? inside - outside : outside - inside) > 1) {
    const Bits<T> mid = rising ? outside + (inside - outside) / 2 : inside + (outside - inside) / 2;
    (positive(from_ordered<T>(mid)) ? inside : outside) = mid;
  }
  const T edge = from_ordered<T>(inside);
  return rising ? PositiveRange<T>{edge, inf} : PositiveRange<T>{-inf, edge};
}

namespace {

// The mask of `applied` for the statistics of a forward (nullopt without one).
template <typename T>
std::optional<OutputMask<T>> mask_of(const BatchNormStats& stats,
                                     const AppliedActivation<T>* applied) {
  if (applied == nullptr) return std::nullopt;
  OutputMask<T> m{.lo = {}, .hi = {}, .slope = applied->slope};
  for (std::size_t c = 0; c < stats.mean.size(); ++c) {
    const PositiveRange<T> r = batchnorm_positive_range<T>(
        stats.mean[c], normalise_scale(stats, applied->weight.data(), c), double(applied->bias[c]));
    m.lo.push_back(r.lo);
    m.hi.push_back(r.hi);
  }
  return m;
}

}  // namespace

template <typename T>
void batchnorm_sum(const Tensor<T>& x, Layout layout, std::span<double> sum) {
  channels("batchnorm_sum", x.shape(), sum.size(), "sum");
  TESSERA_LOOPS(sum, units_of(x.shape(), layout), x.data(), sum);
}

template <typename T>
void batchnorm_centered_square_sum(const Tensor<T>& x, Layout layout, std::span<const double> mean,
                                   std::span<double> sum) {
  channels("batchnorm_centered_square_sum", x.shape(), mean.size(), "mean");
  channels("batchnorm_centered_square_sum", x.shape(), sum.size(), "sum");
  TESSERA_LOOPS(centered_square_sum, units_of(x.shape(), layout), x.data(), mean, sum);
}

template <typename T>
void batchnorm_shifted_sums(const Tensor<T>& x, Layout layout, std::span<const double> shift,
                            std::span<double> sum, std::span<double> square_sum) {
  channels("batchnorm_shifted_sums", x.shape(), shift.size(), "shift");
  channels("batchnorm_shifted_sums", x.shape(), sum.size(), "sum");
  channels("batchnorm_shifted_sums", x.shape(), square_sum.size(), "square sum");
  TESSERA_LOOPS(shifted_sums, units_of(x.shape(), layout), x.data(), shift, sum, square_sum);
}

template <typename T>
void batchnorm_forward(const Tensor<T>& x, Layout layout, const BatchNormStats& stats,
                       std::span<const T> weight, std::span<const T> bias, Tensor<T>& y,
                       std::optional<T> leaky_slope) {
  const Shape4& s = x.shape();
  statistics("batchnorm_forward", s, stats);
  channels("batchnorm_forward", s, weight.size(), "weight");
  channels("batchnorm_forward", s, bias.size(), "bias");
  same("batchnorm_forward", s, y.shape(), "output");
  TESSERA_LOOPS(forward, units_of(s, layout), x.data(), stats, weight.data(), bias.data(), y.data(),
                leaky_slope, streams<T>(y.numel()));
}

template <typename T>
void batchnorm_backward_sums(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const BatchNormStats& stats, std::span<double> sum_dy,
                             std::span<double> sum_dy_xhat, const AppliedActivation<T>* applied) {
  const Shape4& s = x.shape();
  statistics("batchnorm_backward_sums", s, stats);
  if (applied != nullptr) {
    channels("batchnorm_backward_sums", s, applied->weight.size(), "weight");
    channels("batchnorm_backward_sums", s, applied->bias.size(), "bias");
  }
  same("batchnorm_backward_sums", s, dy.shape(), "output gradient");
  channels("batchnorm_backward_sums", s, sum_dy.size(), "sum_dy");
  channels("batchnorm_backward_sums", s, sum_dy_xhat.size(), "sum_dy_xhat");
  const std::optional<OutputMask<T>> mask = mask_of(stats, applied);
  TESSERA_LOOPS(backward_sums, units_of(s, layout), x.data(), dy.data(), stats, sum_dy, sum_dy_xhat,
                mask ? &*mask : nullptr);
}

template <typename T>
void batchnorm_backward_data(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const BatchNormStats& stats, std::span<const T> weight,
                             std::span<const double> mean_dy, std::span<const double> mean_dy_xhat,
                             Tensor<T>& dx, const AppliedActivation<T>* applied) {
  batchnorm_checks::backward_data("batchnorm_backward_data", x, dy, stats, weight.size(),
                                  mean_dy.size(), mean_dy_xhat.size(), dx);
  if (applied != nullptr) {
    channels("batchnorm_backward_data", x.shape(), applied->weight.size(), "weight");
    channels("batchnorm_backward_data", x.shape(), applied->bias.size(), "bias");
  }
  const std::optional<OutputMask<T>> mask = mask_of(stats, applied);
  TESSERA_LOOPS(backward_data, units_of(x.shape(), layout), x.data(), dy.data(), stats,
                weight.data(), mean_dy, mean_dy_xhat, dx.data(), streams<T>(dx.numel()),
                mask ? &*mask : nullptr);
}
#undef TESSERA_LOOPS

#define TESSERA_INSTANTIATE(T)                                                                \
  template PositiveRange<T> batchnorm_positive_range<T>(double, double, double);              \
  template void batchnorm_sum<T>(const Tensor<T>&, Layout, std::span<double>);                \
  template void batchnorm_centered_square_sum<T>(const Tensor<T>&, Layout,                    \
                                                 std::span<const double>, std::span<double>); \
  template void batchnorm_shifted_sums<T>(const Tensor<T>&, Layout, std::span<const double>,  \
                                          std::span<double>, std::span<double>);              \
  template void batchnorm_forward<T>(const Tensor<T>&, Layout, const BatchNormStats&,         \
                                     std::span<const T>, std::span<const T>, Tensor<T>&,      \
                                     std::optional<T>);                                       \
  template void batchnorm_backward_sums<T>(const Tensor<T>&, const Tensor<T>&, Layout,        \
                                           const BatchNormStats&, std::span<double>,          \
                                           std::span<double>, const AppliedActivation<T>*);   \
  template void batchnorm_backward_data<T>(                                                   \
      const Tensor<T>&, const Tensor<T>&, Layout, const BatchNormStats&, std::span<const T>,  \
      std::span<const double>, std::span<const double>, Tensor<T>&, const AppliedActivation<T>*);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::fast

namespace tessera {
namespace {

template <typename T>
class CpuBatchNorm final : public BatchNormKernel<T> {
 public:
  std::string name() const override { return "threaded"; }
  void sum(const Tensor<T>& x, Layout layout, std::span<double> sum) const override {
    fast::batchnorm_sum(x, layout, sum);
  }
  void centered_square_sum(const Tensor<T>& x, Layout layout, std::span<const double> mean,
                           std::span<double> sum) const override {
    fast::batchnorm_centered_square_sum(x, layout, mean, sum);
  }
  void shifted_sums(const Tensor<T>& x, Layout layout, std::span<const double> shift,
                    std::span<double> sum, std::span<double> square_sum) const override {
    fast::batchnorm_shifted_sums(x, layout, shift, sum, square_sum);
  }
  void forward(const Tensor<T>& x, Layout layout, const reference::BatchNormStats& stats,
               std::span<const T> weight, std::span<const T> bias, Tensor<T>& y) const override {
    fast::batchnorm_forward(x, layout, stats, weight, bias, y);
  }
  bool applies(const FusedActivation& f) const override {
    return f.kind == ActivationKind::relu || f.kind == ActivationKind::leaky_relu;
  }
  void forward_activated(const Tensor<T>& x, Layout layout, const reference::BatchNormStats& stats,
                         std::span<const T> weight, std::span<const T> bias,
                         const FusedActivation& f, Tensor<T>& y) const override {
    TESSERA_CHECK(applies(f), "batch norm: no fused activation of this kind");
    fast::batchnorm_forward(
        x, layout, stats, weight, bias, y,
        std::optional<T>(f.kind == ActivationKind::leaky_relu ? static_cast<T>(f.slope) : T(0)));
  }
  void backward_sums(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                     const reference::BatchNormStats& stats, std::span<double> sum_dy,
                     std::span<double> sum_dy_xhat) const override {
    fast::batchnorm_backward_sums(x, dy, layout, stats, sum_dy, sum_dy_xhat);
  }
  void backward_data(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                     const reference::BatchNormStats& stats, std::span<const T> weight,
                     std::span<const double> mean_dy, std::span<const double> mean_dy_xhat,
                     Tensor<T>& dx) const override {
    fast::batchnorm_backward_data(x, dy, layout, stats, weight, mean_dy, mean_dy_xhat, dx);
  }
  void backward_sums_activated(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                               const reference::BatchNormStats& stats,
                               const ForwardActivation<T>& a, std::span<double> sum_dy,
                               std::span<double> sum_dy_xhat) const override {
    const fast::AppliedActivation<T> applied = applied_of(a);
    fast::batchnorm_backward_sums(x, dy, layout, stats, sum_dy, sum_dy_xhat, &applied);
  }
  void backward_data_activated(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                               const reference::BatchNormStats& stats,
                               const ForwardActivation<T>& a, std::span<const double> mean_dy,
                               std::span<const double> mean_dy_xhat, Tensor<T>& dx) const override {
    const fast::AppliedActivation<T> applied = applied_of(a);
    fast::batchnorm_backward_data(x, dy, layout, stats, a.weight, mean_dy, mean_dy_xhat, dx,
                                  &applied);
  }

 private:
  fast::AppliedActivation<T> applied_of(const ForwardActivation<T>& a) const {
    TESSERA_CHECK(applies(a.f), "batch norm: no fused activation of this kind");
    return {.weight = a.weight,
            .bias = a.bias,
            .slope = a.f.kind == ActivationKind::leaky_relu ? static_cast<T>(a.f.slope) : T(0)};
  }
};

}  // namespace

template <typename T>
std::unique_ptr<BatchNormKernel<T>> make_cpu_batch_norm() {
  return std::make_unique<CpuBatchNorm<T>>();
}

template std::unique_ptr<BatchNormKernel<float>> make_cpu_batch_norm<float>();
template std::unique_ptr<BatchNormKernel<double>> make_cpu_batch_norm<double>();

}  // namespace tessera
