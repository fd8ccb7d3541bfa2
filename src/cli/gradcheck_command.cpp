#include <iostream>

#include "command.hpp"
#include "tessera/collectives.hpp"
#include "tessera/drivers/gradcheck.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/placement.hpp"

namespace tessera::cli {

int gradcheck_command(const std::vector<std::string>& args, const Comm& world,
                      RuntimeOptions runtime) {
  GradcheckOptions o;
  std::string grid;
  po::options_description d("Gradcheck options");
  d.add_options()("model", po::value(&o.model)->default_value(o.model),
                  model_option_help().c_str())("grid", po::value(&grid), kGridHelp)(
      "dtype", po::value(&o.dtype)->default_value(o.dtype), "float32 or float64")(
      "mode", po::value(&o.mode)->default_value(o.mode),
      "train (batch statistics, dropout) or eval (running statistics, no dropout)")(
      "init", po::value(&o.init),
      "initial parameters (HDF5, /params/<layer>/<param>); default: "
      "seeded random")("input", po::value(&o.input),
                       "batch (HDF5, /images [N,C,H,W] and /labels [N,H,W]); "
                       "default: a seeded random batch")(
      "dump", po::value(&o.dump), "write sharded and single-rank results to this HDF5 file")(
      "rtol", po::value(&o.rtol)->default_value(0),
      "relative tolerance; 0 means 1e-10 for float64, 1e-4 for float32, 1e-2 with --precision "
      "bf16")("batch", po::value(&o.batch)->default_value(o.batch), "random batch: samples")(
      "channels", po::value(&o.channels)->default_value(0),
      "random batch: channels (0: the model's input channels)")(
      "height", po::value(&o.height)->default_value(o.height), "random batch: image height")(
      "width", po::value(&o.width)->default_value(o.width), "random batch: image width")(
      "seed", po::value(&o.seed)->default_value(o.seed), "seed of the random batch and parameters");
  d.add(device_options());
  po::variables_map vm;
  if (!parse(
          "gradcheck",
          "Runs one forward and backward pass of the model sharded over the grid and on a single "
          "rank,\nand compares the loss, the output, the input gradient and every parameter "
          "gradient.\nExits 1 when a relative error exceeds the tolerance.",
          d, args, vm, world, runtime))
    return 0;
  const std::unique_ptr<Comm> timed = command_world(world, runtime);
  const GridShape fallback = default_grid(*timed);
  agree(*timed, [&] { o.grid = grid_or_default(grid, fallback); });
  return run_gradcheck(o, *timed, runtime, std::cout);
}

}  // namespace tessera::cli
