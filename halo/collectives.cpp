#include "tessera/collectives.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <utility>
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

std::vector<std::string> allgather(const Comm& comm, const std::string& text,
                                   const std::string& what) {
  // Every rank's length, then each text in its own slot of one buffer, summed (zeros elsewhere).
  const int size = comm.size(Group::world), rank = comm.rank(Group::world);
  std::vector<long long> lengths(static_cast<std::size_t>(size));
  Request r =
      comm.start_allgather(static_cast<long long>(text.size()), lengths, Group::world, what);
  comm.wait(r);
  std::vector<long long> offsets(static_cast<std::size_t>(size) + 1, 0);
  for (std::size_t k = 0; k < lengths.size(); ++k)
    offsets[k + 1] = offsets[k] + lengths[k];
  std::vector<int> bytes(static_cast<std::size_t>(offsets.back()), 0);
  for (std::size_t c = 0; c < text.size(); ++c)
    bytes[static_cast<std::size_t>(offsets[static_cast<std::size_t>(rank)]) + c] =
        static_cast<unsigned char>(text[c]);
  allreduce_sum(comm, std::span<int>(bytes), Group::world, what);
  std::vector<std::string> all;
  for (std::size_t k = 0; k < lengths.size(); ++k) {
    std::string t;
    for (long long c = offsets[k]; c < offsets[k + 1]; ++c)
      t += static_cast<char>(bytes[static_cast<std::size_t>(c)]);
    all.push_back(std::move(t));
  }
  return all;
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

namespace {

// Every rank's `mine`, in rank order. Collective over the world group.
std::vector<long long> allgather_world(const Comm& comm, long long mine, const std::string& what) {
  std::vector<long long> all(static_cast<std::size_t>(comm.size(Group::world)));
  Request r = comm.start_allgather(mine, all, Group::world, what);
  comm.wait(r);
  return all;
}

// A hash of `parts` in order, each preceded by its length (so "ab","c" differs from "a","bc").
long long hash_parts(const std::vector<std::string>& parts) {
  std::string text;
  for (const std::string& p : parts)
    text += std::to_string(p.size()) + ":" + p;
  return static_cast<long long>(hash_string(text));
}

// "rank 3", or "ranks 0-2, 5" for ranks in increasing order.
std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t k = 0; k < ranks.size();) {
    std::size_t end = k + 1;
    while (end < ranks.size() && ranks[end] == ranks[end - 1] + 1)
      ++end;
    text += (text.empty() ? "" : ", ") + std::to_string(ranks[k]);
    if (end - k > 1) text += "-" + std::to_string(ranks[end - 1]);
    k = end;
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + text;
}

// A value as the message shows it: "(not given)" for none, long ones cut.
std::string shown(const std::string& value) {
  if (value.empty()) return "(not given)";
  constexpr std::size_t kMax = 80;
  return value.size() <= kMax ? value : value.substr(0, kMax) + "...";
}

}  // namespace

void agree_on_fields(const Comm& comm, const std::vector<Field>& fields) {
  const std::string what = "agreement on the command and its options";
  std::vector<std::string> names{std::to_string(fields.size())}, values;
  for (const Field& f : fields) {
    names.push_back(f.name);
    values.push_back(f.value);
  }
  // Different names (or counts) mean different programs: nothing further can be compared safely.
  const std::vector<long long> name_hashes = allgather_world(comm, hash_parts(names), what);
  std::vector<int> differ;
  for (std::size_t k = 1; k < name_hashes.size(); ++k)
    if (name_hashes[k] != name_hashes[0]) differ.push_back(static_cast<int>(k));
  if (!differ.empty())
    throw Error("ranks disagree on which options they compare: " + rank_list(differ) +
                    " differ from rank 0 (is the tessera binary the same on every node?)",
                "collectives.cpp", /*agreed=*/true);
  const std::vector<long long> value_hashes = allgather_world(comm, hash_parts(values), what);
  if (std::all_of(value_hashes.begin(), value_hashes.end(),
                  [&](long long h) { return h == value_hashes[0]; }))
    return;
  // Which fields differ, and who holds what: every rank computes the same groups, so the
  // broadcasts below (one per distinct value shown) match on every rank.
  std::string message;
  for (const Field& f : fields) {
    const std::vector<long long> hashes = allgather_world(comm, hash_parts({f.value}), what);
    std::vector<long long> distinct;
    std::vector<std::vector<int>> holders;
    for (std::size_t r = 0; r < hashes.size(); ++r) {
      const auto at = std::find(distinct.begin(), distinct.end(), hashes[r]);
      if (at == distinct.end()) {
        distinct.push_back(hashes[r]);
        holders.push_back({static_cast<int>(r)});
      } else {
        holders[static_cast<std::size_t>(at - distinct.begin())].push_back(static_cast<int>(r));
      }
    }
    if (distinct.size() == 1) continue;
    constexpr std::size_t kShown = 4;
    std::string part = f.name + ":";
    for (std::size_t g = 0; g < std::min(kShown, holders.size()); ++g) {
      const int root = holders[g].front();
      std::string value = comm.rank() == root ? f.value : std::string();
      broadcast(comm, value, root);
      part += std::string(g == 0 ? " " : ", ") + rank_list(holders[g]) + " " + shown(value);
    }
    if (holders.size() > kShown)
      part += ", and " + std::to_string(holders.size() - kShown) + " other values";
    message += (message.empty() ? "" : "; ") + part;
  }
  throw Error("ranks disagree on " + message +
                  " (every rank must run the same command with the same options)",
              "collectives.cpp", /*agreed=*/true);
}

}  // namespace tessera
