// Argument checks the batch-norm kernels share (private to kernels/cpu). Local; throw an Error
// naming the kernel.
#pragma once

#include <string>

#include "tessera/error.hpp"
#include "tessera/kernels/reference_batchnorm.hpp"
#include "tessera/tensor.hpp"

namespace tessera::batchnorm_checks {

inline void channels(const char* kernel, const Shape4& x, std::size_t size, const char* what) {
  TESSERA_CHECK(static_cast<std::int64_t>(size) == x.c,
                std::string(kernel) + ": " + what + " has " + std::to_string(size) +
                    " entries for the " + std::to_string(x.c) + " channels of " + x.str());
}

inline void same(const char* kernel, const Shape4& x, const Shape4& other, const char* what) {
  TESSERA_CHECK(x == other, std::string(kernel) + ": " + what + " " + other.str() +
                                " does not match the input " + x.str());
}

inline void statistics(const char* kernel, const Shape4& x, const reference::BatchNormStats& s) {
  channels(kernel, x, s.mean.size(), "mean");
  channels(kernel, x, s.invstd.size(), "invstd");
}

// The arguments of batchnorm_backward_data (both implementations take the same ones).
template <typename T>
void backward_data(const char* kernel, const Tensor<T>& x, const Tensor<T>& dy,
                   const reference::BatchNormStats& s, std::size_t weight, std::size_t mean_dy,
                   std::size_t mean_dy_xhat, const Tensor<T>& dx) {
  statistics(kernel, x.shape(), s);
  same(kernel, x.shape(), dy.shape(), "output gradient");
  same(kernel, x.shape(), dx.shape(), "input gradient");
  channels(kernel, x.shape(), weight, "weight");
  channels(kernel, x.shape(), mean_dy, "mean_dy");
  channels(kernel, x.shape(), mean_dy_xhat, "mean_dy_xhat");
}

}  // namespace tessera::batchnorm_checks
