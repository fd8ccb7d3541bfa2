#include <algorithm>
#include <cmath>
#include <iostream>
#include <optional>

#include "command.hpp"
#include "tessera/checked.hpp"
#include "tessera/collectives.hpp"
#include "tessera/drivers/driver.hpp"
#include "tessera/drivers/memory.hpp"
#include "tessera/drivers/plan.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"

namespace tessera::cli {

int plan_command(const std::vector<std::string>& args, const Comm& world, RuntimeOptions runtime) {
  std::string model = "convstack-small", grid, image, dtype = "float32", precision = "float32";
  std::int64_t batch = 1;
  std::string device = "cpu";
  double device_gib = 0, host_gib = 0;
  po::options_description d("Plan options");
  d.add_options()("model", po::value(&model)->default_value(model), model_option_help().c_str())(
      "grid", po::value(&grid),
      "process grid NxHxW to plan for (required): N data-parallel groups of HxW spatial ranks")(
      "image", po::value(&image), "image size CxHxW (required); C is the model's input channels")(
      "batch", po::value(&batch)->default_value(batch),
      "samples per step, split over the N groups (at least N)")(
      "dtype", po::value(&dtype)->default_value(dtype), "float32 or float64: sizes in bytes")(
      "precision", po::value(&precision)->default_value(precision),
      "float32, or bf16: the host memory of a run with --precision bf16 (its bfloat16 copies)")(
      "device", po::value(&device)->default_value(device),
      "cpu, or cuda: also estimate each rank's GPU memory, say whether it fits and, if not, "
      "which grid would")(
      "device-memory", po::value(&device_gib),
      "with --device cuda: GiB of memory per GPU (default: this machine's first GPU)")(
      "host-memory", po::value(&host_gib),
      "GiB of host memory per rank: an estimate above it is an error (default: this machine's "
      "available memory, as for one rank per node)");
  po::variables_map vm;
  if (!parse("plan",
             "Plans a model on a grid without moving any data: per layer, the tiles, the halo "
             "widths\nand the bytes each rank exchanges per step; the estimated peak memory per "
             "rank against\na single device. Runs as one process for a grid of any size (no "
             "mpiexec needed).\nAn impossible grid is refused with the reason and a grid that "
             "works.",
             d, args, vm, world, runtime))
    return 0;
  Plan plan;
  ModelSpec spec;
  agree(world, [&] {
    TESSERA_CHECK(!grid.empty(), "--grid NxHxW is required (see tessera plan --help)");
    TESSERA_CHECK(!image.empty(), "--image CxHxW is required (see tessera plan --help)");
    PlanOptions o{.grid = parse_grid(grid), .input = parse_image(image), .dtype = dtype};
    check_dtype(dtype);
    TESSERA_CHECK(batch >= o.grid.n,
                  "--batch " + std::to_string(batch) + " is smaller than the grid's " +
                      std::to_string(o.grid.n) +
                      " data-parallel groups: every group needs at least one sample");
    o.input.n = batch;
    o.engine = plan_engine(runtime);
    TESSERA_CHECK(precision == "float32" || precision == "bf16",
                  "bad --precision '" + precision + "': expected float32 or bf16");
    TESSERA_CHECK(precision == "float32" || (dtype == "float32" && device == "cpu"),
                  "--precision bf16 plans oneDNN's bfloat16 convolutions: with --dtype float32 "
                  "and --device cpu");
    o.engine.bf16 = precision == "bf16";
    TESSERA_CHECK(device == "cpu" || device == "cuda",
                  "bad --device '" + device + "': expected cpu or cuda");
    TESSERA_CHECK(!vm.count("device-memory") || (device == "cuda" && device_gib > 0),
                  "--device-memory takes a number of GiB > 0, with --device cuda");
    TESSERA_CHECK(!vm.count("host-memory") || (host_gib > 0 && std::isfinite(host_gib)),
                  "--host-memory takes a finite number of GiB > 0");
    if (device == "cuda") {
      o.device = true;
      if (device_gib > 0) {
        o.device_memory = static_cast<std::int64_t>(device_gib * 1024 * 1024 * 1024);
        o.device_name = "--device-memory";
      } else if (const GpuInfo gpu = gpu_info(); gpu.devices > 0) {
        o.device_memory = gpu.memory_bytes;
        o.device_name = gpu.name;
      }
    }
    spec = load_model(model);
    try {
      plan = make_plan(spec, o);
    } catch (const Error& e) {
      const std::optional<GridShape> better = suggest_grid(spec, o);
      if (!better || *better == o.grid) throw;
      throw Error(std::string(e.what()) + "; for the whole model, try --grid " + better->str());
    }
  });
  // The host memory the estimate must fit: --host-memory, or this machine's (one rank per node).
  MemoryBudget host = available_host_memory();
  if (vm.count("host-memory")) {
    host = {static_cast<std::int64_t>(std::min(host_gib * 1024 * 1024 * 1024, 9e18)),
            "--host-memory"};
  } else if (host.bytes > 0) {
    host.source += " on this machine";
  }
  const PlanOptions& o = plan.options;
  if (is_root(world)) {
    print_plan(plan, std::cout);
    if (o.device && o.device_memory > 0 &&
        saturating_add(plan.memory.device_total(), kDeviceReserve) > o.device_memory) {
      const std::optional<GridShape> fits = grid_that_fits(spec, o, o.device_memory);
      std::cout << (fits ? "  a grid that fits: --grid " + fits->str() + "\n"
                         : "  no grid up to 64x64 fits this batch: lower --batch\n");
    }
    if (!o.device && host.bytes > 0) {
      const bool fits = plan.memory.total() <= host.bytes;
      std::cout << "  host memory per rank: " << human_bytes(host.bytes) << " (" << host.source
                << "): " << (fits ? "fits" : "does NOT fit") << "\n";
      if (!fits) {
        const std::optional<GridShape> grid = host_grid_that_fits(
            spec, o, host.bytes, [](const Plan& p) { return p.memory.total(); });
        std::cout << (grid ? "  a grid that fits: --grid " + grid->str() + "\n"
                           : "  no grid up to 64x64 fits: a smaller image or --batch\n");
      }
    }
    std::cout << std::flush;
  }
  // A plan no machine (or not the given memory) can run is an error: sizes past 64 bits always;
  // on the host, an estimate above the memory per rank (on a GPU the lines above say whether it
  // fits).
  if (!vm.count("host-memory")) host.source += "; --host-memory GIB plans for other nodes";
  agree(world, [&] {
    check_memory(o.device ? plan.memory.device_total() : plan.memory.total(), "the estimate above",
                 o.device ? MemoryBudget{} : host,
                 "use more ranks, a smaller image or a smaller batch");
  });
  return 0;
}

}  // namespace tessera::cli
