#include "tessera/io/checkpoint.hpp"

#include <filesystem>
#include <regex>

#include "tessera/error.hpp"
#include "tessera/io/hdf5.hpp"
#include "tessera/io/params_io.hpp"

namespace tessera {
namespace {

std::int64_t read_int(const h5::File& f, const std::string& name) {
  TESSERA_CHECK(f.has(name), "'" + f.path() + "' is not a complete checkpoint: no " + name);
  return f.read<std::int64_t>(name).at(0);
}

void write_int(h5::File& f, const std::string& name, std::int64_t v) {
  f.write<std::int64_t>(name, std::span<const std::int64_t>(&v, 1), {});
}

}  // namespace

std::string checkpoint_path(const std::string& dir, std::int64_t step) {
  return (std::filesystem::path(dir) / ("checkpoint-" + std::to_string(step) + ".h5")).string();
}

std::string latest_checkpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) return "";
  static const std::regex pattern(R"(checkpoint-(\d+)\.h5)");
  std::string best;
  std::int64_t best_step = -1;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, m, pattern)) continue;
    const std::int64_t step = std::stoll(m[1].str());
    if (step > best_step) {
      best_step = step;
      best = entry.path().string();
    }
  }
  return best;
}

template <typename T>
void write_checkpoint(const std::string& path, Model<T>& model, Optimizer<T>& optimizer,
                      const CheckpointState& state) {
  h5::write_atomically(path, [&](h5::File& f) {
    f.set_attribute("format", kCheckpointFormat);
    f.set_attribute("model", state.model);
    f.set_attribute("grid", state.grid);
    f.set_attribute("dtype", state.dtype);
    f.set_attribute("optimizer", state.optimizer);
    write_params(f, model, "/params", ParamField::value);
    write_buffers(f, model, "/buffers");
    for (const OptimizerSlot<T>& s : optimizer.slots()) {
      const Tensor<T> t = to_host(*s.tensor);
      f.write<T>("/optimizer/" + s.name, t.span(), {t.numel()});
    }
    write_int(f, "/state/step", state.step);
    write_int(f, "/state/epoch", state.epoch);
    write_int(f, "/state/seed", static_cast<std::int64_t>(state.seed));
    write_int(f, "/state/optimizer_steps", optimizer.steps());
    write_int(f, "/state/batch", state.batch);
    write_int(f, "/state/samples", state.samples);
    write_int(f, "/state/window_steps", state.window_steps);
    f.write<double>("/state/window_loss", std::span<const double>(&state.window_loss, 1), {});
    if (!state.window_counts.empty())
      f.write<std::int64_t>("/state/window_counts", state.window_counts,
                            {static_cast<std::int64_t>(state.window_counts.size())});
  });
}

template <typename T>
CheckpointState read_checkpoint(const std::string& path, Model<T>& model, Optimizer<T>& optimizer,
                                const CheckpointState& expect) {
  const h5::File f = h5::File::open_read(path);
  TESSERA_CHECK(f.has_attribute("format") && f.attribute("format") == kCheckpointFormat,
                "'" + path + "' is not a Tessera checkpoint (root attribute 'format' is not '" +
                    kCheckpointFormat + "')");
  CheckpointState s;
  s.model = f.attribute("model");
  s.grid = f.attribute("grid");
  s.dtype = f.attribute("dtype");
  s.optimizer = f.attribute("optimizer");
  TESSERA_CHECK(s.model == expect.model,
                "'" + path +
                    "' was written for another model; resume with the model it was "
                    "trained with, or start afresh in another --checkpoint-dir");
  TESSERA_CHECK(s.dtype == expect.dtype,
                "'" + path + "' holds " + s.dtype + " parameters, this run uses " + expect.dtype);
  TESSERA_CHECK(s.optimizer == expect.optimizer, "'" + path + "' was written by the " +
                                                     s.optimizer + " optimizer, this run uses " +
                                                     expect.optimizer);
  const auto same = [&](const char* name, std::int64_t expected, const std::string& what) {
    const std::int64_t v = read_int(f, std::string("/state/") + name);
    TESSERA_CHECK(v == expected, "'" + path + "' was written by a run with " + what + " " +
                                     std::to_string(v) + ", this run has " +
                                     std::to_string(expected) +
                                     ": it would not continue exactly (resume with the same "
                                     "options, or start afresh in another --checkpoint-dir)");
  };
  same("seed", static_cast<std::int64_t>(expect.seed), "--seed");
  same("batch", expect.batch, "--batch");
  same("samples", expect.samples, "training samples (--data, --val-fraction, --samples)");
  read_params(f, model);
  for (const OptimizerSlot<T>& slot : optimizer.slots()) {
    const std::string name = "/optimizer/" + slot.name;
    TESSERA_CHECK(f.has(name), "'" + path + "' has no optimizer state '" + name + "'");
    const std::vector<T> v = f.read<T>(name);
    TESSERA_CHECK(static_cast<std::int64_t>(v.size()) == slot.tensor->numel(),
                  "'" + path + "': optimizer state '" + name + "' has the wrong size");
    upload(v.data(), *slot.tensor);
  }
  s.step = read_int(f, "/state/step");
  s.epoch = read_int(f, "/state/epoch");
  s.seed = static_cast<std::uint64_t>(read_int(f, "/state/seed"));
  optimizer.set_steps(read_int(f, "/state/optimizer_steps"));
  s.batch = read_int(f, "/state/batch");
  s.samples = read_int(f, "/state/samples");
  s.window_steps = read_int(f, "/state/window_steps");
  TESSERA_CHECK(f.has("/state/window_loss"),
                "'" + path + "' is not a complete checkpoint: no /state/window_loss");
  s.window_loss = f.read<double>("/state/window_loss").at(0);
  if (f.has("/state/window_counts")) s.window_counts = f.read<std::int64_t>("/state/window_counts");
  return s;
}

template void write_checkpoint(const std::string&, Model<float>&, Optimizer<float>&,
                               const CheckpointState&);
template void write_checkpoint(const std::string&, Model<double>&, Optimizer<double>&,
                               const CheckpointState&);
template CheckpointState read_checkpoint(const std::string&, Model<float>&, Optimizer<float>&,
                                         const CheckpointState&);
template CheckpointState read_checkpoint(const std::string&, Model<double>&, Optimizer<double>&,
                                         const CheckpointState&);

}  // namespace tessera
