#include "tessera/drivers/gradcheck.hpp"
#include "tessera/drivers/driver.hpp"
#include "tessera/drivers/memory.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/batch.hpp"
#include "tessera/collectives.hpp"
#include "tessera/engine/graph.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/error.hpp"
#include "tessera/gather.hpp"
#include "tessera/io/params_io.hpp"

namespace tessera {
namespace {

struct Row {
  std::string name;
  std::string shape;
  double max_abs = 0;
  double rel = 0;
};

template <typename T>
double max_abs(std::span<const T> v) {
  double m = 0;
  for (T x : v)
    m = std::max(m, std::abs(double(x)));
  return m;
}

// max |a - b| and that over max(max |b|, floor) (b: the single-rank reference). The floor keeps
// a gradient that is zero in exact arithmetic (a conv bias before a batch norm) from comparing
// rounding noise with rounding noise.
template <typename T>
Row compare(std::string name, std::string shape, std::span<const T> a, std::span<const T> b,
            double floor = 0) {
  double diff = 0;
  for (std::size_t k = 0; k < a.size(); ++k)
    diff = std::max(diff, std::abs(double(a[k]) - double(b[k])));
  if (a.size() != b.size()) diff = INFINITY;
  const double scale = std::max(max_abs(b), floor);
  return {std::move(name), std::move(shape), diff, scale > 0 ? diff / scale : diff};
}

// Gradients are compared relative to at least this fraction of the largest gradient anywhere.
// A gradient that is zero in exact arithmetic is rounding noise of about eps * sqrt(terms)
// times the gradients around it; measured on conv bias -> batch norm at 64^2 and 256^2 images:
// float64 noise 2e-12 and 7e-12 of the floor below, float32 9e-6 and 2e-5 of 1e-2's. On small
// images float32's noise is larger: a randomised campaign of ~7000 gradchecks (2026-11-29) found
// conv biases before a batch norm at 1.1e-4 to 2.7e-4 of a 1e-2 floor (17x33 to 40x24 images;
// 4.1e-7 against a largest gradient of 0.18): float32's floor is 1e-1.
template <typename T>
constexpr double kGradientFloor = std::is_same_v<T, float> ? 1e-1 : 1e-3;

// A batch norm's running mean is compared relative to at least kGradientFloor of its channels'
// spread, the square root of the largest running variance of the same layer: the mean of an input
// that is normalised already (a batch norm after a batch norm and a pooling) is zero in exact
// arithmetic, and its running mean rounding noise (1e-18 against a variance of 1: a relative
// error of 0.75 between two grids' noise, found by a randomised gradcheck campaign). Other
// buffers: no floor.
template <typename T>
double buffer_floor(std::span<const NamedBuffer<T>> buffers, std::size_t k) {
  const std::string& key = buffers[k].key();
  const std::string suffix = "/running_mean";
  if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix))
    return 0;
  const std::string var = key.substr(0, key.size() - suffix.size()) + "/running_var";
  for (const NamedBuffer<T>& b : buffers)
    if (b.key() == var) {
      const Tensor<T> variance = to_host(b.buffer->value);
      return kGradientFloor<T> * std::sqrt(max_abs(variance.span()));
    }
  return 0;
}

std::string dims_text(const std::vector<std::int64_t>& dims) {
  std::string text;
  for (std::int64_t d : dims)
    text += (text.empty() ? "" : "x") + std::to_string(d);
  return text;
}

template <typename T>
void write_result(h5::File& f, const std::string& group, double loss, const Tensor<T>& output,
                  const Tensor<T>& input_grad, Model<T>& model) {
  f.write<double>(group + "/loss", std::span<const double>(&loss, 1), {});
  const Shape4& o = output.shape();
  const Shape4& i = input_grad.shape();
  f.write<T>(group + "/output", output.span(), {o.n, o.c, o.h, o.w});
  f.write<T>(group + "/input_grad", input_grad.span(), {i.n, i.c, i.h, i.w});
  write_params(f, model, group + "/grads", ParamField::grad);
  write_buffers(f, model, group + "/buffers");
}

// This rank's tile of the batch: from the file, or drawn from the seed. Local (the file read is
// this rank's hyperslab).
template <typename T>
void tile_of_batch(std::optional<h5::File>& input, std::uint64_t seed, DistTensor<T>& x,
                   const Distribution& label_dist, Labels& labels) {
  if (input) {
    x.local = read_image_tile<T>(*input, x.dist);
    labels = read_label_tile(*input, label_dist);
  } else {
    x.local = random_image_tile<T>(x.dist, seed);
    labels = random_label_tile(label_dist, seed);
  }
}

