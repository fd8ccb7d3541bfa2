// A thin RAII layer over HDF5 for Tessera's files (DESIGN.md section 4). Every call is local:
// each rank opens files on its own (parallel HDF5 arrives with the training data reader).
#pragma once

#include <hdf5.h>

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

  // Writes a whole dataset (intermediate groups are created). A scalar has no dims.
  template <typename T>
  void write(const std::string& dataset, std::span<const T> data,
             const std::vector<std::int64_t>& dims);

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
// flushed, closed and renamed over `path`. On any failure the temporary file is removed and the
// previous `path` (if any) is untouched. Local.
void write_atomically(const std::string& path, const std::function<void(File&)>& body);

}  // namespace tessera::h5
