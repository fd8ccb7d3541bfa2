#include "tessera/kernels/backend.hpp"

#include <sched.h>

#include <algorithm>
#include <thread>

#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera/kernels/amx_conv.hpp"
#include "tessera/kernels/narrow_conv.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera_config.h"

#if TESSERA_HAVE_ONEDNN
#include "tessera/kernels/onednn_conv.hpp"
#include "tessera/kernels/onednn_pool.hpp"
#endif

namespace tessera {
namespace {

constexpr bool kHaveOneDnn = TESSERA_HAVE_ONEDNN;

KernelThreads g_threads{1, "the default"};

#if TESSERA_HAVE_ONEDNN
// oneDNN for float32 convolutions and pooling; everything else, and every case oneDNN declines or
// would run with its own plain loops, the reference.
class OneDnnBackend final : public Backend {
 public:
  KernelBackend kind() const override { return KernelBackend::onednn; }
  std::string description() const override {
    const std::string bf16 =
        !conv_bf16() ? ""
        : amx::available()
            ? "; bfloat16 convolutions (--precision bf16): Tessera's AMX kernels between "
              "16-channel blocks at stride 1, else oneDNN's"
            : "; bfloat16 convolutions (--precision bf16) on oneDNN's kernels";
    return "onednn for float32 convolutions, transposed convolutions and pooling (" +
           onednn_description() + ")" + bf16 + "; " +
           (narrow_conv_available() ? "narrow AVX-512 kernels for convolutions of few channels; "
                                    : "") +
           "threaded loops for batch norm (" + to_string(simd_level()) +
           "), activations, the loss, upsampling by 2 and max pooling by windows that tile the "
           "image; reference (plain loops) for the rest";
  }

 protected:
  bool float_conv_in_nchw(const ConvShapes& shapes,
                          const reference::ConvGeometry& g) const override {
    return narrow_conv_fits(shapes, g);
  }
  // The narrow kernels read a concat's parts; oneDNN's would gather them (no cheaper than the
  // window they replace).
  bool float_conv_takes_parts(const ConvShapes& shapes,
                              const reference::ConvGeometry& g) const override {
    return narrow_conv_fits(shapes, g);
  }
  std::unique_ptr<ConvKernel<float>> conv_float(const ConvShapes& shapes,
                                                const reference::ConvGeometry& g) const override {
    // Few output channels at stride 1 on AVX-512: the narrow kernels, in NCHW; other layouts are
    // declined for them, so that the conv plans NCHW (Conv2d::bind_kernel tries it last).
    if (narrow_conv_fits(shapes, g)) return make_narrow_conv(shapes, g);
    if (auto gemm = make_onednn_blocked_pointwise(shapes, g)) return gemm;
    if (std::unique_ptr<OneDnnConv> fast = OneDnnConv::create(shapes, g)) return fast;
    return Backend::conv_float(shapes, g);
  }
  std::unique_ptr<PoolKernel<float>> pool_float(PoolKind kind, const PoolShapes& shapes,
                                                const reference::PoolGeometry& g) const override {
    // NCHW max pooling by windows that tile the image: oneDNN has plain loops for it on some CPUs
    // (AMD EPYC), and on others (Skylake-SP) JIT loops through a transposed scratch copy that are
    // 4-7x slower than the tiled kernel (4 x 256 x 256 by 2, one thread: 0.8 + 1.5 against 0.12 +
    // 0.19 ms forward + backward).
    if (auto tiled = TiledMaxPool<float>::create(kind, shapes, g)) return tiled;
    if (std::unique_ptr<OneDnnPool> fast = OneDnnPool::create(kind, shapes, g)) return fast;
    return Backend::pool_float(kind, shapes, g);
  }
  std::unique_ptr<UpsampleKernel<float>> make_upsample(const reference::UpsampleGeometry& g,
                                                       float) const override {
    return make_cpu_upsample<float>(g);
  }
  std::unique_ptr<LossKernel<float>> make_loss(float) const override {
    return make_cpu_loss<float>();
  }

