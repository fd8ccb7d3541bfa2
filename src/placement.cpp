// One GPU per rank from its node-local rank (include/tessera/placement.hpp).
#include "tessera/placement.hpp"

#include <mpi.h>

#include <algorithm>
#include <map>
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

DeviceAssignment assign_devices(const std::vector<std::vector<std::string>>& visible, bool share) {
  const int ranks = static_cast<int>(visible.size());
  std::vector<std::string> gpus;  // the node's GPUs, as first seen
  for (int k = 0; k < ranks; ++k) {
    const std::vector<std::string>& seen = visible[static_cast<std::size_t>(k)];
    TESSERA_CHECK(!seen.empty(), "no usable GPU on this node for node-local rank " +
                                     std::to_string(k) + " of " + std::to_string(ranks) +
                                     ": run with --device cpu");
    for (const std::string& id : seen)
      if (std::find(gpus.begin(), gpus.end(), id) == gpus.end()) gpus.push_back(id);
  }
  // A GPU of its own for as many ranks as can have one: rank k takes the first free GPU it sees,
  // or, where none is, one whose holder can move to another (an augmenting path of a bipartite
  // matching: rank 0 seeing GPUs a and b and rank 1 only a give rank 0 b).
  DeviceAssignment out;
  out.device.assign(static_cast<std::size_t>(ranks), -1);
  std::map<std::string, int> holder;  // a GPU's own rank
  std::map<std::string, bool> visited;
  const auto take = [&](auto& self, int r) -> bool {
    const std::vector<std::string>& seen = visible[static_cast<std::size_t>(r)];
    for (std::size_t d = 0; d < seen.size(); ++d)
      if (!holder.contains(seen[d])) {
        holder[seen[d]] = r;
        out.device[static_cast<std::size_t>(r)] = static_cast<int>(d);
        return true;
      }
    for (std::size_t d = 0; d < seen.size(); ++d)
      if (!std::exchange(visited[seen[d]], true) && self(self, holder[seen[d]])) {
        holder[seen[d]] = r;  // its holder moved to another GPU
        out.device[static_cast<std::size_t>(r)] = static_cast<int>(d);
        return true;
      }
    return false;
  };
  std::map<std::string, int> served;  // ranks per GPU
  std::vector<int> left;              // ranks without a GPU of their own
  for (int k = 0; k < ranks; ++k) {
    visited.clear();
    if (!take(take, k)) left.push_back(k);
  }
  for (const auto& [id, rank] : holder)
    served[id] = 1;
  for (int k : left) {
    const std::vector<std::string>& seen = visible[static_cast<std::size_t>(k)];
    if (!share) {
      if (static_cast<int>(gpus.size()) < ranks)
        throw Error(std::to_string(ranks) + " ranks on this node but " +
                    std::to_string(gpus.size()) +
                    " GPU(s): start one rank per GPU, or pass --share-devices to let ranks "
                    "share them (halos then travel through host memory, not NCCL)");
      std::string ids;
      for (const std::string& id : seen)
        ids += (ids.empty() ? "" : ", ") + id;
      throw Error("node-local rank " + std::to_string(k) + " sees only " + ids +
                  ", which other ranks took, though the node has " + std::to_string(gpus.size()) +
                  " GPUs for its " + std::to_string(ranks) +
                  " ranks: CUDA_VISIBLE_DEVICES (or the launcher's GPU binding) gives two ranks "
                  "the same GPU; give each its own, or pass --share-devices");
    }
    // Shared: the GPU it sees that serves the fewest ranks (the first among equals).
    std::size_t pick = 0;
    for (std::size_t d = 1; d < seen.size(); ++d)
      if (served[seen[d]] < served[seen[pick]]) pick = d;
    ++served[seen[pick]];
    out.device[static_cast<std::size_t>(k)] = static_cast<int>(pick);
    out.shared = true;
  }
  return out;
}

std::vector<std::vector<std::string>> node_devices(const Comm& comm, const NodeRank& me,
                                                   const std::vector<std::string>& mine) {
  // One line per rank: its host, then the GPUs it sees, one a line (neither holds a newline).
  std::string text = me.host;
  for (const std::string& id : mine)
    text += "\n" + id;
  std::vector<std::vector<std::string>> node;
  for (const std::string& rank : allgather(comm, text, "device placement")) {
    std::vector<std::string> fields;
    std::size_t at = 0;
    for (std::size_t end; (end = rank.find('\n', at)) != std::string::npos; at = end + 1)
      fields.push_back(rank.substr(at, end - at));
    fields.push_back(rank.substr(at));
    if (fields.front() != me.host) continue;
    node.emplace_back(fields.begin() + 1, fields.end());
  }
  // The world's ranks on this host, in world order, are the node's in node-local order
  // (node_rank's split keys them by world rank), unless two nodes report one host name.
  TESSERA_CHECK(static_cast<int>(node.size()) == me.local_size,
                "device placement: " + std::to_string(node.size()) + " ranks report host '" +
                    me.host + "', whose node holds " + std::to_string(me.local_size) +
                    ": do two nodes share a host name?");
  return node;
}

Placement place_on_device(const Comm& comm, bool share) {
  Placement p;
  p.node = node_rank(comm);
  GpuInfo gpu;
  agree(
      comm,
      [&] {
        gpu = gpu_info();
        TESSERA_CHECK(gpu.built, "--device cuda: this build of tessera has no CUDA");
        TESSERA_CHECK(gpu.devices > 0, "--device cuda: no usable GPU on " + p.node.host + " (" +
                                           gpu.error + "): run with --device cpu");
      },
      "device placement");
  std::vector<std::vector<std::string>> node;
  agree(
      comm, [&] { node = node_devices(comm, p.node, gpu.uuids); }, "device placement");
  agree(
      comm,
      [&] {
        const DeviceAssignment a = assign_devices(node, share);
        p.device = a.device[static_cast<std::size_t>(p.node.local_rank)];
        p.shared = a.shared;
        set_current_device(p.device);
      },
      "device placement");
  p.line = "rank " + std::to_string(comm.rank(Group::world)) + " -> " + p.node.host + " -> GPU " +
           std::to_string(p.device) + " (" + device_name(p.device) + ", " +
           gpu.uuids[static_cast<std::size_t>(p.device)] + ")";
  return p;
}

std::vector<std::string> placement_report(const Comm& comm, const Placement& mine) {
  std::vector<std::string> lines = allgather(comm, mine.line, "placement report");
  if (comm.rank(Group::world) != 0) lines.clear();
  return lines;
}

}  // namespace tessera
