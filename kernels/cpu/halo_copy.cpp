// The CPU halo copies of include/tessera/kernels/halo_copy.hpp.
#include <algorithm>

#include "tessera/kernels/halo_copy.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

// Copies (fill) or adds (accumulate) `n` values `in_step` apart to `n` places `out_step` apart.
template <typename T>
void move_row(const T* in, std::int64_t in_step, T* out, std::int64_t out_step, std::int64_t n,
              Direction how) {
  if (in_step == 1 && out_step == 1) {
    if (how == Direction::fill) {
      std::copy(in, in + n, out);
    } else {
      for (std::int64_t k = 0; k < n; ++k)
        out[k] += in[k];
    }
  } else if (how == Direction::fill) {
    for (std::int64_t k = 0; k < n; ++k)
      out[k * out_step] = in[k * in_step];
  } else {
    for (std::int64_t k = 0; k < n; ++k)
      out[k * out_step] += in[k * in_step];
  }
}

// Copies (fill) or adds (accumulate) `box` of every plane from `from` to `to`, converting the
// layout on the way; planes go to the kernel threads in groups (the channels of a block) when the
// box is large. In one layout a row of a group is contiguous. Between layouts, tiles of 16
// columns of the 16 channels of a block, so that the strided side stays within 16 cache lines (a
// plane at a time would stride over a whole row per channel: 5x slower here).
// A group is a block of 16 channels of one sample (fewer in the last block when an nchw16c side
// pads its channels; the padding channels are never read or written), or one plane when both
// sides are NCHW.
template <typename T>
void move_box(const Planes<const T>& from, const Planes<T>& to, const Box& box, Direction how) {
  if (box.empty()) return;
  const std::int64_t group = std::max(from.block(), to.block()), width = box.w.size();
  const std::int64_t channels = from.shape.c, per_sample = (channels + group - 1) / group;
  const bool same = from.layout == to.layout;
  parallel_for(
      from.shape.n * per_sample,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t g = first; g < last; ++g) {
          const std::int64_t c0 = (g % per_sample) * group;
          const std::int64_t p0 = (g / per_sample) * channels + c0;
          const std::int64_t count = std::min(group, channels - c0);
          for (std::int64_t r = box.h.begin; r < box.h.end; ++r) {
            if (same && count == group) {
              move_row(from.at(p0, r, box.w.begin), 1, to.at(p0, r, box.w.begin), 1, width * group,
                       how);
              continue;
            }
            for (std::int64_t w0 = box.w.begin; w0 < box.w.end; w0 += kBlock)
              for (std::int64_t p = p0; p < p0 + count; ++p)
                move_row(from.at(p, r, w0), from.block(), to.at(p, r, w0), to.block(),
                         std::min(kBlock, box.w.end - w0), how);
          }
        }
      },
      grain_for(group * box.size()));
}

// A message holds `box` of every plane in NCHW order, whatever the layouts at both ends.
template <typename T>
void pack(const Planes<const T>& t, const Box& box, T* out) {
  const Planes<T> message{
      out, {t.shape.n, t.shape.c, box.h.size(), box.w.size()}, box, Layout::nchw};
  move_box(t, message, box, Direction::fill);
}

template <typename T>
void unpack(const T* in, const Box& box, const Planes<T>& t, Direction how) {
  const Planes<const T> message{
      in, {t.shape.n, t.shape.c, box.h.size(), box.w.size()}, box, Layout::nchw};
  move_box(message, t, box, how);
}

// Sets the elements of `t` outside `keep` to `value`: a window's padding, which no tile owns, or
// (zero) the part of a tile gradient the own window does not reach. Everything inside `keep` is
// written otherwise.
template <typename T>
void fill_outside(const Planes<T>& t, const Box& keep, T value) {
  const Shape4& s = t.shape;
  const Box& origin = t.origin;
  // Physical rows: in nChw16c a row of a channel block holds 16 values per column.
  const std::int64_t v = t.block(), width = s.w * v;
  const std::int64_t rows_total = s.n * (v == 1 ? s.c : channel_blocks(s.c)) * s.h;
  const Range rows = intersect(keep.h, origin.h), cols = intersect(keep.w, origin.w);
  parallel_for(
      rows_total,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t k = first; k < last; ++k) {
          T* row = t.data + k * width;
          const std::int64_t global = origin.h.begin + k % s.h;
          if (!rows.contains(global) || cols.empty()) {
            std::fill(row, row + width, value);
            continue;
          }
          std::fill(row, row + (cols.begin - origin.w.begin) * v, value);
          std::fill(row + (cols.end - origin.w.begin) * v, row + width, value);
        }
      },
      grain_for(width));
}

template <typename T>
class CpuHaloCopy final : public HaloCopyKernel<T> {
 public:
  std::string name() const override { return "threaded"; }
  MemorySpace space() const override { return MemorySpace::host; }
  void move(const Planes<const T>& from, const Planes<T>& to, const Box& box,
            Direction how) const override {
    move_box(from, to, box, how);
  }
  void pack(const Planes<const T>& t, const Box& box, T* message) const override {
    tessera::pack(t, box, message);
  }
  void unpack(const T* message, const Box& box, const Planes<T>& t, Direction how) const override {
    tessera::unpack(message, box, t, how);
  }
  void fill_outside(const Planes<T>& t, const Box& keep, T value) const override {
    tessera::fill_outside(t, keep, value);
  }
};

}  // namespace

template <typename T>
std::unique_ptr<HaloCopyKernel<T>> make_cpu_halo_copy() {
  return std::make_unique<CpuHaloCopy<T>>();
}

template std::unique_ptr<HaloCopyKernel<float>> make_cpu_halo_copy<float>();
template std::unique_ptr<HaloCopyKernel<double>> make_cpu_halo_copy<double>();

}  // namespace tessera
