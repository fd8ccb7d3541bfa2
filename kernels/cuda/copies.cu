// Strided box copies and fills on the device: the halo exchange's moves, packs and unpacks and
// the merges' channel blocks (kernels/cuda/cuda_local_kernels.cpp) are 3-D boxes of elements.
#include <cstdint>

#include "cuda_kernels.hpp"

namespace tessera::cuda {
namespace {

constexpr int kThreads = 256;

// Element k of the box (the innermost extent fastest): its offset with strides `stride`.
__device__ inline std::int64_t box_offset(const Box3& box, const std::int64_t* stride,
                                          std::int64_t k) {
  const std::int64_t c = k % box.extent[2], b = k / box.extent[2] % box.extent[1],
                     a = k / (box.extent[2] * box.extent[1]);
  return a * stride[0] + b * stride[1] + c * stride[2];
}

// One thread per element of the box, the innermost extent fastest (coalesced rows).
template <typename T>
__global__ void copy_box_kernel(const T* src, T* dst, Box3 box, bool accumulate) {
  const std::int64_t n = box.extent[0] * box.extent[1] * box.extent[2];
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t k = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += step) {
    const T v = src[box_offset(box, box.src_stride, k)];
    T& out = dst[box_offset(box, box.dst_stride, k)];
    out = accumulate ? out + v : v;
  }
}

template <typename T>
__global__ void fill_box_kernel(T* dst, Box3 box, T value) {
  const std::int64_t n = box.extent[0] * box.extent[1] * box.extent[2];
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t k = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += step) {
    dst[box_offset(box, box.dst_stride, k)] = value;
  }
}

unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

}  // namespace

template <typename T>
void copy_box(const T* src, T* dst, const Box3& box, bool accumulate, cudaStream_t stream) {
  const std::int64_t n = box.extent[0] * box.extent[1] * box.extent[2];
  if (n <= 0) return;
  copy_box_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(src, dst, box, accumulate);
  check_launch("copy_box");
}

template <typename T>
void fill_box(T* dst, const Box3& box, T value, cudaStream_t stream) {
  const std::int64_t n = box.extent[0] * box.extent[1] * box.extent[2];
  if (n <= 0) return;
  fill_box_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(dst, box, value);
  check_launch("fill_box");
}

template void copy_box<float>(const float*, float*, const Box3&, bool, cudaStream_t);
template void copy_box<double>(const double*, double*, const Box3&, bool, cudaStream_t);
template void fill_box<float>(float*, const Box3&, float, cudaStream_t);
template void fill_box<double>(double*, const Box3&, double, cudaStream_t);

}  // namespace tessera::cuda
