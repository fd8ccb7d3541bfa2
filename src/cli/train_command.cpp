#include <unistd.h>

#include <iostream>

#include "command.hpp"
#include "tessera/collectives.hpp"
#include "tessera/drivers/train.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/placement.hpp"

namespace tessera::cli {

int train_command(const std::vector<std::string>& args, const Comm& world, RuntimeOptions runtime) {
  TrainOptions o;
  std::string grid, optimizer = "adam", schedule = "constant", progress = "auto";
  o.optimizer.kind = OptimizerKind::adam;
  po::options_description d("Training options");
  d.add_options()("model", po::value(&o.model)->default_value(o.model),
                  model_option_help().c_str())(
      "data", po::value(&o.data),
      "training set (HDF5: /images [N,C,H,W], /labels [N,H,W] or [N]); default: the built-in "
      "synthetic set of shapes and their masks")("val-data", po::value(&o.val_data),
                                                 "validation set (HDF5, same layout)")(
      "val-fraction", po::value(&o.val_fraction)->default_value(0),
      "or validate on this last fraction of --data")("grid", po::value(&grid), kGridHelp)(
      "epochs", po::value(&o.epochs)->default_value(o.epochs), "epochs to train")(
      "steps", po::value(&o.steps)->default_value(0),
      "steps to train; overrides --epochs (0: --epochs decides)")(
      "batch", po::value(&o.batch)->default_value(o.batch),
      "global batch, split over the data-parallel groups")(
      "optimizer", po::value(&optimizer)->default_value(optimizer), "sgd or adam")(
      "lr", po::value(&o.lr)->default_value(o.lr), "learning rate")(
      "momentum", po::value(&o.optimizer.momentum)->default_value(o.optimizer.momentum, "0.9"),
      "sgd momentum")("weight-decay", po::value(&o.optimizer.weight_decay)->default_value(0),
                      "L2 weight decay")(
      "lr-schedule", po::value(&schedule)->default_value(schedule), "constant, cosine or step")(
      "lr-step-size", po::value(&o.schedule.step_size)->default_value(o.schedule.step_size),
      "step schedule: steps between decays")(
      "lr-gamma", po::value(&o.schedule.gamma)->default_value(o.schedule.gamma, "0.1"),
      "step schedule: decay factor")("dtype", po::value(&o.dtype)->default_value(o.dtype),
                                     "float32 or float64")(
      "seed", po::value(&o.seed)->default_value(o.seed),
      "seed of the parameters, the data order, dropout and the built-in data")(
      "init", po::value(&o.init),
      "initial parameters and batch-norm buffers: a parameter file (HDF5 /params, /buffers; "
      "scripts/import_pytorch.py writes one from a PyTorch state_dict); default: seeded random")(
      "checkpoint-dir", po::value(&o.checkpoint_dir), "write checkpoints here")(
      "checkpoint-every", po::value(&o.checkpoint_every)->default_value(0),
      "steps between checkpoints (0: only at the end)")(
      "keep-checkpoints", po::value(&o.keep_checkpoints)->default_value(3),
      "keep this many newest checkpoints, removing older ones (0: keep all)")(
      "resume", po::bool_switch(&o.resume),
      "continue from the newest checkpoint in --checkpoint-dir that verifies (start afresh if "
      "there is none)")(
      "allow-changes", po::bool_switch(&o.allow_changes),
      "with --resume: go on although options that change what the run computes (--lr, image "
      "size, --steps...) differ from the checkpoint's")(
      "verify-data", po::bool_switch(&o.verify_data),
      "before training, read every sample of --data and --val-data whole: pixels finite, "
      "labels within the model's classes, and per-sample checksums where the file has them")(
      "metrics", po::value(&o.metrics),
      "write metrics per log interval and epoch (.csv, or JSON lines for .jsonl / .json)")(
      "log-every", po::value(&o.log_every)->default_value(o.log_every), "steps between log lines")(
      "progress", po::value(&progress)->default_value(progress),
      "auto (one updating line on a terminal), line, or plain")(
      "samples", po::value(&o.samples)->default_value(o.samples), "built-in data: samples")(
      "val-samples", po::value(&o.val_samples)->default_value(o.val_samples),
      "built-in data: validation samples (0: no validation)")(
      "height", po::value(&o.height)->default_value(o.height), "built-in data: image height")(
      "width", po::value(&o.width)->default_value(o.width), "built-in data: image width");
  d.add(device_options());
  po::variables_map vm;
  if (!parse("train",
             "Trains a model with its images tiled over the grid. Every option can also be set in "
             "an INI file\ngiven with --config (key = value; the command line wins).",
             d, args, vm, world, runtime))
    return 0;
  const std::unique_ptr<Comm> timed = command_world(world, runtime);
  const GridShape fallback = default_grid(*timed);
  agree(*timed, [&] {
    o.grid = grid_or_default(grid, fallback);
    o.optimizer.kind = parse_optimizer(optimizer);
    o.schedule.kind = parse_schedule(schedule);
    TESSERA_CHECK(progress == "auto" || progress == "line" || progress == "plain",
                  "bad --progress '" + progress + "': expected auto, line or plain");
  });
  o.progress_line = progress == "line" || (progress == "auto" && isatty(STDOUT_FILENO));
  return run_train(o, *timed, runtime, std::cout);
}

}  // namespace tessera::cli
