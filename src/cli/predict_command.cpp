#include <unistd.h>

#include <boost/algorithm/string/classification.hpp>
#include <boost/algorithm/string/split.hpp>
#include <iostream>

#include "command.hpp"
#include "tessera/collectives.hpp"
#include "tessera/drivers/predict.hpp"
#include "tessera/error.hpp"
#include "tessera/placement.hpp"

namespace tessera::cli {
namespace {

// The options predict and evaluate share; `evaluating` leaves --output optional.
int predict_or_evaluate(const std::vector<std::string>& args, const Comm& world,
                        RuntimeOptions runtime, bool evaluating) {
  PredictOptions o;
  o.evaluate = evaluating;
  std::string grid, write = "labels", progress = "auto";
  po::options_description d(evaluating ? "Evaluate options" : "Predict options");
  d.add_options()("model", po::value(&o.model),
                  "model JSON file or built-in name; default: the one the checkpoint was trained "
                  "with")("checkpoint", po::value(&o.checkpoint),
                          "the weights: a checkpoint directory (its newest checkpoint that "
                          "verifies), a checkpoint file, or a parameter file (HDF5 /params)")(
      "input", po::value(&o.input),
      evaluating ? "labelled images (HDF5: /images [N,C,H,W], /labels [N,H,W] or [N])"
                 : "images (HDF5: /images [N,C,H,W] float32, float64 or uint8)")(
      "output", po::value(&o.output),
      evaluating ? "also write the predictions to this HDF5 file (see tessera predict)"
                 : "HDF5 file to write (to a temporary name first, renamed when complete)")(
      "write", po::value(&write)->default_value(write),
      "what to write, comma-separated: labels (argmax, uint8 or uint16), probabilities "
      "(softmax), logits")("probabilities-type",
                           po::value(&o.probabilities_type)->default_value(o.probabilities_type),
                           "float16, float32 or float64")(
      "compress", po::value(&o.compress)->default_value(0),
      "deflate level of the outputs, 1..9 (0: none)")("grid", po::value(&grid), kGridHelp)(
      "batch", po::value(&o.batch)->default_value(0, "one per data-parallel group"),
      "images per pass, split over the data-parallel groups")(
      "dtype", po::value(&o.dtype)->default_value(o.dtype), "float32 or float64")(
      "progress", po::value(&progress)->default_value(progress),
      "auto (one updating line on a terminal), line, or plain");
  if (evaluating)
    d.add_options()("json", po::value(&o.json), "also write the report to this JSON file");
  d.add(device_options());
  po::variables_map vm;
  const char* summary =
      evaluating
          ? "Runs a trained model in evaluation mode over labelled images and reports the loss,\n"
            "pixel accuracy, IoU per class and mean IoU, counted exactly over all ranks."
          : "Runs a trained model in evaluation mode (running batch-norm statistics, no dropout)\n"
            "over every image of --input, each rank reading and writing only its tile: the\n"
            "predictions are those of one device, with no seams.";
  if (!parse(evaluating ? "evaluate" : "predict", summary, d, args, vm, world, runtime)) return 0;
  const std::unique_ptr<Comm> timed = command_world(world, runtime);
  const GridShape fallback = default_grid(*timed);
  agree(*timed, [&] {
    o.grid = grid_or_default(grid, fallback);
    o.write.clear();
    boost::split(o.write, write, boost::is_any_of(","));
    TESSERA_CHECK(progress == "auto" || progress == "line" || progress == "plain",
                  "bad --progress '" + progress + "': expected auto, line or plain");
  });
  o.progress_line = progress == "line" || (progress == "auto" && isatty(STDOUT_FILENO));
  return run_predict(o, *timed, runtime, std::cout);
}

}  // namespace

int predict_command(const std::vector<std::string>& args, const Comm& world,
                    RuntimeOptions runtime) {
  return predict_or_evaluate(args, world, runtime, false);
}

int evaluate_command(const std::vector<std::string>& args, const Comm& world,
                     RuntimeOptions runtime) {
  return predict_or_evaluate(args, world, runtime, true);
}

}  // namespace tessera::cli
