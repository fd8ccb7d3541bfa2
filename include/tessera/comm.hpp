// Communication behind one interface (after Aluminum's communicators): the process grid hands out
// groups (world, spatial, sample); operations start split phase and return a Request; every
// Request is completed by Comm::wait, which has a deadline (the watchdog). Layers and the model
// talk to a Comm and never to MPI; the MPI implementation is mpi_comm.hpp, and a GPU transport
// (NCCL) is another implementation of this class.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/allocator.hpp"
#include "tessera/process_grid.hpp"

namespace tessera {

// The ranks an operation spans: every rank of the job (grid rank n*h*w + i*w + j), the h*w
// spatial ranks of my sample group (rank i*w + j), or the n ranks that hold my tile of other
// samples (rank n).
enum class Group { world, spatial, sample };
const char* to_string(Group g);

enum class ReduceOp { sum, max, min };

// How a rank waits: `spin` polls without pause (a core per rank), `sleep` polls every 20 us and
// leaves the core to ranks with work (more ranks than cores; README "Waiting for messages").
enum class WaitPolicy { spin, sleep };
WaitPolicy parse_wait_policy(const std::string& text);  // "spin" | "sleep"; local
const char* to_string(WaitPolicy p);

// A wait with no deadline: only for a wait that lasts as long as a known piece of work of one
// rank (rank 0 writing a dataset while the others wait for its outcome).
inline constexpr double kNoTimeout = std::numeric_limits<double>::infinity();

struct WaitSettings {
  WaitPolicy policy = WaitPolicy::spin;
  // Seconds any one wait may take before the watchdog ends the job (> 0, or kNoTimeout).
  double timeout = 600;
};

// Checks a --timeout value: a number of seconds > 0. Local; throws an Error otherwise.
double check_timeout(double seconds);

// An operation in flight. Move-only. Complete it with Comm::wait; a Request destroyed while
// pending (an exception unwound past it) is released without blocking, and its buffers must be
// kept alive by the implementation: the job is ending then.
class Request {
 public:
  // What an implementation keeps for a pending operation.
  class State {
   public:
    virtual ~State() = default;
    // Makes progress; true once the operation is complete. Local.
    virtual bool test() = 0;
    // World ranks whose messages to this rank have not arrived: the peers of a point-to-point
    // exchange; empty for collectives, where MPI cannot say (the watchdog asks every rank).
    virtual std::vector<int> missing_peers() = 0;
    // Gives the operation up without waiting. Returns false when the state itself must outlive
    // the operation (a collective MPI cannot cancel may still read or write what it holds): the
    // Request then leaks it. Must not throw.
    virtual bool release() noexcept = 0;
  };

  Request() = default;
  Request(std::unique_ptr<State> state, std::string what)
      : state_(std::move(state)), what_(std::move(what)) {}
  Request(Request&&) noexcept = default;
  Request& operator=(Request&& other) noexcept {
    if (this != &other) {
      abandon();
      state_ = std::move(other.state_);
      what_ = std::move(other.what_);
    }
    return *this;
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() { abandon(); }

  bool pending() const { return state_ != nullptr; }
  // "halo fill of layer 'c3'", "allreduce of gradient bucket 2": what the watchdog names.
  const std::string& what() const { return what_; }

 private:
  friend class Comm;
  void abandon() noexcept {
    if (state_ && !state_->release()) (void)state_.release();  // deliberately leaked
    state_.reset();
  }
  std::unique_ptr<State> state_;
  std::string what_;
};

// One message of a point-to-point exchange: `count` values at `data`, to or from rank `peer` of
// the exchange's group.
template <typename T>
struct Message {
  int peer = 0;
  T* data = nullptr;
  std::int64_t count = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // The grid and this rank's place in it. Local.
  const GridShape& shape() const { return shape_; }
  const GridCoords& coords() const { return coords_; }
  int rank() const { return rank_; }  // in the world group
  int rank(Group g) const;
  int size(Group g) const;
  int spatial_rank(int i, int j) const { return i * shape_.w + j; }
  GridCoords coords_of(int world_rank) const;
  // The world rank of rank `r` of `g` (as seen from this rank's groups). Local.
  int world_rank(Group g, int r) const;

