#include "tessera/kernels/batchnorm_kernels.hpp"

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "batchnorm_checks.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/batchnorm_kernel.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/parallel.hpp"

namespace tessera::fast {
namespace {

constexpr std::int64_t kLanes = 16;  // values handled side by side: nchw16c's channel block
using Lanes = std::array<double, kLanes>;

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

using batchnorm_checks::channels;
using batchnorm_checks::same;
using batchnorm_checks::statistics;

// Calls body(unit) for every unit, split over the kernel threads.
template <typename Body>
void for_each_unit(const Units& u, Body&& body) {
  parallel_for(
      u.count,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t unit = first; unit < last; ++unit)
          body(unit);
      },
      grain_for(u.length));
}

// Per-channel sums (overwritten) of what acc(unit) returns for each unit: its 16 lane sums, one
// per channel in nchw16c, two per channel (lanes j and j + 8) in nchw8c, all the unit's channel
// in NCHW. Units are added in order.
template <typename Acc>
void channel_sums(const Units& u, std::span<double> sums, Acc&& acc) {
  std::vector<Lanes> partial(static_cast<std::size_t>(u.count));
  for_each_unit(u, [&](std::int64_t unit) { partial[std::size_t(unit)] = acc(unit); });
  std::fill(sums.begin(), sums.end(), 0.0);
  for (std::int64_t unit = 0; unit < u.count; ++unit) {
    const Lanes& p = partial[std::size_t(unit)];
    if (u.blocked()) {
      for (std::int64_t j = 0; j < kLanes; ++j)
        sums[std::size_t(u.channel(unit, j))] += p[std::size_t(j)];
    } else {
      double s = 0;
      for (double v : p)
        s += v;
      sums[std::size_t(u.first_channel(unit))] += s;
    }
  }
}

// Lane sums of term(k, j) over one unit's elements k, element k on lane j = k % 16 (past the
// last full 16, on lane k - full): 16 independent accumulators, which vectorise.
template <typename Term>
Lanes lane_sums(const Units& u, Term&& term) {
  Lanes acc{};
  const std::int64_t full = u.length / kLanes * kLanes;
  for (std::int64_t k = 0; k < full; k += kLanes)
    for (std::int64_t j = 0; j < kLanes; ++j)
      acc[std::size_t(j)] += term(k + j, j);
  for (std::int64_t k = full; k < u.length; ++k)
    acc[std::size_t(k - full)] += term(k, k - full);
  return acc;
}

// op(k, j) for every element k of one unit, on the lanes lane_sums uses.
template <typename Op>
void lane_apply(const Units& u, Op&& op) {
  const std::int64_t full = u.length / kLanes * kLanes;
  for (std::int64_t k = 0; k < full; k += kLanes)
    for (std::int64_t j = 0; j < kLanes; ++j)
      op(k + j, j);
  for (std::int64_t k = full; k < u.length; ++k)
    op(k, k - full);
}

}  // namespace

template <typename T>
void batchnorm_sum(const Tensor<T>& x, Layout layout, std::span<double> sum) {
  channels("batchnorm_sum", x.shape(), sum.size(), "sum");
  const Units u = units_of(x.shape(), layout);
  channel_sums(u, sum, [&](std::int64_t unit) {
    const T* p = x.data() + unit * u.length;
    return lane_sums(u, [&](std::int64_t k, std::int64_t) { return double(p[k]); });
  });
}

template <typename T>
void batchnorm_centered_square_sum(const Tensor<T>& x, Layout layout, std::span<const double> mean,
                                   std::span<double> sum) {
  channels("batchnorm_centered_square_sum", x.shape(), mean.size(), "mean");
  channels("batchnorm_centered_square_sum", x.shape(), sum.size(), "sum");
  const Units u = units_of(x.shape(), layout);
  channel_sums(u, sum, [&](std::int64_t unit) {
    const T* p = x.data() + unit * u.length;
    const Lanes m = u.per_lane(unit, [&](std::size_t c) { return mean[c]; });
    return lane_sums(u, [&](std::int64_t k, std::int64_t j) {
      const double d = double(p[k]) - m[std::size_t(j)];
      return d * d;
    });
  });
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
  const Units u = units_of(s, layout);
  for_each_unit(u, [&](std::int64_t unit) {
    const Lanes m = u.per_lane(unit, [&](std::size_t c) { return stats.mean[c]; });
    const Lanes scale =
        u.per_lane(unit, [&](std::size_t c) { return stats.invstd[c] * double(weight[c]); });
    const Lanes shift = u.per_lane(unit, [&](std::size_t c) { return double(bias[c]); });
    const T* p = x.data() + unit * u.length;
    T* q = y.data() + unit * u.length;
    if (leaky_slope) {
      const T slope = *leaky_slope;
      lane_apply(u, [&](std::int64_t k, std::int64_t j) {
        const std::size_t l = std::size_t(j);
        q[k] = elementwise::leaky_relu(elementwise::batchnorm_apply(p[k], m[l], scale[l], shift[l]),
                                       slope);
      });
    } else {
      lane_apply(u, [&](std::int64_t k, std::int64_t j) {
        const std::size_t l = std::size_t(j);
        q[k] = elementwise::batchnorm_apply(p[k], m[l], scale[l], shift[l]);
      });
    }
  });
}

