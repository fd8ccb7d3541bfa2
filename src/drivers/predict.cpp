#include "tessera/drivers/predict.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "tessera/checked.hpp"
#include "tessera/collectives.hpp"
#include "tessera/drivers/driver.hpp"
#include "tessera/drivers/memory.hpp"
#include "tessera/drivers/plan.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/error.hpp"
#include "tessera/h5_dataset.hpp"
#include "tessera/io/checkpoint.hpp"
#include "tessera/io/hdf5.hpp"
#include "tessera/io/metrics.hpp"
#include "tessera/io/params_io.hpp"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

// Where the weights come from: --checkpoint resolved to one file.
struct Weights {
  std::string path;
  std::string model_json;  // a checkpoint's model (canonical JSON); empty for a params file
  std::string kind;        // "checkpoint" | "parameters"
};

// Rank 0 resolves --checkpoint (a directory: its newest checkpoint that verifies, the others
// listed as skipped) and checks the file's format; every rank gets the answer. Collective.
Weights resolve_weights(const std::string& given, const Comm& world, std::ostream& out) {
  Weights w;
  agree(world, [&] {
    if (world.rank() != 0) return;
    TESSERA_CHECK(!given.empty(),
                  "--checkpoint is required: a checkpoint directory, a checkpoint file (tessera "
                  "train --checkpoint-dir) or a parameter file (README.md \"Files\")");
    TESSERA_CHECK(fs::exists(given), "--checkpoint '" + given + "' does not exist");
    bool verified = false;
    w.path = given;
    if (fs::is_directory(given)) {
      const std::vector<std::string> all = checkpoints_newest_first(given);
      TESSERA_CHECK(!all.empty(), "'" + given + "' holds no checkpoint (checkpoint-<step>.h5)");
      w.path.clear();
      for (const std::string& candidate : all) {
        try {
          verify_checkpoint(candidate);
          w.path = candidate;
          verified = true;
          break;
        } catch (const Error& e) {
          out << "  skipped " << candidate << ": " << e.what() << "\n" << std::flush;
        }
      }
      TESSERA_CHECK(verified, "no checkpoint in '" + given + "' verifies (as listed above)");
    }
    const h5::File f = h5::File::open_read(w.path);
    const std::string format = f.has_attribute("format") ? f.attribute("format") : "";
    if (format == kCheckpointFormat) {
      if (!verified) verify_checkpoint(w.path);
      w.kind = "checkpoint";
      w.model_json = f.attribute("model");
    } else if (format == kParamsFormat) {
      w.kind = "parameters";
    } else {
      throw Error("'" + w.path + "' is neither a Tessera checkpoint ('" + kCheckpointFormat +
                  "') nor a parameter file ('" + kParamsFormat + "')" +
                  (format.empty() ? std::string(": it has no root attribute 'format'")
                                  : ": its format is '" + format + "'"));
    }
  });
  broadcast(world, w.path, 0);
  broadcast(world, w.model_json, 0);
  broadcast(world, w.kind, 0);
  return w;
}

// Chunk extents of the outputs: a tile of the largest output tile's size, at most 4096 a side.
std::pair<std::int64_t, std::int64_t> tile_chunk(const Distribution& out, const GridShape& g) {
  std::int64_t rows = 1, cols = 1;
  for (int i = 0; i < g.h; ++i)
    for (int j = 0; j < g.w; ++j) {
      const Box b = out.tile_of(i, j);
      rows = std::max(rows, b.h.size());
      cols = std::max(cols, b.w.size());
    }
  return {std::min<std::int64_t>({rows, out.global.h, 4096}),
          std::min<std::int64_t>({cols, out.global.w, 4096})};
}

template <typename T>
class Predictor {
 public:
  Predictor(const PredictOptions& o, const Comm& world, const RuntimeOptions& runtime,
            std::ostream& out)
      : o_(o), world_(world), runtime_options_(runtime), out_(out) {}
  int run();

