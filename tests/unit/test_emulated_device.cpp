// Emulated device memory (allocator.hpp) and the copies between memory spaces (tensor.hpp): the
// host reaches emulated device tensors only inside a kernel scope, and copies, zeroing and host
// views move the values exactly. The whole model on this memory is the MPI suite under
// TESSERA_KERNELS=emulated (tests/meson.build).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tessera/allocator.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/tensor.hpp"

namespace tessera {
namespace {

Tensor<double> counting(Shape4 s) {
  Tensor<double> t(s);
  for (std::size_t k = 0; k < t.size(); ++k)
    t.data()[k] = 0.5 + static_cast<double>(k);
  return t;
}

TEST(EmulatedDevice, HostAccessorsRefuseItOutsideAKernel) {
  Tensor<float> t({1, 2, 3, 4}, Layout::nchw, emulated_device_allocator());
  EXPECT_EQ(t.space(), MemorySpace::device);
  try {
    (void)t.data();
    ADD_FAILURE() << "a host accessor reached emulated device memory";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("device"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)t.span(), Error);
  EXPECT_THROW(t.fill(1.0f), Error);
  {
    EmulatedKernelScope kernel;
    for (float v : t.span())
      EXPECT_EQ(v, 0.0f);  // the allocator's constructor zeroed it
    t.fill(2.0f);
  }
  EXPECT_THROW((void)t.at(0, 0, 0, 0), Error);
  EXPECT_EQ(to_host(t).at(0, 1, 2, 3), 2.0f);
}

TEST(EmulatedDevice, CopiesBetweenSpacesKeepEveryValueAndTheLayout) {
  const Tensor<double> host = counting({2, 3, 2, 2});
  const Tensor<double> device = copy_to(host, emulated_device_allocator());
  EXPECT_EQ(device.space(), MemorySpace::device);
  EXPECT_EQ(device.shape(), host.shape());
  const Tensor<double> back = to_host(device);
  EXPECT_EQ(back.space(), MemorySpace::host);
  for (std::size_t k = 0; k < host.size(); ++k)
    EXPECT_EQ(back.data()[k], host.data()[k]);

  // A copy within the device stays there; download and upload move size() values.
  Tensor<double> twin = device;
  EXPECT_EQ(twin.space(), MemorySpace::device);
  std::vector<double> out(twin.size());
  download(twin, out.data());
  EXPECT_EQ(out.back(), host.data()[host.size() - 1]);
  for (double& v : out)
    v = -v;
  upload(out.data(), twin);
  EXPECT_EQ(to_host(twin).data()[3], -host.data()[3]);
  twin.zero();
  EXPECT_EQ(to_host(twin).data()[3], 0.0);
}

TEST(EmulatedDevice, HostValuesWriteBackOnlyWhenStored) {
  Tensor<double> device = copy_to(counting({1, 4, 1, 1}), emulated_device_allocator());
  {
    HostValues<double> v(device);
    v.span()[2] = 100;
  }
  EXPECT_EQ(to_host(device).data()[2], 2.5);  // not stored: the device copy is unchanged
  HostValues<double> v(device);
  v.span()[2] = 100;
  v.store();
  EXPECT_EQ(to_host(device).data()[2], 100);

  Tensor<double> host = counting({1, 4, 1, 1});
  HostValues<double> direct(host);  // host memory: the tensor's own values
  direct.span()[0] = 7;
  EXPECT_EQ(host.data()[0], 7);
}

TEST(EmulatedDevice, TheBackendComputesInItAndIsAChoiceOfTheKernelsVariable) {
  EXPECT_EQ(parse_kernel_backend("emulated"), KernelBackend::emulated);
  const Backend& b = backend_of(KernelBackend::emulated);
  EXPECT_EQ(&b.allocator(), &emulated_device_allocator());
  auto merge = b.merge<float>();
  EXPECT_EQ(merge->name(), "emulated threaded");
  Tensor<float> a = copy_to(Tensor<float>({1, 2, 2, 2}, 1.0f), b.allocator());
  const Tensor<float> c = copy_to(Tensor<float>({1, 2, 2, 2}, 2.0f), b.allocator());
  merge->add(c, a);  // the kernel reaches both inside its scope
  EXPECT_EQ(to_host(a).data()[7], 3.0f);
  EXPECT_EQ(a.space(), MemorySpace::device);
}

}  // namespace
}  // namespace tessera
