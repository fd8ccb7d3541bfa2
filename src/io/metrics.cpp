#include "tessera/io/metrics.hpp"

#include <cmath>
#include <limits>

#include "tessera/collectives.hpp"

namespace tessera {

template <typename T>
void Confusion::add(const DistTensor<T>& logits, std::span<const std::int32_t> labels) {
  if (logits.dist.replicated && (logits.dist.me.i != 0 || logits.dist.me.j != 0)) return;
  const Tensor<T> host = to_host(logits.local);
  const Shape4& s = host.shape();
  const std::int64_t plane = s.h * s.w;
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t p = 0; p < plane; ++p) {
      const T* x = host.data() + n * s.c * plane + p;
      std::int64_t best = 0;
      for (std::int64_t c = 1; c < s.c; ++c)
        if (x[c * plane] > x[best * plane]) best = c;
      const std::int32_t label = labels[static_cast<std::size_t>(n * plane + p)];
      ++counts_[static_cast<std::size_t>(label * classes_ + best)];
    }
}

void Confusion::reduce(const Comm& comm) {
  allreduce_sum(comm, std::span<long long>(counts_), Group::world, "allreduce of the metrics");
}

long long Confusion::total() const {
  long long t = 0;
  for (long long c : counts_)
    t += c;
  return t;
}

double Confusion::accuracy() const {
  long long correct = 0;
  for (std::int64_t k = 0; k < classes_; ++k)
    correct += count(k, k);
  const long long t = total();
  return t > 0 ? static_cast<double>(correct) / static_cast<double>(t) : 0.0;
}

double Confusion::iou(std::int64_t k) const {
  long long row = 0, col = 0;
  for (std::int64_t j = 0; j < classes_; ++j) {
    row += count(k, j);
    col += count(j, k);
  }
  const long long tp = count(k, k);
  const long long uni = row + col - tp;
  return uni == 0 ? std::numeric_limits<double>::quiet_NaN()
                  : static_cast<double>(tp) / static_cast<double>(uni);
}

double Confusion::mean_iou() const {
  double sum = 0;
  int present = 0;
  for (std::int64_t k = 0; k < classes_; ++k) {
    const double v = iou(k);
    if (std::isnan(v)) continue;
    sum += v;
    ++present;
  }
  return present > 0 ? sum / present : 0.0;
}

template void Confusion::add(const DistTensor<float>&, std::span<const std::int32_t>);
template void Confusion::add(const DistTensor<double>&, std::span<const std::int32_t>);

}  // namespace tessera
