#include "tessera/drivers/memory.hpp"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include "tessera/checked.hpp"
#include "tessera/drivers/plan.hpp"
#include "tessera/error.hpp"
#include "tessera/placement.hpp"

namespace tessera {

namespace {

// The first integer of `text`, or -1.
std::int64_t leading_integer(const std::string& text) {
  const char* begin = text.data();
  while (*begin == ' ' || *begin == '\t')
    ++begin;
  std::int64_t v = -1;
  const auto [end, ec] = std::from_chars(begin, text.data() + text.size(), v);
  return ec == std::errc() && end != begin ? v : -1;
}

// MemAvailable of /proc/meminfo in bytes, or 0.
std::int64_t meminfo_available() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("MemAvailable:")) {
      const std::int64_t kib = leading_integer(line.substr(13));
      return kib > 0 ? saturating_mul(kib, 1024) : 0;
    }
  return 0;
}

// The tightest memory limit of this process's cgroups and their ancestors, or 0 for none. A
// limit of 2^62 bytes or more is "unlimited" (cgroup v1 writes 2^63 - 4096 for that).
std::int64_t cgroup_limit() {
  namespace fs = std::filesystem;
  std::int64_t tightest = 0;
  std::ifstream in("/proc/self/cgroup");
  for (std::string line; std::getline(in, line);) {
    // hierarchy-ID:controller-list:path; v2 has an empty controller list.
    const std::size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    fs::path base;
    std::string file;
    if (controllers.empty()) {
      base = "/sys/fs/cgroup";
      file = "memory.max";
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      base = "/sys/fs/cgroup/memory";
      file = "memory.limit_in_bytes";
    } else {
      continue;
    }
    // From the process's own group up to the root (a container may show only the root).
    fs::path dir = (base / fs::path(path).relative_path()).lexically_normal();
    for (int depth = 0; depth < 64; ++depth) {
      std::ifstream f(dir / file);
      std::string text;
      if (f && std::getline(f, text)) {
        const std::int64_t v = leading_integer(text);  // "max" reads -1: no limit
        if (v > 0 && v < (std::int64_t{1} << 62) && (tightest == 0 || v < tightest)) tightest = v;
      }
      if (dir == base || !dir.has_parent_path() || dir.parent_path() == dir) break;
      dir = dir.parent_path();
    }
  }
  return tightest;
}

}  // namespace

MemoryBudget available_host_memory() {
  const std::int64_t available = meminfo_available();
  const std::int64_t limit = cgroup_limit();
  if (limit > 0 && (available == 0 || limit < available))
    return {limit, "the memory cgroup's limit"};
  if (available > 0) return {available, "MemAvailable"};
  return {0, "unknown"};
}

MemoryBudget host_memory_per_rank(const Comm& world) {
  MemoryBudget b = available_host_memory();
  const int ranks = node_rank(world).local_size;
  if (b.bytes <= 0) return b;
  b.source += " " + human_bytes(b.bytes);
  if (ranks <= 1) return b;
  b.bytes /= ranks;
  b.source += " shared by " + std::to_string(ranks) + " ranks on this node";
  return b;
}

MemoryBudget run_memory_budget(const Comm& world, KernelBackend kernels) {
  MemoryBudget b = host_memory_per_rank(world);  // collective: every rank calls it
  if (kernels == KernelBackend::cuda) return {0, "GPU memory (tessera plan --device cuda)"};
  return b;
}

void check_memory(std::int64_t bytes, const std::string& what, const MemoryBudget& budget,
                  const std::string& advice) {
  if (bytes < kSizeMax && (budget.bytes <= 0 || bytes <= budget.bytes)) return;
  throw Error("the run needs " + human_bytes(bytes) + " per rank (" + what + "), " +
              (budget.bytes > 0 ? human_bytes(budget.bytes) + " available (" + budget.source + ")"
                                : "more than any machine holds") +
              (advice.empty() ? "" : ": " + advice));
}

