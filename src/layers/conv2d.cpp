#include "tessera/layers/conv2d.hpp"

#include <algorithm>
#include <array>
#include <optional>
#include <utility>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/halo_plan.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/layers/window.hpp"

namespace tessera {
namespace {

// The output boxes of rank (a, b)'s tile whose inputs are not all its own tile or the image's
// zero padding (top and bottom the whole width, left and right between them; empty where none),
// or nothing where the tile has no output reading only those (no interior: a tile too small for
// the kernel's reach). Local and pure.
std::optional<std::array<Box, 4>> border_boxes(const Distribution& in, const Distribution& out,
                                               const WindowMap& map, int a, int b) {
  const Box owned = in.tile_of(a, b), tile = out.tile_of(a, b);
  const Range ready_h = ready_without_halo(map.rows(tile.h), owned.h, in.global.h);
  const Range ready_w = ready_without_halo(map.cols(tile.w), owned.w, in.global.w);
  const Range ih = outputs_reading_within(tile.h, ready_h, map.rows);
  const Range iw = outputs_reading_within(tile.w, ready_w, map.cols);
  if (ih.empty() || iw.empty()) return std::nullopt;
  return std::array<Box, 4>{Box{{tile.h.begin, ih.begin}, tile.w},
                            Box{{ih.end, tile.h.end}, tile.w}, Box{ih, {tile.w.begin, iw.begin}},
                            Box{ih, {iw.end, tile.w.end}}};
}

// Sets `box` (global coordinates) of every plane of `t` to zero, in any layout.
template <typename T>
void zero_box(const Planes<T>& t, const Box& box) {
  if (box.empty()) return;
  const std::int64_t v = t.block(), width = box.w.size() * v;
  for (std::int64_t n = 0; n < t.shape.n; ++n)
    for (std::int64_t c = 0; c < t.shape.c; c += v)  // a block's columns lie side by side
      for (std::int64_t r = box.h.begin; r < box.h.end; ++r) {
        T* row = t.at(n * t.shape.c + c, r, box.w.begin);
        std::fill(row, row + width, T(0));
      }
}

}  // namespace

WindowAxis Conv2dSpec::axis(int a) const {
  return {.kernel = kernel[a],
          .stride = stride[a],
          .pad_begin = pad_begin[a],
          .pad_end = pad_end[a],
          .dilation = dilation[a]};
}

Conv2dSpec parse_conv2d(const LayerSpec& spec) {
  Fields f(spec);
  Conv2dSpec s;
  s.out_channels = f.integer("out_channels", std::nullopt, 1);
  s.kernel = f.pair("kernel", std::nullopt, 1);
  s.stride = f.pair("stride", Pair{1, 1}, 1);
  s.dilation = f.pair("dilation", Pair{1, 1}, 1);
  s.groups = f.integer("groups", 1, 1);
  s.bias = f.boolean("bias", true);
  const nlohmann::json* padding = f.raw("padding");
  if (!(padding != nullptr && padding->is_string()))
    s.pad_begin = s.pad_end = f.pair("padding", Pair{0, 0}, 0);
  f.finish();
  if (const nlohmann::json* p = padding; p != nullptr && p->is_string()) {
    if (p->get<std::string>() == "same") {
      if (s.stride != Pair{1, 1}) f.fail("padding 'same' needs stride 1 (as in PyTorch)");
      for (int a = 0; a < 2; ++a) {
        // PyTorch: total = dilation * (kernel - 1), the smaller half first.
        const std::int64_t total = s.dilation[a] * (s.kernel[a] - 1);
        s.pad_begin[a] = total / 2;
        s.pad_end[a] = total - total / 2;
      }
    } else if (p->get<std::string>() != "valid") {
      f.fail("field 'padding' must be an integer, [h, w], \"same\" or \"valid\", got " + p->dump());
    }
  }
  if (s.out_channels % s.groups != 0)
    f.fail("out_channels (" + std::to_string(s.out_channels) + ") must be divisible by groups (" +
           std::to_string(s.groups) + ")");
  return s;
}

template <typename T>
Conv2d<T>::Conv2d(std::string name, const Conv2dSpec& spec, int tag)
    : WindowLayer<T>(std::move(name), tag), spec_(spec) {}

template <typename T>
std::optional<WindowMap> Conv2d<T>::window() const {
  return conv_window(spec_.axis(0), spec_.axis(1));
}

template <typename T>
Distribution Conv2d<T>::setup(const Distribution& in) {
  const std::string who = "layer '" + this->name() + "' (conv2d)";
  require_spatial(who, in);
  const Shape4& s = in.global;
  TESSERA_CHECK(s.c % spec_.groups == 0,
                who + ": its " + std::to_string(s.c) +
                    " input channels are not divisible by groups=" + std::to_string(spec_.groups));
  const WindowAxis ah = spec_.axis(0), aw = spec_.axis(1);
  const std::int64_t oh = window_output_extent(s.h, ah);
  const std::int64_t ow = window_output_extent(s.w, aw);
  TESSERA_CHECK(oh > 0 && ow > 0,
                who + ": its " + std::to_string(s.h) + "x" + std::to_string(s.w) +
                    " input, padded to " + std::to_string(s.h + ah.pad_begin + ah.pad_end) + "x" +
                    std::to_string(s.w + aw.pad_begin + aw.pad_end) +
                    ", is smaller than the kernel's reach of " + std::to_string(ah.span()) + "x" +
                    std::to_string(aw.span()) + " (dilation * (kernel - 1) + 1)");
  const Distribution& out = this->set_distributions(who, in, {s.n, spec_.out_channels, oh, ow});
  // The window materialises the padding, so the kernel itself pads nothing.
  geometry_ = {.stride_h = ah.stride,
               .stride_w = aw.stride,
               .dilation_h = ah.dilation,
               .dilation_w = aw.dilation,
               .pad_top = 0,
               .pad_left = 0,
               .groups = spec_.groups};
  // Windowless (bind_kernel), the tile's kernel pads as the layer does.
  padded_ = geometry_;
  padded_.pad_top = ah.pad_begin;
  padded_.pad_left = aw.pad_begin;
  const Shape4 wshape{spec_.out_channels, s.c / spec_.groups, spec_.kernel[0], spec_.kernel[1]};
  weight_ = this->make_param("weight", wshape);
  if (spec_.bias) {
    const Shape4 bshape{spec_.out_channels, 1, 1, 1};
    bias_ = this->make_param("bias", bshape);
  }
  return out;
}

template <typename T>
bool Conv2d<T>::computes_in_nchw(const Backend& backend) const {
  // The whole image's window: the input with its padding, as the kernels see a window.
  const Shape4& y = this->out_dist().global;
  const Shape4 x{y.n, this->in_dist().global.c, input_window({0, y.h}, spec_.axis(0)).size(),
                 input_window({0, y.w}, spec_.axis(1)).size()};
  return backend.conv_in_nchw<T>(layer_shapes(x, y, spec_.bias), geometry_);
}

template <typename T>
void Conv2d<T>::bind_kernel(const Box& window, const Backend& backend) {
  // The model is built for one global batch, so every shape here is fixed for the layer's life.
  const Shape4 in = this->in_dist().local_shape();
  // Windowless: the kernel reads the tile itself, padded as the layer pads.
  windowless_ = windowless_fits(backend);
  strips_.clear();
  regions_.clear();
  const Shape4 x = windowless_ ? in : Shape4{in.n, in.c, window.h.size(), window.w.size()};
  const Shape4 y = this->out_dist().local_shape();
  // The window, and the output where the model allows it, in nchw16c when a fast kernel takes
  // them: the exchange then assembles the window in the layout oneDNN computes in, and the output
  // goes to the next layer as oneDNN wrote it; no reorders of activations or their gradients.
  // Else NCHW, which every kernel takes. A window of more than 16 channels that are not a
  // multiple of 16 is nchw16c too, its last block padded with zero channels: oneDNN then reads it
  // as it computes instead of converting an NCHW window at every call (24 -> 8 channels 3x3 at
  // 1024x1024, forward + backward-data + backward-weights: 326 ms -> 124 ms). Fewer channels stay
  // NCHW: blocks mostly made of padding measured no faster (8 -> 8: 148 vs 150 ms, with a
  // slower window assembly) or slower (an image's 3 channels, which oneDNN's first-layer kernels
  // read in NCHW).
  // Before those, a multiple of 8 channels that is not one of 16 (8, 24, 40, ...) is offered in
  // nchw8c, which oneDNN's 8-channel kernels read without padding (24 -> 8 3x3 at 2048x2048, the
  // three passes: 629 -> 334 ms; README "Channel blocks"), where the window is assembled anyway,
  // and where it is the tile itself (a 1x1 conv's, whose gradient is then taken over uncopied)
  // when the input is expected in nchw8c (a narrow head after 8-channel activations, computed as
  // GEMMs on the blocks: make_onednn_blocked_pointwise).
  // The kernel declines it where it computes faster from 16-channel blocks (Winograd).
  // An output of a multiple of 8 channels that is not one of 16 (the 8-channel convs of
  // unet-small) goes on in nchw8c, as oneDNN's 8-channel kernels write it: no conversion to NCHW
  // after the conv and none of its gradient back (README "Channel blocks").
  const Layout x_fast = in.c % kBlock == 0 || in.c > kBlock ? Layout::nchw16c : Layout::nchw;
  const Layout y_fast = this->blocked_output_allowed() ? blocked_layout_for(y.c) : Layout::nchw;
  std::vector<std::pair<Layout, Layout>> layouts;
  // A tile in nchw8c only for the narrow GEMMs, which apply no fused activation (below).
  const bool tile_in_8c = this->blocked_input_expected() && y.c < kBlock;
  if ((!this->window_is_tile() || tile_in_8c) && in.c % 8 == 0 && in.c % kBlock != 0)
    layouts.emplace_back(Layout::nchw8c, y_fast);
  layouts.emplace_back(x_fast, y_fast);
  if (x_fast != Layout::nchw || y_fast != Layout::nchw)
    layouts.emplace_back(Layout::nchw, Layout::nchw);
  // The parity of x's first row and column in global coordinates (the tile's, or the window's,
  // which may start in the padding at -1), for the input channels in 2x2 blocks.
  const Box& origin = windowless_ ? this->in_dist().tile() : window;
  const BoxAt parity{((origin.h.begin % 2) + 2) % 2, ((origin.w.begin % 2) + 2) % 2};
  // The rank's own rows start there in x (the window's rows above may be halos still travelling
  // while the tile computes under the overlap).
  const std::int64_t ready_row =
      std::max<std::int64_t>(0, this->in_dist().tile().h.begin - origin.h.begin);
  // An activation offered (Layer::offer_output_activation) is taken where a kernel applies it;
  // else the layers compute it apart, as without the offer.
  for (bool fused : {offered_.has_value(), false}) {
    activation_ = fused ? offered_ : std::nullopt;
    for (auto [xl, yl] : layouts) {
      if (this->window_is_tile() && xl == Layout::nchw8c && activation_) continue;
      // Windowless, dx is a tile of the strips' exchanges, which never pad blocked channels.
      if (windowless_ && storage_size(x, xl) != x.numel()) continue;
      ConvShapes shapes = layer_shapes(x, y, spec_.bias);
      shapes.x_layout = xl;
      shapes.y_layout = yl;
      shapes.activation = activation_;
      shapes.doubled_parity = parity;
      shapes.doubled_ready_row = ready_row;
      kernel_ = backend.conv<T>(shapes, windowless_ ? padded_ : geometry_);
      if (kernel_ && (windowless_ ? plan_strips(x, y, xl, yl, backend)
                                  : plan_regions(window, x, y, xl, yl, backend))) {
        this->set_window_layout(xl);
        x_layout_ = xl;
        out_layout_ = yl;
        return;
      }
      // Windowless needs its strips: a tile kernel without them would leave the border wrong and
      // start fewer exchanges than the other ranks. (NCHW, which every backend plans, comes last.)
      if (windowless_) kernel_.reset();
    }
    if (!fused) break;
  }
  TESSERA_CHECK(kernel_ != nullptr,
                "no conv kernel for layer '" + this->name() + "'" +
                    (windowless_ ? " (windowless, with its border strips)" : ""));
}

template <typename T>
std::pair<std::int64_t, std::int64_t> Conv2d<T>::doubled_channels() const {
  std::int64_t begin = 0, end = 0;
  for (std::size_t k = 0; k < doubled_.size(); ++k) {
    const std::int64_t first = this->concat_taken() ? this->concat_first_channel(k) : 0;
    const std::int64_t last = first + (this->concat_taken() ? this->concat_inputs()[k].global.c
                                                            : this->in_dist().global.c);
    if (!doubled_[k]) {
      if (end > begin) break;
      continue;
    }
    if (end == begin) begin = first;
    end = last;
  }
  return {begin, end};
}

template <typename T>
ConvShapes Conv2d<T>::layer_shapes(const Shape4& x, const Shape4& y, bool bias) const {
  const auto [doubled_begin, doubled_end] = doubled_channels();
  return {.x = x,
          .w = weight_.value.shape(),
          .y = y,
          .bias = bias,
          .doubled_begin = doubled_begin,
          .doubled_end = doubled_end,
          .x_nchw = this->nchw_input_expected()};
}

template <typename T>
bool Conv2d<T>::plan_regions(const Box& window, const Shape4& x, const Shape4& y, Layout x_layout,
                             Layout y_layout, const Backend& backend) {
  regions_.clear();
  const HaloPlan& plan = this->plan();
  if (!this->overlap() || plan.recv.empty()) return true;
  const WindowMap map = *this->window();
  const Distribution& in = this->in_dist();
  const Box tile = this->out_dist().tile();
  // The whole tile is computed while the halos travel (its border from stale halos); these strips
  // are computed again once they arrived. A box kernel of the interior would have to copy it
  // (oneDNN's fast convolutions take dense tensors only): 35% slower here than the whole tile.
  const std::optional<std::array<Box, 4>> boxes =
      border_boxes(in, this->out_dist(), map, in.me.i, in.me.j);
  if (!boxes) return true;  // no interior to hide the halos behind
  for (const Box& b : *boxes) {
    if (b.empty()) continue;
    const Box footprint{map.rows(b.h), map.cols(b.w)};
    const BoxAt at{footprint.h.begin - window.h.begin, footprint.w.begin - window.w.begin};
    const BoxAt out{b.h.begin - tile.h.begin, b.w.begin - tile.w.begin};
    ConvShapes shapes = layer_shapes({x.n, x.c, footprint.h.size(), footprint.w.size()},
                                     {y.n, y.c, b.h.size(), b.w.size()}, spec_.bias);
    shapes.x_outer = x;
    shapes.y_outer = y;
    shapes.x_layout = x_layout;
    shapes.y_layout = y_layout;
    shapes.x_at = at;
    shapes.y_at = out;
    shapes.activation = activation_;
    Region r{.in = at, .out = out, .kernel = backend.conv<T>(shapes, geometry_)};
    if (!r.kernel) {
      regions_.clear();
      return false;  // a box these layouts cannot take: try the next ones
    }
    regions_.push_back(std::move(r));
  }
  return true;
}

template <typename T>
bool Conv2d<T>::windowless_fits(const Backend& backend) const {
  if (!this->windowless_wanted() || spec_.stride != Pair{1, 1}) return false;
  if (spec_.axis(0).span() == 1 && spec_.axis(1).span() == 1) return false;  // window is tile
  const Distribution &in = this->in_dist(), &out = this->out_dist();
  // On a device (the GPU), only where the tile has no neighbours, so no strips: cuDNN pads the
  // image as the window would, without the window's copy in and the gradient's copy out (on an
  // H200, unet-small's window copies took ~4 ms of a 39 ms step). The strips' box kernels and
  // exchanges are not measured on a GPU: with neighbours the GPU keeps its windows, as do the
  // consumers of a concat's inputs (their parts are gathered on the host where a kernel does not
  // read them in place: ConvKernel::forward_parts).
  if (backend.allocator().space() != MemorySpace::host &&
      (in.grid.h != 1 || in.grid.w != 1 || this->concat_taken()))
    return false;
  // More than 16 channels, not a multiple of 16: a padded 16-channel block is the fast layout
  // for some of them (Winograd, bf16: bind_kernel), which the window may pad and a windowless
  // tile may not (its gradient is a tile of the strips' exchanges): they keep the window. (A
  // concat's inputs are computed windowless only by kernels that read NCHW: below.)
  if (!this->concat_taken() && in.global.c > kBlock && in.global.c % kBlock != 0) return false;
  if (in.global.h != out.global.h || in.global.w != out.global.w) return false;
  // A concat's inputs where the kernel reads them as they lie (and never with an input
  // activation: the concat, not this layer, is the activation's consumer).
  if (this->concat_taken() &&
      (this->input_activation_offered() ||
       !backend.conv_takes_parts<T>(layer_shapes(in.global, out.global, spec_.bias), padded_)))
    return false;
  // Decided from every rank's tiles, so the same on every rank: the exchanges differ.
  const WindowMap map = *this->window();
  for (int a = 0; a < in.grid.h; ++a)
    for (int b = 0; b < in.grid.w; ++b)
      if (!(in.tile_of(a, b) == out.tile_of(a, b)) || !border_boxes(in, out, map, a, b))
        return false;
  return true;
}

template <typename T>
bool Conv2d<T>::plan_strips(const Shape4& x, const Shape4& y, Layout x_layout, Layout y_layout,
                            const Backend& backend) {
  strips_.clear();
  const Distribution &in = this->in_dist(), &out = this->out_dist();
  const WindowMap map = *this->window();
  const int me = in.me.i * in.grid.w + in.me.j;
  // Every rank's tile, and per side every rank's strip and its footprint.
  std::vector<Box> owned;
  std::array<std::vector<Box>, 4> boxes, footprints;
  for (int a = 0; a < in.grid.h; ++a)
    for (int b = 0; b < in.grid.w; ++b) {
      owned.push_back(in.tile_of(a, b));
      const std::array<Box, 4> sides = *border_boxes(in, out, map, a, b);
      for (std::size_t s = 0; s < sides.size(); ++s) {
        boxes[s].push_back(sides[s]);
        footprints[s].push_back(sides[s].empty() ? Box{}
                                                 : Box{map.rows(sides[s].h), map.cols(sides[s].w)});
      }
    }
  const Box tile = out.tile();
  // x's channels, or those of each of a concat's inputs.
  std::vector<std::int64_t> channels{x.c};
  firsts_ = {0};
  if (this->concat_taken()) {
    channels.clear();
    firsts_.clear();
    for (std::size_t k = 0; k < this->concat_inputs().size(); ++k) {
      channels.push_back(this->concat_inputs()[k].global.c);
      firsts_.push_back(this->concat_first_channel(k));
    }
  }
  for (std::size_t s = 0; s < boxes.size(); ++s) {
    if (std::all_of(boxes[s].begin(), boxes[s].end(), [](const Box& b) { return b.empty(); }))
      continue;
    const Box& box = boxes[s][static_cast<std::size_t>(me)];
    const Box& footprint = footprints[s][static_cast<std::size_t>(me)];
    HaloPlan plan = make_halo_plan(owned, footprints[s], me);
    HaloPlan others = plan;
    others.self = Box{};  // the tile's own backward-data pass has its part
    const Shape4 fs{x.n, x.c, footprint.h.size(), footprint.w.size()};
    Strip strip{.box = box,
                .footprint = footprint,
                .at = {box.h.begin - tile.h.begin, box.w.begin - tile.w.begin},
                .fill = {},
                .accumulate = {},
                // The fill writes every element but padding channels, which must read as zeros.
                .x = this->copy_target(fs, x_layout),
                .forward = nullptr,
                .backward = nullptr,
                .dy = {},
                .grad = {}};
    for (std::int64_t c : channels) {
      strip.fill.push_back(this->exchange_on(plan, x_layout, c));
      strip.accumulate.push_back(this->exchange_on(others, x_layout, c));
    }
    // The gradient of the footprint (backward-data overwrites it; empty where the strip is).
    strip.grad = Tensor<T>(fs, x_layout, uninitialized, this->allocator());
    if (!box.empty()) {
      const Shape4 bs{y.n, y.c, box.h.size(), box.w.size()};
      strip.dy = Tensor<T>(bs, y_layout, uninitialized, this->allocator());
      ConvShapes forward = layer_shapes(fs, bs, spec_.bias);
      forward.x_outer = fs;
      forward.y_outer = y;
      forward.x_layout = x_layout;
      forward.y_layout = y_layout;
      forward.y_at = strip.at;
      forward.activation = activation_;
      strip.forward = backend.conv<T>(forward, geometry_);
      // Partial footprints (the tile's own part zeroed for the filter): no doubled_parity.
      ConvShapes backward = layer_shapes(fs, bs, false);
      backward.x_layout = x_layout;
      backward.y_layout = y_layout;
      strip.backward = backend.conv<T>(backward, geometry_);
      if (!strip.forward || !strip.backward) {
        strips_.clear();
        return false;  // a strip these layouts cannot take: try the next ones
      }
    }
    strips_.push_back(std::move(strip));
  }
  return true;
}

template <typename T>
std::size_t Conv2d<T>::border_strips() const {
  return static_cast<std::size_t>(
      std::count_if(strips_.begin(), strips_.end(), [](const Strip& s) { return !s.box.empty(); }));
}

template <typename T>
DistTensor<T> Conv2d<T>::forward_windowless(const DistTensor<T>& x) {
  DistTensor<T> y(this->out_dist(), out_layout_, uninitialized, this->allocator());
  const std::span<const T> bias(std::as_const(bias_.value).span_in(this->allocator().space()));
  const bool concat = this->concat_taken();
  const DistTensor<T>* const one = &x;
  const std::span<const DistTensor<T>* const> inputs =
      concat ? this->concat_inputs_given() : std::span<const DistTensor<T>* const>(&one, 1);
  TESSERA_CHECK(inputs.size() == firsts_.size(),
                "layer '" + this->name() + "' was planned for " + std::to_string(firsts_.size()) +
                    " inputs, but forward was given " + std::to_string(inputs.size()));
  // Every rank starts its strips' exchanges in side order, and each strip's in input order: their
  // messages share the layer's tag.
  std::vector<HaloRequest<T>> requests;
  requests.reserve(strips_.size() * inputs.size());
  for (Strip& s : strips_)
    for (std::size_t k = 0; k < inputs.size(); ++k)
      requests.push_back(s.fill[k].start_fill(inputs[k]->local, s.x, firsts_[k]));
  // The whole tile while the halos travel, reading zeros where they are; then the strips again.
  if (concat)
    kernel_->forward_parts(this->keep_concat_tiles(x_layout_), weight_.value, bias, y.local);
  else
    kernel_->forward(this->keep_tile(x, x_layout_), weight_.value, bias, y.local);
  std::size_t r = 0;
  for (Strip& s : strips_) {
    for (HaloExchange<T>& fill : s.fill)
      fill.finish(requests[r++]);
    if (s.forward) s.forward->forward_box(s.x, {}, weight_.value, bias, y.local, s.at);
  }
  return y;
}

template <typename T>
bool Conv2d<T>::relu_gate_fusable() const {
  const std::optional<FusedActivation> f = this->input_activation_taken();
  return !strips_.empty() && f && f->kind == ActivationKind::relu && x_layout_ == Layout::nchw &&
         this->allocator().space() == MemorySpace::host;
}

template <typename T>
void Conv2d<T>::gate_box(const Tensor<T>& x, Tensor<T>& dx, const Box& box) const {
  const Box tile = this->in_dist().tile();
  const Shape4& s = dx.shape();
  const Box b = intersect(box, tile);
  if (b.empty()) return;
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t c = 0; c < s.c; ++c)
      for (std::int64_t i = b.h.begin; i < b.h.end; ++i) {
        const std::int64_t at =
            ((n * s.c + c) * s.h + (i - tile.h.begin)) * s.w + (b.w.begin - tile.w.begin);
        elementwise::leaky_relu_grad_from_output(x.data() + at, dx.data() + at, b.w.size(), T(0));
      }
}

