#include "tessera/drivers/train.hpp"
#include "tessera/drivers/driver.hpp"
#include "tessera/drivers/memory.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include "tessera/checked.hpp"
#include "tessera/collectives.hpp"
#include "tessera/dataset.hpp"
#include "tessera/engine/graph.hpp"
#include "tessera/engine/model.hpp"
#include "tessera/error.hpp"
#include "tessera/h5_dataset.hpp"
#include "tessera/io/checkpoint.hpp"
#include "tessera/io/metrics.hpp"
#include "tessera/io/params_io.hpp"
#include "tessera/partition.hpp"
#include "tessera/profile.hpp"
#include "tessera/synthetic.hpp"

namespace tessera {
namespace {

using clock_type = std::chrono::steady_clock;

// A dataset seen through a list of its sample indices (a training or validation split).
struct Split {
  Dataset* data = nullptr;
  std::vector<std::int64_t> index;
};

// Computation options (Trainer::computation_options) that checkpoints record only since
// 2026-11-29, with what a run whose checkpoint lacks one computed with ("": not known, not
// compared on resume): older checkpoints resume as before.
const std::map<std::string, std::string> kRecordedSince = {{"--precision", "float32"},
                                                           {"--val-samples", ""}};

// Stragglers and memory over one log window (train lines only): each rank's share of the window's
// wall time spent waiting for peers (halo messages not yet there, reductions: profile.hpp), and
// each rank's peak resident memory in the window.
struct Monitor {
  int slowest_rank = 0;       // the rank that waited least: the others wait for it
  double wait_share = 0;      // the mean over ranks, in [0, 1]
  double max_wait_share = 0;  // the rank that waited most
  double peak_mib_max = 0, peak_mib_min = 0;
  int peak_rank = 0;  // the rank with peak_mib_max
};

// One line of metrics, to the console and the metrics file.
struct Record {
  std::int64_t step = 0, epoch = 0;
  std::string split;  // "train" | "val"
  double loss = 0, accuracy = 0, mean_iou = 0, lr = 0, images_per_s = 0;
  std::optional<Monitor> monitor = std::nullopt;
};

constexpr const char* kMetricsHeader =
    "step,epoch,split,loss,accuracy,mean_iou,lr,images_per_s,slowest_rank,wait_share,"
    "max_wait_share,peak_mib_max,peak_mib_rank,peak_mib_min\n";

// The step a metrics line was written at, or -1 for a header or a damaged line.
std::int64_t metrics_line_step(const std::string& line, bool json) {
  std::size_t at = 0;
  if (json) {
    at = line.find("\"step\": ");
    if (at == std::string::npos || !line.ends_with("}")) return -1;
    at += 8;
  } else if (std::count(line.begin(), line.end(), ',') !=
             std::count(kMetricsHeader, kMetricsHeader + std::strlen(kMetricsHeader), ',')) {
    return -1;
  }
  std::int64_t step = -1;
  const auto [end, ec] = std::from_chars(line.data() + at, line.data() + line.size(), step);
  return ec == std::errc() && end != line.data() + at ? step : -1;
}

class MetricsFile {
 public:
  // A fresh file, or with `resume_step` >= 0 the existing one with only its lines up to that
  // step: those written after the checkpoint would otherwise come twice.
  MetricsFile(const std::string& path, std::int64_t resume_step)
      : json_(path.ends_with(".json") || path.ends_with(".jsonl")) {
    if (path.empty()) return;
    const std::string header = json_ ? "" : kMetricsHeader;
    if (resume_step >= 0 && std::filesystem::exists(path)) {
      // Rewritten through a temporary file, so that a crash here leaves the old lines.
      std::string kept = header;
      std::ifstream in(path);
      for (std::string line; std::getline(in, line);) {
        const std::int64_t step = metrics_line_step(line, json_);
        if (step >= 0 && step <= resume_step) kept += line + "\n";
      }
      write_text_file(path, kept, "the metrics file");
      out_.open(path, std::ios::app);
    } else {
      out_.open(path, std::ios::trunc);
      out_ << header;
    }
    out_.flush();
    TESSERA_CHECK(out_.good(), "cannot write the metrics file '" + path + "'");
  }
  void write(const Record& r, bool segmentation) {
    if (!out_.is_open()) return;
    out_ << std::setprecision(10);
    if (json_) {
      out_ << "{\"step\": " << r.step << ", \"epoch\": " << r.epoch << ", \"split\": \"" << r.split
           << "\", \"loss\": " << r.loss << ", \"accuracy\": " << r.accuracy;
      if (segmentation) out_ << ", \"mean_iou\": " << r.mean_iou;
      out_ << ", \"lr\": " << r.lr << ", \"images_per_s\": " << r.images_per_s;
      if (const auto& m = r.monitor)
        out_ << ", \"slowest_rank\": " << m->slowest_rank << ", \"wait_share\": " << m->wait_share
             << ", \"max_wait_share\": " << m->max_wait_share
             << ", \"peak_mib_max\": " << m->peak_mib_max << ", \"peak_mib_rank\": " << m->peak_rank
             << ", \"peak_mib_min\": " << m->peak_mib_min;
      out_ << "}\n";
    } else {
      out_ << r.step << "," << r.epoch << "," << r.split << "," << r.loss << "," << r.accuracy
           << ",";
      if (segmentation) out_ << r.mean_iou;
      out_ << "," << r.lr << "," << r.images_per_s;
      if (const auto& m = r.monitor)
        out_ << "," << m->slowest_rank << "," << m->wait_share << "," << m->max_wait_share << ","
             << m->peak_mib_max << "," << m->peak_rank << "," << m->peak_mib_min << "\n";
      else
        out_ << ",,,,,,\n";
    }
    out_.flush();  // a run that dies keeps every line it logged
  }

