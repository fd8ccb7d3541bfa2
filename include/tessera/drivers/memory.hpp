// The memory a run needs against the memory it has, checked before the run allocates or computes
// anything the size of its image: a run that cannot fit is refused with both numbers instead of
// ending in std::bad_alloc, the kernel's OOM killer, or hours of set-up work.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/comm.hpp"
#include "tessera/drivers/plan.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

// The host memory a rank may count on, in bytes, and where the number comes from ("MemAvailable
// 22.9 GiB shared by 2 ranks on this node"). 0 bytes: unknown (then only sizes past 64 bits are
// refused).
struct MemoryBudget {
  std::int64_t bytes = 0;
  std::string source;
};

// This machine's memory: MemAvailable of /proc/meminfo, or the limit of this process's memory
// cgroup (v2 memory.max, v1 memory.limit_in_bytes, the tightest up the hierarchy) when lower;
// the source says which ("MemAvailable"). Local.
MemoryBudget available_host_memory();
// available_host_memory() shared evenly by the ranks of this rank's node. Collective over the
// world group.
MemoryBudget host_memory_per_rank(const Comm& world);
// The budget a run on `kernels` is checked against: host_memory_per_rank, or none (0 bytes) when
// the kernels compute in GPU memory (tessera plan --device cuda estimates that). Collective over
// the world group.
MemoryBudget run_memory_budget(const Comm& world, KernelBackend kernels);

// A run, for the check: what tessera plan estimates, and what the run holds besides.
struct RunMemory {
  GridShape grid;
  Shape4 input;  // the global batch
  std::string dtype;
  int optimizer_states = 0;    // tensors of every parameter's size (Adam 2, SGD momentum 1)
  int confusion_matrices = 0;  // classes x classes counts (training's metrics)
  std::int64_t sample_order_bytes = 0;  // the index and permutation of the training samples
  bool single_reference = false;  // this rank also runs the whole batch alone (gradcheck's root)
  // Inference only (tessera predict): no gradients (MemoryEstimate::inference); a refusal then
  // names the smallest grid that would fit at the same memory per rank.
  bool inference = false;
  // Training that evaluates a validation set between steps (MemoryEstimate::training).
  bool evaluates = false;
  // Bytes a rank holds besides per output pixel of its tile and sample, and per output channel of
  // such a pixel (predict's outputs: the labels, the probabilities).
  std::int64_t output_bytes_per_pixel = 0;
  std::int64_t output_bytes_per_channel = 0;
  PlanEngine engine{};  // how the run computes (plan_engine of its runtime's options)
};

// Refuses a run that cannot fit: tessera plan's estimate for the busiest rank (shapes only;
// nothing allocated) plus `run`'s extras, against `budget`. Throws an Error "the run needs N per
// rank (...), M available (...)"; sizes past 64 bits read "more than 8 EiB" and are refused
// whatever the budget. Shapes the plan cannot split are left to the model, which names the
// layer. Returns the estimate in bytes per rank, to be shown beside the peak the run measures; 0
// where there is none to show (a shape left to the model, kernels on a GPU: the host walk does
// not describe them). Local.
std::int64_t check_run_memory(const ModelSpec& spec, const RunMemory& run,
                              const MemoryBudget& budget);
// " (tessera plan: 595 MiB)": the estimate check_run_memory returned, to follow the peak a run
// measured; empty for 0. Local.
std::string estimate_note(std::int64_t estimate);
// Refuses `bytes` per rank (made of `what`) beyond `budget`, or past 64 bits, with the same
// message, then `advice`. Local.
void check_memory(std::int64_t bytes, const std::string& what, const MemoryBudget& budget,
                  const std::string& advice = "");

}  // namespace tessera
