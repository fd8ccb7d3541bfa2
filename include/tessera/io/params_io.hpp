// Parameters and buffers in HDF5, in PyTorch layouts (README.md "Files"):
// /params/<layer>/weight (conv OIHW, transposed conv [in, out, kh, kw], linear [out, in], batch
// norm [C]), /params/<layer>/bias [C], /buffers/<layer>/running_mean|running_var [C]; root
// attribute format = "tessera-params-1". Every function is local.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/engine/model.hpp"
#include "tessera/io/hdf5.hpp"

namespace tessera {

inline constexpr const char* kParamsFormat = "tessera-params-1";

// Loads every parameter of `model` from `path`, and its buffers where the file has them (a file
// without /buffers leaves them at their initial values; a layer's buffers come all or none).
// Missing or extra parameters, extra buffers, wrong shapes, non-finite values and files of
// another format are Errors naming the dataset.
template <typename T>
void read_params(const std::string& path, Model<T>& model);
// The same from an open file of any format that holds /params (and /buffers): checkpoints.
template <typename T>
void read_params(const h5::File& file, Model<T>& model);

// Writes values (`what` = values) or gradients under `group`: `group`/<layer>/<param>.
enum class ParamField { value, grad };
template <typename T>
void write_params(h5::File& file, Model<T>& model, const std::string& group, ParamField what);

// Writes every buffer's value under `group`: `group`/<layer>/<buffer>, each [C].
template <typename T>
void write_buffers(h5::File& file, Model<T>& model, const std::string& group);

// The PyTorch shape of parameter `param` of a layer of type `layer_type` held as `s` (layers keep
// every tensor as 4-D; PyTorch's are 1-D for biases and batch norm, 2-D for linear weights).
std::vector<std::int64_t> torch_param_dims(const std::string& layer_type, const std::string& param,
                                           const Shape4& s);
// The same for a parameter of `model`.
template <typename T>
std::vector<std::int64_t> torch_param_dims(const Model<T>& model, const NamedParam<T>& p);

}  // namespace tessera
