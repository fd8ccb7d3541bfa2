// Parameters in HDF5, in PyTorch layouts: /params/<layer>/weight (conv OIHW), /params/<layer>/bias,
// root attribute format = "tessera-params-1" (DESIGN.md section 4). Local.
#pragma once

#include <string>

#include "tessera/hdf5.hpp"
#include "tessera/model.hpp"

namespace tessera {

inline constexpr const char* kParamsFormat = "tessera-params-1";

// Loads every parameter of `model` from `path`. Missing or extra parameters, wrong shapes and
// files of another format are Errors naming the parameter.
template <typename T>
void read_params(const std::string& path, Model<T>& model);

// Writes values (`what` = values) or gradients under `group`: `group`/<layer>/<param>.
enum class ParamField { value, grad };
template <typename T>
void write_params(h5::File& file, Model<T>& model, const std::string& group, ParamField what);

}  // namespace tessera
