#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "tessera/error.hpp"
#include "tessera/synthetic.hpp"

namespace tessera {
namespace {

SyntheticOptions segmentation(std::int64_t classes = 2, std::uint64_t seed = 7) {
  return {.task = SyntheticTask::segmentation,
          .samples = 12,
          .channels = 3,
          .height = 37,
          .width = 29,
          .classes = classes,
          .seed = seed};
}

SyntheticOptions classification(std::int64_t classes = 10, std::int64_t channels = 3) {
  return {.task = SyntheticTask::classification,
          .samples = 12,
          .channels = channels,
          .height = 31,
          .width = 40,
          .classes = classes,
          .seed = 3};
}

template <typename T>
struct Read {
  Tensor<T> images;
  Labels labels;
};

template <typename T>
Read<T> read(SyntheticDataset& d, const std::vector<std::int64_t>& samples, const Box& image,
             const Box& label) {
  Read<T> r;
  d.read(samples, image, label, r.images, r.labels);
  return r;
}

Box whole(const DatasetInfo& info) {
  return {{0, info.height}, {0, info.width}};
}

// Every pixel and label of a whole-image read is the per-pixel definition.
void expect_matches_definition(const SyntheticOptions& o) {
  SyntheticDataset d(o);
  const DatasetInfo& info = d.info();
  const std::vector<std::int64_t> samples{0, 5, 11};
  const Read<double> r = read<double>(d, samples, whole(info), whole(info));
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto n = static_cast<std::int64_t>(i);
    for (std::int64_t c = 0; c < info.channels; ++c)
      for (std::int64_t h = 0; h < info.height; ++h)
        for (std::int64_t w = 0; w < info.width; ++w)
          ASSERT_EQ(r.images.at(n, c, h, w), d.pixel(samples[i], c, h, w))
              << "sample " << samples[i] << " channel " << c << " pixel " << h << "," << w;
    if (info.labels == LabelKind::per_image) {
      EXPECT_EQ(r.labels[i], d.label(samples[i], 0, 0));
      continue;
    }
    for (std::int64_t h = 0; h < info.height; ++h)
      for (std::int64_t w = 0; w < info.width; ++w)
        ASSERT_EQ(r.labels[static_cast<std::size_t>((n * info.height + h) * info.width + w)],
                  d.label(samples[i], h, w))
            << "sample " << samples[i] << " pixel " << h << "," << w;
  }
}

TEST(Synthetic, EveryPixelIsItsOwnDefinition) {
  expect_matches_definition(segmentation(2));
  expect_matches_definition(segmentation(3));
  expect_matches_definition(segmentation(4));
  expect_matches_definition(classification(10));
  expect_matches_definition(classification(5, 1));
}

// The row spans the fast path paints are exactly the pixels a shape contains, for every kind,
// both triangle orientations, and rows and columns beyond the shape and the image.
TEST(Synthetic, ShapeColumnsAreExactlyItsPixels) {
  std::vector<SyntheticShape> shapes;
  shapes.push_back({ShapeKind::circle, {5, 7, 4, 0, 0, 0}, 1, {}});
  shapes.push_back({ShapeKind::circle, {0, 0, 1, 0, 0, 0}, 1, {}});
  shapes.push_back({ShapeKind::circle, {-3, 12, 6, 0, 0, 0}, 1, {}});
  shapes.push_back({ShapeKind::rectangle, {2, -4, 9, 3, 0, 0}, 1, {}});
  shapes.push_back({ShapeKind::rectangle, {4, 4, 4, 4, 0, 0}, 1, {}});
  shapes.push_back({ShapeKind::triangle, {0, 0, 10, 3, 4, 12}, 1, {}});
  shapes.push_back({ShapeKind::triangle, {0, 0, 4, 12, 10, 3}, 1, {}});
  shapes.push_back({ShapeKind::triangle, {-5, 7, 13, -2, 8, 15}, 1, {}});
  shapes.push_back({ShapeKind::triangle, {3, 3, 3, 11, 9, 7}, 1, {}});
  shapes.push_back({ShapeKind::triangle, {1, 2, 2, 5, 3, 2}, 1, {}});
  for (const SyntheticShape& s : shapes) {
    std::int64_t inside = 0;
    for (std::int64_t h = -15; h < 25; ++h) {
      const Range r = s.columns(h);
      for (std::int64_t w = -20; w < 30; ++w) {
        ASSERT_EQ(s.contains(h, w), r.contains(w))
            << "kind " << static_cast<int>(s.kind) << " row " << h << " column " << w;
        inside += s.contains(h, w);
      }
      if (!r.empty()) {
        EXPECT_GT(r.begin, -20);
        EXPECT_LT(r.end, 30);
      }
    }
    EXPECT_GT(inside, 0) << "kind " << static_cast<int>(s.kind);
  }
  // Spot checks of the geometry itself.
  EXPECT_EQ(shapes[0].columns(5), (Range{3, 12}));
  EXPECT_EQ(shapes[0].columns(9), (Range{7, 8}));
  EXPECT_TRUE(shapes[0].columns(10).empty());
  EXPECT_EQ(shapes[3].columns(2), (Range{-4, 4}));
  EXPECT_TRUE(shapes[3].columns(10).empty());
  EXPECT_EQ(shapes[8].columns(3), (Range{3, 12}));
  EXPECT_EQ(shapes[8].columns(9), (Range{7, 8}));
  // The scenes' own shapes: random sizes and orientations.
  SyntheticDataset d(segmentation(4));
  for (std::int64_t sample = 0; sample < 12; ++sample)
    for (const SyntheticShape& s : d.scene(sample).shapes)
      for (std::int64_t h = -2; h < 40; ++h) {
        const Range r = s.columns(h);
        for (std::int64_t w = -2; w < 32; ++w)
          ASSERT_EQ(s.contains(h, w), r.contains(w)) << "sample " << sample;
      }
}

template <typename T>
void expect_tiles_equal_whole(const SyntheticOptions& o) {
  SyntheticDataset d(o);
  const DatasetInfo& info = d.info();
  const bool per_pixel = info.labels == LabelKind::per_pixel;
  const std::vector<std::int64_t> samples{3, 0, 11, 3};
  const Read<T> all = read<T>(d, samples, whole(info), whole(info));
  const std::int64_t H = info.height, W = info.width;
  const std::vector<Box> boxes{
      {{0, 1}, {0, 1}},   {{5, 17}, {3, W}},        {{H - 1, H}, {0, W}}, {{0, H}, {W - 2, W - 1}},
      {{10, 10}, {0, W}}, {{1, H - 1}, {1, W - 1}}, {{0, H}, {0, W}},     {{13, 20}, {11, 12}}};
  for (const Box& image : boxes) {
    // A label box other than the image box, as when the image tile carries a halo.
    const Box label{intersect(Range{image.h.begin + 1, image.h.end + 2}, Range{0, H}),
                    intersect(Range{image.w.begin - 1, image.w.end}, Range{0, W})};
    const Read<T> tile = read<T>(d, samples, image, label);
    ASSERT_EQ(tile.images.shape(), (Shape4{4, info.channels, image.h.size(), image.w.size()}));
    for (std::int64_t n = 0; n < 4; ++n)
      for (std::int64_t c = 0; c < info.channels; ++c)
        for (std::int64_t h = image.h.begin; h < image.h.end; ++h)
          for (std::int64_t w = image.w.begin; w < image.w.end; ++w)
            ASSERT_EQ(tile.images.at(n, c, h - image.h.begin, w - image.w.begin),
                      all.images.at(n, c, h, w))
                << "box " << to_string(image) << " pixel " << h << "," << w;
    if (!per_pixel) {
      EXPECT_EQ(tile.labels, all.labels);
      continue;
    }
    ASSERT_EQ(tile.labels.size(), static_cast<std::size_t>(4 * label.size()));
    auto at = tile.labels.begin();
    for (std::int64_t n = 0; n < 4; ++n)
      for (std::int64_t h = label.h.begin; h < label.h.end; ++h)
        for (std::int64_t w = label.w.begin; w < label.w.end; ++w)
          ASSERT_EQ(*at++, all.labels[static_cast<std::size_t>((n * H + h) * W + w)])
              << "label box " << to_string(label) << " pixel " << h << "," << w;
  }
}

TEST(Synthetic, TileEqualsTheSameBoxOfTheWholeImage) {
  expect_tiles_equal_whole<float>(segmentation(2));
  expect_tiles_equal_whole<double>(segmentation(2));
  expect_tiles_equal_whole<double>(segmentation(4));
  expect_tiles_equal_whole<float>(classification());
  expect_tiles_equal_whole<double>(classification());
}

TEST(Synthetic, FloatIsTheDoubleRoundedOnce) {
  SyntheticDataset d(segmentation());
  const Box box{{2, 30}, {4, 25}};
  const Read<float> f = read<float>(d, {1, 7}, box, box);
  const Read<double> g = read<double>(d, {1, 7}, box, box);
  ASSERT_EQ(f.images.numel(), g.images.numel());
  for (std::int64_t k = 0; k < f.images.numel(); ++k)
    ASSERT_EQ(f.images.data()[k], static_cast<float>(g.images.data()[k]));
  EXPECT_EQ(f.labels, g.labels);
}

TEST(Synthetic, SameSeedSameDataOtherSeedOtherData) {
  const Box box{{0, 37}, {0, 29}};
  SyntheticDataset a(segmentation(2, 7)), b(segmentation(2, 7)), c(segmentation(2, 8));
  const Read<double> ra = read<double>(a, {0, 1, 2}, box, box);
  const Read<double> rb = read<double>(b, {0, 1, 2}, box, box);
  const Read<double> rc = read<double>(c, {0, 1, 2}, box, box);
  EXPECT_TRUE(
      std::equal(ra.images.span().begin(), ra.images.span().end(), rb.images.span().begin()));
  EXPECT_EQ(ra.labels, rb.labels);
  EXPECT_FALSE(
      std::equal(ra.images.span().begin(), ra.images.span().end(), rc.images.span().begin()));
  EXPECT_NE(ra.labels, rc.labels);
  // Different samples of one seed differ, noise included: same shapes would still differ.
  const Read<double> r0 = read<double>(a, {0}, box, box), r1 = read<double>(a, {1}, box, box);
  EXPECT_NE(r0.labels, r1.labels);
  std::int64_t same = 0;
  for (std::int64_t k = 0; k < r0.images.numel(); ++k)
    same += r0.images.data()[k] == r1.images.data()[k];
  EXPECT_LT(same, r0.images.numel() / 20);
}

// Pixels carry the colour of what their label says covers them, give or take the noise, and
// shapes stand out from the background in every channel.
TEST(Synthetic, ImagesAgreeWithLabels) {
  for (std::int64_t classes : {2, 4}) {
    SyntheticDataset d(segmentation(classes));
    const DatasetInfo& info = d.info();
    for (std::int64_t s = 0; s < info.samples; ++s) {
      const SyntheticScene scene = d.scene(s);
      const Read<double> r = read<double>(d, {s}, whole(info), whole(info));
      for (std::int64_t c = 0; c < info.channels; ++c) {
        const auto ci = static_cast<std::size_t>(c);
        EXPECT_LE(scene.background[ci], 0.3);
        for (const SyntheticShape& shape : scene.shapes)
          EXPECT_GE(shape.colour[ci], 0.5);
        for (std::int64_t h = 0; h < info.height; ++h)
          for (std::int64_t w = 0; w < info.width; ++w) {
            const std::int32_t label = r.labels[static_cast<std::size_t>(h * info.width + w)];
            const double v = r.images.at(0, c, h, w);
            // The topmost shape over the pixel, found independently of the labels.
            const SyntheticShape* top = nullptr;
            for (const SyntheticShape& shape : scene.shapes)
              if (shape.contains(h, w)) top = &shape;
            ASSERT_EQ(label, top == nullptr ? 0 : top->label);
            const double base = top == nullptr ? scene.background[ci] : top->colour[ci];
            ASSERT_LE(std::abs(v - base), scene.noise + 1e-15);
            ASSERT_TRUE(label == 0 ? v < 0.4 : v > 0.4) << v << " with label " << label;
          }
      }
    }
  }
}

TEST(Synthetic, SegmentationClassBalance) {
  for (std::int64_t classes : {2, 3, 4}) {
    SyntheticOptions o = segmentation(classes);
    o.samples = 200;
    o.height = o.width = 64;
    SyntheticDataset d(o);
    std::vector<std::int64_t> samples(200);
    for (std::int64_t k = 0; k < 200; ++k)
      samples[static_cast<std::size_t>(k)] = k;
    const Box box{{0, 64}, {0, 64}};
    const Read<float> r = read<float>(d, samples, box, box);
    std::map<std::int32_t, std::int64_t> count;
    for (std::int32_t l : r.labels)
      ++count[l];
    const double foreground =
        1 - static_cast<double>(count[0]) / static_cast<double>(r.labels.size());
    EXPECT_GT(foreground, 0.05) << classes << " classes";
    EXPECT_LT(foreground, 0.6) << classes << " classes";
    // Every class occurs, and no other.
    EXPECT_EQ(static_cast<std::int64_t>(count.size()), classes);
    EXPECT_EQ(count.rbegin()->first, classes - 1);
    // Every image has some foreground.
    for (std::int64_t s = 0; s < 200; ++s) {
      const auto first = r.labels.begin() + s * 64 * 64;
      EXPECT_TRUE(std::any_of(first, first + 64 * 64, [](std::int32_t l) { return l > 0; }))
          << "sample " << s;
    }
  }
}

TEST(Synthetic, ClassificationCoversEveryClass) {
  for (auto [classes, channels] :
       {std::pair<std::int64_t, std::int64_t>{10, 3}, {10, 1}, {64, 3}, {2, 5}}) {
    SyntheticOptions o = classification(classes, channels);
    o.samples = 40 * classes;
    SyntheticDataset d(o);
    EXPECT_EQ(d.info().labels, LabelKind::per_image);
    std::vector<std::int64_t> samples;
    for (std::int64_t k = 0; k < o.samples; ++k)
      samples.push_back(k);
    Read<float> r;
    d.read(samples, {{0, 1}, {0, 1}}, {}, r.images, r.labels);
    ASSERT_EQ(r.labels.size(), samples.size());
    std::vector<std::int64_t> count(static_cast<std::size_t>(classes));
    for (std::int32_t l : r.labels) {
      ASSERT_GE(l, 0);
      ASSERT_LT(l, classes);
      ++count[static_cast<std::size_t>(l)];
    }
    for (std::int64_t c = 0; c < classes; ++c)
      EXPECT_GE(count[static_cast<std::size_t>(c)], 15) << "class " << c << " of " << classes;
    // One colour per class, every two classes apart by more than twice the noise in some
    // channel, and brighter than the background in every channel.
    std::map<std::int32_t, std::vector<double>> colour;
    for (std::int64_t s = 0; s < o.samples; ++s) {
      const SyntheticScene scene = d.scene(s);
      ASSERT_FALSE(scene.shapes.empty());
      for (const SyntheticShape& shape : scene.shapes) {
        if (!colour.count(scene.label)) colour[scene.label] = shape.colour;
        ASSERT_EQ(shape.colour, colour[scene.label]);
        for (std::size_t c = 0; c < shape.colour.size(); ++c)
          ASSERT_GT(shape.colour[c] - scene.noise, scene.background[c] + scene.noise);
      }
      for (auto& [other, value] : colour) {
        if (other == scene.label) continue;
        double apart = 0;
        for (std::size_t c = 0; c < value.size(); ++c)
          apart = std::max(apart, std::abs(value[c] - colour[scene.label][c]));
        ASSERT_GT(apart, 2 * scene.noise) << "classes " << other << " and " << scene.label;
      }
    }
  }
}

TEST(Synthetic, Info) {
  SyntheticDataset seg(segmentation(0));
  EXPECT_EQ(seg.info().classes, 2);
  EXPECT_EQ(seg.info().labels, LabelKind::per_pixel);
  EXPECT_EQ(seg.info().samples, 12);
  EXPECT_EQ(seg.info().channels, 3);
  EXPECT_EQ(seg.info().label_height, 37);
  EXPECT_EQ(seg.info().label_width, 29);
  SyntheticDataset cls(classification(0));
  EXPECT_EQ(cls.info().classes, 10);
  EXPECT_EQ(cls.info().labels, LabelKind::per_image);
  EXPECT_EQ(cls.info().label_height, 1);
  EXPECT_EQ(cls.info().label_width, 1);
  EXPECT_EQ(parse_synthetic_task("classification"), SyntheticTask::classification);
  EXPECT_THROW(parse_synthetic_task("detection"), Error);
}

TEST(Synthetic, BadOptionsAndBoxesAreErrors) {
  EXPECT_THROW(SyntheticDataset{segmentation(1)}, Error);
  EXPECT_THROW(SyntheticDataset{segmentation(5)}, Error);
  EXPECT_THROW(SyntheticDataset{classification(65)}, Error);
  SyntheticOptions o = segmentation();
  o.channels = 0;
  EXPECT_THROW(SyntheticDataset{o}, Error);
  o = segmentation();
  o.height = 0;
  EXPECT_THROW(SyntheticDataset{o}, Error);
  o = segmentation();
  o.samples = -1;
  EXPECT_THROW(SyntheticDataset{o}, Error);
  SyntheticDataset d(segmentation());
  Tensor<float> images;
  Labels labels;
  const std::vector<std::int64_t> one{0}, outside{12};
  const Box ok{{0, 37}, {0, 29}};
  EXPECT_THROW(d.read(one, {{0, 38}, {0, 29}}, ok, images, labels), Error);
  EXPECT_THROW(d.read(one, ok, {{-1, 3}, {0, 29}}, images, labels), Error);
  EXPECT_THROW(d.read(outside, ok, ok, images, labels), Error);
  try {
    d.read(one, {{0, 37}, {0, 30}}, ok, images, labels);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("37x29"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
