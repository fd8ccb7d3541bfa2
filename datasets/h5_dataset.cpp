#include "tessera/h5_dataset.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <utility>
#include <vector>

#include "tessera/batch.hpp"
#include "tessera/collectives.hpp"
#include "tessera/error.hpp"

namespace tessera {
namespace {

void check_box(const Box& box, std::int64_t height, std::int64_t width, const std::string& what,
               const std::string& path) {
  const bool inside = box.h.begin >= 0 && box.h.end <= height && box.w.begin >= 0 &&
                      box.w.end <= width && !box.empty();
  TESSERA_CHECK(inside, "'" + path + "': the tile " + to_string(box) +
                            " is empty or lies outside " + what + " (" + std::to_string(height) +
                            " x " + std::to_string(width) + ")");
}

H5Dataset::Identity identify(const std::string& path) {
  struct stat st {};
  TESSERA_CHECK(::stat(path.c_str(), &st) == 0,
                "cannot examine '" + path + "': " + std::strerror(errno));
  return {
      .size = static_cast<std::int64_t>(st.st_size),
      .modified_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
      .inode = static_cast<std::uint64_t>(st.st_ino),
      .device = static_cast<std::uint64_t>(st.st_dev)};
}

// The CRC-32 of 16 pieces of 64 KiB spread evenly over the file (all of a small file): 1 MiB
// read per rank, whatever the file's size, tells different files behind one path apart, though
// they have the same size and structure (the same dataset written with another seed).
std::uint32_t fingerprint(const std::string& path, std::int64_t size) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), "cannot read '" + path + "'");
  constexpr std::int64_t kPiece = 64 * 1024, kPieces = 16;
  std::vector<unsigned char> piece(kPiece);
  std::uint32_t crc = 0;
  for (std::int64_t k = 0; k < kPieces; ++k) {
    const std::int64_t at =
        size <= kPiece * kPieces ? k * kPiece : (size - kPiece) / (kPieces - 1) * k;
    if (at >= size) break;
    const std::int64_t n = std::min(kPiece, size - at);
    in.seekg(at);
    in.read(reinterpret_cast<char*>(piece.data()), n);
    TESSERA_CHECK(in.gcount() == n, "cannot read '" + path + "' (it shrank while being read?)");
    crc = h5::checksum({piece.data(), static_cast<std::size_t>(n)}, crc);
  }
  return crc;
}

// Every rank examines the file behind `path`; they agree on its size and fingerprint or throw
// an agreed Error showing what rank 0 and the first differing rank see. Collective over `comm`.
H5Dataset::Identity agree_on_file(const std::string& path, const Comm& comm) {
  H5Dataset::Identity id;
  std::string seen;
  agree(comm, [&] {
    TESSERA_CHECK(std::filesystem::exists(path), "file '" + path + "' does not exist");
    id = identify(path);
    char hex[16];
    std::snprintf(hex, sizeof hex, "%08x", fingerprint(path, id.size));
    seen = std::to_string(id.size) + " bytes, fingerprint " + hex;
  });
  const int size = comm.size(Group::world);
  const long long mine =
      h5::checksum({reinterpret_cast<const unsigned char*>(seen.data()), seen.size()});
  std::vector<long long> all(static_cast<std::size_t>(size));
  Request r = comm.start_allgather(mine, all, Group::world, "agreement on the file '" + path + "'");
  comm.wait(r);
  int first = 0, differing = 0;
  for (int k = 1; k < size; ++k)
    if (all[static_cast<std::size_t>(k)] != all[0]) {
      if (differing++ == 0) first = k;
    }
  if (differing == 0) return id;
  std::string on_root = seen, on_first = seen;
  broadcast(comm, on_root, 0);
  broadcast(comm, on_first, first);
  throw Error("the ranks see different files behind '" + path + "': rank 0 " + on_root + ", rank " +
                  std::to_string(first) + " " + on_first +
                  (differing > 1 ? " (and " + std::to_string(differing - 1) + " more ranks differ)"
                                 : std::string()) +
                  ". Is the path the same file on every node?",
              "h5_dataset.cpp", /*agreed=*/true);
}

}  // namespace

