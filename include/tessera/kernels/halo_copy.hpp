// The copies of a halo exchange as a planned kernel of the Backend: boxes of every channel plane
// moved between a tile or window and another, or packed into and unpacked from the messages,
// converting between NCHW and the blocked layouts on the way; and a window's padding. The exchange
// (halo/halo_exchange.cpp) decides what moves where; these only move bytes. Every method is local.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tessera/box.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

enum class Direction { fill, accumulate };

// Where the elements of one channel plane of a tensor lie: `data` of `shape` with spatial origin
// `origin` (global coordinates of its first row and column), in NCHW or a blocked layout. With
// `sample_stride` non-zero, the planes are a run of channels of a larger tensor (channel_slice):
// `data` points at the run's first channel of sample 0, and sample n lies `sample_stride`
// elements after sample n - 1.
template <typename T>
struct Planes {
  T* data;
  Shape4 shape;
  Box origin;
  Layout layout;
  std::int64_t sample_stride = 0;

  // Channels per block: the distance between neighbouring columns of a plane, and how many
  // planes share memory (so go to one thread).
  std::int64_t block() const { return block_of(layout); }
  // Element (plane p = n * C + c, global row, global column).
  T* at(std::int64_t p, std::int64_t row, std::int64_t col) const {
    const std::int64_t r = row - origin.h.begin, c = col - origin.w.begin;
    if (sample_stride != 0)
      return data + p / shape.c * sample_stride +
             layout_offset({1, shape.c, shape.h, shape.w}, layout, 0, p % shape.c, r, c);
    if (layout == Layout::nchw) return data + (p * shape.h + r) * shape.w + c;
    return data + blocked_offset(shape, block(), p / shape.c, p % shape.c, r, c);
  }
  // The first element of the physical row `k` (of N x channel blocks x H rows of W x block()).
  T* row(std::int64_t k) const {
    const std::int64_t width = shape.w * block();
    if (sample_stride == 0) return data + k * width;
    const std::int64_t per_sample = channel_blocks(shape.c, block()) * shape.h;
    return data + k / per_sample * sample_stride + k % per_sample * width;
  }
};

// Channels [first, first + count) of `p` (a whole tensor's planes) as planes of their own; `first`
// a multiple of the layout's block. Local and pure.
template <typename T>
Planes<T> channel_slice(const Planes<T>& p, std::int64_t first, std::int64_t count) {
  const Shape4 one{1, p.shape.c, p.shape.h, p.shape.w};
  return {p.data + layout_offset(one, p.layout, 0, first, 0, 0),
          {p.shape.n, count, p.shape.h, p.shape.w},
          p.origin,
          p.layout,
          storage_size(one, p.layout)};
}

template <typename T>
Planes<T> planes_of(Tensor<T>& t, const Box& origin) {
  return {t.data_in(t.space()), t.shape(), origin, t.layout()};
}
template <typename T>
Planes<const T> planes_of(const Tensor<T>& t, const Box& origin) {
  return {t.data_in(t.space()), t.shape(), origin, t.layout()};
}

template <typename T>
class HaloCopyKernel {
 public:
  virtual ~HaloCopyKernel() = default;
  virtual std::string name() const = 0;
  // The memory the copies read and write; the exchange checks its tensors lie there.
  virtual MemorySpace space() const = 0;
  // Copies (fill) or adds (accumulate) `box` of every plane from `from` to `to`.
  virtual void move(const Planes<const T>& from, const Planes<T>& to, const Box& box,
                    Direction how) const = 0;
  // A message holds `box` of every plane in NCHW order, whatever the layout of `t`.
  virtual void pack(const Planes<const T>& t, const Box& box, T* message) const = 0;
  virtual void unpack(const T* message, const Box& box, const Planes<T>& t,
                      Direction how) const = 0;
  // Sets the elements of `t` outside `keep` (global coordinates) to `value`, padding channels of
  // blocked layouts included.
  virtual void fill_outside(const Planes<T>& t, const Box& keep, T value) const = 0;
  // Whether these copies take channel slices (Planes with a sample_stride) on every side.
  virtual bool takes_channel_slices() const { return false; }
};

// Tessera's CPU copies, split over the kernel threads. Local.
template <typename T>
std::unique_ptr<HaloCopyKernel<T>> make_cpu_halo_copy();

}  // namespace tessera