 private:
  // The options every rank must hold alike, checked and agreed. Collective.
  void check_options();
  // The weights, the model spec, the runtime, the input, the memory check, the model. Collective.
  void build();
  // The temporary output file and its datasets. Collective.
  void create_output();
  // One pass: the global images [first, first + batch) (past the last image, the last again: the
  // padding is computed and dropped). Collective.
  void pass(std::int64_t first);
  // The output file renamed into place, or removed after a failure (rank 0). Collective.
  void finish_output();
  void abandon_output() noexcept;
  void progress(std::int64_t done, bool last);
  void report();
  bool root() const { return world_.rank() == 0; }
  // Bytes of one stored probability (--probabilities-type).
  std::int64_t probability_size() const {
    return o_.probabilities_type == "float16" ? 2 : o_.probabilities_type == "float32" ? 4 : 8;
  }
  bool wants(const std::string& what) const {
    return std::find(o_.write.begin(), o_.write.end(), what) != o_.write.end();
  }

  const PredictOptions& o_;
  const Comm& world_;
  const RuntimeOptions& runtime_options_;
  std::ostream& out_;
  Weights weights_;
  ModelSpec spec_;
  std::optional<Runtime> runtime_;
  std::int64_t memory_estimate_ = 0;  // tessera plan's for this run, bytes per rank (0: none)
  std::unique_ptr<H5Dataset> data_;
  std::optional<Model<T>> model_;
  std::int64_t images_ = 0, batch_ = 0, classes_ = 0;
  bool segmentation_ = true;
  std::optional<h5::File> file_;
  std::string temp_;  // the output's temporary name
  std::optional<Confusion> confusion_;
  double loss_sum_ = 0;  // this rank's, over the pixels (or images) it counts
  long long loss_count_ = 0;
  clock_type::time_point began_, last_progress_;
  bool line_open_ = false;
  // A write or the close of the output failed: HDF5 can no longer close the parallel file on
  // every rank alike (it hangs or crashes in MPI_Finalize), so the job ends through MPI_Abort.
  bool write_failed_ = false;
};

template <typename T>
void Predictor<T>::check_options() {
  agree(world_, [&] {
    TESSERA_CHECK(!o_.input.empty(), "--input is required: an HDF5 file with /images [N, C, H, W]");
    TESSERA_CHECK(o_.evaluate || !o_.output.empty(),
                  "--output is required: the HDF5 file to write the predictions to");
    TESSERA_CHECK(o_.batch >= 0, "--batch must not be negative (0: one image per group)");
    TESSERA_CHECK(
        o_.compress >= 0 && o_.compress <= 9,
        "--compress must lie in 0..9 (deflate level; 0: none), not " + std::to_string(o_.compress));
    TESSERA_CHECK(o_.probabilities_type == "float16" || o_.probabilities_type == "float32" ||
                      o_.probabilities_type == "float64",
                  "bad --probabilities-type '" + o_.probabilities_type +
                      "': expected float16, float32 or float64");
    TESSERA_CHECK(!o_.output.empty() || o_.json.empty() || o_.evaluate,
                  "--json goes with evaluation");
    if (!o_.output.empty()) {
      TESSERA_CHECK(!o_.write.empty(), "--write names nothing to write");
      for (const std::string& w : o_.write)
        TESSERA_CHECK(w == "probabilities" || w == "labels" || w == "logits",
                      "bad --write '" + w +
                          "': expected probabilities, labels or logits "
                          "(several separated by commas)");
      const fs::path target(o_.output);
      const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
      TESSERA_CHECK(fs::is_directory(dir), "cannot write --output '" + o_.output +
                                               "': the directory '" + dir.string() +
                                               "' does not exist");
      TESSERA_CHECK(!fs::is_directory(target),
                    "cannot write --output '" + o_.output + "': it is a directory");
    }
    check_outputs_apart(
        {{"--output", o_.output}, {"--json", o_.json}},
        {{"--input", o_.input}, {"--checkpoint", o_.checkpoint}, {"--model", o_.model}});
    if (!o_.json.empty() && root()) check_writable(o_.json, "--json");
  });
  std::ostringstream c;
  c << o_.model << "|" << o_.checkpoint << "|" << o_.input << "|" << o_.output << "|";
  for (const std::string& w : o_.write)
    c << w << ",";
  c << "|" << o_.probabilities_type << "|" << o_.compress << "|" << o_.grid.str() << "|" << o_.batch
    << "|" << o_.dtype << "|" << o_.evaluate << "|" << o_.json << "|" << __DATE__ << __TIME__;
  check_same_everywhere(world_, "configuration (model, options, build)", c.str());
}

