// The halo copies every backend hands out (include/tessera/kernels/halo_copy.hpp): messages hold a
// box of every plane in NCHW order whatever the tensor's layout, unpacking copies or adds it back,
// moves convert layouts, and fill_outside writes exactly the elements outside its box.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/simd.hpp"
#include "unit_test.hpp"

namespace tessera {
namespace {

// Every element of `t` (any layout; its first row and column at `origin`'s) is want(n, c, h, w)
// inside `box` and `outside` elsewhere.
template <typename T, typename Want>
void expect_box(const Tensor<T>& t, const Box& origin, const Box& box, Want want, T outside,
                const char* what) {
  const Tensor<T> plain = to_layout(t, Layout::nchw);
  const Shape4& s = plain.shape();
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t c = 0; c < s.c; ++c)
      for (std::int64_t h = 0; h < s.h; ++h)
        for (std::int64_t w = 0; w < s.w; ++w) {
          const bool inside =
              box.h.contains(h + origin.h.begin) && box.w.contains(w + origin.w.begin);
          ASSERT_EQ(plain.at(n, c, h, w), inside ? want(n, c, h, w) : outside)
              << what << " at " << n << ", " << c << ", " << h << ", " << w;
        }
}

template <typename T>
void check_halo_copies(Layout layout) {
  SCOPED_TRACE(to_string(layout));
  // 20 channels: a block of 16 pads the second block, one of 8 the third. The tensor holds rows
  // [4, 13) and columns [10, 21) of its image; the box is a part of that.
  const Shape4 s{2, 20, 9, 11};
  const Box origin{{4, 13}, {10, 21}}, box{{6, 11}, {12, 20}};
  const Tensor<T> plain = test::random_tensor<T>(s, 3, 1);
  const Tensor<T> blocked = to_layout(plain, layout);
  const std::int64_t box_elements = s.n * s.c * box.size();
  for (KernelBackend backend : test::built_backends()) {
    SCOPED_TRACE(to_string(backend));
    auto copies = backend_of(backend).halo_copy<T>();
    std::vector<T> from_plain(box_elements), from_blocked(box_elements);
    copies->pack(planes_of(plain, origin), box, from_plain.data());
    copies->pack(planes_of(blocked, origin), box, from_blocked.data());
    EXPECT_EQ(from_plain, from_blocked) << "a message does not depend on the layout";
    std::int64_t k = 0;
    for (std::int64_t p = 0; p < s.n * s.c; ++p)
      for (std::int64_t r = box.h.begin; r < box.h.end; ++r)
        for (std::int64_t c = box.w.begin; c < box.w.end; ++c, ++k)
          ASSERT_EQ(from_plain[k], plain.at(p / s.c, p % s.c, r - 4, c - 10));

    // Unpack adds into a blocked tensor; fill_outside(box) then zeroes everything else.
    Tensor<T> sum(s, layout, T(1));
    copies->unpack(from_plain.data(), box, planes_of(sum, origin), Direction::accumulate);
    copies->fill_outside(planes_of(sum, origin), box, T(0));
    expect_box(
        sum, origin, box, [&](auto... i) { return plain.at(i...) + T(1); }, T(0),
        "unpack, then fill_outside");

    // A move converts layouts: the box of the blocked tensor into a plain one.
    Tensor<T> moved(s, Layout::nchw, T(-3));
    copies->move(planes_of(blocked, origin), planes_of(moved, origin), box, Direction::fill);
    expect_box(
        moved, origin, box, [&](auto... i) { return plain.at(i...); }, T(-3), "move out of blocks");

    // And back: the box of a plain tensor added into a blocked one (a window's gradient path),
    // full blocks interleaved and the padded last block plane by plane.
    Tensor<T> target = to_layout(Tensor<T>(s, T(2)), layout);
    copies->move(planes_of(plain, origin), planes_of(target, origin), box, Direction::accumulate);
    expect_box(
        target, origin, box, [&](auto... i) { return plain.at(i...) + T(2); }, T(2),
        "move into blocks");

    // Between blocks of 16 and of 8 (an upsampling's output into an 8-channel window): 8
    // channels of a column at a time, the padded last block of 16 (4 channels) plane by plane.
    // Within one layout (a tile into a window of its layout), and from NCHW into blocks (an
    // NCHW tile into a blocked window).
    Tensor<T> same(s, layout, T(-5)), filled(s, layout, T(-6));
    copies->move(planes_of(blocked, origin), planes_of(same, origin), box, Direction::fill);
    expect_box(
        same, origin, box, [&](auto... i) { return plain.at(i...); }, T(-5), "move in blocks");
    copies->move(planes_of(plain, origin), planes_of(filled, origin), box, Direction::fill);
    expect_box(
        filled, origin, box, [&](auto... i) { return plain.at(i...); }, T(-6), "move into blocks");

    const Layout other = layout == Layout::nchw16c ? Layout::nchw8c : Layout::nchw16c;
    Tensor<T> into(s, other, T(-1));
    copies->move(planes_of(blocked, origin), planes_of(into, origin), box, Direction::fill);
    expect_box(
        into, origin, box, [&](auto... i) { return plain.at(i...); }, T(-1), "move between blocks");
    copies->move(planes_of(blocked, origin), planes_of(into, origin), box, Direction::accumulate);
    expect_box(
        into, origin, box, [&](auto... i) { return T(2) * plain.at(i...); }, T(-1),
        "add between blocks");
  }
}

TEST(HaloCopy, MessagesMovesAndPaddingDouble) {
  for (Layout layout : {Layout::nchw16c, Layout::nchw8c})
    check_halo_copies<double>(layout);
}
TEST(HaloCopy, MessagesMovesAndPaddingFloat) {
  for (Layout layout : {Layout::nchw16c, Layout::nchw8c})
    check_halo_copies<float>(layout);
}

// The streaming stores that fill large targets (kernels/simd.hpp's streaming_store_bytes; forced
// here by a threshold of 0) give the same values: whole rows, 8-channel columns, interleaved
// tiles, and NCHW rows that start off a 16-byte boundary (the plain stores before and after).
TEST(HaloCopy, StreamingStoresGiveTheSameValues) {
  const std::int64_t before = streaming_store_bytes();
  set_streaming_store_bytes(0);
  for (Layout layout : {Layout::nchw16c, Layout::nchw8c}) {
    check_halo_copies<float>(layout);
    check_halo_copies<double>(layout);
  }
  const Shape4 s{1, 3, 5, 150};
  const Box origin{{0, 5}, {0, 150}};
  const Tensor<float> from = test::random_tensor<float>(s, 4, 1);
  for (const Box& box : {Box{{1, 4}, {11, 140}}, Box{{0, 5}, {1, 150}}, Box{{2, 3}, {3, 70}}}) {
    for (KernelBackend backend : test::built_backends()) {
      Tensor<float> to(s, Layout::nchw, -4.0f);
      backend_of(backend).halo_copy<float>()->move(planes_of(from, origin), planes_of(to, origin),
                                                   box, Direction::fill);
      expect_box(
          to, origin, box, [&](auto... i) { return from.at(i...); }, -4.0f, "an NCHW row");
    }
  }
  set_streaming_store_bytes(before);
}

// Channel slices (a concat's input filling its channels of a window, WindowLayer): a move into
// a slice writes the box of those channels only, fill_outside on a slice writes only its channels
// (the padding channels of its last block included), a message packed from a slice is the part's;
// two samples, so the slice's sample stride is that of the whole window.
template <typename T>
void check_channel_slices(Layout layout) {
  SCOPED_TRACE(to_string(layout));
  // 40 channels: slices at channels 16 (16 of them) and 32 (8: the last, padded block of 16).
  const Shape4 s{2, 40, 9, 11}, part{2, 16, 9, 11}, last{2, 8, 9, 11};
  const Box origin{{4, 13}, {10, 21}}, box{{6, 11}, {12, 20}};
  const Tensor<T> tile = test::random_tensor<T>(part, 5, 1);
  for (KernelBackend backend : test::built_backends()) {
    SCOPED_TRACE(to_string(backend));
    auto copies = backend_of(backend).halo_copy<T>();
    if (!copies->takes_channel_slices()) continue;
    Tensor<T> window(s, layout, T(5));
    copies->move(planes_of(tile, origin), channel_slice(planes_of(window, origin), 16, 16), box,
                 Direction::fill);
    copies->fill_outside(channel_slice(planes_of(window, origin), 32, 8), box, T(0));
    const Tensor<T> plain = to_layout(window, Layout::nchw);
    for (std::int64_t n = 0; n < s.n; ++n)
      for (std::int64_t c = 0; c < s.c; ++c)
        for (std::int64_t h = 0; h < s.h; ++h)
          for (std::int64_t w = 0; w < s.w; ++w) {
            const bool inside = box.h.contains(h + 4) && box.w.contains(w + 10);
            const T want = c >= 16 && c < 32 && inside ? tile.at(n, c - 16, h, w)
                           : c >= 32 && !inside        ? T(0)
                                                       : T(5);
            ASSERT_EQ(plain.at(n, c, h, w), want) << n << ", " << c << ", " << h << ", " << w;
          }
    std::vector<T> from_slice(part.n * part.c * box.size()), from_tile(from_slice.size());
    copies->pack(channel_slice(planes_of(std::as_const(window), origin), 16, 16), box,
                 from_slice.data());
    copies->pack(planes_of(tile, origin), box, from_tile.data());
    EXPECT_EQ(from_slice, from_tile);
    std::vector<T> zeros(last.n * last.c * box.size());
    copies->pack(channel_slice(planes_of(std::as_const(window), origin), 32, 8), box, zeros.data());
    EXPECT_EQ(zeros, std::vector<T>(zeros.size(), T(5)));
  }
}

TEST(HaloCopy, ChannelSlices) {
  for (Layout layout : {Layout::nchw, Layout::nchw8c, Layout::nchw16c}) {
    check_channel_slices<float>(layout);
    check_channel_slices<double>(layout);
  }
}

}  // namespace
}  // namespace tessera
