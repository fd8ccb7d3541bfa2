#include "tessera/runtime.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "tessera/error.hpp"
#include "tessera/kernels/narrow_conv.hpp"

namespace tessera {
namespace {

// The value of `name`, or nullptr when it is unset or empty.
const char* variable(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// A positive integer from the environment, else 0. OMP_NUM_THREADS may be a list ("4,2"): its
// first entry is the outer level's count.
int count_of(const char* name) {
  const char* text = variable(name);
  if (text == nullptr) return 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return end != text && v > 0 && v < (1 << 20) ? static_cast<int>(v) : 0;
}

bool switch_of(const char* name, bool fallback) {
  const char* text = variable(name);
  if (text == nullptr) return fallback;
  const std::string v = text;
  if (v == "0") return false;
  if (v == "1") return true;
  throw Error(std::string(name) + ": expected 0 or 1, got '" + v + "'");
}

KernelThreads threads_from_environment() {
  if (const int omp = count_of("OMP_NUM_THREADS"); omp > 0)
    return {omp, "OMP_NUM_THREADS=" + std::to_string(omp)};
  // Launchers say how many ranks they started on this node; asking MPI would be a collective.
  int ranks = 0;
  for (const char* name : {"MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    if (ranks == 0) ranks = count_of(name);
  const bool known = ranks > 0;
  ranks = std::max(ranks, 1);
  const int cores = available_cores();
  auto count = [](int n, const char* what) {
    return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
  };
  return {std::max(1, cores / ranks),
          count(cores, "core") + " / " + count(ranks, "rank") +
              (known ? " on this node" : " (the launcher did not say how many share the node)")};
}

// Prefixes an Error from parsing a variable's value with the variable's name.
template <typename F>
auto parsed(const char* name, F&& parse) {
  try {
    return parse(std::string(variable(name)));
  } catch (const Error& e) {
    throw Error(std::string(name) + ": " + e.what());
  }
}

}  // namespace

RuntimeOptions runtime_options_from_environment() {
  RuntimeOptions o;
  if (variable("TESSERA_KERNELS"))
    o.kernels =
        parsed("TESSERA_KERNELS", [](const std::string& v) { return parse_kernel_backend(v); });
  o.overlap = switch_of("TESSERA_OVERLAP", true);
  o.fuse = switch_of("TESSERA_FUSE", true);
  o.windowless = switch_of("TESSERA_WINDOWLESS", true);
  o.batchnorm_alone = switch_of("TESSERA_BN_ALONE", true);
  o.winograd = switch_of("TESSERA_WINOGRAD", true);
  o.narrow_conv = switch_of("TESSERA_NARROW_CONV", simd_available(SimdLevel::avx512));
  if (variable("TESSERA_SIMD"))
    o.simd = parsed("TESSERA_SIMD", [](const std::string& v) { return parse_simd_level(v); });
  if (variable("TESSERA_WAIT"))
    o.wait = parsed("TESSERA_WAIT", [](const std::string& v) { return parse_wait_policy(v); });
  if (variable("TESSERA_TIMEOUT"))
    o.timeout = parsed("TESSERA_TIMEOUT", [](const std::string& v) {
      char* end = nullptr;
      const double s = std::strtod(v.c_str(), &end);
      TESSERA_CHECK(end != v.c_str() && *end == '\0', "bad timeout '" + v + "': expected seconds");
      return check_timeout(s);
    });
  if (variable("TESSERA_HOST_MEMORY"))
    o.host_memory =
        parsed("TESSERA_HOST_MEMORY", [](const std::string& v) { return parse_host_memory(v); });
  if (variable("TESSERA_TRANSPORT"))
    o.transport =
        parsed("TESSERA_TRANSPORT", [](const std::string& v) { return parse_transport(v); });
  if (variable("TESSERA_CUDNN_SEARCH"))
    o.cudnn_measure = parsed("TESSERA_CUDNN_SEARCH", [](const std::string& v) {
      TESSERA_CHECK(v == "measure" || v == "heuristic",
                    "bad value '" + v + "': expected measure or heuristic");
      return v == "measure";
    });
  o.cudnn_log = switch_of("TESSERA_CUDNN_LOG", false);
  o.threads = threads_from_environment();
  return o;
}

Runtime::Runtime(std::unique_ptr<Comm> comm, const RuntimeOptions& options)
    : comm_(std::move(comm)), backend_(&backend_of(options.kernels)), options_(options) {
  TESSERA_CHECK(comm_ != nullptr, "a runtime needs communicators");
}

Runtime make_runtime(const Comm& world, GridShape grid, const RuntimeOptions& options) {
  set_conv_bf16(options.bf16);  // before the model plans its kernels
  set_conv_winograd(options.winograd);
  set_conv_narrow(options.narrow_conv);
  if (options.simd) set_simd_level(*options.simd);
  const WaitSettings wait{options.wait.value_or(world.wait_settings().policy), options.timeout};
  return Runtime(with_transport(world.host().make_grid(grid, wait), options.transport), options);
}

Runtime Runtime::single() const {
  return Runtime(comm_->make_single(), options_);
}

}  // namespace tessera
