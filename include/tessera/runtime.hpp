// What a run is made of, built once (in main, or in a test) and passed down: the
// communicators (Comm), the kernel backend, and the switches that change how, not what, Tessera
// computes. Layers receive it at bind(); nothing below it reads the environment or a global
// setting (the one exception is the kernel thread count: backend.hpp says why).
#pragma once

#include <memory>
#include <optional>

#include "tessera/allocator.hpp"
#include "tessera/comm.hpp"
#include "tessera/device_comm.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/simd.hpp"

namespace tessera {

struct RuntimeOptions {
  KernelBackend kernels = default_kernel_backend();
  // Convolutions compute their tile while halos travel, then the border strips (README
  // "Overlap"); off only to measure what it hides. Windowless convolutions always overlap.
  bool overlap = true;
  // Activations computed by their neighbouring layers (README "Fused activations"); off only to
  // measure what it saves or to compare.
  bool fuse = true;
  // Stride-1 convolutions whose input and output tiles coincide compute the tile from the tile
  // itself with the kernel's zero padding, and only the border strips that read halos from small
  // strip buffers (README "Windowless convolutions"); off only to compare with the window path.
  bool windowless = true;
  // A batch norm whose batch lies wholly on one rank lets a kernel that can keep its statistics
  // where it computes (the CUDA kernel: BatchNormKernel::trains_alone), so that the host never
  // waits for them; off only to compare with the host's statistics.
  bool batchnorm_alone = true;
  std::optional<WaitPolicy> wait;  // none: detected from ranks and cores per node
  double timeout = 600;            // seconds any one wait may take (the watchdog)
  // How the host serves large blocks (allocator.hpp); process-wide, like the heap: main applies it.
  HostMemory host_memory = HostMemory::pool;
  KernelThreads threads;
  // How halos and gradient sums travel (device_comm.hpp): mpi stages device memory through the
  // host; nccl and emulated take device buffers.
  Transport transport = Transport::mpi;
  // How the CUDA backend picks cuDNN's algorithms (gpu.hpp's CudaOptions): measured or by
  // heuristics, and whether it prints its choices.
  bool cudnn_measure = true;
  bool cudnn_log = false;
  // --precision bf16: the oneDNN backend's convolutions compute with bfloat16 products (see
  // set_conv_bf16, kernels/backend.hpp); make_runtime applies it.
  bool bf16 = false;
  // Winograd convolutions where they are faster (set_conv_winograd, kernels/backend.hpp); off
  // only to compare with direct convolutions.
  bool winograd = true;
  // The narrow convolution kernels for few channels on AVX-512 (set_conv_narrow,
  // kernels/narrow_conv.hpp); by default wherever the CPU has AVX-512 (simd_available,
  // kernels/simd.hpp): they beat oneDNN's 8-channel kernels on every such CPU measured (Intel
  // Xeons, AMD Zen 4 and Zen 5; README "Narrow convolutions").
  bool narrow_conv = true;
  // The threaded CPU loops' instruction set (kernels/simd.hpp); none: the widest the CPU has.
  // make_runtime applies it. The levels give the same results: only to compare their speed.
  std::optional<SimdLevel> simd;
};

// The documented environment defaults, the one place Tessera reads the environment:
//   TESSERA_KERNELS=reference|onednn|emulated|cuda, TESSERA_OVERLAP=0|1, TESSERA_FUSE=0|1,
//   TESSERA_WINDOWLESS=0|1, TESSERA_WINOGRAD=0|1, TESSERA_NARROW_CONV=0|1,
//   TESSERA_SIMD=baseline|avx512, TESSERA_WAIT=spin|sleep, TESSERA_TIMEOUT=seconds,
//   TESSERA_HOST_MEMORY=pool|system, TESSERA_TRANSPORT=mpi|nccl|emulated,
//   TESSERA_CUDNN_SEARCH=measure|heuristic, TESSERA_CUDNN_LOG=0|1;
//   the kernel threads from OMP_NUM_THREADS, else the cores of this process's affinity mask divided
//   by the ranks the launcher started on this node (MPI_LOCALNRANKS from MPICH's Hydra,
//   OMPI_COMM_WORLD_LOCAL_SIZE from Open MPI).
// Command-line options override them. Local; a bad value throws an Error naming the variable.
RuntimeOptions runtime_options_from_environment();

class Runtime {
 public:
  // Local: takes over `comm` (built collectively by the caller).
  Runtime(std::unique_ptr<Comm> comm, const RuntimeOptions& options);

  Comm& comm() const { return *comm_; }
  const Backend& backend() const { return *backend_; }
  // The memory the backend computes in (host for the CPU backends; the host allocator's policy
  // is process-wide, set by main from options().host_memory). Local.
  Allocator& allocator() const { return backend_->allocator(); }
  bool overlap() const { return options_.overlap; }
  bool fuse() const { return options_.fuse; }
  bool windowless() const { return options_.windowless; }
  const RuntimeOptions& options() const { return options_; }

  // The same options on a 1x1x1 grid of this rank alone (single-rank reference runs). Local.
  Runtime single() const;

 private:
  std::unique_ptr<Comm> comm_;
  const Backend* backend_;
  RuntimeOptions options_;
};

// A runtime on the grid `grid` over the ranks of `world`, waiting as options.wait says (else as
// `world` does), its messages moved by options.transport. Collective over the world group; throws
// an agreed Error when the grid does not fit the job or the transport cannot run here.
Runtime make_runtime(const Comm& world, GridShape grid, const RuntimeOptions& options);

}  // namespace tessera