 public:
  std::unique_ptr<PatchDeconvKernel> patch_deconv(const PatchDeconvShapes& shapes) const override {
    return make_patch_deconv(shapes);
  }
};
#endif

template <typename T>
std::unique_ptr<ConvKernel<T>> reference_conv(const ConvShapes& shapes,
                                              const reference::ConvGeometry& g) {
  if (shapes.x_layout != Layout::nchw || shapes.y_layout != Layout::nchw) return nullptr;
  return std::make_unique<ReferenceConv<T>>(g, shapes);
}

template <typename T>
std::unique_ptr<PoolKernel<T>> reference_pool(PoolKind kind, const PoolShapes& shapes,
                                              const reference::PoolGeometry& g) {
  if (shapes.layout != Layout::nchw) return nullptr;
  return std::make_unique<ReferencePool<T>>(kind, g);
}

}  // namespace

const char* to_string(KernelBackend b) {
  switch (b) {
    case KernelBackend::onednn:
      return "onednn";
    case KernelBackend::cuda:
      return "cuda";
    case KernelBackend::emulated:
      return "emulated";
    case KernelBackend::reference:
      break;
  }
  return "reference";
}

namespace {
CudaOptions g_cuda_options;
}  // namespace

void set_cuda_options(const CudaOptions& options) {
  g_cuda_options = options;
}

const CudaOptions& cuda_options() {
  return g_cuda_options;
}

KernelBackend parse_kernel_backend(const std::string& text) {
  if (text == "reference") return KernelBackend::reference;
  if (text == "emulated") return KernelBackend::emulated;
  if (text == "cuda") return KernelBackend::cuda;  // backend_of says when no GPU is usable
  if (text == "onednn") {
    TESSERA_CHECK(kHaveOneDnn,
                  "kernel backend 'onednn' asked for, but this build has no oneDNN "
                  "(libdnnl): use 'reference' or rebuild with -Donednn=enabled");
    return KernelBackend::onednn;
  }
  throw Error("bad kernel backend '" + text + "': expected reference, onednn, emulated or cuda");
}

KernelBackend default_kernel_backend() {
  return kHaveOneDnn ? KernelBackend::onednn : KernelBackend::reference;
}

void set_kernel_threads(const KernelThreads& threads) {
  g_threads = threads;
  g_threads.count = std::max(1, g_threads.count);
}

const KernelThreads& kernel_threads() {
  return g_threads;
}

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

std::string Backend::description() const {
  return std::string("reference (plain loops, float32 and float64)") +
         (kHaveOneDnn ? "; onednn is built but off (TESSERA_KERNELS=reference)" : "");
}

std::unique_ptr<ConvKernel<float>> Backend::conv_float(const ConvShapes& shapes,
                                                       const reference::ConvGeometry& g) const {
  return reference_conv<float>(shapes, g);
}
std::unique_ptr<ConvKernel<double>> Backend::conv_double(const ConvShapes& shapes,
                                                         const reference::ConvGeometry& g) const {
  return reference_conv<double>(shapes, g);
}
std::unique_ptr<PoolKernel<float>> Backend::pool_float(PoolKind kind, const PoolShapes& shapes,
                                                       const reference::PoolGeometry& g) const {
  return reference_pool<float>(kind, shapes, g);
}
std::unique_ptr<PoolKernel<double>> Backend::pool_double(PoolKind kind, const PoolShapes& shapes,
                                                         const reference::PoolGeometry& g) const {
  return reference_pool<double>(kind, shapes, g);
}

std::unique_ptr<BatchNormKernel<float>> Backend::batch_norm_float() const {
  return make_cpu_batch_norm<float>();
}
std::unique_ptr<BatchNormKernel<double>> Backend::batch_norm_double() const {
  return make_cpu_batch_norm<double>();
}

std::unique_ptr<ActivationKernel<float>> Backend::make_activation(ActivationKind kind, double slope,
                                                                  float) const {
  return make_cpu_activation<float>(kind, slope);
}
std::unique_ptr<ActivationKernel<double>> Backend::make_activation(ActivationKind kind,
                                                                   double slope, double) const {
  return make_cpu_activation<double>(kind, slope);
}
std::unique_ptr<UpsampleKernel<float>> Backend::make_upsample(const reference::UpsampleGeometry& g,
                                                              float) const {
  return make_reference_upsample<float>(g);
}
std::unique_ptr<UpsampleKernel<double>> Backend::make_upsample(const reference::UpsampleGeometry& g,
                                                               double) const {
  return make_reference_upsample<double>(g);
}
std::unique_ptr<SpatialSumKernel<float>> Backend::make_spatial_sum(float) const {
  return make_reference_spatial_sum<float>();
}
std::unique_ptr<SpatialSumKernel<double>> Backend::make_spatial_sum(double) const {
  return make_reference_spatial_sum<double>();
}
std::unique_ptr<MergeKernel<float>> Backend::make_merge(float) const {
  return make_cpu_merge<float>();
}
std::unique_ptr<MergeKernel<double>> Backend::make_merge(double) const {
  return make_cpu_merge<double>();
}
std::unique_ptr<HaloCopyKernel<float>> Backend::make_halo_copy(float) const {
  return make_cpu_halo_copy<float>();
}
std::unique_ptr<HaloCopyKernel<double>> Backend::make_halo_copy(double) const {
  return make_cpu_halo_copy<double>();
}
std::unique_ptr<DropoutKernel<float>> Backend::make_dropout(double p, float) const {
  return make_cpu_dropout<float>(p);
}
std::unique_ptr<DropoutKernel<double>> Backend::make_dropout(double p, double) const {
  return make_cpu_dropout<double>(p);
}
std::unique_ptr<UpdateKernel<float>> Backend::make_update(float) const {
  return make_reference_update<float>();
}
std::unique_ptr<UpdateKernel<double>> Backend::make_update(double) const {
  return make_reference_update<double>();
}
std::unique_ptr<LossKernel<float>> Backend::make_loss(float) const {
  return make_reference_loss<float>();
}
std::unique_ptr<LossKernel<double>> Backend::make_loss(double) const {
  return make_reference_loss<double>();
}
std::unique_ptr<LinearKernel<float>> Backend::make_linear(std::int64_t in, std::int64_t out,
                                                          float) const {
  return make_reference_linear<float>(in, out);
}
std::unique_ptr<LinearKernel<double>> Backend::make_linear(std::int64_t in, std::int64_t out,
                                                           double) const {
  return make_reference_linear<double>(in, out);
}

const Backend& backend_of(KernelBackend kind) {
  static const Backend reference;
  if (kind == KernelBackend::reference) return reference;
  if (kind == KernelBackend::emulated) return emulated_backend();
  if (kind == KernelBackend::cuda) {
    const Backend* cuda = cuda_backend();
    TESSERA_CHECK(cuda != nullptr, "kernel backend 'cuda' asked for, but " +
                                       std::string(gpu_info().built ? "no GPU is usable here (" +
                                                                          gpu_info().error + ")"
                                                                    : "this build has no CUDA"));
    return *cuda;
  }
#if TESSERA_HAVE_ONEDNN
  static const OneDnnBackend onednn;
  return onednn;
#else
  (void)parse_kernel_backend("onednn");  // throws the explanation
  return reference;
#endif
}

namespace {
bool g_conv_bf16 = false;
bool g_conv_winograd = true;
}  // namespace

void set_conv_bf16(bool on) {
  g_conv_bf16 = on;
}

bool conv_bf16() {
  return g_conv_bf16;
}

void set_conv_winograd(bool on) {
  g_conv_winograd = on;
}

bool conv_winograd() {
  return g_conv_winograd;
}

bool bf16_supported() {
#if TESSERA_HAVE_ONEDNN
  return onednn_bf16_native() && onednn_bf16_supported();
#else
  return false;
#endif
}

double sgemm_gflops(std::int64_t n, int repeats) {
#if TESSERA_HAVE_ONEDNN
  return onednn_sgemm_gflops(n, repeats);
#else
  (void)n;
  (void)repeats;
  return 0;
#endif
}

}  // namespace tessera
