// Layers that join branches (skip connections): concat along channels and elementwise add. Their
// inputs share a distribution (same N, H, W, so the same tiles), so both are local.
#pragma once

#include "tessera/engine/layer.hpp"
#include "tessera/layers/fields.hpp"

namespace tessera {

enum class MergeKind { concat, add };

// Types concat and add; no fields besides "inputs" (two or more).
MergeKind parse_merge(const LayerSpec& spec);

template <typename T>
class Merge final : public Layer<T> {
 public:
  Merge(std::string name, MergeKind kind) : Layer<T>(std::move(name)), kind_(kind) {}

  Distribution setup(std::span<const Distribution> inputs) override;
  DistTensor<T> forward(std::span<const DistTensor<T>* const> inputs, const RunState&) override;
  std::vector<DistTensor<T>> backward(const DistTensor<T>& dy, const RunState&) override;

  // Takes the backend's merge kernel. Local.
  void bind(const Runtime& runtime) override { kernel_ = runtime.backend().merge<T>(); }

 private:
  MergeKind kind_;
  std::vector<Distribution> in_;
  std::unique_ptr<MergeKernel<T>> kernel_;
};

}  // namespace tessera