template <typename T>
DistTensor<T> Conv2d<T>::backward_windowless(const DistTensor<T>& dy) {
  const bool concat = this->concat_taken();
  // The tile keep_tile kept, or the concat's inputs' tiles keep_concat_tiles kept.
  const Tensor<T>& x = this->kept_window();
  const std::vector<const Tensor<T>*> xs =
      concat ? this->kept_concat_tiles() : std::vector<const Tensor<T>*>{};
  const std::span<T> dbias = bias_.grad.span_in(this->allocator().space());
  const Box tile = this->out_dist().tile();
  // dy's strips: the outputs whose inputs include halos.
  for (Strip& s : strips_)
    if (s.backward)
      this->copies().move(planes_of(dy.local, tile), planes_of(s.dy, s.box), s.box,
                          Direction::fill);
  // The filter gradient: the tile's with zeros for the halos (unless the tile's fused backward
  // summed it, below), plus each strip's from the halos alone (its own part zeroed: the tile's
  // pass has it), dy's strip against them.
  bool tile_filtered = false;
  const auto filter = [&] {
    if (concat)
      kernel_->backward_filter_parts(xs, dy.local, weight_.grad, dbias);
    else if (!tile_filtered)
      kernel_->backward_filter(x, dy.local, weight_.grad, dbias);
    for (Strip& s : strips_) {
      if (!s.backward) continue;
      zero_box(planes_of(s.x, s.footprint), s.fill.front().plan().self);
      s.backward->backward_filter(s.x, s.dy, weight_.grad, {});
    }
  };
  if (!this->input_grad()) {
    filter();
    if (concat) this->set_concat_grads({});  // releases the kept tiles
    this->release_window();
    return {};
  }
  // dL/dx: the tile's own dy through the padded kernel, plus what the neighbours' strips give
  // this tile (their backward-data, accumulated here); this rank's strips' parts go to them. With
  // a concat, each input's gradient apart.
  std::vector<Tensor<T>> dx;
  if (!concat) {
    dx.emplace_back(this->in_dist().local_shape(), x_layout_, uninitialized, this->allocator());
    // A tile without neighbours (no strips): both passes and the fused input activation's f' at
    // once where the kernel offers that (Tessera's AMX kernels: f' applied as dx is written, no
    // pass over it after).
    if (strips_.empty() &&
        kernel_->backward_fused(x, dy.local, weight_.value, this->input_activation_taken(),
                                dx.front(), weight_.grad, dbias))
      return this->tile_grad(std::move(dx.front()), true);
  }
  if (concat) {
    for (const Distribution& d : this->concat_inputs())
      dx.emplace_back(d.local_shape(), x_layout_, uninitialized, this->allocator());
    std::vector<Tensor<T>*> parts;
    for (Tensor<T>& t : dx)
      parts.push_back(&t);
    kernel_->backward_data_parts(dy.local, weight_.value, parts);
  } else if (relu_gate_fusable()) {
    // With strips and a ReLU's f' to apply: the tile's passes and f' at once, and f' again on the
    // boxes the neighbours' strips add into (after them). f' of a ReLU is a 0/1 mask m, and
    // m(m a + b) = m a + m b: the values of f' applied to the sum (to the sign of a zero).
    tile_filtered =
        kernel_->backward_fused(x, dy.local, weight_.value, this->input_activation_taken(),
                                dx.front(), weight_.grad, dbias);
    if (!tile_filtered) kernel_->backward_data(dy.local, weight_.value, dx.front());
  } else {
    kernel_->backward_data(dy.local, weight_.value, dx.front());
  }
  std::vector<HaloRequest<T>> requests;
  requests.reserve(strips_.size() * dx.size());
  for (Strip& s : strips_) {
    if (s.backward) s.backward->backward_data(s.dy, weight_.value, s.grad);
    for (std::size_t k = 0; k < dx.size(); ++k)
      requests.push_back(s.accumulate[k].start_accumulate(s.grad, dx[k], Into::add, firsts_[k]));
  }
  filter();  // needs no halo: it overlaps the exchanges
  std::size_t r = 0;
  for (Strip& s : strips_)
    for (HaloExchange<T>& accumulate : s.accumulate)
      accumulate.finish(requests[r++]);
  if (!concat && tile_filtered) {
    // The boxes the neighbours' strips added into: an accumulate receives on its plan's send
    // boxes (this tile's part of each peer's strip footprint; HaloPlan).
    for (Strip& s : strips_)
      for (const HaloTransfer& t : s.accumulate.front().plan().send)
        gate_box(x, dx.front(), t.box);
    return this->tile_grad(std::move(dx.front()), true);
  }
  if (!concat) return this->tile_grad(std::move(dx.front()));
  this->set_concat_grads(std::move(dx));
  return {};  // backward() returns the concat's inputs' gradients
}

