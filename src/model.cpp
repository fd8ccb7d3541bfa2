#include "tessera/model.hpp"

#include <cmath>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/layers/conv2d.hpp"
#include "tessera/layers/relu.hpp"
#include "tessera/random.hpp"

namespace tessera {
namespace {

template <typename T>
std::unique_ptr<Layer<T>> make_layer(const LayerSpec& spec, int tag) {
  return std::visit(
      [&](const auto& config) -> std::unique_ptr<Layer<T>> {
        using C = std::decay_t<decltype(config)>;
        if constexpr (std::is_same_v<C, Conv2dSpec>) {
          return std::make_unique<Conv2d<T>>(spec.name, config, tag);
        } else {
          return std::make_unique<Relu<T>>(spec.name);
        }
      },
      spec.config);
}

}  // namespace

template <typename T>
Model<T>::Model(const ModelSpec& spec, const ProcessGrid& grid, Shape4 input)
    : spec_(spec), grid_(grid) {
  TESSERA_CHECK(input.c == spec.input_channels,
                "model '" + spec.name + "' takes " + std::to_string(spec.input_channels) +
                    " input channels, the batch has " + std::to_string(input.c));
  TESSERA_CHECK(input.n >= grid.shape().n,
                "the batch has " + std::to_string(input.n) + " samples, fewer than the grid's " +
                    std::to_string(grid.shape().n) +
                    " data-parallel groups: every group needs at least one sample");
  input_ = {input, grid.shape(), grid.coords()};
  TESSERA_CHECK(input.h >= grid.shape().h && input.w >= grid.shape().w,
                "the " + std::to_string(input.h) + "x" + std::to_string(input.w) +
                    " image cannot be split over " + std::to_string(grid.shape().h) + "x" +
                    std::to_string(grid.shape().w) + " spatial ranks: a tile would have " +
                    (input.h < grid.shape().h
                         ? (input.w < grid.shape().w ? "no rows and no columns" : "no rows")
                         : "no columns"));
  Distribution d = input_;
  int tag = 0;
  for (const LayerSpec& l : spec.layers) {
    layers_.push_back(make_layer<T>(l, ++tag));
    d = layers_.back()->setup(d, grid);
  }
  output_ = d;
}

template <typename T>
DistTensor<T> Model<T>::forward(const DistTensor<T>& x) {
  DistTensor<T> a = layers_.front()->forward(x);
  for (std::size_t k = 1; k < layers_.size(); ++k)
    a = layers_[k]->forward(a);
  return a;
}

template <typename T>
DistTensor<T> Model<T>::backward(const DistTensor<T>& dy) {
  DistTensor<T> g = layers_.back()->backward(dy);
  for (std::size_t k = layers_.size() - 1; k-- > 0;)
    g = layers_[k]->backward(g);
  return g;
}

template <typename T>
void Model<T>::zero_grad() {
  for (auto& p : params())
    p.param->grad.fill(T(0));
}

template <typename T>
void Model<T>::reduce_gradients() {
  // One message for all parameters: the model's gradients are small next to its activations.
  std::vector<T> flat;
  for (auto& p : params())
    flat.insert(flat.end(), p.param->grad.span().begin(), p.param->grad.span().end());
  allreduce_sum(std::span<T>(flat), grid_.comm());
  std::size_t at = 0;
  for (auto& p : params()) {
    std::span<T> g = p.param->grad.span();
    std::copy(flat.begin() + at, flat.begin() + at + g.size(), g.begin());
    at += g.size();
  }
}

template <typename T>
std::vector<NamedParam<T>> Model<T>::params() {
  std::vector<NamedParam<T>> out;
  for (auto& l : layers_)
    for (Param<T>* p : l->params())
      out.push_back({l->name(), p});
  return out;
}

template <typename T>
std::int64_t Model<T>::parameter_count() {
  std::int64_t n = 0;
  for (auto& p : params())
    n += p.param->value.numel();
  return n;
}

template <typename T>
void Model<T>::init_params(std::uint64_t seed) {
  for (auto& l : layers_) {
    auto ps = l->params();
    if (ps.empty()) continue;
    // fan_in of the weight: in_channels * kernel area (PyTorch's _calculate_fan_in_and_fan_out).
    const Shape4& ws = ps.front()->value.shape();
    const double bound = 1.0 / std::sqrt(static_cast<double>(ws.c * ws.h * ws.w));
    for (Param<T>* p : ps) {
      const std::uint64_t stream = hash_string(l->name() + "/" + p->name);
      std::span<T> v = p->value.span();
      for (std::size_t k = 0; k < v.size(); ++k)
        v[k] = static_cast<T>((2 * uniform01(seed, stream, k) - 1) * bound);
    }
  }
}

template <typename T>
LossResult<T> pixel_cross_entropy(const DistTensor<T>& logits, std::span<const std::int32_t> labels,
                                  MPI_Comm comm) {
  const Shape4& g = logits.dist.global;
  const double count = static_cast<double>(g.n) * g.h * g.w;
  LossResult<T> r;
  r.grad = DistTensor<T>(logits.dist);
  double local = reference::pixel_cross_entropy(logits.local, labels, static_cast<T>(1.0 / count),
                                                &r.grad.local);
  allreduce_sum(std::span<double>(&local, 1), comm);
  r.loss = local / count;
  return r;
}

template <typename T>
StepResult<T> forward_backward(Model<T>& model, const DistTensor<T>& input,
                               std::span<const std::int32_t> labels, const ProcessGrid& grid) {
  StepResult<T> r;
  model.zero_grad();
  r.output = model.forward(input);
  LossResult<T> loss = pixel_cross_entropy(r.output, labels, grid.comm());
  r.loss = loss.loss;
  r.input_grad = model.backward(loss.grad);
  model.reduce_gradients();
  return r;
}

template StepResult<float> forward_backward(Model<float>&, const DistTensor<float>&,
                                            std::span<const std::int32_t>, const ProcessGrid&);
template StepResult<double> forward_backward(Model<double>&, const DistTensor<double>&,
                                             std::span<const std::int32_t>, const ProcessGrid&);
template class Model<float>;
template class Model<double>;
template LossResult<float> pixel_cross_entropy(const DistTensor<float>&,
                                               std::span<const std::int32_t>, MPI_Comm);
template LossResult<double> pixel_cross_entropy(const DistTensor<double>&,
                                                std::span<const std::int32_t>, MPI_Comm);

}  // namespace tessera
