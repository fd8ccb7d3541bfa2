#include "tessera/comm.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

#include "tessera/error.hpp"
#include "tessera/profile.hpp"

namespace tessera {
namespace {

// Measured here (README "Waiting for messages"): 20 us between polls keeps latency low and
// leaves the core to the rank that has work.
constexpr auto kPollSleep = std::chrono::microseconds(20);
// Spinning ranks look at the clock and the watchdog's questions every this many polls.
constexpr std::uint64_t kSpinPolls = 64;

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks)
    s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

std::string seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", s);
  return text;
}

}  // namespace

const char* to_string(Group g) {
  switch (g) {
    case Group::world:
      return "world";
    case Group::spatial:
      return "spatial";
    case Group::sample:
      return "sample";
  }
  return "?";
}

WaitPolicy parse_wait_policy(const std::string& text) {
  if (text == "spin") return WaitPolicy::spin;
  if (text == "sleep") return WaitPolicy::sleep;
  throw Error("bad wait policy '" + text + "': expected spin or sleep");
}

const char* to_string(WaitPolicy p) {
  return p == WaitPolicy::spin ? "spin" : "sleep";
}

double check_timeout(double s) {
  // Above 1e9 s (31 years) the deadline would overflow the clock's nanoseconds.
  TESSERA_CHECK(std::isfinite(s) && s > 0 && s <= 1e9,
                "bad timeout " + seconds(s) + ": expected a number of seconds > 0 and at most 1e9");
  return s;
}

Comm::Comm(GridShape shape, int rank, WaitSettings wait) : shape_(shape), rank_(rank), wait_(wait) {
  coords_ = coords_of(rank);
}

GridCoords Comm::coords_of(int r) const {
  const int hw = shape_.h * shape_.w;
  return {r / hw, (r % hw) / shape_.w, r % shape_.w};
}

int Comm::rank(Group g) const {
  switch (g) {
    case Group::world:
      return rank_;
    case Group::spatial:
      return spatial_rank(coords_.i, coords_.j);
    case Group::sample:
      return coords_.n;
  }
  return 0;
}

int Comm::size(Group g) const {
  switch (g) {
    case Group::world:
      return shape_.size();
    case Group::spatial:
      return shape_.h * shape_.w;
    case Group::sample:
      return shape_.n;
  }
  return 1;
}

int Comm::world_rank(Group g, int r) const {
  const int hw = shape_.h * shape_.w;
  switch (g) {
    case Group::world:
      return r;
    case Group::spatial:
      return coords_.n * hw + r;
    case Group::sample:
      return r * hw + spatial_rank(coords_.i, coords_.j);
  }
  return r;
}

bool Comm::test(Request& r) const {
  if (!r.state_) return true;
  if (!r.state_->test()) return false;
  r.state_.reset();
  return true;
}

void Comm::wait(Request& r) const {
  wait_all(std::span<Request>(&r, 1));
}

void Comm::wait_all(std::span<Request> requests) const {
  using clock = std::chrono::steady_clock;
  const clock::time_point start = clock::now();
  const bool bounded = std::isfinite(wait_.timeout);
  const clock::time_point deadline = bounded
                                         ? start + std::chrono::duration_cast<clock::duration>(
                                                       std::chrono::duration<double>(wait_.timeout))
                                         : clock::time_point::max();
  // Looks at the clock are microseconds apart while the rank runs: a long gap is time it was
  // stopped or not scheduled, which the straggler monitor must not read as waiting for a peer.
  clock::time_point looked = start;
  const auto look = [&looked] {
    const clock::time_point now = clock::now();
    if (const double gap = std::chrono::duration<double>(now - looked).count();
        gap >= kStallSeconds)
      add_stalled(gap);
    looked = now;
    return now;
  };
  std::size_t next = 0;  // requests before it are complete
  for (std::uint64_t polls = 1;; ++polls) {
    while (next < requests.size() && test(requests[next]))
      ++next;
    if (next == requests.size()) {
      look();  // a rank stopped in its first test finds everything arrived
      return;
    }
    if (wait_.policy == WaitPolicy::sleep)
      std::this_thread::sleep_for(kPollSleep);
    else if (polls % kSpinPolls != 0)
      continue;
    answer_watchdog();
    const clock::time_point now = look();
    if (bounded && now >= deadline)
      time_out(requests[next], std::chrono::duration<double>(now - start).count());
  }
}

void Comm::time_out(Request& r, double waited) const {
  // The request stays with its owner, pending: its destructor releases it, and owners of pending
  // requests keep their buffers (an operation in flight may still write to them).
  const std::vector<int> missing = r.state_->missing_peers();
  // Long enough for a live rank that is itself waiting to answer; short next to the timeout.
  const double grace = std::min(5.0, std::max(0.5, wait_.timeout / 4));
  const std::vector<int> silent = silent_ranks(grace);
  std::string m = "timeout: rank " + std::to_string(rank_) + " waited " + seconds(waited) +
                  " s for the " + r.what();
  if (step_ >= 0) m += " at step " + std::to_string(step_);
  if (!missing.empty()) m += "; no message yet from rank(s) " + rank_list(missing);
  if (!silent.empty())
    m += "; rank(s) " + rank_list(silent) + " did not answer the watchdog within " +
         seconds(grace) + " s (stopped, hung or dead)";
  else if (size(Group::world) > 1)
    m += "; every other rank answered the watchdog (a rank is slow, or ranks run different "
         "commands)";
  m += ". Ending the job (--timeout " + seconds(wait_.timeout) + " s)";
  throw Error(m, fatal);
}

}  // namespace tessera
