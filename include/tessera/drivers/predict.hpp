// `tessera predict` and `tessera evaluate`: a trained model in evaluation mode (running batch-norm
// statistics, no dropout) over every image of a file, each rank reading only its tile of the
// images and writing only its tile of the outputs (collective hyperslab writes of parallel HDF5),
// so that no rank ever holds a whole image. The halo exchange makes every output pixel what one
// device computes: a prediction has no seams (README.md "Predicting").
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "tessera/runtime.hpp"

namespace tessera {

inline constexpr const char* kPredictionsFormat = "tessera-predictions-1";

struct PredictOptions {
  std::string model;  // a model JSON file or built-in name; empty: the checkpoint's own
  std::string
      checkpoint;      // a checkpoint directory (its newest that verifies), file, or params file
  std::string input;   // HDF5: /images [N, C, H, W] (float32, float64, uint8), /labels optional
  std::string output;  // HDF5 to write; empty: nothing written (evaluate)
  // What to write: "probabilities" ([N, K, H, W], or [N, K] for a classifier), "labels" (the
  // argmax, [N, H, W] or [N], uint8 up to 256 classes, else uint16) and "logits" (the dtype's).
  std::vector<std::string> write{"labels"};
  std::string probabilities_type = "float32";  // float16 | float32 | float64
  int compress = 0;                            // deflate level of the outputs, 0: none
  GridShape grid;
  std::int64_t batch = 0;  // images per pass; 0: one per data-parallel group
  std::string dtype = "float32";
  bool evaluate = false;  // compare with the input's /labels: loss, accuracy, IoU per class
  std::string json;       // evaluate: the report as JSON here too
  bool progress_line = false;
};

// Collective over the world group of `world`: predicts (and evaluates) on a grid of options.grid
// built with `runtime`; rank 0 prints progress and the summary to `out`. The output is written to
// a temporary file beside options.output and renamed when complete: an interrupted or failed run
// leaves no partial output under that name. Bad input throws an agreed Error on every rank.
// Returns 0.
int run_predict(const PredictOptions& options, const Comm& world, const RuntimeOptions& runtime,
                std::ostream& out);

}  // namespace tessera
