// The main of the GPU tests: without a usable device (or in a build without CUDA) the whole
// executable reports itself skipped (Meson's exit code 77) with the reason, so the suite passes
// on machines without a GPU and says why.
#include <gtest/gtest.h>

#include <cstdio>

#include "tessera/gpu.hpp"

int main(int argc, char** argv) {
  const tessera::GpuInfo gpu = tessera::gpu_info();
  if (tessera::device_allocator() == nullptr) {
    std::printf("SKIP: no usable GPU (%s)\n", gpu.error.c_str());
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
