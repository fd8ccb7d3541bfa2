// One GPU per rank from its node-local rank (include/tessera/placement.hpp).
#include "tessera/placement.hpp"

#include <mpi.h>

#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera/mpi_comm.hpp"

namespace tessera {

NodeRank node_rank(const Comm& comm) {
  const MPI_Comm world = mpi_comm(comm, Group::world);
  MPI_Comm node = MPI_COMM_NULL;
  TESSERA_CHECK_MPI(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, comm.rank(Group::world),
                                        MPI_INFO_NULL, &node));
  NodeRank r;
  MPI_Comm_rank(node, &r.local_rank);
  MPI_Comm_size(node, &r.local_size);
  MPI_Comm_free(&node);
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  TESSERA_CHECK_MPI(MPI_Get_processor_name(host, &length));
  r.host.assign(host, static_cast<std::size_t>(length));
  return r;
}

GridShape default_grid(int ranks, int nodes, bool even_blocks) {
  if (nodes <= 1 || !even_blocks || ranks % nodes != 0) return {1, ranks, 1};
  return {nodes, ranks / nodes, 1};
}

GridShape default_grid(const Comm& comm) {
  const NodeRank me = node_rank(comm);
  // With L ranks on every node, they lie in consecutive blocks exactly when each rank's place on
  // its node is its world rank modulo L (the ranks below it fill the earlier blocks).
  const bool mine = me.local_rank == comm.rank(Group::world) % me.local_size;
  const int nodes =
      static_cast<int>(allreduce_sum(comm, static_cast<long long>(me.local_rank == 0)));
  const bool even_blocks =
      allreduce_min(comm, me.local_size) == allreduce_max(comm, me.local_size) &&
      allreduce_min(comm, mine) == 1;
  return default_grid(comm.size(Group::world), nodes, even_blocks);
}

int device_for(int local_rank, int local_size, int devices, bool share) {
  TESSERA_CHECK(devices > 0, "no usable GPU on this node for " + std::to_string(local_size) +
                                 " rank(s): run with --device cpu");
  if (local_size > devices && !share)
    throw Error(std::to_string(local_size) + " ranks on this node but " + std::to_string(devices) +
                " GPU(s): start one rank per GPU, or pass --share-devices to let ranks share "
                "them (halos then travel through host memory, not NCCL)");
  return local_rank % devices;
}

Placement place_on_device(const Comm& comm, bool share) {
  Placement p;
  p.node = node_rank(comm);
  agree(
      comm,
      [&] {
        const GpuInfo gpu = gpu_info();
        TESSERA_CHECK(gpu.built, "--device cuda: this build of tessera has no CUDA");
        TESSERA_CHECK(gpu.devices > 0, "--device cuda: no usable GPU on " + p.node.host + " (" +
                                           gpu.error + "): run with --device cpu");
        p.device = device_for(p.node.local_rank, p.node.local_size, gpu.devices, share);
        set_current_device(p.device);
      },
      "device placement");
  p.line = "rank " + std::to_string(comm.rank(Group::world)) + " -> " + p.node.host + " -> GPU " +
           std::to_string(p.device) + " (" + device_name(p.device) + ")";
  return p;
}

std::vector<std::string> placement_report(const Comm& comm, const Placement& mine) {
  // Through the Comm, so the report's waits have the watchdog's deadline: every rank's length,
  // then each line in its own slot of one buffer, summed.
  const int size = comm.size(Group::world), rank = comm.rank(Group::world);
  std::vector<long long> lengths(static_cast<std::size_t>(size));
  Request r = comm.start_allgather(static_cast<long long>(mine.line.size()), lengths, Group::world,
                                   "placement report");
  comm.wait(r);
  std::vector<long long> offsets(static_cast<std::size_t>(size) + 1, 0);
  for (int k = 0; k < size; ++k)
    offsets[static_cast<std::size_t>(k) + 1] =
        offsets[static_cast<std::size_t>(k)] + lengths[static_cast<std::size_t>(k)];
  std::vector<int> text(static_cast<std::size_t>(offsets.back()), 0);
  for (std::size_t c = 0; c < mine.line.size(); ++c)
    text[static_cast<std::size_t>(offsets[static_cast<std::size_t>(rank)]) + c] =
        static_cast<unsigned char>(mine.line[c]);
  allreduce_sum(comm, std::span<int>(text), Group::world, "placement report");
  std::vector<std::string> lines;
  if (rank != 0) return lines;
  for (int k = 0; k < size; ++k) {
    std::string line;
    for (long long c = offsets[static_cast<std::size_t>(k)];
         c < offsets[static_cast<std::size_t>(k) + 1]; ++c)
      line += static_cast<char>(text[static_cast<std::size_t>(c)]);
    lines.push_back(std::move(line));
  }
  return lines;
}

}  // namespace tessera