H5Dataset::H5Dataset(const std::string& path, const Comm& comm, bool labels_required)
    : identity_(agree_on_file(path, comm)), file_(h5::File::open_read_parallel(path, comm)) {
  agree(comm, [&] {
    const BatchFileInfo b = inspect_batch_file(file_, labels_required);
    const h5::DatasetInfo im = file_.info("/images");
    uint8_ = im.kind == h5::Kind::integer;  // inspect_batch_file admits uint8 only
    const bool per_image = b.has_labels && file_.info("/labels").dims.size() == 1;
    info_ = {.samples = b.images.n,
             .channels = b.images.c,
             .height = b.images.h,
             .width = b.images.w,
             .labels = per_image ? LabelKind::per_image : LabelKind::per_pixel,
             .label_height = b.labels[1],
             .label_width = b.labels[2],
             .classes = 0,
             .has_labels = b.has_labels};
  });
}

H5Dataset::~H5Dataset() {
  // Leaks the handle on purpose: see the header.
  if (std::uncaught_exceptions() > exceptions_at_open_)
    static_cast<void>(new h5::File(std::move(file_)));
}

void H5Dataset::read(std::span<const std::int64_t> samples, const Box& image_tile,
                     const Box& label_tile, Tensor<float>& images, Labels& labels) {
  try {
    read_tiles(samples, image_tile, label_tile, images, labels);
  } catch (const Error&) {
    check_unchanged();  // a read that failed because the file changed (was truncated) says so
    throw;
  }
}

void H5Dataset::read(std::span<const std::int64_t> samples, const Box& image_tile,
                     const Box& label_tile, Tensor<double>& images, Labels& labels) {
  try {
    read_tiles(samples, image_tile, label_tile, images, labels);
  } catch (const Error&) {
    check_unchanged();  // a read that failed because the file changed (was truncated) says so
    throw;
  }
}

void H5Dataset::check_unchanged() const {
  const std::string& path = file_.path();
  std::string change;
  if (!std::filesystem::exists(path)) {
    change = "it was removed";
  } else {
    const Identity now = identify(path);
    if (now == identity_) return;
    if (now.inode != identity_.inode || now.device != identity_.device)
      change = "it was replaced by another file";
    else if (now.size != identity_.size)
      change = "its size went from " + std::to_string(identity_.size) + " to " +
               std::to_string(now.size) + " bytes";
    else
      change = "it was modified";
  }
  throw Error("'" + path + "' changed while the job was reading it (" + change +
              "): stopping, so that no step trains on what it holds now");
}

