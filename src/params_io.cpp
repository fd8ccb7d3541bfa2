#include "tessera/params_io.hpp"

#include <algorithm>
#include <cmath>
#include <set>

#include "tessera/error.hpp"

namespace tessera {
namespace {

std::string dims_str(const std::vector<std::int64_t>& dims) {
  std::string s = "[";
  for (std::size_t k = 0; k < dims.size(); ++k)
    s += (k ? ", " : "") + std::to_string(dims[k]);
  return s + "]";
}

// PyTorch's layout of a parameter: 1-D for biases, OIHW for conv weights.
std::vector<std::int64_t> torch_dims(const std::string& name, const Shape4& s) {
  if (name == "bias") return {s.n};
  return {s.n, s.c, s.h, s.w};
}

}  // namespace

template <typename T>
void read_params(const std::string& path, Model<T>& model) {
  const h5::File file = h5::File::open_read(path);
  TESSERA_CHECK(file.has_attribute("format") && file.attribute("format") == kParamsFormat,
                "'" + path +
                    "' is not a Tessera parameter file: its root attribute 'format' must be '" +
                    kParamsFormat + "' (in h5py: f.attrs['format'] = '" + kParamsFormat + "')");
  std::set<std::string> expected;
  for (auto& p : model.params()) {
    const std::string name = "/params/" + p.key();
    expected.insert(p.key());
    const auto want = torch_dims(p.param->name, p.param->value.shape());
    TESSERA_CHECK(file.has(name),
                  "'" + path + "' has no parameter '" + name + "' (shape " + dims_str(want) + ")");
    const h5::DatasetInfo info = file.info(name);
    TESSERA_CHECK(info.dims == want, "'" + path + "': parameter '" + name + "' has shape " +
                                         dims_str(info.dims) + ", the model needs " +
                                         dims_str(want));
    TESSERA_CHECK(info.kind == h5::Kind::floating, "'" + path + "': parameter '" + name +
                                                       "' holds " + info.type_name() +
                                                       ", expected float32 or float64");
    const std::vector<T> values = file.read<T>(name);
    TESSERA_CHECK(std::all_of(values.begin(), values.end(), [](T v) { return std::isfinite(v); }),
                  "'" + path + "': parameter '" + name + "' holds NaN or infinity");
    std::copy(values.begin(), values.end(), p.param->value.data());
  }
  for (const std::string& layer : file.children("/params")) {
    TESSERA_CHECK(file.is_group("/params/" + layer),
                  "'" + path + "' has parameter '/params/" + layer + "', which the model '" +
                      model.spec().name +
                      "' does not have (parameters are /params/<layer>/<name>)");
    for (const std::string& param : file.children("/params/" + layer))
      TESSERA_CHECK(expected.count(layer + "/" + param),
                    "'" + path + "' has parameter '/params/" + layer + "/" + param +
                        "', which the model '" + model.spec().name + "' does not have");
  }
}

template <typename T>
void write_params(h5::File& file, Model<T>& model, const std::string& group, ParamField what) {
  for (auto& p : model.params()) {
    const Tensor<T>& t = what == ParamField::value ? p.param->value : p.param->grad;
    file.write<T>(group + "/" + p.key(), t.span(), torch_dims(p.param->name, t.shape()));
  }
}

template void read_params(const std::string&, Model<float>&);
template void read_params(const std::string&, Model<double>&);
template void write_params(h5::File&, Model<float>&, const std::string&, ParamField);
template void write_params(h5::File&, Model<double>&, const std::string&, ParamField);

}  // namespace tessera
