// Built only when Meson finds the CUDA toolkit (option cuda=auto|enabled).
#include <cuda_runtime_api.h>

#include "cuda_check.hpp"
#include "tessera/gpu.hpp"

namespace tessera {

GpuInfo gpu_info() {
  GpuInfo info;
  info.built = true;
  cudaRuntimeGetVersion(&info.runtime_version);
  const cudaError_t rc = cudaGetDeviceCount(&info.devices);
  if (rc != cudaSuccess) {
    info.devices = 0;
    info.error = cudaGetErrorString(rc);
  } else if (info.devices == 0) {
    info.error = "no CUDA device";
  } else if (cudaDeviceProp prop{}; cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    info.name = prop.name;
    info.memory_bytes = static_cast<std::int64_t>(prop.totalGlobalMem);
  }
  return info;
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  TESSERA_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

}  // namespace tessera
