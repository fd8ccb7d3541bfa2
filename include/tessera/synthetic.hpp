// The built-in synthetic dataset: filled circles, rectangles and triangles on a noisy
// background, for segmentation (a class per pixel) or classification (a class per image).
// Every value is a pure function of (seed, sample, channel, row, column): a sample's shapes come
// from a counter-based hash of (seed, sample), a pixel's noise from a hash of its global index.
// So each rank generates only its own tile, in any order, and every grid sees the same data.
// Every function here is local and pure.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/box.hpp"
#include "tessera/dataset.hpp"

namespace tessera {

// Written into generated files, so that a file can be traced to the generator that made it.
// Bump it whenever a change to this generator changes any pixel or label.
inline constexpr const char* kSyntheticGenerator = "tessera-synthetic-1";

enum class SyntheticTask {
  segmentation,    // per-pixel labels: 0 background, 1 shape (or 1 + kind with 3 or 4 classes)
  classification,  // one label per image: the colour of its shapes, from a palette of `classes`
};

SyntheticTask parse_synthetic_task(const std::string& name);  // "segmentation" | "classification"
const char* to_string(SyntheticTask task);

struct SyntheticOptions {
  SyntheticTask task = SyntheticTask::segmentation;
  std::int64_t samples = 64;
  std::int64_t channels = 3;
  std::int64_t height = 256, width = 256;
  // 0: the task's default, 2 for segmentation, 10 for classification. Segmentation takes 2 to 4
  // (background plus one class per shape kind from 3 on); classification 2 to 64.
  std::int64_t classes = 0;
  std::uint64_t seed = 1;
};

enum class ShapeKind { circle, rectangle, triangle };

// A filled shape in integer pixel coordinates (row, column); membership is exact integer
// arithmetic, so row spans and per-pixel tests agree on every pixel.
struct SyntheticShape {
  ShapeKind kind = ShapeKind::circle;
  // circle: centre (p[0], p[1]), radius p[2]. rectangle: rows [p[0], p[2]], columns [p[1], p[3]]
  // (inclusive). triangle: vertices (p[0], p[1]), (p[2], p[3]), (p[4], p[5]).
  std::array<std::int64_t, 6> p{};
  std::int32_t label = 1;      // segmentation: the class of its pixels
  std::vector<double> colour;  // one value per channel, in [0, 1]

  bool contains(std::int64_t row, std::int64_t col) const;
  // The columns of `row` inside the shape: exactly those where contains() holds. May reach
  // outside the image; empty when the row misses the shape.
  Range columns(std::int64_t row) const;
};

// Everything about one sample but its per-pixel noise.
struct SyntheticScene {
  std::vector<double> background;      // one value per channel
  std::vector<SyntheticShape> shapes;  // painted in order: a later shape covers earlier ones
  double noise = 0;                    // pixel = clamp(colour + noise * (2u - 1), 0, 1)
  std::int32_t label = 0;              // classification: the image's class
};

class SyntheticDataset final : public Dataset {
 public:
  // Throws an Error naming the bad option (samples, channels, height, width, classes).
  explicit SyntheticDataset(const SyntheticOptions& options);

  const DatasetInfo& info() const override { return info_; }
  const SyntheticOptions& options() const { return options_; }

  SyntheticScene scene(std::int64_t sample) const;

  // One pixel and one label computed on their own, the slow way (every shape tested): the
  // definition that read() must reproduce on every tile.
  double pixel(std::int64_t sample, std::int64_t channel, std::int64_t row, std::int64_t col) const;
  // Segmentation: the pixel's class; classification: the image's (row and col ignored).
  std::int32_t label(std::int64_t sample, std::int64_t row, std::int64_t col) const;

  // The boxes must lie inside the image (an Error otherwise); `images` is reshaped to
  // [samples.size(), C, rows, cols] and `labels` resized. Float values are the double ones
  // rounded once.
  void read(std::span<const std::int64_t> samples, const Box& image_tile, const Box& label_tile,
            Tensor<float>& images, Labels& labels) override;
  void read(std::span<const std::int64_t> samples, const Box& image_tile, const Box& label_tile,
            Tensor<double>& images, Labels& labels) override;

 private:
  template <typename T>
  void read_tiles(std::span<const std::int64_t> samples, const Box& image_tile,
                  const Box& label_tile, Tensor<T>& images, Labels& labels);

  SyntheticOptions options_;
  DatasetInfo info_;
};

}  // namespace tessera
