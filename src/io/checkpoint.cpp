#include "tessera/io/checkpoint.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "tessera/error.hpp"
#include "tessera/io/hdf5.hpp"
#include "tessera/io/params_io.hpp"

namespace tessera {
namespace {

// Checks that dataset `name` holds `count` numbers of `kind` before it is read: a damaged file
// may claim any shape (tests/fuzz/fuzz_checkpoint).
void check_holds(const h5::File& f, const std::string& name, std::int64_t count, h5::Kind kind) {
  TESSERA_CHECK(f.has(name), "'" + f.path() + "' is not a complete checkpoint: no " + name);
  const h5::DatasetInfo info = f.info(name);
  std::int64_t n = 1;
  for (const std::int64_t d : info.dims)
    n *= d;  // info() refuses shapes whose count overflows
  TESSERA_CHECK(info.kind == kind && info.dims.size() <= 1 && n == count,
                "'" + f.path() + "' is not a complete checkpoint: " + name + " holds " +
                    std::to_string(n) + " " + info.type_name() + " value(s), not " +
                    std::to_string(count) +
                    (kind == h5::Kind::integer ? " integer(s)" : " floating-point value(s)"));
}

std::int64_t read_int(const h5::File& f, const std::string& name) {
  check_holds(f, name, 1, h5::Kind::integer);
  return f.read<std::int64_t>(name).front();
}

void write_int(h5::File& f, const std::string& name, std::int64_t v) {
  f.write<std::int64_t>(name, std::span<const std::int64_t>(&v, 1), {});
}

// A tensor about to be written must hold finite numbers only.
template <typename T>
void require_finite(const Tensor<T>& t, const std::string& what, const std::string& path) {
  const auto values = t.span();
  const auto bad =
      std::find_if(values.begin(), values.end(), [](T v) { return !std::isfinite(v); });
  TESSERA_CHECK(bad == values.end(), "not writing '" + path + "': " + what + " holds " +
                                         (std::isnan(*bad) ? "NaN" : "infinity") +
                                         " (the run diverged)");
}

const std::regex& checkpoint_name() {
  static const std::regex pattern(R"(checkpoint-(\d+)\.h5)");
  return pattern;
}

// What write_atomically (src/io/hdf5.cpp) leaves behind when its writer is killed.
const std::regex& temporary_name() {
  static const std::regex pattern(R"(\.checkpoint-\d+\.h5\.tmp\.\d+)");
  return pattern;
}

// The root attributes are not datasets, so verify_checksums does not see them: their CRC-32 is
// kept in the dataset /state/attributes_crc32.
std::int64_t attributes_checksum(const h5::File& f) {
  std::string text;
  for (const char* name : {"format", "options", "model", "grid", "dtype", "optimizer"})
    text += (f.has_attribute(name) ? f.attribute(name) : std::string("-")) + '\0';
  return h5::checksum({reinterpret_cast<const unsigned char*>(text.data()), text.size()});
}

void check_format(const h5::File& f) {
  TESSERA_CHECK(f.has_attribute("format"), "'" + f.path() +
                                               "' is not a Tessera checkpoint (it has no root "
                                               "attribute 'format')");
  const std::string format = f.attribute("format");
  TESSERA_CHECK(
      format == kCheckpointFormat,
      "'" + f.path() + "' is a '" + format + "' file, not a '" + kCheckpointFormat +
          "' checkpoint" +
          (format.starts_with("tessera-checkpoint-") ? " (written by another version of Tessera)"
                                                     : ""));
}

}  // namespace

std::string checkpoint_path(const std::string& dir, std::int64_t step) {
  return (std::filesystem::path(dir) / ("checkpoint-" + std::to_string(step) + ".h5")).string();
}

namespace {

// The checkpoints of `dir` with their steps, the highest step first.
std::vector<std::pair<std::int64_t, std::string>> checkpoints_by_step(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::pair<std::int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return {};
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, m, checkpoint_name())) continue;
    std::int64_t step = 0;
    try {
      step = std::stoll(m[1].str());
    } catch (const std::out_of_range&) {
      continue;  // not one of ours: no run takes 10^19 steps
    }
    found.emplace_back(step, entry.path().string());
  }
  std::sort(found.begin(), found.end(), std::greater<>());
  return found;
}

}  // namespace

std::vector<std::string> checkpoints_newest_first(const std::string& dir) {
  std::vector<std::string> paths;
  for (auto& [step, path] : checkpoints_by_step(dir))
    paths.push_back(std::move(path));
  return paths;
}

std::vector<std::string> checkpoints_after(const std::string& dir, std::int64_t step) {
  std::vector<std::string> later;
  for (auto& [s, path] : checkpoints_by_step(dir))
    if (s > step) later.push_back(std::move(path));
  return later;
}

