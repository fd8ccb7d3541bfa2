#include "tessera/halo_exchange.hpp"

#include <algorithm>
#include <optional>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/parallel.hpp"
#include "tessera/profile.hpp"
#include "tessera/wait.hpp"

namespace tessera {
namespace {

// Index of global (row, col) in a tensor whose spatial origin is `origin`.
template <typename T>
const T* plane_row(const Tensor<T>& t, std::int64_t plane, const Box& origin, std::int64_t row,
                   std::int64_t col) {
  const Shape4& s = t.shape();
  return t.data() + (plane * s.h + (row - origin.h.begin)) * s.w + (col - origin.w.begin);
}

template <typename T>
T* plane_row(Tensor<T>& t, std::int64_t plane, const Box& origin, std::int64_t row,
             std::int64_t col) {
  return const_cast<T*>(plane_row(static_cast<const Tensor<T>&>(t), plane, origin, row, col));
}

template <typename T>
void pack(const Tensor<T>& t, const Box& origin, const Box& box, T* out) {
  const std::int64_t planes = t.shape().n * t.shape().c;
  const std::int64_t width = box.w.size();
  for (std::int64_t p = 0; p < planes; ++p)
    for (std::int64_t r = box.h.begin; r < box.h.end; ++r, out += width) {
      const T* in = plane_row(t, p, origin, r, box.w.begin);
      std::copy(in, in + width, out);
    }
}

template <typename T>
void unpack(const T* in, const Box& box, Tensor<T>& t, const Box& origin, Direction how) {
  const std::int64_t planes = t.shape().n * t.shape().c;
  const std::int64_t width = box.w.size();
  for (std::int64_t p = 0; p < planes; ++p)
    for (std::int64_t r = box.h.begin; r < box.h.end; ++r, in += width) {
      T* out = plane_row(t, p, origin, r, box.w.begin);
      if (how == Direction::fill) {
        std::copy(in, in + width, out);
      } else {
        for (std::int64_t k = 0; k < width; ++k)
          out[k] += in[k];
      }
    }
}

// Copies (fill) or adds (accumulate) `box` from one tensor to another without a message, row by
// row.
template <typename T>
void move_local(const Tensor<T>& from, const Box& from_origin, Tensor<T>& to, const Box& to_origin,
                const Box& box, Direction how) {
  if (box.empty()) return;
  const std::int64_t planes = from.shape().n * from.shape().c;
  const std::int64_t width = box.w.size();
  // Planes are independent: split over the kernel threads when they are large.
  parallel_for(
      planes,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t p = first; p < last; ++p)
          for (std::int64_t r = box.h.begin; r < box.h.end; ++r) {
            const T* in = plane_row(from, p, from_origin, r, box.w.begin);
            T* out = plane_row(to, p, to_origin, r, box.w.begin);
            if (how == Direction::fill) {
              std::copy(in, in + width, out);
            } else {
              for (std::int64_t k = 0; k < width; ++k)
                out[k] += in[k];
            }
          }
      },
      std::max<std::int64_t>(1, (std::int64_t{1} << 16) / std::max<std::int64_t>(box.size(), 1)));
}

// Zeroes the elements of `t` (spatial origin `origin`) outside `keep`: the window's padding,
// which no tile owns. Everything inside `keep` is written by the exchange.
template <typename T>
void zero_outside(Tensor<T>& t, const Box& origin, const Box& keep) {
  const Shape4& s = t.shape();
  const std::int64_t planes = s.n * s.c;
  const Range rows = intersect(keep.h, origin.h), cols = intersect(keep.w, origin.w);
  parallel_for(
      planes,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t p = first; p < last; ++p) {
          T* plane = t.data() + p * s.h * s.w;
          for (std::int64_t r = 0; r < s.h; ++r) {
            T* row = plane + r * s.w;
            const std::int64_t global = origin.h.begin + r;
            if (!rows.contains(global) || cols.empty()) {
              std::fill(row, row + s.w, T(0));
              continue;
            }
            std::fill(row, row + (cols.begin - origin.w.begin), T(0));
            std::fill(row + (cols.end - origin.w.begin), row + s.w, T(0));
          }
        }
      },
      std::max<std::int64_t>(1, (std::int64_t{1} << 16) / std::max<std::int64_t>(s.h * s.w, 1)));
}

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
struct HaloRequest<T>::State {
  Direction how = Direction::fill;
  Tensor<T>* target = nullptr;  // window (fill) or tile gradient (accumulate)
  Box target_origin;
  std::vector<Box> incoming;  // boxes of recv_buffers, in order
  std::vector<std::vector<T>> recv_buffers;
  std::vector<std::vector<T>> send_buffers;
  std::vector<MPI_Request> requests;
  bool* in_flight = nullptr;
};

