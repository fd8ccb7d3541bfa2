#include "tessera/collectives.hpp"

#include <climits>
#include <cstdint>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/profile.hpp"
#include "tessera/random.hpp"
#include "tessera/wait.hpp"

namespace tessera {

template <>
MPI_Datatype mpi_type<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype mpi_type<double>() {
  return MPI_DOUBLE;
}
template <>
MPI_Datatype mpi_type<int>() {
  return MPI_INT;
}
template <>
MPI_Datatype mpi_type<long long>() {
  return MPI_LONG_LONG;
}
template <>
MPI_Datatype mpi_type<std::int64_t>() {
  return MPI_INT64_T;
}

template <typename T>
void allreduce_sum(std::span<T> data, MPI_Comm comm) {
  if (data.empty()) return;
  MPI_Request r = MPI_REQUEST_NULL;
  TESSERA_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, data.data(), static_cast<int>(data.size()),
                                   mpi_type<T>(), MPI_SUM, comm, &r));
  Timed timed(Activity::allreduce);
  wait(r);
}

template void allreduce_sum<float>(std::span<float>, MPI_Comm);
template void allreduce_sum<double>(std::span<double>, MPI_Comm);
template void allreduce_sum<long long>(std::span<long long>, MPI_Comm);

void allreduce_max(std::span<double> data, MPI_Comm comm) {
  if (data.empty()) return;
  MPI_Request r = MPI_REQUEST_NULL;
  TESSERA_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, data.data(), static_cast<int>(data.size()),
                                   MPI_DOUBLE, MPI_MAX, comm, &r));
  wait(r);
}

namespace {

int allreduce_int(int value, MPI_Op op, MPI_Comm comm) {
  MPI_Request r = MPI_REQUEST_NULL;
  TESSERA_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, &value, 1, MPI_INT, op, comm, &r));
  wait(r);
  return value;
}

}  // namespace

int allreduce_max(int value, MPI_Comm comm) {
  return allreduce_int(value, MPI_MAX, comm);
}
int allreduce_min(int value, MPI_Comm comm) {
  return allreduce_int(value, MPI_MIN, comm);
}

long long allreduce_sum(long long value, MPI_Comm comm) {
  allreduce_sum(std::span<long long>(&value, 1), comm);
  return value;
}

void broadcast(std::string& text, int root, MPI_Comm comm) {
  long long length = static_cast<long long>(text.size());
  MPI_Request r = MPI_REQUEST_NULL;
  TESSERA_CHECK_MPI(MPI_Ibcast(&length, 1, MPI_LONG_LONG, root, comm, &r));
  wait(r);
  text.resize(static_cast<std::size_t>(length));
  if (length == 0) return;
  TESSERA_CHECK_MPI(MPI_Ibcast(text.data(), static_cast<int>(length), MPI_CHAR, root, comm, &r));
  wait(r);
}

void agree(MPI_Comm comm, const std::function<void()>& step) {
  std::string message;
  std::string where;
  bool failed = false;
  try {
    step();
  } catch (const Error& e) {
    failed = true;
    message = e.what();
    where = e.where();
  } catch (const std::exception& e) {
    failed = true;
    message = e.what();
  }
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const int first = allreduce_min(failed ? rank : INT_MAX, comm);
  if (first == INT_MAX) return;
  broadcast(message, first, comm);
  broadcast(where, first, comm);
  if (size > 1 && first != 0) message = "rank " + std::to_string(first) + ": " + message;
  throw Error(message, where, /*agreed=*/true);
}

void check_same_everywhere(const std::string& what, const std::string& value, MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  const long long mine = static_cast<long long>(hash_string(value));
  std::vector<long long> all(static_cast<std::size_t>(size));
  MPI_Request r = MPI_REQUEST_NULL;
  TESSERA_CHECK_MPI(
      MPI_Iallgather(&mine, 1, MPI_LONG_LONG, all.data(), 1, MPI_LONG_LONG, comm, &r));
  wait(r);
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
