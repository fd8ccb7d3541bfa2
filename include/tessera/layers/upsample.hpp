// Distributed nearest-neighbour upsampling by an integer factor. Output tiles are partitioned
// afresh over the output extent, so a rank's outputs may read inputs another rank owns: it is a
// halo layer (fill the input window, upsample locally, accumulate window gradients back).
#pragma once

#include <optional>

#include "tessera/kernels/reference_upsample.hpp"
#include "tessera/layers/fields.hpp"
#include "tessera/layers/window.hpp"

namespace tessera {

// PyTorch's Upsample(scale_factor=scale, mode="nearest"): output q reads input floor(q / scale).
struct UpsampleSpec {
  std::int64_t scale = 1;
};

// Type upsample_nearest. Field: scale (required, an integer >= 1). Local; throws an Error naming
// the layer and the field.
UpsampleSpec parse_upsample(const LayerSpec& spec);

// The input rows [floor(qb / scale), floor((qe - 1) / scale) + 1) that output rows [qb, qe) read,
// on both axes. Local and pure.
WindowMap upsample_window(std::int64_t scale);

template <typename T>
class UpsampleNearest final : public WindowLayer<T> {
 public:
  UpsampleNearest(std::string name, const UpsampleSpec& spec, int tag);

  using WindowLayer<T>::setup;
  Distribution setup(const Distribution& in) override;
  // forward and backward: neighbour-wise collective over the spatial communicator (halos).
  using WindowLayer<T>::forward;
  DistTensor<T> forward(const DistTensor<T>& x, const RunState&) override;
  DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState&) override;
  std::optional<WindowMap> window() const override { return upsample_window(spec_.scale); }
  // Any input layout (the exchange converts into the window's); the output is nchw16c where the
  // model allows it and the kernel takes it, else NCHW, and then the window is blocked where the
  // input is expected blocked and the kernel converts as it widens
  // (UpsampleKernel::converts_blocked_to_nchw): no conversion pass either way.
  bool takes_blocked() const override { return true; }
  // An even scale repeats each input value over blocks of scale x scale from even rows and columns.
  bool output_doubled() const override { return spec_.scale % 2 == 0; }

 private:
  void bind_kernel(const Box& window, const Backend& backend) override;
  bool backward_reads_window() const override { return false; }
  UpsampleSpec spec_;
  reference::UpsampleGeometry geometry_;
  std::unique_ptr<UpsampleKernel<T>> kernel_;
  Layout layout_ = Layout::nchw;  // of the output and its gradient: bind_kernel's
};

}  // namespace tessera
