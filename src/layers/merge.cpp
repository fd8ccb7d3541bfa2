#include "tessera/layers/merge.hpp"

#include <algorithm>

#include "tessera/error.hpp"

namespace tessera {

MergeKind parse_merge(const LayerSpec& spec) {
  Fields f(spec);
  f.finish();
  return spec.type == "add" ? MergeKind::add : MergeKind::concat;
}

template <typename T>
Distribution Merge<T>::setup(std::span<const Distribution> inputs) {
  const bool concat = kind_ == MergeKind::concat;
  const std::string who = "layer '" + this->name() + "' (" + (concat ? "concat" : "add") + ")";
  in_.assign(inputs.begin(), inputs.end());
  const Distribution& first = inputs[0];
  std::int64_t channels = 0;
  for (const Distribution& d : inputs) {
    const Shape4& a = first.global;
    const Shape4& b = d.global;
    // Tiles depend only on the extents, so equal extents mean equal tiles on every rank.
    TESSERA_CHECK(b.n == a.n && b.h == a.h && b.w == a.w && d.replicated == first.replicated &&
                      (concat || b.c == a.c),
                  who + ": its inputs have shapes " + a.str() + " and " + b.str() +
                      (concat ? " (N x C x H x W): all but the channels must agree"
                              : " (N x C x H x W): they must agree") +
                      (b.h != a.h || b.w != a.w
                           ? "; crop or pad the image so that pooling and upsampling give back "
                             "the same size"
                           : ""));
    channels += b.c;
  }
  Shape4 out = first.global;
  if (concat) out.c = channels;
  return first.with_shape(out);
}

template <typename T>
DistTensor<T> Merge<T>::forward(std::span<const DistTensor<T>* const> inputs, const RunState&) {
  DistTensor<T> y(
      inputs[0]->dist.with_shape(kind_ == MergeKind::add ? inputs[0]->dist.global : Shape4{}));
  TESSERA_CHECK(kernel_ != nullptr, "layer '" + this->name() + "': forward before bind");
  if (kind_ == MergeKind::add) {
    y.local = inputs[0]->local;
    for (std::size_t k = 1; k < inputs.size(); ++k)
      kernel_->add(inputs[k]->local, y.local);
    return y;
  }
  Shape4 g = inputs[0]->dist.global;
  g.c = 0;
  for (const auto* x : inputs)
    g.c += x->dist.global.c;
  // Every element is copied from an input: no zeroing first.
  y = DistTensor<T>(inputs[0]->dist.with_shape(g), Layout::nchw, uninitialized, this->allocator());
  std::int64_t offset = 0;  // channels before this input
  for (const auto* x : inputs) {
    kernel_->put_channels(x->local, y.local, offset);
    offset += x->local.shape().c;
  }
  return y;
}

template <typename T>
std::vector<DistTensor<T>> Merge<T>::backward(const DistTensor<T>& dy, const RunState&) {
  std::vector<DistTensor<T>> grads;
  if (kind_ == MergeKind::add) {
    for (std::size_t k = 0; k < in_.size(); ++k)
      grads.push_back(dy);
    return grads;
  }
  std::int64_t offset = 0;  // channels before this input
  for (const Distribution& d : in_) {
    DistTensor<T> g(d, Layout::nchw, uninitialized, this->allocator());
    kernel_->take_channels(dy.local, offset, g.local);
    offset += d.global.c;
    grads.push_back(std::move(g));
  }
  return grads;
}

template class Merge<float>;
template class Merge<double>;

}  // namespace tessera
