// Quality of predictions over the global batch: a confusion matrix summed over every rank, and
// what users read from it (pixel accuracy and mean IoU for segmentation, accuracy for
// classification).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tessera/comm.hpp"
#include "tessera/dist_tensor.hpp"

namespace tessera {

class Confusion {
 public:
  explicit Confusion(std::int64_t classes)
      : classes_(classes), counts_(static_cast<std::size_t>(classes * classes), 0) {}

  // Adds this rank's predictions (argmax over channels of `logits`) against `labels` (its tile,
  // [N, H, W] or [N]). Replicated logits are counted by the first spatial rank of each sample
  // group only, so that a sample counts once. Local.
  template <typename T>
  void add(const DistTensor<T>& logits, std::span<const std::int32_t> labels);

  // Sums the counts over the grid. Collective over the world group.
  void reduce(const Comm& comm);

  std::int64_t classes() const { return classes_; }
  long long count(std::int64_t label, std::int64_t predicted) const {
    return counts_[static_cast<std::size_t>(label * classes_ + predicted)];
  }
  // Every count, [label][predicted]: to save and restore a partial sum (checkpoints).
  std::span<long long> counts() { return counts_; }
  long long total() const;
  double accuracy() const;  // correct / total
  // Mean over the classes that occur (in labels or predictions) of TP / (TP + FP + FN).
  double mean_iou() const;
  // Class k's TP / (TP + FP + FN); NaN when k occurs neither in the labels nor the predictions.
  double iou(std::int64_t k) const;

 private:
  std::int64_t classes_;
  std::vector<long long> counts_;  // [label][predicted]
};

}  // namespace tessera
