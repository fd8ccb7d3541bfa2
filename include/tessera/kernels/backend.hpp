// Which kernels run: a Backend hands out planned kernel objects, one factory per operation, and
// declines what it does not do well (oneDNN's own pattern). The reference
// backend implements every factory; the oneDNN backend overrides the float32 convolutions and
// pooling and falls back to the reference for the rest. Layers get their backend from the Runtime
// at bind() and never name one. One process may use both (tests do).
#pragma once

#include <memory>
#include <string>
#include <type_traits>

#include "tessera/kernels/batchnorm_kernel.hpp"
#include "tessera/kernels/conv_kernel.hpp"
#include "tessera/kernels/halo_copy.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/patch_deconv.hpp"
#include "tessera/kernels/pool_kernel.hpp"

namespace tessera {

// emulated: the reference kernels computing in emulated device memory (allocator.hpp), which
// the host cannot reach outside a kernel: the device path (parameters, halo staging, gradient
// buckets, I/O through copies) checked on a machine without a GPU. For tests; slow.
enum class KernelBackend { reference, onednn, cuda, emulated };

const char* to_string(KernelBackend b);
// "reference" | "onednn" | "emulated" | "cuda" (every rank on the current GPU: the tests' way;
// `--device cuda` places each rank on its own); throws an Error otherwise, or for onednn in a
// build without it. Local.
KernelBackend parse_kernel_backend(const std::string& text);
// onednn when this build has it, else reference. Local.
KernelBackend default_kernel_backend();

// Threads each rank's kernels use (fast kernels and the threaded loops of parallel.hpp). One
// OpenMP thread pool serves the whole process, so this is the one process-wide setting: main (and
// each test main) sets it once from the runtime options (runtime.hpp). Default 1. Local.
struct KernelThreads {
  int count = 1;
  std::string reason;  // "8 cores / 4 ranks on this node", "OMP_NUM_THREADS=4"
};
void set_kernel_threads(const KernelThreads& threads);
const KernelThreads& kernel_threads();

// Cores this process may run on (its affinity mask; srun --cpu-bind narrows it). Local.
int available_cores();

class Backend {
 public:
  virtual ~Backend() = default;

  virtual KernelBackend kind() const { return KernelBackend::reference; }
  // One line for `tessera --version` and `tessera bench`: what runs where. Local.
  virtual std::string description() const;