 private:
  bool json_;
  std::ofstream out_;
};

template <typename T>
class Trainer {
 public:
  Trainer(const TrainOptions& o, const Comm& world, const RuntimeOptions& runtime,
          std::ostream& out)
      : o_(o), world_(world), runtime_options_(runtime), out_(out) {}
  // Collective over the world group: check_options, build, resume, then step after step until
  // should_stop, with validate and save at their steps, and the closing line.
  int run();

 private:
  // The options every rank must agree on. Collective over the world group.
  void check_options();
  // The runtime, the data, the model and the optimizer. Collective over the world group.
  void build();
  // The first step to train: 0, or the step of the latest checkpoint with --resume. Collective.
  std::int64_t resume();
  // One training step (forward, backward, gradient reduction, optimizer update); adds to the log
  // window and returns the learning rate it used. Collective over the world group.
  double step(std::int64_t step);
  // After step `done`: the log line and metrics record when one is due, validation at the end
  // of an epoch, a checkpoint when one is due. Collective over the world group.
  void after_step(std::int64_t done, double lr);
  // Whether training ends after step `done`. Every rank computes it from the same counts, so the
  // ranks agree; a rank-local reason to stop (a signal) must be combined over the ranks here.
  bool should_stop(std::int64_t done) const { return done >= total_steps_; }
  // Whether --checkpoint-every asks for a checkpoint after step `done`.
  bool checkpoint_due(std::int64_t done) const {
    return o_.checkpoint_every > 0 && done % o_.checkpoint_every == 0;
  }
  void log(std::int64_t done, double lr);
  // This window's Monitor from its length and this rank's activity in it: what every rank
  // waited and held. Collective over the world group.
  Monitor monitor(double elapsed, const ActivityTimes& activity);
  void report_validation(std::int64_t done, double lr);
  void finish();
  // After step `done`, when a rank received `signal`: a checkpoint (unless one was just written)
  // and the message; returns kExitStoppedResumable, or 1 without --checkpoint-dir. Collective.
  int stop(std::int64_t done, int signal);
  void open_data();
  // The samples of `global_batch` that are this rank's. Collective over the world group: a bad
  // sample (a non-finite pixel, a label outside the model's classes, an unreadable chunk) is one
  // agreed Error, after rescue() has saved what was trained.
  void read_batch(const Split& split, std::span<const std::int64_t> global_batch, DistTensor<T>& x,
                  Labels& labels);
  // After an agreed error that left the model as step done_ left it (a bad sample, found before
  // the step or, with `validating`, the validation read it): a checkpoint of step done_ unless one
  // exists, so that nothing trained is lost. Returns what to tell the user. Collective over the
  // world group.
  std::string rescue(bool validating);
  Record validate(std::int64_t step, std::int64_t epoch);
  void save(std::int64_t step, std::int64_t epoch);
  void print_summary();
  // What a checkpoint of this run holds about the run itself (seed, model, grid, dtype,
  // optimizer, batch, samples; the window's counts as zeros, as many as it saves): written by
  // save, expected by resume.
  CheckpointState checkpoint_identity() const {
    const auto counts = static_cast<std::size_t>(classes_ * classes_);
    return {.seed = o_.seed,
            .model = spec_.json,
            .grid = o_.grid.str(),
            .dtype = o_.dtype,
            .optimizer = o_.optimizer.kind == OptimizerKind::adam ? "adam" : "sgd",
            .batch = o_.batch,
            .samples = static_cast<std::int64_t>(train_.index.size()),
            .window_counts = std::vector<std::int64_t>(counts),
            .options = computation_options()};
  }
  // The options that decide what the run computes, as a checkpoint keeps them: a resume with
  // others would not continue the run it began.
  std::map<std::string, std::string> computation_options() const {
    const auto text = [](auto v) {
      std::ostringstream o;
      o << std::setprecision(17) << v;
      return o.str();
    };
    const Shape4& image = model_->input_distribution().global;
    std::map<std::string, std::string> options{
        {"--batch", text(o_.batch)},
        {"--data", o_.data.empty() ? "(built-in)" : o_.data},
        {"--val-data", o_.val_data},
        {"--val-fraction", text(o_.val_fraction)},
        {"training samples", text(train_.index.size())},
        {"image size", text(image.c) + "x" + text(image.h) + "x" + text(image.w)},
        {"--seed", text(o_.seed)},
        {"--lr", text(o_.lr)},
        {"--lr-schedule", schedule_.kind == ScheduleKind::cosine ? "cosine"
                          : schedule_.kind == ScheduleKind::step ? "step"
                                                                 : "constant"},
        {"--momentum", text(o_.optimizer.momentum)},
        {"--weight-decay", text(o_.optimizer.weight_decay)}};
    // The length of the run changes the learning rate of every step only when cosine anneals
    // over it; a longer run of a constant or step schedule continues the same computation.
    if (schedule_.kind == ScheduleKind::cosine)
      options["steps (--steps, --epochs)"] = text(total_steps_);
    if (!o_.init.empty()) options["--init"] = o_.init;
    // bfloat16 products change every step's arithmetic; the built-in validation set changes what
    // validation reports (kRecordedSince: checkpoints from before these were recorded).
    options["--precision"] = runtime_options_.bf16 ? "bf16" : "float32";
    if (o_.data.empty() && o_.val_data.empty()) options["--val-samples"] = text(o_.val_samples);
    if (schedule_.kind == ScheduleKind::step) {
      options["--lr-step-size"] = text(schedule_.step_size);
      options["--lr-gamma"] = text(schedule_.gamma);
    }
    return options;
  }
  // "the last good checkpoint is ..." for messages about a run that cannot go on.
  std::string last_good_text() const {
    return last_good_.empty() ? "this run wrote no checkpoint"
                              : "the last good checkpoint is " + last_good_;
  }
  bool root() const { return world_.rank() == 0; }
  const Comm& grid() const { return runtime_->comm(); }

