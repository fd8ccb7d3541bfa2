#include "tessera/h5_dataset.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <utility>

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

}  // namespace

H5Dataset::H5Dataset(const std::string& path, const Comm& comm)
    : file_(h5::File::open_read_parallel(path, comm)) {
  agree(comm, [&] {
    const BatchFileInfo b = inspect_batch_file(file_);
    const h5::DatasetInfo im = file_.info("/images");
    uint8_ = im.kind == h5::Kind::integer;  // inspect_batch_file admits uint8 only
    const bool per_image = file_.info("/labels").dims.size() == 1;
    info_ = {.samples = b.images.n,
             .channels = b.images.c,
             .height = b.images.h,
             .width = b.images.w,
             .labels = per_image ? LabelKind::per_image : LabelKind::per_pixel,
             .label_height = b.labels[1],
             .label_width = b.labels[2],
             .classes = 0};
  });
}

H5Dataset::~H5Dataset() {
  // Leaks the handle on purpose: see the header.
  if (std::uncaught_exceptions() > exceptions_at_open_)
    static_cast<void>(new h5::File(std::move(file_)));
}

void H5Dataset::read(std::span<const std::int64_t> samples, const Box& image_tile,
                     const Box& label_tile, Tensor<float>& images,
                     std::vector<std::int32_t>& labels) {
  read_tiles(samples, image_tile, label_tile, images, labels);
}

void H5Dataset::read(std::span<const std::int64_t> samples, const Box& image_tile,
                     const Box& label_tile, Tensor<double>& images,
                     std::vector<std::int32_t>& labels) {
  read_tiles(samples, image_tile, label_tile, images, labels);
}

template <typename T>
void H5Dataset::read_tiles(std::span<const std::int64_t> samples, const Box& image_tile,
                           const Box& label_tile, Tensor<T>& images,
                           std::vector<std::int32_t>& labels) {
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
}

}  // namespace tessera
