// Moves the boxes of a HaloPlan over MPI, split phase (start / finish), in two directions:
//   fill:       a rank's owned tile -> every window that overlaps it (forward)
//   accumulate: window gradients -> added into their owners' tiles (backward; the adjoint of fill)
#pragma once

#include <mpi.h>

#include <memory>
#include <vector>

#include "tessera/halo_plan.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

enum class Direction { fill, accumulate };

// What accumulate does with the tile gradient it is given: add into its values, or overwrite it
// (any values; every element is written, zero where no window reaches) — which saves zeroing a
// fresh tensor and reading it back.
enum class Into { add, overwrite };

template <typename T>
class HaloExchange;

// An exchange in flight. Move-only; hand it back to HaloExchange::finish.
template <typename T>
class HaloRequest {
 public:
  HaloRequest() = default;
  HaloRequest(HaloRequest&&) noexcept = default;
  HaloRequest& operator=(HaloRequest&&) noexcept = default;
  HaloRequest(const HaloRequest&) = delete;
  HaloRequest& operator=(const HaloRequest&) = delete;
  ~HaloRequest();

 private:
  friend class HaloExchange<T>;
  struct State;
  std::unique_ptr<State> state_;
};

template <typename T>
class HaloExchange {
 public:
  // `comm` is the spatial communicator the plan's peers index; `tag` tells this exchange's
  // messages from other exchanges that may be in flight at the same time. Local.
  HaloExchange(HaloPlan plan, MPI_Comm comm, int tag);

  const HaloPlan& plan() const { return plan_; }

  // The memory layout of the window (fill's target, accumulate's source); the tile's is given per
  // exchange. nchw16c (channels a multiple of 16) lets a oneDNN convolution read the window, and
  // write its gradient, with no reorder: the exchange converts while it copies. Local; not while
  // an exchange is in flight.
  void set_window_layout(Layout layout);
  Layout window_layout() const { return window_layout_; }

  // The value fill writes where the window leaves the image (default 0, a convolution's zero
  // padding). Max pooling on oneDNN asks for -infinity, which no image value loses to. Local;
  // not while an exchange is in flight.
  void set_window_padding(T value) { window_padding_ = value; }

  // Forward. `tile` holds plan.owned, `window` (same N and C) is sized to plan.window; on
  // finish, window holds the tile's values, the peers' values, and the padding value (zero unless
  // set_window_padding said otherwise) outside the image.
  // Neighbour-wise collective over the spatial communicator (every rank must start one).
  // `tile_layout` is the tile's memory layout (the window's is window_layout()).
  HaloRequest<T> start_fill(const Tensor<T>& tile, Tensor<T>& window,
                            Layout tile_layout = Layout::nchw) {
    return start(Direction::fill, tile, window, tile_layout);
  }

  // Backward. Adds each element of `window_grad` (sized to plan.window) into the tile that owns
  // it; parts outside the image are dropped. `tile_grad` is added to, or with Into::overwrite
  // overwritten. Neighbour-wise collective over the spatial communicator.
  HaloRequest<T> start_accumulate(const Tensor<T>& window_grad, Tensor<T>& tile_grad,
                                  Layout tile_layout = Layout::nchw, Into into = Into::add) {
    return start(Direction::accumulate, window_grad, tile_grad, tile_layout, into);
  }

  // Completes the exchange. Local wait (through wait_all).
  void finish(HaloRequest<T>& request);

  void fill(const Tensor<T>& tile, Tensor<T>& window, Layout tile_layout = Layout::nchw) {
    auto r = start_fill(tile, window, tile_layout);
    finish(r);
  }
  void accumulate(const Tensor<T>& window_grad, Tensor<T>& tile_grad,
                  Layout tile_layout = Layout::nchw) {
    auto r = start_accumulate(window_grad, tile_grad, tile_layout);
    finish(r);
  }

 private:
  HaloRequest<T> start(Direction how, const Tensor<T>& source, Tensor<T>& target,
                       Layout tile_layout, Into into = Into::add);

  HaloPlan plan_;
  MPI_Comm comm_;
  int tag_;
  Layout window_layout_ = Layout::nchw;
  T window_padding_ = T(0);
  bool in_flight_ = false;
};

}  // namespace tessera
