// Which kernels run: the process-wide backend and the factories that honour it. The one place that
// chooses between the reference kernels and the fast ones (STYLE.md 5); layers ask a factory and
// never name a backend.
#pragma once

#include <memory>
#include <string>

#include "tessera/kernels/conv_kernel.hpp"
#include "tessera/kernels/pool_kernel.hpp"

namespace tessera {

enum class KernelBackend { reference, onednn };

const char* to_string(KernelBackend b);
// "reference" | "onednn"; throws an Error otherwise, or for onednn in a build without it. Local.
KernelBackend parse_kernel_backend(const std::string& text);

// The process-wide backend: onednn when this build has it, else reference; the environment
// variable TESSERA_KERNELS=reference|onednn overrides. Read once, on first use (a bad value
// throws an Error then, on every rank alike). Local.
KernelBackend kernel_backend();

// Threads each rank's fast kernels use: the cores this process may run on (its affinity mask)
// divided by the ranks of the job on this node, at least 1. The ranks per node come from the
// launcher's environment (MPI_LOCALNRANKS from MPICH's Hydra, OMPI_COMM_WORLD_LOCAL_SIZE from
// Open MPI, else 1); OMP_NUM_THREADS, when set, wins. Computed once. Local.
struct KernelThreads {
  int count = 1;
  std::string reason;  // "8 cores / 4 ranks on this node", "OMP_NUM_THREADS=4"
};
const KernelThreads& kernel_threads();

// One line for `tessera --version`: the backend, its library and threads. Local.
std::string kernel_backend_description();

// The float32 matrix-multiply rate of the fast backend's GEMM (oneDNN's dnnl_sgemm) on this
// rank with kernel_threads(), in GFLOP/s: the best of `repeats` products of two n x n matrices.
// The yardstick the convolutions are measured against. Returns 0 in a build without oneDNN.
// Local.
double sgemm_gflops(std::int64_t n = 2048, int repeats = 5);

// A conv kernel planned for `shapes` and `g`: the fast one of the active backend when it accepts
// the case (float32 only: oneDNN has no float64 on CPU), else the reference. Never null for an
// NCHW x and y; with nchw16c (which only fast kernels take) null when no fast kernel accepts it.
// Local.
template <typename T>
std::unique_ptr<ConvKernel<T>> make_conv_kernel(const ConvShapes& shapes,
                                                const reference::ConvGeometry& g);

// A pooling kernel planned for `shapes` and `g` (no geometry padding: a window with its image box):
// oneDNN's for float32 when the active backend is onednn and it accepts the case, else the
// reference. Never null for NCHW; with nchw16c null when no fast kernel accepts it. Local.
template <typename T>
std::unique_ptr<PoolKernel<T>> make_pool_kernel(PoolKind kind, const PoolShapes& shapes,
                                                const reference::PoolGeometry& g);

}  // namespace tessera
