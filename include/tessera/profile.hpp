// Where a rank's time goes: every place that moves halos, waits for messages or reduces over
// ranks adds its wall time to one process-wide account, so `tessera bench` can split a layer's
// time into compute and communication without the layers knowing about it. Local; not thread
// safe (a rank's engine runs on one thread; the kernels' own threads never call these).
#pragma once

#include <array>
#include <chrono>

namespace tessera {

enum class Activity {
  window,     // assembling a halo layer's window from its own tile: the local copy and the zero
              // padding (local work that a single rank does too)
  halo,       // packing, posting and unpacking halo messages (CPU work of the exchange)
  waiting,    // blocked until halo messages arrive: the part of the exchange not hidden
  allreduce,  // blocked in reductions over ranks: gradients, batch norm statistics, the loss
};
inline constexpr int kActivities = 4;

struct ActivityTimes {
  std::array<double, kActivities> seconds{};
  // Of `waiting` and `allreduce`: the time this rank was not running while it waited (stopped,
  // swapped out or unscheduled for kStallSeconds or more at once). Its own delay, not a peer's:
  // the straggler monitor of `tessera train` takes it out of the rank's waiting.
  double stalled = 0;

  double operator[](Activity a) const { return seconds[static_cast<int>(a)]; }
  // Everything but compute: window assembly and communication.
  double overhead() const { return seconds[0] + seconds[1] + seconds[2] + seconds[3]; }
  ActivityTimes& operator+=(const ActivityTimes& o) {
    for (int k = 0; k < kActivities; ++k)
      seconds[k] += o.seconds[k];
    stalled += o.stalled;
    return *this;
  }
  friend ActivityTimes operator-(ActivityTimes a, const ActivityTimes& b) {
    for (int k = 0; k < kActivities; ++k)
      a.seconds[k] -= b.seconds[k];
    a.stalled -= b.stalled;
    return a;
  }
};

// The running totals since the process started. Local.
const ActivityTimes& activity_totals();
void add_activity(Activity a, double seconds);
// A gap this long between two looks at the clock of one wait means the rank was not running.
inline constexpr double kStallSeconds = 0.1;
// Adds to ActivityTimes::stalled. Local.
void add_stalled(double seconds);

// Adds the wall time of its scope to `a`. Scopes of different activities must not nest.
class Timed {
 public:
  explicit Timed(Activity a) : activity_(a), start_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    add_activity(activity_,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  Activity activity_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace tessera
