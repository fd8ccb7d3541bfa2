// The window machinery shared by every halo layer (conv, pooling, transposed conv, upsampling):
// from a map "output range -> input range" to the halo plan of each rank.
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessera/dist_tensor.hpp"
#include "tessera/engine/layer.hpp"
#include "tessera/halo_exchange.hpp"
#include "tessera/partition.hpp"

namespace tessera {

// The conv-like map of `a` on each axis.
WindowMap conv_window(const WindowAxis& rows, const WindowAxis& cols);

// Rank (i, j)'s plan for a layer from `in` to `out` through `map`. Local and pure: it intersects
// the rank's window with every rank's tile, O(spatial ranks).
HaloPlan window_plan(const Distribution& in, const Distribution& out, const WindowMap& map, int i,
                     int j);

// This rank's exchange on the comm's spatial group, with the backend's copies; `name` ("layer
// 'c1'") for the watchdog. Local.
template <typename T>
HaloExchange<T> window_exchange(const Distribution& in, const Distribution& out,
                                const WindowMap& map, const Comm& comm, int tag,
                                const std::string& name, const Backend& backend);

// Shape of the local window buffer: my samples and channels, the plan's window box.
Shape4 window_shape(const Distribution& in, const HaloPlan& plan);

// The outputs of `out` (a range of output rows or columns) whose inputs, through `map`, all lie
// in `ready`: a contiguous range, possibly empty (map is monotone). Local and pure.
Range outputs_reading_within(Range out, Range ready, const std::function<Range(Range)>& map);

// The rows (columns) of a window `window` that hold the rank's own tile `tile` or zero padding
// outside [0, extent), as far as they form one range with the tile: what is ready when a fill
// starts, before any halo arrives. Local and pure.
Range ready_without_halo(Range window, Range tile, std::int64_t extent);

// Setup checks with messages naming the layer (`who` = "layer 'c1' (conv2d)"):
// the input must be an image (not the N x C output of global pooling) ...
void require_spatial(const std::string& who, const Distribution& in);
// ... and the output must leave every spatial rank at least one row and one column.
void require_tiles(const std::string& who, const Distribution& out);

// A halo layer with one input. It owns what every such layer repeats: the distributions setup()
// records, the exchange bind() builds from window(), and the forward window kept for backward.
// A derived layer keeps its spec, kernel geometry and parameters; its setup() records the
// distributions through set_distributions, its forward and backward wrap their kernels in
// fill_window and accumulate_window.
template <typename T>
class WindowLayer : public UnaryLayer<T> {
 public:
  // Builds this rank's exchange from window() and the distributions of the last setup(), then
  // hands the window box to bind_kernel. Local.
  void bind(const Runtime& runtime) final;
  // Takes f' from the backend's activation when that works from f's output: accumulate_window
  // then applies it to the window's gradient (Layer::offer_input_activation_grad). Local.
  void offer_input_activation_grad(const FusedActivation& f) final { input_activation_ = f; }
  bool input_activation_grad_fused() const final { return input_activation_grad_ != nullptr; }
  // Keeps x as the window where fill_window computed from it in place. Local.
  void take_input(DistTensor<T>&& x) final;
  // A concat's inputs (Layer::offer_concat), taken where the layer reads its input only through
  // its window (reads_input_through_window), the backend's halo copies take channel slices, and
  // each input's channels start at a multiple of 16 (a block of every layout): each input then
  // has an exchange of its own, made at bind(), which fills its channels of the window and
  // returns their gradient. Call after setup(). Local.
  bool offer_concat(std::vector<Distribution> inputs, const Backend& backend) final;
  bool concat_taken() const final { return !taken_.empty(); }
  // Keeps input k where keep_concat_tiles read it in place. Local.
  void take_concat_input(std::size_t k, DistTensor<T>&& x) final;
  // With a concat taken, the concat's inputs (and one gradient for each); else as UnaryLayer.
  // Neighbour-wise collective over the spatial communicator.
  DistTensor<T> forward(std::span<const DistTensor<T>* const> inputs, const RunState& state) final;
  std::vector<DistTensor<T>> backward(const DistTensor<T>& dy, const RunState& state) final;
  using UnaryLayer<T>::forward;
  // Pure in the spec: `tessera plan` asks for it after setup() alone, with no grid bound.
  std::optional<WindowMap> window() const override = 0;

 protected:
  // `tag` keeps this layer's halo messages apart from other exchanges in flight.
  WindowLayer(std::string name, int tag);

