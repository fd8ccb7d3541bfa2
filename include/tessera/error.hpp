// The one exception type of Tessera, and the check macros for each foreign library.
#pragma once

#include <source_location>
#include <stdexcept>
#include <string>

namespace tessera {

// Marks an Error after which no agreement between ranks is possible (the watchdog's timeout: the
// ranks it waited for may never answer).
struct Fatal {};
inline constexpr Fatal fatal{};

// Every failure Tessera reports is an Error. `agreed()` is true when every rank of the
// communicator that raised it holds the same Error (see `agree` in collectives.hpp), so the
// process may end normally; otherwise `main` must abort the job to avoid a hang. `fatal()` errors
// are never agreed on: agree() passes them through untouched.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message,
                 std::source_location where = std::source_location::current());
  Error(const std::string& message, Fatal,
        std::source_location where = std::source_location::current());
  Error(const std::string& message, const std::string& where, bool agreed);

  // "file:line" of the place that raised it.
  const std::string& where() const { return where_; }
  bool agreed() const { return agreed_; }
  bool fatal() const { return fatal_; }

 private:
  std::string where_;
  bool agreed_ = false;
  bool fatal_ = false;
};

// A device allocation that failed (kernels/cuda/device_allocator.cpp): the model adds the layer
// that asked (engine/model.cpp), so the message names the layer, the bytes asked and free.
class OutOfDeviceMemory : public Error {
 public:
  using Error::Error;
};

// Builds the message "what: detail" for a failed foreign call.
[[noreturn]] void fail_mpi(int code, const char* call, std::source_location where);
[[noreturn]] void fail_hdf5(const char* call, std::source_location where);

}  // namespace tessera

// Throws tessera::Error with `message` (anything streamable into a std::string via +) when
// `cond` is false.
#define TESSERA_CHECK(cond, message)                \
  do {                                              \
    if (!(cond)) throw ::tessera::Error((message)); \
  } while (0)

#define TESSERA_CHECK_MPI(call)                                                     \
  do {                                                                              \
    int tessera_mpi_rc_ = (call);                                                   \
    if (tessera_mpi_rc_ != 0)                                                       \
      ::tessera::fail_mpi(tessera_mpi_rc_, #call, std::source_location::current()); \
  } while (0)

// HDF5 calls return a negative value on failure.
#define TESSERA_CHECK_HDF5(call)                                                          \
  ([&]() {                                                                                \
    auto tessera_h5_rc_ = (call);                                                         \
    if (tessera_h5_rc_ < 0) ::tessera::fail_hdf5(#call, std::source_location::current()); \
    return tessera_h5_rc_;                                                                \
  }())
