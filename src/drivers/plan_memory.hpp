// The host memory of one rank's training step and inference passes, walked as the engine runs
// them (src/engine/model.cpp): forward in node order, then the loss and the backward pass in
// reverse, allocating and freeing each tensor where the engine does. Internal to
// src/drivers/plan.cpp; README "Planning a run" states the rules. Local.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tessera/drivers/plan.hpp"
#include "tessera/engine/graph.hpp"

namespace tessera {

// The largest live total of one walk and the allocation that reached it ("c2 output, forward").
struct WalkPeak {
  std::int64_t bytes = 0;
  std::string at;
};

struct RankWalk {
  WalkPeak step;       // a training step: forward, loss, backward
  WalkPeak inference;  // two forward passes (evaluation: the first pass's kept state stays)
  std::int64_t loss_gradient = 0;  // what computing the loss adds to an evaluation
};

class MemoryWalk {
 public:
  // Decides, from shapes, types and `engine` alone, what Model's constructor and the layers'
  // bind() decide (fusions, taken concats, windowless convolutions, blocked layouts). Every rank
  // is walked with `samples` samples (the most any rank holds).
  MemoryWalk(const ModelSpec& spec, const std::vector<LayerNode<double>>& nodes,
             const Distribution& input, std::int64_t samples, std::int64_t dtype_bytes,
             const PlanEngine& engine);
  ~MemoryWalk();
  MemoryWalk(const MemoryWalk&) = delete;
  MemoryWalk& operator=(const MemoryWalk&) = delete;

  // The walks of spatial rank (i, j), without halo buffers and the fixed cost (MemoryEstimate's
  // halo and kHostFixed). Ranks with the same tile and window extents on every layer share one
  // walk.
  const RankWalk& walk(int i, int j);

  // Bytes of the halo buffers rank (i, j) keeps for window layer k, given the elements it receives
  // and sends per channel plane in one exchange (RankHalo::moved): receive and send boxes per
  // exchange, twice and with the strip buffers for a windowless convolution.
  std::int64_t halo_bytes(std::size_t k, std::int64_t moved) const;

  struct Node;  // what the walk knows of a layer (plan_memory.cpp)

 private:
  RankWalk run(int i, int j) const;
  // What convolution k's oneDNN kernels allocate for one call beside the tensors, for an output
  // and a window of `out` and `window` elements.
  std::int64_t scratch_bytes(std::size_t k, std::int64_t out, std::int64_t window) const;
  // What oneDNN's bfloat16 kernels add beside a (transposed) convolution's tensors under
  // --precision bf16: conversions of an output of `out` and a window of `window` elements.
  std::int64_t bf16_copies(std::int64_t out, std::int64_t window) const;

  std::vector<Node> nodes_;
  Distribution input_;
  std::int64_t samples_;
  std::int64_t dtype_bytes_;
  PlanEngine engine_;
  bool fast_;  // oneDNN's float32 kernels
  std::int64_t params_ = 0;
  int ranks_ = 1;
  // Ranks whose rows (columns) have the same extents on every layer share a class; a walk is
  // cached per pair of classes.
  std::vector<int> row_class_, col_class_;
  int col_classes_ = 0;
  std::map<int, RankWalk> cache_;  // by row class * column classes + column class
};

}  // namespace tessera
