// The halo copies every backend hands out (include/tessera/kernels/halo_copy.hpp): messages hold a
// box of every plane in NCHW order whatever the tensor's layout, unpacking copies or adds it back,
// moves convert layouts, and fill_outside writes exactly the elements outside its box.
#include <gtest/gtest.h>

#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/kernels/backend.hpp"
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

}  // namespace
}  // namespace tessera