// The single-rank run of the same step: the sharded model's parameters, the buffers it started
// from, the whole batch. Local (rank 0 alone).
template <typename T>
struct Reference {
  std::unique_ptr<Model<T>> model;
  DistTensor<T> x;
  Labels labels;
  StepResult<T> result;
  double seconds = 0;
};

template <typename T>
Reference<T> reference_step(const ModelSpec& spec, const Runtime& single, Shape4 shape,
                            Model<T>& sharded, const std::vector<Tensor<T>>& initial_buffers,
                            std::optional<h5::File>& input, std::uint64_t seed) {
  Reference<T> r;
  r.model = std::make_unique<Model<T>>(spec, single, shape);
  r.model->state() = sharded.state();
  auto mine = sharded.params();
  auto theirs = r.model->params();
  for (std::size_t k = 0; k < mine.size(); ++k)
    theirs[k].param->value = mine[k].param->value;
  auto their_buffers = r.model->buffers();
  for (std::size_t k = 0; k < their_buffers.size(); ++k)
    their_buffers[k].buffer->value = initial_buffers[k];
  r.x = DistTensor<T>(r.model->input_distribution());
  tile_of_batch(input, seed, r.x, r.model->output_distribution(), r.labels);
  const auto t0 = std::chrono::steady_clock::now();
  r.result = forward_backward(*r.model, r.x, r.labels);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// One row per quantity: loss, output, input gradient, every parameter gradient and buffer.
template <typename T>
std::vector<Row> compare_all(Model<T>& sharded, const StepResult<T>& step, const Tensor<T>& output,
                             const Tensor<T>& input_grad, Reference<T>& ref) {
  const StepResult<T>& r = ref.result;
  auto mine = sharded.params();
  auto theirs = ref.model->params();
  auto my_buffers = sharded.buffers();
  auto their_buffers = ref.model->buffers();
  std::vector<Row> rows;
  rows.push_back(compare<double>("loss", "1", std::span<const double>(&step.loss, 1),
                                 std::span<const double>(&r.loss, 1)));
  // The models' tensors lie where their backend computes: compared in host copies.
  const Tensor<T> ref_output = to_host(r.output.local),
                  ref_input_grad = to_host(r.input_grad.local);
  std::vector<Tensor<T>> my_grads, their_grads;
  for (std::size_t k = 0; k < mine.size(); ++k) {
    my_grads.push_back(to_host(mine[k].param->grad));
    their_grads.push_back(to_host(theirs[k].param->grad));
  }
  rows.push_back(compare<T>("output", output.shape().str(), output.span(), ref_output.span()));
  double largest = max_abs(ref_input_grad.span());
  for (const Tensor<T>& g : their_grads)
    largest = std::max(largest, max_abs(g.span()));
  const double floor = kGradientFloor<T> * largest;
  rows.push_back(compare<T>("input_grad", input_grad.shape().str(), input_grad.span(),
                            ref_input_grad.span(), floor));
  for (std::size_t k = 0; k < mine.size(); ++k)
    rows.push_back(compare<T>(mine[k].key(), dims_text(torch_param_dims(sharded, mine[k])),
                              my_grads[k].span(), their_grads[k].span(), floor));
  for (std::size_t k = 0; k < my_buffers.size(); ++k)
    rows.push_back(compare<T>(
        my_buffers[k].key(), std::to_string(my_buffers[k].buffer->value.numel()),
        to_host(my_buffers[k].buffer->value).span(), to_host(their_buffers[k].buffer->value).span(),
        buffer_floor<T>(their_buffers, k)));
  return rows;
}

// The layers either model computes with a Winograd kernel (their kernel summary names
// oneDNN's jit_wino), comma-separated; empty if none. Local.
template <typename T>
std::string winograd_layers(const Model<T>& sharded, const Model<T>& reference) {
  std::vector<std::string> names;
  for (const Model<T>* m : {&sharded, &reference})
    for (const auto& [name, summary] : m->kernel_summaries())
      if (summary.find("wino") != std::string::npos &&
          std::find(names.begin(), names.end(), name) == names.end())
        names.push_back(name);
  std::string text;
  for (const std::string& n : names)
    text += (text.empty() ? "" : ", ") + n;
  return text;
}

// Prints the table; returns how many rows exceed rtol. Local.
int print_rows(std::ostream& out, const std::vector<Row>& rows, double rtol) {
  out << "  " << std::left << std::setw(22) << "quantity" << std::setw(16) << "shape"
      << std::setw(14) << "max abs err"
      << "rel err\n";
  int failed = 0;
  for (const Row& row : rows) {
    out << "  " << std::left << std::setw(22) << row.name << std::setw(16) << row.shape
        << std::setw(14) << std::setprecision(3) << std::scientific << row.max_abs << row.rel
        << (row.rel > rtol ? "  FAIL" : "") << std::defaultfloat << "\n";
    if (!(row.rel <= rtol)) ++failed;
  }
  return failed;
}

// The dump (README "Files"), written to a temporary file and renamed. Local.
template <typename T>
void write_dump(const GradcheckOptions& o, const ModelSpec& spec, Model<T>& sharded,
                const StepResult<T>& step, const Tensor<T>& output, const Tensor<T>& input_grad,
                Reference<T>& ref, const std::vector<Tensor<T>>& initial_buffers) {
  h5::write_atomically(o.dump, [&](h5::File& f) {
    f.set_attribute("format", "tessera-gradcheck-1");
    f.set_attribute("grid", o.grid.str());
    f.set_attribute("dtype", o.dtype);
    f.set_attribute("model", spec.json);
    f.set_attribute("mode", o.mode);
    write_params(f, *ref.model, "/params", ParamField::value);
    auto their_buffers = ref.model->buffers();
    for (std::size_t k = 0; k < their_buffers.size(); ++k)
      f.write<T>("/buffers/" + their_buffers[k].key(), initial_buffers[k].span(),
                 {initial_buffers[k].numel()});
    write_batch(f, "/batch", ref.x.local, ref.labels, ref.model->output_distribution());
    for (auto& m : ref.model->masks()) {
      const Tensor<T> mask = to_host(m.buffer->value);
      const Shape4& s = mask.shape();
      f.write<T>("/masks/" + m.layer, mask.span(), {s.n, s.c, s.h, s.w});
    }
    write_result(f, "/sharded", step.loss, output, input_grad, sharded);
    write_result(f, "/reference", ref.result.loss, to_host(ref.result.output.local),
                 to_host(ref.result.input_grad.local), *ref.model);
  });
}

template <typename T>
int run(const GradcheckOptions& o, const Comm& world, const RuntimeOptions& ro, std::ostream& out) {
  using clock = std::chrono::steady_clock;
  ModelSpec spec;
  agree(world, [&] { spec = load_model(o.model); });
  const Runtime runtime = make_runtime(world, o.grid, ro);
  const Comm& grid = runtime.comm();

  // The batch's shape: from the file, or from the options.
  std::optional<h5::File> input;
  Shape4 shape{o.batch, o.channels > 0 ? o.channels : spec.input_channels, o.height, o.width};
  BatchFileInfo file_info{};
  agree(world, [&] {
    check_dtype(o.dtype, ro);
    TESSERA_CHECK(o.mode == "train" || o.mode == "eval",
                  "bad mode '" + o.mode + "': expected train or eval");
    TESSERA_CHECK(o.rtol >= 0 && std::isfinite(o.rtol),
                  "--rtol must be a finite number >= 0 (0: the default of the dtype), got " +
                      std::to_string(o.rtol));
    // Say so now rather than after the work: the dump must be writable.
    check_outputs_apart({{"--dump", o.dump}},
                        {{"--input", o.input}, {"--init", o.init}, {"--model", o.model}});
    if (!o.dump.empty() && world.rank() == 0) check_writable(o.dump, "--dump");
    if (o.input.empty()) {
      TESSERA_CHECK(o.batch > 0 && o.height > 0 && o.width > 0,
                    "--batch, --height and --width must be positive");
      TESSERA_CHECK(o.channels >= 0,
                    "--channels must not be negative (0: the model's input channels)");
      return;
    }
    input.emplace(h5::File::open_read(o.input));
    file_info = inspect_batch_file(*input);
    shape = file_info.images;
  });

  check_same_everywhere(world, "configuration",
                        spec.json + "|" + o.grid.str() + "|" + shape.str() + "|" + o.dtype + "|" +
                            o.init + "|" + o.input + "|" + std::to_string(o.seed) + "|" + __DATE__ +
                            __TIME__);

  const MemoryBudget memory = run_memory_budget(world, ro.kernels);
  std::optional<Model<T>> model;
  agree(world, [&] {
    // Before anything the size of the image is allocated or computed; rank 0 also runs the whole
    // batch alone.
    check_run_memory(spec,
                     {.grid = o.grid,
                      .input = shape,
                      .dtype = o.dtype,
                      .single_reference = grid.rank() == 0,
                      .evaluates = o.mode != "train",
                      .engine = plan_engine(runtime.options())},
                     memory);
    model.emplace(spec, runtime, shape);
    if (o.mode == "train") model->check_trainable();
    const Shape4& g = model->output_distribution().global;
    if (input)
      TESSERA_CHECK(file_info.labels == (std::array<std::int64_t, 3>{g.n, g.h, g.w}),
                    "'" + o.input + "': /labels is " + std::to_string(file_info.labels[0]) + "x" +
                        std::to_string(file_info.labels[1]) + "x" +
                        std::to_string(file_info.labels[2]) + " but the model's output is " +
                        std::to_string(g.n) + "x" + std::to_string(g.h) + "x" +
                        std::to_string(g.w) + " (N x H x W)");
    if (o.init.empty()) {
      model->init_params(o.seed);
    } else {
      read_params(o.init, *model);
    }
  });
  const RunState state{.mode = o.mode == "eval" ? Mode::eval : Mode::train, .seed = o.seed};
  model->state() = state;
  // The step updates the buffers (batch norm's running statistics): keep the values it starts
  // from, for the reference run and the dump.
  std::vector<Tensor<T>> initial_buffers;
  for (auto& b : model->buffers())
    initial_buffers.push_back(b.buffer->value);

  // This rank's tile of the batch.
  DistTensor<T> x(model->input_distribution());
  Labels labels;
  const Distribution& label_dist = model->output_distribution();
  agree(world, [&] { tile_of_batch(input, o.seed, x, label_dist, labels); });

  // With --precision bf16 both runs round their conv inputs to bfloat16 (8 bits), and a value
  // that differs between them in its last float32 bits may round to the next bfloat16: the
  // gradients then agree to about 3e-3 (README.md "Mixed precision"), not to
  // float32's 1e-4.
  const double rtol = o.rtol > 0                 ? o.rtol
                      : ro.bf16                  ? 1e-2
                      : std::is_same_v<T, float> ? 1e-4
                                                 : 1e-10;
  const bool root = grid.rank() == 0;
  if (root) {
    out << "tessera gradcheck: model " << spec.name << ", grid " << o.grid.str() << " ("
        << o.grid.size() << " ranks), " << o.dtype << ", batch " << shape.str() << ", rtol " << rtol
        << "\n";
    const Box t = x.dist.tile();
    out << "  rank 0 tile: rows " << to_string(t.h) << ", columns " << to_string(t.w)
        << ", samples " << to_string(x.dist.samples());
    if (const std::string spread = tile_spread_text(x.dist); !spread.empty()) out << "; " << spread;
    out << "\n";
  }

  const auto t0 = clock::now();
  StepResult<T> sharded = forward_backward(*model, x, labels);
  const double sharded_s = std::chrono::duration<double>(clock::now() - t0).count();
  const Tensor<T> output = gather_to_root(sharded.output, grid);
  const Tensor<T> input_grad = gather_to_root(sharded.input_grad, grid);

  // The single-rank reference, on rank 0 only; the others wait at the agreement, with no deadline:
  // it takes as long as the whole model takes on one rank (the watchdog's --timeout is per wait).
  const std::unique_ptr<Comm> patient =
      world.make_grid(world.shape(), {world.wait_settings().policy, kNoTimeout});
  int failed = 0;
  agree(*patient, [&] {
    if (!root) return;
    Reference<T> ref =
        reference_step(spec, runtime.single(), shape, *model, initial_buffers, input, o.seed);
    const std::vector<Row> rows = compare_all(*model, sharded, output, input_grad, ref);
    failed = print_rows(out, rows, rtol);
    out << std::setprecision(3) << "  loss " << std::setprecision(12) << sharded.loss
        << std::setprecision(3) << "; sharded " << sharded_s << " s, single rank " << ref.seconds
        << " s\n";
    if (!o.dump.empty()) {
      write_dump(o, spec, *model, sharded, output, input_grad, ref, initial_buffers);
      out << "  wrote " << o.dump << "\n";
    }
    if (failed && std::is_same_v<T, float>) {
      const std::string wino = winograd_layers(*model, *ref.model);
      if (!wino.empty())
        out << "  note: float32 with Winograd convolutions (" << wino
            << "): each run places Winograd's tiles\n"
               "  relative to its own tile, so the sharded forward pass differs from the single "
               "rank's in its\n"
               "  last bits, and a ReLU whose input lies that close to 0 may switch sides, moving "
               "every\n"
               "  gradient before it by far more than rounding. TESSERA_WINOGRAD=0 makes the "
               "forward pass\n"
               "  bit-identical; --dtype float64 (the default) checks to 1e-10.\n";
    }
    if (failed)
      out << "FAIL: " << failed << " of " << rows.size() << " quantities exceed rtol " << rtol
          << "\n";
    else
      out << "PASS: all " << rows.size() << " quantities within rtol " << rtol << "\n";
  });
  failed = allreduce_max(world, failed);
  return failed ? 1 : 0;
}

}  // namespace

int run_gradcheck(const GradcheckOptions& options, const Comm& world, const RuntimeOptions& runtime,
                  std::ostream& out) {
  return with_dtype(options.dtype,
                    [&](auto zero) { return run<decltype(zero)>(options, world, runtime, out); });
}

}  // namespace tessera