template <typename T>
void Predictor<T>::build() {
  weights_ = resolve_weights(o_.checkpoint, world_, out_);
  agree(world_, [&] {
    if (o_.model.empty()) {
      TESSERA_CHECK(!weights_.model_json.empty(), "--model is needed with a parameter file ('" +
                                                      weights_.path +
                                                      "'): only a checkpoint names its model");
      spec_ = parse_model(weights_.model_json, "'" + weights_.path + "'");
      return;
    }
    spec_ = load_model(o_.model);
    if (weights_.model_json.empty()) return;
    const ModelSpec trained = parse_model(weights_.model_json, "'" + weights_.path + "'");
    TESSERA_CHECK(trained.json == spec_.json,
                  "'" + weights_.path + "' was trained with model '" + trained.name +
                      "', which is not --model '" + o_.model +
                      "' (leave --model out to use the checkpoint's own)");
  });
  // Every rank read its own model file: they must have read the same model.
  check_same_everywhere(world_, "model (--model, the checkpoint's)", spec_.json);
  segmentation_ = spec_.loss == LossKind::pixel_cross_entropy;
  runtime_.emplace(make_runtime(world_, o_.grid, runtime_options_));
  const MemoryBudget memory = run_memory_budget(world_, runtime_options_.kernels);
  data_ = std::make_unique<H5Dataset>(o_.input, world_, /*labels_required=*/o_.evaluate);
  if (!o_.evaluate) data_->ignore_labels();
  const DatasetInfo& info = data_->info();
  images_ = info.samples;
  const GridShape& g = o_.grid;
  agree(world_, [&] {
    TESSERA_CHECK(
        !o_.evaluate || (info.labels == LabelKind::per_pixel) == segmentation_,
        "'" + o_.input + "' has " +
            (info.labels == LabelKind::per_pixel ? "per-pixel labels" : "one label per image") +
            " but the model's loss is " + to_string(spec_.loss));
    batch_ = o_.batch > 0 ? o_.batch : g.n;
    TESSERA_CHECK(batch_ >= g.n, "--batch " + std::to_string(batch_) + " is smaller than the " +
                                     std::to_string(g.n) +
                                     " data-parallel groups of the grid: each needs an image");
    batch_ = std::min(batch_, std::max<std::int64_t>(images_, g.n));
    const Shape4 image{batch_, info.channels, info.height, info.width};
    // Before anything the size of the image is allocated or computed.
    const std::int64_t probability_bytes =
        wants("probabilities") && !o_.output.empty() ? probability_size() : 0;
    memory_estimate_ = check_run_memory(
        spec_,
        {.grid = g,
         .input = image,
         .dtype = o_.dtype,
         .confusion_matrices = o_.evaluate ? 1 : 0,
         .inference = true,
         // The label (and its read labels), and per class the probabilities and the
         // host copy of the logits.
         .output_bytes_per_pixel = o_.evaluate ? 6 : 2,
         .output_bytes_per_channel = probability_bytes + static_cast<std::int64_t>(sizeof(T)),
         .engine = plan_engine(runtime_->options())},
        memory);
    model_.emplace(spec_, *runtime_, image);
    classes_ = model_->output_distribution().global.c;
    TESSERA_CHECK(classes_ <= 65536 || !wants("labels") || o_.output.empty(),
                  "the model predicts " + std::to_string(classes_) +
                      " classes: --write labels stores at most 65536 (uint16)");
    const Shape4 y = model_->output_distribution().global;
    if (o_.evaluate && segmentation_)
      TESSERA_CHECK(info.label_height == y.h && info.label_width == y.w,
                    "'" + o_.input + "': the labels are " + std::to_string(info.label_height) +
                        "x" + std::to_string(info.label_width) + " but the model's output is " +
                        std::to_string(y.h) + "x" + std::to_string(y.w));
    const h5::File f = h5::File::open_read(weights_.path);
    read_params(f, *model_);
  });
  model_->state() = {.mode = Mode::eval, .seed = 0, .step = 0};
  model_->set_input_grad(false);
  if (o_.evaluate) confusion_.emplace(classes_);
}