template <typename T>
void H5Dataset::read_tiles(std::span<const std::int64_t> samples, const Box& image_tile,
                           const Box& label_tile, Tensor<T>& images, Labels& labels) {
  const std::string& path = file_.path();
  for (std::int64_t s : samples)
    TESSERA_CHECK(s >= 0 && s < info_.samples, "'" + path + "' has no sample " + std::to_string(s) +
                                                   " (it has " + std::to_string(info_.samples) +
                                                   ")");
  check_box(image_tile, info_.height, info_.width, "the images", path);
  const auto k = static_cast<std::int64_t>(samples.size());
  const Shape4 shape{k, info_.channels, image_tile.h.size(), image_tile.w.size()};
  if (!(images.shape() == shape)) images = Tensor<T>(shape);
  const std::array<std::int64_t, 3> offset{0, image_tile.h.begin, image_tile.w.begin};
  const std::array<std::int64_t, 3> count{shape.c, shape.h, shape.w};
  file_.read_entries<T>("/images", samples, offset, count, images.span());
  if (uint8_)
    for (T& v : images.span())
      v /= T(255);
  const auto per_sample = static_cast<std::size_t>(shape.c * shape.h * shape.w);
  for (std::size_t n = 0; n < samples.size(); ++n) {
    const auto first = images.span().begin() + static_cast<std::ptrdiff_t>(n * per_sample);
    const auto bad = std::find_if(first, first + static_cast<std::ptrdiff_t>(per_sample),
                                  [](T v) { return !std::isfinite(v); });
    TESSERA_CHECK(bad == first + static_cast<std::ptrdiff_t>(per_sample),
                  "'" + path + "': /images holds " + std::to_string(*bad) + " in sample " +
                      std::to_string(samples[n]) + ", rows " + to_string(image_tile.h) +
                      ", columns " + to_string(image_tile.w) + " (every pixel must be finite)");
  }

  std::vector<std::int64_t> wide;
  std::size_t per_label = 1;
  if (!info_.has_labels) {
    labels.clear();
    check_unchanged();
    return;
  }
  if (info_.labels == LabelKind::per_image) {
    wide.resize(samples.size());
    file_.read_entries<std::int64_t>("/labels", samples, {}, {}, wide);
  } else {
    check_box(label_tile, info_.label_height, info_.label_width, "the label maps", path);
    per_label = static_cast<std::size_t>(label_tile.size());
    wide.resize(samples.size() * per_label);
    const std::array<std::int64_t, 2> at{label_tile.h.begin, label_tile.w.begin};
    const std::array<std::int64_t, 2> extent{label_tile.h.size(), label_tile.w.size()};
    file_.read_entries<std::int64_t>("/labels", samples, at, extent, wide);
  }
  labels.resize(wide.size());
  for (std::size_t e = 0; e < wide.size(); ++e) {
    const std::int64_t v = wide[e];
    TESSERA_CHECK(
        v >= 0 && v <= std::numeric_limits<std::int32_t>::max(),
        "'" + path + "': /labels holds " + std::to_string(v) + " in sample " +
            std::to_string(samples[e / per_label]) +
            (info_.labels == LabelKind::per_image
                 ? ""
                 : ", rows " + to_string(label_tile.h) + ", columns " + to_string(label_tile.w)) +
            (v < 0 ? " (a class index is never negative)" : " (too large for a class index)"));
    labels[e] = static_cast<std::int32_t>(v);
  }
  // After the reads: a file that changed before or while they ran is caught here.
  check_unchanged();
}

namespace {

// The values of `bytes` (elements of `info`'s type) as doubles: finite checks and label ranges.
double element(const h5::DatasetInfo& info, const unsigned char* p) {
  const auto load = [p]<typename V>(V) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return static_cast<double>(v);
  };
  if (info.kind == h5::Kind::floating) return info.bytes == 4 ? load(float{}) : load(double{});
  switch (info.bytes) {
    case 1:
      return info.is_signed ? load(std::int8_t{}) : load(std::uint8_t{});
    case 2:
      return info.is_signed ? load(std::int16_t{}) : load(std::uint16_t{});
    case 4:
      return info.is_signed ? load(std::int32_t{}) : load(std::uint32_t{});
    default:
      return info.is_signed ? load(std::int64_t{}) : load(std::uint64_t{});
  }
}

}  // namespace

