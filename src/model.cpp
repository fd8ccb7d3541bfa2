#include "tessera/model.hpp"

#include <cmath>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/layers/registry.hpp"
#include "tessera/random.hpp"

namespace tessera {
namespace {

template <typename T>
void add_into(Tensor<T>& to, const Tensor<T>& from) {
  T* a = to.data();
  const T* b = from.data();
  for (std::int64_t k = 0; k < to.numel(); ++k)
    a[k] += b[k];
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
  int tag = 0;
  for (const LayerSpec& l : spec.layers) {
    Node node;
    node.layer = make_layer<T>(l, ++tag);
    std::vector<Distribution> ins;
    for (const std::string& name : l.inputs) {
      int index = -1;
      for (std::size_t k = 0; k < nodes_.size(); ++k)
        if (nodes_[k].layer->name() == name) index = static_cast<int>(k);
      node.inputs.push_back(index);
      if (index >= 0) ++nodes_[index].consumers;
      ins.push_back(index >= 0 ? nodes_[index].out : input_);
    }
    node.out = node.layer->setup(ins);
    node.layer->bind(grid);
    nodes_.push_back(std::move(node));
  }
  const Distribution& out = nodes_.back().out;
  const std::string who = "model '" + spec.name + "'";
  if (spec.loss == LossKind::pixel_cross_entropy)
    TESSERA_CHECK(!out.replicated, who +
                                       ": the loss pixel_cross_entropy needs per-pixel logits, "
                                       "but the last layer '" +
                                       spec.layers.back().name +
                                       "' gives one vector per sample (use cross_entropy)");
  else
    TESSERA_CHECK(out.replicated, who +
                                      ": the loss cross_entropy needs one vector of logits per "
                                      "sample (after global_avgpool and linear), but the last "
                                      "layer '" +
                                      spec.layers.back().name +
                                      "' gives an image (use pixel_cross_entropy)");
}

template <typename T>
DistTensor<T> Model<T>::forward(const DistTensor<T>& x) {
  // Outputs are kept until their last consumer has run.
  std::vector<std::optional<DistTensor<T>>> outputs(nodes_.size());
  std::vector<int> pending(nodes_.size());
  for (std::size_t k = 0; k < nodes_.size(); ++k)
    pending[k] = nodes_[k].consumers;
  for (std::size_t k = 0; k < nodes_.size(); ++k) {
    std::vector<const DistTensor<T>*> ins;
    for (int i : nodes_[k].inputs)
      ins.push_back(i >= 0 ? &*outputs[i] : &x);
    outputs[k] = nodes_[k].layer->forward(ins, state_);
    for (int i : nodes_[k].inputs)
      if (i >= 0 && --pending[i] == 0 && static_cast<std::size_t>(i) + 1 != nodes_.size())
        outputs[i].reset();
  }
  return std::move(*outputs.back());
}

template <typename T>
DistTensor<T> Model<T>::backward(const DistTensor<T>& dy) {
  std::vector<std::optional<DistTensor<T>>> grads(nodes_.size());
  std::optional<DistTensor<T>> input_grad;
  auto add = [](std::optional<DistTensor<T>>& to, DistTensor<T>&& g) {
    if (to) {
      add_into(to->local, g.local);
    } else {
      to = std::move(g);
    }
  };
  grads.back() = dy;
  for (std::size_t k = nodes_.size(); k-- > 0;) {
    // A node whose output reaches no loss has no gradient: its parameters get none either.
    if (!grads[k]) continue;
    std::vector<DistTensor<T>> g = nodes_[k].layer->backward(*grads[k], state_);
    grads[k].reset();
    for (std::size_t j = 0; j < g.size(); ++j) {
      const int i = nodes_[k].inputs[j];
      add(i >= 0 ? grads[i] : input_grad, std::move(g[j]));
    }
  }
  if (!input_grad) return DistTensor<T>(input_);  // nothing depends on the input
  return std::move(*input_grad);
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
  for (auto& n : nodes_)
    for (Param<T>* p : n.layer->params())
      out.push_back({n.layer->name(), p});
  return out;
}

template <typename T>
std::vector<NamedBuffer<T>> Model<T>::buffers() {
  std::vector<NamedBuffer<T>> out;
  for (auto& n : nodes_)
    for (Buffer<T>* b : n.layer->buffers())
      out.push_back({n.layer->name(), b});
  return out;
}

template <typename T>
std::vector<NamedBuffer<T>> Model<T>::masks() {
  std::vector<NamedBuffer<T>> out;
  for (auto& n : nodes_)
    for (Buffer<T>* b : n.layer->masks())
      out.push_back({n.layer->name(), b});
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
  for (std::size_t k = 0; k < nodes_.size(); ++k) {
    auto ps = nodes_[k].layer->params();
    if (ps.empty()) continue;
    if (spec_.layers[k].type == "batchnorm2d") {
      ps[0]->value.fill(T(1));
      if (ps.size() > 1) ps[1]->value.fill(T(0));
      continue;
    }
    // fan_in as PyTorch's _calculate_fan_in_and_fan_out: dim 1 times the kernel area. For
    // transposed convolutions (weight [in, out/groups, kh, kw]) that is out/groups * area, as in
    // PyTorch.
    const Shape4& ws = ps.front()->value.shape();
    const double bound = 1.0 / std::sqrt(static_cast<double>(ws.c * ws.h * ws.w));
    for (Param<T>* p : ps) {
      const std::uint64_t stream = hash_string(nodes_[k].layer->name() + "/" + p->name);
      std::span<T> v = p->value.span();
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = static_cast<T>((2 * uniform01(seed, stream, i) - 1) * bound);
    }
  }
}

template <typename T>
LossResult<T> compute_loss(LossKind kind, const DistTensor<T>& logits,
                           std::span<const std::int32_t> labels, const ProcessGrid& grid) {
  const Shape4& g = logits.dist.global;
  LossResult<T> r;
  r.grad = DistTensor<T>(logits.dist);
  // Replicated logits (one vector per sample) are whole on every spatial rank: all compute the
  // gradient, only the first rank of each sample group counts the loss.
  const bool counts = !logits.dist.replicated || (grid.coords().i == 0 && grid.coords().j == 0);
  const double count = static_cast<double>(g.n) * (kind == LossKind::cross_entropy ? 1 : g.h * g.w);
  double local = reference::pixel_cross_entropy(logits.local, labels, static_cast<T>(1.0 / count),
                                                &r.grad.local);
  if (!counts) local = 0;
  allreduce_sum(std::span<double>(&local, 1), grid.comm());
  r.loss = local / count;
  return r;
}

template <typename T>
StepResult<T> forward_backward(Model<T>& model, const DistTensor<T>& input,
                               std::span<const std::int32_t> labels, const ProcessGrid& grid) {
  StepResult<T> r;
  model.zero_grad();
  r.output = model.forward(input);
  LossResult<T> loss = compute_loss(model.spec().loss, r.output, labels, grid);
  r.loss = loss.loss;
  r.input_grad = model.backward(loss.grad);
  model.reduce_gradients();
  return r;
}

template class Model<float>;
template class Model<double>;
template LossResult<float> compute_loss(LossKind, const DistTensor<float>&,
                                        std::span<const std::int32_t>, const ProcessGrid&);
template LossResult<double> compute_loss(LossKind, const DistTensor<double>&,
                                         std::span<const std::int32_t>, const ProcessGrid&);
template StepResult<float> forward_backward(Model<float>&, const DistTensor<float>&,
                                            std::span<const std::int32_t>, const ProcessGrid&);
template StepResult<double> forward_backward(Model<double>&, const DistTensor<double>&,
                                             std::span<const std::int32_t>, const ProcessGrid&);

}  // namespace tessera
