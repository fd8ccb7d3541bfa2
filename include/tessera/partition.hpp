// Block partitions and convolution windows: the index math of README.md "Design".
// Every function here is local and pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/box.hpp"

namespace tessera {

// Part `index` of `extent` split over `parts`: with q = extent / parts and r = extent % parts,
// [index*q + min(index, r), (index+1)*q + min(index+1, r)) -- the first r parts get one more.
Range block_range(std::int64_t extent, int parts, int index);

// The part that owns element `i` of `extent` split over `parts`.
int block_owner(std::int64_t extent, int parts, std::int64_t i);

// Part `index` of `extent` split over `parts` in whole units: where `units` > 0 divides `extent`,
// block_range(units, parts, index) scaled by the unit's length extent / units (the first
// units % parts parts get one unit more); else block_range(extent, parts, index). So extents
// that are multiples of one unit count (a model's 2048, 1024 and 512 rows in 512 units of 4, 2
// and 1 rows) are cut at the same places of the image (README.md "The grid").
Range split_range(std::int64_t extent, std::int64_t units, int parts, int index);

// The part of split_range(extent, units, parts, .) that owns element `i`.
int split_owner(std::int64_t extent, std::int64_t units, int parts, std::int64_t i);

// The unit count that lines up the splits of `extents` (one axis of every tensor of a model) over
// `parts`: the greatest common divisor g of the largest extents, taken from the largest down
// while g >= parts and the largest part of the largest extent, ceil(g / parts) units, is at most
// 3% more than block_range's (all of unet-small's 2048, 1024, 512 over 3: 512; a deeper net's
// 2048 ... 128, 64 over 3: 128, as 64 would cost 3.1%, and its 64 rows are split on their own);
// 0 where fewer than two extents line up so (block_range of each; also for one part, or an
// extent <= 0). With g a multiple of `parts` the splits are block_range's.
std::int64_t aligned_units(const std::vector<std::int64_t>& extents, int parts);

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
