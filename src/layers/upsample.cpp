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
    : WindowLayer<T>(std::move(name), tag), spec_(spec) {}

template <typename T>
Distribution UpsampleNearest<T>::setup(const Distribution& in) {
  const std::string who = "layer '" + this->name() + "' (upsample_nearest)";
  require_spatial(who, in);
  const Shape4& s = in.global;
  const Distribution& out =
      this->set_distributions(who, in, {s.n, s.c, s.h * spec_.scale, s.w * spec_.scale});
  // The window starts at input floor(qb / scale), so output qb sits qb mod scale into its block.
  geometry_ = {.scale_h = spec_.scale,
               .scale_w = spec_.scale,
               .phase_h = out.rows().begin % spec_.scale,
               .phase_w = out.cols().begin % spec_.scale};
  return out;
}

template <typename T>
void UpsampleNearest<T>::bind_kernel(const Box&, const Backend& backend) {
  kernel_ = backend.upsample<T>(geometry_);
  // The window and the output blocked where the model allows the output so and the kernel takes
  // it: an input that comes so is then read in place, and nothing is converted.
  const Layout blocked = blocked_layout_for(this->out_dist().global.c);
  layout_ = this->blocked_output_allowed() && kernel_->takes_blocked() ? blocked : Layout::nchw;
  // An NCHW output from blocked inputs: the kernel converts as it widens.
  const bool converts = layout_ == Layout::nchw && blocked != Layout::nchw &&
                        this->blocked_input_expected() && kernel_->converts_blocked_to_nchw();
  this->set_window_layout(converts ? blocked : layout_);
}

template <typename T>
DistTensor<T> UpsampleNearest<T>::forward(const DistTensor<T>& x, const RunState&) {
  TESSERA_CHECK(kernel_ != nullptr,
                "layer '" + this->name() + "' (upsample_nearest): forward before bind");
  const Tensor<T>& window = this->fill_window(x);
  DistTensor<T> y(this->out_dist(), layout_, uninitialized, this->allocator());  // all written
  kernel_->forward(window, y.local);
  return y;
}

template <typename T>
DistTensor<T> UpsampleNearest<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  Tensor<T> window_grad = this->window_grad_uninitialized();  // overwritten
  kernel_->backward(dy.local, window_grad);
  return this->accumulate_window(window_grad);
}

template class UpsampleNearest<float>;
template class UpsampleNearest<double>;

}  // namespace tessera
