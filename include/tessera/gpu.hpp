// What the build knows about GPUs. The CUDA backend (cuDNN, NCCL) is not built yet; this reports
// whether the CUDA runtime was linked and what it sees, for `tessera --version`. Local.
#pragma once

#include <string>

namespace tessera {

struct GpuInfo {
  bool built = false;       // compiled with the CUDA runtime
  int runtime_version = 0;  // e.g. 13000 for 13.0
  int devices = 0;
  std::string error;  // why no device is usable, if none is
};

GpuInfo gpu_info();

}  // namespace tessera
