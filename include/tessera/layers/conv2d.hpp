// Distributed 2-D convolution: fills its input window from the neighbours, convolves locally,
// and in the backward pass accumulates window gradients back into their owners.
#pragma once

#include <memory>
#include <optional>

#include "tessera/halo_exchange.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/layer.hpp"
#include "tessera/model_spec.hpp"
#include "tessera/partition.hpp"

namespace tessera {

template <typename T>
class Conv2d final : public Layer<T> {
 public:
  Conv2d(std::string name, const Conv2dSpec& spec, int tag);

  Distribution setup(const Distribution& in, const ProcessGrid& grid) override;
  DistTensor<T> forward(const DistTensor<T>& x) override;
  DistTensor<T> backward(const DistTensor<T>& dy) override;
  std::vector<Param<T>*> params() override;

  const HaloPlan& plan() const { return exchange_->plan(); }
  WindowAxis axis(int a) const;  // 0: rows, 1: columns

 private:
  Conv2dSpec spec_;
  int tag_;
  Distribution in_, out_;
  std::optional<HaloExchange<T>> exchange_;
  reference::ConvGeometry geometry_;
  Param<T> weight_, bias_;
  Tensor<T> window_;  // the forward input window, kept for backward-filter
};

}  // namespace tessera
