// `tessera datagen`: writes the built-in synthetic dataset to an HDF5 file (README.md "Files"),
// streamed one band of chunk rows at a time, so no image, let alone the dataset, has to fit in
// memory. Rank 0 writes; the other ranks only wait for its result (the data is cheap to
// generate and one writer keeps the file simple).
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>

#include "command.hpp"
#include "tessera/collectives.hpp"
#include "tessera/drivers/driver.hpp"
#include "tessera/error.hpp"
#include "tessera/io/hdf5.hpp"
#include "tessera/synthetic.hpp"

namespace tessera::cli {
namespace {

using Clock = std::chrono::steady_clock;

// "HxW": two positive integers.
std::array<std::int64_t, 2> parse_chunk(const std::string& text) {
  const std::vector<std::int64_t> v = parse_sizes(
      text, 2,
      "bad --chunk '" + text +
          "': expected HxW, two positive integers (rows x columns of one chunk), e.g. 256x256");
  return {v[0], v[1]};
}

std::string bytes_text(double bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000 && u < 4) {
    bytes /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, s < 10 ? "%.2f s" : "%.0f s", s);
  return buf;
}

struct Request {
  std::string output;
  bool uint8 = false;
  std::array<std::int64_t, 2> chunk{};  // rows x columns, clipped to the image
  std::int64_t image_bytes = 0, label_bytes = 0;
};

// Samples done / total, at most once a second: plain lines, or one updating line on a terminal.
class Progress {
 public:
  Progress(std::int64_t total_bytes, std::ostream& out)
      : total_(total_bytes), out_(out), tty_(::isatty(STDOUT_FILENO) == 1), start_(Clock::now()) {}