template <typename T>
HaloRequest<T>::~HaloRequest() {
  if (!state_) return;
  // Abandoned mid-flight (an exception unwound past it): never block here, and keep the
  // buffers alive so a late message cannot land in freed memory. The job is ending anyway.
  for (MPI_Request& r : state_->requests)
    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
  if (state_->in_flight) *state_->in_flight = false;
  (void)state_.release();
}

template <typename T>
HaloExchange<T>::HaloExchange(HaloPlan plan, MPI_Comm comm, int tag)
    : plan_(std::move(plan)), comm_(comm), tag_(tag) {}

template <typename T>
HaloRequest<T> HaloExchange<T>::start(Direction how, const Tensor<T>& source, Tensor<T>& target) {
  TESSERA_CHECK(!in_flight_, "halo exchange started while another is in flight on the same plan");
  const bool fill = how == Direction::fill;
  // fill: tile -> window; accumulate: window -> tile, the same messages reversed.
  const Box& from = fill ? plan_.owned : plan_.window;
  const Box& to = fill ? plan_.window : plan_.owned;
  const auto& incoming = fill ? plan_.recv : plan_.send;
  const auto& outgoing = fill ? plan_.send : plan_.recv;
  TESSERA_CHECK(source.shape() == with_box(source.shape(), from) &&
                    target.shape() == with_box(source.shape(), to),
                std::string("halo ") + (fill ? "fill" : "accumulate") + ": source " +
                    source.shape().str() + " / target " + target.shape().str() +
                    " do not match the plan's " + to_string(from) + " / " + to_string(to));
  HaloRequest<T> request;
  auto s = std::make_unique<typename HaloRequest<T>::State>();
  s->how = how;
  s->target = &target;
  s->target_origin = to;
  const std::int64_t planes = source.shape().n * source.shape().c;
  const int tag = 2 * tag_ + (fill ? 0 : 1);
  std::optional<Timed> timed(std::in_place, Activity::halo);
  for (const HaloTransfer& t : incoming) {
    s->incoming.push_back(t.box);
    auto& buf = s->recv_buffers.emplace_back(static_cast<std::size_t>(planes * t.box.size()));
    MPI_Request r;
    TESSERA_CHECK_MPI(
        MPI_Irecv(buf.data(), static_cast<int>(buf.size()), mpi_type<T>(), t.peer, tag, comm_, &r));
    s->requests.push_back(r);
  }
  for (const HaloTransfer& t : outgoing) {
    auto& buf = s->send_buffers.emplace_back(static_cast<std::size_t>(planes * t.box.size()));
    pack(source, from, t.box, buf.data());
    MPI_Request r;
    TESSERA_CHECK_MPI(
        MPI_Isend(buf.data(), static_cast<int>(buf.size()), mpi_type<T>(), t.peer, tag, comm_, &r));
    s->requests.push_back(r);
  }
  // Zero padding and the local part overlap the messages.
  timed.emplace(Activity::window);
  if (fill) zero_outside(target, to, covered(plan_));
  move_local(source, from, target, to, plan_.self, how);
  in_flight_ = true;
  s->in_flight = &in_flight_;
  request.state_ = std::move(s);
  return request;
}

template <typename T>
void HaloExchange<T>::finish(HaloRequest<T>& request) {
  TESSERA_CHECK(request.state_ != nullptr, "halo finish: the request is empty or already finished");
  auto s = std::move(request.state_);
  {
    Timed timed(Activity::waiting);
    wait_all(s->requests);
  }
  Timed timed(Activity::halo);
  // Received boxes are added in ascending peer order, so results do not depend on timing.
  for (std::size_t k = 0; k < s->incoming.size(); ++k)
    unpack(s->recv_buffers[k].data(), s->incoming[k], *s->target, s->target_origin, s->how);
  in_flight_ = false;
}

template class HaloRequest<float>;
template class HaloRequest<double>;
template class HaloExchange<float>;
template class HaloExchange<double>;

}  // namespace tessera
