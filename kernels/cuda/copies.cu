// Strided box copies and fills on the device: the halo exchange's moves, packs and unpacks, the
// merges' channel blocks and the convolutions' padded copies (kernels/cuda/) are 3-D boxes of
// elements. Boxes with rows of at least a warp: store_at (copies; four elements in flight a thread)
// and launch_rows (fills), launch.cuh, the innermost extent fastest (coalesced rows), no index
// division per element. Narrower boxes (a halo's columns): one thread per element.
#include <cstdint>

#include "launch.cuh"

namespace tessera::cuda {
namespace {

// Element k of the box: its offset with strides `stride`.
__device__ inline std::int64_t box_offset(const Box3& box, const std::int64_t* stride,
                                          std::int64_t k) {
  const std::int64_t c = k % box.extent[2], b = k / box.extent[2] % box.extent[1],
                     a = k / (box.extent[2] * box.extent[1]);
  return a * stride[0] + b * stride[1] + c * stride[2];
}

std::int64_t elements(const Box3& box) {
  return box.extent[0] * box.extent[1] * box.extent[2];
}

// Element (a, r, c) of a box with strides `stride`.
__device__ inline std::int64_t at(const std::int64_t* stride, std::int64_t a, std::int64_t r,
                                  std::int64_t c) {
  return a * stride[0] + r * stride[1] + c * stride[2];
}

// The address of (a, r, c) of a box in dst (store_at).
template <typename T>
struct BoxAddress {
  T* dst;
  Box3 b;
  __device__ T* operator()(std::int64_t a, std::int64_t r, std::int64_t c) const {
    return dst + at(b.dst_stride, a, r, c);
  }
};

// Whether the box's rows are wide enough for launch_rows.
bool by_rows(const Box3& b) {
  return b.extent[2] >= 32;
}

}  // namespace

template <typename T>
void copy_box(const T* src, T* dst, const Box3& box, bool accumulate, cudaStream_t stream) {
  const Box3 b = box;
  if (by_rows(b)) {
    const BoxAddress<T> where{dst, b};
    if (accumulate)
      store_at("copy_box", b.extent[0], b.extent[1], b.extent[2], stream, where,
               [=] __device__(std::int64_t a, std::int64_t r, std::int64_t c) {
                 return dst[at(b.dst_stride, a, r, c)] + src[at(b.src_stride, a, r, c)];
               });
    else
      store_at("copy_box", b.extent[0], b.extent[1], b.extent[2], stream, where,
               [=] __device__(std::int64_t a, std::int64_t r, std::int64_t c) {
                 return src[at(b.src_stride, a, r, c)];
               });
    return;
  }
  launch("copy_box", elements(b), stream, [=] __device__(std::int64_t k) {
    const T v = src[box_offset(b, b.src_stride, k)];
    T& out = dst[box_offset(b, b.dst_stride, k)];
    out = accumulate ? out + v : v;
  });
}

template <typename T>
void fill_box(T* dst, const Box3& box, T value, cudaStream_t stream) {
  const Box3 b = box;
  if (by_rows(b)) {
    launch_rows("fill_box", b.extent[0], b.extent[1], b.extent[2], stream,
                [=] __device__(std::int64_t a, std::int64_t r, std::int64_t c) {
                  dst[at(b.dst_stride, a, r, c)] = value;
                });
    return;
  }
  launch("fill_box", elements(b), stream,
         [=] __device__(std::int64_t k) { dst[box_offset(b, b.dst_stride, k)] = value; });
}

template void copy_box<float>(const float*, float*, const Box3&, bool, cudaStream_t);
template void copy_box<double>(const double*, double*, const Box3&, bool, cudaStream_t);
template void fill_box<float>(float*, const Box3&, float, cudaStream_t);
template void fill_box<double>(double*, const Box3&, double, cudaStream_t);

}  // namespace tessera::cuda