  const WaitSettings& wait_settings() const { return wait_; }
  // The training step the watchdog's messages name (-1: none). Local.
  void set_step(std::int64_t step) { step_ = step; }
  std::int64_t step() const { return step_; }

  // Whether start_exchange and the float/double start_allreduce take buffers in `space` (an MPI
  // Comm: host memory only; a device transport, device_comm.hpp: device memory too). Local.
  virtual bool reaches(MemorySpace space) const { return space == MemorySpace::host; }
  // The Comm that moves host buffers: this one, or the one a device transport wraps. Local.
  virtual const Comm& host() const { return *this; }

  // In-place reduction of `data` over `group`. Collective over `group`.
  virtual Request start_allreduce(std::span<float> data, ReduceOp op, Group group,
                                  std::string what) const = 0;
  virtual Request start_allreduce(std::span<double> data, ReduceOp op, Group group,
                                  std::string what) const = 0;
  virtual Request start_allreduce(std::span<long long> data, ReduceOp op, Group group,
                                  std::string what) const = 0;
  virtual Request start_allreduce(std::span<int> data, ReduceOp op, Group group,
                                  std::string what) const = 0;
  // `data` from rank `root` of `group` to every rank of it. Collective over `group`.
  virtual Request start_broadcast(std::span<char> data, int root, Group group,
                                  std::string what) const = 0;
  virtual Request start_broadcast(std::span<long long> data, int root, Group group,
                                  std::string what) const = 0;
  // all[k] = rank k's `mine`; all.size() == size(group). Collective over `group`.
  virtual Request start_allgather(const long long& mine, std::span<long long> all, Group group,
                                  std::string what) const = 0;
  // Receives every message of `recv` and sends every one of `send` (peers are ranks of `group`;
  // `tag` keeps exchanges in flight at the same time apart). The buffers must live until the
  // request completes. Neighbour-wise collective over `group`.
  virtual Request start_exchange(Group group, int tag, std::span<const Message<float>> recv,
                                 std::span<const Message<const float>> send,
                                 std::string what) const = 0;
  virtual Request start_exchange(Group group, int tag, std::span<const Message<double>> recv,
                                 std::span<const Message<const double>> send,
                                 std::string what) const = 0;

  // Makes progress on `r` without blocking; true (and `r` done) once complete. Local.
  bool test(Request& r) const;
  // Completes `r` (nothing to do for an empty one). Polls as the wait policy says, answering
  // other ranks' watchdog questions meanwhile. When the timeout passes, throws an Error (not
  // agreed: main ends the job) naming the operation, the step, the peers whose messages have not
  // arrived and the ranks that did not answer the watchdog. Local.
  void wait(Request& r) const;
  void wait_all(std::span<Request> requests) const;

  // A grid of `grid` over the same ranks (world rank order kept). Collective over the world
  // group; throws an agreed Error when grid.size() is not the number of ranks.
  virtual std::unique_ptr<Comm> make_grid(GridShape grid, WaitSettings wait) const = 0;
  // A 1x1x1 grid of this rank alone (single-rank reference runs). Local.
  virtual std::unique_ptr<Comm> make_single() const = 0;

 protected:
  Comm(GridShape shape, int rank, WaitSettings wait);

  // The watchdog's two halves. answer_watchdog() replies to other ranks' "are you there?"
  // (every wait calls it while it polls). silent_ranks() asks every other rank and returns
  // those that did not reply within `grace` seconds. Local.
  virtual void answer_watchdog() const = 0;
  virtual std::vector<int> silent_ranks(double grace) const = 0;
  // The same of another Comm (a wrapper forwards to the Comm it wraps).
  static void answer_watchdog_of(const Comm& c) { c.answer_watchdog(); }
  static std::vector<int> silent_ranks_of(const Comm& c, double grace) {
    return c.silent_ranks(grace);
  }

 private:
  [[noreturn]] void time_out(Request& r, double waited) const;

  GridShape shape_;
  GridCoords coords_;
  int rank_ = 0;
  WaitSettings wait_;
  std::int64_t step_ = -1;
};

}  // namespace tessera
