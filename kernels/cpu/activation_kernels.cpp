// Tessera's CPU activations behind ActivationKernel (include/tessera/kernels/local_kernels.hpp).
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

// y = leaky_relu(x), and which x were positive. Over restrict pointers, so that GCC vectorises
// it (elementwise::leaky_relu is branch-free); with a branch, signs that change at random cost a
// misprediction every other element (4 ns per element here).
template <typename T>
void leaky_relu_mask(const T* __restrict x, T* __restrict y, std::uint8_t* __restrict positive,
                     std::int64_t n, T slope) {
  for (std::int64_t k = 0; k < n; ++k) {
    positive[k] = x[k] > T(0);
    y[k] = elementwise::leaky_relu(x[k], slope);
  }
}

// The positives of y = leaky_relu(x) are those of x (slope >= 0): the mask from the output.
template <typename T>
void positive_mask(const T* __restrict y, std::uint8_t* __restrict positive, std::int64_t n) {
  for (std::int64_t k = 0; k < n; ++k)
    positive[k] = y[k] > T(0);
}

// y = leaky_relu(x), nothing kept.
template <typename T>
void leaky_relu_only(const T* __restrict x, T* __restrict y, std::int64_t n, T slope) {
  for (std::int64_t k = 0; k < n; ++k)
    y[k] = elementwise::leaky_relu(x[k], slope);
}

// The rule of reference::leaky_relu_backward, with y > 0 read from the mask.
template <typename T>
void leaky_relu_mask_backward(const T* __restrict dy, const std::uint8_t* __restrict positive,
                              T* __restrict dx, std::int64_t n, T slope) {
  for (std::int64_t k = 0; k < n; ++k)
    dx[k] = elementwise::leaky_relu_grad(positive[k] != 0, dy[k], slope);
}

template <typename T>
class CpuActivation final : public ActivationKernel<T> {
 public:
  CpuActivation(ActivationKind kind, double slope)
      : kind_(kind), slope_(kind == ActivationKind::leaky_relu ? static_cast<T>(slope) : T(0)) {}
  std::string name() const override { return "threaded"; }

  void forward(const Tensor<T>& x, Tensor<T>& y) override {
    TESSERA_CHECK(y.span().size() == x.span().size(), "activation: y's storage is not x's");
    if (kind_ == ActivationKind::sigmoid) {
      reference::sigmoid_forward<T>(x.span(), y.span());
      y_ = y;
      return;
    }
    // (Leaky) ReLU's backward needs only which elements were positive: one byte each instead of
    // a copy of the output (a 512 MiB copy per layer per step at 32 x 2048 x 2048).
    if (!(positive_.shape() == x.shape()))
      positive_ = Tensor<std::uint8_t>(x.shape(), uninitialized);
    parallel_for(x.numel(), [&](std::int64_t begin, std::int64_t end) {
      leaky_relu_mask(x.data() + begin, y.data() + begin, positive_.data() + begin, end - begin,
                      slope_);
    });
  }

  bool works_from_output() const override { return true; }

  void forward_unkept(const Tensor<T>& x, Tensor<T>& y) override {
    TESSERA_CHECK(y.span().size() == x.span().size(), "activation: y's storage is not x's");
    if (kind_ == ActivationKind::sigmoid) {
      reference::sigmoid_forward<T>(x.span(), y.span());
      return;
    }
    parallel_for(x.numel(), [&](std::int64_t begin, std::int64_t end) {
      leaky_relu_only(x.data() + begin, y.data() + begin, end - begin, slope_);
    });
  }

  void keep_output(const Tensor<T>& y) override {
    if (kind_ == ActivationKind::sigmoid) {
      y_ = y;
      return;
    }
    if (!(positive_.shape() == y.shape()))
      positive_ = Tensor<std::uint8_t>(y.shape(), uninitialized);
    parallel_for(y.numel(), [&](std::int64_t begin, std::int64_t end) {
      positive_mask(y.data() + begin, positive_.data() + begin, end - begin);
    });
  }

  void backward_from_output(const Tensor<T>& y, Tensor<T>& grad) const override {
    TESSERA_CHECK(
        y.shape() == grad.shape() && y.layout() == grad.layout() &&
            y.span().size() == grad.span().size(),
        "activation: a gradient of " + grad.shape().str() + " for an output of " + y.shape().str());
    const auto n = static_cast<std::int64_t>(grad.span().size());
    if (kind_ == ActivationKind::sigmoid) {
      reference::sigmoid_backward<T>(y.span(), grad.span(), grad.span());
      return;
    }
    parallel_for(n, [&](std::int64_t begin, std::int64_t end) {
      elementwise::leaky_relu_grad_from_output(y.data() + begin, grad.data() + begin, end - begin,
                                               slope_);
    });
  }

  void backward(const Tensor<T>& dy, Tensor<T>& dx) const override {
    if (kind_ == ActivationKind::sigmoid) {
      reference::sigmoid_backward<T>(y_.span(), dy.span(), dx.span());
      return;
    }
    TESSERA_CHECK(positive_.numel() == dx.numel(), "activation: backward without its forward");
    parallel_for(dx.numel(), [&](std::int64_t begin, std::int64_t end) {
      leaky_relu_mask_backward(dy.data() + begin, positive_.data() + begin, dx.data() + begin,
                               end - begin, slope_);
    });
  }

 private:
  ActivationKind kind_;
  T slope_;
  Tensor<T> y_;                    // sigmoid's output
  Tensor<std::uint8_t> positive_;  // (leaky) ReLU: x > 0
};

}  // namespace

template <typename T>
std::unique_ptr<ActivationKernel<T>> make_cpu_activation(ActivationKind kind, double slope) {
  return std::make_unique<CpuActivation<T>>(kind, slope);
}

template std::unique_ptr<ActivationKernel<float>> make_cpu_activation<float>(ActivationKind,
                                                                             double);
template std::unique_ptr<ActivationKernel<double>> make_cpu_activation<double>(ActivationKind,
                                                                               double);

}  // namespace tessera
