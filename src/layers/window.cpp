#include "tessera/layers/window.hpp"

#include <utility>

#include "tessera/error.hpp"
#include "tessera/partition.hpp"

namespace tessera {

WindowMap conv_window(const WindowAxis& rows, const WindowAxis& cols) {
  return {[rows](Range r) { return input_window(r, rows); },
          [cols](Range r) { return input_window(r, cols); }};
}

HaloPlan window_plan(const Distribution& in, const Distribution& out, const WindowMap& map, int i,
                     int j) {
  std::vector<Box> owned, windows;
  for (int a = 0; a < in.grid.h; ++a)
    for (int b = 0; b < in.grid.w; ++b) {
      owned.push_back(in.tile_of(a, b));
      const Box t = out.tile_of(a, b);
      windows.push_back({map.rows(t.h), map.cols(t.w)});
    }
  return make_halo_plan(owned, windows, i * in.grid.w + j);
}

template <typename T>
HaloExchange<T> window_exchange(const Distribution& in, const Distribution& out,
                                const WindowMap& map, const Comm& comm, int tag,
                                const std::string& name, const Backend& backend) {
  const Shape4 l = in.local_shape();
  return HaloExchange<T>(window_plan(in, out, map, in.me.i, in.me.j), comm, tag, name, l.n * l.c,
                         backend.halo_copy<T>(), &backend.allocator());
}

Shape4 window_shape(const Distribution& in, const HaloPlan& plan) {
  const Shape4 l = in.local_shape();
  return {l.n, l.c, plan.window.h.size(), plan.window.w.size()};
}

Range outputs_reading_within(Range out, Range ready, const std::function<Range(Range)>& map) {
  Range r{out.end, out.end};
  for (std::int64_t o = out.begin; o < out.end; ++o) {
    const Range in = map({o, o + 1});
    if (in.begin >= ready.begin && in.end <= ready.end) {
      if (r.begin == out.end) r.begin = o;
      r.end = o + 1;
    }
  }
  if (r.begin == out.end) return {out.begin, out.begin};
  return r;
}

Range ready_without_halo(Range window, Range tile, std::int64_t extent) {
  // Rows before the tile inside the image come from peers; rows before row 0 are padding.
  const std::int64_t begin =
      window.begin < tile.begin && tile.begin > 0 ? tile.begin : window.begin;
  const std::int64_t end = window.end > tile.end && tile.end < extent ? tile.end : window.end;
  return {begin, end};
}

void require_spatial(const std::string& who, const Distribution& in) {
  TESSERA_CHECK(!in.replicated, who + ": its input is " + std::to_string(in.global.n) + "x" +
                                    std::to_string(in.global.c) +
                                    " (after global pooling), but the layer needs an image");
}

void require_tiles(const std::string& who, const Distribution& out) {
  const std::int64_t h = out.global.h, w = out.global.w;
  check_splittable(who + ": its " + std::to_string(h) + "x" + std::to_string(w) + " output", h, w,
                   out.grid.h, out.grid.w);
}

template <typename T>
WindowLayer<T>::WindowLayer(std::string name, int tag)
    : UnaryLayer<T>(std::move(name)), tag_(tag) {}

template <typename T>
const Distribution& WindowLayer<T>::set_distributions(const std::string& who,
                                                      const Distribution& in, const Shape4& out) {
  Distribution d = in.with_shape(out);
  require_tiles(who, d);
  in_ = in;
  out_ = std::move(d);
  return out_;
}

template <typename T>
void WindowLayer<T>::bind(const Runtime& runtime) {
  overlap_ = runtime.overlap();
  windowless_wanted_ = runtime.windowless();
  comm_ = &runtime.comm();
  backend_ = &runtime.backend();
  copies_ = backend_->halo_copy<T>();
  exchange_.emplace(window_exchange<T>(in_, out_, *this->window(), runtime.comm(), tag_,
                                       "layer '" + this->name() + "'", runtime.backend()));
  const HaloPlan& plan = exchange_->plan();
  window_is_tile_ = plan.window == plan.owned && plan.send.empty() && plan.recv.empty();
  bind_kernel(plan.window, runtime.backend());
  parts_.clear();
  std::int64_t channels = 0;
  for (const Distribution& d : taken_) {
    // The same tiles and window as exchange_'s (only the channels differ), the same tag.
    parts_.push_back(
        {.dist = d,
         .first_channel = channels,
         .exchange = window_exchange<T>(d, out_, *this->window(), runtime.comm(), tag_,
                                        "layer '" + this->name() + "'", runtime.backend()),
         .layout = Layout::nchw});
    parts_.back().exchange.set_window_layout(exchange_->window_layout());
    parts_.back().exchange.set_window_padding(exchange_->window_padding());
    channels += d.global.c;
  }
  input_activation_grad_.reset();
  if (input_activation_) {
    input_activation_grad_ =
        runtime.backend().activation<T>(input_activation_->kind, input_activation_->slope);
    if (!input_activation_grad_->works_from_output()) input_activation_grad_.reset();
  }
}

template <typename T>
bool WindowLayer<T>::offer_concat(std::vector<Distribution> inputs, const Backend& backend) {
  taken_.clear();
  if (!reads_input_through_window() || !backend.halo_copy<T>()->takes_channel_slices())
    return false;
  // Each input starts on a 16-channel block, whatever layout the window takes: the window's
  // layout may differ between ranks (it is planned for each rank's window box), and every rank
  // must take the concat or none, since the messages differ.
  std::int64_t channels = 0;
  for (const Distribution& d : inputs) {
    if (channels % kBlock != 0) return false;
    channels += d.global.c;
  }
  if (channels != in_.global.c) return false;
  taken_ = std::move(inputs);
  return true;
}

template <typename T>
const Tensor<T>& WindowLayer<T>::fill_window(const DistTensor<T>& x) {
  // A window that is the tile itself, in x's layout with no padding channels, is x: the kernel
  // reads x, and the layer keeps x instead of a copy where the model hands it over (take_input),
  // or keeps nothing where its backward does not read the window.
  const bool tile = parts_.empty() && window_is_tile_ && x.layout() == exchange_->window_layout() &&
                    x.local.shape() == window_shape(in_, exchange_->plan()) &&
                    storage_size(x.local.shape(), x.layout()) == x.local.numel();
  const bool in_place = tile && !backward_reads_window() && !input_activation_grad_;
  adopting_ = tile && !in_place && this->input_handed_over();
  if (in_place || adopting_) {
    window_ = Tensor<T>();
    in_layout_ = x.layout();
    return x.local;
  }
  HaloRequest<T> request = start_window(x);
  return finish_window(request);
}

template <typename T>
void WindowLayer<T>::take_input(DistTensor<T>&& x) {
  if (adopting_) window_ = std::move(x.local);
  adopting_ = false;
}

template <typename T>
HaloRequest<T> WindowLayer<T>::start_window(const DistTensor<T>& x) {
  adopting_ = false;
  // The exchange writes every element: the tiles' values and the padding value outside the image.
  // The buffer is reused from forward to forward unless a backward released it.
  const Shape4 shape = window_shape(in_, exchange_->plan());
  const Layout layout = exchange_->window_layout();
  if (window_.shape() != shape || window_.layout() != layout) {
    window_ = copy_target(shape, layout);
    // A conv computes from the halo part before the halos arrive (and then recomputes what read
    // it): zeros there, never indeterminate values.
    if (storage_size(shape, layout) == shape.numel() && overlap_ && !exchange_->plan().recv.empty())
      exchange_->clear_halos(window_);
  }
  in_layout_ = x.layout();
  if (parts_.empty()) return exchange_->start_fill(x.local, window_);
  TESSERA_CHECK(part_inputs_.size() == parts_.size(),
                "layer '" + this->name() + "' took a concat of " + std::to_string(parts_.size()) +
                    " inputs, but forward was given " + std::to_string(part_inputs_.size()));
  part_requests_.clear();
  for (std::size_t k = 0; k < parts_.size(); ++k) {
    parts_[k].layout = part_inputs_[k]->layout();
    part_requests_.push_back(
        parts_[k].exchange.start_fill(part_inputs_[k]->local, window_, parts_[k].first_channel));
  }
  return {};  // the parts' requests are kept here
}

template <typename T>
const Tensor<T>& WindowLayer<T>::finish_window(HaloRequest<T>& request) {
  if (parts_.empty()) {
    exchange_->finish(request);
    return window_;
  }
  for (std::size_t k = 0; k < parts_.size(); ++k)
    parts_[k].exchange.finish(part_requests_[k]);
  part_requests_.clear();
  return window_;
}

template <typename T>
DistTensor<T> WindowLayer<T>::forward(std::span<const DistTensor<T>* const> inputs,
                                      const RunState& state) {
  if (parts_.empty()) return UnaryLayer<T>::forward(inputs, state);
  part_inputs_ = inputs;
  DistTensor<T> y = this->forward(*inputs[0], state);  // its window from part_inputs_
  part_inputs_ = {};
  return y;
}

template <typename T>
std::vector<DistTensor<T>> WindowLayer<T>::backward(const DistTensor<T>& dy,
                                                    const RunState& state) {
  std::vector<DistTensor<T>> grads = UnaryLayer<T>::backward(dy, state);
  if (parts_.empty()) return grads;
  return std::exchange(part_grads_, {});  // accumulate_window's, one per input
}

template <typename T>
Tensor<T> WindowLayer<T>::copy_target(const Shape4& shape, Layout layout) const {
  if (storage_size(shape, layout) != shape.numel())
    return Tensor<T>(shape, layout, this->allocator());
  return Tensor<T>(shape, layout, uninitialized, this->allocator());
}

template <typename T>
Tensor<T> WindowLayer<T>::window_grad_zeros() const {
  return Tensor<T>(window_shape(in_, exchange_->plan()), exchange_->window_layout(),
                   this->allocator());
}

template <typename T>
Tensor<T> WindowLayer<T>::window_grad_uninitialized() const {
  return Tensor<T>(window_shape(in_, exchange_->plan()), exchange_->window_layout(), uninitialized,
                   this->allocator());
}

template <typename T>
DistTensor<T> WindowLayer<T>::accumulate_window(Tensor<T>& grad,
                                                const std::function<void()>& overlap,
                                                bool activated) {
  // The window holds f(x) wherever the image is (the padding's gradient is dropped anyway), and
  // f' applies to each contribution to an element as well as to their sum (to rounding, for
  // leaky ReLU's slope, where halos add up).
  if (input_activation_grad_ && !activated)
    input_activation_grad_->backward_from_output(window_, grad);
  // A concat's inputs: each input's gradient from its channels of the window's.
  if (!parts_.empty()) {
    part_grads_.clear();
    std::vector<HaloRequest<T>> requests;
    for (Part& part : parts_) {
      part_grads_.emplace_back(part.dist, part.layout, uninitialized, this->allocator());
      requests.push_back(part.exchange.start_accumulate(grad, part_grads_.back().local,
                                                        Into::overwrite, part.first_channel));
    }
    if (overlap) overlap();
    for (std::size_t k = 0; k < parts_.size(); ++k)
      parts_[k].exchange.finish(requests[k]);
    release_window();
    return {};  // backward() returns part_grads_
  }
  // A window that is the tile itself (a 1x1 conv's: it receives nothing) in x's layout, with
  // nothing to send, is dL/dx as it is: taken over, with no copy and no second buffer.
  if (window_is_tile_ && grad.layout() == in_layout_) {
    if (overlap) overlap();
    release_window();
    DistTensor<T> dx;
    dx.dist = in_;
    dx.local = std::move(grad);
    return dx;
  }
  // dL/dx lies as x did; the exchange writes all of it.
  DistTensor<T> dx(in_, in_layout_, uninitialized, this->allocator());
  auto request = exchange_->start_accumulate(grad, dx.local, Into::overwrite);
  if (overlap) overlap();
  exchange_->finish(request);
  release_window();
  return dx;
}

template <typename T>
HaloExchange<T> WindowLayer<T>::exchange_on(HaloPlan plan, Layout layout,
                                            std::int64_t channels) const {
  const Shape4 l = in_.local_shape();
  HaloExchange<T> e(std::move(plan), *comm_, tag_, "layer '" + this->name() + "'",
                    l.n * (channels > 0 ? channels : l.c), backend_->halo_copy<T>(),
                    &backend_->allocator());
  e.set_window_layout(layout);
  return e;
}

template <typename T>
bool WindowLayer<T>::keep(const DistTensor<T>& x, Layout layout, bool handed, Tensor<T>& kept) {
  const Shape4& shape = x.local.shape();
  if (handed && x.layout() == layout && storage_size(shape, layout) == x.local.numel()) {
    kept = Tensor<T>();
    return true;
  }
  if (kept.shape() != shape || kept.layout() != layout) kept = copy_target(shape, layout);
  const Box tile = x.dist.tile();
  copies_->move(planes_of(x.local, tile), planes_of(kept, tile), tile, Direction::fill);
  return false;
}

template <typename T>
DistTensor<T> WindowLayer<T>::in_layout(Tensor<T>&& t, const Distribution& dist,
                                        Layout layout) const {
  if (t.layout() == layout) {
    DistTensor<T> out;
    out.dist = dist;
    out.local = std::move(t);
    return out;
  }
  DistTensor<T> out(dist, layout, uninitialized, this->allocator());
  const Box tile = dist.tile();
  copies_->move(planes_of(std::as_const(t), tile), planes_of(out.local, tile), tile,
                Direction::fill);
  return out;
}

template <typename T>
const Tensor<T>& WindowLayer<T>::keep_tile(const DistTensor<T>& x, Layout layout) {
  in_layout_ = x.layout();
  adopting_ = keep(x, layout, this->input_handed_over(), window_);
  return adopting_ ? x.local : window_;
}

template <typename T>
DistTensor<T> WindowLayer<T>::tile_grad(Tensor<T>&& dx, bool activated) {
  if (input_activation_grad_ && !activated)
    input_activation_grad_->backward_from_output(window_, dx);
  release_window();
  return in_layout(std::move(dx), in_, in_layout_);
}

template <typename T>
std::int64_t WindowLayer<T>::concat_first_channel(std::size_t k) const {
  std::int64_t first = 0;
  for (std::size_t j = 0; j < k; ++j)
    first += taken_[j].global.c;
  return first;
}

template <typename T>
std::vector<const Tensor<T>*> WindowLayer<T>::keep_concat_tiles(Layout layout) {
  const std::size_t parts = part_inputs_.size();
  TESSERA_CHECK(parts == taken_.size(),
                "layer '" + this->name() + "' took a concat of " + std::to_string(taken_.size()) +
                    " inputs, but forward was given " + std::to_string(parts));
  part_tiles_.resize(parts);
  part_kept_.assign(parts, false);
  part_layouts_.resize(parts);
  std::vector<const Tensor<T>*> tiles;
  for (std::size_t k = 0; k < parts; ++k) {
    const DistTensor<T>& x = *part_inputs_[k];
    part_layouts_[k] = x.layout();
    part_kept_[k] = keep(x, layout, this->concat_input_handed_over(k), part_tiles_[k]);
    tiles.push_back(part_kept_[k] ? &x.local : &part_tiles_[k]);
  }
  return tiles;
}

template <typename T>
void WindowLayer<T>::take_concat_input(std::size_t k, DistTensor<T>&& x) {
  if (k < part_kept_.size() && part_kept_[k]) part_tiles_[k] = std::move(x.local);
}

template <typename T>
std::vector<const Tensor<T>*> WindowLayer<T>::kept_concat_tiles() const {
  std::vector<const Tensor<T>*> tiles;
  for (const Tensor<T>& t : part_tiles_)
    tiles.push_back(&t);
  return tiles;
}

template <typename T>
void WindowLayer<T>::set_concat_grads(std::vector<Tensor<T>>&& dx) {
  part_grads_.clear();
  if (dx.empty()) {  // no input gradient asked for: only the release
    part_tiles_.clear();
    part_kept_.clear();
    return;
  }
  TESSERA_CHECK(dx.size() == taken_.size() && part_layouts_.size() == taken_.size(),
                "layer '" + this->name() + "': " + std::to_string(dx.size()) +
                    " input gradients for a concat of " + std::to_string(taken_.size()));
  for (std::size_t k = 0; k < dx.size(); ++k)
    part_grads_.push_back(in_layout(std::move(dx[k]), taken_[k], part_layouts_[k]));
  part_tiles_.clear();  // released, as release_window does
  part_kept_.clear();
}

template HaloExchange<float> window_exchange(const Distribution&, const Distribution&,
                                             const WindowMap&, const Comm&, int, const std::string&,
                                             const Backend&);
template HaloExchange<double> window_exchange(const Distribution&, const Distribution&,
                                              const WindowMap&, const Comm&, int,
                                              const std::string&, const Backend&);
template class WindowLayer<float>;
template class WindowLayer<double>;

}  // namespace tessera
