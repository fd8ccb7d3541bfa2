// The CUDA backend's kernels one by one against the CPU (include/tessera/gpu.hpp: cuda_backend):
// cuDNN convolutions against the reference loops (float64 to 1e-12, float32 to 1e-5, no TF32),
// the pointwise kernels, merges, halo copies, optimizer updates, pooling, upsampling and the
// classification head bit for bit against the CPU kernels (they share their arithmetic,
// kernels/elementwise.hpp and kernels/window_arithmetic.hpp; sigmoid's exp to a few ulp), batch
// norm's sums to double rounding. Skipped without a GPU (gpu_main.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../common/test_helpers.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/batchnorm_kernel.hpp"
#include "tessera/kernels/reference.hpp"
#include "tessera/kernels/window_arithmetic.hpp"

namespace tessera {
namespace {

const Backend& gpu() {
  return *cuda_backend();
}

template <typename T>
Tensor<T> on_device(const Tensor<T>& t) {
  return copy_to(t, *device_allocator());
}
template <typename T>
Tensor<T> on_host(const Tensor<T>& t) {
  return copy_to(t, host_allocator());
}
template <typename T>
std::span<const T> device_span(const Tensor<T>& t) {
  return {t.data_in(MemorySpace::device), t.size()};
}

template <typename T>
void expect_same_bits(const Tensor<T>& device_result, const Tensor<T>& cpu,
                      const std::string& what) {
  const Tensor<T> got = on_host(device_result);
  ASSERT_EQ(got.size(), cpu.size()) << what;
  for (std::size_t k = 0; k < got.size(); ++k)
    ASSERT_EQ(got.data()[k], cpu.data()[k]) << what << ": element " << k;
}

template <typename T>
double tolerance() {
  return sizeof(T) == 8 ? 1e-12 : 1e-5;
}

struct ConvCase {
  std::string name;
  Shape4 x, w;
  reference::ConvGeometry g;
  std::int64_t oh, ow;
  bool bias;
};

// Conv2d's windows (pad 0), strides, dilations and groups, and the adjoint convolutions of
// ConvTranspose2d (padding of any sign, the padded-copy path).
std::vector<ConvCase> conv_cases() {
  return {
      {"3x3", {2, 5, 12, 11}, {7, 5, 3, 3}, {}, 10, 9, true},
      {"stride 2", {1, 4, 13, 12}, {6, 4, 3, 3}, {.stride_h = 2, .stride_w = 2}, 6, 5, true},
      {"dilation 2",
       {2, 3, 14, 13},
       {4, 3, 3, 3},
       {.dilation_h = 2, .dilation_w = 2},
       10,
       9,
       false},
      {"groups 2", {1, 6, 9, 9}, {4, 3, 3, 3}, {.groups = 2}, 7, 7, true},
      {"1x1", {3, 8, 5, 6}, {5, 8, 1, 1}, {}, 5, 6, true},
      // A head's pointwise conv: its filter gradient is Tessera's chunked sums (cudnn_conv.cpp),
      // here over several chunks.
      {"1x1 to 2 channels", {2, 8, 100, 130}, {2, 8, 1, 1}, {}, 100, 130, true},
      {"symmetric pad 1", {1, 3, 8, 8}, {2, 3, 3, 3}, {.pad_top = 1, .pad_left = 1}, 8, 8, true},
      {"pad 2 top, 0 bottom",
       {1, 3, 8, 9},
       {2, 3, 3, 3},
       {.pad_top = 2, .pad_left = 1},
       8,
       8,
       false},
      {"negative pad", {2, 2, 10, 10}, {3, 2, 3, 3}, {.pad_top = -1, .pad_left = -2}, 6, 5, false},
      {"adjoint of stride 2",
       {1, 4, 7, 6},
       {3, 4, 4, 4},
       {.stride_h = 2, .stride_w = 2, .pad_top = 3, .pad_left = 2},
       6,
       5,
       false},
  };
}

template <typename T>
void check_conv(const ConvCase& c) {
  SCOPED_TRACE(c.name);
  const Shape4 ys{c.x.n, c.w.n, c.oh, c.ow};
  const ConvShapes shapes{.x = c.x, .w = c.w, .y = ys, .bias = c.bias};
  std::unique_ptr<ConvKernel<T>> k = gpu().conv<T>(shapes, c.g);
  ASSERT_TRUE(k) << "the CUDA backend declined";
  EXPECT_TRUE(test::contains(k->name(), "cudnn")) << k->name();
  // Pointwise convs of few weights take their filter gradient from Tessera's sums (cudnn_conv.cpp).
  const bool pointwise = c.w.h == 1 && c.w.w == 1 && c.w.n * c.w.c <= 256;
  EXPECT_EQ(test::contains(k->name(), "Tessera's sums"), pointwise) << k->name();

  const Tensor<T> x = test::random_tensor<T>(c.x, 1, 1), w = test::random_tensor<T>(c.w, 1, 2);
  const Tensor<T> bias = test::random_tensor<T>({c.bias ? c.w.n : 0, 1, 1, 1}, 1, 3);
  const Tensor<T> dy = test::random_tensor<T>(ys, 1, 4);
  const Tensor<T> dx_x = on_device(x), dx_w = on_device(w), dx_bias = on_device(bias),
                  dx_dy = on_device(dy);
  const std::span<const T> no_bias;

  Tensor<T> y_ref(ys);
  reference::conv2d_forward(x, w, c.bias ? bias.span() : no_bias, y_ref, c.g);
  Tensor<T> y(ys, Layout::nchw, uninitialized, *device_allocator());
  k->forward(dx_x, dx_w, c.bias ? device_span(dx_bias) : no_bias, y);
  EXPECT_LE(test::rel_error(on_host(y).span(), y_ref.span()), tolerance<T>()) << "forward";

  Tensor<T> dxr(c.x);
  reference::conv2d_backward_data(dy, w, dxr, c.g);
  Tensor<T> dx(c.x, Layout::nchw, uninitialized, *device_allocator());
  k->backward_data(dx_dy, dx_w, dx);
  EXPECT_LE(test::rel_error(on_host(dx).span(), dxr.span()), tolerance<T>()) << "backward data";

  // backward_filter adds into what is there.
  Tensor<T> dw_ref = test::random_tensor<T>(c.w, 1, 5);
  Tensor<T> db_ref = test::random_tensor<T>(bias.shape(), 1, 6);
  Tensor<T> dw = on_device(dw_ref), db = on_device(db_ref);
  reference::conv2d_backward_filter(x, dy, dw_ref, db_ref.span(), c.g);
  k->backward_filter(
      dx_x, dx_dy, dw,
      c.bias ? std::span<T>(db.data_in(MemorySpace::device), db.size()) : std::span<T>());
  EXPECT_LE(test::rel_error(on_host(dw).span(), dw_ref.span()), tolerance<T>()) << "dw";
  if (c.bias) {
    EXPECT_LE(test::rel_error(on_host(db).span(), db_ref.span()), tolerance<T>()) << "dbias";
  }
}

TEST(CudaConv, AgreesWithTheReferenceDouble) {
  for (const ConvCase& c : conv_cases())
    check_conv<double>(c);
}
TEST(CudaConv, AgreesWithTheReferenceFloat) {
  for (const ConvCase& c : conv_cases())
    check_conv<float>(c);
}

// A box kernel writes only its box of y, reading its box of x in place.
TEST(CudaConv, BoxForwardWritesOnlyItsBox) {
  using T = double;
  const Shape4 xo{2, 3, 14, 15}, yo{2, 4, 12, 13}, xb{2, 3, 6, 7}, wb{4, 3, 3, 3}, yb{2, 4, 4, 5};
  const reference::ConvGeometry g;
  const ConvShapes shapes{.x = xb, .w = wb, .y = yb, .bias = true, .x_outer = xo, .y_outer = yo};
  std::unique_ptr<ConvKernel<T>> k = gpu().conv<T>(shapes, g);
  ASSERT_TRUE(k);
  const Tensor<T> x = test::random_tensor<T>(xo, 2, 1), w = test::random_tensor<T>(wb, 2, 2);
  const Tensor<T> bias = test::random_tensor<T>({4, 1, 1, 1}, 2, 3);
  const Tensor<T> y0 = test::random_tensor<T>(yo, 2, 4);
  Tensor<T> y = on_device(y0);
  const Tensor<T> dw = on_device(w), dbias = on_device(bias);
  k->forward_box(on_device(x), {5, 4}, dw, device_span(dbias), y, {3, 6});

  ReferenceConv<T> ref(g, shapes);
  Tensor<T> expected = y0;
  ref.forward_box(x, {5, 4}, w, bias.span(), expected, {3, 6});
  EXPECT_LE(test::rel_error(on_host(y).span(), expected.span()), 1e-12);
}

template <typename T>
void check_activations() {
  const Shape4 s{2, 3, 17, 19};
  Tensor<T> x = test::random_tensor<T>(s, 3, 1);
  x.data()[5] = T(0);  // the boundary: not positive
  const Tensor<T> dy = test::random_tensor<T>(s, 3, 2);
  for (const ActivationKind kind :
       {ActivationKind::relu, ActivationKind::leaky_relu, ActivationKind::sigmoid}) {
    SCOPED_TRACE(static_cast<int>(kind));
    auto cpu = Backend().activation<T>(kind, 0.1);
    auto dev = gpu().activation<T>(kind, 0.1);
    Tensor<T> y(s), dx(s);
    cpu->forward(x, y);
    cpu->backward(dy, dx);
    Tensor<T> yd(s, Layout::nchw, uninitialized, *device_allocator()), dxd = yd;
    dev->forward(on_device(x), yd);
    dev->backward(on_device(dy), dxd);
    if (kind == ActivationKind::sigmoid) {
      EXPECT_LE(test::rel_error(on_host(yd).span(), y.span()), 8 * tolerance<T>());
      EXPECT_LE(test::rel_error(on_host(dxd).span(), dx.span()), 8 * tolerance<T>());
    } else {
      expect_same_bits(yd, y, "activation forward");
      expect_same_bits(dxd, dx, "activation backward");
    }
  }
}
TEST(CudaPointwise, ActivationsMatchTheCpu) {
  check_activations<float>();
  check_activations<double>();
}

TEST(CudaPointwise, DropoutDropsTheSameElementsAsTheCpu) {
  using T = float;
  const Shape4 tile{2, 3, 5, 7};
  const TileOrigin at{.global = {4, 3, 20, 30}, .n = 1, .h = 9, .w = 11};
  const Tensor<T> x = test::random_tensor<T>(tile, 4, 1), dy = test::random_tensor<T>(tile, 4, 2);
  auto cpu = Backend().dropout<T>(0.3);
  auto dev = gpu().dropout<T>(0.3);
  Tensor<T> mask(tile), y(tile), dx(tile);
  cpu->forward(x, at, 77, 5, mask, y);
  cpu->backward(dy, mask, dx);
  Tensor<T> maskd(tile, Layout::nchw, uninitialized, *device_allocator()), yd = maskd, dxd = maskd;
  dev->forward(on_device(x), at, 77, 5, maskd, yd);
  dev->backward(on_device(dy), maskd, dxd);
  expect_same_bits(maskd, mask, "mask");
  expect_same_bits(yd, y, "y");
  expect_same_bits(dxd, dx, "dx");
}

template <typename T>
void check_updates() {
  const Shape4 s{1, 1, 1, 1000};
  const Tensor<T> g = test::random_tensor<T>(s, 5, 1);
  auto cpu = Backend().update<T>();
  auto dev = gpu().update<T>();
  for (const bool momentum : {false, true}) {
    Tensor<T> p = test::random_tensor<T>(s, 5, 2), buf = test::random_tensor<T>(s, 5, 3);
    Tensor<T> pd = on_device(p), bufd = on_device(buf);
    const SgdScalars<T> sgd{.weight_decay = T(0.01),
                            .momentum = T(0.9),
                            .neg_lr = T(-0.1),
                            .decay = true,
                            .first_step = false};
    cpu->sgd(p.data(), g.data(), momentum ? buf.data() : nullptr, s.numel(), sgd);
    const Tensor<T> gd = on_device(g);
    dev->sgd(pd.data_in(MemorySpace::device), gd.data_in(MemorySpace::device),
             momentum ? bufd.data_in(MemorySpace::device) : nullptr, s.numel(), sgd);
    expect_same_bits(pd, p, "sgd p");
    expect_same_bits(bufd, buf, "sgd momentum");
  }
  Tensor<T> p = test::random_tensor<T>(s, 6, 1), m = test::random_tensor<T>(s, 6, 2),
            v = test::random_tensor<T>(s, 6, 3, 0, 1);
  Tensor<T> pd = on_device(p), md = on_device(m), vd = on_device(v);
  const Tensor<T> gd = on_device(g);
  const AdamScalars<T> adam{.weight_decay = T(0.01),
                            .beta1 = T(0.9),
                            .one_minus_beta1 = T(0.1),
                            .beta2 = T(0.999),
                            .one_minus_beta2 = T(0.001),
                            .eps = T(1e-8),
                            .neg_step_size = T(-0.001),
                            .bias_correction2_sqrt = T(0.3),
                            .decay = true};
  cpu->adam(p.data(), g.data(), m.data(), v.data(), s.numel(), adam);
  dev->adam(pd.data_in(MemorySpace::device), gd.data_in(MemorySpace::device),
            md.data_in(MemorySpace::device), vd.data_in(MemorySpace::device), s.numel(), adam);
  expect_same_bits(pd, p, "adam p");
  expect_same_bits(md, m, "adam m");
  expect_same_bits(vd, v, "adam v");
}
TEST(CudaPointwise, OptimizerUpdatesMatchTheCpuBitForBit) {
  check_updates<float>();
  check_updates<double>();
}

void check_merges(const Shape4& xs, const Shape4& ys) {
  using T = double;
  const Tensor<T> x = test::random_tensor<T>(xs, 7, 1), y0 = test::random_tensor<T>(ys, 7, 2);
  auto cpu = Backend().merge<T>();
  auto dev = gpu().merge<T>();
  Tensor<T> y = y0, yd = on_device(y0);
  cpu->put_channels(x, y, 4);
  dev->put_channels(on_device(x), yd, 4);
  expect_same_bits(yd, y, "put_channels");
  Tensor<T> taken(xs), takend(xs, Layout::nchw, uninitialized, *device_allocator());
  cpu->take_channels(y0, 2, taken);
  dev->take_channels(on_device(y0), 2, takend);
  expect_same_bits(takend, taken, "take_channels");
  Tensor<T> a = test::random_tensor<T>(xs, 7, 3), ad = on_device(a);
  cpu->add(x, a);
  dev->add(on_device(x), ad);
  expect_same_bits(ad, a, "add");
  // Per-channel bias and its gradient (transposed convolutions, the head). The gradient's plane
  // sums run in double on the GPU, in chunks (planes of several chunks below): the CPU's sums in T
  // within the CPU's rounding.
  const Tensor<T> bias = test::random_tensor<T>({1, 3, 1, 1}, 7, 4);
  const Tensor<T> biasd = on_device(bias);
  cpu->add_bias(bias.span(), a);
  dev->add_bias(device_span(biasd), ad);
  expect_same_bits(ad, a, "add_bias");
  // Positive values: no cancellation, so the CPU's float sums of 19500 values are good to ~1e-5.
  const double tol = sizeof(T) == 8 ? 1e-13 : 1e-4;
  for (const Shape4& s : {xs, Shape4{2, 3, 130, 150}}) {
    const Tensor<T> g = test::random_tensor<T>(s, 7, 6, 0.5, 1.5);
    Tensor<T> db = test::random_tensor<T>({1, 3, 1, 1}, 7, 5), dbd = on_device(db);
    cpu->add_bias_grad(g, db.span());
    dev->add_bias_grad(on_device(g), dbd.span_in(MemorySpace::device));
    EXPECT_LE(test::rel_error(on_host(dbd).span(), std::as_const(db).span()), tol)
        << "add_bias_grad of " << s.str();
  }
}

TEST(CudaMerge, ChannelBlocksAndSumsMatchTheCpu) {
  check_merges({2, 3, 4, 5}, {2, 8, 4, 5});
  // A sample's channel block longer than the grid's threads (1024 blocks of 256): its threads
  // go round again.
  check_merges({1, 3, 300, 300}, {1, 8, 300, 300});
}

template <typename T>
void check_cross_entropy(const Shape4& s) {
  const Tensor<T> logits = test::random_tensor<T>(s, 9, 1, -4, 4);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(s.n * s.h * s.w));
  for (std::size_t k = 0; k < labels.size(); ++k)
    labels[k] = static_cast<std::int32_t>((k * 7) % 5);
  const T scale = T(0.125);
  Tensor<T> d(s), dd(s, Layout::nchw, *device_allocator());
  const double cpu = Backend().loss<T>()->cross_entropy(logits, labels, scale, &d);
  const double dev = gpu().loss<T>()->cross_entropy(on_device(logits), labels, scale, &dd);
  // The device's exp and log may differ from glibc's by an ulp; the pixels' losses are summed in
  // double in chunks (a different order from the CPU's).
  const double tol = sizeof(T) == 8 ? 1e-13 : 1e-6;
  EXPECT_NEAR(dev, cpu, tol * std::abs(cpu));
  EXPECT_LE(test::rel_error(on_host(dd).span(), std::as_const(d).span()), tol);
  // One kernel, called again: the same labels (kept on the device, not copied again), then
  // changed ones (copied), each against the CPU; from round 3 on staged ahead by prepare() (a
  // training step's), the same labels, changed ones, and labels prepared then settled (not
  // uploaded: the next ones must be), or prepared and then not the ones given.
  const auto loss = gpu().loss<T>();
  for (int round = 0; round < 7; ++round) {
    if (round == 2 || round == 4 || round == 6)
      for (std::size_t k = 0; k < labels.size(); k += 3)
        labels[k] = static_cast<std::int32_t>((labels[k] + 2) % 5);
    std::vector<std::int32_t> other = labels;
    other[0] = (other[0] + 1) % 5;
    if (round == 3 || round == 4) loss->prepare(labels);
    if (round == 5) {  // staged, not uploaded: the same labels again must still go up
      loss->prepare(other);
      loss->settle();
      labels = other;
    }
    if (round == 6) loss->prepare(other);
    const double want = Backend().loss<T>()->cross_entropy(logits, labels, scale, &d);
    const double got = loss->cross_entropy(on_device(logits), labels, scale, &dd);
    EXPECT_NEAR(got, want, tol * std::abs(want)) << "call " << round;
    EXPECT_LE(test::rel_error(on_host(dd).span(), std::as_const(d).span()), tol)
        << "call " << round;
  }
  // A label outside the classes (checked on the device, named by the host), through a fresh
  // kernel and through the one that holds the last labels.
  for (const std::int32_t bad : {5, -1}) {
    labels[3] = bad;
    for (const bool fresh : {true, false}) {
      try {
        if (fresh)
          (void)gpu().loss<T>()->cross_entropy(on_device(logits), labels, scale, nullptr);
        else
          (void)loss->cross_entropy(on_device(logits), labels, scale, &dd);
        ADD_FAILURE() << "a label " << bad << " outside [0, 5) was accepted";
      } catch (const Error& e) {
        test::expect_mentions(e.what(), {"label " + std::to_string(bad), "[0, 5)"});
      }
    }
  }
}
TEST(CudaLoss, CrossEntropyMatchesTheCpu) {
  for (const Shape4& s : {Shape4{2, 5, 3, 4}, Shape4{2, 5, 90, 100}}) {  // one chunk; several
    check_cross_entropy<double>(s);
    check_cross_entropy<float>(s);
  }
}

void check_halo_copies(const Shape4& s, const Box& origin, const Box& box) {
  using T = float;
  auto cpu = Backend().halo_copy<T>();
  auto dev = gpu().halo_copy<T>();
  EXPECT_EQ(dev->space(), MemorySpace::device);
  const Tensor<T> t = test::random_tensor<T>(s, 8, 1);
  const Tensor<T> td = on_device(t);
  const std::int64_t planes = s.n * s.c;

  Tensor<T> message({1, 1, 1, planes * box.size()}), messaged = on_device(message);
  cpu->pack(planes_of(t, origin), box, message.data());
  dev->pack(planes_of(td, origin), box, messaged.data_in(MemorySpace::device));
  expect_same_bits(messaged, message, "pack");

  for (const Direction how : {Direction::fill, Direction::accumulate}) {
    Tensor<T> u = test::random_tensor<T>(s, 8, 2), ud = on_device(u);
    cpu->unpack(message.data(), box, planes_of(u, origin), how);
    dev->unpack(messaged.data_in(MemorySpace::device), box, planes_of(ud, origin), how);
    expect_same_bits(ud, u, "unpack");

    Tensor<T> m = test::random_tensor<T>(s, 8, 3), md = on_device(m);
    cpu->move(planes_of(t, origin), planes_of(m, origin), box, how);
    dev->move(planes_of(td, origin), planes_of(md, origin), box, how);
    expect_same_bits(md, m, "move");
  }

  for (const Box keep : {box, Box{{0, 12}, {0, 100}}, Box{{30, 40}, {0, 5}}}) {
    Tensor<T> f = t, fd = on_device(t);
    cpu->fill_outside(planes_of(f, origin), keep, T(-7));
    dev->fill_outside(planes_of(fd, origin), keep, T(-7));
    expect_same_bits(fd, f, "fill_outside " + to_string(keep));
  }
}
// The same on a channel slice (a taken concat's input in its consumer's window: channels 2..4 of
// 6, two samples): moved into and out of, packed, unpacked, padded.
void check_halo_copies_on_slices() {
  using T = float;
  const Shape4 s{2, 3, 9, 70}, big{2, 6, 9, 70};
  const Box origin{{10, 19}, {4, 74}}, box{{12, 16}, {5, 60}};
  auto cpu = Backend().halo_copy<T>();
  auto dev = gpu().halo_copy<T>();
  ASSERT_TRUE(dev->takes_channel_slices());
  const Tensor<T> t = test::random_tensor<T>(s, 8, 4);
  const Tensor<T> td = on_device(t);
  for (const Direction how : {Direction::fill, Direction::accumulate}) {
    Tensor<T> w = test::random_tensor<T>(big, 8, 5), wd = on_device(w);
    cpu->move(planes_of(t, origin), channel_slice(planes_of(w, origin), 2, 3), box, how);
    dev->move(planes_of(td, origin), channel_slice(planes_of(wd, origin), 2, 3), box, how);
    expect_same_bits(wd, w, "move into a slice");
    Tensor<T> u = test::random_tensor<T>(s, 8, 6), ud = on_device(u);
    cpu->move(channel_slice(planes_of(std::as_const(w), origin), 2, 3), planes_of(u, origin), box,
              how);
    dev->move(channel_slice(planes_of(std::as_const(wd), origin), 2, 3), planes_of(ud, origin), box,
              how);
    expect_same_bits(ud, u, "move out of a slice");
    Tensor<T> message({1, 1, 1, s.n * s.c * box.size()}), messaged = on_device(message);
    cpu->pack(channel_slice(planes_of(std::as_const(w), origin), 1, 3), box, message.data());
    dev->pack(channel_slice(planes_of(std::as_const(wd), origin), 1, 3), box,
              messaged.data_in(MemorySpace::device));
    expect_same_bits(messaged, message, "pack a slice");
    cpu->unpack(message.data(), box, channel_slice(planes_of(w, origin), 3, 3), how);
    dev->unpack(messaged.data_in(MemorySpace::device), box,
                channel_slice(planes_of(wd, origin), 3, 3), how);
    expect_same_bits(wd, w, "unpack into a slice");
    cpu->fill_outside(channel_slice(planes_of(w, origin), 0, 3), box, T(-7));
    dev->fill_outside(channel_slice(planes_of(wd, origin), 0, 3), box, T(-7));
    expect_same_bits(wd, w, "fill_outside of a slice");
  }
}

TEST(CudaHaloCopy, MessagesMovesAndPaddingMatchTheCpu) {
  // Rows narrower than a warp (one thread per element) and wider (a thread per element of a
  // row: launch_rows).
  check_halo_copies({2, 3, 9, 11}, {{10, 19}, {4, 15}}, {{12, 16}, {5, 9}});
  check_halo_copies({2, 3, 9, 70}, {{10, 19}, {4, 74}}, {{12, 16}, {5, 60}});
  // More rows than launch_rows gives blocks: its threads go over several rows.
  check_halo_copies({1, 1, 20000, 40}, {{10, 20010}, {4, 44}}, {{12, 20000}, {5, 40}});
  // Rows wider than a block of threads (store_at's second to fourth columns of a thread: the
  // fourth from column 768 of a one-block row), with a width no multiple of four.
  check_halo_copies({2, 3, 9, 320}, {{10, 19}, {4, 324}}, {{12, 16}, {5, 310}});
  check_halo_copies({2, 3, 9, 900}, {{10, 19}, {4, 904}}, {{12, 16}, {5, 890}});
  check_halo_copies_on_slices();
}

TEST(CudaBackend, ComputesInDeviceMemory) {
  EXPECT_EQ(&gpu().allocator(), device_allocator());
  EXPECT_TRUE(test::contains(gpu().description(), "cuDNN"));
}

template <typename T>
Tensor<T> device_tensor(const Shape4& s) {
  return Tensor<T>(s, Layout::nchw, uninitialized, *device_allocator());
}

// Max pooling with ties and NaN, and average pooling, over windows with padding, strides larger
// and smaller than the kernel, and an image box smaller than x (a halo window): bit for bit
// against the reference, forward and backward (the GPU gathers what the CPU scatters).
template <typename T>
void check_pooling() {
  struct Case {
    const char* name;
    Shape4 x;
    std::int64_t oh, ow;
    reference::PoolGeometry g;
  };
  const std::vector<Case> cases = {
      {"2x2 stride 2",
       {2, 3, 8, 10},
       4,
       5,
       {.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2, .image = {{0, 8}, {0, 10}}}},
      {"3x3 stride 1 pad 1",
       {1, 2, 7, 6},
       7,
       6,
       {.kernel_h = 3, .kernel_w = 3, .pad_top = 1, .pad_left = 1, .image = {{0, 7}, {0, 6}}}},
      {"3x2 stride 2x3 pad 1x0",
       {2, 2, 9, 11},
       5,
       4,
       {.kernel_h = 3,
        .kernel_w = 2,
        .stride_h = 2,
        .stride_w = 3,
        .pad_top = 1,
        .image = {{0, 9}, {0, 11}}}},
      // Rows wider than a block of threads (store_rows' second and third columns of a thread;
      // the fourth from column 1536 of a two-block row).
      {"2x2 stride 2, 1030 columns",
       {1, 2, 4, 1030},
       2,
       515,
       {.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2, .image = {{0, 4}, {0, 1030}}}},
      {"2x2 stride 2, 1902 columns",
       {1, 2, 4, 1902},
       2,
       951,
       {.kernel_h = 2, .kernel_w = 2, .stride_h = 2, .stride_w = 2, .image = {{0, 4}, {0, 1902}}}},
      // Overlapping windows on wide rows: an input column in two windows, whose gradients the
      // GPU's backward gathers from both (the CPU scatters them).
      {"3x3 stride 2 pad 1, 1030 columns",
       {1, 2, 5, 1030},
       3,
       515,
       {.kernel_h = 3,
        .kernel_w = 3,
        .stride_h = 2,
        .stride_w = 2,
        .pad_top = 1,
        .pad_left = 1,
        .image = {{0, 5}, {0, 1030}}}},
      {"window with a halo outside the image",
       {1, 3, 10, 9},
       4,
       4,
       {.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .image = {{1, 10}, {0, 8}}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Shape4 ys{c.x.n, c.x.c, c.oh, c.ow};
    Tensor<T> x = test::random_tensor<T>(c.x, 11, 1);
    x.data()[3] = x.data()[4] = x.data()[c.x.w + 3];  // ties
    x.data()[7] = std::numeric_limits<T>::quiet_NaN();
    const Tensor<T> dy = test::random_tensor<T>(ys, 11, 2);
    for (const PoolKind kind : {PoolKind::max, PoolKind::avg}) {
      SCOPED_TRACE(kind == PoolKind::max ? "max" : "avg");
      const PoolShapes shapes{.x = c.x, .y = ys};
      auto cpu = Backend().pool<T>(kind, shapes, c.g);
      auto dev = gpu().pool<T>(kind, shapes, c.g);
      ASSERT_TRUE(dev);
      EXPECT_EQ(dev->name(), "cuda");
      Tensor<T> y(ys), dx(c.x), yd = device_tensor<T>(ys), dxd = device_tensor<T>(c.x);
      cpu->forward(x, y);
      cpu->backward(dy, dx);
      dev->forward(on_device(x), yd);
      dev->backward(on_device(dy), dxd);
      const Tensor<T> got = on_host(yd);
      for (std::size_t k = 0; k < got.size(); ++k)  // NaN == NaN here
        ASSERT_TRUE(got.data()[k] == y.data()[k] ||
                    (std::isnan(got.data()[k]) && std::isnan(y.data()[k])))
            << "forward element " << k;
      // dx outside the image is left open (pool_kernel.hpp): compare the image.
      const Tensor<T> dxh = on_host(dxd);
      for (std::int64_t p = 0; p < c.x.n * c.x.c; ++p)
        for (std::int64_t h = c.g.image.h.begin; h < c.g.image.h.end; ++h)
          for (std::int64_t w = c.g.image.w.begin; w < c.g.image.w.end; ++w) {
            const std::int64_t k = (p * c.x.h + h) * c.x.w + w;
            ASSERT_EQ(dxh.data()[k], dx.data()[k])
                << "backward plane " << p << " at " << h << ", " << w;
          }
    }
  }
}
TEST(CudaLayers, PoolingMatchesTheReferenceBitForBit) {
  check_pooling<float>();
  check_pooling<double>();
}

template <typename T>
void check_upsample(const Shape4& xs) {
  for (const reference::UpsampleGeometry g :
       {reference::UpsampleGeometry{.scale_h = 2, .scale_w = 2},
        reference::UpsampleGeometry{.scale_h = 3, .scale_w = 2, .phase_h = 2, .phase_w = 1}}) {
    SCOPED_TRACE(g.scale_h);
    const Shape4 ys{xs.n, xs.c, xs.h * g.scale_h - g.phase_h, xs.w * g.scale_w - g.phase_w};
    const Tensor<T> x = test::random_tensor<T>(xs, 12, 1), dy = test::random_tensor<T>(ys, 12, 2);
    auto cpu = Backend().upsample<T>(g);
    auto dev = gpu().upsample<T>(g);
    Tensor<T> y(ys), dx(xs), yd = device_tensor<T>(ys), dxd = device_tensor<T>(xs);
    cpu->forward(x, y);
    cpu->backward(dy, dx);
    dev->forward(on_device(x), yd);
    dev->backward(on_device(dy), dxd);
    expect_same_bits(yd, y, "upsample forward");
    expect_same_bits(dxd, dx, "upsample backward");
  }
}
TEST(CudaLayers, UpsamplingMatchesTheReferenceBitForBit) {
  // 301 and 900 columns: rows wider than a block of threads (store_rows' second to fourth
  // columns of a thread: the fourth from column 768 of a one-block row, 1536 of a two-block one).
  for (const Shape4 xs : {Shape4{2, 3, 5, 6}, Shape4{1, 2, 3, 301}, Shape4{1, 2, 3, 900}}) {
    check_upsample<float>(xs);
    check_upsample<double>(xs);
  }
}

template <typename T>
void check_head() {
  const Shape4 xs{3, 4, 5, 6};
  const Tensor<T> x = test::random_tensor<T>(xs, 13, 1);
  auto cpu_sum = Backend().spatial_sum<T>();
  auto dev_sum = gpu().spatial_sum<T>();
  const Shape4 per_plane{1, 1, 1, xs.n * xs.c};
  Tensor<T> sums(per_plane), sumsd = device_tensor<T>(per_plane);
  cpu_sum->sums(x, sums.span());
  dev_sum->sums(on_device(x), sumsd.span_in(MemorySpace::device));
  expect_same_bits(sumsd, sums, "spatial sums");
  const Tensor<T> g = test::random_tensor<T>(per_plane, 13, 2);
  const Tensor<T> gd = on_device(g);
  Tensor<T> dx(xs), dxd = device_tensor<T>(xs);
  cpu_sum->spread(g.span(), dx);
  dev_sum->spread(device_span(gd), dxd);
  expect_same_bits(dxd, dx, "spread");

  const std::int64_t n = 3, in = 7, out = 5;
  const Tensor<T> v = test::random_tensor<T>({1, 1, n, in}, 13, 3),
                  w = test::random_tensor<T>({1, 1, out, in}, 13, 4),
                  bias = test::random_tensor<T>({1, 1, 1, out}, 13, 5),
                  dy = test::random_tensor<T>({1, 1, n, out}, 13, 6);
  const Tensor<T> vd = on_device(v), wd = on_device(w), biasd = on_device(bias),
                  dyd = on_device(dy);
  auto cpu = Backend().linear<T>(in, out);
  auto dev = gpu().linear<T>(in, out);
  Tensor<T> y({1, 1, n, out}), yd = device_tensor<T>({1, 1, n, out});
  cpu->forward(v.span(), w.span(), bias.span(), y.span(), n);
  dev->forward(device_span(vd), device_span(wd), device_span(biasd),
               yd.span_in(MemorySpace::device), n);
  expect_same_bits(yd, y, "linear forward");
  Tensor<T> dv({1, 1, n, in}), dvd = device_tensor<T>({1, 1, n, in});
  cpu->backward_data(dy.span(), w.span(), dv.span(), n);
  dev->backward_data(device_span(dyd), device_span(wd), dvd.span_in(MemorySpace::device), n);
  expect_same_bits(dvd, dv, "linear backward_data");
  Tensor<T> dw = test::random_tensor<T>({1, 1, out, in}, 13, 7), db = bias;
  Tensor<T> dwd = on_device(dw), dbd = on_device(db);
  cpu->backward_weights(v.span(), dy.span(), dw.span(), db.span(), n);
  dev->backward_weights(device_span(vd), device_span(dyd), dwd.span_in(MemorySpace::device),
                        dbd.span_in(MemorySpace::device), n);
  expect_same_bits(dwd, dw, "linear weight gradient");
  expect_same_bits(dbd, db, "linear bias gradient");
}
TEST(CudaLayers, HeadMatchesTheReferenceBitForBit) {
  check_head<float>();
  check_head<double>();
}

// Batch norm's local halves: per-channel sums (a tree per plane on the GPU, in double: within
// double rounding of the CPU's), and the normalisation and input gradient from given statistics.
template <typename T>
void check_batch_norm(const Shape4& s) {
  const Tensor<T> x = test::random_tensor<T>(s, 14, 1, 2, 5), dy = test::random_tensor<T>(s, 14, 2);
  const Tensor<T> weight = test::random_tensor<T>({1, 1, 1, s.c}, 14, 3),
                  bias = test::random_tensor<T>({1, 1, 1, s.c}, 14, 4);
  const Tensor<T> xd = on_device(x), dyd = on_device(dy), weightd = on_device(weight),
                  biasd = on_device(bias);
  auto cpu = Backend().batch_norm<T>();
  auto dev = gpu().batch_norm<T>();
  const auto C = static_cast<std::size_t>(s.c);
  std::vector<double> sum(C), sumd(C), sq(C), sqd(C);
  cpu->sum(x, Layout::nchw, sum);
  dev->sum(xd, Layout::nchw, sumd);
  EXPECT_LE(test::rel_error(sumd, sum), 1e-14) << "sum";
  std::vector<double> mean(C), invstd(C);
  for (std::size_t c = 0; c < C; ++c)
    mean[c] = sum[c] / double(s.n * s.h * s.w);
  cpu->centered_square_sum(x, Layout::nchw, mean, sq);
  dev->centered_square_sum(xd, Layout::nchw, mean, sqd);
  EXPECT_LE(test::rel_error(sqd, sq), 1e-13) << "centered square sum";
  // Both sums in one pass: the two passes' bits (the base class's default runs them), within
  // double rounding of the CPU's.
  {
    std::vector<double> shift(C), one(C), one_sq(C), two(C), two_sq(C), cpu_one(C), cpu_sq(C);
    for (std::size_t c = 0; c < C; ++c)
      shift[c] = 1.5 + 0.25 * double(c);
    dev->shifted_sums(xd, Layout::nchw, shift, one, one_sq);
    dev->BatchNormKernel<T>::shifted_sums(xd, Layout::nchw, shift, two, two_sq);
    EXPECT_EQ(one, two) << "shifted sums";
    EXPECT_EQ(one_sq, two_sq) << "shifted square sums";
    cpu->shifted_sums(x, Layout::nchw, shift, cpu_one, cpu_sq);
    EXPECT_LE(test::rel_error(one, cpu_one), 1e-12) << "shifted sums against the CPU's";
    EXPECT_LE(test::rel_error(one_sq, cpu_sq), 1e-13) << "shifted square sums against the CPU's";
  }
  for (std::size_t c = 0; c < C; ++c)
    invstd[c] = 1 / std::sqrt(sq[c] / double(s.n * s.h * s.w) + 1e-5);
  const reference::BatchNormStats stats{mean, invstd};
  Tensor<T> y(s), yd = device_tensor<T>(s);
  cpu->forward(x, Layout::nchw, stats, weight.span(), bias.span(), y);
  dev->forward(xd, Layout::nchw, stats, device_span(weightd), device_span(biasd), yd);
  expect_same_bits(yd, y, "batch-norm forward");
  std::vector<double> a(C), b(C), ad(C), bd(C);
  cpu->backward_sums(x, dy, Layout::nchw, stats, a, b);
  dev->backward_sums(xd, dyd, Layout::nchw, stats, ad, bd);
  EXPECT_LE(test::rel_error(ad, a), 1e-13) << "sum of dy";
  EXPECT_LE(test::rel_error(bd, b), 1e-13) << "sum of dy * xhat";
  for (std::size_t c = 0; c < C; ++c) {
    a[c] /= double(s.n * s.h * s.w);
    b[c] /= double(s.n * s.h * s.w);
  }
  Tensor<T> dx(s), dxd = device_tensor<T>(s);
  cpu->backward_data(x, dy, Layout::nchw, stats, weight.span(), a, b, dx);
  dev->backward_data(xd, dyd, Layout::nchw, stats, device_span(weightd), a, b, dxd);
  expect_same_bits(dxd, dx, "batch-norm input gradient");
}
TEST(CudaLayers, BatchNormMatchesTheCpu) {
  // Planes longer than a block; planes of several chunks (kernels/cuda/layers.cu).
  for (const Shape4& s : {Shape4{3, 4, 37, 29}, Shape4{2, 3, 130, 150}}) {
    check_batch_norm<float>(s);
    check_batch_norm<double>(s);
  }
}

// Training alone (the statistics and the running statistics kept on the device, no host
// wait): three steps, each against the same kernel's host path as BatchNorm2d drives it on a grid
// (shifted_sums, the moments on the host, a second pass where they are not conditioned, forward;
// backward_sums, the gradients on the host, backward_data): the same bits everywhere. With an
// `offset` far from the spread the first step's one-pass moments around a running mean of 0 are
// not conditioned (the second pass), the second step's are (momentum 1: the running mean is the
// first batch's mean), and before the third the host writes new running statistics, which the
// kernel loads (back to 0: the second pass again).
template <typename T>
void check_batch_norm_alone(const Shape4& s, double offset) {
  const auto C = static_cast<std::size_t>(s.c);
  const double count = double(s.n * s.h * s.w);
  const BatchNormTraining training{
      .count = count, .eps = 1e-5, .momentum = offset != 0 ? 1.0 : 0.1};
  const Tensor<T> weight = test::random_tensor<T>({1, 1, 1, s.c}, 15, 3),
                  bias = test::random_tensor<T>({1, 1, 1, s.c}, 15, 4);
  const Tensor<T> weightd = on_device(weight), biasd = on_device(bias);
  Tensor<T> running_mean({1, 1, 1, s.c}), running_var({1, 1, 1, s.c}, T(1));
  Tensor<T> bias_grad = test::random_tensor<T>({1, 1, 1, s.c}, 15, 5),
            weight_grad = test::random_tensor<T>({1, 1, 1, s.c}, 15, 6);
  Tensor<T> bias_gradd = on_device(bias_grad), weight_gradd = on_device(weight_grad);
  auto host_path = gpu().batch_norm<T>();
  auto alone = gpu().batch_norm<T>();
  ASSERT_TRUE(alone->trains_alone());
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step == 2) {
      running_mean.fill(T(0));
      running_var.fill(T(2));
    }
    const Tensor<T> x = test::random_tensor<T>(s, 15, 10 + step, offset, offset + 3),
                    dy = test::random_tensor<T>(s, 15, 20 + step);
    const Tensor<T> xd = on_device(x), dyd = on_device(dy);
    // The host path.
    std::vector<double> mean(C), invstd(C);
    Tensor<T> want_mean = running_mean, want_var = running_var;
    bool second_pass = false;
    batch_statistics(*host_path, xd, Layout::nchw, training, want_mean.span(), want_var.span(),
                     mean, invstd, [&](std::span<double> v) { second_pass = v.size() == C; });
    EXPECT_EQ(second_pass, offset != 0 && step != 1) << "the case meant to test that";
    const reference::BatchNormStats stats{mean, invstd};
    Tensor<T> want_y = device_tensor<T>(s), want_dx = device_tensor<T>(s);
    host_path->forward(xd, Layout::nchw, stats, device_span(weightd), device_span(biasd), want_y);
    std::vector<double> a(C), b(C);
    host_path->backward_sums(xd, dyd, Layout::nchw, stats, a, b);
    Tensor<T> want_bias_grad = bias_grad, want_weight_grad = weight_grad;
    for (std::size_t c = 0; c < C; ++c) {
      want_bias_grad.data()[c] += static_cast<T>(a[c]);
      want_weight_grad.data()[c] += static_cast<T>(b[c]);
      a[c] /= count;
      b[c] /= count;
    }
    host_path->backward_data(xd, dyd, Layout::nchw, stats, device_span(weightd), a, b, want_dx);
    // Alone: the running statistics loaded at the first step only.
    Tensor<T> y = device_tensor<T>(s), dx = device_tensor<T>(s);
    alone->train_forward_alone(xd, Layout::nchw, training, std::as_const(running_mean).span(),
                               std::as_const(running_var).span(), step != 1, device_span(weightd),
                               device_span(biasd), y);
    alone->train_backward_alone(xd, dyd, Layout::nchw, device_span(weightd), bias_gradd,
                                weight_gradd, dx);
    expect_same_bits(y, on_host(want_y), "forward");
    expect_same_bits(dx, on_host(want_dx), "input gradient");
    expect_same_bits(bias_gradd, want_bias_grad, "bias gradient");
    expect_same_bits(weight_gradd, want_weight_grad, "weight gradient");
    Tensor<T> got_mean({1, 1, 1, s.c}), got_var({1, 1, 1, s.c});
    alone->store_running(got_mean.span(), got_var.span());
    for (std::size_t c = 0; c < C; ++c) {
      EXPECT_EQ(got_mean.data()[c], want_mean.data()[c]) << "running mean " << c;
      EXPECT_EQ(got_var.data()[c], want_var.data()[c]) << "running variance " << c;
    }
    running_mean = want_mean;
    running_var = want_var;
    bias_grad = want_bias_grad;
    weight_grad = want_weight_grad;
  }
}
TEST(CudaLayers, BatchNormTrainsAloneAsTheHostPathComputes) {
  for (const Shape4& s : {Shape4{3, 4, 37, 29}, Shape4{2, 3, 130, 150}})
    for (double offset : {0.0, 1e4}) {
      SCOPED_TRACE(s.str() + ", offset " + std::to_string(offset));
      check_batch_norm_alone<float>(s, offset);
      check_batch_norm_alone<double>(s, offset);
    }
}

}  // namespace
}  // namespace tessera
