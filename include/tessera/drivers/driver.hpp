// Pieces every driver (train, bench, gradcheck, plan) shares, written once: the dtype switch,
// the check that ends a run whose loss stopped being finite, stop signals, and the peak memory
// per rank.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm.hpp"
#include "tessera/runtime.hpp"

namespace tessera {

// Checks a --dtype value: "float32" or "float64"; throws an Error otherwise. Local.
void check_dtype(const std::string& dtype);
// The same, and that `runtime`'s --precision goes with it (bf16 converts float32 only). Local.
void check_dtype(const std::string& dtype, const RuntimeOptions& runtime);

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

// A file a command reads or writes, named by its option ("--output").
struct NamedPath {
  std::string option, path;
};
// Throws unless each of `outputs` names a file apart from every one of `inputs` and from the other
// outputs (compared after '.', '..' and symbolic links; empty paths are not compared), nor one of
// the checkpoints in an input that is a directory (a checkpoint directory): a run would otherwise
// destroy what it reads. Inputs that do not exist (a built-in model's name) are not compared.
// Local.
void check_outputs_apart(const std::vector<NamedPath>& outputs,
                         const std::vector<NamedPath>& inputs);

// Writes `text` to `path` through a temporary beside it (`path`.tmp.<pid>) and a rename: a failed
// write leaves what was there. An Error says "cannot write <what> '<path>'" and why. Local.
void write_text_file(const std::string& path, const std::string& text, const std::string& what);
// Throws unless the file `path` could be written, leaving it as it was (an existing file is
// opened for appending, not truncated; a new one is created and removed again): a run checks its
// outputs before the work whose results they hold. The Error names `what` ("--json"). Local.
void check_writable(const std::string& path, const std::string& what);
// Creates the directory `dir` (and its parents) unless it exists, and throws unless a file can
// be created in it (one is, and removed again). The Error names `what` ("--checkpoint-dir").
// Local.
void check_writable_directory(const std::string& dir, const std::string& what);

// Stop requests. SIGUSR1 (what a batch script forwards when Slurm warns of the time limit,
// `#SBATCH --signal=B:USR1@120`) and SIGTERM (scancel, preemption) only set a flag here; a
// long-running command looks at it between steps (agreed_stop_signal) and stops cleanly there,
// with a checkpoint. install_stop_signals also unblocks both in the calling thread (a stop sent
// while they were blocked is taken then); it is idempotent. `tessera train`, `predict` and
// `evaluate` call it first thing in main, before MPI starts: a stop that comes while the job
// starts is kept for the first step's end rather than ending the process. Local.
void install_stop_signals();
// The stop signal this process received (SIGUSR1 or SIGTERM), 0 if none. Local.
int stop_signal();
// A stop signal received by any rank (the largest signal number), 0 if none: every rank stops at
// the same step. Collective over the world group.
int agreed_stop_signal(const Comm& comm);
// "SIGUSR1", "SIGTERM", or "signal N". Local.
std::string signal_name(int signal);
// The exit status of a run stopped by a signal after writing a checkpoint it can resume from
// (EX_TEMPFAIL of sysexits.h): scripts/slurm/train.sbatch requeues the job on it.
inline constexpr int kExitStoppedResumable = 75;

// Seconds since `t` on the steady clock. Local.
double seconds_since(std::chrono::steady_clock::time_point t);
// A duration for progress lines: "m:ss", or "h:mm:ss" from an hour on. Local.
std::string duration_text(double seconds);

// Peak resident memory of this process so far, in MiB (what a user sizes nodes by). Local.
double peak_memory_mib();
// Peak resident memory since the previous call (since the start, for the first), in MiB: Linux's
// VmHWM, reset after reading through /proc/self/clear_refs. Where that reset is refused, the
// peak since the start. peak_memory_mib() still reports the peak since the start. Local.
double interval_peak_memory_mib();
// Minor page faults of this process so far (pages mapped on first touch). Local.
long minor_page_faults();
// Its smallest and largest value over the ranks. Collective over the world group.
std::pair<double, double> peak_memory_range_mib(const Comm& comm);

}  // namespace tessera
