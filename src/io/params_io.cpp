#include "tessera/io/params_io.hpp"

#include <algorithm>
#include <cmath>
#include <map>
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

const std::string& layer_type(const ModelSpec& spec, const std::string& layer) {
  for (const LayerSpec& l : spec.layers)
    if (l.name == layer) return l.type;
  throw Error("model '" + spec.name + "' has no layer '" + layer + "'");
}

// Reads dataset `name` (a `what`: "parameter" or "buffer") of shape `want`, checked to be
// floating point and finite.
template <typename T>
std::vector<T> read_checked(const h5::File& file, const std::string& name, const std::string& what,
                            const std::vector<std::int64_t>& want) {
  const std::string& path = file.path();
  const h5::DatasetInfo info = file.info(name);
  TESSERA_CHECK(info.dims == want, "'" + path + "': " + what + " '" + name + "' has shape " +
                                       dims_str(info.dims) + ", the model needs " + dims_str(want));
  TESSERA_CHECK(info.kind == h5::Kind::floating, "'" + path + "': " + what + " '" + name +
                                                     "' holds " + info.type_name() +
                                                     ", expected float32 or float64");
  std::vector<T> values = file.read<T>(name);
  TESSERA_CHECK(std::all_of(values.begin(), values.end(), [](T v) { return std::isfinite(v); }),
                "'" + path + "': " + what + " '" + name + "' holds NaN or infinity");
  return values;
}

template <typename T>
void read_buffers(const h5::File& file, Model<T>& model) {
  const std::string& path = file.path();
  if (!file.has("/buffers")) return;
  TESSERA_CHECK(file.is_group("/buffers"),
                "'" + path + "': '/buffers' must be a group (/buffers/<layer>/<name>)");
  // The model's buffers, by layer.
  std::map<std::string, std::vector<NamedBuffer<T>>> by_layer;
  for (auto& b : model.buffers())
    by_layer[b.layer].push_back(b);
  for (const std::string& layer : file.children("/buffers")) {
    const std::string group = "/buffers/" + layer;
    TESSERA_CHECK(by_layer.count(layer), "'" + path + "' has buffers '" + group +
                                             "', but the model '" + model.spec().name +
                                             "' has no layer '" + layer + "' with buffers");
    TESSERA_CHECK(file.is_group(group), "'" + path + "' has buffer '" + group +
                                            "', which is not a group (buffers are "
                                            "/buffers/<layer>/<name>)");
    std::set<std::string> names;
    for (const NamedBuffer<T>& b : by_layer[layer])
      names.insert(b.buffer->name);
    // PyTorch's state_dict counts batches in num_batches_tracked; with a fixed momentum the
    // count changes nothing, so files exported from PyTorch load as they are.
    names.insert("num_batches_tracked");
    for (const std::string& name : file.children(group))
      TESSERA_CHECK(names.count(name), "'" + path + "' has buffer '" + group + "/" + name +
                                           "', which the layer '" + layer + "' of model '" +
                                           model.spec().name + "' does not have");
    // A layer's buffers come together: half of them would mix trained and initial statistics.
    for (const NamedBuffer<T>& b : by_layer[layer]) {
      const std::string name = group + "/" + b.buffer->name;
      const std::vector<std::int64_t> want{b.buffer->value.numel()};
      TESSERA_CHECK(file.has(name), "'" + path + "' has buffers of layer '" + layer +
                                        "' but not '" + name + "' (shape " + dims_str(want) + ")");
      const std::vector<T> values = read_checked<T>(file, name, "buffer", want);
      // A negative variance normalises every value to NaN: predictions of NaN, exit 0.
      if (b.buffer->name == "running_var")
        TESSERA_CHECK(std::all_of(values.begin(), values.end(), [](T v) { return v >= 0; }),
                      "'" + path + "': buffer '" + name +
                          "' holds a negative variance (a batch norm's running variance is >= 0)");
      upload(values.data(), b.buffer->value);
    }
  }
}

}  // namespace

std::vector<std::int64_t> torch_param_dims(const std::string& layer_type, const std::string& param,
                                           const Shape4& s) {
  if (param == "bias" || layer_type == "batchnorm2d") return {s.n};
  if (layer_type == "linear") return {s.n, s.c};
  return {s.n, s.c, s.h, s.w};
}

template <typename T>
std::vector<std::int64_t> torch_param_dims(const Model<T>& model, const NamedParam<T>& p) {
  return torch_param_dims(layer_type(model.spec(), p.layer), p.param->name, p.param->value.shape());
}

template <typename T>
void read_params(const std::string& path, Model<T>& model) {
  const h5::File file = h5::File::open_read(path);
  TESSERA_CHECK(file.has_attribute("format") && file.attribute("format") == kParamsFormat,
                "'" + path +
                    "' is not a Tessera parameter file: its root attribute 'format' must be '" +
                    kParamsFormat + "' (in h5py: f.attrs['format'] = '" + kParamsFormat + "')");
  read_params(file, model);
}

template <typename T>
void read_params(const h5::File& file, Model<T>& model) {
  const std::string& path = file.path();
  std::set<std::string> expected;
  for (auto& p : model.params()) {
    const std::string name = "/params/" + p.key();
    expected.insert(p.key());
    const auto want = torch_param_dims(model, p);
    TESSERA_CHECK(file.has(name),
                  "'" + path + "' has no parameter '" + name + "' (shape " + dims_str(want) + ")");
    const std::vector<T> values = read_checked<T>(file, name, "parameter", want);
    upload(values.data(), p.param->value);
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
  read_buffers(file, model);
}

template <typename T>
void write_params(h5::File& file, Model<T>& model, const std::string& group, ParamField what) {
  for (auto& p : model.params()) {
    const Tensor<T> t = to_host(what == ParamField::value ? p.param->value : p.param->grad);
    file.write<T>(group + "/" + p.key(), t.span(), torch_param_dims(model, p));
  }
}

template <typename T>
void write_buffers(h5::File& file, Model<T>& model, const std::string& group) {
  for (auto& b : model.buffers()) {
    const Tensor<T> t = to_host(b.buffer->value);
    file.write<T>(group + "/" + b.key(), t.span(), {t.numel()});
  }
}

template void read_params(const std::string&, Model<float>&);
template void read_params(const std::string&, Model<double>&);
template void read_params(const h5::File&, Model<float>&);
template void read_params(const h5::File&, Model<double>&);
template void write_params(h5::File&, Model<float>&, const std::string&, ParamField);
template void write_params(h5::File&, Model<double>&, const std::string&, ParamField);
template void write_buffers(h5::File&, Model<float>&, const std::string&);
template void write_buffers(h5::File&, Model<double>&, const std::string&);
template std::vector<std::int64_t> torch_param_dims(const Model<float>&, const NamedParam<float>&);
template std::vector<std::int64_t> torch_param_dims(const Model<double>&,
                                                    const NamedParam<double>&);

}  // namespace tessera
