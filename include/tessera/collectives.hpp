// Collectives that wait through wait_all, and agreement on errors.
#pragma once

#include <mpi.h>

#include <functional>
#include <span>
#include <string>

namespace tessera {

template <typename T>
MPI_Datatype mpi_type();

// In-place SUM over `comm`. Collective over `comm`.
template <typename T>
void allreduce_sum(std::span<T> data, MPI_Comm comm);

// In-place elementwise MAX over `comm`. Collective over `comm`.
void allreduce_max(std::span<double> data, MPI_Comm comm);

// Returns the maximum / minimum of `value` over `comm`. Collective over `comm`.
int allreduce_max(int value, MPI_Comm comm);
int allreduce_min(int value, MPI_Comm comm);
long long allreduce_sum(long long value, MPI_Comm comm);

// Broadcasts `text` from `root`. Collective over `comm`.
void broadcast(std::string& text, int root, MPI_Comm comm);

// Runs `step` on every rank of `comm`; if it throws on any rank, every rank throws an agreed
// Error with the message of the lowest failing rank (prefixed with that rank when the
// communicator has more than one). Use it around every check a user can fail, so that a bad
// input ends all ranks with one message instead of a hang. Collective over `comm`.
void agree(MPI_Comm comm, const std::function<void()>& step);

// Checks that `value` (a description of the run: model, grid, shapes, build) is the same on every
// rank; otherwise every rank throws an agreed Error naming `what` and the ranks that differ from
// rank 0 (e.g. a model file that differs between nodes). Collective over `comm`.
void check_same_everywhere(const std::string& what, const std::string& value, MPI_Comm comm);

}  // namespace tessera