  // A conv kernel planned for `shapes` and `g`: the backend's own when it accepts the case, else
  // the reference. Never null for an NCHW x and y without an activation; with nchw16c (which only
  // fast kernels take) or a fused activation, null when no kernel that takes it accepts the case.
  // Local.
  template <typename T>
  std::unique_ptr<ConvKernel<T>> conv(const ConvShapes& shapes,
                                      const reference::ConvGeometry& g) const {
    std::unique_ptr<ConvKernel<T>> k;
    if constexpr (std::is_same_v<T, float>)
      k = conv_float(shapes, g);
    else
      k = conv_double(shapes, g);
    if (k && shapes.activation && !k->applies_activation()) return nullptr;
    return k;
  }
  // Whether conv() computes the case (its layouts aside) with a kernel that reads and writes
  // NCHW only, declining channel-blocked layouts for it (the oneDNN backend's narrow kernels,
  // kernels/narrow_conv.hpp): the model then gives the conv NCHW inputs and lets it give NCHW
  // output, rather than converting. Local.
  template <typename T>
  bool conv_in_nchw(const ConvShapes& shapes, const reference::ConvGeometry& g) const {
    return std::is_same_v<T, float> && float_conv_in_nchw(shapes, g);
  }
  // Whether the kernel conv() plans for the case computes from a concat's parts where they lie
  // (ConvKernel::reads_parts: the narrow kernels), or is the reference, which gathers them
  // (ConvKernel's defaults) and is there to check the path, not for speed: where a conv computes
  // windowless from a concat's inputs (Conv2d::windowless) instead of assembling them in its
  // window. Pure in the case, so the same on every rank. Local.
  template <typename T>
  bool conv_takes_parts(const ConvShapes& shapes, const reference::ConvGeometry& g) const {
    if constexpr (std::is_same_v<T, float>)
      return float_conv_takes_parts(shapes, g);
    else
      return double_conv_takes_parts(shapes, g);
  }
  // A pooling kernel planned for `shapes` and `g` (no geometry padding: a window with its image
  // box), as conv() decides. Never null for NCHW; with nchw16c null when no fast kernel accepts
  // it. Local.
  template <typename T>
  std::unique_ptr<PoolKernel<T>> pool(PoolKind kind, const PoolShapes& shapes,
                                      const reference::PoolGeometry& g) const {
    if constexpr (std::is_same_v<T, float>)
      return pool_float(kind, shapes, g);
    else
      return pool_double(kind, shapes, g);
  }
  // The batch-norm kernel of this backend (the layer reduces its sums over the grid). Never
  // null. Local.
  template <typename T>
  std::unique_ptr<BatchNormKernel<T>> batch_norm() const {
    if constexpr (std::is_same_v<T, float>)
      return batch_norm_float();
    else
      return batch_norm_double();
  }
  // An activation for one layer (it keeps what its backward needs). Never null. Local.
  template <typename T>
  std::unique_ptr<ActivationKernel<T>> activation(ActivationKind kind, double slope) const {
    return make_activation(kind, slope, T{});
  }
  // Nearest upsampling planned for a tile's geometry. Never null. Local.
  template <typename T>
  std::unique_ptr<UpsampleKernel<T>> upsample(const reference::UpsampleGeometry& g) const {
    return make_upsample(g, T{});
  }
  // Global average pooling's per-tile sums and spread. Never null. Local.
  template <typename T>
  std::unique_ptr<SpatialSumKernel<T>> spatial_sum() const {
    return make_spatial_sum(T{});
  }
  // Concat's channel copies and add's sums. Never null. Local.
  template <typename T>
  std::unique_ptr<MergeKernel<T>> merge() const {
    return make_merge(T{});
  }
  // The copies of one halo exchange (boxes in and out of tiles, windows and messages). Never
  // null. Local.
  template <typename T>
  std::unique_ptr<HaloCopyKernel<T>> halo_copy() const {
    return make_halo_copy(T{});
  }
  // Dropout with probability p for one layer. Never null. Local.
  template <typename T>
  std::unique_ptr<DropoutKernel<T>> dropout(double p) const {
    return make_dropout(p, T{});
  }
  // A 2x2 stride-2 transposed convolution's forward and filter gradient, each in one pass with
  // its bias (kernels/patch_deconv.hpp), where this backend has the kernel and it takes the case;
  // nullptr otherwise (ConvTranspose2d then runs its adjoint conv and separate bias passes).
  // float32 only. Local.
  virtual std::unique_ptr<PatchDeconvKernel> patch_deconv(
      const PatchDeconvShapes& /*shapes*/) const {
    return nullptr;
  }
  // The memory this backend's kernels compute in: where the layers allocate their tensors. Local.
  virtual Allocator& allocator() const { return host_allocator(); }
  // Returns when every kernel this process enqueued so far has finished: a no-op where kernels
  // run before they return (the CPU), a wait for the stream on a GPU. For timing only. Local.
  virtual void synchronize() const {}
  // The optimizers' per-element updates. Never null. Local.
  template <typename T>
  std::unique_ptr<UpdateKernel<T>> update() const {
    return make_update(T{});
  }
  // The softmax cross-entropy of the losses. Never null. Local.
  template <typename T>
  std::unique_ptr<LossKernel<T>> loss() const {
    return make_loss(T{});
  }
  // A linear layer of `in` inputs and `out` outputs. Never null. Local.
  template <typename T>
  std::unique_ptr<LinearKernel<T>> linear(std::int64_t in, std::int64_t out) const {
    return make_linear(in, out, T{});
  }

