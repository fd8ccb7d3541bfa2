// Pieces every driver (train, bench, gradcheck, plan) shares, written once: the dtype switch,
// the check that ends a run whose loss stopped being finite, and the peak memory per rank.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "tessera/comm.hpp"

namespace tessera {

// Checks a --dtype value: "float32" or "float64"; throws an Error otherwise. Local.
void check_dtype(const std::string& dtype);

// Calls f(float{}) or f(double{}) as `dtype` says and returns what it returns. Local; throws as
// check_dtype (run it inside an agreement).
template <typename F>
decltype(auto) with_dtype(const std::string& dtype, F&& f) {
  check_dtype(dtype);
  if (dtype == "float32") return std::forward<F>(f)(float{});
  return std::forward<F>(f)(double{});
}

// Every rank holds the same global loss: all throw an agreed Error together when it is not
// finite, naming the step and `advice` ("try a smaller --lr"). Collective over the world group.
void check_finite_loss(const Comm& comm, double loss, std::int64_t step, const std::string& advice);

// Peak resident memory of this process so far, in MiB (what a user sizes nodes by). Local.
double peak_memory_mib();
// Minor page faults of this process so far (pages mapped on first touch). Local.
long minor_page_faults();
// Its smallest and largest value over the ranks. Collective over the world group.
std::pair<double, double> peak_memory_range_mib(const Comm& comm);

}  // namespace tessera
