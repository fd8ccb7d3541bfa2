#include "tessera/drivers/driver.hpp"

#include <sys/resource.h>

#include <cmath>
#include <span>
#include <vector>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"

namespace tessera {

void check_dtype(const std::string& dtype) {
  TESSERA_CHECK(dtype == "float32" || dtype == "float64",
                "bad --dtype '" + dtype + "': expected float32 or float64");
}

void check_finite_loss(const Comm& comm, double loss, std::int64_t step,
                       const std::string& advice) {
  agree(comm, [&] {
    TESSERA_CHECK(std::isfinite(loss), "the loss became " + std::to_string(loss) + " at step " +
                                           std::to_string(step) + " (" + advice + ")");
  });
}

double peak_memory_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // Linux reports KiB
}

long minor_page_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

std::pair<double, double> peak_memory_range_mib(const Comm& comm) {
  const double mine = peak_memory_mib();
  std::vector<double> v{mine, -mine};  // max of both: the largest and minus the smallest
  allreduce(comm, std::span<double>(v), ReduceOp::max, Group::world, "peak memory");
  return {-v[1], v[0]};
}

}  // namespace tessera
