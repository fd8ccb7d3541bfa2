#include <numeric>
#include <string>
#include <utility>

#include "tessera/dataset.hpp"
#include "tessera/error.hpp"
#include "tessera/random.hpp"

namespace tessera {
namespace {

// Uniform in [0, bound) from counter-based bits: plain modulo after rejecting the top
// 2^64 % bound values, which would otherwise make small results more likely. std's
// distributions are implementation-defined, and every rank on every platform must agree.
std::uint64_t uniform_below(std::uint64_t bound, std::uint64_t seed, std::uint64_t stream,
                            std::uint64_t& counter) {
  const std::uint64_t rejected = (0 - bound) % bound;  // 2^64 mod bound
  for (;;) {
    const std::uint64_t r = random_bits(seed, stream, counter++);
    if (r >= rejected) return r % bound;
  }
}

}  // namespace

EpochSampler::EpochSampler(std::int64_t size, std::int64_t batch, std::uint64_t seed)
    : size_(size), batch_(batch), seed_(seed) {
  TESSERA_CHECK(batch >= 1, "the batch size must be at least 1, not " + std::to_string(batch));
  TESSERA_CHECK(batch <= size, "the batch size " + std::to_string(batch) +
                                   " is larger than the dataset (" + std::to_string(size) +
                                   " samples): an epoch would have no batch");
}

const std::vector<std::int64_t>& EpochSampler::permutation(std::int64_t epoch) const {
  TESSERA_CHECK(epoch >= 0, "epoch " + std::to_string(epoch) + " is negative");
  if (epoch == cached_epoch_) return order_;
  cached_epoch_ = -1;  // stays invalid if the allocation below throws
  order_.resize(static_cast<std::size_t>(size_));
  std::iota(order_.begin(), order_.end(), std::int64_t{0});
  // Fisher-Yates; the epoch is the stream, so each epoch draws from its own sequence.
  const std::uint64_t stream = hash_string("epoch-sampler") + static_cast<std::uint64_t>(epoch);
  std::uint64_t counter = 0;
  for (std::int64_t i = size_ - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(
        uniform_below(static_cast<std::uint64_t>(i) + 1, seed_, stream, counter));
    std::swap(order_[static_cast<std::size_t>(i)], order_[static_cast<std::size_t>(j)]);
  }
  cached_epoch_ = epoch;
  return order_;
}

std::vector<std::int64_t> EpochSampler::batch(std::int64_t epoch, std::int64_t index) const {
  TESSERA_CHECK(index >= 0 && index < batches_per_epoch(),
                "batch " + std::to_string(index) + " is outside the epoch's [0, " +
                    std::to_string(batches_per_epoch()) + ") batches");
  const std::vector<std::int64_t>& order = permutation(epoch);
  const auto begin = order.begin() + index * batch_;
  return std::vector<std::int64_t>(begin, begin + batch_);
}

}  // namespace tessera
