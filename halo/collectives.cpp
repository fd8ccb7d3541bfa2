#include "tessera/collectives.hpp"

#include <climits>
#include <cstdint>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/profile.hpp"
#include "tessera/random.hpp"

namespace tessera {

template <typename T>
void allreduce(const Comm& comm, std::span<T> data, ReduceOp op, Group group,
               const std::string& what) {
  if (data.empty()) return;
  Request r = comm.start_allreduce(data, op, group, what);
  Timed timed(Activity::allreduce);
  comm.wait(r);
}

template void allreduce<float>(const Comm&, std::span<float>, ReduceOp, Group, const std::string&);
template void allreduce<double>(const Comm&, std::span<double>, ReduceOp, Group,
                                const std::string&);
template void allreduce<long long>(const Comm&, std::span<long long>, ReduceOp, Group,
                                   const std::string&);
template void allreduce<int>(const Comm&, std::span<int>, ReduceOp, Group, const std::string&);

int allreduce_max(const Comm& comm, int value, Group group) {
  allreduce(comm, std::span<int>(&value, 1), ReduceOp::max, group);
  return value;
}
int allreduce_min(const Comm& comm, int value, Group group) {
  allreduce(comm, std::span<int>(&value, 1), ReduceOp::min, group);
  return value;
}
long long allreduce_sum(const Comm& comm, long long value, Group group) {
  allreduce(comm, std::span<long long>(&value, 1), ReduceOp::sum, group);
  return value;
}

void broadcast(const Comm& comm, std::string& text, int root, Group group) {
  long long length = static_cast<long long>(text.size());
  Request r = comm.start_broadcast(std::span<long long>(&length, 1), root, group, "broadcast");
  comm.wait(r);
  text.resize(static_cast<std::size_t>(length));
  if (length == 0) return;
  r = comm.start_broadcast(std::span<char>(text.data(), text.size()), root, group, "broadcast");
  comm.wait(r);
}

void agree(const Comm& comm, const std::function<void()>& step, const std::string& what) {
  std::string message;
  std::string where;
  bool failed = false;
  try {
    step();
  } catch (const Error& e) {
    // A timeout is not a disagreement to settle: the peers it waited for may never answer.
    if (!e.agreed() && e.fatal()) throw;
    failed = true;
    message = e.what();
    where = e.where();
  } catch (const std::exception& e) {
    failed = true;
    message = e.what();
  }
  int first = failed ? comm.rank() : INT_MAX;
  allreduce(comm, std::span<int>(&first, 1), ReduceOp::min, Group::world, what);
  if (first == INT_MAX) return;
  broadcast(comm, message, first);
  broadcast(comm, where, first);
  if (comm.size(Group::world) > 1 && first != 0)
    message = "rank " + std::to_string(first) + ": " + message;
  throw Error(message, where, /*agreed=*/true);
}

void check_same_everywhere(const Comm& comm, const std::string& what, const std::string& value) {
  const int size = comm.size(Group::world);
  const long long mine = static_cast<long long>(hash_string(value));
  std::vector<long long> all(static_cast<std::size_t>(size));
  Request r = comm.start_allgather(mine, all, Group::world, "agreement on the " + what);
  comm.wait(r);
  std::string differ;
  for (int k = 1; k < size; ++k)
    if (all[k] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(k);
  if (!differ.empty())
    throw Error("the ranks disagree on the " + what + ": rank(s) " + differ +
                    " differ from rank 0 (are the files and the tessera binary the same on every "
                    "node?)",
                "collectives.cpp", /*agreed=*/true);
}

}  // namespace tessera
