// Built when CUDA is disabled or not found.
#include "tessera/gpu.hpp"

namespace tessera {

GpuInfo gpu_info() {
  return {.built = false, .error = "built without CUDA"};
}

}  // namespace tessera
