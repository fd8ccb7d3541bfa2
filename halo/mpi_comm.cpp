#include "tessera/mpi_comm.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <thread>

#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"

namespace tessera {
namespace {

// Tags of the watchdog's communicator.
constexpr int kPing = 1, kAnswer = 2;

template <typename T>
MPI_Datatype mpi_type();
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
MPI_Datatype mpi_type<char>() {
  return MPI_CHAR;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  return MPI_SUM;
}

int mpi_count(std::int64_t n) {
  TESSERA_CHECK(n >= 0 && n <= INT_MAX,
                "a message of " + std::to_string(n) + " values is larger than MPI's int count");
  return static_cast<int>(n);
}

// MPI requests of one operation. Receives know their peer (a world rank) for the watchdog.
class MpiState final : public Request::State {
 public:
  explicit MpiState(bool collective) : collective_(collective) {}

  MPI_Request* add(int peer = -1) {
    requests_.push_back(MPI_REQUEST_NULL);
    peers_.push_back(peer);
    return &requests_.back();
  }
  void reserve(std::size_t n) {
    requests_.reserve(n);
    peers_.reserve(n);
  }
  // For an allgather: the value sent must outlive the call.
  long long& kept() { return kept_; }

  bool test() override {
    int done = 0;
    TESSERA_CHECK_MPI(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done,
                                  MPI_STATUSES_IGNORE));
    return done != 0;
  }
  std::vector<int> missing_peers() override {
    std::vector<int> missing;
    for (std::size_t k = 0; k < requests_.size(); ++k) {
      if (peers_[k] < 0 || requests_[k] == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Test(&requests_[k], &done, MPI_STATUS_IGNORE);
      if (!done) missing.push_back(peers_[k]);
    }
    std::sort(missing.begin(), missing.end());
    missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
    return missing;
  }
  bool release() noexcept override {
    // Point-to-point requests can be freed; a pending collective cannot (MPI forbids it): it is
    // left running, and this state (which may hold its send value) with it. The job is ending.
    if (collective_) return false;
    for (MPI_Request& r : requests_)
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    return true;
  }

 private:
  bool collective_;
  std::vector<MPI_Request> requests_;
  std::vector<int> peers_;
  long long kept_ = 0;
};

int rank_in(MPI_Comm c) {
  int rank = 0;
  TESSERA_CHECK_MPI(MPI_Comm_rank(c, &rank));
  return rank;
}

MPI_Comm returning_errors(MPI_Comm c) {
  if (c != MPI_COMM_NULL) TESSERA_CHECK_MPI(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN));
  return c;
}

}  // namespace

WaitPolicy MpiComm::detect_wait_policy(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  TESSERA_CHECK_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int on_node = 1;
  MPI_Comm_size(node, &on_node);
  MPI_Comm_free(&node);
  // Affinity masks may be per rank (srun --cpu-bind): the node has at least the largest.
  int cores = available_cores();
  TESSERA_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &cores, 1, MPI_INT, MPI_MAX, comm));
  return on_node > cores ? WaitPolicy::sleep : WaitPolicy::spin;
}