  // For setup(): records `in` and the distribution of shape `out` over the same grid, once
  // require_tiles(who, ...) has accepted it; returns the latter. Local; throws an Error.
  const Distribution& set_distributions(const std::string& who, const Distribution& in,
                                        const Shape4& out);
  const Distribution& in_dist() const { return in_; }
  const Distribution& out_dist() const { return out_; }

  // For layers whose kernel geometry depends on where this rank's window lies (global input
  // coordinates, not clipped to the image); plans its kernels with `backend`. Local.
  virtual void bind_kernel(const Box& /*window*/, const Backend& /*backend*/) {}
  // Whether forward(x) reads x only through fill_window or start_window and backward_one returns
  // what accumulate_window returns: such a layer can take a concat's inputs (offer_concat), its
  // forward(x) then being given the first of them as x. Local.
  virtual bool reads_input_through_window() const { return false; }
  // Whether backward reads the window forward filled (the filter gradient does; pooling keeps
  // what it needs, upsampling needs nothing): a layer whose backward does not, and that applies
  // no f' from it, computes from its input in place where the window is the tile, keeping
  // nothing. Local.
  virtual bool backward_reads_window() const { return true; }
  // Whether convolutions compute their tile while halos travel and then recompute the border
  // strips that read them (Runtime::overlap). Valid after bind(). Local.
  bool overlap() const { return overlap_; }
  // Whether the run asks for windowless layers where they fit (Runtime::windowless). Valid in
  // bind_kernel. Local.
  bool windowless_wanted() const { return windowless_wanted_; }

  // Allocates the window, fills it from x's tiles (zeros outside the image) and keeps it until
  // the next forward; where the window is x's tile in x's layout, returns x itself, kept from
  // take_input where the model hands x over and backward reads the window. Neighbour-wise
  // collective over the spatial communicator.
  const Tensor<T>& fill_window(const DistTensor<T>& x);
  // fill_window in two phases: when start_window returns, the window holds the rank's own tile
  // and the zero padding (the box of ready_without_halo on each axis); finish_window waits for
  // the halos. Neighbour-wise collective over the spatial communicator.
  HaloRequest<T> start_window(const DistTensor<T>& x);
  const Tensor<T>& finish_window(HaloRequest<T>& request);
  // This rank's plan; valid after bind(). Local.
  const HaloPlan& plan() const { return exchange_->plan(); }
  // Whether the window is the rank's own tile: nothing to receive or send (a 1x1 conv's, a pool's
  // whose windows tile the image on an even split). Valid after bind(). Local.
  bool window_is_tile() const { return window_is_tile_; }
  // The layout the exchange assembles the window in, and takes its gradient in (default NCHW);
  // for bind_kernel. Local.
  void set_window_layout(Layout layout) { exchange_->set_window_layout(layout); }
  // What the window holds outside the image (default 0); for bind_kernel. Local.
  void set_window_padding(T value) { exchange_->set_window_padding(value); }
  // The window the last fill_window filled (backward-filter reads it). Local.
  const Tensor<T>& kept_window() const { return window_; }
  // Frees the kept window once backward is done with it (accumulate_window does, as its last
  // step): one backward per forward, and the memory goes back as the backward pass proceeds,
  // as PyTorch frees saved tensors. The next forward allocates it again. Local.
  void release_window() { window_ = Tensor<T>(); }

  // A buffer that copies fill (a window, a kept tile, a strip): uninitialised, but its padding
  // channels zero where `layout` pads `shape`'s (no copy writes them, kernels read them). Local.
  Tensor<T> copy_target(const Shape4& shape, Layout layout) const;
  // A zero gradient shaped like the window (with the storage of its layout), for backward-data
  // to add into; or one for a kernel that overwrites it. Local.
  Tensor<T> window_grad_zeros() const;
  Tensor<T> window_grad_uninitialized() const;
  // Returns dL/dx: `grad` (shaped like the window) added into the tiles that own it; with a fused
  // input activation, `grad` is first multiplied by its f' in place. Releases the kept window;
  // may take `grad` over (then empty) when the window is the tile.
  // `overlap` is local work needing no halo (backward-filter): it runs while the exchange is in
  // flight. `activated`: f' was applied already (ConvKernel::backward_fused). Neighbour-wise
  // collective over the spatial communicator.
  DistTensor<T> accumulate_window(Tensor<T>& grad, const std::function<void()>& overlap = {},
                                  bool activated = false);
  // The fused input activation whose f' accumulate_window applies, if one was taken. Local.
  std::optional<FusedActivation> input_activation_taken() const {
    return input_activation_grad_ ? input_activation_ : std::nullopt;
  }

