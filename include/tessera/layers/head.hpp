// The classification head: global average pooling (N x C x H x W -> N x C, summed over the
// spatial ranks and then replicated on each of them) and fully connected layers on the
// replicated vectors.
#pragma once

#include "tessera/engine/layer.hpp"
#include "tessera/layers/fields.hpp"

namespace tessera {

// Type global_avgpool; no fields.
void parse_global_avgpool(const LayerSpec& spec);

// Averages each channel over the whole image. Forward: collective over the spatial group;
// backward: local.
template <typename T>
class GlobalAvgPool final : public UnaryLayer<T> {
 public:
  using UnaryLayer<T>::UnaryLayer;
  using UnaryLayer<T>::setup;
  Distribution setup(const Distribution& in) override;
  // Takes the Comm its sums are reduced over and the backend's kernel. Local.
  void bind(const Runtime& runtime) override {
    comm_ = &runtime.comm();
    kernel_ = runtime.backend().spatial_sum<T>();
  }
  using UnaryLayer<T>::forward;
  DistTensor<T> forward(const DistTensor<T>& x, const RunState&) override;
  DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState&) override;

 private:
  Distribution in_, out_;
  const Comm* comm_ = nullptr;
  std::unique_ptr<SpatialSumKernel<T>> kernel_;
};

struct LinearSpec {
  std::int64_t out_features = 0;
  bool bias = true;
};

// Type linear: out_features, bias=true.
LinearSpec parse_linear(const LayerSpec& spec);

// y = x w^T + b on the replicated N x C vectors; every spatial rank computes the same y. Only
// the first spatial rank of each sample group adds to the weight gradients, so the sum over all
// ranks counts each sample once. Local.
template <typename T>
class Linear final : public UnaryLayer<T> {
 public:
  Linear(std::string name, const LinearSpec& spec) : UnaryLayer<T>(std::move(name)), spec_(spec) {}
  using UnaryLayer<T>::setup;
  Distribution setup(const Distribution& in) override;
  using UnaryLayer<T>::forward;
  DistTensor<T> forward(const DistTensor<T>& x, const RunState&) override;
  DistTensor<T> backward_one(const DistTensor<T>& dy, const RunState&) override;
  std::vector<Param<T>*> params() override;
  // Takes the backend's linear kernel for this layer's sizes. Local.
  void bind(const Runtime& runtime) override {
    kernel_ = runtime.backend().linear<T>(in_.global.c, spec_.out_features);
  }

 private:
  LinearSpec spec_;
  Distribution in_, out_;
  Param<T> weight_, bias_;
  Tensor<T> x_;
  std::unique_ptr<LinearKernel<T>> kernel_;
};

}  // namespace tessera
