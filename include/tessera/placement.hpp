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

// Where the ranks of one node compute: visible[k] lists the GPUs node-local rank k sees, by
// identity (GpuInfo::uuids), in its own numbering. Every rank of a node may see all of them (as
// under mpiexec or srun --gpus-per-node), or each its own (srun --gpus-per-task=1, or
// CUDA_VISIBLE_DEVICES set per rank), or any mix. As many ranks as can get a GPU of their own:
// rank k, in order, takes the first GPU it sees that no rank before it took (ranks that see all
// of a node's GPUs take GPU k, ranks that see one each take that one), and where none is left,
// one whose holder can move to another GPU it sees (a bipartite matching). The others: with
// `share`, each the GPU it sees that serves the fewest ranks (the first among equals: ranks
// dealt out in turn); else an Error naming the node's ranks and GPUs. An Error too where a rank
// sees no GPU. Local; pure.
struct DeviceAssignment {
  std::vector<int> device;  // per node-local rank: the index of its GPU in its own numbering
  bool shared = false;      // some GPU of the node serves more than one rank
};
DeviceAssignment assign_devices(const std::vector<std::vector<std::string>>& visible, bool share);

// The GPUs every rank of this rank's node sees (`mine`: this rank's, GpuInfo::uuids), in
// node-local rank order: the ranks whose host is `me.host`. Collective over the world group.
std::vector<std::vector<std::string>> node_devices(const Comm& comm, const NodeRank& me,
                                                   const std::vector<std::string>& mine);

struct Placement {
  NodeRank node;
  int device = -1;
  bool shared = false;  // this node's assignment has a GPU serving two ranks (no NCCL then)
  // "rank 3 -> node7 -> GPU 1 (NVIDIA H100 80GB HBM3, GPU-8d3f05a1-...)"
  std::string line;
};

// Picks this rank's device with assign_devices from what every rank of its node sees and makes it
// current. A failure on any rank (no GPU, too few without share) is an agreed Error on every rank.
// Collective over the world group.
Placement place_on_device(const Comm& comm, bool share);

// Every rank's placement line, in rank order, on rank 0 (empty elsewhere). Collective over the
// world group.
std::vector<std::string> placement_report(const Comm& comm, const Placement& mine);

}  // namespace tessera
