// Softmax cross-entropy over the kernel threads (include/tessera/kernels/local_kernels.hpp,
// make_cpu_loss): the reference's per-pixel loop (reference::pixel_cross_entropy_range),
// the pixels split into fixed chunks whose sums are added in chunk order, so that the loss does
// not depend on the thread count. The gradient is the reference's bit for bit; the loss differs
// from the reference's one sequential sum by double rounding.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/kernels/local_kernels.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

constexpr std::int64_t kChunk = 1 << 14;  // pixels per partial sum

template <typename T>
class ThreadedLoss final : public LossKernel<T> {
 public:
  std::string name() const override { return "threaded"; }
  double cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels, T scale,
                       Tensor<T>* dlogits) const override {
    const Shape4& s = logits.shape();
    check_cross_entropy(s, labels, dlogits != nullptr ? &dlogits->shape() : nullptr);
    const std::int64_t pixels = s.n * s.h * s.w;
    const std::int64_t chunks = (pixels + kChunk - 1) / kChunk;
    std::vector<double> partial(static_cast<std::size_t>(chunks), 0.0);
    parallel_for(
        chunks,
        [&](std::int64_t first, std::int64_t last) {
          for (std::int64_t chunk = first; chunk < last; ++chunk)
            partial[static_cast<std::size_t>(chunk)] =
                reference::pixel_cross_entropy_range(logits, labels, scale, dlogits, chunk * kChunk,
                                                     std::min(pixels, (chunk + 1) * kChunk));
        },
        1);
    double total = 0;
    for (double v : partial)
      total += v;
    return total;
  }
};

}  // namespace

template <typename T>
std::unique_ptr<LossKernel<T>> make_cpu_loss() {
  return std::make_unique<ThreadedLoss<T>>();
}

template std::unique_ptr<LossKernel<float>> make_cpu_loss<float>();
template std::unique_ptr<LossKernel<double>> make_cpu_loss<double>();

}  // namespace tessera
