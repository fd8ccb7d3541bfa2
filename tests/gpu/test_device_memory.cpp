// Device memory (include/tessera/gpu.hpp) on a real GPU: tensors in device memory keep their
// shape, layout and bytes through copies to and from the host, host accessors refuse them, and an
// allocation that cannot fit names the bytes asked and free; staging memory is page-locked. Skipped
// without a GPU (gpu_main.cpp).
#include <gtest/gtest.h>

#include <algorithm>

#include "../common/test_helpers.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera_config.h"
#if TESSERA_HAVE_CUDA  // the tests are built, and skipped, without CUDA too
#include <cuda_runtime_api.h>
#endif

namespace tessera {
namespace {

TEST(DeviceMemory, TensorsRoundTripThroughTheDevice) {
  Allocator& device = *device_allocator();
  const Tensor<float> host = test::random_tensor<float>({2, 20, 33, 17}, 5, 1);
  const Tensor<float> blocked = to_layout(host, Layout::nchw16c);
  const Tensor<float> on_device = copy_to(blocked, device);
  EXPECT_EQ(on_device.space(), MemorySpace::device);
  EXPECT_EQ(on_device.layout(), Layout::nchw16c);
  EXPECT_THROW((void)on_device.data(), Error);
  const Tensor<float> device_copy = on_device;  // a device-to-device copy
  EXPECT_EQ(device_copy.space(), MemorySpace::device);
  EXPECT_NE(device_copy.data_in(MemorySpace::device), on_device.data_in(MemorySpace::device));
  const Tensor<float> back = copy_to(device_copy, host_allocator());
  EXPECT_EQ(back.layout(), Layout::nchw16c);
  ASSERT_EQ(back.size(), blocked.size());
  for (std::size_t k = 0; k < back.size(); ++k)
    ASSERT_EQ(back.data()[k], blocked.data()[k]) << "element " << k;
}

TEST(DeviceMemory, AnAllocationTooLargeNamesTheBytes) {
  try {
    void* p = device_allocator()->allocate(std::size_t{1} << 50);  // 1 PiB
    device_allocator()->deallocate(p, std::size_t{1} << 50);
    ADD_FAILURE() << "a 1 PiB device allocation succeeded";
  } catch (const Error& e) {
    test::expect_mentions(e.what(), {"out of device memory", "1125899906842624 bytes", "free of"});
  }
  // The device still works afterwards.
  const Tensor<double> t = copy_to(Tensor<double>({1, 1, 4, 4}, 2.0), *device_allocator());
  EXPECT_EQ(copy_to(t, host_allocator()).data()[15], 2.0);
}

// The MPI transport stages halos and gradient buckets in the device allocator's staging memory:
// host memory the GPU's copy engines reach directly (page-locked), through which tensors upload
// and download unchanged.
TEST(DeviceMemory, StagingMemoryIsPageLockedHostMemory) {
  Allocator& staging = device_allocator()->staging();
  EXPECT_EQ(staging.space(), MemorySpace::host);
  const Tensor<double> host = test::random_tensor<double>({1, 3, 9, 11}, 6, 1);
  Tensor<double> staged(host.shape(), Layout::nchw, uninitialized, staging);
#if TESSERA_HAVE_CUDA
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, staged.data()), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost) << "pageable memory, not page-locked";
#endif
  std::copy(host.span().begin(), host.span().end(), staged.span().begin());
  Tensor<double> on_device(host.shape(), Layout::nchw, uninitialized, *device_allocator());
  upload(staged.data(), on_device);
  Tensor<double> back(host.shape(), Layout::nchw, uninitialized, staging);
  download(on_device, back.data());
  EXPECT_TRUE(std::equal(host.span().begin(), host.span().end(), back.span().begin()));
}

}  // namespace
}  // namespace tessera
