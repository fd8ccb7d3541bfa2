#include "tessera/layers/upsample.hpp"

#include "tessera/error.hpp"
#include "tessera/layers/window.hpp"

namespace tessera {

UpsampleSpec parse_upsample(const LayerSpec& spec) {
  Fields f(spec);
  UpsampleSpec s;
  s.scale = f.integer("scale", std::nullopt, 1);
  f.finish();
  return s;
}

WindowMap upsample_window(std::int64_t scale) {
  auto map = [scale](Range r) -> Range {
    if (r.empty()) return {0, 0};
    return {r.begin / scale, (r.end - 1) / scale + 1};  // r.begin >= 0: '/' is floor
  };
  return {map, map};
}

template <typename T>
UpsampleNearest<T>::UpsampleNearest(std::string name, const UpsampleSpec& spec, int tag)
    : UnaryLayer<T>(std::move(name)), spec_(spec), tag_(tag) {}

template <typename T>
Distribution UpsampleNearest<T>::setup(const Distribution& in) {
  const std::string who = "layer '" + this->name() + "' (upsample_nearest)";
  require_spatial(who, in);
  const Shape4& s = in.global;
  in_ = in;
  out_ = in.with_shape({s.n, s.c, s.h * spec_.scale, s.w * spec_.scale});
  require_tiles(who, out_);
  return out_;
}

template <typename T>
void UpsampleNearest<T>::bind(const ProcessGrid& grid) {
  exchange_.emplace(window_exchange<T>(in_, out_, *window(), grid, tag_));
  // The window starts at input floor(qb / scale), so output qb sits qb mod scale into its block.
  geometry_ = {.scale_h = spec_.scale,
               .scale_w = spec_.scale,
               .phase_h = out_.rows().begin % spec_.scale,
               .phase_w = out_.cols().begin % spec_.scale};
}

template <typename T>
DistTensor<T> UpsampleNearest<T>::forward(const DistTensor<T>& x, const RunState&) {
  Tensor<T> window(window_shape(in_, exchange_->plan()));
  exchange_->fill(x.local, window);
  DistTensor<T> y(out_);
  reference::upsample_nearest_forward(window, y.local, geometry_);
  return y;
}

template <typename T>
DistTensor<T> UpsampleNearest<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  Tensor<T> window_grad(window_shape(in_, exchange_->plan()));
  reference::upsample_nearest_backward(dy.local, window_grad, geometry_);
  DistTensor<T> dx(in_);
  exchange_->accumulate(window_grad, dx.local);
  return dx;
}

template class UpsampleNearest<float>;
template class UpsampleNearest<double>;

}  // namespace tessera
