#include "tessera/io/hdf5.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/mpi_comm.hpp"

namespace tessera::h5 {
namespace {

// Forces `path` (a file, or a directory and so the names in it) to disk. Filesystems that cannot
// (EINVAL, ENOTSUP) are left as they are; a directory's failure only costs durability of the name.
void sync_to_disk(const std::filesystem::path& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) {
    TESSERA_CHECK(directory, "cannot open '" + path.string() +
                                 "' to flush it to disk: " + std::strerror(errno));
    return;
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TESSERA_CHECK(rc == 0 || directory || err == EINVAL || err == ENOTSUP,
                "cannot flush '" + path.string() + "' to disk: " + std::strerror(err));
}

template <typename T>
hid_t native();
template <>
hid_t native<float>() {
  return H5T_NATIVE_FLOAT;
}
template <>
hid_t native<double>() {
  return H5T_NATIVE_DOUBLE;
}
template <>
hid_t native<std::int32_t>() {
  return H5T_NATIVE_INT32;
}
template <>
hid_t native<std::int64_t>() {
  return H5T_NATIVE_INT64;
}
template <>
hid_t native<std::uint8_t>() {
  return H5T_NATIVE_UINT8;
}
template <>
hid_t native<std::uint16_t>() {
  return H5T_NATIVE_UINT16;
}
// binary16 as h5py defines it (IEEE_F32LE narrowed: sign bit 15, exponent bits 10..14 biased by
// 15, mantissa bits 0..9), made once and kept for the process: the file's type and the memory's.
template <>
hid_t native<Half>() {
  static const hid_t type = [] {
    const hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    TESSERA_CHECK(t >= 0 && H5Tset_fields(t, 15, 10, 5, 0, 10) >= 0 && H5Tset_size(t, 2) >= 0 &&
                      H5Tset_ebias(t, 15) >= 0 && H5Tlock(t) >= 0,
                  "HDF5 cannot define a 16-bit float type");
    return t;
  }();
  return type;
}

// Closes an HDF5 identifier with the right function when it goes out of scope.
class Id {
 public:
  Id(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Id() {
    if (id_ >= 0) close_(id_);
  }
  Id(Id&& other) noexcept : id_(other.id_), close_(other.close_) { other.id_ = -1; }
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  Id& operator=(Id&&) = delete;
  operator hid_t() const { return id_; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

std::vector<hsize_t> to_hsize(std::span<const std::int64_t> v) {
  return std::vector<hsize_t>(v.begin(), v.end());
}

// A dataspace of `extent` in memory.
Id memory_space(const std::vector<hsize_t>& extent) {
  return Id(
      TESSERA_CHECK_HDF5(H5Screate_simple(static_cast<int>(extent.size()), extent.data(), nullptr)),
      H5Sclose);
}

// Reads on a parallel file are independent, so that ranks reading different numbers of entries
// (or only some ranks reading) never wait on each other.
Id independent_transfer() {
  Id transfer(TESSERA_CHECK_HDF5(H5Pcreate(H5P_DATASET_XFER)), H5Pclose);
#ifdef H5_HAVE_PARALLEL
  TESSERA_CHECK_HDF5(H5Pset_dxpl_mpio(transfer, H5FD_MPIO_INDEPENDENT));
#endif
  return transfer;
}

constexpr const char* kChecksumAttribute = "tessera_crc32";

std::uint32_t crc32_of(const void* data, std::size_t bytes, std::uint32_t previous = 0) {
  uLong crc = previous;
  const auto* p = static_cast<const Bytef*>(data);
  // zlib takes lengths as uInt: feed it in pieces below 4 GiB.
  while (bytes > 0) {
    const std::size_t n = std::min<std::size_t>(bytes, std::size_t{1} << 30);
    crc = crc32(crc, p, static_cast<uInt>(n));
    p += n;
    bytes -= n;
  }
  return static_cast<std::uint32_t>(crc);
}

// Writes all of `bytes` to `fd`; false (errno set) on failure.
bool write_all(int fd, const unsigned char* bytes, std::size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, bytes, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = ENOSPC;
      return false;
    }
    bytes += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

// Creates every missing group on the way to `dataset`.
hid_t link_creation_with_parents() {
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  return lcpl;
}

// What File::read and read_entries convert: integers or floats of at most 16 bytes (a damaged
// file may claim gigabytes per number, and HDF5 would allocate its conversion buffer to match).
void check_numbers(const std::string& path, const std::string& dataset, const DatasetInfo& di) {
  TESSERA_CHECK(di.kind != Kind::other,
                "'" + path + "': '" + dataset + "' holds " + di.type_name() + ", not numbers");
  TESSERA_CHECK(di.bytes >= 1 && di.bytes <= 16,
                "'" + path + "': '" + dataset + "' holds numbers of " + std::to_string(di.bytes) +
                    " bytes each (the file is damaged)");
}

}  // namespace

void quiet() {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

std::string DatasetInfo::type_name() const {
  if (kind == Kind::floating) return bytes == 4 ? "float32" : bytes == 8 ? "float64" : "float";
  if (kind == Kind::integer)
    return std::string(is_signed ? "int" : "uint") + std::to_string(8 * bytes);
  return "a non-numeric type";
}

File File::open_read(const std::string& path) {
  TESSERA_CHECK(std::filesystem::exists(path), "file '" + path + "' does not exist");
  const htri_t is_h5 = H5Fis_hdf5(path.c_str());
  TESSERA_CHECK(is_h5 > 0, "'" + path + "' is not an HDF5 file");
  const hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  TESSERA_CHECK(id >= 0, "cannot open '" + path + "' as HDF5: the file is damaged or truncated");
  return File(id, path);
}

File File::open_read_parallel(const std::string& path, const Comm& comm) {
  // The local checks are agreed first, so that no rank enters the collective calls alone
  // (H5Pset_fapl_mpio duplicates `comm`; H5Fopen opens the file on every rank).
  agree(comm, [&] {
    TESSERA_CHECK(std::filesystem::exists(path), "file '" + path + "' does not exist");
    TESSERA_CHECK(H5Fis_hdf5(path.c_str()) > 0, "'" + path + "' is not an HDF5 file");
  });
  Id fapl(TESSERA_CHECK_HDF5(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
#ifdef H5_HAVE_PARALLEL
  TESSERA_CHECK_HDF5(H5Pset_fapl_mpio(fapl, mpi_comm(comm, Group::world), MPI_INFO_NULL));
#endif
  File file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), path);
  agree(comm, [&] {
    if (file.id_ < 0) H5Eclear2(H5E_DEFAULT);
    TESSERA_CHECK(file.id_ >= 0,
                  "cannot open '" + path + "' as HDF5: the file is damaged or truncated");
  });
  return file;
}

File File::create_parallel(const std::string& path, const Comm& comm) {
#ifndef H5_HAVE_PARALLEL
  // A serial HDF5 would have every rank create and truncate the file on its own.
  agree(comm, [&] {
    TESSERA_CHECK(comm.size(Group::world) == 1,
                  "cannot write '" + path + "' from " + std::to_string(comm.size(Group::world)) +
                      " ranks: this build's HDF5 is not parallel (libhdf5-mpich-dev)");
  });
#endif
  Id fapl(TESSERA_CHECK_HDF5(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
#ifdef H5_HAVE_PARALLEL
  TESSERA_CHECK_HDF5(H5Pset_fapl_mpio(fapl, mpi_comm(comm, Group::world), MPI_INFO_NULL));
#endif
  File file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), path);
  file.parallel_ = true;
  file.shared_ = comm.size(Group::world) > 1;
  agree(comm, [&] {
    if (file.id_ < 0) H5Eclear2(H5E_DEFAULT);
    TESSERA_CHECK(file.id_ >= 0, "cannot create '" + path + "' (is the directory writable?)");
  });
  return file;
}

File File::create(const std::string& path) {
  const hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  TESSERA_CHECK(id >= 0, "cannot create '" + path + "' (is the directory writable?)");
  return File(id, path);
}

File File::create_in_memory(const std::string& name) {
  Id fapl(TESSERA_CHECK_HDF5(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
  // Grows 1 MiB at a time; no backing store: the file never touches the disk.
  TESSERA_CHECK_HDF5(H5Pset_fapl_core(fapl, std::size_t{1} << 20, 0));
  const hid_t id = H5Fcreate(name.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  TESSERA_CHECK(id >= 0, "cannot create '" + name + "' in memory");
  return File(id, name);
}

std::vector<unsigned char> File::image() {
  flush();
  const ssize_t size = H5Fget_file_image(id_, nullptr, 0);
  TESSERA_CHECK(size >= 0, "cannot take the bytes of '" + path_ + "' from HDF5");
  std::vector<unsigned char> bytes(static_cast<std::size_t>(size));
  TESSERA_CHECK(H5Fget_file_image(id_, bytes.data(), bytes.size()) == size,
                "cannot take the bytes of '" + path_ + "' from HDF5");
  return bytes;
}

File::File(File&& other) noexcept
    : id_(other.id_),
      path_(std::move(other.path_)),
      parallel_(other.parallel_),
      shared_(other.shared_) {
  other.id_ = -1;
}

File& File::operator=(File&& other) noexcept {
  std::swap(id_, other.id_);
  std::swap(path_, other.path_);
  std::swap(parallel_, other.parallel_);
  std::swap(shared_, other.shared_);
  return *this;
}

File::~File() {
  if (id_ >= 0) H5Fclose(id_);
}

void File::close() {
  if (id_ < 0) return;
  const herr_t rc = H5Fclose(id_);
  id_ = -1;
  if (rc < 0) {
    H5Eclear2(H5E_DEFAULT);
    throw Error("cannot finish '" + path_ + "' (is the disk full?)");
  }
}

bool File::has(const std::string& name) const {
  // H5Lexists needs every parent to exist: walk the path one link at a time.
  std::string at;
  std::size_t start = 1;
  while (start <= name.size()) {
    const std::size_t slash = std::min(name.find('/', start), name.size());
    at += "/" + name.substr(start, slash - start);
    if (H5Lexists(id_, at.c_str(), H5P_DEFAULT) <= 0) return false;
    start = slash + 1;
  }
  return true;
}

bool File::is_group(const std::string& name) const {
  if (!has(name)) return false;
  H5O_info_t oi;
  TESSERA_CHECK_HDF5(H5Oget_info_by_name(id_, name.c_str(), &oi, H5P_DEFAULT));
  return oi.type == H5O_TYPE_GROUP;
}

std::vector<std::string> File::children(const std::string& group) const {
  std::vector<std::string> names;
  if (!has(group)) return names;
  TESSERA_CHECK(is_group(group), "'" + path_ + "': '" + group + "' is a dataset, not a group");
  Id g(TESSERA_CHECK_HDF5(H5Gopen2(id_, group.c_str(), H5P_DEFAULT)), H5Gclose);
  H5G_info_t gi;
  TESSERA_CHECK_HDF5(H5Gget_info(g, &gi));
  for (hsize_t k = 0; k < gi.nlinks; ++k) {
    const ssize_t n =
        H5Lget_name_by_idx(g, ".", H5_INDEX_NAME, H5_ITER_INC, k, nullptr, 0, H5P_DEFAULT);
    std::string name(static_cast<std::size_t>(std::max<ssize_t>(n, 0)), '\0');
    H5Lget_name_by_idx(g, ".", H5_INDEX_NAME, H5_ITER_INC, k, name.data(), name.size() + 1,
                       H5P_DEFAULT);
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

DatasetInfo File::info(const std::string& dataset) const {
  TESSERA_CHECK(has(dataset), "'" + path_ + "' has no dataset '" + dataset + "'");
  Id d(H5Dopen2(id_, dataset.c_str(), H5P_DEFAULT), H5Dclose);
  TESSERA_CHECK(d >= 0, "'" + path_ + "': '" + dataset + "' is not a readable dataset");
  Id space(TESSERA_CHECK_HDF5(H5Dget_space(d)), H5Sclose);
  Id type(TESSERA_CHECK_HDF5(H5Dget_type(d)), H5Tclose);
  DatasetInfo out;
  const int rank = H5Sget_simple_extent_ndims(space);
  TESSERA_CHECK(rank >= 0, "'" + path_ + "': '" + dataset + "' has an unreadable shape");
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  // A damaged file may claim any extents: every count of elements must fit in an int64_t.
  constexpr auto kMax = static_cast<hsize_t>(std::numeric_limits<std::int64_t>::max());
  hsize_t elements = 1;
  std::string shape;
  for (const hsize_t n : dims)
    shape += (shape.empty() ? "" : ", ") + std::to_string(n);
  for (const hsize_t n : dims) {
    TESSERA_CHECK(n <= kMax && (n == 0 || elements <= kMax / n),
                  "'" + path_ + "': '" + dataset + "' has the impossible shape [" + shape +
                      "] (the file is damaged)");
    elements *= n;
  }
  out.dims.assign(dims.begin(), dims.end());
  const H5T_class_t cls = H5Tget_class(type);
  out.kind = cls == H5T_FLOAT ? Kind::floating : cls == H5T_INTEGER ? Kind::integer : Kind::other;
  out.bytes = H5Tget_size(type);
  out.is_signed = cls != H5T_INTEGER || H5Tget_sign(type) == H5T_SGN_2;
  return out;
}

template <typename T>
std::vector<T> File::read(const std::string& dataset, std::span<const std::int64_t> offset,
                          std::span<const std::int64_t> count) const {
  const DatasetInfo di = info(dataset);
  check_numbers(path_, dataset, di);
  Id d(TESSERA_CHECK_HDF5(H5Dopen2(id_, dataset.c_str(), H5P_DEFAULT)), H5Dclose);
  Id file_space(TESSERA_CHECK_HDF5(H5Dget_space(d)), H5Sclose);
  std::int64_t elements = 1;
  std::vector<std::int64_t> box =
      count.empty() ? di.dims : std::vector<std::int64_t>(count.begin(), count.end());
  for (auto n : box)
    elements *= n;
  std::vector<T> out;
  try {
    out.resize(static_cast<std::size_t>(elements));
  } catch (const std::exception&) {  // std::bad_alloc, std::length_error
    throw Error("'" + path_ + "': '" + dataset + "' holds " + std::to_string(elements) +
                " values, more than fit in memory");
  }
  if (elements == 0) return out;
  if (!count.empty()) {
    const auto start = to_hsize(offset), extent = to_hsize(count);
    TESSERA_CHECK_HDF5(H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr,
                                           extent.data(), nullptr));
  }
  const auto mem_dims = to_hsize(box);
  Id mem_space(TESSERA_CHECK_HDF5(
                   H5Screate_simple(static_cast<int>(mem_dims.size()), mem_dims.data(), nullptr)),
               H5Sclose);
  const herr_t rc = H5Dread(d, native<T>(), mem_space, file_space, H5P_DEFAULT, out.data());
  if (rc < 0) {
    H5Eclear2(H5E_DEFAULT);
    throw Error("cannot read '" + dataset + "' from '" + path_ +
                "': the file is truncated or damaged");
  }
  return out;
}

template <typename T>
void File::read_entries(const std::string& dataset, std::span<const std::int64_t> entries,
                        std::span<const std::int64_t> offset, std::span<const std::int64_t> count,
                        std::span<T> out) const {
  const DatasetInfo di = info(dataset);
  check_numbers(path_, dataset, di);
  TESSERA_CHECK(offset.size() == count.size() && count.size() + 1 == di.dims.size(),
                "'" + path_ + "': '" + dataset + "' has " + std::to_string(di.dims.size()) +
                    " dimensions, not " + std::to_string(count.size() + 1));
  std::int64_t per_entry = 1;
  for (std::size_t k = 0; k < count.size(); ++k) {
    const std::int64_t extent = di.dims[k + 1];
    TESSERA_CHECK(offset[k] >= 0 && count[k] >= 0 && offset[k] + count[k] <= extent,
                  "'" + path_ + "': the box [" + std::to_string(offset[k]) + ", " +
                      std::to_string(offset[k] + count[k]) + ") lies outside dimension " +
                      std::to_string(k + 1) + " of '" + dataset + "' (extent " +
                      std::to_string(extent) + ")");
    per_entry *= count[k];
  }
  TESSERA_CHECK(out.size() == entries.size() * static_cast<std::size_t>(per_entry),
                "'" + path_ + "': reading '" + dataset + "' into a buffer of the wrong size");
  for (std::int64_t i : entries)
    TESSERA_CHECK(i >= 0 && i < di.dims[0], "'" + path_ + "': '" + dataset + "' has no entry " +
                                                std::to_string(i) + " (it has " +
                                                std::to_string(di.dims[0]) + ")");
  if (out.empty()) return;

  // HDF5 delivers a union of boxes in file order, once per element: read the distinct entries in
  // increasing order, then place them as asked.
  std::vector<std::int64_t> sorted(entries.begin(), entries.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  Id d(TESSERA_CHECK_HDF5(H5Dopen2(id_, dataset.c_str(), H5P_DEFAULT)), H5Dclose);
  Id file_space(TESSERA_CHECK_HDF5(H5Dget_space(d)), H5Sclose);
  std::vector<hsize_t> start(di.dims.size()), extent(di.dims.size());
  for (std::size_t k = 0; k < count.size(); ++k) {
    start[k + 1] = static_cast<hsize_t>(offset[k]);
    extent[k + 1] = static_cast<hsize_t>(count[k]);
  }
  // Runs of consecutive entries become one hyperslab each.
  for (std::size_t a = 0; a < sorted.size();) {
    std::size_t b = a + 1;
    while (b < sorted.size() && sorted[b] == sorted[b - 1] + 1)
      ++b;
    start[0] = static_cast<hsize_t>(sorted[a]);
    extent[0] = static_cast<hsize_t>(b - a);
    TESSERA_CHECK_HDF5(H5Sselect_hyperslab(file_space, a == 0 ? H5S_SELECT_SET : H5S_SELECT_OR,
                                           start.data(), nullptr, extent.data(), nullptr));
    a = b;
  }
  extent[0] = sorted.size();
  Id mem_space = memory_space(extent);
  Id transfer = independent_transfer();
  const bool in_place = std::equal(entries.begin(), entries.end(), sorted.begin(), sorted.end());
  std::vector<T> scratch(in_place ? 0 : sorted.size() * static_cast<std::size_t>(per_entry));
  T* const target = in_place ? out.data() : scratch.data();
  if (H5Dread(d, native<T>(), mem_space, file_space, transfer, target) < 0) {
    H5Eclear2(H5E_DEFAULT);
    throw Error("cannot read '" + dataset + "' from '" + path_ +
                "': the file is truncated or damaged");
  }
  if (in_place) return;
  const auto per = static_cast<std::size_t>(per_entry);
  for (std::size_t k = 0; k < entries.size(); ++k) {
    const auto at = static_cast<std::size_t>(
        std::lower_bound(sorted.begin(), sorted.end(), entries[k]) - sorted.begin());
    std::copy_n(scratch.begin() + static_cast<std::ptrdiff_t>(at * per), per,
                out.begin() + static_cast<std::ptrdiff_t>(k * per));
  }
}

template <typename T>
void File::write(const std::string& dataset, std::span<const T> data,
                 const std::vector<std::int64_t>& dims) {
  const auto extent = to_hsize(dims);
  Id space(TESSERA_CHECK_HDF5(dims.empty() ? H5Screate(H5S_SCALAR)
                                           : H5Screate_simple(static_cast<int>(extent.size()),
                                                              extent.data(), nullptr)),
           H5Sclose);
  Id lcpl(link_creation_with_parents(), H5Pclose);
  Id d(TESSERA_CHECK_HDF5(
           H5Dcreate2(id_, dataset.c_str(), native<T>(), space, lcpl, H5P_DEFAULT, H5P_DEFAULT)),
       H5Dclose);
  TESSERA_CHECK_HDF5(H5Dwrite(d, native<T>(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()));
  const std::uint32_t crc = crc32_of(data.data(), data.size_bytes());
  Id scalar(TESSERA_CHECK_HDF5(H5Screate(H5S_SCALAR)), H5Sclose);
  Id a(TESSERA_CHECK_HDF5(
           H5Acreate2(d, kChecksumAttribute, H5T_STD_U32LE, scalar, H5P_DEFAULT, H5P_DEFAULT)),
       H5Aclose);
  TESSERA_CHECK_HDF5(H5Awrite(a, H5T_NATIVE_UINT32, &crc));
}

template <typename T>
void File::create_chunked(const std::string& dataset, const std::vector<std::int64_t>& dims,
                          const std::vector<std::int64_t>& chunk, bool checksummed, int deflate) {
  TESSERA_CHECK(!dims.empty() && chunk.size() == dims.size(),
                "'" + path_ + "': chunks of '" + dataset + "' must have one extent per dimension");
  for (std::size_t k = 0; k < dims.size(); ++k)
    TESSERA_CHECK(1 <= chunk[k] && chunk[k] <= dims[k],
                  "'" + path_ + "': chunk extent " + std::to_string(chunk[k]) + " of '" + dataset +
                      "' is outside [1, " + std::to_string(dims[k]) + "]");
  const auto extent = to_hsize(dims), chunk_extent = to_hsize(chunk);
  Id space(
      TESSERA_CHECK_HDF5(H5Screate_simple(static_cast<int>(extent.size()), extent.data(), nullptr)),
      H5Sclose);
  Id dcpl(TESSERA_CHECK_HDF5(H5Pcreate(H5P_DATASET_CREATE)), H5Pclose);
  TESSERA_CHECK_HDF5(
      H5Pset_chunk(dcpl, static_cast<int>(chunk_extent.size()), chunk_extent.data()));
  // Every chunk is written whole once: filling it first would write it twice.
  TESSERA_CHECK_HDF5(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
  if (checksummed) TESSERA_CHECK_HDF5(H5Pset_fletcher32(dcpl));
  TESSERA_CHECK(deflate >= 0 && deflate <= 9,
                "a compression level must lie in 0..9, not " + std::to_string(deflate));
  if (deflate > 0) TESSERA_CHECK_HDF5(H5Pset_deflate(dcpl, static_cast<unsigned>(deflate)));
  if (parallel_) TESSERA_CHECK_HDF5(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY));
  Id lcpl(link_creation_with_parents(), H5Pclose);
  const hid_t d = H5Dcreate2(id_, dataset.c_str(), native<T>(), space, lcpl, dcpl, H5P_DEFAULT);
  TESSERA_CHECK(d >= 0, "cannot create '" + dataset + "' in '" + path_ +
                            "' (chunks over 4 GiB are refused by HDF5)");
  H5Dclose(d);
}

std::vector<unsigned char> File::read_bytes(const std::string& dataset,
                                            std::span<const std::int64_t> offset,
                                            std::span<const std::int64_t> count) const {
  const DatasetInfo di = info(dataset);
  TESSERA_CHECK(di.kind != Kind::other,
                "'" + path_ + "': '" + dataset + "' holds " + di.type_name() + ", not numbers");
  TESSERA_CHECK(offset.size() == di.dims.size() && count.size() == di.dims.size(),
                "'" + path_ + "': '" + dataset + "' has " + std::to_string(di.dims.size()) +
                    " dimensions, not " + std::to_string(count.size()));
  std::size_t elements = 1;
  for (std::size_t k = 0; k < count.size(); ++k) {
    TESSERA_CHECK(offset[k] >= 0 && count[k] >= 0 && offset[k] + count[k] <= di.dims[k],
                  "'" + path_ + "': the box [" + std::to_string(offset[k]) + ", " +
                      std::to_string(offset[k] + count[k]) + ") lies outside dimension " +
                      std::to_string(k) + " of '" + dataset + "'");
    elements *= static_cast<std::size_t>(count[k]);
  }
  std::vector<unsigned char> bytes(elements * di.bytes);
  if (bytes.empty()) return bytes;
  Id d(TESSERA_CHECK_HDF5(H5Dopen2(id_, dataset.c_str(), H5P_DEFAULT)), H5Dclose);
  Id file_type(TESSERA_CHECK_HDF5(H5Dget_type(d)), H5Tclose);
  Id memory_type(TESSERA_CHECK_HDF5(H5Tget_native_type(file_type, H5T_DIR_ASCEND)), H5Tclose);
  TESSERA_CHECK(H5Tget_size(memory_type) == di.bytes,
                "'" + path_ + "': '" + dataset + "' has elements of an unusual size");
  Id file_space(TESSERA_CHECK_HDF5(H5Dget_space(d)), H5Sclose);
  const auto start = to_hsize(offset), extent = to_hsize(count);
  TESSERA_CHECK_HDF5(H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr,
                                         extent.data(), nullptr));
  Id mem_space = memory_space(extent);
  Id transfer = independent_transfer();
  if (H5Dread(d, memory_type, mem_space, file_space, transfer, bytes.data()) < 0) {
    H5Eclear2(H5E_DEFAULT);
    throw Error("cannot read '" + dataset + "' from '" + path_ +
                "': the file is truncated or damaged");
  }
  return bytes;
}

void File::check_written(const std::string& dataset, const std::string& what) const {
  Id d(TESSERA_CHECK_HDF5(H5Dopen2(id_, dataset.c_str(), H5P_DEFAULT)), H5Dclose);
  Id space(TESSERA_CHECK_HDF5(H5Dget_space(d)), H5Sclose);
  const int rank = TESSERA_CHECK_HDF5(H5Sget_simple_extent_ndims(space));
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  TESSERA_CHECK_HDF5(H5Sget_simple_extent_dims(space, dims.data(), nullptr));
  if (rank == 0 || std::find(dims.begin(), dims.end(), hsize_t{0}) != dims.end()) return;
  Id dcpl(TESSERA_CHECK_HDF5(H5Dget_create_plist(d)), H5Pclose);
  const H5D_layout_t layout = H5Pget_layout(dcpl);
  const std::string unwritten = "'" + path_ + "': '" + dataset + "' declares " +
                                std::to_string(dims[0]) + " " + what + "s but ";
  const std::string zeros = " (HDF5 would read them as zeros; was the file completely written?)";
  if (layout == H5D_CONTIGUOUS) {
    TESSERA_CHECK(H5Dget_storage_size(d) > 0, unwritten + "none was ever written" + zeros);
    return;
  }
  if (layout != H5D_CHUNKED) return;  // compact: the data lives in the object header
  std::vector<hsize_t> chunk(static_cast<std::size_t>(rank));
  TESSERA_CHECK_HDF5(H5Pget_chunk(dcpl, rank, chunk.data()));
  std::vector<hsize_t> per(dims.size());  // chunks along each dimension
  hsize_t expected = 1;
  for (std::size_t k = 0; k < dims.size(); ++k) {
    per[k] = (dims[k] + chunk[k] - 1) / chunk[k];
    expected *= per[k];
  }
  hsize_t present = 0;
  TESSERA_CHECK_HDF5(H5Dget_num_chunks(d, space, &present));
  if (present >= expected) return;
  // Some chunk is missing: find which entries it leaves unwritten (an error path, so a lookup of
  // every chunk is affordable; but not of 10^12 declared and never written, so past the first
  // missing one the count stops after kLookups lookups).
  constexpr std::int64_t kLookups = std::int64_t{1} << 20;
  std::int64_t first = -1, incomplete = 0, lookups = 0;
  bool counted_all = true;
  std::vector<hsize_t> index(dims.size()), at(dims.size());
  for (hsize_t row = 0; row < per[0]; ++row) {
    if (first >= 0 && lookups >= kLookups) {
      counted_all = false;
      break;
    }
    bool whole = true;
    std::fill(index.begin(), index.end(), 0);
    index[0] = row;
    for (;;) {
      for (std::size_t k = 0; k < dims.size(); ++k)
        at[k] = index[k] * chunk[k];
      unsigned filters = 0;
      haddr_t address = HADDR_UNDEF;
      hsize_t bytes = 0;
      ++lookups;
      if (H5Dget_chunk_info_by_coord(d, at.data(), &filters, &address, &bytes) < 0) {
        H5Eclear2(H5E_DEFAULT);
        address = HADDR_UNDEF;
      }
      if (address == HADDR_UNDEF || bytes == 0) {
        whole = false;
        break;
      }
      // The next chunk of this row, the last dimension fastest; done when every index wraps.
      std::size_t k = dims.size();
      for (; k > 1; --k) {
        if (++index[k - 1] < per[k - 1]) break;
        index[k - 1] = 0;
      }
      if (k == 1) break;
    }
    if (whole) continue;
    const hsize_t begin = row * chunk[0], end = std::min(dims[0], begin + chunk[0]);
    if (first < 0) first = static_cast<std::int64_t>(begin);
    incomplete += static_cast<std::int64_t>(end - begin);
  }
  TESSERA_CHECK(first < 0, unwritten + (counted_all ? "" : "at least ") +
                               std::to_string(incomplete) + " of them were never " +
                               "written, completely or in part (the first: " + what + " " +
                               std::to_string(first) + ")" + zeros);
}

template <typename T>
void File::write_box(const std::string& dataset, std::span<const T> data,
                     std::span<const std::int64_t> offset, std::span<const std::int64_t> count) {
  Id d(TESSERA_CHECK_HDF5(H5Dopen2(id_, dataset.c_str(), H5P_DEFAULT)), H5Dclose);
  Id file_space(TESSERA_CHECK_HDF5(H5Dget_space(d)), H5Sclose);
  std::int64_t elements = 1;
  for (auto n : count)
    elements *= n;
  TESSERA_CHECK(static_cast<std::int64_t>(data.size()) == elements &&
                    static_cast<int>(count.size()) == H5Sget_simple_extent_ndims(file_space) &&
                    offset.size() == count.size(),
                "'" + path_ + "': a box of " + std::to_string(data.size()) +
                    " values does not match its extent in '" + dataset + "'");
  if (elements == 0 && !parallel_) return;
  const auto start = to_hsize(offset), extent = to_hsize(count);
  // A rank with nothing to write still takes part in a collective write, with empty selections.
  const hsize_t one = 1;
  Id mem_space(TESSERA_CHECK_HDF5(elements == 0 ? H5Screate_simple(1, &one, nullptr)
                                                : H5Screate_simple(static_cast<int>(extent.size()),
                                                                   extent.data(), nullptr)),
               H5Sclose);
  if (elements == 0) {
    TESSERA_CHECK_HDF5(H5Sselect_none(file_space));
    TESSERA_CHECK_HDF5(H5Sselect_none(mem_space));
  } else {
    TESSERA_CHECK_HDF5(H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr,
                                           extent.data(), nullptr));
  }
  Id transfer(TESSERA_CHECK_HDF5(H5Pcreate(H5P_DATASET_XFER)), H5Pclose);
#ifdef H5_HAVE_PARALLEL
  if (parallel_) TESSERA_CHECK_HDF5(H5Pset_dxpl_mpio(transfer, H5FD_MPIO_COLLECTIVE));
#endif
  const T nothing{};
  if (H5Dwrite(d, native<T>(), mem_space, file_space, transfer,
               elements == 0 ? &nothing : data.data()) < 0) {
    H5Eclear2(H5E_DEFAULT);
    const std::string m = "cannot write '" + dataset + "' to '" + path_ + "' (is the disk full?)";
    // The other ranks may be waiting inside HDF5's collective write (see hdf5.hpp).
    if (shared_)
      throw Error(m + "; the other ranks may be inside the collective write still, so the job ends",
                  fatal);
    throw Error(m);
  }
}

void File::set_attribute(const std::string& name, const std::string& value) {
  Id type(TESSERA_CHECK_HDF5(H5Tcopy(H5T_C_S1)), H5Tclose);
  TESSERA_CHECK_HDF5(H5Tset_size(type, std::max<std::size_t>(value.size(), 1)));
  TESSERA_CHECK_HDF5(H5Tset_strpad(type, H5T_STR_NULLPAD));
  Id space(TESSERA_CHECK_HDF5(H5Screate(H5S_SCALAR)), H5Sclose);
  Id a(TESSERA_CHECK_HDF5(H5Acreate2(id_, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT)),
       H5Aclose);
  TESSERA_CHECK_HDF5(H5Awrite(a, type, value.empty() ? "" : value.data()));
}

bool File::has_attribute(const std::string& name) const {
  return H5Aexists(id_, name.c_str()) > 0;
}

std::string File::attribute(const std::string& name) const {
  TESSERA_CHECK(has_attribute(name), "'" + path_ + "' has no attribute '" + name + "'");
  Id a(TESSERA_CHECK_HDF5(H5Aopen(id_, name.c_str(), H5P_DEFAULT)), H5Aclose);
  Id type(TESSERA_CHECK_HDF5(H5Aget_type(a)), H5Tclose);
  TESSERA_CHECK(H5Tget_class(type) == H5T_STRING,
                "'" + path_ + "': attribute '" + name + "' is not a string");
  if (H5Tis_variable_str(type) > 0) {
    // h5py writes variable-length UTF-8 strings; HDF5 does not convert between character
    // sets, so read with the attribute's own.
    Id mem(TESSERA_CHECK_HDF5(H5Tcopy(H5T_C_S1)), H5Tclose);
    TESSERA_CHECK_HDF5(H5Tset_size(mem, H5T_VARIABLE));
    TESSERA_CHECK_HDF5(H5Tset_cset(mem, TESSERA_CHECK_HDF5(H5Tget_cset(type))));
    char* text = nullptr;
    TESSERA_CHECK_HDF5(H5Aread(a, mem, &text));
    std::string out = text != nullptr ? text : "";
    H5free_memory(text);
    return out;
  }
  std::string out(H5Tget_size(type), '\0');
  TESSERA_CHECK_HDF5(H5Aread(a, type, out.data()));
  out.erase(std::find(out.begin(), out.end(), '\0'), out.end());
  return out;
}

void File::flush() {
  TESSERA_CHECK_HDF5(H5Fflush(id_, H5F_SCOPE_GLOBAL));
}

void File::verify_checksums(bool required) const {
  const auto verify = [&](const std::string& name) {
    Id d(H5Dopen2(id_, name.c_str(), H5P_DEFAULT), H5Dclose);
    if (d < 0) H5Eclear2(H5E_DEFAULT);
    TESSERA_CHECK(d >= 0, "'" + path_ + "': dataset '" + name + "' cannot be opened (damaged)");
    const htri_t has = H5Aexists(d, kChecksumAttribute);
    if (has <= 0) {
      H5Eclear2(H5E_DEFAULT);
      TESSERA_CHECK(!required, "'" + path_ + "': dataset '" + name + "' has no checksum");
      return;
    }
    std::uint32_t stored = 0;
    {
      Id a(H5Aopen(d, kChecksumAttribute, H5P_DEFAULT), H5Aclose);
      const bool ok = a >= 0 && H5Aread(a, H5T_NATIVE_UINT32, &stored) >= 0;
      if (!ok) H5Eclear2(H5E_DEFAULT);
      TESSERA_CHECK(ok, "'" + path_ + "': the checksum of '" + name + "' cannot be read");
    }
    Id space(TESSERA_CHECK_HDF5(H5Dget_space(d)), H5Sclose);
    Id type(TESSERA_CHECK_HDF5(H5Dget_type(d)), H5Tclose);
    Id memory(TESSERA_CHECK_HDF5(H5Tget_native_type(type, H5T_DIR_ASCEND)), H5Tclose);
    (void)info(name);  // refuses a shape whose count overflows (HDF5's count would wrap)
    const hssize_t points = H5Sget_simple_extent_npoints(space);
    TESSERA_CHECK(points >= 0, "'" + path_ + "': '" + name + "' has an unreadable shape");
    // The file's own element size bounds the read: a damaged shape cannot make it allocate more
    // than the file could hold (divided, not multiplied: a damaged count times the element size
    // may wrap around).
    const std::size_t element = H5Tget_size(memory);
    const auto storage = static_cast<std::uint64_t>(H5Dget_storage_size(d));
    TESSERA_CHECK(element > 0 && static_cast<std::uint64_t>(points) <=
                                     std::max<std::uint64_t>(storage, element) / element,
                  "'" + path_ + "': '" + name + "' declares more data than the file stores");
    std::vector<unsigned char> bytes(static_cast<std::size_t>(points) * element);
    const herr_t rc =
        bytes.empty() ? 0 : H5Dread(d, memory, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data());
    if (rc < 0) H5Eclear2(H5E_DEFAULT);
    TESSERA_CHECK(rc >= 0, "cannot read '" + name + "' from '" + path_ +
                               "': the file is truncated or damaged");
    const std::uint32_t computed = crc32_of(bytes.data(), bytes.size());
    TESSERA_CHECK(computed == stored, "'" + path_ + "': dataset '" + name +
                                          "' does not match its checksum (the file was changed "
                                          "or damaged after it was written)");
  };
  // A damaged file may link a group into itself (the walk recursed until the stack overflowed,
  // tests/fuzz/fuzz_checkpoint): each group is walked once, and one met again (a cycle, or a
  // group linked twice, which Tessera never writes) is an Error.
  std::set<haddr_t> walked;
  const std::function<void(const std::string&)> walk = [&](const std::string& group) {
    H5O_info_t oi;
    TESSERA_CHECK_HDF5(H5Oget_info_by_name(id_, group.c_str(), &oi, H5P_DEFAULT));
    TESSERA_CHECK(walked.insert(oi.addr).second,
                  "'" + path_ + "': group '" + group + "' is linked more than once (damaged)");
    for (const std::string& child : children(group)) {
      const std::string name = (group == "/" ? "" : group) + "/" + child;
      if (is_group(name))
        walk(name);
      else
        verify(name);
    }
  };
  walk("/");
}

Half to_half(float v) {
  std::uint32_t x = 0;
  std::memcpy(&x, &v, sizeof x);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u)  // infinity, NaN (kept quiet)
    return {static_cast<std::uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u))};
  if (a >= 0x47800000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};  // >= 65536
  if (a < 0x38800000u) {
    // Below 2^-14: a subnormal binary16, |v| / 2^-24 rounded to an integer (ties to even; the
    // scaling by a power of two is exact). 1024 is the smallest normal, which is its encoding.
    const float scaled = std::fabs(v) * 16777216.0f;
    return {static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(std::nearbyint(scaled)))};
  }
  // Rebias the exponent (127 -> 15) and drop 13 mantissa bits, rounding to nearest even; a carry
  // out of the mantissa raises the exponent, up to infinity.
  const std::uint32_t m = a - 0x38000000u;
  return {static_cast<std::uint16_t>(sign | ((m + 0x0fffu + ((m >> 13) & 1u)) >> 13))};
}

float from_half(Half h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  const std::uint32_t e = (h.bits >> 10) & 0x1fu, m = h.bits & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24
    const float v = static_cast<float>(m) / 16777216.0f;
    return sign ? -v : v;
  }
  const std::uint32_t bits =
      sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float v = 0;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

std::uint32_t checksum(std::span<const unsigned char> bytes, std::uint32_t previous) {
  return crc32_of(bytes.data(), bytes.size(), previous);
}

std::uint32_t checksum_combine(std::uint32_t a, std::uint32_t b, std::int64_t b_bytes) {
  return static_cast<std::uint32_t>(crc32_combine(a, b, static_cast<z_off_t>(b_bytes)));
}

void write_atomically(const std::string& path, const std::function<void(File&)>& body,
                      Staging staging) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  TESSERA_CHECK(fs::is_directory(dir),
                "cannot write '" + path + "': the directory '" + dir.string() + "' does not exist");
  const fs::path temp =
      dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()));
  const auto fail = [&](const std::string& doing, int err) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    throw Error("cannot write '" + path + "' (" + doing + " '" + temp.string() +
                "'): " + std::strerror(err) + "; any previous '" + path + "' is untouched");
  };
  if (staging == Staging::disk) {
    try {
      {
        File f = File::create(temp.string());
        body(f);
        f.flush();
      }
      sync_to_disk(temp, false);
    } catch (...) {
      std::error_code ignored;
      fs::remove(temp, ignored);
      throw;
    }
    std::error_code ec;
    fs::rename(temp, target, ec);
    if (ec) fail("renaming", ec.value());
    sync_to_disk(dir, true);
    return;
  }
  // HDF5 writes to memory; the bytes go to disk through plain system calls whose errors we see.
  std::vector<unsigned char> bytes;
  {
    File f = File::create_in_memory(path);
    body(f);
    bytes = f.image();
  }
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("creating", errno);
  if (!write_all(fd, bytes.data(), bytes.size())) {
    const int err = errno;
    ::close(fd);
    fail("writing", err);
  }
  // On disk before the name points at it: after a power cut the name holds the old file or the
  // whole new one, never an empty or partial one.
  if (::fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP) {
    const int err = errno;
    ::close(fd);
    fail("flushing", err);
  }
  if (::close(fd) != 0) fail("closing", errno);
  std::error_code ec;
  fs::rename(temp, target, ec);
  if (ec) fail("renaming", ec.value());
  sync_to_disk(dir, true);
}

template std::vector<float> File::read(const std::string&, std::span<const std::int64_t>,
                                       std::span<const std::int64_t>) const;
template std::vector<double> File::read(const std::string&, std::span<const std::int64_t>,
                                        std::span<const std::int64_t>) const;
template std::vector<std::int32_t> File::read(const std::string&, std::span<const std::int64_t>,
                                              std::span<const std::int64_t>) const;
template std::vector<std::int64_t> File::read(const std::string&, std::span<const std::int64_t>,
                                              std::span<const std::int64_t>) const;
template void File::read_entries(const std::string&, std::span<const std::int64_t>,
                                 std::span<const std::int64_t>, std::span<const std::int64_t>,
                                 std::span<float>) const;
template void File::read_entries(const std::string&, std::span<const std::int64_t>,
                                 std::span<const std::int64_t>, std::span<const std::int64_t>,
                                 std::span<double>) const;
template void File::read_entries(const std::string&, std::span<const std::int64_t>,
                                 std::span<const std::int64_t>, std::span<const std::int64_t>,
                                 std::span<std::int64_t>) const;
template void File::write(const std::string&, std::span<const float>,
                          const std::vector<std::int64_t>&);
template void File::write(const std::string&, std::span<const double>,
                          const std::vector<std::int64_t>&);
template void File::write(const std::string&, std::span<const std::int32_t>,
                          const std::vector<std::int64_t>&);
template void File::write(const std::string&, std::span<const std::int64_t>,
                          const std::vector<std::int64_t>&);
template void File::create_chunked<float>(const std::string&, const std::vector<std::int64_t>&,
                                          const std::vector<std::int64_t>&, bool, int);
template void File::write_box(const std::string&, std::span<const float>,
                              std::span<const std::int64_t>, std::span<const std::int64_t>);
template void File::create_chunked<double>(const std::string&, const std::vector<std::int64_t>&,
                                           const std::vector<std::int64_t>&, bool, int);
template void File::write_box(const std::string&, std::span<const double>,
                              std::span<const std::int64_t>, std::span<const std::int64_t>);
template void File::create_chunked<std::int32_t>(const std::string&,
                                                 const std::vector<std::int64_t>&,
                                                 const std::vector<std::int64_t>&, bool, int);
template void File::write_box(const std::string&, std::span<const std::int32_t>,
                              std::span<const std::int64_t>, std::span<const std::int64_t>);
template void File::create_chunked<std::uint8_t>(const std::string&,
                                                 const std::vector<std::int64_t>&,
                                                 const std::vector<std::int64_t>&, bool, int);
template void File::create_chunked<std::uint16_t>(const std::string&,
                                                  const std::vector<std::int64_t>&,
                                                  const std::vector<std::int64_t>&, bool, int);
template void File::create_chunked<Half>(const std::string&, const std::vector<std::int64_t>&,
                                         const std::vector<std::int64_t>&, bool, int);
template void File::write_box(const std::string&, std::span<const Half>,
                              std::span<const std::int64_t>, std::span<const std::int64_t>);
template void File::write_box(const std::string&, std::span<const std::uint16_t>,
                              std::span<const std::int64_t>, std::span<const std::int64_t>);
template void File::write_box(const std::string&, std::span<const std::uint8_t>,
                              std::span<const std::int64_t>, std::span<const std::int64_t>);

}  // namespace tessera::h5