  // For a layer that computes without a window (Conv2d's windowless convolutions), from bind_kernel
  // on: another exchange of this layer's (its communicator, tag, name and the backend's copies) on
  // `plan`, its window in `layout`, for tiles of `channels` channels (0: the input's); several may
  // be in flight together when every rank starts them in the same order (messages between two
  // ranks arrive in the order sent). Local.
  HaloExchange<T> exchange_on(HaloPlan plan, Layout layout, std::int64_t channels = 0) const;
  // The backend's halo copies (box copies and layout conversions), from bind_kernel on. Local.
  const HaloCopyKernel<T>& copies() const { return *copies_; }
  // A windowless forward's input: x's tile in `layout`, kept for backward (kept_window()) — x
  // itself where it lies so and the model hands it over (take_input), else a copy. Local.
  const Tensor<T>& keep_tile(const DistTensor<T>& x, Layout layout);
  // A windowless backward's result: dL/dx from `dx` (shaped like x's tile, in keep_tile's
  // layout): multiplied by the fused input activation's f' (read from the kept tile) unless
  // `activated` (ConvKernel::backward_fused applied it), then in the layout x came in. Releases
  // the kept tile. Local.
  DistTensor<T> tile_grad(Tensor<T>&& dx, bool activated = false);
  // The same with a concat taken (concat_inputs): the inputs forward was given, valid during
  // forward (their channels start at concat_first_channel); their tiles in `layout`, kept for
  // backward (kept_concat_tiles) — each input itself where it lies so and the model hands it over
  // (take_concat_input), else a copy; and dL/d(input k) from dx[k] (in keep_concat_tiles' layout),
  // in the layout input k came in, for backward() to return, releasing the kept tiles (no dx:
  // only the release, where no input gradient is asked for). A fused
  // input activation is never taken with a concat (the concat is the activation's consumer).
  // Local.
  const std::vector<Distribution>& concat_inputs() const { return taken_; }
  std::int64_t concat_first_channel(std::size_t k) const;
  std::span<const DistTensor<T>* const> concat_inputs_given() const { return part_inputs_; }
  std::vector<const Tensor<T>*> keep_concat_tiles(Layout layout);
  std::vector<const Tensor<T>*> kept_concat_tiles() const;
  void set_concat_grads(std::vector<Tensor<T>>&& dx);
  // Whether an input activation was offered (offer_input_activation_grad); from bind_kernel on.
  bool input_activation_offered() const { return input_activation_.has_value(); }

 private:
  int tag_;
  bool overlap_ = true;
  bool windowless_wanted_ = true;
  Distribution in_, out_;
  std::optional<HaloExchange<T>> exchange_;
  // bind()'s, for exchange_on and keep_tile.
  const Comm* comm_ = nullptr;
  const Backend* backend_ = nullptr;
  std::unique_ptr<HaloCopyKernel<T>> copies_;
  Tensor<T> window_;
  bool window_is_tile_ = false;  // bind()'s plan: window_is_tile()
  bool adopting_ = false;  // the last fill_window returned x: take_input keeps it as the window
  Layout in_layout_ = Layout::nchw;                             // of the last forward's x
  std::optional<FusedActivation> input_activation_;             // offered
  std::unique_ptr<ActivationKernel<T>> input_activation_grad_;  // taken: its f' from the window
  // A concat's inputs: taken, and at bind() (each with its channels' exchange on the plan of
  // exchange_, and the layout its gradient lies in: that of the last forward's input).
  struct Part {
    Distribution dist;
    std::int64_t first_channel;
    HaloExchange<T> exchange;
    Layout layout = Layout::nchw;
  };
  std::vector<Distribution> taken_;
  std::vector<Part> parts_;
  std::span<const DistTensor<T>* const> part_inputs_;  // during forward
  std::vector<HaloRequest<T>> part_requests_;          // between start_window and finish_window
  std::vector<DistTensor<T>> part_grads_;              // accumulate_window's, for backward
  // keep_tile's and keep_concat_tiles': x's tile in `layout` kept in `kept` for backward — a
  // copy, or, where x lies so and is `handed` over, nothing yet (returns true: the model then
  // moves x in; the forward reads x itself).
  bool keep(const DistTensor<T>& x, Layout layout, bool handed, Tensor<T>& kept);
  // `t`, a tile of `dist`, as a DistTensor in `layout` (moved where it lies so, else converted).
  DistTensor<T> in_layout(Tensor<T>&& t, const Distribution& dist, Layout layout) const;
  // keep_concat_tiles': a tile kept for each input (empty where `part_kept_` says it reads the
  // input itself, which take_concat_input then moves in).
  std::vector<Tensor<T>> part_tiles_;
  std::vector<bool> part_kept_;
  std::vector<Layout> part_layouts_;  // the layouts the inputs came in
};

}  // namespace tessera
