#include "tessera/kernels/conv_kernel.hpp"

#include <algorithm>

#include "tessera/error.hpp"

namespace tessera {
namespace {

// Calls f(outer_row, box_row, width) for every row of the box.
template <typename Outer, typename Box, typename F>
void for_box_rows(Outer& outer, BoxAt at, Box& box, F&& f) {
  const Shape4 &o = outer.shape(), &b = box.shape();
  TESSERA_CHECK(
      o.n == b.n && o.c == b.c && at.h >= 0 && at.w >= 0 && at.h + b.h <= o.h && at.w + b.w <= o.w,
      "box " + b.str() + " at (" + std::to_string(at.h) + ", " + std::to_string(at.w) +
          ") does not fit in " + o.str());
  for (std::int64_t p = 0; p < b.n * b.c; ++p)
    for (std::int64_t r = 0; r < b.h; ++r)
      f(outer.data() + (p * o.h + at.h + r) * o.w + at.w, box.data() + (p * b.h + r) * b.w, b.w);
}

// The parts of a concat (ConvKernel::forward_parts) and the tensor that is their concatenation:
// calls f(part's sample, whole's sample at the part's first channel, elements) for every part and
// sample. A part's samples are whole channel blocks in every layout, as the whole's are from a
// block's first channel on. Checks the parts' shapes and layouts against the whole's.
template <typename P, typename W, typename F>
void for_part_samples(std::span<P* const> parts, W& whole, F&& f) {
  const Shape4& s = whole.shape();
  const Layout layout = whole.layout();
  const Shape4 one{1, s.c, s.h, s.w};
  const std::int64_t per_sample = storage_size(one, layout);
  std::int64_t first = 0;
  for (P* part : parts) {
    const Shape4& p = part->shape();
    TESSERA_CHECK(p.n == s.n && p.h == s.h && p.w == s.w && part->layout() == layout &&
                      first % block_of(layout) == 0,
                  "conv kernel: a concat's part " + p.str() + " at channel " +
                      std::to_string(first) + " does not fit its concatenation " + s.str());
    const std::int64_t part_sample = storage_size({1, p.c, p.h, p.w}, layout);
    const std::int64_t offset = layout_offset(one, layout, 0, first, 0, 0);
    for (std::int64_t n = 0; n < s.n; ++n)
      f(part->data() + n * part_sample, whole.data() + n * per_sample + offset, part_sample);
    first += p.c;
  }
  TESSERA_CHECK(first == s.c, "conv kernel: a concat's parts hold " + std::to_string(first) +
                                  " channels, the kernel was planned for " + std::to_string(s.c));
}

// An uninitialised tensor shaped as the parts' concatenation, in their layout and memory.
template <typename T, typename P>
Tensor<T> concatenation_of(std::span<P* const> parts) {
  TESSERA_CHECK(!parts.empty(), "conv kernel: a concat of no parts");
  Shape4 s = parts[0]->shape();
  s.c = 0;
  for (P* part : parts)
    s.c += part->shape().c;
  return {s, parts[0]->layout(), uninitialized, parts[0]->allocator()};
}

// The parts' concatenation, copied.
template <typename T>
Tensor<T> gathered(std::span<const Tensor<T>* const> parts) {
  Tensor<T> whole = concatenation_of<T>(parts);
  for_part_samples(parts, whole,
                   [](const T* part, T* at, std::int64_t n) { std::copy(part, part + n, at); });
  return whole;
}

}  // namespace

template <typename T>
void ConvKernel<T>::forward_parts(std::span<const Tensor<T>* const> x, const Tensor<T>& w,
                                  std::span<const T> bias, Tensor<T>& y) {
  forward(gathered(x), w, bias, y);
}

template <typename T>
void ConvKernel<T>::backward_data_parts(const Tensor<T>& dy, const Tensor<T>& w,
                                        std::span<Tensor<T>* const> dx) {
  Tensor<T> whole = concatenation_of<T>(dx);
  backward_data(dy, w, whole);
  const Tensor<T>& from = whole;
  for_part_samples(dx, from,
                   [](T* part, const T* at, std::int64_t n) { std::copy(at, at + n, part); });
}

template <typename T>
void ConvKernel<T>::backward_filter_parts(std::span<const Tensor<T>* const> x, const Tensor<T>& dy,
                                          Tensor<T>& dw, std::span<T> dbias) {
  backward_filter(gathered(x), dy, dw, dbias);
}

template <typename T>
void copy_box_out(const Tensor<T>& outer, BoxAt at, Tensor<T>& box) {
  for_box_rows(outer, at, box,
               [](const T* from, T* to, std::int64_t n) { std::copy(from, from + n, to); });
}

template <typename T>
void copy_box_in(const Tensor<T>& box, Tensor<T>& outer, BoxAt at) {
  for_box_rows(outer, at, box,
               [](T* to, const T* from, std::int64_t n) { std::copy(from, from + n, to); });
}

template <typename T>
void ReferenceConv<T>::forward_box(const Tensor<T>& x, BoxAt x_at, const Tensor<T>& w,
                                   std::span<const T> bias, Tensor<T>& y, BoxAt y_at) {
  TESSERA_CHECK(shapes_.is_box() && x.shape() == shapes_.x_outer && y.shape() == shapes_.y_outer,
                "reference conv forward_box: planned for boxes of " + shapes_.x_outer.str() +
                    " / " + shapes_.y_outer.str() + ", called with " + x.shape().str() + " / " +
                    y.shape().str());
  Tensor<T> xb(shapes_.x, uninitialized), yb(shapes_.y, uninitialized);
  copy_box_out(x, x_at, xb);
  reference::conv2d_forward(xb, w, bias, yb, g_);
  copy_box_in(yb, y, y_at);
}

template void copy_box_out(const Tensor<float>&, BoxAt, Tensor<float>&);
template void copy_box_out(const Tensor<double>&, BoxAt, Tensor<double>&);
template void copy_box_in(const Tensor<float>&, Tensor<float>&, BoxAt);
template void copy_box_in(const Tensor<double>&, Tensor<double>&, BoxAt);
template class ConvKernel<float>;
template class ConvKernel<double>;
template class ReferenceConv<float>;
template class ReferenceConv<double>;

}  // namespace tessera
