// The CUDA backend (include/tessera/gpu.hpp: cuda_backend): cuDNN convolutions and Tessera's own
// CUDA kernels for every other layer, in device memory. No factory falls back to a host kernel,
// which could not read device memory.
#include <cudnn.h>

#include <memory>
#include <string>

#include "cuda_backend.hpp"
#include "cuda_check.hpp"
#include "cuda_context.hpp"
#include "tessera/gpu.hpp"
#include "tessera/kernels/backend.hpp"

namespace tessera {
namespace {

template <typename T>
std::unique_ptr<ConvKernel<T>> cudnn_conv(const ConvShapes& shapes,
                                          const reference::ConvGeometry& g) {
  std::string why;
  if (auto k = cuda::make_cudnn_conv<T>(shapes, g, cuda_options(), why)) return k;
  // Backend::conv never returns null for NCHW; a host kernel cannot stand in on the device.
  if (shapes.x_layout != Layout::nchw || shapes.y_layout != Layout::nchw) return nullptr;
  throw Error("cuDNN declined the convolution of x " + shapes.x.str() + ", w " + shapes.w.str() +
              ", y " + shapes.y.str() + " (stride " + std::to_string(g.stride_h) + "x" +
              std::to_string(g.stride_w) + ", dilation " + std::to_string(g.dilation_h) + "x" +
              std::to_string(g.dilation_w) + ", groups " + std::to_string(g.groups) + "): " + why);
}

class CudaBackend final : public Backend {
 public:
  KernelBackend kind() const override { return KernelBackend::cuda; }
  std::string description() const override {
    int device = 0;
    cudaDeviceProp prop{};
    TESSERA_CHECK_CUDA(cudaGetDevice(&device));
    TESSERA_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
    const CudaOptions& o = cuda_options();
    return "cuda on GPU " + std::to_string(device) + " (" + prop.name + "): cuDNN " +
           std::to_string(cudnnGetVersion()) + " convolutions" +
           (o.deterministic ? ", deterministic algorithms" : "") +
           (o.allow_tf32 ? ", TF32 allowed" : ", no TF32") +
           "; CUDA kernels for pooling, batch norm, activations, dropout, upsampling, merges, "
           "halo copies, the head, updates and the cross-entropy";
  }
  Allocator& allocator() const override { return *device_allocator(); }
  void synchronize() const override { cuda::Context::get().synchronize(); }

 protected:
  // cuDNN's kernels take no concat's parts (and convs keep their windows in device memory).
  bool float_conv_takes_parts(const ConvShapes& /*shapes*/,
                              const reference::ConvGeometry& /*g*/) const override {
    return false;
  }
  bool double_conv_takes_parts(const ConvShapes& /*shapes*/,
                               const reference::ConvGeometry& /*g*/) const override {
    return false;
  }
  std::unique_ptr<ConvKernel<float>> conv_float(const ConvShapes& shapes,
                                                const reference::ConvGeometry& g) const override {
    return cudnn_conv<float>(shapes, g);
  }
  std::unique_ptr<ConvKernel<double>> conv_double(const ConvShapes& shapes,
                                                  const reference::ConvGeometry& g) const override {
    return cudnn_conv<double>(shapes, g);
  }
  std::unique_ptr<ActivationKernel<float>> make_activation(ActivationKind kind, double slope,
                                                           float) const override {
    return cuda::make_activation<float>(kind, slope);
  }
  std::unique_ptr<ActivationKernel<double>> make_activation(ActivationKind kind, double slope,
                                                            double) const override {
    return cuda::make_activation<double>(kind, slope);
  }
  std::unique_ptr<DropoutKernel<float>> make_dropout(double p, float) const override {
    return cuda::make_dropout<float>(p);
  }
  std::unique_ptr<DropoutKernel<double>> make_dropout(double p, double) const override {
    return cuda::make_dropout<double>(p);
  }
  std::unique_ptr<UpdateKernel<float>> make_update(float) const override {
    return cuda::make_update<float>();
  }
  std::unique_ptr<UpdateKernel<double>> make_update(double) const override {
    return cuda::make_update<double>();
  }
  std::unique_ptr<MergeKernel<float>> make_merge(float) const override {
    return cuda::make_merge<float>();
  }
  std::unique_ptr<MergeKernel<double>> make_merge(double) const override {
    return cuda::make_merge<double>();
  }
  std::unique_ptr<HaloCopyKernel<float>> make_halo_copy(float) const override {
    return cuda::make_halo_copy<float>();
  }
  std::unique_ptr<HaloCopyKernel<double>> make_halo_copy(double) const override {
    return cuda::make_halo_copy<double>();
  }
  std::unique_ptr<LossKernel<float>> make_loss(float) const override {
    return cuda::make_loss<float>();
  }
  std::unique_ptr<LossKernel<double>> make_loss(double) const override {
    return cuda::make_loss<double>();
  }

  std::unique_ptr<PoolKernel<float>> pool_float(PoolKind kind, const PoolShapes& shapes,
                                                const reference::PoolGeometry& g) const override {
    return cuda::make_pool<float>(kind, shapes, g);
  }
  std::unique_ptr<PoolKernel<double>> pool_double(PoolKind kind, const PoolShapes& shapes,
                                                  const reference::PoolGeometry& g) const override {
    return cuda::make_pool<double>(kind, shapes, g);
  }
  std::unique_ptr<BatchNormKernel<float>> batch_norm_float() const override {
    return cuda::make_batch_norm<float>();
  }
  std::unique_ptr<BatchNormKernel<double>> batch_norm_double() const override {
    return cuda::make_batch_norm<double>();
  }
  std::unique_ptr<UpsampleKernel<float>> make_upsample(const reference::UpsampleGeometry& g,
                                                       float) const override {
    return cuda::make_upsample<float>(g);
  }
  std::unique_ptr<UpsampleKernel<double>> make_upsample(const reference::UpsampleGeometry& g,
                                                        double) const override {
    return cuda::make_upsample<double>(g);
  }
  std::unique_ptr<SpatialSumKernel<float>> make_spatial_sum(float) const override {
    return cuda::make_spatial_sum<float>();
  }
  std::unique_ptr<SpatialSumKernel<double>> make_spatial_sum(double) const override {
    return cuda::make_spatial_sum<double>();
  }
  std::unique_ptr<LinearKernel<float>> make_linear(std::int64_t in, std::int64_t out,
                                                   float) const override {
    return cuda::make_linear<float>(in, out);
  }
  std::unique_ptr<LinearKernel<double>> make_linear(std::int64_t in, std::int64_t out,
                                                    double) const override {
    return cuda::make_linear<double>(in, out);
  }
};

}  // namespace

const Backend* cuda_backend() {
  if (device_allocator() == nullptr) return nullptr;
  static const CudaBackend backend;
  return &backend;
}

}  // namespace tessera