struct MpiComm::Watchdog {
  MPI_Comm comm = MPI_COMM_NULL;
  ~Watchdog() {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

MpiComm::MpiComm(MPI_Comm world, GridShape shape, WaitSettings settings)
    : MpiComm(world, shape, settings, nullptr) {}

MpiComm::MpiComm(MPI_Comm world, GridShape shape, WaitSettings settings,
                 std::shared_ptr<Watchdog> watchdog)
    : Comm(shape, rank_in(world), settings), watchdog_(std::move(watchdog)) {
  int size = 0;
  TESSERA_CHECK_MPI(MPI_Comm_size(world, &size));
  // The watchdog's channel comes first: the agreement below waits through the watchdog.
  if (!watchdog_) {
    watchdog_ = std::make_shared<Watchdog>();
    TESSERA_CHECK_MPI(MPI_Comm_dup(world, &watchdog_->comm));
    returning_errors(watchdog_->comm);
  }
  // Every rank compares its own grid with the job; ranks whose grids differ still agree, since
  // the reduction runs on the job's communicator.
  int ok = shape.size() == size ? 1 : 0;
  {
    auto s = std::make_unique<MpiState>(true);
    TESSERA_CHECK_MPI(
        MPI_Iallreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, watchdog_->comm, s->add()));
    Request r(std::move(s), "agreement on the grid");
    wait(r);
  }
  if (!ok) {
    throw Error("grid " + shape.str() + " has " + std::to_string(shape.size()) +
                    " ranks but the job has " + std::to_string(size) + " (run mpiexec -n " +
                    std::to_string(shape.size()) + ", or choose a grid whose product is " +
                    std::to_string(size) + ")",
                "mpi_comm.cpp", /*agreed=*/true);
  }
  int dims[3] = {shape.n, shape.h, shape.w};
  int periods[3] = {0, 0, 0};
  TESSERA_CHECK_MPI(MPI_Cart_create(world, 3, dims, periods, /*reorder=*/0, &cart_));
  returning_errors(cart_);
  const GridCoords& c = coords();
  TESSERA_CHECK_MPI(MPI_Comm_split(cart_, c.n, spatial_rank(c.i, c.j), &spatial_));
  TESSERA_CHECK_MPI(MPI_Comm_split(cart_, spatial_rank(c.i, c.j), c.n, &sample_));
  returning_errors(spatial_);
  returning_errors(sample_);
}

MpiComm::~MpiComm() {
  for (MPI_Comm* c : {&sample_, &spatial_, &cart_})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

MPI_Comm MpiComm::mpi(Group g) const {
  switch (g) {
    case Group::world:
      return cart_;
    case Group::spatial:
      return spatial_;
    case Group::sample:
      return sample_;
  }
  return cart_;
}

MPI_Comm mpi_comm(const Comm& comm, Group g) {
  const auto* m = dynamic_cast<const MpiComm*>(&comm.host());
  TESSERA_CHECK(m != nullptr, "this operation needs MPI communicators, and the grid has none");
  return m->mpi(g);
}

template <typename T>
Request MpiComm::allreduce(std::span<T> data, ReduceOp op, Group group, std::string what) const {
  auto s = std::make_unique<MpiState>(true);
  TESSERA_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, data.data(), mpi_count(std::ssize(data)),
                                   mpi_type<T>(), mpi_op(op), mpi(group), s->add()));
  return Request(std::move(s), std::move(what));
}

Request MpiComm::start_allreduce(std::span<float> d, ReduceOp op, Group g, std::string w) const {
  return allreduce(d, op, g, std::move(w));
}
Request MpiComm::start_allreduce(std::span<double> d, ReduceOp op, Group g, std::string w) const {
  return allreduce(d, op, g, std::move(w));
}
Request MpiComm::start_allreduce(std::span<long long> d, ReduceOp op, Group g,
                                 std::string w) const {
  return allreduce(d, op, g, std::move(w));
}
Request MpiComm::start_allreduce(std::span<int> d, ReduceOp op, Group g, std::string w) const {
  return allreduce(d, op, g, std::move(w));
}

template <typename T>
Request MpiComm::broadcast(std::span<T> data, int root, Group group, std::string what) const {
  auto s = std::make_unique<MpiState>(true);
  TESSERA_CHECK_MPI(MPI_Ibcast(data.data(), mpi_count(std::ssize(data)), mpi_type<T>(), root,
                               mpi(group), s->add()));
  return Request(std::move(s), std::move(what));
}

Request MpiComm::start_broadcast(std::span<char> d, int root, Group g, std::string w) const {
  return broadcast(d, root, g, std::move(w));
}
Request MpiComm::start_broadcast(std::span<long long> d, int root, Group g, std::string w) const {
  return broadcast(d, root, g, std::move(w));
}

Request MpiComm::start_allgather(const long long& mine, std::span<long long> all, Group group,
                                 std::string what) const {
  TESSERA_CHECK(std::ssize(all) == size(group), "allgather: one value per rank of the group");
  auto s = std::make_unique<MpiState>(true);
  s->kept() = mine;
  TESSERA_CHECK_MPI(MPI_Iallgather(&s->kept(), 1, MPI_LONG_LONG, all.data(), 1, MPI_LONG_LONG,
                                   mpi(group), s->add()));
  return Request(std::move(s), std::move(what));
}