template <typename T>
void Predictor<T>::create_output() {
  std::string pid = std::to_string(::getpid());
  broadcast(world_, pid, 0);
  const fs::path target(o_.output);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  temp_ = (dir / ("." + target.filename().string() + ".tmp." + pid)).string();
  // Room for the outputs, uncompressed, before the file exists: parallel HDF5 cannot close a
  // file on a disk that filled up under it (with --compress the size is not known).
  agree(world_, [&] {
    if (!root() || o_.compress > 0) return;
    const Shape4 y = model_->output_distribution().global;
    const std::int64_t pixels = saturating_mul(images_, segmentation_ ? y.h * y.w : 1);
    const std::int64_t per_pixel =
        (wants("labels") ? (classes_ <= 256 ? 1 : 2) : 0) +
        (wants("probabilities") ? classes_ * probability_size() : 0) +
        (wants("logits") ? classes_ * static_cast<std::int64_t>(sizeof(T)) : 0);
    const std::int64_t needed = saturating_add(saturating_mul(pixels, per_pixel), 1 << 20);
    std::error_code ec;
    const fs::space_info space = fs::space(dir, ec);
    if (ec) return;  // a filesystem that does not say: the writes will
    TESSERA_CHECK(static_cast<std::uintmax_t>(needed) <= space.available,
                  "cannot write --output '" + o_.output + "': it needs about " +
                      human_bytes(needed) + " and the filesystem of '" + dir.string() + "' has " +
                      human_bytes(static_cast<std::int64_t>(
                          std::min<std::uintmax_t>(space.available, kSizeMax))) +
                      " free (free some space, or write fewer outputs, or --compress)");
  });
  try {
    file_.emplace(h5::File::create_parallel(temp_, world_));
  } catch (const Error& e) {
    throw Error("cannot write --output '" + o_.output + "': " + e.what(), "predict.cpp",
                /*agreed=*/true);
  }
  try {
    agree(world_, [&] {
      h5::File& f = *file_;
      f.set_attribute("format", kPredictionsFormat);
      f.set_attribute("model", spec_.json);
      f.set_attribute("weights", weights_.path);
      f.set_attribute("input", o_.input);
      f.set_attribute("grid", o_.grid.str());
      f.set_attribute("dtype", o_.dtype);
      const Distribution& y = model_->output_distribution();
      const std::int64_t n = images_, k = classes_;
      const auto [rows, cols] = tile_chunk(y, o_.grid);
      // A classifier's chunks: at most 4096 images and 64 MiB (HDF5 refuses chunks over 4 GiB).
      const std::int64_t images_per_chunk =
          std::clamp<std::int64_t>((std::int64_t{64} << 20) / std::max<std::int64_t>(k * 8, 1), 1,
                                   std::min<std::int64_t>(n, 4096));
      const std::vector<std::int64_t> dims =
          segmentation_ ? std::vector<std::int64_t>{n, k, y.global.h, y.global.w}
                        : std::vector<std::int64_t>{n, k};
      const std::vector<std::int64_t> chunk = segmentation_
                                                  ? std::vector<std::int64_t>{1, 1, rows, cols}
                                                  : std::vector<std::int64_t>{images_per_chunk, k};
      const std::vector<std::int64_t> label_dims =
          segmentation_ ? std::vector<std::int64_t>{n, y.global.h, y.global.w}
                        : std::vector<std::int64_t>{n};
      const std::vector<std::int64_t> label_chunk =
          segmentation_ ? std::vector<std::int64_t>{1, rows, cols}
                        : std::vector<std::int64_t>{images_per_chunk};
      const int z = o_.compress;
      if (wants("probabilities")) {
        if (o_.probabilities_type == "float16")
          f.create_chunked<h5::Half>("/probabilities", dims, chunk, false, z);
        else if (o_.probabilities_type == "float32")
          f.create_chunked<float>("/probabilities", dims, chunk, false, z);
        else
          f.create_chunked<double>("/probabilities", dims, chunk, false, z);
      }
      if (wants("labels")) {
        if (k <= 256)
          f.create_chunked<std::uint8_t>("/labels", label_dims, label_chunk, false, z);
        else
          f.create_chunked<std::uint16_t>("/labels", label_dims, label_chunk, false, z);
      }
      if (wants("logits")) f.create_chunked<T>("/logits", dims, chunk, false, z);
    });
  } catch (...) {
    abandon_output();
    throw;
  }
}

