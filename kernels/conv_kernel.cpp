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

}  // namespace

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
template class ReferenceConv<float>;
template class ReferenceConv<double>;

}  // namespace tessera
