// Built when CUDA is disabled or not found.
#include "tessera/gpu.hpp"

#include "tessera/device_comm.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"

namespace tessera {

GpuInfo gpu_info() {
  GpuInfo info;
  info.error = "this build has no CUDA";
  return info;
}

Allocator* device_allocator() {
  return nullptr;
}

void set_current_device(int device) {
  throw Error("GPU " + std::to_string(device) + " asked for, but this build has no CUDA");
}

std::string device_name(int) {
  return "no CUDA in this build";
}

const Backend* cuda_backend() {
  return nullptr;
}

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm>) {
  throw Error("the NCCL transport asked for, but this build has no CUDA: run with --transport mpi");
}

}  // namespace tessera