template <typename T>
void Predictor<T>::abandon_output() noexcept {
  // Not closed here: the failure may be this rank's alone, and closing is collective (see
  // H5Dataset's destructor); MPI_Finalize or MPI_Abort closes it. Every rank removes the name
  // (a rank may fail alone; removing twice is harmless).
  if (file_) static_cast<void>(new h5::File(std::move(*file_)));
  file_.reset();
  if (!temp_.empty()) {
    std::error_code ignored;
    fs::remove(temp_, ignored);
  }
}

template <typename T>
void Predictor<T>::finish_output() {
  try {
    agree(world_, [&] { file_->close(); });  // collective: every dataset written
  } catch (const Error&) {
    write_failed_ = true;
    throw;
  }
  file_.reset();
  agree(world_, [&] {
    if (!root()) return;
    std::error_code ec;
    fs::rename(temp_, o_.output, ec);
    if (ec) {
      fs::remove(temp_, ec);
      throw Error("cannot rename '" + temp_ + "' to '" + o_.output + "': " + ec.message());
    }
  });
  temp_.clear();
}

// Writes this rank's box of an output: `count` entries from `offset`. Collective.
template <typename V>
void write_box(h5::File& f, const std::string& dataset, const std::vector<V>& values,
               const std::vector<std::int64_t>& offset, const std::vector<std::int64_t>& count) {
  f.write_box<V>(dataset, values, offset, count);
}

