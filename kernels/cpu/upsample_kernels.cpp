// Nearest upsampling by 2 across the columns (include/tessera/kernels/local_kernels.hpp,
// make_cpu_upsample), in NCHW or a blocked layout: each input value written to two neighbouring
// outputs, and each input gradient summed from its outputs, with contiguous loops GCC vectorises
// (the reference gathers through a column table). Same results as
// reference::upsample_nearest_forward / _backward bit for bit: the backward adds each input's
// gradients in the reference's order (row-major over the outputs), one input row at a time.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/error.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference_upsample.hpp"
#include "tessera/kernels/window_arithmetic.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

// Where an output row of `count` columns reads at scale 2 with phase `phase`: output q reads
// input (q + phase) / 2, so the row starts at input phase / 2 and, for an odd phase, its first
// output is alone with its input; after that outputs come in pairs.
struct Pairs {
  std::int64_t first_input = 0;
  bool single_first = false;  // output 0 alone (odd phase)
  std::int64_t pairs = 0;     // then pairs of outputs, one input each
  bool single_last = false;   // and one output left over
};

Pairs pairs_of(std::int64_t count, std::int64_t phase) {
  Pairs p;
  p.first_input = phase / 2;
  p.single_first = phase % 2 == 1 && count > 0;
  const std::int64_t rest = count - (p.single_first ? 1 : 0);
  p.pairs = rest / 2;
  p.single_last = rest % 2 == 1;
  return p;
}

// A row of pixels of V values each (V channels side by side in a blocked layout, one in NCHW):
// output pixel pairs from input pixels.
template <std::int64_t V, typename T>
void widen_row(const T* __restrict in, T* __restrict out, const Pairs& p) {
  in += p.first_input * V;
  if (p.single_first) {
    std::copy(in, in + V, out);
    in += V;
    out += V;
  }
  for (std::int64_t i = 0; i < p.pairs; ++i)
    for (std::int64_t v = 0; v < V; ++v) {
      out[2 * i * V + v] = in[i * V + v];
      out[(2 * i + 1) * V + v] = in[i * V + v];
    }
  if (p.single_last) std::copy(in + p.pairs * V, in + (p.pairs + 1) * V, out + 2 * p.pairs * V);
}

// in[i] += out[2i], then += out[2i + 1]: the reference's order within an output row.
template <std::int64_t V, typename T>
void narrow_row_into(const T* __restrict out, T* __restrict in, const Pairs& p) {
  in += p.first_input * V;
  if (p.single_first) {
    for (std::int64_t v = 0; v < V; ++v)
      in[v] += out[v];
    in += V;
    out += V;
  }
  for (std::int64_t i = 0; i < p.pairs; ++i)
    for (std::int64_t v = 0; v < V; ++v)
      in[i * V + v] = (in[i * V + v] + out[2 * i * V + v]) + out[(2 * i + 1) * V + v];
  if (p.single_last)
    for (std::int64_t v = 0; v < V; ++v)
      in[p.pairs * V + v] += out[2 * p.pairs * V + v];
}

// NCHW, or a blocked layout: then a row is a block's row of pixels of V values (the padding
// channels of a last partial block upsampled with the rest: zeros stay zeros).
template <typename T>
class PairedUpsample final : public UpsampleKernel<T> {
 public:
  explicit PairedUpsample(const reference::UpsampleGeometry& g) : g_(g) {}
  std::string name() const override { return "threaded pairs"; }
  bool takes_blocked() const override { return true; }

  void forward(const Tensor<T>& x, Tensor<T>& y) const override {
    const Shape4 &xs = x.shape(), &ys = y.shape();
    reference::check_upsample("upsample_nearest_forward", xs, ys, g_);
    check_layouts(x, y);
    const std::int64_t v = block_of(x.layout()), planes = xs.n * channel_blocks(xs.c, v);
    const Pairs p = pairs_of(ys.w, g_.phase_w);
    const auto widen = v == 1 ? widen_row<1, T> : v == 8 ? widen_row<8, T> : widen_row<kBlock, T>;
    parallel_for(
        planes * ys.h,
        [&](std::int64_t first, std::int64_t last) {
          for (std::int64_t k = first; k < last; ++k) {
            const std::int64_t plane = k / ys.h, r = k % ys.h;
            const std::int64_t source = elementwise::upsample_source(r, g_.scale_h, g_.phase_h);
            widen(x.data() + (plane * xs.h + source) * xs.w * v, y.data() + k * ys.w * v, p);
          }
        },
        grain_for(ys.w * v));
  }

  // One input row at a time: zeros, then the output rows that read it in increasing order.
  void backward(const Tensor<T>& dy, Tensor<T>& dx) const override {
    const Shape4 &xs = dx.shape(), &ys = dy.shape();
    reference::check_upsample("upsample_nearest_backward", xs, ys, g_);
    check_layouts(dx, dy);
    const std::int64_t v = block_of(dx.layout()), planes = xs.n * channel_blocks(xs.c, v);
    const Pairs p = pairs_of(ys.w, g_.phase_w);
    const auto narrow = v == 1   ? narrow_row_into<1, T>
                        : v == 8 ? narrow_row_into<8, T>
                                 : narrow_row_into<kBlock, T>;
    const std::int64_t sh = g_.scale_h, ph = g_.phase_h;
    parallel_for(
        planes * xs.h,
        [&](std::int64_t first, std::int64_t last) {
          for (std::int64_t k = first; k < last; ++k) {
            const std::int64_t plane = k / xs.h, row = k % xs.h;
            T* in = dx.data() + k * xs.w * v;
            std::fill(in, in + xs.w * v, T(0));
            // Output rows r with (r + ph) / sh == row.
            const std::int64_t begin = std::max<std::int64_t>(row * sh - ph, 0);
            const std::int64_t end = std::min<std::int64_t>(row * sh - ph + sh, ys.h);
            for (std::int64_t r = begin; r < end; ++r)
              narrow(dy.data() + (plane * ys.h + r) * ys.w * v, in, p);
          }
        },
        grain_for(xs.w * v * sh * 2));
  }

 private:
  static void check_layouts(const Tensor<T>& a, const Tensor<T>& b) {
    TESSERA_CHECK(a.layout() == b.layout(), std::string("upsample_nearest: ") +
                                                to_string(a.layout()) + " and " +
                                                to_string(b.layout()) + " tensors");
  }
  reference::UpsampleGeometry g_;
};

}  // namespace

template <typename T>
std::unique_ptr<UpsampleKernel<T>> make_cpu_upsample(const reference::UpsampleGeometry& g) {
  if (g.scale_w == 2) return std::make_unique<PairedUpsample<T>>(g);
  return make_reference_upsample<T>(g);
}

template std::unique_ptr<UpsampleKernel<float>> make_cpu_upsample<float>(
    const reference::UpsampleGeometry&);
template std::unique_ptr<UpsampleKernel<double>> make_cpu_upsample<double>(
    const reference::UpsampleGeometry&);

}  // namespace tessera
