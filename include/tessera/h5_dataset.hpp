// A training set in an HDF5 file (README.md "Files": /images [N, C, H, W] float32, float64 or
// uint8; /labels int32 or int64 [N, H, W] or [N]) read with parallel HDF5: each rank reads only
// its own tile of the samples it is given, never a whole image.
#pragma once

#include <exception>
#include <string>

#include "tessera/dataset.hpp"
#include "tessera/io/hdf5.hpp"

namespace tessera {

class H5Dataset : public Dataset {
 public:
  // Opens `path` with MPI-IO over `comm` and checks its datasets as inspect_batch_file does.
  // Collective over `comm`: a missing, damaged or malformed file is one agreed Error on every
  // rank.
  H5Dataset(const std::string& path, const Comm& comm);
  // Closes the file: collective over `comm`, except while an exception unwinds the stack. That
  // exception may be this rank's alone, and waiting there for the others would keep main from
  // ending the job; the file then stays open until MPI_Finalize (which closes it collectively)
  // or MPI_Abort.
  ~H5Dataset() override;
  H5Dataset(const H5Dataset&) = delete;
  H5Dataset& operator=(const H5Dataset&) = delete;

  // classes is 0 (a file does not say): the caller checks labels against its model.
  const DatasetInfo& info() const override { return info_; }

  // Local: independent MPI-IO transfers, one per call and dataset, so data-parallel groups with
  // different numbers of samples never wait on each other. Throws a local Error naming the file,
  // sample and tile for a sample outside [0, N), a box outside the image or label map, a
  // non-finite pixel, a label outside [0, 2^31) or unreadable data; callers agree() on it.
  // Labels below the caller's class count are its to check.
  void read(std::span<const std::int64_t> samples, const Box& image_tile, const Box& label_tile,
            Tensor<float>& images, std::vector<std::int32_t>& labels) override;
  void read(std::span<const std::int64_t> samples, const Box& image_tile, const Box& label_tile,
            Tensor<double>& images, std::vector<std::int32_t>& labels) override;

 private:
  template <typename T>
  void read_tiles(std::span<const std::int64_t> samples, const Box& image_tile,
                  const Box& label_tile, Tensor<T>& images, std::vector<std::int32_t>& labels);

  h5::File file_;
  DatasetInfo info_;
  bool uint8_ = false;
  int exceptions_at_open_ = std::uncaught_exceptions();
};

}  // namespace tessera
