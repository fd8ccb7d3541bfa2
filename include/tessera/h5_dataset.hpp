// A training set in an HDF5 file (README.md "Files": /images [N, C, H, W] float32, float64 or
// uint8; /labels int32 or int64 [N, H, W] or [N]) read with parallel HDF5: each rank reads only
// its own tile of the samples it is given, never a whole image.
#pragma once

#include <cstdint>
#include <exception>
#include <ostream>
#include <string>

#include "tessera/dataset.hpp"
#include "tessera/io/hdf5.hpp"

namespace tessera {

class H5Dataset : public Dataset {
 public:
  // Opens `path` with MPI-IO over `comm` and checks its datasets as inspect_batch_file does
  // (shapes, types, every sample written). Before opening, the ranks agree that
  // they see the same file behind `path` (its size and a fingerprint of its bytes), so that
  // different files on different nodes are refused with the ranks and what each sees.
  // Collective over `comm`: a missing, damaged, malformed, partly written or differing file is
  // one agreed Error on every rank.
  // Without `labels_required`, a file of images alone is accepted (info().has_labels false).
  H5Dataset(const std::string& path, const Comm& comm, bool labels_required = true);
  // Closes the file: collective over `comm`, except while an exception unwinds the stack. That
  // exception may be this rank's alone, and waiting there for the others would keep main from
  // ending the job; the file then stays open until MPI_Finalize (which closes it collectively)
  // or MPI_Abort.
  ~H5Dataset() override;
  H5Dataset(const H5Dataset&) = delete;
  H5Dataset& operator=(const H5Dataset&) = delete;

  // classes is 0 (a file does not say): the caller checks labels against its model.
  const DatasetInfo& info() const override { return info_; }
  // From now on reads return no labels, though the file has them (prediction: a third less to
  // read). Local.
  void ignore_labels() { info_.has_labels = false; }

  // Local: independent MPI-IO transfers, one per call and dataset, so data-parallel groups with
  // different numbers of samples never wait on each other. Throws a local Error naming the file,
  // sample and tile for a sample outside [0, N), a box outside the image or label map, a
  // non-finite pixel, a label outside [0, 2^31), unreadable data (a chunk whose Fletcher-32
  // checksum fails), or a file that changed since it was opened (size, modification time or
  // inode: truncated, rewritten or replaced under the running job); callers agree() on it.
  // Labels below the caller's class count are its to check.
  void read(std::span<const std::int64_t> samples, const Box& image_tile, const Box& label_tile,
            Tensor<float>& images, Labels& labels) override;
  void read(std::span<const std::int64_t> samples, const Box& image_tile, const Box& label_tile,
            Tensor<double>& images, Labels& labels) override;

  // Reads every sample whole (ranks share the samples) and checks that every pixel is finite,
  // every label lies in [0, classes) and, when the file carries /image_crc32 and /label_crc32
  // (README.md "Files"; `tessera datagen` writes them), that each sample matches its checksums.
  // Rank 0 reports progress to `out` about every two seconds and a summary at the end.
  // Collective over `comm`: the first bad sample is one agreed Error naming the file, the
  // sample and what is wrong.
  void verify(const Comm& comm, std::int64_t classes, std::ostream& out);

  // What stat(2) says of the file: compared after every read.
  struct Identity {
    std::int64_t size = 0, modified_ns = 0;
    std::uint64_t inode = 0, device = 0;
    bool operator==(const Identity&) const = default;
  };

 private:
  template <typename T>
  void read_tiles(std::span<const std::int64_t> samples, const Box& image_tile,
                  const Box& label_tile, Tensor<T>& images, Labels& labels);

  void check_unchanged() const;

  Identity identity_;  // before file_: taken when the ranks agree on the file, before it opens
  h5::File file_;
  DatasetInfo info_;
  bool uint8_ = false;
  int exceptions_at_open_ = std::uncaught_exceptions();
};

}  // namespace tessera
