// Built only when Meson finds the CUDA toolkit (option cuda=auto|enabled).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "cuda_check.hpp"
#include "tessera/gpu.hpp"

namespace tessera {
namespace {

// "GPU-" and the UUID's 16 bytes in hex, grouped 4-2-2-2-6 as nvidia-smi -L prints them.
std::string uuid_text(const cudaUUID_t& uuid) {
  std::string text = "GPU-";
  for (int i = 0; i < 16; ++i) {
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(uuid.bytes[i]));
    text += hex;
    if (i == 3 || i == 5 || i == 7 || i == 9) text += '-';
  }
  return text;
}

}  // namespace

GpuInfo gpu_info() {
  GpuInfo info;
  info.built = true;
  cudaRuntimeGetVersion(&info.runtime_version);
  const cudaError_t rc = cudaGetDeviceCount(&info.devices);
  if (rc != cudaSuccess || info.devices == 0) {
    info.devices = 0;
    info.error = rc != cudaSuccess ? cudaGetErrorString(rc) : "no CUDA device";
    return info;
  }
  for (int d = 0; d < info.devices; ++d) {
    cudaDeviceProp prop{};
    if (const cudaError_t e = cudaGetDeviceProperties(&prop, d); e != cudaSuccess) {
      info.devices = 0;
      info.uuids.clear();
      info.error = std::string("device ") + std::to_string(d) + ": " + cudaGetErrorString(e);
      return info;
    }
    if (d == 0) {
      info.name = prop.name;
      info.memory_bytes = static_cast<std::int64_t>(prop.totalGlobalMem);
    }
    info.uuids.push_back(uuid_text(prop.uuid));
  }
  return info;
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  TESSERA_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

}  // namespace tessera
