#include "tessera/bench.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "tessera/batch.hpp"
#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/model.hpp"
#include "tessera/model_spec.hpp"
#include "tessera/optimizer.hpp"
#include "tessera/wait.hpp"

namespace tessera {
namespace {

using clock_type = std::chrono::steady_clock;

// The numbers one rank measured, flattened so that one reduction gives their maximum over ranks:
// per layer and pass [seconds, halo, waiting, allreduce], then the gradient reduction's
// [seconds, halo, waiting, allreduce], then the step time.
constexpr int kPerPass = 4;

void append(std::vector<double>& v, const PassTiming& t, double steps) {
  v.push_back(t.seconds / steps);
  for (double s : t.comm.seconds)
    v.push_back(s / steps);
}

struct PassRow {
  double seconds = 0, halo = 0, waiting = 0, allreduce = 0;
  double compute() const { return seconds - halo - waiting - allreduce; }
};

PassRow row_at(const std::vector<double>& v, std::size_t at) {
  return {v[at], v[at + 1], v[at + 2], v[at + 3]};
}

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

std::string pad(const std::string& s, std::size_t width, bool left = false) {
  if (s.size() >= width) return s;
  return left ? s + std::string(width - s.size(), ' ') : std::string(width - s.size(), ' ') + s;
}

template <typename T>
int bench(const BenchOptions& o, MPI_Comm world, std::ostream& out) {
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  const bool root = rank == 0;
  ModelSpec spec;
  agree(world, [&] {
    TESSERA_CHECK(o.steps >= 1, "--steps must be at least 1, got " + std::to_string(o.steps));
    TESSERA_CHECK(o.warmup >= 0, "--warmup must be at least 0, got " + std::to_string(o.warmup));
    TESSERA_CHECK(o.grid.size() == size,
                  "grid " + o.grid.str() + " has " + std::to_string(o.grid.size()) +
                      " ranks but the job has " + std::to_string(size) + " (use mpiexec -n " +
                      std::to_string(o.grid.size()) + ")");
    spec = load_model(o.model);
    if (root && !o.json.empty())
      TESSERA_CHECK(std::ofstream(o.json).good(), "cannot write '" + o.json + "'");
  });
  ProcessGrid grid(world, o.grid);
  std::optional<Model<T>> model;
  Shape4 input = o.image;
  if (input.c == 0) input.c = spec.input_channels;
  agree(world, [&] { model.emplace(spec, grid, input); });
  model->init_params(o.seed);
  Optimizer<T> optimizer({.kind = OptimizerKind::sgd, .momentum = 0}, *model);

  DistTensor<T> x(model->input_distribution());
  x.local = random_image_tile<T>(x.dist, o.seed);
  const std::vector<std::int32_t> labels = random_label_tile(model->output_distribution(), o.seed);

  const double sgemm = o.sgemm ? sgemm_gflops() : 0;

  if (root) {
    out << "tessera bench: model " << spec.name << " (" << model->parameter_count()
        << " parameters), " << o.dtype << ", grid " << o.grid.str() << " (" << size
        << (size == 1 ? " rank" : " ranks") << "), image " << input.c << "x" << input.h << "x"
        << input.w << ", batch " << input.n << "\n"
        << "  kernels: " << kernel_backend_description() << "\n"
        << "  waiting: " << to_string(wait_policy()) << "; " << o.warmup << " warm-up step"
        << (o.warmup == 1 ? "" : "s") << ", then " << o.steps << " timed; SGD lr " << o.lr << "\n"
        << std::flush;
  }

  double step_seconds = 0;
  for (std::int64_t s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) {
      model->reset_timings();
      step_seconds = 0;
    }
    model->state() = {.mode = Mode::train, .seed = o.seed, .step = s};
    const auto began = clock_type::now();
    const StepResult<T> r = forward_backward(*model, x, labels, grid);
    optimizer.step(o.lr);
    step_seconds += std::chrono::duration<double>(clock_type::now() - began).count();
    agree(world, [&] {
      TESSERA_CHECK(std::isfinite(r.loss), "the loss became " + std::to_string(r.loss) +
                                               " at step " + std::to_string(s) +
                                               " (try a smaller --lr)");
    });
  }

