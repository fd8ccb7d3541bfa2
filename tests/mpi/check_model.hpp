// The central check of the MPI tests: a model on the test grid against the same model on one
// rank, every rank comparing its own tiles with the reference it computes itself.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/engine/model.hpp"

namespace tessera::test {

struct CheckOptions {
  Mode mode = Mode::train;
  std::uint64_t seed = 7;  // parameters, batch and dropout
  // Tolerances; 0: 1e-10 for double, 1e-4 for float.
  double tolerance = 0;
  // A model whose input gradient is zero in exact arithmetic (dropout with p = 1) says so;
  // otherwise a zero reference input gradient fails the check, since comparing zeros with
  // zeros would hide a layer that drops its gradients on every grid alike.
  bool zero_input_grad = false;
  // The smallest image (rows, columns) any layer of the case outputs, declared by the caller
  // from the case's own arithmetic (0: the input's). When the grid has more spatial rows or
  // columns than that, the sharded model must be refused, naming the layer, while one rank
  // accepts it; any other refusal fails the check, so no case passes by being skipped.
  std::int64_t smallest_h = 0, smallest_w = 0;
  // The sharded run's runtime (null: world_runtime()); the reference is single_runtime().
  const Runtime* grid = nullptr;
};

// Rows (or columns) out of a conv or pooling window of kernel k, stride s, dilation d over
// `extent` padded by `pad` on each side: the case's own arithmetic (PyTorch's formula). Local.
inline std::int64_t window_rows(std::int64_t extent, std::int64_t k, std::int64_t s, std::int64_t d,
                                std::int64_t pad) {
  const std::int64_t reach = extent + 2 * pad - d * (k - 1) - 1;
  return reach < 0 ? 0 : reach / s + 1;
}

// Runs one forward/backward of `spec` on a seeded batch of shape `input` over
// test::world_runtime() (or options.grid) and on a single rank, and expects loss, output, input
// gradient, every parameter gradient and every buffer (batch norm's running statistics) to agree;
// or, when options.smallest_* is below the grid's rows or columns, the refusal described there.
// Collective over the world.
template <typename T>
void check_model(const ModelSpec& spec, Shape4 input, const std::string& what,
                 const CheckOptions& options = {});

}  // namespace tessera::test
