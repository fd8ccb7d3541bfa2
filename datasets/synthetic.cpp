#include "tessera/synthetic.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "tessera/error.hpp"
#include "tessera/random.hpp"

namespace tessera {
namespace {

constexpr std::uint64_t kSceneStream = hash_string("synthetic/scene");
constexpr std::uint64_t kDrawStream = hash_string("synthetic/draw");
constexpr std::uint64_t kNoiseStream = hash_string("synthetic/noise");

// Draws for one sample, in a fixed order: a counter-based sequence keyed by (seed, sample).
class Draws {
 public:
  Draws(std::uint64_t seed, std::int64_t sample)
      : key_(random_bits(seed, kSceneStream, static_cast<std::uint64_t>(sample))) {}
  double uniform() { return uniform01(key_, kDrawStream, counter_++); }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Uniform in [lo, hi].
  std::int64_t integer(std::int64_t lo, std::int64_t hi) {
    const auto span = static_cast<double>(hi - lo + 1);
    return std::min(hi, lo + static_cast<std::int64_t>(uniform() * span));
  }

 private:
  std::uint64_t key_;
  std::uint64_t counter_ = 0;
};

std::int64_t floor_div(std::int64_t a, std::int64_t b) {  // b > 0
  const std::int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

std::int64_t isqrt(std::int64_t q) {  // the largest d with d * d <= q, for q >= 0
  auto d = static_cast<std::int64_t>(std::sqrt(static_cast<double>(q)));
  while (d * d > q)
    --d;
  while ((d + 1) * (d + 1) <= q)
    ++d;
  return d;
}

// Twice the signed area of the triangle; its sign is the orientation of the vertices.
std::int64_t orientation(const std::array<std::int64_t, 6>& p) {
  return (p[3] - p[1]) * (p[4] - p[0]) - (p[2] - p[0]) * (p[5] - p[1]);
}

// The pixel value: one definition for the fast tile path and the per-pixel one, so both round
// identically.
inline double shade(double base, double noise, double u) {
  return std::clamp(base + noise * (2 * u - 1), 0.0, 1.0);
}

// uniform01(seed, kNoiseStream, index) with the part that does not depend on the index hoisted:
// random_bits is splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ index).
std::uint64_t noise_key(std::uint64_t seed) {
  return splitmix64(splitmix64(seed) ^ kNoiseStream);
}
inline double noise_u(std::uint64_t key, std::uint64_t index) {
  return static_cast<double>(splitmix64(key ^ index) >> 11) * 0x1.0p-53;
}

// The palette of the classification task: `levels` brightness levels per channel, class k
// taking the base-`levels` digits of k as its channels' levels, so every two classes differ by
// a whole level in some channel and class k's shapes are told apart by colour alone.
std::int64_t palette_levels(std::int64_t classes, std::int64_t channels) {
  for (std::int64_t levels = 2;; ++levels) {
    std::int64_t colours = 1;
    for (std::int64_t c = 0; c < channels && colours < classes; ++c)
      colours *= levels;
    if (colours >= classes) return levels;
  }
}

constexpr double kPaletteLow = 0.4, kPaletteHigh = 1.0;

void add_geometry(SyntheticShape& s, Draws& d, std::int64_t height, std::int64_t width,
                  double size_lo, double size_hi) {
  const auto m = static_cast<double>(std::min(height, width));
  const std::int64_t cy = d.integer(0, height - 1), cx = d.integer(0, width - 1);
  auto extent = [&](double scale) {
    return std::max<std::int64_t>(1, std::llround(scale * m * d.uniform(size_lo, size_hi)));
  };
  switch (s.kind) {
    case ShapeKind::circle:
      s.p = {cy, cx, extent(1), 0, 0, 0};
      break;
    case ShapeKind::rectangle: {
      const std::int64_t a = extent(0.9), b = extent(0.9);
      s.p = {cy - a, cx - b, cy + a, cx + b, 0, 0};
      break;
    }
    case ShapeKind::triangle: {
      // Equal-area-ish with the circle: a triangle inscribed in radius r has 0.41 pi r^2.
      const double r = static_cast<double>(std::max<std::int64_t>(2, extent(1.5)));
      const double turn = 2 * std::numbers::pi / 3, start = d.uniform(0, turn);
      for (int k = 0; k < 3; ++k) {
        const double a = start + k * turn + d.uniform(-0.35, 0.35);
        s.p[2 * k] = cy + std::llround(r * std::sin(a));
        s.p[2 * k + 1] = cx + std::llround(r * std::cos(a));
      }
      // Rounding can flatten a tiny triangle to a line, whose "inside" would be the whole
      // line through it; a circle of the same size stands in.
      if (orientation(s.p) == 0) s = {ShapeKind::circle, {cy, cx, std::llround(r)}, s.label, {}};
      break;
    }
  }
}

void check_box(const Box& box, const DatasetInfo& info, const char* what) {
  TESSERA_CHECK(0 <= box.h.begin && box.h.begin <= box.h.end && box.h.end <= info.height &&
                    0 <= box.w.begin && box.w.begin <= box.w.end && box.w.end <= info.width,
                std::string("synthetic dataset: the ") + what + " box " + to_string(box) +
                    " is not inside the " + std::to_string(info.height) + "x" +
                    std::to_string(info.width) + " image");
}

}  // namespace

SyntheticTask parse_synthetic_task(const std::string& name) {
  if (name == "segmentation") return SyntheticTask::segmentation;
  if (name == "classification") return SyntheticTask::classification;
  throw Error("unknown task '" + name + "': expected segmentation or classification");
}

const char* to_string(SyntheticTask task) {
  return task == SyntheticTask::segmentation ? "segmentation" : "classification";
}

bool SyntheticShape::contains(std::int64_t row, std::int64_t col) const {
  switch (kind) {
    case ShapeKind::circle: {
      const std::int64_t dy = row - p[0], dx = col - p[1];
      return dy * dy + dx * dx <= p[2] * p[2];
    }
    case ShapeKind::rectangle:
      return p[0] <= row && row <= p[2] && p[1] <= col && col <= p[3];
    case ShapeKind::triangle: {
      const std::int64_t sign = orientation(p) > 0 ? 1 : -1;
      for (int k = 0; k < 3; ++k) {
        const std::int64_t ay = p[2 * k], ax = p[2 * k + 1];
        const std::int64_t by = p[(2 * k + 2) % 6], bx = p[(2 * k + 3) % 6];
        if (sign * ((bx - ax) * (row - ay) - (by - ay) * (col - ax)) < 0) return false;
      }
      return true;
    }
  }
  return false;
}

Range SyntheticShape::columns(std::int64_t row) const {
  switch (kind) {
    case ShapeKind::circle: {
      const std::int64_t dy = row - p[0], q = p[2] * p[2] - dy * dy;
      if (q < 0) return {};
      const std::int64_t d = isqrt(q);
      return {p[1] - d, p[1] + d + 1};
    }
    case ShapeKind::rectangle:
      if (row < p[0] || row > p[2]) return {};
      return {p[1], p[3] + 1};
    case ShapeKind::triangle: {
      // Each edge's test, sign * E >= 0 with E linear in the column, bounds the column from
      // one side: A + k (col - ax) >= 0.
      const std::int64_t sign = orientation(p) > 0 ? 1 : -1;
      std::int64_t lo = std::numeric_limits<std::int64_t>::min();
      std::int64_t hi = std::numeric_limits<std::int64_t>::max();
      for (int k = 0; k < 3; ++k) {
        const std::int64_t ay = p[2 * k], ax = p[2 * k + 1];
        const std::int64_t by = p[(2 * k + 2) % 6], bx = p[(2 * k + 3) % 6];
        const std::int64_t a = sign * (bx - ax) * (row - ay), slope = -sign * (by - ay);
        if (slope > 0)
          lo = std::max(lo, ax - floor_div(a, slope));  // col - ax >= ceil(-a / slope)
        else if (slope < 0)
          hi = std::min(hi, ax + floor_div(a, -slope));
        else if (a < 0)
          return {};
      }
      if (lo > hi) return {};
      return {lo, hi + 1};
    }
  }
  return {};
}

SyntheticDataset::SyntheticDataset(const SyntheticOptions& options) : options_(options) {
  const SyntheticOptions& o = options_;
  const bool seg = o.task == SyntheticTask::segmentation;
  if (options_.classes == 0) options_.classes = seg ? 2 : 10;
  const auto positive = [](std::int64_t v, const char* what) {
    // 2^31 keeps every product of coordinates in the shape tests far from overflow.
    TESSERA_CHECK(v >= 1 && v < (std::int64_t{1} << 31), std::string("synthetic dataset: ") + what +
                                                             " must be in [1, 2^31), got " +
                                                             std::to_string(v));
  };
  positive(o.samples, "samples");
  positive(o.channels, "channels");
  positive(o.height, "height");
  positive(o.width, "width");
  // Every value's global index, the key of its noise, must fit in 63 bits.
  const double values = static_cast<double>(o.samples) * static_cast<double>(o.channels) *
                        static_cast<double>(o.height) * static_cast<double>(o.width);
  TESSERA_CHECK(values < 0x1p62, "synthetic dataset: " + std::to_string(o.samples) + " x " +
                                     std::to_string(o.channels) + " x " + std::to_string(o.height) +
                                     " x " + std::to_string(o.width) +
                                     " values are more than 2^62");
  const std::int64_t max_classes = seg ? 4 : 64;
  TESSERA_CHECK(
      2 <= o.classes && o.classes <= max_classes,
      std::string("synthetic dataset: ") + to_string(o.task) + " has 2 to " +
          std::to_string(max_classes) + " classes" +
          (seg ? " (background, then one per shape kind: circle, rectangle, triangle)" : "") +
          ", got " + std::to_string(o.classes));
  info_.samples = o.samples;
  info_.channels = o.channels;
  info_.height = o.height;
  info_.width = o.width;
  info_.labels = seg ? LabelKind::per_pixel : LabelKind::per_image;
  info_.label_height = seg ? o.height : 1;
  info_.label_width = seg ? o.width : 1;
  info_.classes = o.classes;
}

SyntheticScene SyntheticDataset::scene(std::int64_t sample) const {
  const SyntheticOptions& o = options_;
  TESSERA_CHECK(0 <= sample && sample < o.samples, "synthetic dataset: sample " +
                                                       std::to_string(sample) + " is outside [0, " +
                                                       std::to_string(o.samples) + ")");
  Draws d(o.seed, sample);
  SyntheticScene s;
  const auto channels = static_cast<std::size_t>(o.channels);
  if (o.task == SyntheticTask::segmentation) {
    // Bright shapes on a dark background, each channel drawn on its own; with 3 or 4 classes a
    // shape's class is its kind, so only the outline tells classes apart.
    s.noise = 0.08;
    for (std::size_t c = 0; c < channels; ++c)
      s.background.push_back(d.uniform(0, 0.3));
    const std::int64_t kinds = o.classes == 3 ? 2 : 3;
    const std::int64_t count = d.integer(2, 6);
    for (std::int64_t k = 0; k < count; ++k) {
      SyntheticShape shape;
      shape.kind = static_cast<ShapeKind>(d.integer(0, kinds - 1));
      add_geometry(shape, d, o.height, o.width, 0.06, 0.2);
      shape.label = o.classes == 2 ? 1 : 1 + static_cast<std::int32_t>(shape.kind);
      for (std::size_t c = 0; c < channels; ++c)
        shape.colour.push_back(d.uniform(0.5, 1.0));
      s.shapes.push_back(std::move(shape));
    }
  } else {
    // A grey background below the palette, and one to three shapes of the class's colour: a
    // small convnet learns it from colour statistics, whatever the shapes' kinds and sizes.
    const std::int64_t levels = palette_levels(o.classes, o.channels);
    const double step = (kPaletteHigh - kPaletteLow) / static_cast<double>(levels - 1);
    s.noise = std::min(0.05, step / 4);
    s.label = static_cast<std::int32_t>(d.integer(0, o.classes - 1));
    s.background.assign(channels, d.uniform(0, 0.25));
    std::vector<double> colour;
    for (std::int64_t c = 0, rest = s.label; c < o.channels; ++c, rest /= levels)
      colour.push_back(kPaletteLow + step * static_cast<double>(rest % levels));
    const std::int64_t count = d.integer(1, 3);
    for (std::int64_t k = 0; k < count; ++k) {
      SyntheticShape shape;
      shape.kind = static_cast<ShapeKind>(d.integer(0, 2));
      add_geometry(shape, d, o.height, o.width, 0.12, 0.3);
      shape.label = s.label;
      shape.colour = colour;
      s.shapes.push_back(std::move(shape));
    }
  }
  return s;
}

double SyntheticDataset::pixel(std::int64_t sample, std::int64_t channel, std::int64_t row,
                               std::int64_t col) const {
  const SyntheticOptions& o = options_;
  const SyntheticScene s = scene(sample);
  const auto c = static_cast<std::size_t>(channel);
  double base = s.background.at(c);
  for (const SyntheticShape& shape : s.shapes)
    if (shape.contains(row, col)) base = shape.colour.at(c);
  const auto index = static_cast<std::uint64_t>(
      ((sample * o.channels + channel) * o.height + row) * o.width + col);
  return shade(base, s.noise, uniform01(o.seed, kNoiseStream, index));
}

std::int32_t SyntheticDataset::label(std::int64_t sample, std::int64_t row,
                                     std::int64_t col) const {
  const SyntheticScene s = scene(sample);
  if (options_.task == SyntheticTask::classification) return s.label;
  std::int32_t out = 0;
  for (const SyntheticShape& shape : s.shapes)
    if (shape.contains(row, col)) out = shape.label;
  return out;
}

namespace {

// Which shape covers each column of `cols` in `row`: 0 for the background, k + 1 for shape k
// (the last one painted wins, as in pixel()).
void paint(const SyntheticScene& s, std::int64_t row, Range cols,
           std::vector<std::int32_t>& owner) {
  std::fill_n(owner.begin(), cols.size(), 0);
  for (std::size_t k = 0; k < s.shapes.size(); ++k) {
    const Range r = intersect(s.shapes[k].columns(row), cols);
    for (std::int64_t w = r.begin; w < r.end; ++w)
      owner[static_cast<std::size_t>(w - cols.begin)] = static_cast<std::int32_t>(k + 1);
  }
}

}  // namespace

template <typename T>
void SyntheticDataset::read_tiles(std::span<const std::int64_t> samples, const Box& image_tile,
                                  const Box& label_tile, Tensor<T>& images, Labels& labels) {
  const SyntheticOptions& o = options_;
  const bool per_pixel = info_.labels == LabelKind::per_pixel;
  check_box(image_tile, info_, "image");
  if (per_pixel) check_box(label_tile, info_, "label");
  const auto n = static_cast<std::int64_t>(samples.size());
  const Shape4 shape{n, o.channels, image_tile.h.size(), image_tile.w.size()};
  if (!(images.shape() == shape)) images = Tensor<T>(shape);
  labels.assign(static_cast<std::size_t>(per_pixel ? n * label_tile.size() : n), 0);
  std::vector<std::int32_t> owner(
      static_cast<std::size_t>(std::max(image_tile.w.size(), label_tile.w.size())));
  const std::uint64_t key = noise_key(o.seed);
  const std::int64_t cols = image_tile.w.size();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t sample = samples[static_cast<std::size_t>(i)];
    const SyntheticScene s = scene(sample);
    // Base colours by owner, channel-major: table[c * (shapes + 1) + owner].
    const std::size_t owners = s.shapes.size() + 1;
    std::vector<double> table;
    for (std::size_t c = 0; c < s.background.size(); ++c) {
      table.push_back(s.background[c]);
      for (const SyntheticShape& shape : s.shapes)
        table.push_back(shape.colour[c]);
    }
    for (std::int64_t h = image_tile.h.begin; h < image_tile.h.end; ++h) {
      paint(s, h, image_tile.w, owner);
      for (std::int64_t c = 0; c < o.channels; ++c) {
        T* out = &images.at(i, c, h - image_tile.h.begin, 0);
        const double* base = table.data() + static_cast<std::size_t>(c) * owners;
        const auto first = static_cast<std::uint64_t>(
            ((sample * o.channels + c) * o.height + h) * o.width + image_tile.w.begin);
        for (std::int64_t j = 0; j < cols; ++j)
          out[j] = static_cast<T>(shade(base[owner[static_cast<std::size_t>(j)]], s.noise,
                                        noise_u(key, first + static_cast<std::uint64_t>(j))));
      }
    }
    if (!per_pixel) {
      labels[static_cast<std::size_t>(i)] = s.label;
      continue;
    }
    std::vector<std::int32_t> label_of{0};
    for (const SyntheticShape& shape : s.shapes)
      label_of.push_back(shape.label);
    auto out = labels.begin() + i * label_tile.size();
    for (std::int64_t h = label_tile.h.begin; h < label_tile.h.end; ++h) {
      paint(s, h, label_tile.w, owner);
      for (std::int64_t j = 0; j < label_tile.w.size(); ++j)
        *out++ = label_of[static_cast<std::size_t>(owner[static_cast<std::size_t>(j)])];
    }
  }
}

void SyntheticDataset::read(std::span<const std::int64_t> samples, const Box& image_tile,
                            const Box& label_tile, Tensor<float>& images, Labels& labels) {
  read_tiles(samples, image_tile, label_tile, images, labels);
}

void SyntheticDataset::read(std::span<const std::int64_t> samples, const Box& image_tile,
                            const Box& label_tile, Tensor<double>& images, Labels& labels) {
  read_tiles(samples, image_tile, label_tile, images, labels);
}

}  // namespace tessera
