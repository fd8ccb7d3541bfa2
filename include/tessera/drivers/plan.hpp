// `tessera plan`: what a model on a grid will cost, computed without moving any data. Every
// function here is local and pure: it sets the layers up (shapes only) and intersects windows with
// tiles for every rank of the grid, so one process plans a grid of any size.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "tessera/checked.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/process_grid.hpp"
#include "tessera/runtime.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

// How the engine will run the model (RuntimeOptions' fields that change what a rank holds): the
// host memory walk follows the decisions these lead to. The defaults are tessera's.
struct PlanEngine {
  KernelBackend kernels = default_kernel_backend();
  bool fuse = true;         // TESSERA_FUSE
  bool windowless = true;   // TESSERA_WINDOWLESS
  bool narrow_conv = true;  // the narrow AVX-512 convolutions where they fit (narrow_conv.hpp)
  bool bf16 = false;        // --precision bf16
  // Tessera's AMX kernels take the bf16 convolutions they fit (kernels/amx_conv.hpp: this CPU
  // has AMX), converting nothing whole.
  bool amx = false;
};

// The engine RuntimeOptions `o` makes (for the narrow kernels: where this CPU has them). Local.
PlanEngine plan_engine(const RuntimeOptions& o);

struct PlanOptions {
  GridShape grid;
  Shape4 input;                   // the global batch, N x C x H x W
  std::string dtype = "float32";  // float32 | float64: the size of every byte count
  // --device cuda: the GPU's memory per rank estimated too; device_memory (bytes, 0: unknown) is
  // what one GPU holds, to say whether the grid fits and which grid would.
  bool device = false;
  std::int64_t device_memory = 0;
  std::string device_name = "";  // "NVIDIA H100 80GB HBM3", or "--device-memory"
  PlanEngine engine{};
};

// The smallest and largest value of a quantity over the ranks of the grid.
struct Spread {
  std::int64_t min = 0;
  std::int64_t max = 0;
};

struct LayerPlan {
  std::string name;
  std::string type;
  Shape4 output;                // global
  Spread tile_rows, tile_cols;  // of the output tile, over spatial ranks
  // Halo layers only (those with a window): how far each rank's input window reaches beyond the
  // input tile it owns, per side, counting only rows and columns inside the image (padding is
  // never exchanged). Negative when the rank owns rows its window does not need.
  bool halo = false;
  Spread top, bottom, left, right;
  // Bytes received + sent per rank in one step, the largest over ranks: the forward fill and the
  // backward accumulate move the same boxes in opposite directions.
  std::int64_t forward_bytes = 0;
  std::int64_t backward_bytes = 0;
  std::int64_t params = 0;  // elements of the layer's parameters
};

// What a rank holds besides its tensors: the binary, MPI, oneDNN's generated code, the heap's
// arenas (28-53 MiB measured on one rank, README "Planning a run").
inline constexpr std::int64_t kHostFixed = std::int64_t(64) << 20;

