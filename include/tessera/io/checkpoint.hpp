// Checkpoints (README.md "Files"): parameters and buffers in the params layout, the optimizer's
// state under /optimizer, and /state (step, epoch, seed, model JSON, grid, dtype). Written by one
// rank to a temporary file in the same directory, flushed and renamed, so a crash mid-write never
// destroys the last good checkpoint. Every function is local.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/engine/model.hpp"
#include "tessera/engine/optimizer.hpp"

namespace tessera {

inline constexpr const char* kCheckpointFormat = "tessera-checkpoint-1";

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
};

// `dir`/checkpoint-<step>.h5.
std::string checkpoint_path(const std::string& dir, std::int64_t step);

// The checkpoint with the highest step in `dir`, or "" when there is none.
std::string latest_checkpoint(const std::string& dir);

template <typename T>
void write_checkpoint(const std::string& path, Model<T>& model, Optimizer<T>& optimizer,
                      const CheckpointState& state);

// Loads a checkpoint into `model` and `optimizer` after checking that it was written for the
// same model, dtype, optimizer, seed, batch and number of training samples as `expect` (its
// step, epoch, grid and window are not compared); a mismatch or a file that is not a checkpoint
// is an Error saying why.
template <typename T>
CheckpointState read_checkpoint(const std::string& path, Model<T>& model, Optimizer<T>& optimizer,
                                const CheckpointState& expect);

}  // namespace tessera