template <typename T>
void batchnorm_backward_sums(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const BatchNormStats& stats, std::span<double> sum_dy,
                             std::span<double> sum_dy_xhat) {
  const Shape4& s = x.shape();
  statistics("batchnorm_backward_sums", s, stats);
  same("batchnorm_backward_sums", s, dy.shape(), "output gradient");
  channels("batchnorm_backward_sums", s, sum_dy.size(), "sum_dy");
  channels("batchnorm_backward_sums", s, sum_dy_xhat.size(), "sum_dy_xhat");
  const Units u = units_of(s, layout);
  channel_sums(u, sum_dy, [&](std::int64_t unit) {
    const T* g = dy.data() + unit * u.length;
    return lane_sums(u, [&](std::int64_t k, std::int64_t) { return double(g[k]); });
  });
  channel_sums(u, sum_dy_xhat, [&](std::int64_t unit) {
    const T* p = x.data() + unit * u.length;
    const T* g = dy.data() + unit * u.length;
    const Lanes m = u.per_lane(unit, [&](std::size_t c) { return stats.mean[c]; });
    const Lanes r = u.per_lane(unit, [&](std::size_t c) { return stats.invstd[c]; });
    return lane_sums(u, [&](std::int64_t k, std::int64_t j) {
      const std::size_t l = std::size_t(j);
      return double(g[k]) * (double(p[k]) - m[l]) * r[l];
    });
  });
}

template <typename T>
void batchnorm_backward_data(const Tensor<T>& x, const Tensor<T>& dy, Layout layout,
                             const BatchNormStats& stats, std::span<const T> weight,
                             std::span<const double> mean_dy, std::span<const double> mean_dy_xhat,
                             Tensor<T>& dx) {
  const Shape4& s = x.shape();
  batchnorm_checks::backward_data("batchnorm_backward_data", x, dy, stats, weight.size(),
                                  mean_dy.size(), mean_dy_xhat.size(), dx);
  const Units u = units_of(s, layout);
  for_each_unit(u, [&](std::int64_t unit) {
    const Lanes m = u.per_lane(unit, [&](std::size_t c) { return stats.mean[c]; });
    const Lanes r = u.per_lane(unit, [&](std::size_t c) { return stats.invstd[c]; });
    const Lanes scale =
        u.per_lane(unit, [&](std::size_t c) { return double(weight[c]) * stats.invstd[c]; });
    const Lanes a = u.per_lane(unit, [&](std::size_t c) { return mean_dy[c]; });
    const Lanes b = u.per_lane(unit, [&](std::size_t c) { return mean_dy_xhat[c]; });
    const T* p = x.data() + unit * u.length;
    const T* g = dy.data() + unit * u.length;
    T* q = dx.data() + unit * u.length;
    lane_apply(u, [&](std::int64_t k, std::int64_t j) {
      const std::size_t l = std::size_t(j);
      q[k] = elementwise::batchnorm_grad(g[k], p[k], m[l], r[l], scale[l], a[l], b[l]);
    });
  });
}

#define TESSERA_INSTANTIATE(T)                                                                \
  template void batchnorm_sum<T>(const Tensor<T>&, Layout, std::span<double>);                \
  template void batchnorm_centered_square_sum<T>(const Tensor<T>&, Layout,                    \
                                                 std::span<const double>, std::span<double>); \
  template void batchnorm_forward<T>(const Tensor<T>&, Layout, const BatchNormStats&,         \
                                     std::span<const T>, std::span<const T>, Tensor<T>&,      \
                                     std::optional<T>);                                       \
  template void batchnorm_backward_sums<T>(const Tensor<T>&, const Tensor<T>&, Layout,        \
                                           const BatchNormStats&, std::span<double>,          \
                                           std::span<double>);                                \
  template void batchnorm_backward_data<T>(                                                   \
      const Tensor<T>&, const Tensor<T>&, Layout, const BatchNormStats&, std::span<const T>,  \
      std::span<const double>, std::span<const double>, Tensor<T>&);
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
};

}  // namespace

template <typename T>
std::unique_ptr<BatchNormKernel<T>> make_cpu_batch_norm() {
  return std::make_unique<CpuBatchNorm<T>>();
}

template std::unique_ptr<BatchNormKernel<float>> make_cpu_batch_norm<float>();
template std::unique_ptr<BatchNormKernel<double>> make_cpu_batch_norm<double>();

}  // namespace tessera
