#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "tessera/dataset.hpp"
#include "tessera/error.hpp"
#include "tessera/partition.hpp"

namespace tessera {
namespace {

bool is_permutation_of_range(std::vector<std::int64_t> v, std::int64_t size) {
  std::sort(v.begin(), v.end());
  std::vector<std::int64_t> expect(static_cast<std::size_t>(size));
  std::iota(expect.begin(), expect.end(), std::int64_t{0});
  return v == expect;
}

TEST(EpochSampler, EveryEpochIsAPermutationCutIntoConsecutiveBatches) {
  std::vector<std::int64_t> sizes;
  for (std::int64_t s = 1; s <= 40; ++s)
    sizes.push_back(s);
  for (std::int64_t s : {63, 64, 65, 257, 1000, 4099})
    sizes.push_back(s);
  for (std::int64_t size : sizes)
    for (std::int64_t batch :
         {std::int64_t{1}, std::int64_t{2}, std::int64_t{3}, size / 2 + 1, size})
      for (std::int64_t epoch : {0, 1, 7}) {
        if (batch > size) continue;
        const EpochSampler sampler(size, batch, 11);
        const std::vector<std::int64_t> perm = sampler.permutation(epoch);
        ASSERT_TRUE(is_permutation_of_range(perm, size)) << size << " epoch " << epoch;
        ASSERT_EQ(sampler.batches_per_epoch(), size / batch);
        std::vector<std::int64_t> batches;
        for (std::int64_t b = 0; b < sampler.batches_per_epoch(); ++b) {
          const std::vector<std::int64_t> got = sampler.batch(epoch, b);
          ASSERT_EQ(got.size(), static_cast<std::size_t>(batch));
          const auto begin = perm.begin() + b * batch;
          ASSERT_TRUE(std::equal(got.begin(), got.end(), begin, begin + batch))
              << "size " << size << " batch " << batch << " index " << b;
          batches.insert(batches.end(), got.begin(), got.end());
        }
        // The batches are the permutation's first batches_per_epoch * batch entries; the rest,
        // fewer than a batch, are dropped.
        ASSERT_EQ(static_cast<std::int64_t>(batches.size()), size - size % batch);
        ASSERT_EQ(std::set<std::int64_t>(batches.begin(), batches.end()).size(), batches.size());
      }
}

TEST(EpochSampler, TheLastShortBatchIsDropped) {
  const EpochSampler sampler(10, 3, 5);
  EXPECT_EQ(sampler.batches_per_epoch(), 3);
  const std::vector<std::int64_t> perm = sampler.permutation(2);
  std::set<std::int64_t> seen;
  for (std::int64_t b = 0; b < 3; ++b)
    for (std::int64_t s : sampler.batch(2, b))
      seen.insert(s);
  EXPECT_EQ(seen.size(), 9u);
  EXPECT_EQ(seen.count(perm[9]), 0u);  // the tenth sample waits for another epoch
  EXPECT_THROW(sampler.batch(2, 3), Error);
  EXPECT_THROW(sampler.batch(2, -1), Error);
}

TEST(EpochSampler, IsDeterministicAcrossInstancesAndCallOrder) {
  const EpochSampler a(37, 4, 2024), b(37, 4, 2024);
  const std::vector<std::int64_t> a3 = a.batch(3, 5);
  const std::vector<std::int64_t> a0 = a.batch(0, 1);
  EXPECT_EQ(b.batch(0, 1), a0);  // b computes epoch 0 first, a computed epoch 3 first
  EXPECT_EQ(b.batch(3, 5), a3);
  EXPECT_EQ(a.batch(3, 5), a3);
}

// Pinned values: integer arithmetic on counter-based bits must give these on every platform and
// compiler, or ranks built differently would train on different batches (the values were checked
// against an independent Python implementation of random_bits and this Fisher-Yates).
TEST(EpochSampler, GivesThePinnedPermutation) {
  const EpochSampler sampler(10, 2, 42);
  EXPECT_EQ(sampler.permutation(0), (std::vector<std::int64_t>{0, 7, 6, 8, 2, 3, 5, 9, 1, 4}));
  EXPECT_EQ(sampler.permutation(1), (std::vector<std::int64_t>{2, 9, 8, 6, 4, 1, 3, 5, 0, 7}));
}

TEST(EpochSampler, EpochsAndSeedsGiveDifferentOrders) {
  const EpochSampler sampler(20, 5, 1);
  std::set<std::vector<std::int64_t>> orders;
  for (std::int64_t epoch = 0; epoch < 10; ++epoch)
    orders.insert(sampler.permutation(epoch));
  EXPECT_EQ(orders.size(), 10u);
  const EpochSampler other(20, 5, 2);
  EXPECT_NE(other.permutation(0), sampler.permutation(0));
}

// Fisher-Yates with an unbiased draw makes every permutation equally likely; an off-by-one (a
// draw from [0, i) instead of [0, i]) would give only cyclic permutations.
TEST(EpochSampler, EveryPermutationOfFourIsEquallyLikely) {
  const EpochSampler sampler(4, 1, 99);
  std::map<std::vector<std::int64_t>, int> counts;
  const int epochs = 24000;
  for (int e = 0; e < epochs; ++e)
    ++counts[sampler.permutation(e)];
  ASSERT_EQ(counts.size(), 24u);
  double chi2 = 0;
  for (const auto& [perm, count] : counts)
    chi2 += (count - 1000.0) * (count - 1000.0) / 1000.0;
  EXPECT_LT(chi2, 60.0);  // 23 degrees of freedom: P(chi2 > 60) < 1e-4
}

// Each data-parallel group takes its block_range of every batch: over the groups, every sample
// of the epoch's batches is taken exactly once, for any number of groups up to the batch.
TEST(EpochSampler, GroupsSplittingEveryBatchSeeEachSampleOnce) {
  for (std::int64_t size : {9, 17, 30})
    for (std::int64_t batch : {2, 3, 5, 8})
      for (int groups = 1; groups <= batch && groups <= 5; ++groups) {
        const EpochSampler sampler(size, batch, 3);
        std::vector<int> seen(static_cast<std::size_t>(size), 0);
        for (std::int64_t b = 0; b < sampler.batches_per_epoch(); ++b) {
          const std::vector<std::int64_t> samples = sampler.batch(4, b);
          for (int g = 0; g < groups; ++g) {
            const Range mine = block_range(batch, groups, g);
            for (std::int64_t k = mine.begin; k < mine.end; ++k)
              ++seen[static_cast<std::size_t>(samples[static_cast<std::size_t>(k)])];
          }
        }
        const std::vector<std::int64_t>& perm = sampler.permutation(4);
        for (std::size_t k = 0; k < perm.size(); ++k)
          EXPECT_EQ(seen[static_cast<std::size_t>(perm[k])],
                    static_cast<std::int64_t>(k) < sampler.batches_per_epoch() * batch ? 1 : 0)
              << "size " << size << " batch " << batch << " groups " << groups;
      }
}

TEST(EpochSampler, RejectsImpossibleBatches) {
  EXPECT_THROW(EpochSampler(10, 0, 1), Error);
  EXPECT_THROW(EpochSampler(10, -2, 1), Error);
  EXPECT_THROW(EpochSampler(10, 11, 1), Error);
  EXPECT_THROW(EpochSampler(0, 1, 1), Error);
  EXPECT_NO_THROW(EpochSampler(10, 10, 1));
  try {
    EpochSampler(5, 8, 1);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch size 8 is larger than the dataset (5 samples)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(EpochSampler(10, 2, 1).permutation(-1), Error);
}

}  // namespace
}  // namespace tessera
