#include "tessera/wait.hpp"

#include <sched.h>

#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"

namespace tessera {
namespace {

std::atomic<WaitPolicy> g_policy{WaitPolicy::spin};

// Measured here (DESIGN.md): 20 us between polls keeps latency low and leaves the core to
// the rank that has work.
constexpr auto kPollSleep = std::chrono::microseconds(20);

}  // namespace

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

WaitPolicy parse_wait_policy(const std::string& text) {
  if (text == "spin") return WaitPolicy::spin;
  if (text == "sleep") return WaitPolicy::sleep;
  throw Error("bad wait policy '" + text + "': expected spin or sleep");
}

const char* to_string(WaitPolicy p) {
  return p == WaitPolicy::spin ? "spin" : "sleep";
}

WaitPolicy detect_wait_policy(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  TESSERA_CHECK_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int on_node = 1;
  MPI_Comm_size(node, &on_node);
  MPI_Comm_free(&node);
  // Affinity masks may be per rank (srun --cpu-bind): the node has at least the largest.
  const int cores = allreduce_max(available_cores(), comm);
  WaitPolicy p = on_node > cores ? WaitPolicy::sleep : WaitPolicy::spin;
  if (const char* env = std::getenv("TESSERA_WAIT"); env != nullptr && *env != '\0') {
    p = parse_wait_policy(env);
  }
  return p;
}

void set_wait_policy(WaitPolicy p) {
  g_policy.store(p);
}
WaitPolicy wait_policy() {
  return g_policy.load();
}

void wait_all(std::span<MPI_Request> requests) {
  if (requests.empty()) return;
  const int count = static_cast<int>(requests.size());
  if (g_policy.load() == WaitPolicy::spin) {
    TESSERA_CHECK_MPI(MPI_Waitall(count, requests.data(), MPI_STATUSES_IGNORE));
    return;
  }
  for (;;) {
    int done = 0;
    TESSERA_CHECK_MPI(MPI_Testall(count, requests.data(), &done, MPI_STATUSES_IGNORE));
    if (done) return;
    std::this_thread::sleep_for(kPollSleep);
  }
}

}  // namespace tessera