  const TrainOptions& o_;
  const Comm& world_;
  const RuntimeOptions& runtime_options_;
  std::ostream& out_;
  ModelSpec spec_;
  std::optional<Runtime> runtime_;
  MemoryBudget memory_;               // per rank: what build() checks the run's needs against
  std::int64_t memory_estimate_ = 0;  // tessera plan's for this run, bytes per rank (0: none)
  std::unique_ptr<Dataset> train_data_, val_data_;
  Split train_, val_;
  std::string data_text_;
  std::optional<Model<T>> model_;
  std::optional<Optimizer<T>> optimizer_;
  std::int64_t total_steps_ = 0, steps_per_epoch_ = 0;
  ScheduleOptions schedule_;
  bool segmentation_ = true;
  std::int64_t classes_ = 0;
  // The log window: steps since the last log line, their summed loss, and this rank's part of
  // their confusion counts.
  std::int64_t window_steps_ = 0;
  double window_loss_ = 0;
  std::optional<Confusion> window_confusion_;
  std::optional<EpochSampler> sampler_;
  std::optional<MetricsFile> metrics_;
  DistTensor<T> x_;  // the batch of a step: this rank's tile
  Labels labels_;
  std::int64_t start_ = 0;  // the first step of this run
  std::int64_t done_ = 0;   // the steps done: this run's and those it resumed from
  // The step of last_good_ (a resumed checkpoint's from its contents, whatever its file's name).
  std::int64_t saved_ = -1;
  // Wall time: of the run, and of the log window (validation and checkpoints left out, so that
  // images per second count training only); steps since window_began_.
  clock_type::time_point began_, window_began_;
  ActivityTimes window_activity_;  // activity_totals() when the log window began (pauses too)
  std::int64_t timed_steps_ = 0;
  bool line_open_ = false;   // the updating progress line awaits its newline
  std::string last_good_;    // the checkpoint this run last wrote or resumed from
  bool later_told_ = false;  // checkpoints of later steps than this run's were warned of
};

template <typename T>
void Trainer<T>::open_data() {
  const bool segmentation = spec_.loss == LossKind::pixel_cross_entropy;
  if (o_.data.empty()) {
    TESSERA_CHECK(o_.val_data.empty() && o_.val_fraction == 0,
                  "--val-data and --val-fraction need --data (the built-in dataset brings its own "
                  "validation set)");
    return;  // built once the model says how many classes it predicts
  }
  train_data_ = std::make_unique<H5Dataset>(o_.data, world_);
  const DatasetInfo& info = train_data_->info();
  TESSERA_CHECK(
      (info.labels == LabelKind::per_pixel) == segmentation,
      "'" + o_.data + "' has " +
          (info.labels == LabelKind::per_pixel ? "per-pixel labels" : "one label per image") +
          " but the model's loss is " + to_string(spec_.loss));
  // The sample order holds 8 bytes per sample, twice (the index and an epoch's permutation).
  check_memory(saturating_mul(info.samples, 2 * sizeof(std::int64_t)),
               "the order of the " + std::to_string(info.samples) + " samples of '" + o_.data + "'",
               memory_);
  std::int64_t n_train = info.samples;
  if (o_.val_fraction > 0) {
    TESSERA_CHECK(o_.val_data.empty(), "give --val-data or --val-fraction, not both");
    n_train = info.samples - static_cast<std::int64_t>(o_.val_fraction * info.samples);
  }
  train_ = {train_data_.get(), {}};
  for (std::int64_t k = 0; k < n_train; ++k)
    train_.index.push_back(k);
  if (!o_.val_data.empty()) {
    val_data_ = std::make_unique<H5Dataset>(o_.val_data, world_);
    const DatasetInfo& v = val_data_->info();
    TESSERA_CHECK(
        v.channels == info.channels && v.height == info.height && v.width == info.width &&
            v.labels == info.labels,
        "'" + o_.val_data + "' holds images or labels of another shape than '" + o_.data + "'");
    check_memory(
        saturating_mul(v.samples, sizeof(std::int64_t)),
        "the order of the " + std::to_string(v.samples) + " samples of '" + o_.val_data + "'",
        memory_);
    val_ = {val_data_.get(), {}};
    for (std::int64_t k = 0; k < v.samples; ++k)
      val_.index.push_back(k);
  } else if (n_train < info.samples) {
    val_ = {train_data_.get(), {}};
    for (std::int64_t k = n_train; k < info.samples; ++k)
      val_.index.push_back(k);
  }
  std::ostringstream d;
  d << "'" << o_.data << "', " << n_train << " samples of " << info.channels << "x" << info.height
    << "x" << info.width;
  if (!val_.index.empty())
    d << "; validation " << val_.index.size() << " samples"
      << (o_.val_data.empty() ? " (the last of --data)" : " from '" + o_.val_data + "'");
  data_text_ = d.str();
}

template <typename T>
void Trainer<T>::read_batch(const Split& split, std::span<const std::int64_t> global_batch,
                            DistTensor<T>& x, Labels& labels) {
  const Range mine = x.dist.samples();
  std::vector<std::int64_t> samples;
  for (std::int64_t k = mine.begin; k < mine.end; ++k)
    samples.push_back(
        split.index[static_cast<std::size_t>(global_batch[static_cast<std::size_t>(k)])]);
  const Distribution& out = model_->output_distribution();
  try {
    agree(world_, [&] {
      split.data->read(samples, x.dist.tile(), out.tile(), x.local, labels);
      for (std::int32_t l : labels)
        TESSERA_CHECK(l >= 0 && l < classes_, "a label is " + std::to_string(l) + ", outside [0, " +
                                                  std::to_string(classes_) +
                                                  "): the model predicts " +
                                                  std::to_string(classes_) + " classes");
    });
  } catch (const Error& e) {
    if (!e.agreed()) throw;  // a timeout: no collective may follow
    throw Error(std::string(e.what()) + "; " + rescue(&split == &val_), e.where(),
                /*agreed=*/true);
  }
}

template <typename T>
std::string Trainer<T>::rescue(bool validating) {
  std::string verify = "(--verify-data checks every sample before training)";
  if (done_ == start_ && saved_ != done_) return "nothing was trained " + verify;
  if (o_.checkpoint_dir.empty())
    return "no --checkpoint-dir was given, so the " + std::to_string(done_ - start_) +
           " steps of this run are lost " + verify;
  const bool written = saved_ != done_;
  if (written) {
    try {
      save(done_, done_ / steps_per_epoch_);
    } catch (const Error& e) {
      if (!e.agreed()) throw;
      return "the checkpoint of step " + std::to_string(done_) + " failed too: " + e.what();
    }
  }
  // A resume goes on after the checkpoint's step, past the validation at its end.
  if (validating)
    verify += "; a --resume does not repeat this validation" +
              (o_.val_data.empty() ? std::string()
                                   : ": tessera evaluate --checkpoint " + last_good_ + " --input " +
                                         o_.val_data + " runs it");
  return (written ? "checkpoint " + last_good_ + " of step " + std::to_string(done_) +
                        " written: mend the data and --resume from it "
                  : "mend the data and --resume from " + last_good_ + " (step " +
                        std::to_string(done_) + ") ") +
         verify;
}

template <typename T>
Record Trainer<T>::validate(std::int64_t step, std::int64_t epoch) {
  Record r{.step = step, .epoch = epoch, .split = "val"};
  const std::int64_t batch = o_.batch;
  const auto batches = static_cast<std::int64_t>(val_.index.size()) / batch;
  model_->state().mode = Mode::eval;
  Confusion confusion(classes_);
  double loss = 0;
  std::vector<std::int64_t> order(static_cast<std::size_t>(batch));
  for (std::int64_t b = 0; b < batches; ++b) {
    for (std::int64_t k = 0; k < batch; ++k)
      order[static_cast<std::size_t>(k)] = b * batch + k;
    DistTensor<T> x(model_->input_distribution());
    Labels labels;
    read_batch(val_, order, x, labels);
    const DistTensor<T> logits = model_->forward(x);
    loss += compute_loss(spec_.loss, logits, labels, grid(), model_->loss_kernel()).loss;
    confusion.add(logits, labels);
  }
  model_->state().mode = Mode::train;
  confusion.reduce(grid());
  r.loss = batches > 0 ? loss / static_cast<double>(batches) : 0;
  r.accuracy = confusion.accuracy();
  r.mean_iou = confusion.mean_iou();
  return r;
}

template <typename T>
void Trainer<T>::save(std::int64_t step, std::int64_t epoch) {
  Confusion window = *window_confusion_;  // the open window's counts over the whole grid
  window.reduce(grid());
  CheckpointState state = checkpoint_identity();
  state.step = step;
  state.epoch = epoch;
  state.window_steps = window_steps_;
  state.window_loss = window_loss_;
  state.window_counts.assign(window.counts().begin(), window.counts().end());
  // One rank writes; the others wait at the agreement, so a failed write stops every rank.
  const std::string path = checkpoint_path(o_.checkpoint_dir, step);
  std::vector<std::string> prune_failures;  // and warnings, a line each
  agree(
      world_,
      [&] {
        if (!root()) return;
        try {
          std::error_code ec;
          std::filesystem::create_directories(o_.checkpoint_dir, ec);
          TESSERA_CHECK(!ec, "cannot create the checkpoint directory '" + o_.checkpoint_dir +
                                 "': " + ec.message());
          write_checkpoint(path, *model_, *optimizer_, state);
        } catch (const Error& e) {
          throw Error(std::string(e.what()) + "; " + last_good_text());
        }
        prune_failures = prune_checkpoints(o_.checkpoint_dir, o_.keep_checkpoints, step);
        // Once: checkpoints of later steps are left alone, and a --resume would take them.
        if (!later_told_) {
          later_told_ = true;
          for (const std::string& later : checkpoints_after(o_.checkpoint_dir, step))
            prune_failures.push_back("'" + later + "' is of a later step than this run's " +
                                     std::to_string(step) +
                                     ": left as it is, not counted among the "
                                     "--keep-checkpoints (a --resume tries the latest step first)");
        }
      },
      "checkpoint agreement");
  last_good_ = path;
  saved_ = step;
  for (const std::string& failure : prune_failures) {
    if (line_open_) out_ << "\n";
    line_open_ = false;
    out_ << "warning: " << failure << "\n" << std::flush;
  }
}

template <typename T>
void Trainer<T>::print_summary() {
  if (!root()) return;
  const Distribution& in = model_->input_distribution();
  const GridShape& g = grid().shape();
  out_ << "tessera train: model " << spec_.name << " (" << model_->parameter_count()
       << " parameters), " << o_.dtype << ", loss " << to_string(spec_.loss) << "\n"
       << "  grid " << g.str() << ": " << g.n << " data-parallel group(s) of " << g.h << "x" << g.w
       << " spatial ranks; rank 0 " << tiles_text(in) << "\n"
       << "  data: " << data_text_ << "\n"
       << "  batch " << o_.batch << " (" << in.samples().size() << " on rank 0's group), "
       << steps_per_epoch_ << " steps per epoch, " << total_steps_ << " steps\n"
       << "  optimizer " << (o_.optimizer.kind == OptimizerKind::adam ? "adam" : "sgd") << ", lr "
       << o_.lr
       << (schedule_.kind == ScheduleKind::cosine ? " (cosine)"
           : schedule_.kind == ScheduleKind::step ? " (step)"
                                                  : " (constant)")
       << ", weight decay " << o_.optimizer.weight_decay << "\n";
  const std::size_t val_used =
      val_.index.size() / static_cast<std::size_t>(o_.batch) * static_cast<std::size_t>(o_.batch);
  if (val_used != val_.index.size())
    out_ << "  validation uses " << val_used << " of the " << val_.index.size()
         << " validation samples (whole batches of " << o_.batch << ")\n";
  if (!o_.checkpoint_dir.empty())
    out_ << "  checkpoints: " << o_.checkpoint_dir
         << (o_.checkpoint_every > 0 ? ", every " + std::to_string(o_.checkpoint_every) + " steps"
                                     : ", at the end")
         << "\n";
  out_.flush();
}

template <typename T>
void Trainer<T>::check_options() {
  agree(world_, [&] {
    spec_ = load_model(o_.model);
    TESSERA_CHECK(o_.batch > 0, "--batch must be positive");
    TESSERA_CHECK(o_.log_every > 0, "--log-every must be positive");
    TESSERA_CHECK(!o_.resume || !o_.checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
    TESSERA_CHECK(o_.epochs >= 0 && o_.steps >= 0, "--epochs and --steps must not be negative");
    TESSERA_CHECK(o_.epochs > 0 || o_.steps > 0,
                  "--epochs 0 trains nothing: give --epochs or --steps");
    TESSERA_CHECK(o_.checkpoint_every >= 0, "--checkpoint-every must not be negative");
    TESSERA_CHECK(o_.keep_checkpoints >= 0,
                  "--keep-checkpoints must not be negative (0: keep all)");
    TESSERA_CHECK(!o_.allow_changes || o_.resume, "--allow-changes goes with --resume");
    TESSERA_CHECK(o_.checkpoint_every == 0 || !o_.checkpoint_dir.empty(),
                  "--checkpoint-every needs --checkpoint-dir");
    TESSERA_CHECK(o_.val_fraction >= 0 && o_.val_fraction < 1, "--val-fraction must be in [0, 1)");
    check_outputs_apart({{"--metrics", o_.metrics}}, {{"--data", o_.data},
                                                      {"--val-data", o_.val_data},
                                                      {"--init", o_.init},
                                                      {"--model", o_.model},
                                                      {"--checkpoint-dir", o_.checkpoint_dir}});
    // Rank 0 writes them: found now, not after the first --checkpoint-every steps.
    if (root() && !o_.checkpoint_dir.empty())
      check_writable_directory(o_.checkpoint_dir, "--checkpoint-dir");
    if (root() && !o_.metrics.empty()) check_writable(o_.metrics, "--metrics");
  });
  // Every rank read its own model file and --config: a file that differs between nodes would
  // otherwise make the ranks run different programs.
  {
    std::ostringstream c;
    c << spec_.json << "|" << o_.grid.str() << "|" << o_.dtype << "|" << o_.seed << "|" << o_.data
      << "|" << o_.val_data << "|" << o_.val_fraction << "|" << o_.epochs << "|" << o_.steps << "|"
      << o_.batch << "|" << static_cast<int>(o_.optimizer.kind) << "|" << o_.optimizer.momentum
      << "|" << o_.optimizer.weight_decay << "|" << o_.lr << "|"
      << static_cast<int>(o_.schedule.kind) << "|" << o_.schedule.step_size << "|"
      << o_.schedule.gamma << "|" << o_.checkpoint_dir << "|" << o_.checkpoint_every << "|"
      << o_.resume << "|" << o_.keep_checkpoints << "|" << o_.allow_changes << "|" << o_.verify_data
      << "|" << o_.log_every << "|" << o_.samples << "|" << o_.height << "|" << o_.width << "|"
      << o_.val_samples << "|" << o_.init << "|" << __DATE__ << __TIME__;
    check_same_everywhere(world_, "configuration (model, options, build)", c.str());
  }
}

template <typename T>
void Trainer<T>::build() {
  runtime_.emplace(make_runtime(world_, o_.grid, runtime_options_));
  memory_ = run_memory_budget(world_, runtime_options_.kernels);
  segmentation_ = spec_.loss == LossKind::pixel_cross_entropy;
  agree(world_, [&] { open_data(); });

  // The model, for the global batch.
  Shape4 image{o_.batch, spec_.input_channels, o_.height, o_.width};
  if (train_data_) {
    const DatasetInfo& info = train_data_->info();
    image = {o_.batch, info.channels, info.height, info.width};
  }
  agree(world_, [&] {
    // Before anything the size of the image is allocated or computed (a model's set-up is).
    const bool files = train_data_ != nullptr;
    const std::int64_t order =
        files ? static_cast<std::int64_t>(2 * train_.index.size() + val_.index.size())
              : saturating_add(saturating_mul(2, o_.samples), o_.val_samples);
    memory_estimate_ =
        check_run_memory(spec_,
                         {.grid = o_.grid,
                          .input = image,
                          .dtype = o_.dtype,
                          .optimizer_states = o_.optimizer.kind == OptimizerKind::adam ? 2
                                              : o_.optimizer.momentum != 0             ? 1
                                                                                       : 0,
                          .confusion_matrices = 2,
                          .sample_order_bytes = saturating_mul(order, sizeof(std::int64_t)),
                          .evaluates = files ? !val_.index.empty() : o_.val_samples > 0,
                          .engine = plan_engine(runtime_->options())},
                         memory_);
    model_.emplace(spec_, *runtime_, image);
    model_->check_trainable();
    const Shape4 out = model_->output_distribution().global;
    classes_ = out.c;
    if (!train_data_) {
      SyntheticOptions s{
          .task = segmentation_ ? SyntheticTask::segmentation : SyntheticTask::classification,
          .samples = o_.samples,
          .channels = spec_.input_channels,
          .height = o_.height,
          .width = o_.width,
          // The model may predict more classes than the generator draws.
          .classes = std::min<std::int64_t>(classes_, segmentation_ ? 4 : 64),
          .seed = o_.seed};
      train_data_ = std::make_unique<SyntheticDataset>(s);
      TESSERA_CHECK(o_.val_samples >= 0, "--val-samples must not be negative (0: no validation)");
      train_ = {train_data_.get(), {}};
      for (std::int64_t k = 0; k < o_.samples; ++k)
        train_.index.push_back(k);
      if (o_.val_samples > 0) {
        s.samples = o_.val_samples;
        s.seed = o_.seed + 0x5eed;  // held-out images, never seen in training
        val_data_ = std::make_unique<SyntheticDataset>(s);
        val_ = {val_data_.get(), {}};
        for (std::int64_t k = 0; k < o_.val_samples; ++k)
          val_.index.push_back(k);
      }
      data_text_ =
          "built-in synthetic " + std::string(segmentation_ ? "segmentation" : "classification") +
          ", " + std::to_string(o_.samples) + " samples of " + std::to_string(image.c) + "x" +
          std::to_string(image.h) + "x" + std::to_string(image.w) + ", " +
          std::to_string(classes_) + " classes; " +
          (o_.val_samples > 0 ? "validation " + std::to_string(o_.val_samples) + " held-out samples"
                              : "no validation (--val-samples 0)");
    }
    const DatasetInfo& info = train_data_->info();
    if (segmentation_) {
      const std::string size = std::to_string(out.h) + "x" + std::to_string(out.w);
      const std::string labels =
          "[N, " + std::to_string(out.h) + ", " + std::to_string(out.w) + "]";
      TESSERA_CHECK(
          info.label_height == out.h && info.label_width == out.w,
          "the labels are " + std::to_string(info.label_height) + "x" +
              std::to_string(info.label_width) + " but the model's output is " + size +
              (o_.data.empty() ? ": the built-in data labels every pixel of its images, so it "
                                 "trains models whose output has the image's size; train this one "
                                 "on a --data file whose /labels are " +
                                     labels
                               : ": this model needs /labels " + labels));
    }
    TESSERA_CHECK(info.classes == 0 || info.classes <= classes_,
                  "the data has " + std::to_string(info.classes) + " classes, the model predicts " +
                      std::to_string(classes_));
    TESSERA_CHECK(static_cast<std::int64_t>(train_.index.size()) >= o_.batch,
                  "the batch of " + std::to_string(o_.batch) + " is larger than the " +
                      std::to_string(train_.index.size()) + " training samples");
    TESSERA_CHECK(val_.index.empty() || static_cast<std::int64_t>(val_.index.size()) >= o_.batch,
                  "the validation set has " + std::to_string(val_.index.size()) +
                      " samples, fewer than one batch of " + std::to_string(o_.batch));
  });
  if (o_.verify_data) {
    // Collective; the data sets of files only (the built-in set is generated, not read).
    agree(world_, [&] {
      TESSERA_CHECK(!o_.data.empty(), "--verify-data needs --data (the built-in set is generated)");
    });
    for (Dataset* d : {train_data_.get(), val_data_.get()})
      if (auto* file = dynamic_cast<H5Dataset*>(d)) file->verify(world_, classes_, out_);
  }
  sampler_.emplace(static_cast<std::int64_t>(train_.index.size()), o_.batch, o_.seed);
  steps_per_epoch_ = sampler_->batches_per_epoch();
  agree(world_, [&] {
    TESSERA_CHECK(o_.steps > 0 || steps_per_epoch_ <= 0 ||
                      o_.epochs <= std::numeric_limits<std::int64_t>::max() / steps_per_epoch_,
                  "--epochs " + std::to_string(o_.epochs) + " of " +
                      std::to_string(steps_per_epoch_) +
                      " steps each is more steps than a run can count: give fewer");
  });
  total_steps_ = o_.steps > 0 ? o_.steps : o_.epochs * steps_per_epoch_;
  schedule_ = o_.schedule;
  schedule_.total_steps = total_steps_;

  model_->init_params(o_.seed);
  if (!o_.init.empty())  // every rank reads the file: the parameters are replicated
    agree(world_, [&] { read_params(o_.init, *model_); });
  model_->set_input_grad(false);  // training never reads dL/dimages
  agree(world_, [&] {
    TESSERA_CHECK(std::isfinite(o_.lr) && o_.lr >= 0,
                  "--lr must be a finite number >= 0, not " + std::to_string(o_.lr));
    if (schedule_.kind == ScheduleKind::step) {
      TESSERA_CHECK(schedule_.step_size >= 1, "--lr-step-size must be at least 1, not " +
                                                  std::to_string(schedule_.step_size));
      TESSERA_CHECK(schedule_.gamma >= 0,
                    "--lr-gamma must be >= 0, not " + std::to_string(schedule_.gamma));
    }
    optimizer_.emplace(o_.optimizer, *model_);  // refuses a bad --momentum or --weight-decay
  });
  window_confusion_.emplace(classes_);
  // The batch in the host memory the backend copies from fastest: page-locked for a GPU, whose
  // copy engines read it directly (one DMA a step instead of a copy through the driver's bounce
  // buffer: a 3x2048x2048 float image took 7.5 ms from pageable memory on an H200, ~1 ms at the
  // page-locked copies' rate); plain host memory otherwise.
  x_ = DistTensor<T>(model_->input_distribution(), Layout::nchw, runtime_->allocator().staging());
}

template <typename T>
std::int64_t Trainer<T>::resume() {
  if (!o_.resume) return 0;
  // Rank 0 chooses the newest checkpoint that verifies, so that every rank resumes from the same
  // step (or each says why not).
  std::string path, skipped, newest_reason;
  agree(world_, [&] {
    if (!root()) return;
    const std::vector<std::string> all = checkpoints_newest_first(o_.checkpoint_dir);
    for (const std::string& candidate : all) {
      try {
        verify_checkpoint(candidate);
        path = candidate;
        break;
      } catch (const Error& e) {
        skipped += "  resume: skipped " + candidate + ": " + e.what() + "\n";
        if (newest_reason.empty()) newest_reason = e.what();
      }
    }
    out_ << skipped << std::flush;  // before any error, about these or the one chosen
    TESSERA_CHECK(all.empty() || !path.empty(),
                  "no checkpoint in " + o_.checkpoint_dir + " verifies, so nothing is resumed (" +
                      std::to_string(all.size()) +
                      " skipped, as listed above; the newest: " + newest_reason +
                      "): remove them, or start afresh in another --checkpoint-dir");
  });
  broadcast(world_, path, 0);
  std::int64_t start = 0;
  std::vector<std::string> changes;
  agree(world_, [&] {
    if (path.empty()) return;
    const CheckpointState s = read_checkpoint(path, *model_, *optimizer_, checkpoint_identity());
    std::map<std::string, std::string> now = computation_options(), then = s.options;
    for (const auto& [name, value] : now) {
      if (then.count(name) == 0)
        if (const auto since = kRecordedSince.find(name); since != kRecordedSince.end()) {
          if (since->second.empty()) continue;  // not known: not compared
          then[name] = since->second;           // what such a run computed with
        }
      if (then.count(name) == 0 || then[name] != value)
        changes.push_back(name + " " + (then.count(name) ? then[name] : "(not recorded)") + " -> " +
                          value);
    }
    std::string list;
    for (const std::string& c : changes)
      list += (list.empty() ? "" : ", ") + c;
    TESSERA_CHECK(changes.empty() || o_.allow_changes,
                  "'" + path + "' was written by a run with other options: " + list +
                      ". The run would not continue as it began: pass --allow-changes to go on "
                      "with the new options, or start afresh in another --checkpoint-dir");
    start = s.step;
    window_steps_ = s.window_steps;
    window_loss_ = s.window_loss;
    // Summed over the grid already: one rank holds them, so the next reduction counts them once.
    if (root())
      std::copy(s.window_counts.begin(), s.window_counts.end(),
                window_confusion_->counts().begin());
  });
  last_good_ = path;
  if (!path.empty()) saved_ = start;
  if (root()) {
    out_ << "  resume: ";
    if (path.empty())
      out_ << "no checkpoint in " << o_.checkpoint_dir << ", starting afresh";
    else
      out_ << path << " (step " << start << ")";
    if (start >= total_steps_)
      out_ << "; the run's " << total_steps_ << " steps are done, nothing to train";
    out_ << "\n";
    for (const std::string& c : changes)
      out_ << "  resume: changed (--allow-changes): " << c << "\n";
    // The first start of a batch script that always passes --resume takes --init; later ones
    // go on from their checkpoint.
    if (!path.empty() && !o_.init.empty())
      out_ << "  resume: the parameters are the checkpoint's; --init " << o_.init
           << " applies to a fresh start only\n";
  }
  return start;
}

template <typename T>
double Trainer<T>::step(std::int64_t step) {
  const std::int64_t epoch = step / steps_per_epoch_;
  // On the host the batch is handed over to the model (its first layer keeps it for backward
  // instead of a copy) and allocated again for the next step; on a device the model copies it
  // there, and the page-locked staging buffer stays.
  if (!(x_.local.shape() == model_->input_distribution().local_shape()))  // handed over
    x_ = DistTensor<T>(model_->input_distribution(), Layout::nchw, runtime_->allocator().staging());
  const bool hand_over = &x_.local.allocator() == &runtime_->allocator();
  read_batch(train_, sampler_->batch(epoch, step % steps_per_epoch_), x_, labels_);
  model_->state() = {.mode = Mode::train, .seed = o_.seed, .step = step};
  runtime_->comm().set_step(step);
  const StepResult<T> r = hand_over ? forward_backward(*model_, std::move(x_), labels_)
                                    : forward_backward(*model_, x_, labels_);
  // Counted from 1, as the progress lines count steps done.
  check_finite_loss(world_, r.loss, step + 1, "try a smaller --lr; " + last_good_text());
  const double lr = learning_rate(schedule_, o_.lr, step);
  optimizer_->step(lr);
  window_loss_ += r.loss;
  ++window_steps_;
  ++timed_steps_;
  window_confusion_->add(r.output, labels_);
  return lr;
}

template <typename T>
void Trainer<T>::log(std::int64_t done, double lr) {
  const std::int64_t epoch = (done - 1) / steps_per_epoch_;
  Confusion& window_confusion = *window_confusion_;
  window_confusion.reduce(grid());
  // Windows are contiguous: the next one begins where this one's time and activity are taken,
  // so a wait in the monitoring below (a peer stopped after this rank's snapshot) is counted in
  // the next window, not lost between two.
  const auto window_ended = clock_type::now();
  const ActivityTimes activity_at_end = activity_totals();
  const double elapsed = std::chrono::duration<double>(window_ended - window_began_).count();
  // Epochs count from 1 in the metrics, as on the console.
  Record rec{.step = done,
             .epoch = epoch + 1,
             .split = "train",
             .loss = window_loss_ / static_cast<double>(window_steps_),
             .accuracy = window_confusion.accuracy(),
             .mean_iou = window_confusion.mean_iou(),
             .lr = lr,
             .images_per_s = static_cast<double>(timed_steps_ * o_.batch) / elapsed,
             .monitor = monitor(elapsed, activity_at_end - window_activity_)};
  metrics_->write(rec, segmentation_);
  if (root()) {
    const double per_step = seconds_since(began_) / static_cast<double>(done - start_);
    std::ostringstream line;
    line << "step " << done << "/" << total_steps_ << "  epoch " << epoch + 1 << "  loss "
         << std::fixed << std::setprecision(4) << rec.loss << "  acc " << rec.accuracy;
    if (segmentation_) line << "  mIoU " << rec.mean_iou;
    line << "  " << std::setprecision(1) << rec.images_per_s << " img/s";
    const Monitor& m = *rec.monitor;
    if (world_.size(Group::world) > 1)
      line << "  wait " << std::setprecision(0) << 100 * m.wait_share << "% (slowest r"
           << m.slowest_rank << ")";
    line << "  mem " << std::setprecision(0) << m.peak_mib_max << " MiB";
    if (world_.size(Group::world) > 1) line << " (r" << m.peak_rank << ")";
    line << "  ETA " << duration_text(per_step * static_cast<double>(total_steps_ - done));
    if (o_.progress_line) {
      out_ << "\r" << line.str() << "\033[K" << std::flush;
      line_open_ = true;
    } else
      out_ << line.str() << "\n" << std::flush;
  }
  window_loss_ = 0;
  window_steps_ = 0;
  timed_steps_ = 0;
  window_confusion = Confusion(classes_);
  window_began_ = window_ended;
  window_activity_ = activity_at_end;
}

template <typename T>
Monitor Trainer<T>::monitor(double elapsed, const ActivityTimes& a) {
  const double share = std::clamp(
      (a[Activity::waiting] + a[Activity::allreduce] - a.stalled) / std::max(elapsed, 1e-9), 0.0,
      1.0);
  const auto ranks = static_cast<std::size_t>(world_.size(Group::world));
  std::vector<long long> shares(ranks), peaks(ranks);
  {
    Timed timed(Activity::waiting);  // for a stopped peer: counted in the next window
    Request r = world_.start_allgather(std::llround(share * 1e6), shares, Group::world,
                                       "straggler monitoring");
    world_.wait(r);
    r = world_.start_allgather(std::llround(interval_peak_memory_mib() * 1024), peaks, Group::world,
                               "memory monitoring");
    world_.wait(r);
  }
  Monitor m;
  const auto least = std::min_element(shares.begin(), shares.end());
  const auto most_memory = std::max_element(peaks.begin(), peaks.end());
  m.slowest_rank = static_cast<int>(least - shares.begin());
  m.max_wait_share = static_cast<double>(*std::max_element(shares.begin(), shares.end())) / 1e6;
  long long sum = 0;
  for (long long v : shares)
    sum += v;
  m.wait_share = static_cast<double>(sum) / 1e6 / static_cast<double>(ranks);
  m.peak_rank = static_cast<int>(most_memory - peaks.begin());
  m.peak_mib_max = static_cast<double>(*most_memory) / 1024;
  m.peak_mib_min = static_cast<double>(*std::min_element(peaks.begin(), peaks.end())) / 1024;
  return m;
}

template <typename T>
void Trainer<T>::report_validation(std::int64_t done, double lr) {
  const std::int64_t epoch = (done - 1) / steps_per_epoch_;
  Record v = validate(done, epoch + 1);
  v.lr = lr;  // the rate the model was last trained with
  metrics_->write(v, segmentation_);
  if (!root()) return;
  if (line_open_) out_ << "\n";
  line_open_ = false;
  if (done % steps_per_epoch_ == 0)
    out_ << "validation after epoch " << epoch + 1;
  else
    out_ << "validation at step " << done << " (part of epoch " << epoch + 1 << ")";
  out_ << ": loss " << std::fixed << std::setprecision(4) << v.loss << "  acc " << v.accuracy;
  if (segmentation_) out_ << "  mIoU " << v.mean_iou;
  out_ << std::defaultfloat << "\n" << std::flush;
}

template <typename T>
void Trainer<T>::after_step(std::int64_t done, double lr) {
  const bool epoch_end = done % steps_per_epoch_ == 0 || done == total_steps_;
  if (done % o_.log_every == 0 || done == total_steps_ || epoch_end) log(done, lr);
  // Images per second count training only: the time of validation and checkpoints is left out.
  const auto pause_began = clock_type::now();
  const ActivityTimes activity_before = activity_totals();
  if (epoch_end && !val_.index.empty()) report_validation(done, lr);
  if (!o_.checkpoint_dir.empty() && (checkpoint_due(done) || done == total_steps_))
    save(done, done / steps_per_epoch_);
  window_began_ += clock_type::now() - pause_began;
  window_activity_ += activity_totals() - activity_before;
}

template <typename T>
void Trainer<T>::finish() {
  const auto [peak_min, peak_max] = peak_memory_range_mib(world_);
  if (!root()) return;
  if (line_open_) out_ << "\n";
  out_ << "done: " << std::max<std::int64_t>(0, total_steps_ - start_) << " steps in "
       << duration_text(seconds_since(began_)) << "; peak memory per rank " << std::fixed
       << std::setprecision(1) << peak_min << ".." << peak_max << " MiB" << std::defaultfloat
       << estimate_note(memory_estimate_) << "\n";
}

template <typename T>
int Trainer<T>::stop(std::int64_t done, int signal) {
  const bool keep = !o_.checkpoint_dir.empty();
  if (keep && saved_ != done) save(done, done / steps_per_epoch_);  // else already written
  if (root()) {
    if (line_open_) out_ << "\n";
    line_open_ = false;
    out_ << "stopped by " << signal_name(signal) << " after step " << done << " of " << total_steps_
         << ": ";
    if (keep)
      out_ << "checkpoint " << checkpoint_path(o_.checkpoint_dir, done)
           << " written; the same command with --resume continues from it (exit status "
           << kExitStoppedResumable << ")\n";
    else
      out_ << "no --checkpoint-dir was given, so the " << done - start_
           << " steps of this run are lost\n";
    out_ << std::flush;
  }
  return keep ? kExitStoppedResumable : 1;
}

template <typename T>
int Trainer<T>::run() {
  check_options();
  build();
  start_ = resume();
  // Resuming, the file keeps the lines up to the checkpoint's step.
  agree(world_, [&] { metrics_.emplace(root() ? o_.metrics : "", o_.resume ? start_ : -1); });
  print_summary();
  began_ = window_began_ = clock_type::now();
  window_activity_ = activity_totals();
  for (done_ = start_; !should_stop(done_);) {
    const double lr = step(done_);
    after_step(++done_, lr);
    // Every rank stops after the same step when any of them was signalled (agreed per step).
    if (should_stop(done_)) break;
    if (const int signal = agreed_stop_signal(world_)) return stop(done_, signal);
  }
  finish();
  return 0;
}

}  // namespace

int run_train(const TrainOptions& options, const Comm& world, const RuntimeOptions& runtime,
              std::ostream& out) {
  agree(world, [&] { check_dtype(options.dtype, runtime); });
  install_stop_signals();
  return with_dtype(options.dtype, [&](auto zero) {
    return Trainer<decltype(zero)>(options, world, runtime, out).run();
  });
}

}  // namespace tessera