  void update(std::int64_t samples_done, std::int64_t samples, std::int64_t bytes_done) {
    const double elapsed = seconds();
    if (elapsed - last_ < 1 || samples_done == samples) return;
    last_ = elapsed;
    const double rate = static_cast<double>(bytes_done) / std::max(elapsed, 1e-9);
    out_ << (tty_ ? "\r" : "") << "  " << samples_done << "/" << samples << " samples, "
         << bytes_text(static_cast<double>(bytes_done)) << " of "
         << bytes_text(static_cast<double>(total_)) << ", " << bytes_text(rate) << "/s, ETA "
         << seconds_text(static_cast<double>(total_ - bytes_done) / std::max(rate, 1.0))
         << (tty_ ? "   " : "\n") << std::flush;
    dirty_ = tty_;
  }
  // Ends the updating line, if one was written.
  void finish() {
    if (dirty_) out_ << "\n";
    dirty_ = false;
  }
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  std::int64_t total_;
  std::ostream& out_;
  bool tty_;
  Clock::time_point start_;
  double last_ = 0;
  bool dirty_ = false;
};

// Writes /images [N, C, H, W] (float32 or uint8) and /labels ([N, H, W] or [N], int32) into
// `file`, one band of chunk rows of one sample at a time: every write covers whole chunks.
void write_dataset(SyntheticDataset& data, const Request& r, h5::File& file, std::ostream& out) {
  const DatasetInfo& info = data.info();
  const std::int64_t n = info.samples, c = info.channels, h = info.height, w = info.width;
  const auto [ch, cw] = r.chunk;
  const bool per_pixel = info.labels == LabelKind::per_pixel;
  // Fletcher-32 on every chunk: HDF5 checks it on every read, so damage is an error, not data.
  if (r.uint8)
    file.create_chunked<std::uint8_t>("/images", {n, c, h, w}, {1, c, ch, cw}, true);
  else
    file.create_chunked<float>("/images", {n, c, h, w}, {1, c, ch, cw}, true);
  if (per_pixel) file.create_chunked<std::int32_t>("/labels", {n, h, w}, {1, ch, cw}, true);
  std::vector<std::int32_t> image_labels;  // per image: N values, written at the end
  // Per-sample CRC-32s of the image and the labels as stored (README.md "Files"): what
  // `tessera train --verify-data` compares. A band holds rows of every channel, so each channel
  // keeps its own CRC, joined in channel order at the end of the sample.
  std::vector<std::int64_t> image_crc, label_crc;
  std::vector<std::uint32_t> channel_crc(static_cast<std::size_t>(c));
  std::uint32_t labels_crc = 0;
  const auto crc_of = [](const auto* data, std::size_t count, std::uint32_t previous) {
    return h5::checksum({reinterpret_cast<const unsigned char*>(data), count * sizeof *data},
                        previous);
  };

  Tensor<float> band;
  Labels labels;
  std::vector<std::uint8_t> bytes;
  Progress progress(r.image_bytes + r.label_bytes, out);
  std::int64_t done = 0;
  for (std::int64_t s = 0; s < n; ++s) {
    for (std::int64_t h0 = 0; h0 < h; h0 += ch) {
      const Box box{{h0, std::min(h, h0 + ch)}, {0, w}};
      const std::int64_t sample[] = {s};
      data.read(sample, box, box, band, labels);
      const std::array<std::int64_t, 4> offset{s, 0, h0, 0}, count{1, c, box.h.size(), w};
      const auto plane = static_cast<std::size_t>(box.h.size() * w);
      if (h0 == 0) {
        std::fill(channel_crc.begin(), channel_crc.end(), 0);
        labels_crc = 0;
      }
      if (r.uint8) {
        bytes.resize(band.span().size());
        std::transform(band.span().begin(), band.span().end(), bytes.begin(), [](float x) {
          return static_cast<std::uint8_t>(std::lround(255.0 * std::clamp(x, 0.0f, 1.0f)));
        });
        file.write_box<std::uint8_t>("/images", bytes, offset, count);
        for (std::size_t k = 0; k < channel_crc.size(); ++k)
          channel_crc[k] = crc_of(bytes.data() + k * plane, plane, channel_crc[k]);
      } else {
        file.write_box<float>("/images", band.span(), offset, count);
        for (std::size_t k = 0; k < channel_crc.size(); ++k)
          channel_crc[k] = crc_of(band.span().data() + k * plane, plane, channel_crc[k]);
      }
      if (per_pixel) {
        const std::array<std::int64_t, 3> at{s, h0, 0}, extent{1, box.h.size(), w};
        file.write_box<std::int32_t>("/labels", labels, at, extent);
        labels_crc = crc_of(labels.data(), labels.size(), labels_crc);
      } else if (h0 == 0) {
        image_labels.push_back(labels.front());
        labels_crc = crc_of(labels.data(), 1, 0);
      }
      if (box.h.end == h) {
        std::uint32_t whole = channel_crc[0];
        const std::int64_t channel_bytes = h * w * (r.uint8 ? 1 : 4);
        for (std::size_t k = 1; k < channel_crc.size(); ++k)
          whole = h5::checksum_combine(whole, channel_crc[k], channel_bytes);
        image_crc.push_back(whole);
        label_crc.push_back(labels_crc);
      }
      done += box.size() * (c * (r.uint8 ? 1 : 4) + (per_pixel ? 4 : 0));
      progress.update(s + (box.h.end == h ? 1 : 0), n, done);
      // SIGTERM (scancel, kill) or SIGUSR1: the temporary file goes (h5::write_atomically), the
      // target stays as it was. Rank 0 alone writes, and its own signal decides: the others wait
      // for it inside an agreement, so one signalled alone is noted there and not acted on
      // (scancel and mpiexec signal every rank).
      if (const int signal = stop_signal())
        throw Error("stopped by " + signal_name(signal) + " after " +
                    std::to_string(s + (box.h.end == h ? 1 : 0)) + " of " + std::to_string(n) +
                    " samples: nothing written to '" + r.output + "'");
    }
  }
  if (!per_pixel) file.write<std::int32_t>("/labels", image_labels, {n});
  file.write<std::int64_t>("/image_crc32", image_crc, {n});
  file.write<std::int64_t>("/label_crc32", label_crc, {n});
  const SyntheticOptions& o = data.options();
  file.set_attribute("generator", kSyntheticGenerator);
  file.set_attribute("task", to_string(o.task));
  file.set_attribute("seed", std::to_string(o.seed));
  file.set_attribute("classes", std::to_string(info.classes));
  progress.finish();
}

}  // namespace

