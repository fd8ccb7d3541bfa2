// H5Dataset on the test grid: every rank reads exactly its tile of the samples it asks for, a bad
// file is one agreed Error on every rank, and data-parallel groups splitting the batches of an
// EpochSampler see every sample of an epoch once.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <vector>

#include "mpi_test.hpp"
#include "tessera/collectives.hpp"
#include "tessera/dataset.hpp"
#include "tessera/dist_tensor.hpp"
#include "tessera/error.hpp"
#include "tessera/h5_dataset.hpp"
#include "tessera/io/hdf5.hpp"
#include "tessera/partition.hpp"

namespace tessera {
namespace {

int world_rank() {
  return test::world().rank();
}

// A path every rank agrees on (rank 0's process id), removed by rank 0 once every rank is done
// with it. Declare it before the datasets that open it, so that they are closed first.
class SharedPath {
 public:
  explicit SharedPath(const std::string& name) {
    if (world_rank() == 0)
      path_ = (std::filesystem::temp_directory_path() /
               ("tessera_test_dataset_" + std::to_string(::getpid()) + "_" + name + ".h5"))
                  .string();
    broadcast(test::world(), path_, 0);
  }
  ~SharedPath() {
    try {
      allreduce_max(test::world(), 0);  // a barrier that waits through Comm::wait
    } catch (...) {
    }
    std::error_code ignored;
    if (world_rank() == 0) std::filesystem::remove(path_, ignored);
  }
  const std::string& str() const { return path_; }

