#include "tessera/error.hpp"

#include <hdf5.h>
#include <mpi.h>

#include <filesystem>

namespace tessera {
namespace {

std::string location(std::source_location where) {
  return std::filesystem::path(where.file_name()).filename().string() + ":" +
         std::to_string(where.line());
}

}  // namespace

Error::Error(const std::string& message, std::source_location where)
    : std::runtime_error(message), where_(location(where)) {}

Error::Error(const std::string& message, Fatal, std::source_location where)
    : std::runtime_error(message), where_(location(where)), fatal_(true) {}

Error::Error(const std::string& message, const std::string& where, bool agreed)
    : std::runtime_error(message), where_(where), agreed_(agreed) {}

void fail_mpi(int code, const char* call, std::source_location where) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw Error(std::string("MPI call failed: ") + call + ": " + std::string(text, length), where);
}

namespace {

herr_t innermost(unsigned, const H5E_error2_t* e, void* out) {
  // The walk goes from the innermost frame outwards; keep the first, most specific one.
  auto* text = static_cast<std::string*>(out);
  if (text->empty() && e->desc != nullptr) *text = e->desc;
  return 0;
}

}  // namespace

void fail_hdf5(const char* call, std::source_location where) {
  std::string detail;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, innermost, &detail);
  H5Eclear2(H5E_DEFAULT);
  throw Error(std::string("HDF5 call failed: ") + call + (detail.empty() ? "" : ": " + detail),
              where);
}

}  // namespace tessera
