#include "tessera/drivers/bench.hpp"
#include "tessera/drivers/driver.hpp"
#include "tessera/drivers/memory.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "tessera/allocator.hpp"
#include "tessera/batch.hpp"
#include "tessera/collectives.hpp"
#include "tessera/engine/graph.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/engine/optimizer.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/placement.hpp"

namespace tessera {
namespace {

using clock_type = std::chrono::steady_clock;

// The numbers one rank measured, flattened so that one reduction gives their maximum over ranks:
// per layer and pass [seconds, window, halo, waiting, allreduce], then the gradient reduction's,
// then the step time.
constexpr int kPerPass = 1 + kActivities;

void append(std::vector<double>& v, const PassTiming& t, double steps) {
  v.push_back(t.seconds / steps);
  for (double s : t.activities.seconds)
    v.push_back(s / steps);
}

struct PassRow {
  double seconds = 0;
  ActivityTimes parts;
  double compute() const { return seconds - parts.overhead(); }
  double operator[](Activity a) const { return parts[a]; }
  PassRow& operator+=(const PassRow& o) {
    seconds += o.seconds;
    parts += o.parts;
    return *this;
  }
};

PassRow row_at(const std::vector<double>& v, std::size_t at) {
  PassRow r{v[at], {}};
  for (int k = 0; k < kActivities; ++k)
    r.parts.seconds[k] = v[at + 1 + k];
  return r;
}

// One rank's step: [compute, window, halo, waiting, allreduce, other, step].
constexpr int kSplit = 7;
constexpr const char* kSplitNames[kSplit] = {"compute",   "window", "halo", "waiting",
                                             "allreduce", "other",  "step"};

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

std::string pad(const std::string& s, std::size_t width, bool left = false) {
  if (s.size() >= width) return s;
  return left ? s + std::string(width - s.size(), ' ') : std::string(width - s.size(), ' ') + s;
}

// What the timed steps measured on this rank.
struct Measured {
  std::vector<double> v;      // as kPerPass says, then the step time
  std::vector<double> split;  // kSplit numbers of every rank (this rank's filled in)
  // The host memory's work over the timed steps, per step: large blocks reused, assembled and
  // fresh, MiB moved and fresh, minor page faults.
  std::vector<double> memory;
  std::int64_t warmup = 0;  // untimed steps run: o.warmup, and more while pages still faulted in
};

// A warm-up step after o.warmup that still faulted in more bytes than this (on some rank) is
// followed by another, at most kMoreWarmup of them: the host pool's pages settle over the first
// steps where a block is assembled from pages no step wrote yet (parts of oneDNN's scratchpads
// and its bf16 copies; conv-bench under --precision bf16: 65 600 faults per step over the 2 steps
// after one warm-up, 0 after four), and a training run's steps are the settled ones. Counted as
// the pool's fresh bytes (its huge pages fault once per 2 MiB: src/allocator.cpp) plus 4 KiB per
// minor fault (the rest of the heap).
constexpr std::int64_t kSettledBytes = std::int64_t{16} << 20;
constexpr std::int64_t kMoreWarmup = 4;

// Runs o.warmup untimed steps (and more as above) and o.steps timed ones. Collective over the
// world group.
template <typename T>
Measured time_steps(Model<T>& model, Optimizer<T>& optimizer, const DistTensor<T>& x,
                    const Labels& labels, const BenchOptions& o, const Runtime& runtime,
                    const Comm& world) {
  double step_seconds = 0;
  long faults_before = 0;
  std::int64_t warmup = o.warmup;
  for (std::int64_t s = 0; s < warmup + o.steps; ++s) {
    if (s == warmup) {
      model.reset_timings();
      step_seconds = 0;
      reset_host_memory_stats();
      faults_before = minor_page_faults();
    }
    const long step_faults_before = s < warmup ? minor_page_faults() : 0;  // warm-up only
    const std::int64_t step_fresh_before = s < warmup ? host_memory_stats().fresh_bytes : 0;
    model.state() = {.mode = Mode::train, .seed = o.seed, .step = s};
    runtime.comm().set_step(s);
    // Each step's batch handed over to the model, as training hands over the batch it read (the
    // first layer keeps it for its filter gradient rather than a copy): a copy, before the clock
    // (on a GPU a copy queued on the stream: finished before the clock starts).
    DistTensor<T> batch = x;
    runtime.backend().synchronize();
    const auto began = clock_type::now();
    const StepResult<T> r = forward_backward(model, std::move(batch), labels);
    optimizer.step(o.lr);
    runtime.backend().synchronize();  // a GPU's step ends when its kernels have
    step_seconds += std::chrono::duration<double>(clock_type::now() - began).count();
    check_finite_loss(world, r.loss, s, "try a smaller --lr");
    if (s + 1 == warmup && warmup > 0 && warmup < o.warmup + kMoreWarmup) {
      const std::int64_t faulted = std::int64_t{4096} * (minor_page_faults() - step_faults_before) +
                                   (host_memory_stats().fresh_bytes - step_fresh_before);
      if (allreduce_max(world, faulted > kSettledBytes ? 1 : 0) != 0) ++warmup;
    }
  }
  const auto steps = static_cast<double>(o.steps);
  Measured m;
  m.warmup = warmup;
  for (const LayerTiming& t : model.timings()) {
    append(m.v, t.forward, steps);
    append(m.v, t.backward, steps);
  }
  append(m.v, model.reduce_timing(), steps);
  m.v.push_back(step_seconds / steps);
  // This rank's own split of its step (its numbers add up, unlike maxima over ranks): a rank
  // that waits long for halos waits for a slower peer.
  const int rank = world.rank();
  m.split.assign(kSplit * static_cast<std::size_t>(world.size(Group::world)), 0.0);
  PassRow mine;
  for (std::size_t at = 0; at + 1 < m.v.size(); at += kPerPass)
    mine += row_at(m.v, at);  // every layer's passes and the gradient reduction
  double* me = m.split.data() + kSplit * rank;
  me[0] = mine.compute();
  for (int k = 0; k < kActivities; ++k)
    me[1 + k] = mine.parts.seconds[k];
  me[6] = m.v.back();
  me[5] = std::max(0.0, me[6] - mine.seconds);
  const HostMemoryStats mem = host_memory_stats();
  m.memory = {static_cast<double>(mem.reused),
              static_cast<double>(mem.assembled),
              static_cast<double>(mem.fresh),
              static_cast<double>(mem.moved_bytes) / (1 << 20),
              static_cast<double>(mem.fresh_bytes) / (1 << 20),
              static_cast<double>(minor_page_faults() - faults_before)};
  for (double& n : m.memory)
    n /= steps;
  return m;
}

// The input's tiles as the JSON says them: the split units (0: an even split) and each spatial
// rank's rows and columns, [begin, end), in the grid's row-major order. Local.
nlohmann::json tile_json(const Distribution& in) {
  nlohmann::json tiles = nlohmann::json::array();
  for (int i = 0; i < in.grid.h; ++i)
    for (int k = 0; k < in.grid.w; ++k) {
      const Box b = in.tile_of(i, k);
      tiles.push_back({{"rows", {b.h.begin, b.h.end}}, {"cols", {b.w.begin, b.w.end}}});
    }
  return {{"row_units", in.row_units}, {"col_units", in.col_units}, {"spatial", tiles}};
}

// Every rank's split on every rank; every other number its maximum over ranks (the slowest rank
// sets the pace). Collective over the world group.
void gather(Measured& m, const Comm& world) {
  allreduce_sum(world, std::span<double>(m.split));
  allreduce(world, std::span<double>(m.v), ReduceOp::max);
  allreduce(world, std::span<double>(m.memory), ReduceOp::max);
}

// The smallest of every rank's `value`. Collective over the world group.
double min_over_ranks(const Comm& world, double value) {
  std::vector<double> neg{-value};
  allreduce(world, std::span<double>(neg), ReduceOp::max);
  return -neg[0];
}

// The convolutions' arithmetic and compute time, all and those with >= 32 channels.
struct ConvTotals {
  double flops = 0, seconds = 0, wide_flops = 0, wide_seconds = 0;
  double rate() const { return seconds > 0 ? flops / seconds / 1e9 : 0; }
  double wide_rate() const { return wide_seconds > 0 ? wide_flops / wide_seconds / 1e9 : 0; }
};

// The per-layer table (printed and into j["layers"]); `wide` says which layers have >= 32
// channels on both sides. Local.
ConvTotals report_layers(std::ostream& out, nlohmann::json& j,
                         const std::vector<LayerTiming>& layers, const std::vector<double>& v,
                         const std::function<bool(const std::string&)>& wide) {
  out << "  per layer, ms per step (each the maximum over ranks); GFLOP/s of this rank's work\n"
      << "  over its compute time\n";
  out << "  " << pad("layer", 8, true) << " " << pad("type", 12, true) << " "
      << pad("pass", 8, true) << pad("total", 9) << pad("compute", 9) << pad("window", 8)
      << pad("halo", 8) << pad("waiting", 8) << pad("allreduce", 10) << pad("GFLOP/s", 9) << "\n";
  auto print_row = [&](const std::string& name, const std::string& type, const std::string& pass,
                       const PassRow& r, double gflops) {
    out << "  " << pad(name, 8, true) << " " << pad(type, 12, true) << " " << pad(pass, 8, true)
        << pad(fixed(r.seconds * 1e3, 1), 9) << pad(fixed(r.compute() * 1e3, 1), 9)
        << pad(fixed(r[Activity::window] * 1e3, 1), 8) << pad(fixed(r[Activity::halo] * 1e3, 1), 8)
        << pad(fixed(r[Activity::waiting] * 1e3, 1), 8)
        << pad(fixed(r[Activity::allreduce] * 1e3, 1), 10)
        << pad(gflops > 0 ? fixed(gflops, 1) : "-", 9) << "\n";
  };
  ConvTotals c;
  std::size_t at = 0;
  j["layers"] = nlohmann::json::array();
  for (const LayerTiming& t : layers) {
    for (int pass = 0; pass < 2; ++pass, at += kPerPass) {
      const PassRow r = row_at(v, at);
      const double flops = pass == 0 ? t.flops.forward : t.flops.backward;
      const double gflops = flops > 0 && r.compute() > 0 ? flops / r.compute() / 1e9 : 0;
      if (flops > 0) {
        c.flops += flops;
        c.seconds += r.compute();
        if (wide(t.name)) {
          c.wide_flops += flops;
          c.wide_seconds += r.compute();
        }
      }
      const char* name = pass == 0 ? "forward" : "backward";
      print_row(pass == 0 ? t.name : "", pass == 0 ? t.type : "", name, r, gflops);
      j["layers"].push_back({{"name", t.name},
                             {"type", t.type},
                             {"pass", name},
                             {"seconds", r.seconds},
                             {"compute", r.compute()},
                             {"window", r[Activity::window]},
                             {"halo", r[Activity::halo]},
                             {"waiting", r[Activity::waiting]},
                             {"allreduce", r[Activity::allreduce]},
                             {"gflops", gflops}});
    }
  }
  print_row("", "gradients", "reduce", row_at(v, at), 0);
  return c;
}

// The per-rank table and the step's exposed communication (printed and into j). Local.
void report_ranks(std::ostream& out, nlohmann::json& j, const std::vector<double>& split, int size,
                  double step) {
  // The critical rank computes longest: its waiting is the communication the step could not
  // hide; the others' waiting is mostly load imbalance (they wait for it).
  int critical = 0;
  for (int k = 1; k < size; ++k)
    if (split[kSplit * k] > split[kSplit * critical]) critical = k;
  auto exposed_of = [&](int k) {
    const double* r = split.data() + kSplit * k;
    return r[6] > 0 ? (r[2] + r[3] + r[4]) / r[6] : 0.0;
  };
  out << "  per rank, s per step" << (size > 1 ? " (* the critical rank: most compute)" : "")
      << "\n  " << pad("rank", 5);
  for (const char* name : kSplitNames)
    out << pad(name, 10);
  out << pad("exposed", 9) << "\n";
  double exposed_max = 0;
  for (int k = 0; k < size; ++k) {
    out << "  " << pad(std::to_string(k) + (k == critical && size > 1 ? "*" : " "), 5);
    for (int c = 0; c < kSplit; ++c)
      out << pad(fixed(split[kSplit * k + c], 3), 10);
    out << pad(fixed(100 * exposed_of(k), 1) + "%", 9) << "\n";
    exposed_max = std::max(exposed_max, exposed_of(k));
  }
  out << "  step " << fixed(step, 3) << " s (slowest rank); exposed communication (halo + waiting "
      << "+ allreduce): " << fixed(100 * exposed_of(critical), 1)
      << "% of the critical rank's step";
  if (size > 1) out << ", at most " << fixed(100 * exposed_max, 1) << "% on any rank";
  out << "\n";
  j["step_seconds"] = step;
  j["critical_rank"] = critical;
  j["split"] = nlohmann::json::object();
  for (int c = 0; c < kSplit - 1; ++c)
    j["split"][kSplitNames[c]] = split[kSplit * critical + c];
  j["exposed_fraction"] = exposed_of(critical);
  j["exposed_fraction_max"] = exposed_max;
  j["per_rank"] = nlohmann::json::array();
  for (int k = 0; k < size; ++k) {
    nlohmann::json r;
    for (int c = 0; c < kSplit; ++c)
      r[kSplitNames[c]] = split[kSplit * k + c];
    j["per_rank"].push_back(r);
  }
}

// The node's memory bandwidth (triad_bandwidth_gbs): the first rank of each node alone while the
// others wait, then every rank at once. What the node's ranks draw together against what one of
// them draws alone is about what the memory-bound passes gain from one rank to all of them.
struct Bandwidth {
  double alone = 0;     // GB/s, the slowest node's first rank alone
  double together = 0;  // GB/s, the sum over a node's ranks at once (the mean over nodes)
  int ranks_per_node = 1;
  bool oversubscribed = false;  // more ranks than cores on some node: shares of cores, not memory
};

// Collective over the world group. Arrays of 64 MiB (several last-level caches here), the median of
// 16 passes.
Bandwidth measure_bandwidth(const Comm& world) {
  constexpr std::int64_t kBytes = std::int64_t{64} << 20;
  constexpr int kPasses = 16;
  const NodeRank node = node_rank(world);
  const bool first = node.local_rank == 0;
  const int most = allreduce_max(world, node.local_size);
  allreduce_max(world, 0);  // the others wait while the first rank of each node measures alone
  const double alone = first ? triad_bandwidth_gbs(kBytes, kPasses) : 0;
  allreduce_max(world, 0);
  // With one rank per node, alone is all there is.
  const double together = most > 1 ? triad_bandwidth_gbs(kBytes, kPasses) : alone;
  std::vector<double> slowest{first ? alone : std::numeric_limits<double>::infinity()};
  allreduce(world, std::span<double>(slowest), ReduceOp::min, Group::world, "memory bandwidth");
  std::vector<double> sums{together, first ? 1.0 : 0.0};  // and the number of nodes
  allreduce_sum(world, std::span<double>(sums), Group::world, "memory bandwidth");
  // As MpiComm::detect_wait_policy: affinity masks may be per rank, the node has the largest.
  const int cores = allreduce_max(world, available_cores());
  return {.alone = slowest[0],
          .together = sums[0] / std::max(sums[1], 1.0),
          .ranks_per_node = most,
          .oversubscribed = most > cores};
}

void report_bandwidth(std::ostream& out, nlohmann::json& j, const Bandwidth& b) {
  out << "  memory: STREAM triad " << fixed(b.alone, 1) << " GB/s for one rank";
  if (b.ranks_per_node == 1)
    out << " (one rank per node: run more to see how far the node's bandwidth grows)\n";
  else
    out << " alone, " << fixed(b.together, 1) << " GB/s for " << b.ranks_per_node
        << " ranks of a node at once (" << fixed(b.together / std::max(b.alone, 1e-9), 2) << "x)"
        << (b.oversubscribed ? " (more ranks than cores: the ranks took turns, not a bandwidth)"
                             : ": about what memory-bound passes gain from more ranks on a node")
        << "\n";
  j["membw_alone_gbs"] = b.alone;
  j["membw_node_gbs"] = b.together;
  j["membw_ranks_per_node"] = b.ranks_per_node;
}

// The host memory's line (printed and into j). Local.
void report_memory(std::ostream& out, nlohmann::json& j, const std::vector<double>& m,
                   std::int64_t warmup) {
  out << "  host memory (" << to_string(host_memory()) << "), per timed step after " << warmup
      << " warm-up step" << (warmup == 1 ? "" : "s") << ": large blocks " << fixed(m[0], 0)
      << " reused, " << fixed(m[1], 0) << " assembled from kept pages (" << fixed(m[3], 0)
      << " MiB moved), " << fixed(m[2], 0) << " fresh; " << fixed(m[4], 0)
      << " MiB of fresh pages; " << fixed(m[5], 0) << " minor page faults\n";
  j["host_memory"] = {{"policy", to_string(host_memory())}, {"reused_per_step", m[0]},
                      {"assembled_per_step", m[1]},         {"fresh_per_step", m[2]},
                      {"moved_mib_per_step", m[3]},         {"fresh_mib_per_step", m[4]},
                      {"minor_faults_per_step", m[5]}};
  j["warmup_steps"] = warmup;
}

template <typename T>
int bench(const BenchOptions& o, const Comm& world, const RuntimeOptions& ro, std::ostream& out) {
  const int rank = world.rank(), size = world.size(Group::world);
  const bool root = rank == 0;
  ModelSpec spec;
  agree(world, [&] {
    TESSERA_CHECK(o.steps >= 1, "--steps must be at least 1, got " + std::to_string(o.steps));
    TESSERA_CHECK(o.warmup >= 0, "--warmup must be at least 0, got " + std::to_string(o.warmup));
    // As train refuses it: found here, not by the optimizer after the first timed step.
    TESSERA_CHECK(std::isfinite(o.lr) && o.lr >= 0,
                  "--lr must be a finite number >= 0, not " + std::to_string(o.lr));
    TESSERA_CHECK(o.grid.size() == size,
                  "grid " + o.grid.str() + " has " + std::to_string(o.grid.size()) +
                      " ranks but the job has " + std::to_string(size) + " (use mpiexec -n " +
                      std::to_string(o.grid.size()) + ")");
    spec = load_model(o.model);
    check_outputs_apart({{"--json", o.json}}, {{"--model", o.model}});
    if (root && !o.json.empty()) check_writable(o.json, "--json");
  });
  const Runtime runtime = make_runtime(world, o.grid, ro);
  std::optional<Model<T>> model;
  Shape4 input = o.image;
  if (input.c == 0) input.c = spec.input_channels;
  const MemoryBudget memory = run_memory_budget(world, ro.kernels);
  std::int64_t estimate = 0;  // tessera plan's, in bytes
  agree(world, [&] {
    // Before anything the size of the image is allocated or computed.
    estimate = check_run_memory(spec,
                                {.grid = o.grid,
                                 .input = input,
                                 .dtype = o.dtype,
                                 .engine = plan_engine(runtime.options())},
                                memory);
    model.emplace(spec, runtime, input);
    model->check_trainable();
  });
  model->init_params(o.seed);
  model->set_input_grad(false);  // as in training
  model->set_synchronized_timings(o.layer_sync);
  Optimizer<T> optimizer({.kind = OptimizerKind::sgd, .momentum = 0}, *model);

  DistTensor<T> x(model->input_distribution());
  // In the backend's memory once, as the batch of a GPU benchmark lies on the GPU (PyTorch's in
  // compare_pytorch.py too): a step does not copy the images in.
  x.local = copy_to(random_image_tile<T>(x.dist, o.seed), runtime.allocator());
  const Labels labels = random_label_tile(model->output_distribution(), o.seed);

  const double sgemm = o.sgemm ? sgemm_gflops() : 0;

  if (root) {
    out << "tessera bench: model " << spec.name << " (" << model->parameter_count()
        << " parameters), " << o.dtype << ", grid " << o.grid.str() << " (" << size
        << (size == 1 ? " rank" : " ranks") << "), image " << input.c << "x" << input.h << "x"
        << input.w << ", batch " << input.n << "\n"
        << "  rank 0's " << tiles_text(model->input_distribution()) << "\n"
        << "  kernels: " << runtime.backend().description() << "\n"
        << "  waiting: " << to_string(runtime.comm().wait_settings().policy) << "; " << o.warmup
        << " warm-up step" << (o.warmup == 1 ? "" : "s")
        << (o.warmup > 0 ? " (up to " + std::to_string(kMoreWarmup) +
                               " more while a step still faults pages in)"
                         : std::string())
        << ", then " << o.steps << " timed; SGD lr " << o.lr << "\n";
    out << "  fused activations (applied by / f' by): ";
    if (model->fused_activations().empty())
      out << (runtime.fuse() ? "none" : "none (TESSERA_FUSE=0)");
    for (std::size_t k = 0; k < model->fused_activations().size(); ++k) {
      const auto& f = model->fused_activations()[k];
      out << (k > 0 ? ", " : "") << f.activation << " (" << (f.producer.empty() ? "-" : f.producer)
          << " / " << (f.consumer.empty() ? "-" : f.consumer) << ")";
    }
    out << "\n";
    if (!model->concats_taken().empty()) {
      out << "  concats read by their consumer (no concatenated tensor): ";
      for (std::size_t k = 0; k < model->concats_taken().size(); ++k) {
        const auto& c = model->concats_taken()[k];
        out << (k > 0 ? ", " : "") << c.concat << " (" << c.consumer << ")";
      }
      out << "\n";
    }
    if (const auto kernels = model->kernel_summaries(); !kernels.empty()) {
      out << "  convolution kernels (rank 0's): ";
      for (std::size_t k = 0; k < kernels.size(); ++k)
        out << (k > 0 ? "; " : "") << kernels[k].first << " " << kernels[k].second;
      out << "\n";
    }
    if (runtime.backend().kind() == KernelBackend::cuda)
      out << "  per-layer times: "
          << (o.layer_sync ? "the GPU's (--layer-sync: waits at every layer, no overlap between "
                             "layers)"
                           : "the host's (kernels run after they are enqueued: a layer's GPU time "
                             "shows where the host next waits; --layer-sync for the GPU's)")
          << "\n";
    out << std::flush;
  }

  Measured m = time_steps(*model, optimizer, x, labels, o, runtime, world);
  gather(m, world);
  const double sgemm_min = min_over_ranks(world, sgemm);
  const double peak_mib = peak_memory_range_mib(world).second;
  // After the peak memory: its arrays are not the model's.
  const bool membw = o.membw && runtime.backend().kind() != KernelBackend::cuda;
  const Bandwidth bandwidth = membw ? measure_bandwidth(world) : Bandwidth{};
  if (!root) return 0;

  nlohmann::json j;
  j["model"] = spec.name;
  j["parameters"] = model->parameter_count();
  j["dtype"] = o.dtype;
  j["grid"] = o.grid.str();
  j["ranks"] = size;
  j["image"] = {input.c, input.h, input.w};
  j["batch"] = input.n;
  j["tiles"] = tile_json(model->input_distribution());
  j["threads_per_rank"] = kernel_threads().count;
  j["kernels"] = runtime.backend().description();
  j["steps"] = o.steps;
  j["layer_sync"] = o.layer_sync;

  // Which conv layers count as ">= 32 channels": both sides of the weight.
  auto wide = [&](const std::string& layer) {
    for (const NamedParam<T>& p : model->params())
      if (p.layer == layer && p.param->name == "weight")
        return std::min(p.param->value.shape().n, p.param->value.shape().c) >= 32;
    return false;
  };
  const ConvTotals conv = report_layers(out, j, model->timings(), m.v, wide);
  const double step = m.v.back();
  report_ranks(out, j, m.split, size, step);
  out << "  convolutions: " << fixed(conv.flops / 1e9, 1) << " GFLOP per step on rank 0, "
      << fixed(conv.rate(), 1) << " GFLOP/s";
  if (conv.wide_seconds > 0)
    out << "; those with >= 32 channels " << fixed(conv.wide_rate(), 1) << " GFLOP/s";
  out << "\n";
  if (sgemm > 0) {
    out << "  sgemm: " << fixed(sgemm_min, 1) << " GFLOP/s per rank (oneDNN, 2048^3, "
        << kernel_threads().count << (kernel_threads().count == 1 ? " thread" : " threads")
        << ", slowest rank)";
    if (conv.wide_seconds > 0)
      out << "; convolutions >= 32 channels at " << fixed(100 * conv.wide_rate() / sgemm_min, 0)
          << "% of it";
    out << "\n";
  }
  out << "  throughput " << fixed(static_cast<double>(input.n) / step, 3)
      << " images/s; peak memory per rank " << fixed(peak_mib, 1) << " MiB"
      << estimate_note(estimate) << "\n";
  report_memory(out, j, m.memory, m.warmup);
  if (membw) report_bandwidth(out, j, bandwidth);
  j["conv_gflop_per_step"] = conv.flops / 1e9;
  j["conv_gflops"] = conv.rate();
  j["conv32_gflops"] = conv.wide_rate();
  j["sgemm_gflops_per_rank"] = sgemm_min;
  j["peak_mib"] = peak_mib;
  if (estimate > 0) j["peak_estimate_mib"] = static_cast<double>(estimate) / (1 << 20);
  if (!o.json.empty()) {
    write_text_file(o.json, j.dump(2) + "\n", "--json");
    out << "  wrote " << o.json << "\n";
  }
  return 0;
}

}  // namespace

int run_bench(const BenchOptions& options, const Comm& world, const RuntimeOptions& runtime,
              std::ostream& out) {
  agree(world, [&] { check_dtype(options.dtype, runtime); });
  return with_dtype(options.dtype,
                    [&](auto zero) { return bench<decltype(zero)>(options, world, runtime, out); });
}

}  // namespace tessera