template <typename T>
void Predictor<T>::pass(std::int64_t first) {
  const Distribution& in = model_->input_distribution();
  DistTensor<T> x(in);
  const Range mine = in.samples();
  std::vector<std::int64_t> samples;
  for (std::int64_t k = mine.begin; k < mine.end; ++k)
    samples.push_back(std::min(first + k, images_ - 1));
  Labels labels;
  const Distribution& y = model_->output_distribution();
  agree(world_, [&] {
    data_->read(samples, x.dist.tile(), y.tile(), x.local, labels);
    if (o_.evaluate)
      for (std::int32_t l : labels)
        TESSERA_CHECK(l >= 0 && l < classes_,
                      "'" + o_.input + "': a label is " + std::to_string(l) + ", outside [0, " +
                          std::to_string(classes_) + "): the model predicts " +
                          std::to_string(classes_) + " classes");
  });
  const DistTensor<T> logits = model_->forward(x);
  Tensor<T> host = to_host(logits.local);
  if (host.layout() != Layout::nchw) host = to_layout(host, Layout::nchw);
  const Shape4 s = host.shape();
  // The images of this group that are real (not padding), and whether this rank speaks for them:
  // a classifier's logits are whole on every spatial rank, and spatial rank (0, 0) writes them.
  const bool speaks = !logits.dist.replicated || (logits.dist.me.i == 0 && logits.dist.me.j == 0);
  const std::int64_t real =
      speaks ? std::clamp<std::int64_t>(images_ - (first + mine.begin), 0, mine.size()) : 0;
  const std::int64_t plane = s.h * s.w, k = s.c;
  std::vector<float> p32;
  std::vector<double> p64;
  std::vector<h5::Half> p16;
  std::vector<std::uint8_t> l8;
  std::vector<std::uint16_t> l16;
  const bool probabilities = !o_.output.empty() && wants("probabilities");
  const bool label_map = !o_.output.empty() && wants("labels");
  const auto values = static_cast<std::size_t>(real * k * plane);
  if (probabilities) {
    if (o_.probabilities_type == "float16") p16.resize(values);
    if (o_.probabilities_type == "float32") p32.resize(values);
    if (o_.probabilities_type == "float64") p64.resize(values);
  }
  if (label_map && classes_ <= 256) l8.resize(static_cast<std::size_t>(real * plane));
  if (label_map && classes_ > 256) l16.resize(static_cast<std::size_t>(real * plane));
  std::vector<double> e(static_cast<std::size_t>(k));
  for (std::int64_t n = 0; n < real; ++n)
    for (std::int64_t p = 0; p < plane; ++p) {
      const T* v = host.data() + n * k * plane + p;
      std::int64_t best = 0;  // the first largest, as Confusion counts it
      for (std::int64_t c = 1; c < k; ++c)
        if (v[c * plane] > v[best * plane]) best = c;
      const double top = static_cast<double>(v[best * plane]);
      double sum = 0;
      for (std::int64_t c = 0; c < k; ++c)
        sum += e[static_cast<std::size_t>(c)] = std::exp(static_cast<double>(v[c * plane]) - top);
      const std::int64_t at = n * plane + p;
      if (probabilities)
        for (std::int64_t c = 0; c < k; ++c) {
          const double q = e[static_cast<std::size_t>(c)] / sum;
          const auto i = static_cast<std::size_t>((n * k + c) * plane + p);
          if (!p16.empty()) p16[i] = h5::to_half(static_cast<float>(q));
          if (!p32.empty()) p32[i] = static_cast<float>(q);
          if (!p64.empty()) p64[i] = q;
        }
      if (!l8.empty()) l8[static_cast<std::size_t>(at)] = static_cast<std::uint8_t>(best);
      if (!l16.empty()) l16[static_cast<std::size_t>(at)] = static_cast<std::uint16_t>(best);
      if (o_.evaluate) {
        const std::int32_t label = labels[static_cast<std::size_t>(at)];
        loss_sum_ += top + std::log(sum) - static_cast<double>(v[label * plane]);
        ++loss_count_;
        ++confusion_->counts()[static_cast<std::size_t>(label * classes_ + best)];
      }
    }
  if (o_.output.empty()) return;
  // This rank's box of every output, in the order every rank writes them.
  const std::int64_t at = first + mine.begin;
  const Range rows = y.rows(), cols = y.cols();
  const std::vector<std::int64_t> offset =
      segmentation_ ? std::vector<std::int64_t>{at, 0, rows.begin, cols.begin}
                    : std::vector<std::int64_t>{at, 0};
  const std::vector<std::int64_t> count = segmentation_
                                              ? std::vector<std::int64_t>{real, k, s.h, s.w}
                                              : std::vector<std::int64_t>{real, k};
  std::vector<std::int64_t> label_offset = offset, label_count = count;
  label_offset.erase(label_offset.begin() + 1);
  label_count.erase(label_count.begin() + 1);
  // One agreement per collective write: a rank whose write failed must not skip the next ones.
  h5::File& f = *file_;
  const auto write = [&](const std::function<void()>& body) {
    try {
      agree(world_, body, "write agreement");
    } catch (const Error&) {
      write_failed_ = true;
      throw;
    }
  };
  if (probabilities) {
    if (o_.probabilities_type == "float16")
      write([&] { write_box(f, "/probabilities", p16, offset, count); });
    else if (o_.probabilities_type == "float32")
      write([&] { write_box(f, "/probabilities", p32, offset, count); });
    else
      write([&] { write_box(f, "/probabilities", p64, offset, count); });
  }
  if (label_map) {
    if (classes_ <= 256)
      write([&] { write_box(f, "/labels", l8, label_offset, label_count); });
    else
      write([&] { write_box(f, "/labels", l16, label_offset, label_count); });
  }
  if (wants("logits"))
    write([&] { f.write_box<T>("/logits", {host.data(), values}, offset, count); });
}

