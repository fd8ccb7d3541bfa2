#include "tessera/kernels/backend.hpp"
#include "tessera/wait.hpp"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <type_traits>

#include "tessera/error.hpp"
#include "tessera_config.h"

#if TESSERA_HAVE_ONEDNN
#include "tessera/kernels/onednn_conv.hpp"
#include "tessera/kernels/onednn_pool.hpp"
#endif

namespace tessera {
namespace {

constexpr bool kHaveOneDnn = TESSERA_HAVE_ONEDNN;

// A positive integer from the environment, else 0. OMP_NUM_THREADS may be a list ("4,2"): its
// first entry is the outer level's count.
int env_count(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr) return 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return end != text && v > 0 && v < (1 << 20) ? static_cast<int>(v) : 0;
}

KernelThreads detect_threads() {
  if (const int omp = env_count("OMP_NUM_THREADS"); omp > 0)
    return {omp, "OMP_NUM_THREADS=" + std::to_string(omp)};
  // Launchers say how many ranks they started on this node; asking MPI would be a collective,
  // and kernels are planned where not every rank takes part (single-rank reference runs).
  int ranks = 0;
  for (const char* name : {"MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    if (ranks == 0) ranks = env_count(name);
  const bool known = ranks > 0;
  ranks = std::max(ranks, 1);
  const int cores = available_cores();
  auto count = [](int n, const char* what) {
    return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
  };
  return {std::max(1, cores / ranks),
          count(cores, "core") + " / " + count(ranks, "rank") +
              (known ? " on this node" : " (the launcher did not say how many share the node)")};
}

}  // namespace

const char* to_string(KernelBackend b) {
  return b == KernelBackend::onednn ? "onednn" : "reference";
}

KernelBackend parse_kernel_backend(const std::string& text) {
  if (text == "reference") return KernelBackend::reference;
  if (text == "onednn") {
    TESSERA_CHECK(kHaveOneDnn,
                  "kernel backend 'onednn' asked for, but this build has no oneDNN "
                  "(libdnnl): use 'reference' or rebuild with -Donednn=enabled");
    return KernelBackend::onednn;
  }
  throw Error("bad kernel backend '" + text + "': expected reference or onednn");
}

KernelBackend kernel_backend() {
  static const KernelBackend backend = [] {
    if (const char* env = std::getenv("TESSERA_KERNELS"); env != nullptr && *env != '\0') {
      try {
        return parse_kernel_backend(env);
      } catch (const Error& e) {
        throw Error(std::string("TESSERA_KERNELS: ") + e.what());
      }
    }
    return kHaveOneDnn ? KernelBackend::onednn : KernelBackend::reference;
  }();
  return backend;
}

const KernelThreads& kernel_threads() {
  static const KernelThreads threads = detect_threads();
  return threads;
}

std::string kernel_backend_description() {
  const std::string reference = "reference (plain loops, float32 and float64)";
  if (kernel_backend() == KernelBackend::reference)
    return reference + (kHaveOneDnn ? "; onednn is built but off (TESSERA_KERNELS=reference)" : "");
#if TESSERA_HAVE_ONEDNN
  return "onednn for float32 convolutions, transposed convolutions and pooling (" +
         onednn_description() +
         "); threaded loops for batch norm and activations; reference (plain loops) for the rest";
#else
  return reference;
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

template <typename T>
std::unique_ptr<ConvKernel<T>> make_conv_kernel(const ConvShapes& shapes,
                                                const reference::ConvGeometry& g) {
#if TESSERA_HAVE_ONEDNN
  // oneDNN's CPU convolutions have no float64.
  if constexpr (std::is_same_v<T, float>)
    if (kernel_backend() == KernelBackend::onednn)
      if (std::unique_ptr<OneDnnConv> fast = OneDnnConv::create(shapes, g)) return fast;
#endif
  if (shapes.x_layout != Layout::nchw || shapes.y_layout != Layout::nchw) return nullptr;
  return std::make_unique<ReferenceConv<T>>(g, shapes);
}

template std::unique_ptr<ConvKernel<float>> make_conv_kernel(const ConvShapes&,
                                                             const reference::ConvGeometry&);
template std::unique_ptr<ConvKernel<double>> make_conv_kernel(const ConvShapes&,
                                                              const reference::ConvGeometry&);

template <typename T>
std::unique_ptr<PoolKernel<T>> make_pool_kernel(PoolKind kind, const PoolShapes& shapes,
                                                const reference::PoolGeometry& g) {
#if TESSERA_HAVE_ONEDNN
  if constexpr (std::is_same_v<T, float>)
    if (kernel_backend() == KernelBackend::onednn)
      if (std::unique_ptr<OneDnnPool> fast = OneDnnPool::create(kind, shapes, g)) return fast;
#endif
  if (shapes.layout != Layout::nchw) return nullptr;
  return std::make_unique<ReferencePool<T>>(kind, g);
}

template std::unique_ptr<PoolKernel<float>> make_pool_kernel(PoolKind, const PoolShapes&,
                                                             const reference::PoolGeometry&);
template std::unique_ptr<PoolKernel<double>> make_pool_kernel(PoolKind, const PoolShapes&,
                                                              const reference::PoolGeometry&);

}  // namespace tessera
