// Where training samples come from: a dataset hands each rank its tile of given samples, and a
// sampler decides which samples form each batch.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/box.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

enum class LabelKind {
  per_pixel,  // /labels [N, H, W], for pixel_cross_entropy
  per_image,  // /labels [N], for cross_entropy
};

struct DatasetInfo {
  std::int64_t samples = 0;
  std::int64_t channels = 0, height = 0, width = 0;  // every image
  LabelKind labels = LabelKind::per_pixel;
  std::int64_t label_height = 0, label_width = 0;  // per_pixel: the label maps (1 x 1 per image)
  std::int64_t classes = 0;  // 0 when unknown (files): labels are then checked as they are read
  bool has_labels = true;    // false: images only (to predict on); read() returns no labels
};

// A batch's labels, as the datasets read them and the loss reads them: in the host pool's huge
// pages where large (tessera/allocator.hpp, HostVector, says why).
using Labels = HostVector<std::int32_t>;

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual const DatasetInfo& info() const = 0;
  // Reads, for each of `samples` (global indices, in this order), the `image_tile` box of its
  // image (every channel) into `images` [samples.size(), C, rows, cols], and the `label_tile` box
  // of its label map into `labels` (per_image: one label per sample; the box is ignored).
  // Images are scaled as the model sees them (uint8 / 255). Local unless the implementation says
  // otherwise.
  virtual void read(std::span<const std::int64_t> samples, const Box& image_tile,
                    const Box& label_tile, Tensor<float>& images, Labels& labels) = 0;
  virtual void read(std::span<const std::int64_t> samples, const Box& image_tile,
                    const Box& label_tile, Tensor<double>& images, Labels& labels) = 0;
};

// The order of samples: a permutation of [0, size) per epoch drawn from (seed, epoch), the same
// on every rank and platform (integer arithmetic only), cut into batches of `batch` samples (the
// last, short batch of an epoch is dropped, so every batch can be split over the data-parallel
// groups). Local and pure; the last epoch's permutation is cached, so one sampler must not be
// shared between threads.
class EpochSampler {
 public:
  // Throws an Error unless 1 <= batch <= size.
  EpochSampler(std::int64_t size, std::int64_t batch, std::uint64_t seed);
  std::int64_t batches_per_epoch() const { return size_ / batch_; }
  // The global batch `index` (in [0, batches_per_epoch())) of `epoch` (>= 0); data-parallel
  // group g of n takes its block_range(batch, n, g) part.
  std::vector<std::int64_t> batch(std::int64_t epoch, std::int64_t index) const;
  // The whole permutation of `epoch`; batch `index` is its entries [index*batch, (index+1)*batch).
  // The reference is valid until a call for another epoch.
  const std::vector<std::int64_t>& permutation(std::int64_t epoch) const;

 private:
  std::int64_t size_, batch_;
  std::uint64_t seed_;
  mutable std::int64_t cached_epoch_ = -1;
  mutable std::vector<std::int64_t> order_;
};

}  // namespace tessera
