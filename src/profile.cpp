#include "tessera/profile.hpp"

namespace tessera {
namespace {

ActivityTimes g_totals;

}  // namespace

const ActivityTimes& activity_totals() {
  return g_totals;
}

void add_activity(Activity a, double seconds) {
  g_totals.seconds[static_cast<int>(a)] += seconds;
}

void add_stalled(double seconds) {
  g_totals.stalled += seconds;
}

}  // namespace tessera