std::string estimate_note(std::int64_t estimate) {
  return estimate > 0 ? " (tessera plan: " + human_bytes(estimate) + ")" : "";
}

std::int64_t check_run_memory(const ModelSpec& spec, const RunMemory& run,
                              const MemoryBudget& budget) {
  Plan plan;
  PlanOptions options{.grid = run.grid, .input = run.input, .dtype = run.dtype};
  options.engine = run.engine;
  try {
    plan = make_plan(spec, options);
  } catch (const Error&) {
    return 0;  // a shape the grid cannot split: the model says so, naming the layer
  }
  const MemoryEstimate& m = plan.memory;
  const std::int64_t optimizer =
      saturating_mul(saturating_mul(plan.params, plan.dtype_bytes), run.optimizer_states);
  const std::int64_t classes = plan.layers.empty() ? 0 : plan.layers.back().output.c;
  const std::int64_t metrics =
      saturating_mul(saturating_mul(saturating_mul(classes, classes), sizeof(std::int64_t)),
                     run.confusion_matrices);
  // Outputs held per rank: the busiest rank's share of the last layer's output.
  const auto output_bytes = [&run](const Plan& p) {
    if (p.layers.empty()) return std::int64_t{0};
    const LayerPlan& last = p.layers.back();
    const std::int64_t per_pixel = saturating_add(
        run.output_bytes_per_pixel, saturating_mul(run.output_bytes_per_channel, last.output.c));
    return saturating_mul(saturating_mul(p.samples.max, per_pixel),
                          saturating_mul(last.tile_rows.max, last.tile_cols.max));
  };
  const std::int64_t outputs = output_bytes(plan);
  const std::int64_t extras =
      saturating_add(optimizer, saturating_add(metrics, run.sample_order_bytes));
  // What tessera plan estimates the run holds, on this grid or another.
  const auto held = [&run](const MemoryEstimate& e) {
    return run.inference ? e.inference() : e.training(run.evaluates);
  };
  std::int64_t needed = saturating_add(saturating_add(held(m), extras), outputs);
  std::string what = std::string("estimate: ") + (run.inference ? "inference " : "training ") +
                     human_bytes(held(m)) + " (tessera plan; params x2 " + human_bytes(m.params) +
                     " of it)";
  if (optimizer > 0) what += " + optimizer state " + human_bytes(optimizer);
  if (outputs > 0) what += " + outputs " + human_bytes(outputs);
  if (metrics > 0) what += " + metrics " + human_bytes(metrics);
  if (run.sample_order_bytes > 0) what += " + sample order " + human_bytes(run.sample_order_bytes);
  if (run.single_reference) {
    needed = saturating_add(needed, plan.single.training(run.evaluates));
    what += " + the single-rank reference " + human_bytes(plan.single.training(run.evaluates));
  }
  if (needed >= kSizeMax || (budget.bytes > 0 && needed > budget.bytes)) {
    std::string advice =
        "use more ranks, a smaller image or a smaller batch (tessera plan estimates any grid)";
    // The smallest grid that would fit, where more ranks help (not gradcheck's single-rank
    // reference, which stays whole).
    if (budget.bytes > 0 && !run.single_reference) {
      const std::optional<GridShape> fits = host_grid_that_fits(
          spec, options, std::max<std::int64_t>(0, budget.bytes - extras),
          [&](const Plan& p) { return saturating_add(held(p.memory), output_bytes(p)); });
      advice = fits ? "a grid of " + fits->str() + " would fit (at this memory per rank)"
                    : "no grid of up to 64 x 64 spatial ranks fits at this memory per rank; use "
                      "a smaller image or batch";
    }
    check_memory(needed, what + "; image " + run.input.str() + ", grid " + run.grid.str(), budget,
                 advice);  // throws
  }
  return run.engine.kernels == KernelBackend::cuda ? 0 : needed;
}

}  // namespace tessera