template <typename T>
DistTensor<T> Conv2d<T>::forward(const DistTensor<T>& x, const RunState&) {
  if (windowless_) return forward_windowless(x);
  DistTensor<T> y(this->out_dist(), out_layout_, uninitialized,
                  this->allocator());  // the kernels overwrite it
  const std::span<const T> bias(std::as_const(bias_.value).span_in(this->allocator().space()));
  if (regions_.empty()) {
    kernel_->forward(this->fill_window(x), weight_.value, bias, y.local);
    return y;
  }
  // The interior reads only the rank's own tile and the padding, in place when the exchange
  // starts: the whole tile is computed then, and the border strips, which read the halos, again
  // after them.
  HaloRequest<T> request = this->start_window(x);
  const Tensor<T>& window = this->kept_window();
  kernel_->forward(window, weight_.value, bias, y.local);
  this->finish_window(request);
  for (Region& r : regions_)
    r.kernel->forward_box(window, r.in, weight_.value, bias, y.local, r.out);
  return y;
}

template <typename T>
DistTensor<T> Conv2d<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  if (windowless_) return backward_windowless(dy);
  if (!this->input_grad()) {
    // The first layer in training: no input gradient, no exchange, only the filter gradient.
    kernel_->backward_filter(this->kept_window(), dy.local, weight_.grad,
                             bias_.grad.span_in(this->allocator().space()));
    this->release_window();
    return {};
  }
  // backward_data overwrites it.
  Tensor<T> window_grad = this->window_grad_uninitialized();
  // A window that is the tile (a 1x1 conv's) sends nothing: both passes and the fused input
  // activation's f' in one pass over the window and dy where the kernel offers that.
  if (this->window_is_tile() &&
      kernel_->backward_fused(this->kept_window(), dy.local, weight_.value,
                              this->input_activation_taken(), window_grad, weight_.grad,
                              bias_.grad.span_in(this->allocator().space())))
    return this->accumulate_window(window_grad, {}, true);
  kernel_->backward_data(dy.local, weight_.value, window_grad);
  // The filter gradient needs no halo: it overlaps the exchange.
  return this->accumulate_window(window_grad, [&] {
    kernel_->backward_filter(this->kept_window(), dy.local, weight_.grad,
                             bias_.grad.span_in(this->allocator().space()));
  });
}

template <typename T>
LayerFlops Conv2d<T>::flops() const {
  const Shape4 y = this->out_dist().local_shape();
  const Shape4& w = weight_.value.shape();
  const double forward =
      2.0 * static_cast<double>(y.numel()) * static_cast<double>(w.c * w.h * w.w);
  return {forward, this->input_grad() ? 2 * forward : forward};
}

template <typename T>
std::string Conv2d<T>::kernel_summary() const {
  if (!kernel_) return {};
  return kernel_->name() + (windowless_ ? ", windowless" : "");
}

template <typename T>
std::vector<Param<T>*> Conv2d<T>::params() {
  if (spec_.bias) return {&weight_, &bias_};
  return {&weight_};
}

template class Conv2d<float>;
template class Conv2d<double>;

}  // namespace tessera