template <typename T>
void Predictor<T>::progress(std::int64_t done, bool last) {
  if (!root()) return;
  const double elapsed = seconds_since(began_);
  if (!last && !o_.progress_line && seconds_since(last_progress_) < 2) return;
  last_progress_ = clock_type::now();
  const double rate = static_cast<double>(done) / std::max(elapsed, 1e-9);
  std::ostringstream line;
  line << "image " << done << "/" << images_ << "  " << std::fixed
       << std::setprecision(rate < 10 ? 2 : 1) << rate << " img/s  ETA "
       << duration_text(static_cast<double>(images_ - done) / std::max(rate, 1e-9));
  if (o_.progress_line) {
    out_ << "\r" << line.str() << "\033[K" << std::flush;
    line_open_ = true;
  } else {
    out_ << line.str() << "\n" << std::flush;
  }
}

template <typename T>
void Predictor<T>::report() {
  std::vector<double> loss{loss_sum_, static_cast<double>(loss_count_)};
  allreduce(world_, std::span<double>(loss), ReduceOp::sum, Group::world, "allreduce of the loss");
  confusion_->reduce(world_);
  const Confusion& c = *confusion_;
  const double mean_loss = loss[1] > 0 ? loss[0] / loss[1] : 0;
  std::string json_text;
  {
    nlohmann::json j;
    j["input"] = o_.input;
    j["weights"] = weights_.path;
    j["model"] = spec_.name;
    j["images"] = images_;
    j[segmentation_ ? "pixels" : "labelled_images"] = c.total();
    j["loss"] = mean_loss;
    j["accuracy"] = c.accuracy();
    if (segmentation_) j["mean_iou"] = c.mean_iou();
    nlohmann::json iou = nlohmann::json::array(), confusion = nlohmann::json::array();
    for (std::int64_t a = 0; a < classes_; ++a) {
      const double v = c.iou(a);
      iou.push_back(std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v));
      nlohmann::json row = nlohmann::json::array();
      for (std::int64_t b = 0; b < classes_; ++b)
        row.push_back(c.count(a, b));
      confusion.push_back(row);
    }
    j["class_iou"] = iou;
    j["confusion"] = confusion;  // [label][predicted]
    json_text = j.dump(2) + "\n";
  }
  agree(world_, [&] {
    if (!root() || o_.json.empty()) return;
    write_text_file(o_.json, json_text, "--json");
  });
  if (!root()) return;
  out_ << "evaluation: " << images_ << " images of '" << o_.input << "'";
  if (segmentation_) out_ << ", " << c.total() << " pixels";
  out_ << "\n  loss " << std::fixed << std::setprecision(4) << mean_loss << "  accuracy "
       << c.accuracy();
  if (segmentation_) out_ << "  mIoU " << c.mean_iou();
  out_ << "\n  class  IoU     labelled  predicted\n";
  for (std::int64_t a = 0; a < classes_; ++a) {
    long long labelled = 0, predicted = 0;
    for (std::int64_t b = 0; b < classes_; ++b) {
      labelled += c.count(a, b);
      predicted += c.count(b, a);
    }
    if (labelled == 0 && predicted == 0) continue;
    out_ << "  " << std::setw(5) << a << "  " << std::setw(6) << std::setprecision(4) << c.iou(a)
         << "  " << std::setw(8) << labelled << "  " << std::setw(9) << predicted << "\n";
  }
  out_ << std::defaultfloat;
  if (!o_.json.empty()) out_ << "  written: " << o_.json << "\n";
  out_ << std::flush;
}

