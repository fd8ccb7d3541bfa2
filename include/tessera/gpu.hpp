// What the build knows about GPUs, and device memory: whether the CUDA runtime was linked and what
// it sees (`tessera --version`), the current device, the current device's memory as an Allocator,
// and the CUDA kernels' options. The CUDA backend itself is kernels/backend.hpp's cuda_backend().
// Local.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/allocator.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

struct GpuInfo {
  bool built = false;       // compiled with the CUDA runtime
  int runtime_version = 0;  // e.g. 13000 for 13.0
  int devices = 0;
  std::string error;  // why no device is usable, whenever none is ("this build has no CUDA", ...)
  // Of device 0, when there is one: its name and memory (tessera plan --device cuda).
  std::string name;
  std::int64_t memory_bytes = 0;
  // Every device this process sees, by index: its UUID as nvidia-smi prints it ("GPU-" and 32 hex
  // digits in groups). CUDA_VISIBLE_DEVICES, and Slurm's --gpus-per-task through it, restrict and
  // renumber the devices per process, so an index names different GPUs in different ranks; the
  // UUID is the same everywhere (src/placement.cpp compares them).
  std::vector<std::string> uuids;
};

GpuInfo gpu_info();

// Makes `device` the current CUDA device of this process, and its name ("NVIDIA H100 80GB HBM3").
// The device memory and the kernels' stream are bound to the device current when first used, so
// a different device after that is an Error; so is any device in a build without CUDA. Local.
void set_current_device(int device);
std::string device_name(int device);

// How the CUDA kernels compute: process-wide, like the kernel threads (backend.hpp), set once by
// main from the command line. Local.
struct CudaOptions {
  // Only algorithms cuDNN marks deterministic (bitwise the same result every run).
  bool deterministic = false;
  // float32 convolutions may use TF32 tensor cores (10-bit mantissa products). Off: float32 is
  // checked against float32.
  bool allow_tf32 = false;
  // cuDNN's algorithms measured on the GPU (cudnnFind*: each candidate run once, the fastest
  // kept, as PyTorch's cudnn.benchmark), once per distinct convolution in the process; else
  // cuDNN's heuristics (no runs; on an H100 conv-bench's step took 0.25 s instead of 0.05 s).
  // TESSERA_CUDNN_SEARCH=measure|heuristic.
  bool measure_algorithms = true;
  // Print each choice and cuDNN's ranked candidates to stderr (TESSERA_CUDNN_LOG=1).
  bool log_algorithms = false;
};
void set_cuda_options(const CudaOptions& options);
const CudaOptions& cuda_options();

// The memory of the current CUDA device (stream-ordered cudaMallocAsync / cudaFreeAsync; copies
// with cudaMemcpyAsync, finished before they return), one per process like host_allocator(); null
// in a build without CUDA or when no device is usable. An allocation that does not fit throws an
// Error naming the bytes asked and the bytes free.
Allocator* device_allocator();

}  // namespace tessera
