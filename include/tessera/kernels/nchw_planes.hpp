// Where the channels of an NCHW tensor lie for the kernels that read them plane by plane (the
// narrow kernels, kernels/cpu/narrow_conv.cpp, and the AMX kernels' NCHW passes,
// kernels/cpu/amx_conv.cpp): a whole tensor, a box of a larger one, or a concat's parts read where
// they lie (ConvKernel::forward_parts). Local.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "tessera/tensor.hpp"

namespace tessera {

// Tensors of the same H x W holding consecutive channels (a concat's parts), or one: channel c of
// sample n in the part p holding it, at p.data + (n * p.channels + c - p.first) * plane, rows
// `row` apart.
template <typename F>
struct ChannelPlanes {
  static constexpr std::size_t kMaxParts = 8;
  struct Part {
    F* data;
    std::int64_t first, channels;
  };
  std::array<Part, kMaxParts> parts{};
  std::size_t count = 0;
  std::int64_t plane = 0, row = 0;

  F* at(std::int64_t n, std::int64_t c, std::int64_t r) const {
    std::size_t k = 0;
    while (k + 1 < count && c >= parts[k + 1].first)
      ++k;
    const Part& p = parts[k];
    return p.data + (n * p.channels + c - p.first) * plane + r * row;
  }
  // Whether every row of every part starts on a 64-byte line.
  bool lines_aligned() const {
    constexpr std::int64_t kLine = 64 / std::int64_t(sizeof(F));
    if (plane % kLine != 0 || row % kLine != 0) return false;
    for (std::size_t k = 0; k < count; ++k)
      if (reinterpret_cast<std::uintptr_t>(parts[k].data) % 64 != 0) return false;
    return true;
  }
};

// The planes of `data`, a tensor of shape `outer`, from row at.h and column at.w on (a box of it;
// a whole tensor: {0, 0}).
template <typename F>
ChannelPlanes<F> channel_planes(F* data, const Shape4& outer, std::int64_t at_h = 0,
                                std::int64_t at_w = 0) {
  ChannelPlanes<F> p;
  p.parts[0] = {data + at_h * outer.w + at_w, 0, outer.c};
  p.count = 1;
  p.plane = outer.h * outer.w;
  p.row = outer.w;
  return p;
}

}  // namespace tessera
