// ReLU: pointwise, so no halo. Local.
#pragma once

#include "tessera/layer.hpp"

namespace tessera {

template <typename T>
class Relu final : public Layer<T> {
 public:
  using Layer<T>::Layer;
  Distribution setup(const Distribution& in, const ProcessGrid&) override { return in; }
  DistTensor<T> forward(const DistTensor<T>& x) override;
  DistTensor<T> backward(const DistTensor<T>& dy) override;

 private:
  DistTensor<T> y_;
};

}  // namespace tessera