int datagen_command(const std::vector<std::string>& args, const Comm& world,
                    RuntimeOptions runtime) {
  SyntheticOptions o;
  std::string output, task = "segmentation", dtype = "float32", chunk = "256x256";
  po::options_description d("Datagen options");
  d.add_options()("output", po::value(&output), "the HDF5 file to write (required)")(
      "task", po::value(&task)->default_value(task),
      "segmentation (per-pixel labels [N,H,W]: 0 background, shapes 1, or 1 + kind with 3-4 "
      "classes) or classification (labels [N]: the colour of the image's shapes)")(
      "samples", po::value(&o.samples)->default_value(o.samples), "number of images N")(
      "channels", po::value(&o.channels)->default_value(o.channels), "channels C")(
      "height", po::value(&o.height)->default_value(o.height), "image height H")(
      "width", po::value(&o.width)->default_value(o.width), "image width W")(
      "classes", po::value(&o.classes)->default_value(0),
      "classes; 0: 2 for segmentation (at most 4), 10 for classification (at most 64)")(
      "seed", po::value(&o.seed)->default_value(o.seed),
      "seed: the same options and seed give the same file")(
      "dtype", po::value(&dtype)->default_value(dtype),
      "float32 (values in [0, 1]) or uint8 (round(255 x), read back as x / 255)")(
      "chunk", po::value(&chunk)->default_value(chunk),
      "rows x columns of one HDF5 chunk of the images and labels (clipped to the image); "
      "memory use is one band of chunk rows");
  po::variables_map vm;
  if (!parse("datagen",
             "Writes the built-in synthetic dataset (filled circles, rectangles and triangles on "
             "a noisy\nbackground) to an HDF5 file with /images [N,C,H,W] and /labels, chunked by "
             "tile, as\n`tessera train --data` and `tessera gradcheck --input` read it. The file "
             "is written\nstreamed and atomically (a temporary file renamed at the end); rank 0 "
             "writes.",
             d, args, vm, world, runtime))
    return 0;
  // The other ranks wait for the whole write, with no deadline (it takes as long as the file),
  // polling politely so that they leave the cores to the writer (unless the user chose
  // otherwise).
  const std::unique_ptr<Comm> waiting =
      world.make_grid(world.shape(), {runtime.wait.value_or(WaitPolicy::sleep), kNoTimeout});

  // The options' agreement waits with this command's --wait and --timeout (cli::command_world).
  const std::unique_ptr<Comm> timed = command_world(world, runtime);
  std::unique_ptr<SyntheticDataset> data;
  Request r;
  agree(*timed, [&] {
    TESSERA_CHECK(!output.empty(), "--output FILE is required (see tessera datagen --help)");
    r.output = output;
    o.task = parse_synthetic_task(task);
    TESSERA_CHECK(dtype == "float32" || dtype == "uint8",
                  "unknown --dtype '" + dtype + "': expected float32 or uint8");
    r.uint8 = dtype == "uint8";
    const auto [ch, cw] = parse_chunk(chunk);
    data = std::make_unique<SyntheticDataset>(o);
    const DatasetInfo& info = data->info();
    r.chunk = {std::min(ch, info.height), std::min(cw, info.width)};
    const std::int64_t chunk_bytes = info.channels * r.chunk[0] * r.chunk[1] * (r.uint8 ? 1 : 4);
    TESSERA_CHECK(chunk_bytes < (std::int64_t{1} << 32),
                  "--chunk " + chunk + " with " + std::to_string(info.channels) +
                      " channels makes chunks of " + bytes_text(static_cast<double>(chunk_bytes)) +
                      "; HDF5 chunks must stay below 4 GiB");
    const std::int64_t pixels = info.samples * info.height * info.width;
    r.image_bytes = pixels * info.channels * (r.uint8 ? 1 : 4);
    r.label_bytes = (info.labels == LabelKind::per_pixel ? pixels : info.samples) * 4;
  });

  const DatasetInfo& info = data->info();
  const bool root = is_root(world);
  if (root) {
    std::cout << "tessera datagen: " << to_string(o.task) << ", " << info.samples << " samples of "
              << info.channels << "x" << info.height << "x" << info.width << ", " << info.classes
              << " classes, " << dtype << ", seed " << o.seed << ", chunks 1x" << info.channels
              << "x" << r.chunk[0] << "x" << r.chunk[1] << "\n"
              << "  writing " << r.output << ": images "
              << bytes_text(static_cast<double>(r.image_bytes)) << ", labels "
              << bytes_text(static_cast<double>(r.label_bytes)) << std::endl;
  }
  double elapsed = 0;
  agree(*waiting, [&] {
    if (!root) return;
    namespace fs = std::filesystem;
    const fs::path target(r.output);
    TESSERA_CHECK(!fs::is_directory(target), "cannot write '" + r.output + "': it is a directory");
    const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
    std::error_code ec;
    const fs::space_info space = fs::space(dir, ec);
    const std::int64_t needed = r.image_bytes + r.label_bytes;
    // Checked before the first byte, rather than failing hours in with a half-written file.
    TESSERA_CHECK(ec || space.available >= static_cast<std::uintmax_t>(needed),
                  "cannot write '" + r.output + "': it needs " +
                      bytes_text(static_cast<double>(needed)) + " but '" + dir.string() + "' has " +
                      bytes_text(static_cast<double>(space.available)) + " free");
    const auto start = Clock::now();
    h5::write_atomically(
        r.output, [&](h5::File& f) { write_dataset(*data, r, f, std::cout); }, h5::Staging::disk);
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  });
  if (root) {
    const double total = static_cast<double>(r.image_bytes + r.label_bytes);
    std::cout << "wrote " << r.output << ": " << info.samples << " samples, " << bytes_text(total)
              << " in " << seconds_text(elapsed) << " ("
              << bytes_text(total / std::max(elapsed, 1e-9)) << "/s)" << std::endl;
  }
  return 0;
}

}  // namespace tessera::cli
