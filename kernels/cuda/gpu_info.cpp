// Built only when Meson finds the CUDA toolkit (option cuda=auto|enabled).
#include <cuda_runtime_api.h>

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
  }
  return info;
}

}  // namespace tessera
