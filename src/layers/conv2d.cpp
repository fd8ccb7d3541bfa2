#include "tessera/layers/conv2d.hpp"

#include "tessera/error.hpp"

namespace tessera {

template <typename T>
Conv2d<T>::Conv2d(std::string name, const Conv2dSpec& spec, int tag)
    : Layer<T>(std::move(name)), spec_(spec), tag_(tag) {}

template <typename T>
WindowAxis Conv2d<T>::axis(int a) const {
  return {.kernel = spec_.kernel[a],
          .stride = spec_.stride[a],
          .pad_begin = spec_.pad_begin[a],
          .pad_end = spec_.pad_end[a],
          .dilation = spec_.dilation[a]};
}

template <typename T>
Distribution Conv2d<T>::setup(const Distribution& in, const ProcessGrid& grid) {
  const std::string who = "layer '" + this->name() + "' (conv2d)";
  const Shape4& s = in.global;
  const WindowAxis ah = axis(0), aw = axis(1);
  const std::int64_t oh = window_output_extent(s.h, ah);
  const std::int64_t ow = window_output_extent(s.w, aw);
  TESSERA_CHECK(oh > 0 && ow > 0,
                who + ": its " + std::to_string(s.h) + "x" + std::to_string(s.w) +
                    " input, padded to " + std::to_string(s.h + ah.pad_begin + ah.pad_end) + "x" +
                    std::to_string(s.w + aw.pad_begin + aw.pad_end) +
                    ", is smaller than the kernel's reach of " + std::to_string(ah.span()) + "x" +
                    std::to_string(aw.span()) + " (dilation * (kernel - 1) + 1)");
  out_ = in.with_shape({s.n, spec_.out_channels, oh, ow});
  TESSERA_CHECK(oh >= in.grid.h && ow >= in.grid.w,
                who + ": its " + std::to_string(oh) + "x" + std::to_string(ow) +
                    " output cannot be split over " + std::to_string(in.grid.h) + "x" +
                    std::to_string(in.grid.w) + " spatial ranks: a tile would have " +
                    (oh < in.grid.h ? (ow < in.grid.w ? "no rows and no columns" : "no rows")
                                    : "no columns") +
                    " (use a spatial grid of at most " +
                    std::to_string(std::min<std::int64_t>(oh, in.grid.h)) + "x" +
                    std::to_string(std::min<std::int64_t>(ow, in.grid.w)) + ")");
  in_ = in;
  std::vector<Box> owned, windows;
  for (int i = 0; i < in.grid.h; ++i)
    for (int j = 0; j < in.grid.w; ++j) {
      owned.push_back(in.tile_of(i, j));
      const Box out_tile = out_.tile_of(i, j);
      windows.push_back({input_window(out_tile.h, ah), input_window(out_tile.w, aw)});
    }
  exchange_.emplace(make_halo_plan(owned, windows, grid.spatial_rank(in.me.i, in.me.j)),
                    grid.spatial(), tag_);
  // The window materialises the padding, so the kernel itself pads nothing.
  geometry_ = {.stride_h = ah.stride,
               .stride_w = aw.stride,
               .dilation_h = ah.dilation,
               .dilation_w = aw.dilation,
               .pad_top = 0,
               .pad_left = 0,
               .groups = 1};
  const Shape4 wshape{spec_.out_channels, s.c, spec_.kernel[0], spec_.kernel[1]};
  weight_ = {"weight", Tensor<T>(wshape), Tensor<T>(wshape)};
  if (spec_.bias) {
    const Shape4 bshape{spec_.out_channels, 1, 1, 1};
    bias_ = {"bias", Tensor<T>(bshape), Tensor<T>(bshape)};
  }
  return out_;
}

template <typename T>
DistTensor<T> Conv2d<T>::forward(const DistTensor<T>& x) {
  const HaloPlan& p = exchange_->plan();
  const Shape4 ls = x.local.shape();
  window_ = Tensor<T>({ls.n, ls.c, p.window.h.size(), p.window.w.size()});
  exchange_->fill(x.local, window_);
  DistTensor<T> y(out_);
  reference::conv2d_forward(window_, weight_.value, std::span<const T>(bias_.value.span()), y.local,
                            geometry_);
  return y;
}

template <typename T>
DistTensor<T> Conv2d<T>::backward(const DistTensor<T>& dy) {
  Tensor<T> window_grad(window_.shape());
  reference::conv2d_backward_data(dy.local, weight_.value, window_grad, geometry_);
  DistTensor<T> dx(in_);
  auto request = exchange_->start_accumulate(window_grad, dx.local);
  // The filter gradient needs no halo: it overlaps the exchange.
  reference::conv2d_backward_filter(window_, dy.local, weight_.grad, bias_.grad.span(), geometry_);
  exchange_->finish(request);
  return dx;
}

template <typename T>
std::vector<Param<T>*> Conv2d<T>::params() {
  if (spec_.bias) return {&weight_, &bias_};
  return {&weight_};
}

template class Conv2d<float>;
template class Conv2d<double>;

}  // namespace tessera