 private:
  std::string path_;
};

enum class Pixels { uint8, float32, float64, int32 };
enum class LabelType { int32, int64, float32 };

struct Spec {
  Pixels pixels = Pixels::float32;
  LabelType labels = LabelType::int32;
  bool per_pixel = true;
  std::int64_t n = 7, c = 2, h = 13, w = 11;
  std::int64_t label_h = 7, label_w = 5;  // the label maps need not have the images' size
  std::int64_t label_n = 7;
  int image_rank = 4;
};

// Exact in float32: below 2^17, in steps of 1/2.
double image_value(std::int64_t s, std::int64_t c, std::int64_t h, std::int64_t w) {
  return double(s * 4096 + c * 1024 + h * 32 + w) + 0.5;
}
std::uint8_t uint8_value(std::int64_t s, std::int64_t c, std::int64_t h, std::int64_t w) {
  return static_cast<std::uint8_t>((s * 37 + c * 11 + h * 5 + w * 3) % 256);
}
std::int64_t pixel_label(std::int64_t s, std::int64_t h, std::int64_t w) {
  return s * 1000 + h * 20 + w;
}
std::int64_t image_label(std::int64_t s) {
  return s;  // tells the sample apart in EverySampleIsSeenOncePerEpoch
}

// File::write knows the types Tessera writes; a dataset's other types come through the C API.
void write_raw(const std::string& path, const std::string& name, hid_t type, const void* data,
               const std::vector<std::int64_t>& dims) {
  const std::vector<hsize_t> extent(dims.begin(), dims.end());
  const hid_t f = TESSERA_CHECK_HDF5(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
  const hid_t space =
      TESSERA_CHECK_HDF5(H5Screate_simple(static_cast<int>(extent.size()), extent.data(), nullptr));
  const hid_t d = TESSERA_CHECK_HDF5(
      H5Dcreate2(f, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  TESSERA_CHECK_HDF5(H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data));
  H5Dclose(d);
  H5Sclose(space);
  H5Fclose(f);
}

// Rank 0 writes the file; the agreement doubles as the barrier before anyone opens it.
void write_dataset(const std::string& path, const Spec& s) {
  agree(test::world(), [&] {
    if (world_rank() != 0) return;
    std::vector<std::int64_t> dims{s.n, s.c, s.h, s.w};
    dims.resize(static_cast<std::size_t>(s.image_rank), 1);
    std::vector<double> values;
    std::vector<std::uint8_t> bytes;
    for (std::int64_t n = 0; n < s.n; ++n)
      for (std::int64_t c = 0; c < s.c; ++c)
        for (std::int64_t h = 0; h < s.h; ++h)
          for (std::int64_t w = 0; w < s.w; ++w) {
            values.push_back(image_value(n, c, h, w));
            bytes.push_back(uint8_value(n, c, h, w));
          }
    std::vector<std::int64_t> labels;
    for (std::int64_t n = 0; n < s.label_n; ++n)
      if (!s.per_pixel)
        labels.push_back(image_label(n));
      else
        for (std::int64_t h = 0; h < s.label_h; ++h)
          for (std::int64_t w = 0; w < s.label_w; ++w)
            labels.push_back(pixel_label(n, h, w));
    const std::vector<std::int64_t> label_dims =
        s.per_pixel ? std::vector<std::int64_t>{s.label_n, s.label_h, s.label_w}
                    : std::vector<std::int64_t>{s.label_n};
    {
      h5::File f = h5::File::create(path);
      if (s.pixels == Pixels::float64) f.write<double>("/images", values, dims);
      if (s.pixels == Pixels::float32) {
        const std::vector<float> narrow(values.begin(), values.end());
        f.write<float>("/images", narrow, dims);
      }
      if (s.pixels == Pixels::int32) {
        const std::vector<std::int32_t> ints(values.begin(), values.end());
        f.write<std::int32_t>("/images", ints, dims);
      }
      if (s.labels == LabelType::int32) {
        const std::vector<std::int32_t> narrow(labels.begin(), labels.end());
        f.write<std::int32_t>("/labels", narrow, label_dims);
      }
      if (s.labels == LabelType::float32) {
        const std::vector<float> floats(labels.begin(), labels.end());
        f.write<float>("/labels", floats, label_dims);
      }
    }
    if (s.pixels == Pixels::uint8) write_raw(path, "/images", H5T_NATIVE_UINT8, bytes.data(), dims);
    if (s.labels == LabelType::int64)
      write_raw(path, "/labels", H5T_NATIVE_INT64, labels.data(), label_dims);
  });
}

Distribution image_dist(const Spec& s) {
  const Comm& grid = test::world();
  return {{s.n, s.c, s.h, s.w}, grid.shape(), grid.coords()};
}
Distribution label_dist(const Spec& s) {
  return image_dist(s).with_shape({s.n, 1, s.label_h, s.label_w});
}

// Compares a read against the values written, for the boxes given; names the first mismatch.
template <typename T>
void expect_tiles(const Spec& s, std::span<const std::int64_t> samples, const Box& image_box,
                  const Box& label_box, const Tensor<T>& images, const Labels& labels) {
  const auto k = static_cast<std::int64_t>(samples.size());
  ASSERT_EQ(images.shape(), (Shape4{k, s.c, image_box.h.size(), image_box.w.size()}));
  for (std::int64_t n = 0; n < k; ++n)
    for (std::int64_t c = 0; c < s.c; ++c)
      for (std::int64_t h = image_box.h.begin; h < image_box.h.end; ++h)
        for (std::int64_t w = image_box.w.begin; w < image_box.w.end; ++w) {
          const std::int64_t sample = samples[static_cast<std::size_t>(n)];
          const T expect = s.pixels == Pixels::uint8 ? T(uint8_value(sample, c, h, w)) / T(255)
                                                     : T(image_value(sample, c, h, w));
          const T got = images.at(n, c, h - image_box.h.begin, w - image_box.w.begin);
          ASSERT_EQ(got, expect) << "sample " << sample << " channel " << c << " pixel (" << h
                                 << ", " << w << ")";
        }
  Labels expect;
  for (std::int64_t sample : samples)
    if (!s.per_pixel)
      expect.push_back(static_cast<std::int32_t>(image_label(sample)));
    else
      for (std::int64_t h = label_box.h.begin; h < label_box.h.end; ++h)
        for (std::int64_t w = label_box.w.begin; w < label_box.w.end; ++w)
          expect.push_back(static_cast<std::int32_t>(pixel_label(sample, h, w)));
  EXPECT_EQ(labels, expect);
}

TEST(H5Dataset, EachRankReadsItsTileOfTheRequestedSamples) {
  const std::vector<Spec> specs{
      {.pixels = Pixels::uint8, .labels = LabelType::int64, .per_pixel = true},
      {.pixels = Pixels::float32, .labels = LabelType::int32, .per_pixel = false},
      {.pixels = Pixels::float64, .labels = LabelType::int64, .per_pixel = false},
      {.pixels = Pixels::float32, .labels = LabelType::int32, .per_pixel = true},
      {.pixels = Pixels::uint8, .labels = LabelType::int32, .per_pixel = false},
  };
  for (std::size_t k = 0; k < specs.size(); ++k) {
    SCOPED_TRACE("spec " + std::to_string(k));
    const Spec& s = specs[k];
    const SharedPath path("tiles" + std::to_string(k));
    write_dataset(path.str(), s);
    H5Dataset data(path.str(), test::world());
    const DatasetInfo& info = data.info();
    EXPECT_EQ(info.samples, s.n);
    EXPECT_EQ(info.channels, s.c);
    EXPECT_EQ(info.height, s.h);
    EXPECT_EQ(info.width, s.w);
    EXPECT_EQ(info.labels, s.per_pixel ? LabelKind::per_pixel : LabelKind::per_image);
    EXPECT_EQ(info.label_height, s.per_pixel ? s.label_h : 1);
    EXPECT_EQ(info.label_width, s.per_pixel ? s.label_w : 1);
    EXPECT_EQ(info.classes, 0);

    const Box image_box = image_dist(s).tile();
    const Box label_box = label_dist(s).tile();
    // Out of order, with a repeat (read once, placed twice), in order, and none.
    const std::vector<std::vector<std::int64_t>> requests{
        {5, 0, 3}, {5, 1, 2, 6, 1}, {0, 1, 2}, {6}, {}};
    for (const auto& samples : requests) {
      Tensor<float> images32;
      Tensor<double> images64;
      Labels labels32, labels64;
      data.read(samples, image_box, label_box, images32, labels32);
      data.read(samples, image_box, label_box, images64, labels64);
      expect_tiles<float>(s, samples, image_box, label_box, images32, labels32);
      expect_tiles<double>(s, samples, image_box, label_box, images64, labels64);
    }
    // Another rank's tile: any box may be read, not only one's own.
    const Box corner{{0, 1}, {s.w - 2, s.w}};
    Tensor<double> images;
    Labels labels;
    const std::vector<std::int64_t> samples{3, 4};
    data.read(samples, corner, {{s.label_h - 1, s.label_h}, {0, 2}}, images, labels);
    expect_tiles<double>(s, samples, corner, {{s.label_h - 1, s.label_h}, {0, 2}}, images, labels);
  }
}

// The requirement: across the data-parallel groups every sample is seen exactly once per
// epoch. Each group reads its block_range of every batch through the dataset (groups read
// different numbers of samples, so a collective read would hang), takes the sample's identity
// from the data it read, and the counts are summed over the groups.
TEST(H5Dataset, EverySampleIsSeenOncePerEpochAcrossTheGroups) {
  const Comm& grid = test::world();
  const Spec s{.pixels = Pixels::float32,
               .labels = LabelType::int32,
               .per_pixel = false,
               .n = 23,
               .label_n = 23};
  const SharedPath path("epoch");
  write_dataset(path.str(), s);
  H5Dataset data(path.str(), test::world());
  const Box tile = image_dist(s).tile();
  for (std::int64_t batch : {5, 6})
    for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
      SCOPED_TRACE("batch " + std::to_string(batch) + " epoch " + std::to_string(epoch));
      const EpochSampler sampler(s.n, batch, 17);
      std::vector<long long> seen(static_cast<std::size_t>(s.n), 0);
      for (std::int64_t b = 0; b < sampler.batches_per_epoch(); ++b) {
        const std::vector<std::int64_t> all = sampler.batch(epoch, b);
        const Range mine = block_range(batch, grid.shape().n, grid.coords().n);
        const std::span<const std::int64_t> samples = std::span(all).subspan(
            static_cast<std::size_t>(mine.begin), static_cast<std::size_t>(mine.size()));
        Tensor<float> images;
        Labels labels;
        data.read(samples, tile, tile, images, labels);
        expect_tiles<float>(s, samples, tile, tile, images, labels);
        for (std::int32_t id : labels)
          ++seen[static_cast<std::size_t>(id)];
      }
      allreduce_sum(grid, std::span<long long>(seen), Group::sample);
      const std::vector<std::int64_t>& order = sampler.permutation(epoch);
      const std::int64_t used = sampler.batches_per_epoch() * batch;
      for (std::int64_t k = 0; k < s.n; ++k)
        EXPECT_EQ(seen[static_cast<std::size_t>(order[static_cast<std::size_t>(k)])],
                  k < used ? 1 : 0)
            << "permutation entry " << k << " (sample " << order[static_cast<std::size_t>(k)]
            << ")";
    }
  // One rank alone reads: a read that waited for the others would hang here (MPIEXEC_TIMEOUT).
  if (world_rank() == 0) {
    Tensor<float> images;
    Labels labels;
    const std::vector<std::int64_t> samples{22, 0};
    data.read(samples, tile, tile, images, labels);
    expect_tiles<float>(s, samples, tile, tile, images, labels);
  }
}

// Closing is collective, but not while an exception unwinds: a rank failing alone must reach
// main (which ends the job) instead of waiting for the others inside the close.
TEST(H5Dataset, ARankUnwindingFromItsOwnErrorDoesNotWaitInTheClose) {
  const SharedPath path("unwinding");
  write_dataset(path.str(), Spec{});
  // The others wait for rank 0 with a deadline: were rank 0 stuck in the close, they would end
  // with the watchdog's message instead of the one below.
  const std::unique_ptr<Comm> bounded =
      test::world().make_grid(test::world().shape(), {test::world().wait_settings().policy, 60});
  std::string caught;
  try {
    H5Dataset data(path.str(), test::world());
    if (world_rank() == 0) throw Error("rank 0 alone");
    allreduce_max(*bounded, 0);
    throw Error("the others unwind too, so that the close at MPI_Finalize is everyone's");
  } catch (const Error& e) {
    caught = e.what();
  }
  if (world_rank() == 0) {
    EXPECT_EQ(caught, "rank 0 alone");
    allreduce_max(*bounded, 0);  // out of the close: the others' wait ends
  } else {
    EXPECT_TRUE(test::contains(caught, "the others unwind too")) << caught;
  }
}

// Opens `path`; expects an agreed Error holding `expect`, with the same message on every rank.
void expect_agreed_error(const std::string& path, const std::string& expect) {
  try {
    H5Dataset data(path, test::world());
    ADD_FAILURE() << "no error for a file that should hold " << expect;
  } catch (const Error& e) {
    EXPECT_TRUE(e.agreed()) << e.what();
    EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    EXPECT_NO_THROW(check_same_everywhere(test::world(), "error message", e.what()));
  }
}

TEST(H5Dataset, ABadFileIsOneAgreedErrorOnEveryRank) {
  {
    const SharedPath path("missing");
    expect_agreed_error(path.str(), "' does not exist");
  }
  {
    const SharedPath path("text");
    agree(test::world(), [&] {
      if (world_rank() == 0) std::ofstream(path.str()) << "not hdf5\n";
    });
    expect_agreed_error(path.str(), "' is not an HDF5 file");
  }
  {
    const SharedPath path("truncated");
    write_dataset(path.str(), Spec{.n = 40, .label_n = 40});
    agree(test::world(), [&] {
      if (world_rank() == 0)
        std::filesystem::resize_file(path.str(), std::filesystem::file_size(path.str()) / 2);
    });
    expect_agreed_error(path.str(), "damaged or truncated");
  }
  const std::vector<std::pair<Spec, std::string>> malformed{
      {{.image_rank = 3}, "/images has 3 dimensions, expected 4 [N, C, H, W]"},
      {{.pixels = Pixels::int32}, "/images holds int32, expected float32, float64 or uint8"},
      {{.labels = LabelType::float32}, "/labels holds float32, expected int32 or int64"},
      {{.label_n = 6}, "/labels has 6 samples, /images 7"},
  };
  for (std::size_t k = 0; k < malformed.size(); ++k) {
    const SharedPath path("malformed" + std::to_string(k));
    write_dataset(path.str(), malformed[k].first);
    expect_agreed_error(path.str(), malformed[k].second);
  }
  {
    const SharedPath path("no_labels");
    agree(test::world(), [&] {
      if (world_rank() != 0) return;
      h5::File f = h5::File::create(path.str());
      const std::vector<float> pixels(2 * 3 * 4 * 5, 1.0f);
      f.write<float>("/images", pixels, {2, 3, 4, 5});
    });
    expect_agreed_error(path.str(), "has no dataset '/labels'");
  }
}

// Bad values are found by the rank whose tile holds them; read() is local, so the training loop
// agrees on its outcome, as here.
TEST(H5Dataset, BadPixelsAndLabelsNameTheFileSampleAndTile) {
  const Spec s{.pixels = Pixels::float64, .labels = LabelType::int64, .per_pixel = true};
  const SharedPath path("bad_values");
  write_dataset(path.str(), s);
  agree(test::world(), [&] {
    if (world_rank() != 0) return;
    const hid_t f = TESSERA_CHECK_HDF5(H5Fopen(path.str().c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    const auto poke = [&](const char* name, hid_t type, std::vector<hsize_t> at,
                          const void* value) {
      const hid_t d = TESSERA_CHECK_HDF5(H5Dopen2(f, name, H5P_DEFAULT));
      const hid_t space = TESSERA_CHECK_HDF5(H5Dget_space(d));
      const std::vector<hsize_t> one(at.size(), 1);
      TESSERA_CHECK_HDF5(
          H5Sselect_hyperslab(space, H5S_SELECT_SET, at.data(), nullptr, one.data(), nullptr));
      const hid_t mem = TESSERA_CHECK_HDF5(H5Screate_simple(1, one.data(), nullptr));
      TESSERA_CHECK_HDF5(H5Dwrite(d, type, mem, space, H5P_DEFAULT, value));
      H5Sclose(mem);
      H5Sclose(space);
      H5Dclose(d);
    };
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const std::int64_t negative = -3, huge = std::int64_t{1} << 40;
    poke("/images", H5T_NATIVE_DOUBLE,
         {2, 1, static_cast<hsize_t>(s.h - 1), static_cast<hsize_t>(s.w - 1)}, &nan);
    poke("/labels", H5T_NATIVE_INT64, {3, 0, 0}, &negative);
    poke("/labels", H5T_NATIVE_INT64,
         {4, static_cast<hsize_t>(s.label_h - 1), static_cast<hsize_t>(s.label_w - 1)}, &huge);
    H5Fclose(f);
  });
  H5Dataset data(path.str(), test::world());
  const Distribution id = image_dist(s), ld = label_dist(s);
  const Box image_box = id.tile(), label_box = ld.tile();
  // The spatial rank that owns a pixel, and the lowest world rank among its owners.
  const Comm& grid = test::world();
  const auto owner = [&](const Distribution& d, std::int64_t h, std::int64_t w) {
    const int i = block_owner(d.global.h, grid.shape().h, h);
    const int j = block_owner(d.global.w, grid.shape().w, w);
    return std::pair{grid.spatial_rank(i, j), d.tile_of(i, j)};
  };
  struct Case {
    std::int64_t sample;
    std::pair<int, Box> owner;
    std::string message;
  };
  const auto [nan_rank, nan_box] = owner(id, s.h - 1, s.w - 1);
  const auto [neg_rank, neg_box] = owner(ld, 0, 0);
  const auto [huge_rank, huge_box] = owner(ld, s.label_h - 1, s.label_w - 1);
  const std::vector<Case> cases{
      {2,
       {nan_rank, nan_box},
       "/images holds nan in sample 2, rows " + to_string(nan_box.h) + ", columns " +
           to_string(nan_box.w) + " (every pixel must be finite)"},
      {3,
       {neg_rank, neg_box},
       "/labels holds -3 in sample 3, rows " + to_string(neg_box.h) + ", columns " +
           to_string(neg_box.w) + " (a class index is never negative)"},
      {4,
       {huge_rank, huge_box},
       "/labels holds 1099511627776 in sample 4, rows " + to_string(huge_box.h) + ", columns " +
           to_string(huge_box.w) + " (too large for a class index)"},
  };
  for (const Case& c : cases) {
    const std::vector<std::int64_t> samples{1, c.sample};
    Tensor<double> images;
    Labels labels;
    bool threw = false;
    try {
      agree(test::world(), [&] {
        try {
          data.read(samples, image_box, label_box, images, labels);
        } catch (const Error&) {
          threw = true;
          throw;
        }
      });
      ADD_FAILURE() << "no error for sample " << c.sample;
    } catch (const Error& e) {
      EXPECT_TRUE(e.agreed());
      // Only the ranks whose tile holds the bad value find it; the lowest of them (in group 0)
      // speaks for all.
      EXPECT_EQ(threw, grid.spatial_rank(grid.coords().i, grid.coords().j) == c.owner.first);
      const std::string prefix =
          c.owner.first == 0 ? "" : "rank " + std::to_string(c.owner.first) + ": ";
      EXPECT_EQ(std::string(e.what()), prefix + "'" + path.str() + "'" + ": " + c.message);
    }
  }
  // A sample the file does not have, and a tile outside the images.
  Tensor<float> images;
  Labels labels;
  const std::vector<std::int64_t> beyond{0, s.n};
  EXPECT_THROW(data.read(beyond, image_box, label_box, images, labels), Error);
  const std::vector<std::int64_t> fine{0};
  EXPECT_THROW(data.read(fine, {{0, s.h + 1}, {0, 1}}, label_box, images, labels), Error);
  EXPECT_THROW(data.read(fine, image_box, {{0, 1}, {0, s.label_w + 1}}, images, labels), Error);
}

}  // namespace
}  // namespace tessera
