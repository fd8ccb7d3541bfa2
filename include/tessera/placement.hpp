// Which GPU each rank computes on: one per rank, chosen from the rank's place among the ranks of
// its node (MPI_COMM_TYPE_SHARED: the same under srun and mpiexec, whatever their rank order),
// and the start-up report of where every rank runs.
#pragma once

#include <string>
#include <vector>

#include "tessera/comm.hpp"

namespace tessera {

// This rank among the ranks sharing its node's memory.
struct NodeRank {
  int local_rank = 0;
  int local_size = 1;
  std::string host;
};

// Collective over the world group of `comm`.
NodeRank node_rank(const Comm& comm);

// The grid of a job run without --grid: 1xPx1 when its P ranks share one node (the image cut
// into bands of rows: halos are whole rows, and border strips whole rows, which the narrow
// kernels vectorise over; columns were 4% slower on unet-small's 2-rank step, README "The
// grid"). When they fill `nodes` nodes evenly and in blocks (each node's ranks consecutive, as
// srun and mpiexec place them by default), one data-parallel group per node whose ranks tile the
// image (nodes x P/nodes x 1): halos then stay within a node and only the gradient sums cross the
// network. 1xPx1 otherwise. Local; pure.
GridShape default_grid(int ranks, int nodes, bool even_blocks);
// The same for the job of `comm`, from where its ranks run. Collective over the world group.
GridShape default_grid(const Comm& comm);

// The device of node-local rank `local_rank` of `local_size` on a node with `devices` GPUs: its own
// (device local_rank) when there are enough; with `share`, local_rank % devices. Throws an Error
// naming the counts when the node has no GPU, or fewer GPUs than ranks without `share`. Local;
// pure.
int device_for(int local_rank, int local_size, int devices, bool share);

struct Placement {
  NodeRank node;
  int device = -1;
  std::string line;  // "rank 3 -> node7 -> GPU 1 (NVIDIA H100 80GB HBM3)"
};

// Picks this rank's device with device_for and makes it current. A failure on any rank (no GPU,
// too few without share) is an agreed Error on every rank. Collective over the world group.
Placement place_on_device(const Comm& comm, bool share);

// Every rank's placement line, in rank order, on rank 0 (empty elsewhere). Collective over the
// world group.
std::vector<std::string> placement_report(const Comm& comm, const Placement& mine);

}  // namespace tessera
