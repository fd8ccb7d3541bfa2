#include "tessera/layers/pool2d.hpp"

#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/layers/window.hpp"

namespace tessera {
namespace {

std::string pair_text(const Pair& p) {
  return "[" + std::to_string(p[0]) + ", " + std::to_string(p[1]) + "]";
}

}  // namespace

WindowAxis Pool2dSpec::axis(int a) const {
  return {.kernel = kernel[a],
          .stride = stride[a],
          .pad_begin = padding[a],
          .pad_end = padding[a],
          .dilation = 1};
}

Pool2dSpec parse_pool2d(const LayerSpec& spec) {
  Fields f(spec);
  Pool2dSpec s;
  s.kind = spec.type == "avgpool2d" ? PoolKind::avg : PoolKind::max;
  s.kernel = f.pair("kernel", std::nullopt, 1);
  s.stride = f.pair("stride", s.kernel, 1);
  s.padding = f.pair("padding", Pair{0, 0}, 0);
  f.finish();
  // PyTorch refuses more: a window could then lie wholly in the padding.
  if (s.padding[0] > s.kernel[0] / 2 || s.padding[1] > s.kernel[1] / 2)
    f.fail("field 'padding' (" + pair_text(s.padding) + ") must be at most half the kernel (" +
           pair_text(s.kernel) + ") on each axis, as in PyTorch");
  return s;
}

template <typename T>
Pool2d<T>::Pool2d(std::string name, const Pool2dSpec& spec, int tag)
    : WindowLayer<T>(std::move(name), tag), spec_(spec) {}

template <typename T>
std::optional<WindowMap> Pool2d<T>::window() const {
  return conv_window(spec_.axis(0), spec_.axis(1));
}

template <typename T>
Distribution Pool2d<T>::setup(const Distribution& in) {
  const std::string who = "layer '" + this->name() + "' (" +
                          (spec_.kind == PoolKind::max ? "maxpool2d" : "avgpool2d") + ")";
  require_spatial(who, in);
  const Shape4& s = in.global;
  const WindowAxis ah = spec_.axis(0), aw = spec_.axis(1);
  const std::int64_t oh = window_output_extent(s.h, ah);
  const std::int64_t ow = window_output_extent(s.w, aw);
  TESSERA_CHECK(oh > 0 && ow > 0,
                who + ": its " + std::to_string(s.h) + "x" + std::to_string(s.w) +
                    " input, padded to " + std::to_string(s.h + 2 * ah.pad_begin) + "x" +
                    std::to_string(s.w + 2 * aw.pad_begin) + ", is smaller than the " +
                    std::to_string(ah.kernel) + "x" + std::to_string(aw.kernel) + " kernel");
  return this->set_distributions(who, in, {s.n, s.c, oh, ow});
}

template <typename T>
void Pool2d<T>::bind_kernel(const Box& w, const Backend& backend) {
  // The window holds padding where it leaves the image; max pooling must tell it from real
  // values, so the kernel gets the image's part of the window in window coordinates.
  const Shape4& s = this->in_dist().global;
  const Box image = intersect(w, Box{{0, s.h}, {0, s.w}});
  const reference::PoolGeometry geometry{
      .kernel_h = spec_.kernel[0],
      .kernel_w = spec_.kernel[1],
      .stride_h = spec_.stride[0],
      .stride_w = spec_.stride[1],
      .pad_top = 0,
      .pad_left = 0,
      .image = {{image.h.begin - w.h.begin, image.h.end - w.h.begin},
                {image.w.begin - w.w.begin, image.w.end - w.w.begin}}};
  const Shape4 in = this->in_dist().local_shape();
  const Shape4 x{in.n, in.c, w.h.size(), w.w.size()};
  const Shape4 y = this->out_dist().local_shape();
  // nchw16c (nchw8c for a multiple of 8 channels that is not one of 16) in and out when the
  // output may go on blocked and a fast kernel takes it: no conversions before or after (a conv's
  // blocked output pooled for the next conv). Else NCHW.
  const Layout blocked = this->blocked_output_allowed() ? blocked_layout_for(in.c) : Layout::nchw;
  for (const Layout layout : {blocked, Layout::nchw}) {
    kernel_ = backend.pool<T>(spec_.kind, {.x = x, .y = y, .layout = layout}, geometry);
    if (kernel_) {
      out_layout_ = layout;
      break;
    }
  }
  TESSERA_CHECK(kernel_ != nullptr, "no pooling kernel for layer '" + this->name() + "'");
  // An NCHW input (an activation that feeds a concat too) would be converted into a blocked
  // window and its gradient back, at the input's resolution: the NCHW kernel pools it as it lies
  // unless that kernel is plain loops.
  nchw_kernel_.reset();
  if (out_layout_ != Layout::nchw) {
    nchw_kernel_ = backend.pool<T>(spec_.kind, {.x = x, .y = y, .layout = Layout::nchw}, geometry);
    if (nchw_kernel_ && nchw_kernel_->plain_loops()) nchw_kernel_.reset();
  }
  active_ = nullptr;  // the exchange is new: set its window up again
  choose_kernel(out_layout_);
}

template <typename T>
void Pool2d<T>::choose_kernel(Layout layout) {
  const bool plain = layout == Layout::nchw && nchw_kernel_ != nullptr;
  PoolKernel<T>* k = plain ? nchw_kernel_.get() : kernel_.get();
  if (k == active_) return;
  active_ = k;
  this->set_window_layout(active_layout());
  this->set_window_padding(active_->window_padding());
}

template <typename T>
DistTensor<T> Pool2d<T>::forward(const DistTensor<T>& x, const RunState&) {
  choose_kernel(x.layout());
  const Tensor<T>& window = this->fill_window(x);
  DistTensor<T> y(this->out_dist(), active_layout(), uninitialized, this->allocator());
  active_->forward(window, y.local);
  return y;
}

template <typename T>
DistTensor<T> Pool2d<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  Tensor<T> window_grad = this->window_grad_uninitialized();
  active_->backward(dy.local, window_grad);
  return this->accumulate_window(window_grad);
}

template <typename T>
bool Pool2d<T>::backward_adding(const DistTensor<T>& dy, const RunState&, DistTensor<T>& grad) {
  // The window's gradient would be dL/dx as it is (WindowLayer::accumulate_window): the same
  // elements, so the kernel may add them into grad where that lies as the window would.
  if (!this->window_is_tile() || this->input_activation_grad_fused() || this->concat_taken() ||
      grad.local.layout() != active_layout() ||
      !(grad.local.shape() == this->in_dist().local_shape()) ||
      grad.local.space() != MemorySpace::host)
    return false;
  if (!active_->backward_add(dy.local, grad.local)) return false;
  this->release_window();
  return true;
}

template class Pool2d<float>;
template class Pool2d<double>;

}  // namespace tessera
