// A thin RAII layer over HDF5 for Tessera's files (README.md "Files"). Every call is local,
// except on a file opened with open_read_parallel, whose opening and closing are collective.
#pragma once

#include <hdf5.h>
#include "tessera/comm.hpp"

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace tessera::h5 {

// Stops HDF5 from printing its error stack; our Errors say what failed. Call once per process.
void quiet();

enum class Kind { floating, integer, other };

struct DatasetInfo {
  std::vector<std::int64_t> dims;
  Kind kind = Kind::other;
  std::size_t bytes = 0;  // size of one element
  bool is_signed = true;
  std::string type_name() const;  // "float32", "uint8", ...
};

class File {
 public:
  // Opens an existing file read-only; a missing path or a file that is not HDF5 (or is damaged)
  // is an Error naming the path.
  static File open_read(const std::string& path);
  // The same with MPI-IO over `comm` (parallel HDF5). Collective over its world group: every rank
  // gets the file, or every rank throws one agreed Error. The file's destructor is collective over
  // `comm`.
  static File open_read_parallel(const std::string& path, const Comm& comm);
  // Creates (truncates) a file for writing.
  static File create(const std::string& path);

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const;  // a dataset or group at "/a/b/c"
  std::vector<std::string> children(const std::string& group) const;  // sorted names
  bool is_group(const std::string& name) const;  // false when missing or a dataset

  DatasetInfo info(const std::string& dataset) const;

  // Reads the box [offset, offset + count) of a dataset, converted by HDF5 to T (float, double,
  // std::int32_t, std::int64_t). Empty offset/count read the whole dataset.
  template <typename T>
  std::vector<T> read(const std::string& dataset, std::span<const std::int64_t> offset = {},
                      std::span<const std::int64_t> count = {}) const;

  // For each i of `entries` (any order, repeats allowed), the box [offset, offset + count) of the
  // dataset's entry i along its first dimension (offset and count cover the other dimensions),
  // into `out` [entries.size(), count...] in the order of `entries`. One H5Dread of the union of
  // the boxes, an independent transfer on a parallel file: local.
  template <typename T>
  void read_entries(const std::string& dataset, std::span<const std::int64_t> entries,
                    std::span<const std::int64_t> offset, std::span<const std::int64_t> count,
                    std::span<T> out) const;

  // Writes a whole dataset (intermediate groups are created). A scalar has no dims.
  template <typename T>
  void write(const std::string& dataset, std::span<const T> data,
             const std::vector<std::int64_t>& dims);

  // Creates a dataset of `dims` elements of T (float, double, std::int32_t, std::uint8_t) stored
  // in chunks of `chunk` (same rank, 1 <= chunk[k] <= dims[k]), to be filled box by box with
  // write_box, so that a dataset larger than memory can be written. Chunks are allocated as they
  // are written and never pre-filled; a chunk never written reads as zeros.
  template <typename T>
  void create_chunked(const std::string& dataset, const std::vector<std::int64_t>& dims,
                      const std::vector<std::int64_t>& chunk);
  // Writes `data` (row-major, count[0] x count[1] x ...) into the box [offset, offset + count)
  // of an existing dataset of T. A box that covers whole chunks is written without reading back.
  template <typename T>
  void write_box(const std::string& dataset, std::span<const T> data,
                 std::span<const std::int64_t> offset, std::span<const std::int64_t> count);

  void set_attribute(const std::string& name, const std::string& value);  // on the root group
  bool has_attribute(const std::string& name) const;
  std::string attribute(const std::string& name) const;  // a string attribute of the root

  void flush();

 private:
  File(hid_t id, std::string path) : id_(id), path_(std::move(path)) {}
  hid_t id_ = -1;
  std::string path_;
};

// Writes `path` all or nothing: `body` fills a temporary file in the same directory, which is
// flushed, closed, synced to disk (fsync) and renamed over `path`. On any failure the temporary
// file is removed and the previous `path` (if any) is untouched. Local.
void write_atomically(const std::string& path, const std::function<void(File&)>& body);

}  // namespace tessera::h5