template <typename T>
Request MpiComm::exchange(Group group, int tag, std::span<const Message<T>> recv,
                          std::span<const Message<const T>> send, std::string what) const {
  auto s = std::make_unique<MpiState>(false);
  s->reserve(recv.size() + send.size());
  const MPI_Comm c = mpi(group);
  try {
    for (const Message<T>& m : recv)
      TESSERA_CHECK_MPI(MPI_Irecv(m.data, mpi_count(m.count), mpi_type<T>(), m.peer, tag, c,
                                  s->add(world_rank(group, m.peer))));
    for (const Message<const T>& m : send)
      TESSERA_CHECK_MPI(
          MPI_Isend(m.data, mpi_count(m.count), mpi_type<T>(), m.peer, tag, c, s->add()));
  } catch (...) {
    s->release();  // what was posted before the failure
    throw;
  }
  return Request(std::move(s), std::move(what));
}

Request MpiComm::start_exchange(Group g, int tag, std::span<const Message<float>> recv,
                                std::span<const Message<const float>> send, std::string w) const {
  return exchange(g, tag, recv, send, std::move(w));
}
Request MpiComm::start_exchange(Group g, int tag, std::span<const Message<double>> recv,
                                std::span<const Message<const double>> send, std::string w) const {
  return exchange(g, tag, recv, send, std::move(w));
}

std::unique_ptr<Comm> MpiComm::make_grid(GridShape grid, WaitSettings wait) const {
  // Not make_unique: the constructor that shares the watchdog is private.
  return std::unique_ptr<Comm>(new MpiComm(cart_, grid, wait, watchdog_));
}

std::unique_ptr<Comm> MpiComm::make_single() const {
  return std::make_unique<MpiComm>(MPI_COMM_SELF, GridShape{1, 1, 1}, wait_settings());
}

void MpiComm::answer_watchdog() const {
  for (;;) {
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kPing, watchdog_->comm, &flag, &status) != MPI_SUCCESS || !flag)
      return;
    int question = 0;
    MPI_Recv(&question, 1, MPI_INT, status.MPI_SOURCE, kPing, watchdog_->comm, MPI_STATUS_IGNORE);
    static const int answer = 1;
    MPI_Request r = MPI_REQUEST_NULL;
    if (MPI_Isend(&answer, 1, MPI_INT, status.MPI_SOURCE, kAnswer, watchdog_->comm, &r) ==
        MPI_SUCCESS)
      MPI_Request_free(&r);
  }
}

std::vector<int> MpiComm::silent_ranks(double grace) const {
  // The watchdog's own size and rank: while a grid is being agreed on, its shape may not be the
  // job's.
  int size = 1, me = 0;
  MPI_Comm_size(watchdog_->comm, &size);
  MPI_Comm_rank(watchdog_->comm, &me);
  if (size == 1) return {};
  // Buffers of requests still pending at the end are left allocated: a late answer may land.
  auto* answers = new std::vector<int>(static_cast<std::size_t>(size), 0);
  std::vector<MPI_Request> asked(static_cast<std::size_t>(size), MPI_REQUEST_NULL);
  static const int question = 1;
  for (int r = 0; r < size; ++r) {
    if (r == me) continue;
    MPI_Request q = MPI_REQUEST_NULL;
    if (MPI_Isend(&question, 1, MPI_INT, r, kPing, watchdog_->comm, &q) == MPI_SUCCESS)
      MPI_Request_free(&q);
    MPI_Irecv(&(*answers)[r], 1, MPI_INT, r, kAnswer, watchdog_->comm, &asked[r]);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace);
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    answer_watchdog();
    MPI_Testall(size, asked.data(), &done, MPI_STATUSES_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<int> silent;
  for (int r = 0; r < size; ++r)
    if (asked[r] != MPI_REQUEST_NULL) {
      int answered = 0;
      MPI_Test(&asked[r], &answered, MPI_STATUS_IGNORE);
      if (!answered) {
        silent.push_back(r);
        MPI_Request_free(&asked[r]);
      }
    }
  if (silent.empty()) delete answers;
  return silent;
}

}  // namespace tessera
