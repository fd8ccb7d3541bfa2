// libFuzzer target: a training set (README.md "Files": /images, /labels) through H5Dataset, the
// reader of `tessera train --data` (parallel HDF5 on one rank): opened and checked, then a tile at
// either corner of the first and last samples read as the trainer reads them (in float32 and
// float64), then verified as --verify-data does. Seeds: `tessera datagen` files, segmentation and
// classification, float32 and uint8, and an h5py file (fuzz_tests.py).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "fuzz_common.hpp"
#include "tessera/h5_dataset.hpp"

namespace {

// Rows or columns [0, 8) and the last 8 of an extent (fewer when it is smaller).
tessera::Range first(std::int64_t extent) {
  return {0, std::min<std::int64_t>(extent, 8)};
}
tessera::Range last(std::int64_t extent) {
  return {extent - std::min<std::int64_t>(extent, 8), extent};
}

template <typename T>
void read_corner(tessera::H5Dataset& d, bool far) {
  const tessera::DatasetInfo& info = d.info();
  // The trainer's model refuses images of other channel counts before reading: a file that
  // claims millions of channels is not read here either (nor by `tessera train`).
  if (info.channels > 16) return;
  // Out of order and repeated, as a shuffled batch asks.
  const std::vector<std::int64_t> samples{info.samples - 1, 0, info.samples - 1};
  const tessera::Box image = far ? tessera::Box{last(info.height), last(info.width)}
                                 : tessera::Box{first(info.height), first(info.width)};
  const tessera::Box labels = far ? tessera::Box{last(info.label_height), last(info.label_width)}
                                  : tessera::Box{first(info.label_height), first(info.label_width)};
  tessera::Tensor<T> x;
  tessera::Labels y;
  d.read(samples, image, labels, x, y);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tessera::fuzz::init_mpi_and_hdf5();
  (void)tessera::fuzz::world();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = tessera::fuzz::write_input(data, size, ".h5");
  return tessera::fuzz::run_one([&] {
    std::optional<tessera::H5Dataset> d;
    d.emplace(path, tessera::fuzz::world());
    try {
      read_corner<float>(*d, false);
      read_corner<double>(*d, true);
      // `tessera train --verify-data`: every sample whole, its checksums when the file has them.
      // Only a small file's (a large one reads for long, as it would in the trainer).
      const tessera::DatasetInfo& info = d->info();
      if (info.channels <= 16 && info.samples * info.height * info.width <= (1 << 20)) {
        std::ostream discard(nullptr);
        d->verify(tessera::fuzz::world(), 64, discard);  // datagen draws at most 64 classes
      }
    } catch (...) {
      // Closed here, not while the Error unwinds: H5Dataset's destructor leaves the file open
      // then (h5_dataset.hpp), and the next input reuses the path.
      d.reset();
      throw;
    }
  });
}
