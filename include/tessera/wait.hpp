// The one place Tessera waits for MPI. With more ranks than cores, MPICH's busy polling makes
// every blocking wait cost 5-25 ms (DESIGN.md "Waiting"); polling MPI_Testall with a short
// sleep between polls costs microseconds instead.
#pragma once

#include <mpi.h>

#include <span>
#include <string>

namespace tessera {

enum class WaitPolicy { spin, sleep };

// Cores this process may run on (its affinity mask; srun --cpu-bind narrows it). Local.
int available_cores();

WaitPolicy parse_wait_policy(const std::string& text);  // "spin" | "sleep"; local
const char* to_string(WaitPolicy p);

// Picks `sleep` when this node runs more ranks of `comm` than it has cores available, else
// `spin`. The environment variable TESSERA_WAIT=spin|sleep overrides. Collective over `comm`.
WaitPolicy detect_wait_policy(MPI_Comm comm);

// The process-wide policy used by wait_all (default: spin). Local.
void set_wait_policy(WaitPolicy p);
WaitPolicy wait_policy();

// Completes every request (MPI_REQUEST_NULL entries are fine). Local.
void wait_all(std::span<MPI_Request> requests);
inline void wait(MPI_Request& r) {
  wait_all(std::span<MPI_Request>(&r, 1));
}

}  // namespace tessera
