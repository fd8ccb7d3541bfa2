// How Tessera's CUDA kernels are launched (kernels/cuda/*.cu only): a grid-stride loop calling
// a device lambda once per element index. Each .cu file instantiates its own copies.
#pragma once

#include <algorithm>
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

// Calls f(p, r, c) for every plane p < planes, row r < rows and column c < cols, each once: x over
// a row's columns (coalesced), y over rows, z over planes, each a grid-stride loop. No index
// division per element, as `launch` needs to split a flat index (64-bit divisions held the
// element-wise kernels to a third of the memory's bandwidth on an H200).
template <typename F>
__global__ void for_each_plane_row_col(std::int64_t planes, std::int64_t rows, std::int64_t cols,
                                       F f) {
  for (std::int64_t p = blockIdx.z; p < planes; p += gridDim.z)
    for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y)
      for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
           c < cols; c += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
        f(p, r, c);
}

// The grid and block of a planes x rows x cols launch whose threads take `per_thread` columns of
// a row each (for_each_plane_row_col: 1; store_plane_row_col: kUnroll): x over a row's columns, y
// over rows, z over planes, about kBlocks blocks in all, each thread going over several rows where
// there are more. (A block per row segment measured the same on an H200 — an upsampling of 16
// planes to 2048x2048, 383 and 382 us — so block starts are not what holds these kernels back:
// README "GPU".)
struct RowsLaunch {
  dim3 grid;
  unsigned threads;
};
inline RowsLaunch rows_launch(std::int64_t planes, std::int64_t rows, std::int64_t cols,
                              std::int64_t per_thread) {
  constexpr std::int64_t kWarp = 32, kBlocks = 8192;
  const std::int64_t threads = std::min<std::int64_t>(kThreads, (cols + kWarp - 1) / kWarp * kWarp);
  const std::int64_t span = threads * per_thread;
  const std::int64_t x = std::min<std::int64_t>((cols + span - 1) / span, 1024);
  const std::int64_t z = std::min<std::int64_t>(planes, 65535);
  const std::int64_t y =
      std::clamp<std::int64_t>(kBlocks / (x * z), 1, std::min<std::int64_t>(rows, 65535));
  return {dim3(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(z)),
          static_cast<unsigned>(threads)};
}

// Enqueues f over planes x rows x cols on `stream` (for_each_plane_row_col); rows of fewer columns
// than a warp leave most of each block idle: use `launch` for those. A failed launch is an Error
// naming `kernel`.
template <typename F>
void launch_rows(const char* kernel, std::int64_t planes, std::int64_t rows, std::int64_t cols,
                 cudaStream_t stream, F f) {
  if (planes <= 0 || rows <= 0 || cols <= 0) return;
  const RowsLaunch l = rows_launch(planes, rows, cols, 1);
  for_each_plane_row_col<<<l.grid, l.threads, 0, stream>>>(planes, rows, cols, f);
  check_launch(kernel);
}

// *where(p, r, c) = value(p, r, c) for every plane p, row r and column c, as launch_rows
// spreads them, with kUnroll columns of a row to each thread at a time: their values are all
// computed before any is stored, so a thread has kUnroll loads in flight rather than one (a
// lambda that stores as it loads may alias its next load, so nothing was loaded ahead: README
// "GPU"). `value` reads (it may read the element it replaces: an accumulation); `where` gives the
// output's address. Each value is the same arithmetic as launch_rows would run.
constexpr int kUnroll = 4;
template <typename Where, typename F>
__global__ void store_plane_row_col(std::int64_t planes, std::int64_t rows, std::int64_t cols,
                                    Where where, F value) {
  using T = decltype(value(std::int64_t{}, std::int64_t{}, std::int64_t{}));
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t p = blockIdx.z; p < planes; p += gridDim.z)
    for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y)
      for (std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
           c0 < cols; c0 += kUnroll * step) {
        T v[kUnroll];
#pragma unroll
        for (int j = 0; j < kUnroll; ++j)
          if (c0 + j * step < cols) v[j] = value(p, r, c0 + j * step);
#pragma unroll
        for (int j = 0; j < kUnroll; ++j)
          if (c0 + j * step < cols) *where(p, r, c0 + j * step) = v[j];
      }
}

// The address of (p, r, c) in a row-major planes x rows x cols array.
template <typename T>
struct RowMajor {
  T* out;
  std::int64_t rows, cols;
  __device__ T* operator()(std::int64_t p, std::int64_t r, std::int64_t c) const {
    return out + (p * rows + r) * cols + c;
  }
};

// Enqueues store_plane_row_col on `stream` (rows_launch with kUnroll columns a thread). A failed
// launch is an Error naming `kernel`.
template <typename Where, typename F>
void store_at(const char* kernel, std::int64_t planes, std::int64_t rows, std::int64_t cols,
              cudaStream_t stream, Where where, F value) {
  if (planes <= 0 || rows <= 0 || cols <= 0) return;
  const RowsLaunch l = rows_launch(planes, rows, cols, kUnroll);
  store_plane_row_col<<<l.grid, l.threads, 0, stream>>>(planes, rows, cols, where, value);
  check_launch(kernel);
}
// store_at into the row-major array `out`: out[(p * rows + r) * cols + c] = value(p, r, c).
template <typename T, typename F>
void store_rows(const char* kernel, T* out, std::int64_t planes, std::int64_t rows,
                std::int64_t cols, cudaStream_t stream, F value) {
  store_at(kernel, planes, rows, cols, stream, RowMajor<T>{out, rows, cols}, value);
}

}  // namespace
}  // namespace tessera::cuda
