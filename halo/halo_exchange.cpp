#include "tessera/halo_exchange.hpp"

#include <algorithm>
#include <optional>

#include "tessera/error.hpp"
#include "tessera/parallel.hpp"
#include "tessera/profile.hpp"

namespace tessera {
namespace {

// The part of the window that tiles own: the self box and every received box tile it exactly
// (the plan's invariant), so it is their hull.
Box covered(const HaloPlan& plan) {
  Box hull = plan.self;
  auto extend = [&hull](const Box& b) {
    if (b.empty()) return;
    if (hull.empty()) {
      hull = b;
      return;
    }
    hull.h = {std::min(hull.h.begin, b.h.begin), std::max(hull.h.end, b.h.end)};
    hull.w = {std::min(hull.w.begin, b.w.begin), std::max(hull.w.end, b.w.end)};
  };
  for (const HaloTransfer& t : plan.recv)
    extend(t.box);
  return hull;
}

Shape4 with_box(const Shape4& s, const Box& b) {
  return {s.n, s.c, b.h.size(), b.w.size()};
}

}  // namespace

template <typename T>
HaloRequest<T>::~HaloRequest() {
  // Abandoned mid-flight (an exception unwound past it): the messages are released without
  // blocking (Request), the exchange's buffers stay with it. The job is ending anyway.
  if (exchange_ == nullptr) return;
  exchange_->in_flight_ = false;
  exchange_->abandoned_ = true;
}

template <typename T>
HaloExchange<T>::~HaloExchange() {
  if (!abandoned_) {
    // Copies queued on the staging buffers may still use them.
    if (copies_queued_) memory_->wait_ordered_quietly();
    return;
  }
  // Deliberately leaked (the job is ending): moving keeps the buffers where MPI writes.
  new std::vector<Tensor<T>>(std::move(recv_buffers_));
  new std::vector<Tensor<T>>(std::move(send_buffers_));
  new std::vector<Tensor<T>>(std::move(recv_staging_));
  new std::vector<Tensor<T>>(std::move(send_staging_));
}

template <typename T>
HaloExchange<T>::HaloExchange(HaloPlan plan, const Comm& comm, int tag, std::string name,
                              std::int64_t planes, std::unique_ptr<HaloCopyKernel<T>> copies,
                              Allocator* memory)
    : plan_(std::move(plan)),
      comm_(&comm),
      copies_(copies ? std::move(copies) : make_cpu_halo_copy<T>()),
      tag_(tag),
      name_(std::move(name)),
      fill_what_("halo fill of " + name_),
      accumulate_what_("halo accumulate of " + name_),
      memory_(memory != nullptr ? memory : &host_allocator()) {
  TESSERA_CHECK(memory_->space() == copies_->space(),
                "halo exchange of " + name_ + ": copies for " + to_string(copies_->space()) +
                    " memory given " + to_string(memory_->space()) + " memory");
  if (planes > 0) size_buffers(planes);
}

template <typename T>
void HaloExchange<T>::size_buffers(std::int64_t planes) {
  if (planes == planes_) return;
  settle_copies();  // queued copies may still use the old buffers
  auto size = [&](const std::vector<HaloTransfer>& transfers, std::vector<Tensor<T>>& bufs,
                  std::vector<Tensor<T>>& staging) {
    bufs.clear();
    staging.clear();
    for (std::size_t k = 0; k < transfers.size(); ++k) {
      const std::int64_t count = planes * transfers[k].box.size();
      // A device transport moves the device buffers themselves: no host copies.
      bufs.emplace_back(Shape4{1, 1, 1, direct() ? 0 : count}, Layout::nchw, uninitialized,
                        memory_->staging());
      if (on_device())
        staging.emplace_back(Shape4{1, 1, 1, count}, Layout::nchw, uninitialized, *memory_);
    }
  };
  size(plan_.recv, recv_buffers_, recv_staging_);
  size(plan_.send, send_buffers_, send_staging_);
  planes_ = planes;
}

template <typename T>
void HaloExchange<T>::settle_copies() {
  if (!copies_queued_) return;
  memory_->wait_ordered();
  copies_queued_ = false;
}

template <typename T>
void HaloExchange<T>::set_window_layout(Layout layout) {
  TESSERA_CHECK(!in_flight_, "halo exchange: layout changed while an exchange is in flight");
  window_layout_ = layout;
}

template <typename T>
void HaloExchange<T>::clear_halos(Tensor<T>& window) const {
  TESSERA_CHECK(window.shape() == with_box(window.shape(), plan_.window) &&
                    window.layout() == window_layout_ && window.space() == copies_->space(),
                "halo exchange of " + name_ + ": clear_halos on a tensor that is not its window");
  copies_->fill_outside(planes_of(window, plan_.window), plan_.owned, T(0));
}

template <typename T>
HaloRequest<T> HaloExchange<T>::start(Direction how, const Tensor<T>& source, Tensor<T>& target,
                                      Into into, std::int64_t window_channel) {
  TESSERA_CHECK(!in_flight_, "halo exchange started while another is in flight on the same plan");
  TESSERA_CHECK(!abandoned_, "the halo exchange of " + name_ +
                                 " was abandoned in flight (an error unwound past it); its "
                                 "buffers may still receive messages, so it is not reused");
  const bool fill = how == Direction::fill;
  // fill: tile -> window; accumulate: window -> tile, the same messages reversed. A fill receives
  // into recv_buffers_ what the plan's recv boxes hold; an accumulate receives the plan's send
  // boxes into send_buffers_ and sends from recv_buffers_.
  const Box& from = fill ? plan_.owned : plan_.window;
  const Box& to = fill ? plan_.window : plan_.owned;
  const auto& incoming = fill ? plan_.recv : plan_.send;
  const auto& outgoing = fill ? plan_.send : plan_.recv;
  const Tensor<T>& window = fill ? target : source;
  const Tensor<T>& tile = fill ? source : target;
  // The tile's channels within the window's: all of them, or a slice.
  const bool slice = window_channel != 0 || window.shape().c != tile.shape().c;
  Shape4 window_part = window.shape();
  window_part.c = tile.shape().c;
  TESSERA_CHECK(
      tile.shape() == with_box(tile.shape(), plan_.owned) &&
          window_part == with_box(tile.shape(), plan_.window) &&
          (!slice ||
           (window_channel >= 0 && window_channel + tile.shape().c <= window.shape().c &&
            window_channel % block_of(window.layout()) == 0 && copies_->takes_channel_slices())),
      std::string("halo ") + (fill ? "fill" : "accumulate") + ": source " + source.shape().str() +
          " / target " + target.shape().str() +
          (slice ? " from channel " + std::to_string(window_channel) : std::string()) +
          " do not match the plan's " + to_string(from) + " / " + to_string(to));
  // A blocked window may pad its channels (its storage holds them); blocked tiles do not.
  TESSERA_CHECK(tile.shape().c % block_of(tile.layout()) == 0,
                std::string("halo exchange: an ") + to_string(tile.layout()) +
                    " tile needs channels divisible by " + std::to_string(block_of(tile.layout())) +
                    ", got " + tile.shape().str());
  TESSERA_CHECK(window.layout() == window_layout_,
                std::string("halo exchange: the window lies in ") + to_string(window.layout()) +
                    ", the exchange assembles it in " + to_string(window_layout_));
  TESSERA_CHECK(source.space() == copies_->space() && target.space() == copies_->space(),
                std::string("halo exchange of ") + name_ + ": tensors in " +
                    to_string(source.space()) + " and " + to_string(target.space()) +
                    " memory, copies for " + to_string(copies_->space()) + " memory");
  // Either side may be blocked: the copies convert.
  Planes<const T> in = planes_of(source, from);
  Planes<T> out = planes_of(target, to);
  if (slice) {
    if (fill)
      out = channel_slice(out, window_channel, tile.shape().c);
    else
      in = channel_slice(in, window_channel, tile.shape().c);
  }
  size_buffers(tile.shape().n * tile.shape().c);
  auto& in_buffers = fill ? recv_buffers_ : send_buffers_;
  auto& out_buffers = fill ? send_buffers_ : recv_buffers_;
  auto& in_staging = fill ? recv_staging_ : send_staging_;
  auto& out_staging = fill ? send_staging_ : recv_staging_;
  std::optional<Timed> timed(std::in_place, Activity::halo);
  std::vector<Message<T>> recv;
  std::vector<Message<const T>> send;
  for (std::size_t k = 0; k < incoming.size(); ++k) {
    if (direct()) {  // received into device memory
      Tensor<T>& box = in_staging[k];
      recv.push_back({incoming[k].peer, box.data_in(box.space()), box.numel()});
    } else {
      recv.push_back({incoming[k].peer, in_buffers[k].data(), in_buffers[k].numel()});
    }
  }
  for (std::size_t k = 0; k < outgoing.size(); ++k) {
    if (direct()) {  // packed on the device and sent from there
      Tensor<T>& box = out_staging[k];
      copies_->pack(in, outgoing[k].box, box.data_in(box.space()));
      send.push_back({outgoing[k].peer, box.data_in(box.space()), box.numel()});
      continue;
    }
    if (staged()) {  // packed on the device, then copied out for the Comm (below)
      Tensor<T>& box = out_staging[k];
      copies_->pack(in, outgoing[k].box, box.data_in(box.space()));
      copies_queued_ = true;  // before the copy: an exception after it still waits for it
      download_ordered(box, out_buffers[k].data());
    } else {
      copies_->pack(in, outgoing[k].box, out_buffers[k].data());
    }
    send.push_back({outgoing[k].peer, out_buffers[k].data(), out_buffers[k].numel()});
  }
  if (copies_queued_) {
    // The downloads wait for the kernels queued before them (the layer that computed the tile:
    // compute, not communication, so outside the halo's time), and the uploads of this
    // exchange's last finish() are done with the buffers the messages now land in.
    timed.reset();
    settle_copies();
    timed.emplace(Activity::halo);
  }
  HaloRequest<T> request;
  try {
    request.messages_ = comm_->start_exchange(Group::spatial, 2 * tag_ + (fill ? 0 : 1), recv, send,
                                              fill ? fill_what_ : accumulate_what_);
  } catch (...) {
    abandoned_ = true;  // messages posted before the failure may still land in the buffers
    throw;
  }
  // From here on an exception unwinding past `request` marks this exchange abandoned.
  in_flight_ = true;
  request.exchange_ = this;
  // Zero padding and the local part overlap the messages.
  timed.emplace(Activity::window);
  if (fill) {
    copies_->fill_outside(out, covered(plan_), window_padding_);
    copies_->move(in, out, plan_.self, how);
  } else if (into == Into::overwrite) {
    // The own part is copied, the rest zeroed; peers' parts are added on finish.
    copies_->fill_outside(out, plan_.self, T(0));
    copies_->move(in, out, plan_.self, Direction::fill);
  } else {
    copies_->move(in, out, plan_.self, how);
  }
  how_ = how;
  target_ = out;
  return request;
}

template <typename T>
void HaloExchange<T>::finish(HaloRequest<T>& request) {
  TESSERA_CHECK(request.exchange_ == this,
                "halo finish: the request is empty, already finished or another exchange's");
  {
    Timed timed(Activity::waiting);
    comm_->wait(request.messages_);
  }
  request.exchange_ = nullptr;
  Timed timed(Activity::halo);
  const bool fill = how_ == Direction::fill;
  const auto& incoming = fill ? plan_.recv : plan_.send;
  const auto& buffers = fill ? recv_buffers_ : send_buffers_;
  auto& staging = fill ? recv_staging_ : send_staging_;
  const Planes<T>& out = target_;
  // Received boxes are added in ascending peer order, so results do not depend on timing.
  for (std::size_t k = 0; k < incoming.size(); ++k) {
    if (on_device()) {  // (staged: copied into the device first) unpacked there
      Tensor<T>& box = staging[k];
      if (staged()) {  // queued: the host goes on while the device copies and unpacks
        copies_queued_ = true;
        upload_ordered(buffers[k].data(), box);
      }
      copies_->unpack(box.data_in(box.space()), incoming[k].box, out, how_);
    } else {
      copies_->unpack(buffers[k].data(), incoming[k].box, out, how_);
    }
  }
  in_flight_ = false;
}

template class HaloRequest<float>;
template class HaloRequest<double>;
template class HaloExchange<float>;
template class HaloExchange<double>;

}  // namespace tessera
