// How Tessera's CUDA kernels are launched (kernels/cuda/*.cu only): a grid-stride loop calling
// a device lambda once per element index. Each .cu file instantiates its own copies.
#pragma once

#include <cstdint>

#include "cuda_kernels.hpp"

namespace tessera::cuda {
namespace {

constexpr int kThreads = 256;

// Enough blocks to fill any current GPU several times over; the loop covers the rest.
inline unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

// Calls f(k) for every k < n, each once, spread over the grid.
template <typename F>
__global__ void for_each_index(std::int64_t n, F f) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t k = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += step)
    f(k);
}

// Enqueues f over [0, n) on `stream`; a failed launch is an Error naming `kernel`.
template <typename F>
void launch(const char* kernel, std::int64_t n, cudaStream_t stream, F f) {
  if (n <= 0) return;
  for_each_index<<<blocks_for(n), kThreads, 0, stream>>>(n, f);
  check_launch(kernel);
}

}  // namespace
}  // namespace tessera::cuda
