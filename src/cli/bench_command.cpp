#include <iostream>

#include "command.hpp"
#include "tessera/collectives.hpp"
#include "tessera/drivers/bench.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/placement.hpp"

namespace tessera::cli {

int bench_command(const std::vector<std::string>& args, const Comm& world, RuntimeOptions runtime) {
  BenchOptions o;
  std::string grid, image = "3x2048x2048";
  std::int64_t batch = 1;
  po::options_description d("Bench options");
  d.add_options()("model", po::value(&o.model)->default_value(o.model),
                  model_option_help().c_str())("grid", po::value(&grid), kGridHelp)(
      "image", po::value(&image)->default_value(image),
      "image size CxHxW; C is the model's input channels")(
      "batch", po::value(&batch)->default_value(batch),
      "samples per step, split over the N groups")(
      "dtype", po::value(&o.dtype)->default_value(o.dtype), "float32 or float64")(
      "steps", po::value(&o.steps)->default_value(o.steps), "timed steps")(
      "warmup", po::value(&o.warmup)->default_value(o.warmup),
      "untimed steps first (planning, first-touch page faults); up to 4 more while a step "
      "still faults more than 16 MiB of pages in (the host pool settling)")(
      "lr", po::value(&o.lr)->default_value(o.lr), "SGD learning rate")(
      "seed", po::value(&o.seed)->default_value(o.seed), "seed of the random batch and parameters")(
      "sgemm", po::value(&o.sgemm)->default_value(o.sgemm),
      "also measure oneDNN's SGEMM rate per rank, the yardstick of the conv GFLOP/s")(
      "membw", po::value(&o.membw)->default_value(o.membw),
      "also measure the memory bandwidth (STREAM's triad) of one rank alone and of every rank of "
      "a node at once: how far the memory-bound passes can speed up on more ranks (cpu)")(
      "json", po::value(&o.json), "also write the results to this JSON file")(
      "layer-sync", po::bool_switch(&o.layer_sync),
      "with cuda: wait for the GPU at the start and end of every layer's pass, so that the "
      "per-layer times are the GPU's (without it they are the host's: a layer's kernels are "
      "counted where the host next waits for the GPU); the step is then slower");
  d.add(device_options());
  po::variables_map vm;
  if (!parse("bench",
             "Times training steps (forward, loss, backward, gradient reduction, SGD update) of a "
             "model on\nrandom data, per layer (the maximum over ranks) and per rank: compute, "
             "window assembly,\nhalo work, waiting for halos, exposed reductions; the "
             "convolutions' GFLOP/s against the\nSGEMM rate. Default: conv-bench on one "
             "3x2048x2048 image (scripts/bench/compare_pytorch.py\ntimes PyTorch beside it). "
             "TESSERA_OVERLAP=0 turns off the interior/border overlap;\nTESSERA_FUSE=0 computes "
             "activations apart from their neighbouring layers;\nTESSERA_WINDOWLESS=0 assembles "
             "every convolution's input window;\nTESSERA_WINOGRAD=0 computes "
             "every convolution with the direct kernel;\nTESSERA_NARROW_CONV=0 computes "
             "convolutions of few channels with oneDNN's kernels;\nTESSERA_NARROW_BF16=0 "
             "computes them in float32 under --precision bf16 (AVX512_BF16, no AMX);\n"
             "TESSERA_AMX=0 leaves bf16 convolutions to oneDNN on CPUs with AMX.",
             d, args, vm, world, runtime))
    return 0;
  const std::unique_ptr<Comm> timed = command_world(world, runtime);
  const GridShape fallback = default_grid(*timed);
  agree(*timed, [&] {
    o.grid = grid_or_default(grid, fallback);
    o.image = parse_image(image);
    o.image.n = batch;
    TESSERA_CHECK(batch >= 1, "--batch must be at least 1, got " + std::to_string(batch));
  });
  return run_bench(o, *timed, runtime, std::cout);
}

}  // namespace tessera::cli
