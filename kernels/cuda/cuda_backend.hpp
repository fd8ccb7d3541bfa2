// The CUDA backend's kernels, private to kernels/cuda: factories the CudaBackend
// (kernels/cuda/cuda_backend.cpp) hands out. Every kernel enqueues on the process's stream
// (cuda_context.hpp) and reads and writes device tensors only (NCHW). Local.
#pragma once

#include <memory>
#include <string>

#include "tessera/gpu.hpp"
#include "tessera/kernels/batchnorm_kernel.hpp"
#include "tessera/kernels/conv_kernel.hpp"
#include "tessera/kernels/halo_copy.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/pool_kernel.hpp"

namespace tessera::cuda {

// A cuDNN convolution planned for `shapes` and `g`: algorithms for the three passes chosen once
// here, measured on the GPU (cudnnFind*, once per distinct convolution in the process) or by
// cuDNN's heuristics (TESSERA_CUDNN_SEARCH=heuristic); deterministic ones only with
// options.deterministic, no TF32 unless options.allow_tf32; their workspace from the context's
// shared one. Null for what it declines:
// nchw16c tensors, a geometry cuDNN rejects, no algorithm fitting the workspace limit; `why`
// then says which.
template <typename T>
std::unique_ptr<ConvKernel<T>> make_cudnn_conv(const ConvShapes& shapes,
                                               const reference::ConvGeometry& g,
                                               const CudaOptions& options, std::string& why);

template <typename T>
std::unique_ptr<ActivationKernel<T>> make_activation(ActivationKind kind, double slope);
template <typename T>
std::unique_ptr<DropoutKernel<T>> make_dropout(double p);
template <typename T>
std::unique_ptr<UpdateKernel<T>> make_update();
template <typename T>
std::unique_ptr<MergeKernel<T>> make_merge();
template <typename T>
std::unique_ptr<HaloCopyKernel<T>> make_halo_copy();
template <typename T>
std::unique_ptr<LossKernel<T>> make_loss();
// Pooling (null for nchw16c), upsampling, the head's sums and linear layers, batch norm
// (kernels/cuda/cuda_layer_kernels.cpp).
template <typename T>
std::unique_ptr<PoolKernel<T>> make_pool(PoolKind kind, const PoolShapes& shapes,
                                         const reference::PoolGeometry& g);
template <typename T>
std::unique_ptr<UpsampleKernel<T>> make_upsample(const reference::UpsampleGeometry& g);
template <typename T>
std::unique_ptr<SpatialSumKernel<T>> make_spatial_sum();
template <typename T>
std::unique_ptr<LinearKernel<T>> make_linear(std::int64_t in, std::int64_t out);
template <typename T>
std::unique_ptr<BatchNormKernel<T>> make_batch_norm();

// The bytes of freed device blocks the allocator keeps for reuse by size
// (kernels/cuda/device_allocator.cpp): memory the pool counts used that this process may take.
// Local.
std::size_t kept_device_bytes();

}  // namespace tessera::cuda
