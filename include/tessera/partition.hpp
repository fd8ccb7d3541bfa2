// Block partitions and convolution windows: the index math of README.md "Design".
// Every function here is local and pure.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/box.hpp"

namespace tessera {

// Part `index` of `extent` split over `parts`: with q = extent / parts and r = extent % parts,
// [index*q + min(index, r), (index+1)*q + min(index+1, r)) -- the first r parts get one more.
Range block_range(std::int64_t extent, int parts, int index);

// The part that owns element `i` of `extent` split over `parts`.
int block_owner(std::int64_t extent, int parts, std::int64_t i);

// One spatial axis of a convolution-like window (conv, pooling). Padding may be asymmetric
// (`same` padding with an even kernel); pad_end only changes the output extent.
struct WindowAxis {
  std::int64_t kernel = 1;
  std::int64_t stride = 1;
  std::int64_t pad_begin = 0;
  std::int64_t pad_end = 0;
  std::int64_t dilation = 1;

  // Input rows spanned by one output row: dilation * (kernel - 1) + 1.
  std::int64_t span() const { return dilation * (kernel - 1) + 1; }
};

// Output extent of the window op over an input of `extent`; may be <= 0 (impossible shape).
std::int64_t window_output_extent(std::int64_t extent, const WindowAxis& a);

// Checks that an image of h x w splits over the grid's h x w spatial ranks with rows and
// columns on every rank; otherwise throws an Error "<what> cannot be split over ... a tile would
// have no rows (use a spatial grid of at most ...; RxC takes the same P ranks)", the last part
// where another split of the same ranks fits. `what`: "the 17x15 image", "layer 'c2'
// (conv2d): its 2x3 output". The one place this rule is written. Local.
void check_splittable(const std::string& what, std::int64_t h, std::int64_t w, int grid_h,
                      int grid_w);

// Input rows that output rows `out` read: [ob*S - P, (oe-1)*S - P + D*(K-1) + 1), not clipped to
// the image (the part outside [0, extent) is zero padding). Empty when `out` is empty.
Range input_window(Range out, const WindowAxis& a);

}  // namespace tessera
