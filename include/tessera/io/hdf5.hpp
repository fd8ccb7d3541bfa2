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

// A 16-bit IEEE float (binary16) as stored. HDF5 1.10 has no predefined half type; Tessera's
// (IEEE layout, little-endian) reads as float16 in h5py and numpy.
struct Half {
  std::uint16_t bits = 0;
};
// `v` rounded to the nearest binary16 (ties to even; beyond 65504 infinity). Local, pure.
Half to_half(float v);
// The binary16 value as a float (exact). Local, pure.
float from_half(Half h);

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
  // The same with MPI-IO over `comm` (parallel HDF5), for datasets every rank writes its box of
  // with write_box. Collective over its world group: every rank gets the file, or every
  // rank throws one agreed Error. Creating datasets in it (create_chunked) and closing it (the
  // destructor) are collective too.
  static File create_parallel(const std::string& path, const Comm& comm);
  // Creates a file that lives in memory only (HDF5's core driver, no backing store): `name` is
  // what messages call it; image() returns its bytes. Nothing reaches a disk, so a full disk can
  // never leave HDF5 with a half-closed file.
  static File create_in_memory(const std::string& name);

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

  // The box [offset, offset + count) of `dataset` (one extent per dimension) as stored: the
  // file's element type, in this machine's byte order, row-major. What per-sample checksums are
  // computed over. An independent transfer on a parallel file: local.
  std::vector<unsigned char> read_bytes(const std::string& dataset,
                                        std::span<const std::int64_t> offset,
                                        std::span<const std::int64_t> count) const;

  // Throws an Error naming the file, the dataset and the first entry (along the first dimension)
  // of `dataset` that was declared but never written: a missing chunk of a chunked dataset, or
  // no storage at all for a contiguous one (HDF5 would read either as zeros). Cheap when every
  // chunk is there (one count); `what` names the entries in the message ("sample"). Local.
  void check_written(const std::string& dataset, const std::string& what) const;

  // Writes a whole dataset (intermediate groups are created). A scalar has no dims. The dataset
  // carries the CRC-32 of its bytes in its attribute "tessera_crc32" (see verify_checksums).
  template <typename T>
  void write(const std::string& dataset, std::span<const T> data,
             const std::vector<std::int64_t>& dims);

  // Creates a dataset of `dims` elements of T (float, double, Half, std::int32_t, std::uint8_t,
  // std::uint16_t) stored in chunks of `chunk` (same rank, 1 <= chunk[k] <= dims[k]), to be filled
  // box by box with write_box, so that a dataset larger than memory can be written. Chunks are
  // allocated as they are written and never pre-filled; a chunk never written reads as zeros
  // (check_written finds it). With `checksummed`, every chunk carries HDF5's Fletcher-32
  // checksum, which HDF5 checks on every read (a damaged chunk is a read error, not wrong
  // numbers); with `deflate` in 1..9, chunks are compressed (zlib at that level). On a file made
  // by create_parallel, collective (the same arguments on every rank); chunks are then allocated
  // when the dataset is created, as parallel HDF5 requires of compressed datasets.
  template <typename T>
  void create_chunked(const std::string& dataset, const std::vector<std::int64_t>& dims,
                      const std::vector<std::int64_t>& chunk, bool checksummed = false,
                      int deflate = 0);
  // Writes `data` (row-major, count[0] x count[1] x ...) into the box [offset, offset + count)
  // of an existing dataset of T. A box that covers whole chunks is written without reading back.
  // On a file made by create_parallel, one collective write: every rank of its group calls it
  // for the same dataset, each with its own box (a box with a zero extent writes nothing). A
  // write that fails there on one rank of several (a disk filling up) throws a fatal Error: the
  // other ranks may be inside HDF5's collective write still (of compressed chunks: several MPI
  // collectives in turn), where no agreement reaches them, so the caller ends the job.
  template <typename T>
  void write_box(const std::string& dataset, std::span<const T> data,
                 std::span<const std::int64_t> offset, std::span<const std::int64_t> count);

  void set_attribute(const std::string& name, const std::string& value);  // on the root group
  bool has_attribute(const std::string& name) const;
  std::string attribute(const std::string& name) const;  // a string attribute of the root

  void flush();
  // Closes the file now (collective on a parallel file) and throws an Error naming it when HDF5
  // could not finish it (a full disk during the last metadata flush): its contents are then not
  // a valid file. The destructor closes silently.
  void close();

  // Reads every dataset of the file whole and compares the CRC-32 of its bytes with its
  // "tessera_crc32" attribute (written by write). A mismatch, an unreadable dataset, or with
  // `required` a dataset without the attribute, is an Error naming the file and the dataset.
  void verify_checksums(bool required) const;

  // The bytes of a file made by create_in_memory, flushed.
  std::vector<unsigned char> image();

 private:
  File(hid_t id, std::string path) : id_(id), path_(std::move(path)) {}
  hid_t id_ = -1;
  std::string path_;
  bool parallel_ = false;  // made by create_parallel
  bool shared_ = false;    // made by create_parallel over several ranks
};

// The CRC-32 (zlib's, as Python's zlib.crc32) of `bytes`: what verify_checksums compares. With
// `previous`, the CRC-32 of the bytes it covered followed by `bytes`. Local.
std::uint32_t checksum(std::span<const unsigned char> bytes, std::uint32_t previous = 0);
// The CRC-32 of A followed by B, from crc(A), crc(B) and B's length (zlib's crc32_combine).
std::uint32_t checksum_combine(std::uint32_t a, std::uint32_t b, std::int64_t b_bytes);

// Where write_atomically builds the file: in memory (whole, then written with plain system calls
// whose every error is seen and reported; for files that fit in memory comfortably) or on disk,
// streamed into the temporary file by HDF5 (for datasets larger than memory).
enum class Staging { memory, disk };

// Writes `path` all or nothing: `body` fills the file (staged as above) that becomes a temporary
// file in the same directory (`.<name>.tmp.<pid>`), synced to disk (fsync) and renamed over
// `path`. On any failure (a full disk, a quota) the temporary file is removed, the previous
// `path` (if any) is untouched, and the Error names the path and the system's reason. Local.
void write_atomically(const std::string& path, const std::function<void(File&)>& body,
                      Staging staging = Staging::memory);

}  // namespace tessera::h5
