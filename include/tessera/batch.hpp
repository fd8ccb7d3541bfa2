// Batches of images and per-pixel labels: from HDF5 files (README.md "Files", each rank reading
// only its own tile) or generated from a seed. Every function is local.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/dataset.hpp"
#include "tessera/dist_tensor.hpp"
#include "tessera/io/hdf5.hpp"

namespace tessera {

struct BatchFileInfo {
  Shape4 images;                       // /images [N, C, H, W]
  std::array<std::int64_t, 3> labels;  // /labels [N, H, W]; [N] reads as [N, 1, 1]
  bool has_labels = true;              // false: the file has no /labels (labels is then zeros)
};

// Checks that `file` holds /images (float32, float64 or uint8, rank 4) and /labels (integer,
// rank 3 for per-pixel classes or rank 1 for one class per image, same N), every sample written
// (h5::File::check_written); throws an Error naming the file and the dataset otherwise. Without
// `labels_required`, a file without /labels passes (images to predict on).
BatchFileInfo inspect_batch_file(const h5::File& file, bool labels_required = true);

// This rank's tile of /images for distribution `d` (its samples, every channel, its rows and
// columns); uint8 images are scaled to [0, 1].
template <typename T>
Tensor<T> read_image_tile(const h5::File& file, const Distribution& d);

// This rank's tile of /labels for distribution `d` (d.global is the logits' shape, whose C is
// the class count); every label is checked to lie in [0, C).
Labels read_label_tile(const h5::File& file, const Distribution& d);

// Uniform(-1, 1) images and uniform labels in [0, C) whose values depend only on the seed and
// the global index, so every grid sees the same batch.
template <typename T>
Tensor<T> random_image_tile(const Distribution& d, std::uint64_t seed);
Labels random_label_tile(const Distribution& d, std::uint64_t seed);

// Writes `group`/images and `group`/labels (whole tensors; "" for the root) into `file`. The
// labels are [N, H, W] of `logits`' shape, or [N] when the logits are one vector per sample.
template <typename T>
void write_batch(h5::File& file, const std::string& group, const Tensor<T>& images,
                 std::span<const std::int32_t> labels, const Distribution& logits);

}  // namespace tessera
