// Checkpoints (README.md "Files"): parameters and buffers in the params layout, the optimizer's
// state under /optimizer, and /state (step, epoch, seed, model JSON, grid, dtype, the options
// that decide what the run computes). Every dataset carries its CRC-32, verified on load. Written
// by one rank to a temporary file in the same directory, flushed and renamed, so a crash mid-write
// never destroys the last good checkpoint. Every function is local.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tessera/engine/model.hpp"
#include "tessera/engine/optimizer.hpp"

namespace tessera {

inline constexpr const char* kCheckpointFormat = "tessera-checkpoint-2";

struct CheckpointState {
  std::int64_t step = 0;   // optimizer steps taken; the data cursor and the dropout step follow
  std::int64_t epoch = 0;  // the epoch the next step belongs to
  std::uint64_t seed = 0;  // every random draw is a function of (seed, step, index)
  std::string model;       // the model's canonical JSON
  std::string grid;        // informational: a checkpoint resumes on any grid
  std::string dtype;
  std::string optimizer;  // "sgd" | "adam"
  // The data cursor means the same only with the same global batch and training-set size.
  std::int64_t batch = 0;
  std::int64_t samples = 0;  // training samples
  // The log window still open at the checkpoint: its steps, their summed loss and its confusion
  // counts summed over the grid, so that a resumed run logs what a straight one does.
  std::int64_t window_steps = 0;
  double window_loss = 0;
  std::vector<std::int64_t> window_counts;
  // The options that decide what the run computes, by name ("--lr" -> "0.001"): a resume compares
  // them with its own (src/drivers/train.cpp).
  std::map<std::string, std::string> options;
};

// `dir`/checkpoint-<step>.h5.
std::string checkpoint_path(const std::string& dir, std::int64_t step);

// The checkpoints in `dir` (checkpoint-<step>.h5), the highest step first; empty when there are
// none or `dir` does not exist.
std::vector<std::string> checkpoints_newest_first(const std::string& dir);

// Checks that `path` is a whole checkpoint of this format whose every dataset matches its
// checksum; otherwise an Error saying what is wrong (truncated, not HDF5, damaged dataset...).
void verify_checkpoint(const std::string& path);

// The checkpoints of `dir` of steps later than `step`, the latest first. Local.
std::vector<std::string> checkpoints_after(const std::string& dir, std::int64_t step);

// Removes all but the `keep` newest checkpoints of `dir` up to step `written` (the one just
// written: it is always kept; keep 0 removes none), and the temporary files writers left behind
// (.checkpoint-<step>.h5.tmp.<pid>). Checkpoints of later steps are neither counted nor removed:
// another run's, or damaged files that a resume skipped. Returns a line per file it could not
// remove (the reason), empty when all went well. Local.
std::vector<std::string> prune_checkpoints(const std::string& dir, std::int64_t keep,
                                           std::int64_t written);

// Writes `path` all or nothing. A parameter, buffer or optimizer state holding NaN or infinity
// is an Error naming it, and nothing is written: a checkpoint always holds finite numbers.
template <typename T>
void write_checkpoint(const std::string& path, Model<T>& model, Optimizer<T>& optimizer,
                      const CheckpointState& state);

// Loads a checkpoint into `model` and `optimizer` after verifying it (verify_checkpoint) and
// checking that it was written for the same model, dtype and optimizer as `expect`, and that its
// /state/window_counts holds as many counts as expect.window_counts (the run's classes squared);
// a mismatch, a damaged file or a file that fails verification is an Error saying why. Its
// options are returned, not compared.
template <typename T>
CheckpointState read_checkpoint(const std::string& path, Model<T>& model, Optimizer<T>& optimizer,
                                const CheckpointState& expect);

}  // namespace tessera
