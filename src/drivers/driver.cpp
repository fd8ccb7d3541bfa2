#include "tessera/drivers/driver.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/io/checkpoint.hpp"

namespace tessera {

void check_dtype(const std::string& dtype) {
  TESSERA_CHECK(dtype == "float32" || dtype == "float64",
                "bad --dtype '" + dtype + "': expected float32 or float64");
}

void check_dtype(const std::string& dtype, const RuntimeOptions& runtime) {
  check_dtype(dtype);
  TESSERA_CHECK(!runtime.bf16 || dtype == "float32",
                "--precision bf16 rounds float32 convolutions to bfloat16: it goes with --dtype "
                "float32, not " +
                    dtype);
}

void check_finite_loss(const Comm& comm, double loss, std::int64_t step,
                       const std::string& advice) {
  agree(comm, [&] {
    TESSERA_CHECK(std::isfinite(loss), "the loss became " + std::to_string(loss) + " at step " +
                                           std::to_string(step) + " (" + advice + ")");
  });
}

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int signal) {
  g_stop_signal = signal;
}

}  // namespace

void check_outputs_apart(const std::vector<NamedPath>& outputs,
                         const std::vector<NamedPath>& inputs) {
  namespace fs = std::filesystem;
  const auto resolved = [](const std::string& path) {
    std::error_code ec;
    const fs::path p = fs::weakly_canonical(path, ec);
    return ec ? fs::absolute(path).lexically_normal() : p;
  };
  for (std::size_t k = 0; k < outputs.size(); ++k) {
    const NamedPath& out = outputs[k];
    if (out.path.empty()) continue;
    const fs::path target = resolved(out.path);
    // An input that is no file (a built-in model's name) cannot be overwritten; two outputs can
    // be the same path before either exists.
    const auto check = [&](const NamedPath& in, const char* what, bool output) {
      std::error_code ec;
      if (in.path.empty() || (!output && !fs::exists(in.path, ec))) return;
      const fs::path source = resolved(in.path);
      TESSERA_CHECK(target != source, out.option + " '" + out.path + "' is the " + in.option +
                                          " file" + what + ": give it another path");
      if (!fs::is_directory(source, ec)) return;
      for (const std::string& c : checkpoints_newest_first(source.string()))
        TESSERA_CHECK(resolved(c) != target,
                      out.option + " '" + out.path + "' is a checkpoint in the " + in.option +
                          " directory '" + in.path + "': give it another path");
    };
    for (const NamedPath& in : inputs)
      check(in, " (the run reads it)", false);
    for (std::size_t j = 0; j < k; ++j)
      check(outputs[j], " (the run writes both)", true);
  }
}

namespace {

// A name beside `path` that no other process writes: `path`.tmp.<pid>.
std::string temporary_beside(const std::string& path) {
  return path + ".tmp." + std::to_string(::getpid());
}

}  // namespace

void write_text_file(const std::string& path, const std::string& text, const std::string& what) {
  const std::string temp = temporary_beside(path);
  std::ofstream f(temp, std::ios::trunc);
  f << text;
  f.close();
  TESSERA_CHECK(f.good(), "cannot write " + what + " '" + path + "' (through '" + temp + "')");
  std::error_code ec;
  std::filesystem::rename(temp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(temp, ignored);
  }
  TESSERA_CHECK(!ec, "cannot write " + what + " '" + path + "': " + ec.message());
}

void check_writable(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TESSERA_CHECK(!fs::is_directory(path, ec),
                "cannot write " + what + " '" + path + "': it is a directory");
  // Through symbolic links, the file they name: a dangling link stays a link.
  fs::path file = path;
  for (int hops = 0; hops < 40 && fs::is_symlink(fs::symlink_status(file, ec)); ++hops) {
    const fs::path to = fs::read_symlink(file, ec);
    if (ec) break;
    file = to.is_absolute() ? to : file.parent_path() / to;
  }
  const bool existed = fs::exists(file, ec);
  const bool ok = std::ofstream(file, std::ios::app).good();
  if (ok && !existed) fs::remove(file, ec);
  const fs::path parent = file.parent_path();
  TESSERA_CHECK(ok, "cannot write " + what + " '" + path + "'" +
                        (parent.empty() || fs::is_directory(parent, ec)
                             ? std::string(" (is its directory writable?)")
                             : ": the directory '" + parent.string() + "' does not exist"));
}

void check_writable_directory(const std::string& dir, const std::string& what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TESSERA_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec),
                "cannot use " + what + " '" + dir + "': it is a file, not a directory");
  fs::create_directories(dir, ec);
  TESSERA_CHECK(!ec, "cannot create " + what + " '" + dir + "': " + ec.message());
  const std::string probe = temporary_beside((fs::path(dir) / ".tessera-write-test").string());
  const bool ok = std::ofstream(probe).good();
  fs::remove(probe, ec);
  TESSERA_CHECK(ok, "cannot write in " + what + " '" + dir + "' (is it writable?)");
}

void install_stop_signals() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // system calls (MPI's polls, file writes) go on
  sigset_t stops;
  sigemptyset(&stops);
  for (int s : {SIGUSR1, SIGTERM}) {
    TESSERA_CHECK(sigaction(s, &action, nullptr) == 0,
                  "cannot install the handler of " + signal_name(s));
    sigaddset(&stops, s);
  }
  // A process started with them blocked (a launcher's mask is inherited through exec) would
  // never see a stop; one sent while they were blocked is taken now.
  TESSERA_CHECK(pthread_sigmask(SIG_UNBLOCK, &stops, nullptr) == 0,
                "cannot unblock SIGUSR1 and SIGTERM");
}

int stop_signal() {
  return g_stop_signal;
}

int agreed_stop_signal(const Comm& comm) {
  return allreduce_max(comm, stop_signal());
}

std::string signal_name(int signal) {
  if (signal == SIGUSR1) return "SIGUSR1";
  if (signal == SIGTERM) return "SIGTERM";
  return "signal " + std::to_string(signal);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string duration_text(double seconds) {
  const auto total = static_cast<long long>(seconds + 0.5);
  std::ostringstream o;
  if (total >= 3600) o << total / 3600 << ":" << std::setw(2) << std::setfill('0');
  o << (total / 60) % 60 << ":" << std::setw(2) << std::setfill('0') << total % 60;
  return o.str();
}

namespace {

// The largest interval peak seen: resetting VmHWM also lowers what getrusage reports.
double largest_interval_peak_mib = 0;

}  // namespace

double peak_memory_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  // Linux reports KiB.
  return std::max(static_cast<double>(usage.ru_maxrss) / 1024.0, largest_interval_peak_mib);
}

double interval_peak_memory_mib() {
  double peak = 0;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.starts_with("VmHWM:")) peak = std::strtod(line.c_str() + 6, nullptr) / 1024.0;
  if (peak == 0) return peak_memory_mib();  // not Linux's /proc
  largest_interval_peak_mib = std::max(peak_memory_mib(), peak);
  std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := the current resident size
  return peak;
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