template <typename T>
int Predictor<T>::run() {
  check_options();
  build();
  if (root()) {
    const Distribution& in = model_->input_distribution();
    const Shape4& y = model_->output_distribution().global;
    out_ << "tessera " << (o_.output.empty() ? "evaluate" : "predict") << ": model " << spec_.name
         << " (" << model_->parameter_count() << " parameters), " << o_.dtype << ", "
         << weights_.kind << " " << weights_.path << "\n"
         << "  grid " << o_.grid.str() << ": " << images_ << " images of " << in.global.c << "x"
         << in.global.h << "x" << in.global.w << " from '" << o_.input << "', " << batch_
         << " per pass; output " << classes_
         << (segmentation_ ? "x" + std::to_string(y.h) + "x" + std::to_string(y.w)
                           : std::string(" classes"))
         << " per image\n";
    if (!o_.output.empty()) {
      out_ << "  writing";
      for (const std::string& w : o_.write)
        out_ << " " << w;
      out_ << " to '" << o_.output << "'"
           << (o_.compress > 0 ? " (deflate " + std::to_string(o_.compress) + ")" : "") << "\n";
    }
    out_ << std::flush;
  }
  if (!o_.output.empty()) create_output();
  began_ = last_progress_ = clock_type::now();
  try {
    for (std::int64_t first = 0; first < images_; first += batch_) {
      pass(first);
      const std::int64_t done = std::min(first + batch_, images_);
      progress(done, done == images_);
      if (const int signal = agreed_stop_signal(world_); signal != 0 && done < images_)
        throw Error("stopped by " + signal_name(signal) + " after " + std::to_string(done) +
                        " of " + std::to_string(images_) + " images" +
                        (o_.output.empty() ? "" : ": nothing written to '" + o_.output + "'"),
                    "predict.cpp", /*agreed=*/true);
    }
    if (root() && line_open_) out_ << "\n" << std::flush;
    if (file_) finish_output();
  } catch (const Error& e) {
    if (root() && line_open_) out_ << "\n" << std::flush;
    const bool fatal = write_failed_;
    abandon_output();
    if (fatal)  // MPI_Abort, not MPI_Finalize: see write_failed_
      throw Error(std::string(e.what()) + "; '" + o_.output + "' was not written", "predict.cpp",
                  /*agreed=*/false);
    throw;
  } catch (...) {
    abandon_output();
    throw;
  }
  const double elapsed = seconds_since(began_);
  const auto [peak_min, peak_max] = peak_memory_range_mib(world_);
  if (o_.evaluate) report();
  if (root()) {
    out_ << "done: " << images_ << " images in " << duration_text(elapsed) << " (" << std::fixed
         << std::setprecision(2) << static_cast<double>(images_) / std::max(elapsed, 1e-9)
         << " img/s); peak memory per rank " << std::setprecision(1) << peak_min << ".." << peak_max
         << " MiB" << std::defaultfloat;
    out_ << estimate_note(memory_estimate_);
    if (!o_.output.empty()) out_ << "; wrote " << o_.output;
    out_ << "\n" << std::flush;
  }
  return 0;
}

}  // namespace

int run_predict(const PredictOptions& options, const Comm& world, const RuntimeOptions& runtime,
                std::ostream& out) {
  agree(world, [&] { check_dtype(options.dtype, runtime); });
  install_stop_signals();  // Ctrl-C, scancel: the temporary output is removed
  return with_dtype(options.dtype, [&](auto zero) {
    return Predictor<decltype(zero)>(options, world, runtime, out).run();
  });
}

}  // namespace tessera
