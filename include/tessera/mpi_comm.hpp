// The MPI implementation of Comm: the grid's communicators (a Cartesian world with ranks in
// order, spatial and sample splits) and a private one for the watchdog. Every communicator
// returns errors (MPI_ERRORS_RETURN), so an MPI failure becomes a Tessera Error. Only the
// drivers (main, tests, parallel HDF5) include this header: layers and the model see a Comm.
#pragma once

#include <mpi.h>

#include <memory>

#include "tessera/comm.hpp"

namespace tessera {

class MpiComm final : public Comm {
 public:
  // The grid `shape` over the ranks of `world` (ranks not reordered: grid rank = rank in world).
  // Collective over `world`; throws an agreed Error when shape.size() is not its size.
  MpiComm(MPI_Comm world, GridShape shape, WaitSettings wait);
  // Grids made from this one (make_grid) share its watchdog channel, so a rank waiting on any
  // of them answers a question asked on another.
  ~MpiComm() override;

  // The wait policy that suits this node: sleep when it runs more ranks of `comm` than it has
  // cores available, else spin. Collective over `comm` (it runs before any Comm exists).
  static WaitPolicy detect_wait_policy(MPI_Comm comm);

  // The communicator of a group (for parallel HDF5). Local.
  MPI_Comm mpi(Group g) const;

  Request start_allreduce(std::span<float> data, ReduceOp op, Group group,
                          std::string what) const override;
  Request start_allreduce(std::span<double> data, ReduceOp op, Group group,
                          std::string what) const override;
  Request start_allreduce(std::span<long long> data, ReduceOp op, Group group,
                          std::string what) const override;
  Request start_allreduce(std::span<int> data, ReduceOp op, Group group,
                          std::string what) const override;
  Request start_broadcast(std::span<char> data, int root, Group group,
                          std::string what) const override;
  Request start_broadcast(std::span<long long> data, int root, Group group,
                          std::string what) const override;
  Request start_allgather(const long long& mine, std::span<long long> all, Group group,
                          std::string what) const override;
  Request start_exchange(Group group, int tag, std::span<const Message<float>> recv,
                         std::span<const Message<const float>> send,
                         std::string what) const override;
  Request start_exchange(Group group, int tag, std::span<const Message<double>> recv,
                         std::span<const Message<const double>> send,
                         std::string what) const override;

  std::unique_ptr<Comm> make_grid(GridShape grid, WaitSettings wait) const override;
  std::unique_ptr<Comm> make_single() const override;

 protected:
  void answer_watchdog() const override;
  std::vector<int> silent_ranks(double grace) const override;

 private:
  struct Watchdog;
  MpiComm(MPI_Comm world, GridShape shape, WaitSettings wait, std::shared_ptr<Watchdog> watchdog);
  template <typename T>
  Request allreduce(std::span<T> data, ReduceOp op, Group group, std::string what) const;
  template <typename T>
  Request broadcast(std::span<T> data, int root, Group group, std::string what) const;
  template <typename T>
  Request exchange(Group group, int tag, std::span<const Message<T>> recv,
                   std::span<const Message<const T>> send, std::string what) const;

  MPI_Comm cart_ = MPI_COMM_NULL;
  MPI_Comm spatial_ = MPI_COMM_NULL;
  MPI_Comm sample_ = MPI_COMM_NULL;
  // A duplicate of the first grid's world, for pings and their answers only.
  std::shared_ptr<Watchdog> watchdog_;
};

// The MPI communicator of group `g` behind `comm`. Local; throws an Error when `comm` is not an
// MpiComm (parallel HDF5 needs MPI).
MPI_Comm mpi_comm(const Comm& comm, Group g);

}  // namespace tessera
