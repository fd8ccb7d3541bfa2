// Blocking collectives on a Comm (each waits through Comm::wait, so each has the watchdog's
// deadline), and agreement on errors.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm.hpp"

namespace tessera {

// In-place reduction over `group`; `what` names it for the watchdog. Collective over `group`.
template <typename T>
void allreduce(const Comm& comm, std::span<T> data, ReduceOp op, Group group = Group::world,
               const std::string& what = "allreduce");
template <typename T>
void allreduce_sum(const Comm& comm, std::span<T> data, Group group = Group::world,
                   const std::string& what = "allreduce") {
  allreduce(comm, data, ReduceOp::sum, group, what);
}

// Returns the maximum / minimum / sum of `value` over `group`. Collective over `group`.
int allreduce_max(const Comm& comm, int value, Group group = Group::world);
int allreduce_min(const Comm& comm, int value, Group group = Group::world);
long long allreduce_sum(const Comm& comm, long long value, Group group = Group::world);

// Broadcasts `text` from rank `root` of `group`. Collective over `group`.
void broadcast(const Comm& comm, std::string& text, int root, Group group = Group::world);

// Every rank's `text`, in rank order, on every rank (any bytes, any lengths); `what` names it for
// the watchdog. Collective over the world group.
std::vector<std::string> allgather(const Comm& comm, const std::string& text,
                                   const std::string& what = "allgather");

// Runs `step` on every rank; if it throws on any rank, every rank throws an agreed Error with the
// message of the lowest failing rank (prefixed with that rank when there is more than one). Use it
// around every check a user can fail, so that a bad input ends all ranks with one message instead
// of a hang. `what` names the agreement for the watchdog ("checkpoint agreement"). Collective
// over the world group.
void agree(const Comm& comm, const std::function<void()>& step,
           const std::string& what = "agreement on errors");

// Checks that `value` (a description of the run: model, grid, shapes, build) is the same on every
// rank; otherwise every rank throws an agreed Error naming `what` and the ranks that differ from
// rank 0 (e.g. a model file that differs between nodes). Collective over the world group.
void check_same_everywhere(const Comm& comm, const std::string& what, const std::string& value);

// One item of what the ranks of a job must hold alike: its name as the user wrote it ("--dtype",
// "the command") and its value as text ("" when not given).
struct Field {
  std::string name;
  std::string value;
};

// Checks that every rank holds the same `fields` (names and values, in order); otherwise every
// rank throws the same agreed Error naming each field that differs and which ranks hold which
// value: "ranks disagree on --dtype: rank 0 float32, rank 1 float64". Safe to call first thing,
// whatever the other ranks run: it starts with two fixed-size allgathers of hashes (the field
// names, then the values), and only when those differ exchanges values, sizes first. Collective
// over the world group.
void agree_on_fields(const Comm& comm, const std::vector<Field>& fields);

}  // namespace tessera
