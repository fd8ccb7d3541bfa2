// Moves the boxes of a HaloPlan through a Comm, split phase (start / finish), in two directions:
//   fill:       a rank's owned tile -> every window that overlaps it (forward)
//   accumulate: window gradients -> added into their owners' tiles (backward; the adjoint of fill)
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm.hpp"
#include "tessera/halo_plan.hpp"
#include "tessera/kernels/halo_copy.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

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
  HaloRequest(HaloRequest&& other) noexcept
      : messages_(std::move(other.messages_)), exchange_(std::exchange(other.exchange_, nullptr)) {}
  HaloRequest& operator=(HaloRequest&& other) noexcept {
    messages_ = std::move(other.messages_);
    exchange_ = std::exchange(other.exchange_, nullptr);
    return *this;
  }
  HaloRequest(const HaloRequest&) = delete;
  HaloRequest& operator=(const HaloRequest&) = delete;
  ~HaloRequest();

 private:
  friend class HaloExchange<T>;
  Request messages_;
  HaloExchange<T>* exchange_ = nullptr;  // while in flight
};

template <typename T>
class HaloExchange {
 public:
  // The plan's peers are ranks of `comm`'s spatial group; `tag` tells this exchange's messages
  // from other exchanges that may be in flight at the same time; `name` ("layer 'c3'") is what
  // the watchdog names. Message buffers are allocated here for `planes` planes (samples x
  // channels) and reused by every exchange (a tensor of other planes reallocates them). The copies
  // are the Backend's (Backend::halo_copy); Tessera's CPU copies when none is given. `memory` is
  // the memory the copies work in (Backend::allocator; host memory when none is given): with
  // device memory, boxes are packed and unpacked there, and the messages travel as they are when
  // the Comm reaches device memory (Comm::reaches: NCCL), else through host copies of them (the
  // MPI transport's host staging). Local.
  HaloExchange(HaloPlan plan, const Comm& comm, int tag, std::string name, std::int64_t planes = 0,
               std::unique_ptr<HaloCopyKernel<T>> copies = nullptr, Allocator* memory = nullptr);
  HaloExchange(HaloExchange&&) noexcept = default;
  // An exchange abandoned in flight leaves its buffers allocated: a late message may still land.
  ~HaloExchange();

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
  T window_padding() const { return window_padding_; }

  // Forward. `tile` holds plan.owned, `window` (same N and C) is sized to plan.window; on
  // finish, window holds the tile's values, the peers' values, and the padding value (zero unless
  // set_window_padding said otherwise) outside the image.
  // Neighbour-wise collective over the spatial communicator (every rank must start one).
  // The tile may lie in any layout (Tensor::layout); the window lies in window_layout().
  // With `window_channel`, the tile fills channels [window_channel, window_channel + its C) of a
  // window of more channels (one input of a concat the window's layer computes from: WindowLayer),
  // a multiple of the window layout's block; this needs copies that take channel slices
  // (takes_channel_slices). Exchanges of several such tiles may be in flight together on plans of
  // one layer: they use the same tag, and messages between two ranks arrive in the order sent.
  HaloRequest<T> start_fill(const Tensor<T>& tile, Tensor<T>& window,
                            std::int64_t window_channel = 0) {
    return start(Direction::fill, tile, window, Into::add, window_channel);
  }

  // Backward. Adds each element of `window_grad` (sized to plan.window) into the tile that owns
  // it; parts outside the image are dropped. `tile_grad` is added to, or with Into::overwrite
  // overwritten. Neighbour-wise collective over the spatial communicator.
  // `window_channel`: the tile's channels start there in the window's (as start_fill).
  HaloRequest<T> start_accumulate(const Tensor<T>& window_grad, Tensor<T>& tile_grad,
                                  Into into = Into::add, std::int64_t window_channel = 0) {
    return start(Direction::accumulate, window_grad, tile_grad, into, window_channel);
  }
  // Whether start_fill and start_accumulate take a window_channel. Local.
  bool takes_channel_slices() const { return copies_->takes_channel_slices(); }

  // Sets every element of `window` (sized to plan.window, in window_layout()) outside the rank's
  // own tile to zero: what peers send before a fill delivers it, for a freshly allocated window
  // whose kernel reads those parts before they arrive (and computes them again after). Local;
  // the strips only.
  void clear_halos(Tensor<T>& window) const;

  // Completes the exchange. Local wait (Comm::wait, with its deadline). In device memory the
  // received boxes are unpacked by the device's queue: the target is complete for the kernels
  // queued after this (a staged transport's uploads are queued too, not waited for).
  void finish(HaloRequest<T>& request);

  void fill(const Tensor<T>& tile, Tensor<T>& window) {
    auto r = start_fill(tile, window);
    finish(r);
  }
  void accumulate(const Tensor<T>& window_grad, Tensor<T>& tile_grad) {
    auto r = start_accumulate(window_grad, tile_grad);
    finish(r);
  }

 private:
  friend class HaloRequest<T>;
  HaloRequest<T> start(Direction how, const Tensor<T>& source, Tensor<T>& target, Into into,
                       std::int64_t window_channel);
  void size_buffers(std::int64_t planes);
  // Waits for the copies between the staging buffers and the device that start() and finish()
  // queued (staged transport), before the host reads, writes or frees those buffers.
  void settle_copies();

  HaloPlan plan_;
  const Comm* comm_;
  std::unique_ptr<HaloCopyKernel<T>> copies_;
  int tag_;
  std::string name_;
  std::string fill_what_, accumulate_what_;  // the watchdog's names, built once
  Layout window_layout_ = Layout::nchw;
  T window_padding_ = T(0);
  bool in_flight_ = false;
  bool abandoned_ = false;
  // One buffer per transfer of plan_.recv / plan_.send, for `planes_` planes: what the Comm
  // sends and receives, in host memory (empty when the Comm moves the device buffers); staged
  // device boxes in the device allocator's staging memory (page-locked for a GPU).
  std::int64_t planes_ = -1;
  std::vector<Tensor<T>> recv_buffers_, send_buffers_;
  // With device copies, the same buffers in device memory, where boxes are packed and unpacked;
  // empty otherwise. A Comm that reaches device memory (NCCL) sends and receives these directly;
  // an MPI Comm sends host copies of them (staged).
  Allocator* memory_;
  bool on_device() const { return memory_->space() != MemorySpace::host; }
  bool direct() const { return on_device() && comm_->reaches(memory_->space()); }
  bool staged() const { return on_device() && !direct(); }
  std::vector<Tensor<T>> recv_staging_, send_staging_;
  // Copies on the host buffers are queued (set before each is queued, cleared by settle_copies).
  bool copies_queued_ = false;
  // Of the exchange in flight: its direction and where finish() unpacks.
  Direction how_ = Direction::fill;
  Planes<T> target_{nullptr, {}, {}, Layout::nchw};
};

}  // namespace tessera