 protected:
  // The reference's factories; a fast backend overrides and calls these for what it declines.
  // The last argument picks the dtype.
  virtual std::unique_ptr<ActivationKernel<float>> make_activation(ActivationKind kind,
                                                                   double slope, float) const;
  virtual std::unique_ptr<ActivationKernel<double>> make_activation(ActivationKind kind,
                                                                    double slope, double) const;
  virtual std::unique_ptr<UpsampleKernel<float>> make_upsample(const reference::UpsampleGeometry& g,
                                                               float) const;
  virtual std::unique_ptr<UpsampleKernel<double>> make_upsample(
      const reference::UpsampleGeometry& g, double) const;
  virtual std::unique_ptr<SpatialSumKernel<float>> make_spatial_sum(float) const;
  virtual std::unique_ptr<SpatialSumKernel<double>> make_spatial_sum(double) const;
  virtual std::unique_ptr<MergeKernel<float>> make_merge(float) const;
  virtual std::unique_ptr<MergeKernel<double>> make_merge(double) const;
  virtual std::unique_ptr<HaloCopyKernel<float>> make_halo_copy(float) const;
  virtual std::unique_ptr<HaloCopyKernel<double>> make_halo_copy(double) const;
  virtual std::unique_ptr<DropoutKernel<float>> make_dropout(double p, float) const;
  virtual std::unique_ptr<DropoutKernel<double>> make_dropout(double p, double) const;
  virtual std::unique_ptr<UpdateKernel<float>> make_update(float) const;
  virtual std::unique_ptr<UpdateKernel<double>> make_update(double) const;
  virtual std::unique_ptr<LossKernel<float>> make_loss(float) const;
  virtual std::unique_ptr<LossKernel<double>> make_loss(double) const;
  virtual std::unique_ptr<LinearKernel<float>> make_linear(std::int64_t in, std::int64_t out,
                                                           float) const;
  virtual std::unique_ptr<LinearKernel<double>> make_linear(std::int64_t in, std::int64_t out,
                                                            double) const;
  virtual bool float_conv_in_nchw(const ConvShapes& /*shapes*/,
                                  const reference::ConvGeometry& /*g*/) const {
    return false;
  }
  // The reference kernels' (conv_float and conv_double here): true.
  virtual bool float_conv_takes_parts(const ConvShapes& /*shapes*/,
                                      const reference::ConvGeometry& /*g*/) const {
    return true;
  }
  virtual bool double_conv_takes_parts(const ConvShapes& /*shapes*/,
                                       const reference::ConvGeometry& /*g*/) const {
    return true;
  }
  virtual std::unique_ptr<ConvKernel<float>> conv_float(const ConvShapes& shapes,
                                                        const reference::ConvGeometry& g) const;
  virtual std::unique_ptr<ConvKernel<double>> conv_double(const ConvShapes& shapes,
                                                          const reference::ConvGeometry& g) const;
  virtual std::unique_ptr<PoolKernel<float>> pool_float(PoolKind kind, const PoolShapes& shapes,
                                                        const reference::PoolGeometry& g) const;
  virtual std::unique_ptr<PoolKernel<double>> pool_double(PoolKind kind, const PoolShapes& shapes,
                                                          const reference::PoolGeometry& g) const;
  // Tessera's threaded CPU loops (oneDNN's batch norm would take one tile's statistics).
  virtual std::unique_ptr<BatchNormKernel<float>> batch_norm_float() const;
  virtual std::unique_ptr<BatchNormKernel<double>> batch_norm_double() const;
};

// The CUDA backend (kernels/cuda/): cuDNN convolutions and CUDA kernels for every other layer
// (pooling, batch norm, activations, dropout, upsampling, merges and biases, the classification
// head), halo copies, the optimizer updates and the cross-entropy, on the current device's memory
// and in NCHW (it declines nchw16c). Null in a build without CUDA or without a usable device.
// Local.
const Backend* cuda_backend();

// KernelBackend::emulated's backend. Local.
const Backend& emulated_backend();

// The backend of `kind`, alive for the whole process (backends hold no state). Local; throws an
// Error for onednn in a build without it.
const Backend& backend_of(KernelBackend kind);

// The float32 matrix-multiply rate of the fast backend's GEMM (oneDNN's dnnl_sgemm) on this
// rank with kernel_threads(), in GFLOP/s: the best of `repeats` products of two n x n matrices.
// The yardstick the convolutions are measured against. Returns 0 in a build without oneDNN.
// Local.
double sgemm_gflops(std::int64_t n = 2048, int repeats = 5);

// The precision of the oneDNN backend's float32 convolutions (and of the transposed convolutions
// run as their adjoints): off, float32 throughout; on (--precision bf16), their inputs, weights and
// output gradients rounded to bfloat16 for the products, accumulated and written in float32, so
// activations, weights, gradients and every sum stay float32. Process-wide: make_runtime sets it
// from RuntimeOptions::bf16 before a model plans its kernels; kernels planned before keep theirs.
// Convolutions oneDNN declines run the float32 reference either way. Local.
void set_conv_bf16(bool on);
bool conv_bf16();
// Whether the oneDNN backend's float32 3x3 convolutions may use Winograd's F(4x4, 3x3) where it
// is faster than the direct kernel (README.md "Winograd convolutions"): on (the default) or off
// (TESSERA_WINOGRAD=0, every convolution direct). Process-wide like set_conv_bf16: make_runtime
// sets it from RuntimeOptions::winograd before a model plans its kernels. Local.
void set_conv_winograd(bool on);
bool conv_winograd();
// Whether this CPU runs oneDNN's bfloat16 convolutions with its own instructions (AVX512_BF16 or
// AMX): oneDNN's effective instruction set has them, and a small bfloat16 convolution planned here
// is not oneDNN's reference implementation. Where oneDNN would only emulate them (AVX-512 without
// AVX512_BF16, e.g. Skylake-SP) --precision bf16 would be slower than float32: false there, and
// in a build without oneDNN. Local.
bool bf16_supported();

}  // namespace tessera