void H5Dataset::verify(const Comm& comm, std::int64_t classes, std::ostream& out) {
  using Clock = std::chrono::steady_clock;
  const std::string& path = file_.path();
  const int rank = comm.rank(), ranks = comm.size(Group::world);
  const bool checksums = file_.has("/image_crc32") && file_.has("/label_crc32");
  std::vector<std::int64_t> image_crc, label_crc;
  const h5::DatasetInfo images = file_.info("/images"), labels = file_.info("/labels");
  const auto start = Clock::now();
  auto last = start;
  std::int64_t bytes_read = 0;
  agree(comm, [&] {
    if (checksums) {
      // Checked before reading: a damaged file may claim any shape.
      const std::vector<std::int64_t> one_per_sample{info_.samples};
      TESSERA_CHECK(file_.info("/image_crc32").dims == one_per_sample &&
                        file_.info("/label_crc32").dims == one_per_sample,
                    "'" + path + "': /image_crc32 and /label_crc32 must hold one value per sample");
      image_crc = file_.read<std::int64_t>("/image_crc32");
      label_crc = file_.read<std::int64_t>("/label_crc32");
    }
    const std::int64_t c = info_.channels, h = info_.height, w = info_.width;
    // Bands of rows of about 8 MiB, whatever the image's size.
    const std::int64_t rows =
        std::clamp<std::int64_t>((std::int64_t{8} << 20) / std::max<std::int64_t>(1, w * 8), 1, h);
    for (std::int64_t s = rank; s < info_.samples; s += ranks) {
      std::uint32_t crc = 0;
      for (std::int64_t ch = 0; ch < c; ++ch)
        for (std::int64_t r0 = 0; r0 < h; r0 += rows) {
          const std::int64_t n = std::min(rows, h - r0);
          const std::int64_t at[] = {s, ch, r0, 0}, count[] = {1, 1, n, w};
          const std::vector<unsigned char> b = file_.read_bytes("/images", at, count);
          bytes_read += static_cast<std::int64_t>(b.size());
          crc = h5::checksum(b, crc);
          if (images.kind != h5::Kind::floating) continue;
          for (std::size_t e = 0; e < b.size(); e += images.bytes) {
            const double v = element(images, b.data() + e);
            const auto px = static_cast<std::int64_t>(e / images.bytes);
            TESSERA_CHECK(std::isfinite(v),
                          "'" + path + "': /images holds " + std::to_string(v) + " in sample " +
                              std::to_string(s) + ", channel " + std::to_string(ch) + ", row " +
                              std::to_string(r0 + px / w) + ", column " + std::to_string(px % w) +
                              " (every pixel must be finite)");
          }
        }
      TESSERA_CHECK(!checksums || crc == static_cast<std::uint32_t>(image_crc[s]),
                    "'" + path + "': the image of sample " + std::to_string(s) +
                        " does not match its checksum in /image_crc32 (the file was damaged or "
                        "changed after it was written)");
      std::uint32_t label_sum = 0;
      const bool per_pixel = labels.dims.size() == 3;
      const std::int64_t lh = per_pixel ? labels.dims[1] : 1, lw = per_pixel ? labels.dims[2] : 1;
      for (std::int64_t r0 = 0; r0 < lh; r0 += rows) {
        const std::int64_t n = std::min(rows, lh - r0);
        const std::vector<std::int64_t> at =
            per_pixel ? std::vector<std::int64_t>{s, r0, 0} : std::vector<std::int64_t>{s};
        const std::vector<std::int64_t> count =
            per_pixel ? std::vector<std::int64_t>{1, n, lw} : std::vector<std::int64_t>{1};
        const std::vector<unsigned char> b = file_.read_bytes("/labels", at, count);
        bytes_read += static_cast<std::int64_t>(b.size());
        label_sum = h5::checksum(b, label_sum);
        for (std::size_t e = 0; e < b.size(); e += labels.bytes) {
          const double v = element(labels, b.data() + e);
          const auto px = static_cast<std::int64_t>(e / labels.bytes);
          TESSERA_CHECK(v >= 0 && v < static_cast<double>(classes),
                        "'" + path + "': /labels holds " + std::to_string(std::llround(v)) +
                            " in sample " + std::to_string(s) +
                            (per_pixel ? ", row " + std::to_string(r0 + px / lw) + ", column " +
                                             std::to_string(px % lw)
                                       : std::string()) +
                            ", outside the model's " + std::to_string(classes) + " classes [0, " +
                            std::to_string(classes) + ")");
        }
      }
      TESSERA_CHECK(!checksums || label_sum == static_cast<std::uint32_t>(label_crc[s]),
                    "'" + path + "': the labels of sample " + std::to_string(s) +
                        " do not match their checksum in /label_crc32 (the file was damaged or "
                        "changed after it was written)");
      const auto now = Clock::now();
      if (rank == 0 && now - last > std::chrono::seconds(2)) {
        last = now;
        out << "  verifying '" << path << "': " << s + 1 << "/" << info_.samples << " samples"
            << std::endl;
      }
    }
    check_unchanged();
  });
  const long long total = allreduce_sum(comm, static_cast<long long>(bytes_read));
  if (rank == 0) {
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    char rate[64];
    std::snprintf(rate, sizeof rate, "%.1f MB in %.1f s", static_cast<double>(total) / 1e6,
                  seconds);
    out << "  verified '" << path << "': " << info_.samples << " samples, " << rate << "; "
        << (checksums ? "every sample matches its checksums"
                      : "finite pixels and labels in range (the file carries no checksums)")
        << std::endl;
  }
}

}  // namespace tessera