  const auto steps = static_cast<double>(o.steps);
  const std::vector<LayerTiming>& layers = model->timings();
  std::vector<double> v;
  for (const LayerTiming& t : layers) {
    append(v, t.forward, steps);
    append(v, t.backward, steps);
  }
  append(v, model->reduce_timing(), steps);
  v.push_back(step_seconds / steps);
  // This rank's compute and waiting per step, for the balance between ranks: a rank that waits
  // long for halos waits for a slower peer.
  std::vector<double> balance(2 * static_cast<std::size_t>(size), 0.0);
  for (std::size_t at = 0; at < layers.size() * 2 * kPerPass; at += kPerPass) {
    const PassRow r = row_at(v, at);
    balance[2 * static_cast<std::size_t>(rank)] += r.compute();
    balance[2 * static_cast<std::size_t>(rank) + 1] += r.waiting;
  }
  allreduce_sum(std::span<double>(balance), world);
  // Each number's maximum over ranks: the slowest rank sets the pace.
  allreduce_max(std::span<double>(v), world);
  double sgemm_min = sgemm;
  {
    std::vector<double> neg{-sgemm};
    allreduce_max(std::span<double>(neg), world);
    sgemm_min = -neg[0];
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const int peak_kib = allreduce_max(static_cast<int>(usage.ru_maxrss), world);
  if (!root) return 0;

  // Which conv layers count as ">= 32 channels": both sides of the weight.
  auto wide = [&](const std::string& layer) {
    for (const NamedParam<T>& p : model->params())
      if (p.layer == layer && p.param->name == "weight")
        return std::min(p.param->value.shape().n, p.param->value.shape().c) >= 32;
    return false;
  };

  nlohmann::json j;
  j["model"] = spec.name;
  j["dtype"] = o.dtype;
  j["grid"] = o.grid.str();
  j["ranks"] = size;
  j["image"] = {input.c, input.h, input.w};
  j["batch"] = input.n;
  j["threads_per_rank"] = kernel_threads().count;
  j["kernels"] = kernel_backend_description();
  j["steps"] = o.steps;

  out << "  per layer, ms per step (each the maximum over ranks); GFLOP/s of this rank's work\n"
      << "  over its compute time\n";
  out << "  " << pad("layer", 8, true) << " " << pad("type", 12, true) << " "
      << pad("pass", 8, true) << pad("total", 10) << pad("compute", 10) << pad("halo", 9)
      << pad("waiting", 9) << pad("allreduce", 10) << pad("GFLOP/s", 9) << "\n";
  double conv_flops = 0, conv_seconds = 0, wide_flops = 0, wide_seconds = 0;
  PassRow sum;
  std::size_t at = 0;
  j["layers"] = nlohmann::json::array();
  for (const LayerTiming& t : layers) {
    for (int pass = 0; pass < 2; ++pass, at += kPerPass) {
      const PassRow r = row_at(v, at);
      sum.seconds += r.seconds;
      sum.halo += r.halo;
      sum.waiting += r.waiting;
      sum.allreduce += r.allreduce;
      const double flops = pass == 0 ? t.flops.forward : t.flops.backward;
      const double gflops = flops > 0 && r.compute() > 0 ? flops / r.compute() / 1e9 : 0;
      if (flops > 0) {
        conv_flops += flops;
        conv_seconds += r.compute();
        if (wide(t.name)) {
          wide_flops += flops;
          wide_seconds += r.compute();
        }
      }
      const char* name = pass == 0 ? "forward" : "backward";
      out << "  " << pad(pass == 0 ? t.name : "", 8, true) << " "
          << pad(pass == 0 ? t.type : "", 12, true) << " " << pad(name, 8, true)
          << pad(fixed(r.seconds * 1e3, 1), 10) << pad(fixed(r.compute() * 1e3, 1), 10)
          << pad(fixed(r.halo * 1e3, 1), 9) << pad(fixed(r.waiting * 1e3, 1), 9)
          << pad(fixed(r.allreduce * 1e3, 1), 10) << pad(gflops > 0 ? fixed(gflops, 1) : "-", 9)
          << "\n";
      j["layers"].push_back({{"name", t.name},
                             {"type", t.type},
                             {"pass", name},
                             {"seconds", r.seconds},
                             {"compute", r.compute()},
                             {"halo", r.halo},
                             {"waiting", r.waiting},
                             {"allreduce", r.allreduce},
                             {"gflops", gflops}});
    }
  }
  const PassRow reduce = row_at(v, at);
  const double step = v[at + kPerPass];
  const double exposed = sum.halo + sum.waiting + sum.allreduce + reduce.seconds;
  const double other = std::max(0.0, step - sum.seconds - reduce.seconds);
  out << "  " << pad("", 8, true) << " " << pad("gradients", 12, true) << " "
      << pad("reduce", 8, true) << pad(fixed(reduce.seconds * 1e3, 1), 10) << pad("", 10)
      << pad("", 9) << pad("", 9) << pad(fixed(reduce.seconds * 1e3, 1), 10) << "\n";
  out << "  step " << fixed(step, 3) << " s: compute " << fixed(sum.compute(), 3) << " + halo "
      << fixed(sum.halo, 3) << " + waiting " << fixed(sum.waiting, 3) << " + allreduce "
      << fixed(sum.allreduce + reduce.seconds, 3) << " + other " << fixed(other, 3)
      << " (loss, optimizer)\n";
  if (size > 1) {
    out << "  per rank, compute + waiting for halos per step:";
    for (int k = 0; k < size; ++k)
      out << (k == 0 ? " " : ", ") << fixed(balance[2 * k], 3) << " + "
          << fixed(balance[2 * k + 1], 3) << " s";
    out << "\n";
  }
  out << "  exposed communication (halo + waiting + allreduce): " << fixed(100 * exposed / step, 1)
      << "% of the step\n";
  const double conv_rate = conv_seconds > 0 ? conv_flops / conv_seconds / 1e9 : 0;
  const double wide_rate = wide_seconds > 0 ? wide_flops / wide_seconds / 1e9 : 0;
  out << "  convolutions: " << fixed(conv_flops / 1e9, 1) << " GFLOP per step on rank 0, "
      << fixed(conv_rate, 1) << " GFLOP/s";
  if (wide_seconds > 0) out << "; those with >= 32 channels " << fixed(wide_rate, 1) << " GFLOP/s";
  out << "\n";
  if (sgemm > 0) {
    out << "  sgemm: " << fixed(sgemm_min, 1) << " GFLOP/s per rank (oneDNN, 2048^3, "
        << kernel_threads().count << (kernel_threads().count == 1 ? " thread" : " threads")
        << ", slowest rank)";
    if (wide_seconds > 0)
      out << "; convolutions >= 32 channels at " << fixed(100 * wide_rate / sgemm_min, 0)
          << "% of it";
    out << "\n";
  }
  out << "  throughput " << fixed(static_cast<double>(input.n) / step, 3)
      << " images/s; peak memory per rank " << fixed(peak_kib / 1024.0, 1) << " MiB\n";

  j["step_seconds"] = step;
  j["split"] = {{"compute", sum.compute()},
                {"halo", sum.halo},
                {"waiting", sum.waiting},
                {"allreduce", sum.allreduce + reduce.seconds},
                {"other", other}};
  j["exposed_fraction"] = exposed / step;
  j["compute_per_rank"] = nlohmann::json::array();
  j["waiting_per_rank"] = nlohmann::json::array();
  for (int k = 0; k < size; ++k) {
    j["compute_per_rank"].push_back(balance[2 * k]);
    j["waiting_per_rank"].push_back(balance[2 * k + 1]);
  }
  j["conv_gflop_per_step"] = conv_flops / 1e9;
  j["conv_gflops"] = conv_rate;
  j["conv32_gflops"] = wide_rate;
  j["sgemm_gflops_per_rank"] = sgemm_min;
  j["peak_mib"] = peak_kib / 1024.0;
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << j.dump(2) << "\n";
    TESSERA_CHECK(f.good(), "cannot write '" + o.json + "'");
    out << "  wrote " << o.json << "\n";
  }
  return 0;
}

}  // namespace

int run_bench(const BenchOptions& options, MPI_Comm world, std::ostream& out) {
  std::string dtype = options.dtype;
  agree(world, [&] {
    TESSERA_CHECK(dtype == "float32" || dtype == "float64",
                  "--dtype must be float32 or float64, got '" + dtype + "'");
  });
  return dtype == "float32" ? bench<float>(options, world, out)
                            : bench<double>(options, world, out);
}

}  // namespace tessera
