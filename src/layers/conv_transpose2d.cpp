#include "tessera/layers/conv_transpose2d.hpp"

#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/layers/window.hpp"

namespace tessera {
namespace {

// Rounds towards minus infinity (b > 0): windows start left of the image when padding is small.
std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

std::string pair_str(const Pair& p) {
  return "[" + std::to_string(p[0]) + ", " + std::to_string(p[1]) + "]";
}

}  // namespace

std::int64_t ConvTransposeAxis::output_extent(std::int64_t in) const {
  return (in - 1) * stride - 2 * padding + (kernel - 1) + output_padding + 1;
}

Range ConvTransposeAxis::input_window(Range out) const {
  if (out.empty()) return {0, 0};
  // i reaches q through some tap j in [0, kernel) iff q + padding - (kernel - 1) <= i*stride <=
  // q + padding; ceil(a / s) = -floor(-a / s). Every i in between reaches some q of `out`, and
  // end >= begin: a stride larger than the kernel gives an empty window, never a negative one.
  return {-floor_div(-(out.begin + padding - (kernel - 1)), stride),
          floor_div(out.end - 1 + padding, stride) + 1};
}

ConvTransposeAxis ConvTranspose2dSpec::axis(int a) const {
  return {.kernel = kernel[a],
          .stride = stride[a],
          .padding = padding[a],
          .output_padding = output_padding[a]};
}

ConvTranspose2dSpec parse_conv_transpose2d(const LayerSpec& spec) {
  Fields f(spec);
  ConvTranspose2dSpec s;
  s.out_channels = f.integer("out_channels", std::nullopt, 1);
  s.kernel = f.pair("kernel", std::nullopt, 1);
  s.stride = f.pair("stride", Pair{1, 1}, 1);
  s.padding = f.pair("padding", Pair{0, 0}, 0);
  s.output_padding = f.pair("output_padding", Pair{0, 0}, 0);
  s.bias = f.boolean("bias", true);
  f.finish();
  for (int a = 0; a < 2; ++a)
    if (s.output_padding[a] >= s.stride[a])
      f.fail("field 'output_padding' " + pair_str(s.output_padding) +
             " must be smaller than 'stride' " + pair_str(s.stride) + " (as in PyTorch)");
  return s;
}

template <typename T>
ConvTranspose2d<T>::ConvTranspose2d(std::string name, const ConvTranspose2dSpec& spec, int tag)
    : WindowLayer<T>(std::move(name), tag), spec_(spec) {}

template <typename T>
std::optional<WindowMap> ConvTranspose2d<T>::window() const {
  const ConvTransposeAxis rows = spec_.axis(0), cols = spec_.axis(1);
  return WindowMap{[rows](Range r) { return rows.input_window(r); },
                   [cols](Range r) { return cols.input_window(r); }};
}

template <typename T>
Distribution ConvTranspose2d<T>::setup(const Distribution& in) {
  const std::string who = "layer '" + this->name() + "' (conv_transpose2d)";
  require_spatial(who, in);
  const Shape4& s = in.global;
  const std::int64_t oh = spec_.axis(0).output_extent(s.h);
  const std::int64_t ow = spec_.axis(1).output_extent(s.w);
  TESSERA_CHECK(oh > 0 && ow > 0,
                who + ": its " + std::to_string(s.h) + "x" + std::to_string(s.w) +
                    " input gives a " + std::to_string(oh) + "x" + std::to_string(ow) +
                    " output ((in - 1)*stride - 2*padding + kernel + output_padding): "
                    "'padding' " +
                    pair_str(spec_.padding) + " is too large");
  const Distribution& out = this->set_distributions(who, in, {s.n, spec_.out_channels, oh, ow});
  // PyTorch's layout [in, out, kh, kw]: the weight of the convolution this is the adjoint of.
  const Shape4 wshape{s.c, spec_.out_channels, spec_.kernel[0], spec_.kernel[1]};
  weight_ = this->make_param("weight", wshape);
  if (spec_.bias) {
    const Shape4 bshape{spec_.out_channels, 1, 1, 1};
    bias_ = this->make_param("bias", bshape);
  }
  return out;
}

template <typename T>
void ConvTranspose2d<T>::bind_kernel(const Box& win, const Backend& backend) {
  // With the window starting at input row ib and the tile at output row qb, local output
  // r = q - qb receives local input l = i - ib through tap j when r = l*S + j - (qb + P - ib*S):
  // the global map with the padding shifted, possibly negative.
  const Box tile = this->out_dist().tile();
  geometry_ = {.stride_h = spec_.stride[0],
               .stride_w = spec_.stride[1],
               .dilation_h = 1,
               .dilation_w = 1,
               .pad_top = tile.h.begin + spec_.padding[0] - win.h.begin * spec_.stride[0],
               .pad_left = tile.w.begin + spec_.padding[1] - win.w.begin * spec_.stride[1],
               .groups = 1};
  // The adjoint conv reads the output tile (its x) and writes the window (its y); PyTorch's
  // transposed weight [in, out, kh, kw] is that conv's [O, C, KH, KW].
  const Shape4 in = this->in_dist().local_shape();
  const Shape4 window{in.n, in.c, win.h.size(), win.w.size()};
  const Shape4 out = this->out_dist().local_shape();
  kernel_.reset();
  patch_.reset();
  out_layout_ = Layout::nchw;
  bias_kernel_ = backend.merge<T>();
  if (window.numel() == 0 || out.numel() == 0) return;
  // The window in nchw16c when a fast kernel takes it (no reorder of it in any pass), and the
  // output too where the model allows it (it goes to the next layer, and its gradient comes
  // back, as the kernel reads and writes them). Not nchw8c: the adjoint conv would read an
  // 8-channel output in 8-channel blocks and convert the window to them (not measured).
  const Layout window_fast = in.c % kBlock == 0 ? Layout::nchw16c : Layout::nchw;
  const Layout out_fast =
      this->blocked_output_allowed() && out.c % kBlock == 0 ? Layout::nchw16c : Layout::nchw;
  std::vector<std::pair<Layout, Layout>> layouts{{window_fast, out_fast}};
  if (out_fast != Layout::nchw) layouts.emplace_back(window_fast, Layout::nchw);
  if (window_fast != Layout::nchw) layouts.emplace_back(Layout::nchw, Layout::nchw);
  for (const auto& [wl, ol] : layouts) {
    kernel_ = backend.conv<T>({.x = out,
                               .w = weight_.value.shape(),
                               .y = window,
                               .bias = false,
                               .x_layout = ol,
                               .y_layout = wl},
                              geometry_);
    if (kernel_) {
      this->set_window_layout(wl);
      out_layout_ = ol;
      if constexpr (std::is_same_v<T, float>)
        if (wl == Layout::nchw16c && ol == Layout::nchw16c && spec_.kernel == Pair{2, 2} &&
            spec_.stride == Pair{2, 2})
          patch_ = backend.patch_deconv({.x = window,
                                         .w = weight_.value.shape(),
                                         .y = out,
                                         .pad_top = geometry_.pad_top,
                                         .pad_left = geometry_.pad_left});
      return;
    }
  }
}

template <typename T>
DistTensor<T> ConvTranspose2d<T>::forward(const DistTensor<T>& x, const RunState&) {
  const Tensor<T>& window = this->fill_window(x);
  const MemorySpace space = this->allocator().space();
  if (!kernel_) {
    // No input reaches this tile (or the tile is empty): the output is the bias alone.
    DistTensor<T> y(this->out_dist(), Layout::nchw, this->allocator());
    if (spec_.bias) bias_kernel_->add_bias(std::as_const(bias_.value).span_in(space), y.local);
    return y;
  }
  DistTensor<T> y(this->out_dist(), out_layout_, uninitialized, this->allocator());
  if constexpr (std::is_same_v<T, float>)
    if (patch_) {
      patch_->forward(window, weight_.value,
                      spec_.bias ? std::as_const(bias_.value).span_in(space) : std::span<const T>(),
                      y.local);
      return y;
    }
  kernel_->backward_data(window, weight_.value, y.local);
  if (spec_.bias) bias_kernel_->add_bias(std::as_const(bias_.value).span_in(space), y.local);
  return y;
}

template <typename T>
DistTensor<T> ConvTranspose2d<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  const MemorySpace space = this->allocator().space();
  auto bias_grad = [&] {
    if (spec_.bias) bias_kernel_->add_bias_grad(dy.local, bias_.grad.span_in(space));
  };
  if (!kernel_) {
    Tensor<T> zeros = this->window_grad_zeros();
    return this->accumulate_window(zeros, bias_grad);
  }
  Tensor<T> window_grad = this->window_grad_uninitialized();
  kernel_->forward(dy.local, weight_.value, {}, window_grad);
  // The filter gradient needs no halo: it overlaps the exchange. The conv's backward-filter
  // pairs its input (our dy) with its output gradient (our window); the window is as forward's
  // backward-data read it, so the kernel may reuse its conversion of it from then.
  return this->accumulate_window(window_grad, [&] {
    if constexpr (std::is_same_v<T, float>)
      if (patch_) {
        patch_->backward_filter(this->kept_window(), dy.local, weight_.grad,
                                spec_.bias ? bias_.grad.span_in(space) : std::span<T>());
        return;
      }
    kernel_->backward_filter(dy.local, this->kept_window(), weight_.grad, {});
    bias_grad();
  });
}

template <typename T>
std::string ConvTranspose2d<T>::kernel_summary() const {
  if (!kernel_) return {};
  return patch_ ? patch_->name() + ", input gradient " + kernel_->name()
                : "adjoint " + kernel_->name();
}

template <typename T>
std::vector<Param<T>*> ConvTranspose2d<T>::params() {
  if (spec_.bias) return {&weight_, &bias_};
  return {&weight_};
}

template class ConvTranspose2d<float>;
template class ConvTranspose2d<double>;

}  // namespace tessera