std::vector<std::string> prune_checkpoints(const std::string& dir, std::int64_t keep,
                                           std::int64_t written) {
  namespace fs = std::filesystem;
  std::vector<std::string> remove;
  // Those of later steps are not this run's (another run's, or damaged files a resume skipped):
  // counting them among the newest would remove what this run just wrote.
  std::vector<std::string> ours;
  for (auto& [step, path] : checkpoints_by_step(dir))
    if (step <= written) ours.push_back(std::move(path));
  if (keep > 0)
    for (std::size_t k = static_cast<std::size_t>(keep); k < ours.size(); ++k)
      remove.push_back(ours[k]);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (std::regex_match(entry.path().filename().string(), temporary_name()))
      remove.push_back(entry.path().string());
  std::vector<std::string> failed;
  for (const std::string& path : remove) {
    std::error_code err;
    fs::remove(path, err);
    if (err) failed.push_back("cannot remove '" + path + "': " + err.message());
  }
  return failed;
}

void verify_checkpoint(const std::string& path) {
  const h5::File f = h5::File::open_read(path);
  check_format(f);
  f.verify_checksums(true);
  for (const char* name : {"/state/step", "/state/epoch", "/state/seed", "/state/optimizer_steps",
                           "/state/window_steps", "/state/window_loss", "/state/attributes_crc32"})
    TESSERA_CHECK(f.has(name), "'" + path + "' is not a complete checkpoint: no " + name);
  TESSERA_CHECK(read_int(f, "/state/attributes_crc32") == attributes_checksum(f),
                "'" + path +
                    "': its root attributes (model, options...) do not match their checksum (the "
                    "file was changed or damaged after it was written)");
}

template <typename T>
void write_checkpoint(const std::string& path, Model<T>& model, Optimizer<T>& optimizer,
                      const CheckpointState& state) {
  for (auto& p : model.params())
    require_finite(to_host(p.param->value), "parameter '" + p.key() + "'", path);
  for (auto& b : model.buffers())
    require_finite(to_host(b.buffer->value), "buffer '" + b.key() + "'", path);
  for (const OptimizerSlot<T>& s : optimizer.slots())
    require_finite(to_host(*s.tensor), "optimizer state '" + s.name + "'", path);
  h5::write_atomically(path, [&](h5::File& f) {
    f.set_attribute("format", kCheckpointFormat);
    f.set_attribute("options", nlohmann::json(state.options).dump());
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
    write_int(f, "/state/attributes_crc32", attributes_checksum(f));
  });
}

template <typename T>
CheckpointState read_checkpoint(const std::string& path, Model<T>& model, Optimizer<T>& optimizer,
                                const CheckpointState& expect) {
  verify_checkpoint(path);
  const h5::File f = h5::File::open_read(path);
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
  read_params(f, model);
  for (const OptimizerSlot<T>& slot : optimizer.slots()) {
    const std::string name = "/optimizer/" + slot.name;
    check_holds(f, name, slot.tensor->numel(), h5::Kind::floating);
    const std::vector<T> v = f.read<T>(name);
    upload(v.data(), *slot.tensor);
  }
  s.step = read_int(f, "/state/step");
  s.epoch = read_int(f, "/state/epoch");
  s.seed = static_cast<std::uint64_t>(read_int(f, "/state/seed"));
  const std::int64_t optimizer_steps = read_int(f, "/state/optimizer_steps");
  s.batch = read_int(f, "/state/batch");
  s.samples = read_int(f, "/state/samples");
  s.window_steps = read_int(f, "/state/window_steps");
  // A negative step would index the data order and the schedule before their start.
  TESSERA_CHECK(s.step >= 0 && s.epoch >= 0 && optimizer_steps >= 0 && s.window_steps >= 0,
                "'" + path + "' is damaged: its /state holds a negative step, epoch or count");
  optimizer.set_steps(optimizer_steps);
  check_holds(f, "/state/window_loss", 1, h5::Kind::floating);
  s.window_loss = f.read<double>("/state/window_loss").front();
  const auto counts = static_cast<std::int64_t>(expect.window_counts.size());
  if (counts > 0 || f.has("/state/window_counts")) {
    check_holds(f, "/state/window_counts", counts, h5::Kind::integer);
    s.window_counts = f.read<std::int64_t>("/state/window_counts");
  }
  if (f.has_attribute("options")) {
    const nlohmann::json options = nlohmann::json::parse(f.attribute("options"), nullptr, false);
    TESSERA_CHECK(options.is_object(),
                  "'" + path + "': its attribute 'options' is not a JSON object");
    for (const auto& [name, value] : options.items()) {
      TESSERA_CHECK(value.is_string(), "'" + path + "': option '" + name + "' is not a string");
      s.options[name] = value.template get<std::string>();
    }
  }
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