// The estimated peak memory of one rank, in bytes.
//
// On the host (the CPU kernels), a walk of the step as the engine runs it (src/drivers/
// plan_memory.hpp): forward in node order, each output freed after its last reader unless a layer
// keeps it, each layer keeping what its backward pass reads (its window, its input, a mask); the
// loss; backward in reverse, each layer's gradients allocated and its kept tensors freed; the
// largest live total, plus the halo buffers and kHostFixed.
//
// On a GPU (--device cuda), the sum of every tensor's size: the input tile, every layer's output
// tile and every halo layer's input window kept for the backward pass, which holds one layer's
// gradients at a time (dy, the window gradient, dx), and the parameters and their gradients.
struct MemoryEstimate {
  // The host walk's peaks: a training step; two forward passes (evaluation keeps each layer's
  // state of the last pass until it runs again); the loss gradient an evaluation adds.
  std::int64_t step = 0;
  std::int64_t evaluation = 0;
  std::int64_t loss_gradient = 0;
  std::string step_at, evaluation_at;  // the allocation that reached each peak
  std::int64_t halo = 0;               // halo buffers, kept from the first exchange on
  std::int64_t params = 0;             // values and gradients (in step and evaluation too)
  // The GPU sum.
  std::int64_t activations = 0;  // input and layer outputs
  std::int64_t windows = 0;
  std::int64_t gradients = 0;
  // On a GPU besides: the halo exchanges' device buffers (packed boxes, kept per layer) and what
  // the CUDA kernels keep for backward (a ReLU's byte per element, a max pool's 8-byte index per
  // output, a sigmoid's output). Not counted: the CUDA context and cuDNN's workspace
  // (kDeviceReserve).
  std::int64_t device_buffers = 0;
  // Sums saturate at kSizeMax (checked.hpp), as every size of a plan does.
  //
  // Training: the step, or, when it `evaluates` a validation set, the evaluation with its loss
  // where that holds more (tessera train between validations: each layer keeps what the last
  // evaluation left it until its next forward).
  std::int64_t training(bool evaluates) const {
    const std::int64_t peak =
        evaluates ? std::max(step, saturating_add(evaluation, loss_gradient)) : step;
    return saturating_add(saturating_add(peak, halo), kHostFixed);
  }
  // What tessera plan reports: training with validation.
  std::int64_t total() const { return training(true); }
  // Inference (tessera predict, eval mode, no backward pass).
  std::int64_t inference() const {
    return saturating_add(saturating_add(evaluation, halo), kHostFixed);
  }
  std::int64_t device_total() const {
    return saturating_add(
        saturating_add(saturating_add(activations, windows), saturating_add(gradients, params)),
        device_buffers);
  }
};

// What a GPU needs beyond device_total() in this estimate: the CUDA context and cuDNN's
// convolution workspace (kernels/cuda/cudnn_conv.cpp caps it at 2 GiB and a quarter of the free
// memory). grid_that_fits leaves it free.
inline constexpr std::int64_t kDeviceReserve = std::int64_t(1) << 30;

struct Plan {
  std::string model;
  PlanOptions options;
  std::int64_t dtype_bytes = 4;
  Spread samples;                 // samples per rank, over the data-parallel groups
  Spread input_rows, input_cols;  // of the input tile, over spatial ranks
  std::string split_units;        // split_units_text of the input distribution
  std::vector<LayerPlan> layers;
  // Over all layers, the largest over ranks of the halo bytes received + sent in one step.
  std::int64_t step_bytes = 0;
  std::int64_t params = 0;  // elements, all layers
  MemoryEstimate memory;    // the busiest rank
  GridCoords busiest;       // that rank's coordinates
  MemoryEstimate single;    // the same model and batch on one device
};

// Plans `spec` for `options`. Throws an Error naming the layer when the grid is impossible (a tile
// without rows or columns), the batch has fewer samples than the grid has groups, or the image's
// channels are not the model's.
Plan make_plan(const ModelSpec& spec, const PlanOptions& options);

// When make_plan refuses options.grid because of its spatial extent: the grid with the same n and
// the largest h' <= h, w' <= w (most ranks; then most rows) on which the model plans. Nothing when
// no spatial grid helps (the model does not fit the image even on one rank, or the batch is too
// small).
std::optional<GridShape> suggest_grid(const ModelSpec& spec, const PlanOptions& options);

// The grid with options.grid's n and the fewest spatial ranks (then the squarest) whose busiest
// rank's device_total() plus kDeviceReserve fits in `device_bytes`, searching up to 64 x 64;
// nothing when none does.
std::optional<GridShape> grid_that_fits(const ModelSpec& spec, const PlanOptions& options,
                                        std::int64_t device_bytes);

// The grid with options.grid's n and the fewest spatial ranks (then the squarest) whose plan's
// cost (bytes per rank, e.g. memory.inference()) fits in `host_bytes`, searching up to 64 x 64;
// nothing when none does.
std::optional<GridShape> host_grid_that_fits(const ModelSpec& spec, const PlanOptions& options,
                                             std::int64_t host_bytes,
                                             const std::function<std::int64_t(const Plan&)>& cost);

// Three significant digits, binary units: "512 B", "12.0 KiB", "1.31 GiB"; "more than 8 EiB" for
// a saturated size (kSizeMax). Local.
std::string human_bytes(std::int64_t bytes);

// The plan as a table of at most 100 columns.
void print_plan(const Plan& plan, std::ostream& out);

}  // namespace tessera
