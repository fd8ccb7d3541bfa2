// The central check of the MPI tests: a model on the test grid against the same model on one
// rank, every rank comparing its own tiles with the reference it computes itself.
#pragma once

#include <string>

#include "tessera/model.hpp"

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
};

// Runs one forward/backward of `spec` on a seeded batch of shape `input` over test::world_grid()
// and on a single rank, and expects loss, output, input gradient, every parameter gradient and
// every buffer (batch norm's running statistics) to agree. When the grid cannot split the model,
// expects the refusal to name a layer and the single rank to accept it (or to refuse it as
// well). Collective over the world.
template <typename T>
void check_model(const ModelSpec& spec, Shape4 input, const std::string& what,
                 const CheckOptions& options = {});

}  // namespace tessera::test
