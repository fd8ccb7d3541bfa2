// Assembling a distributed tensor on one rank (for checks and dumps, never on the training path).
#pragma once

#include "tessera/comm.hpp"
#include "tessera/dist_tensor.hpp"

namespace tessera {

// Returns the whole tensor on grid rank 0 and an empty tensor elsewhere. Collective over the
// world group.
template <typename T>
Tensor<T> gather_to_root(const DistTensor<T>& x, const Comm& grid);

}  // namespace tessera
