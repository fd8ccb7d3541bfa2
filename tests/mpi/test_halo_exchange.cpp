#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "mpi_test.hpp"
#include "tessera/collectives.hpp"
#include "tessera/dist_tensor.hpp"
#include "tessera/error.hpp"
#include "tessera/halo_exchange.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/partition.hpp"
#include "tessera/random.hpp"

namespace tessera {
namespace {

struct Geometry {
  Shape4 shape;  // global input
  WindowAxis ah, aw;
};

// The exchange of a conv with this geometry on the test grid, as Conv2d builds it.
template <typename T = double>
struct ExchangeSetup {
  const Comm& grid = test::world();
  Distribution in;
  std::optional<HaloExchange<T>> exchange;

  // `copies` and `memory` as HaloExchange takes them (the CPU's when left out).
  explicit ExchangeSetup(const Geometry& g, std::unique_ptr<HaloCopyKernel<T>> copies = nullptr,
                         Allocator* memory = nullptr) {
    in = {g.shape, grid.shape(), grid.coords()};
    const Shape4 out_shape{g.shape.n, 1, window_output_extent(g.shape.h, g.ah),
                           window_output_extent(g.shape.w, g.aw)};
    const Distribution out = in.with_shape(out_shape);
    std::vector<Box> owned, windows;
    for (int i = 0; i < grid.shape().h; ++i)
      for (int j = 0; j < grid.shape().w; ++j) {
        owned.push_back(in.tile_of(i, j));
        windows.push_back(
            {input_window(out.tile_of(i, j).h, g.ah), input_window(out.tile_of(i, j).w, g.aw)});
      }
    exchange.emplace(make_halo_plan(owned, windows, grid.spatial_rank(in.me.i, in.me.j)), grid, 1,
                     "layer 'test'", 0, std::move(copies), memory);
  }
  Shape4 window_shape() const {
    const Shape4 l = in.local_shape();
    const Box& w = exchange->plan().window;
    return {l.n, l.c, w.h.size(), w.w.size()};
  }
  // A tile and a window-shaped gradient of values in [-0.5, 0.5), different on every rank.
  std::pair<Tensor<T>, Tensor<T>> random_tile_and_window(std::uint64_t stream) const {
    const auto salt = static_cast<std::uint64_t>(grid.rank()) << 40;
    Tensor<T> x(in.local_shape()), y(window_shape());
    for (std::size_t k = 0; k < x.span().size(); ++k)
      x.span()[k] = T(uniform01(1, stream, salt + k) - 0.5);
    for (std::size_t k = 0; k < y.span().size(); ++k)
      y.span()[k] = T(uniform01(2, stream, salt + k) - 0.5);
    return {std::move(x), std::move(y)};
  }
};

std::vector<Geometry> geometries() {
  std::vector<Geometry> out;
  for (auto [H, W] : {std::pair{17, 15}, std::pair{9, 10}})
    for (std::int64_t k : {1, 2, 3, 5, 7})
      for (std::int64_t s : {1, 2, 3})
        for (std::int64_t d : {1, 2})
          for (std::int64_t p : {std::int64_t{0}, k / 2 * d, std::int64_t{3}}) {
            const WindowAxis a{
                .kernel = k, .stride = s, .pad_begin = p, .pad_end = p, .dilation = d};
            const Geometry g{{3, 2, H, W}, a, a};
            const auto grid = test::test_grid();
            if (window_output_extent(H, a) < grid.h || window_output_extent(W, a) < grid.w ||
                g.shape.n < grid.n)
              continue;
            out.push_back(g);
          }
  return out;
}

// Global coordinates encoded in the value, so a misplaced element is caught.
double code(std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) {
  return 1 + n * 1e6 + c * 1e4 + h * 100 + w;
}

TEST(HaloExchange, FillPutsEveryGlobalElementInPlaceAndZerosOutsideTheImage) {
  for (const Geometry& g : geometries()) {
    ExchangeSetup<> s(g);
    Tensor<double> tile(s.in.local_shape());
    const Range ns = s.in.samples(), hs = s.in.rows(), ws = s.in.cols();
    for (std::int64_t n = 0; n < ns.size(); ++n)
      for (std::int64_t c = 0; c < g.shape.c; ++c)
        for (std::int64_t h = 0; h < hs.size(); ++h)
          for (std::int64_t w = 0; w < ws.size(); ++w)
            tile.at(n, c, h, w) = code(ns.begin + n, c, hs.begin + h, ws.begin + w);
    Tensor<double> window(s.window_shape(), -1.0);
    s.exchange->fill(tile, window);
    const Box& wb = s.exchange->plan().window;
    std::int64_t wrong = 0;
    for (std::int64_t n = 0; n < ns.size(); ++n)
      for (std::int64_t c = 0; c < g.shape.c; ++c)
        for (std::int64_t h = wb.h.begin; h < wb.h.end; ++h)
          for (std::int64_t w = wb.w.begin; w < wb.w.end; ++w) {
            const bool inside = h >= 0 && h < g.shape.h && w >= 0 && w < g.shape.w;
            const double want = inside ? code(ns.begin + n, c, h, w) : 0.0;
            wrong += window.at(n, c, h - wb.h.begin, w - wb.w.begin) != want;
          }
    EXPECT_EQ(wrong, 0) << "kernel " << g.ah.kernel << " stride " << g.ah.stride << " dilation "
                        << g.ah.dilation << " padding " << g.ah.pad_begin << " image " << g.shape.h
                        << "x" << g.shape.w;
  }
}

// accumulate is the adjoint of fill: <fill(x), y> == <x, accumulate(y)>, summed over ranks.
TEST(HaloExchange, AccumulateIsTheAdjointOfFill) {
  std::uint64_t stream = 0;
  for (const Geometry& g : geometries()) {
    ExchangeSetup<> s(g);
    ++stream;
    const auto [x, y] = s.random_tile_and_window(stream);
    Tensor<double> fx(s.window_shape());
    s.exchange->fill(x, fx);
    Tensor<double> ay(s.in.local_shape());
    s.exchange->accumulate(y, ay);
    double sums[2] = {0, 0};
    for (std::size_t k = 0; k < y.span().size(); ++k)
      sums[0] += fx.span()[k] * y.span()[k];
    for (std::size_t k = 0; k < x.span().size(); ++k)
      sums[1] += x.span()[k] * ay.span()[k];
    allreduce_sum(s.grid, std::span<double>(sums, 2));
    EXPECT_NEAR(sums[0], sums[1], 1e-12 * std::max(1.0, std::abs(sums[0])))
        << "kernel " << g.ah.kernel << " stride " << g.ah.stride << " dilation " << g.ah.dilation;
  }
}

// A window in nChw16c holds exactly the values of the NCHW one, and accumulating from it gives the
// same tile gradient bit for bit, whatever the tile's layout: the exchange converts while it
// copies.
template <typename T>
void expect_blocked_windows_hold_the_same_values() {
  std::uint64_t stream = 100;
  for (const Geometry& base : geometries()) {
    if (base.ah.kernel != 3 && base.ah.kernel != 5) continue;
    Geometry g = base;
    g.shape.c = 32;  // two channel blocks
    ExchangeSetup<T> s(g);
    ++stream;
    const auto [x, y] = s.random_tile_and_window(stream);
    Tensor<T> plain(s.window_shape(), -1.0), blocked(s.window_shape(), Layout::nchw16c, -1.0);
    s.exchange->fill(x, plain);
    Tensor<T> ay_plain(s.in.local_shape()), ay_blocked(s.in.local_shape());
    s.exchange->accumulate(y, ay_plain);
    s.exchange->set_window_layout(Layout::nchw16c);
    s.exchange->fill(x, blocked);
    s.exchange->accumulate(to_layout(y, Layout::nchw16c), ay_blocked);
    const Tensor<T> back = to_layout(blocked, Layout::nchw);
    EXPECT_TRUE(std::equal(back.span().begin(), back.span().end(), plain.span().begin()))
        << "fill, kernel " << g.ah.kernel << " stride " << g.ah.stride;
    EXPECT_TRUE(
        std::equal(ay_blocked.span().begin(), ay_blocked.span().end(), ay_plain.span().begin()))
        << "accumulate, kernel " << g.ah.kernel << " stride " << g.ah.stride;
    // Tiles in nchw16c too (a conv's output handed on as oneDNN wrote it): both sides blocked.
    Tensor<T> both(s.window_shape(), Layout::nchw16c, -1.0),
        ay_both(s.in.local_shape(), Layout::nchw16c);
    s.exchange->fill(to_layout(x, Layout::nchw16c), both);
    s.exchange->accumulate(to_layout(y, Layout::nchw16c), ay_both);
    EXPECT_TRUE(std::equal(both.span().begin(), both.span().end(), blocked.span().begin()))
        << "fill from an nchw16c tile, kernel " << g.ah.kernel << " stride " << g.ah.stride;
    const Tensor<T> ay_back = to_layout(ay_both, Layout::nchw);
    EXPECT_TRUE(std::equal(ay_back.span().begin(), ay_back.span().end(), ay_plain.span().begin()))
        << "accumulate into an nchw16c tile, kernel " << g.ah.kernel << " stride " << g.ah.stride;
  }
}

TEST(HaloExchange, ChannelBlockedWindowsHoldTheSameValues) {
  expect_blocked_windows_hold_the_same_values<double>();
  expect_blocked_windows_hold_the_same_values<float>();
}

// A window of 8, 12, 24 or 40 channels in nChw16c pads its last block (Conv2d uses such windows):
// it holds the NCHW window's values, accumulating from it gives the same tile gradient bit for
// bit, and the padding channels get nothing but the zeros of the window's padding outside the
// image (3 samples: blocks of one sample never run into the next).
template <typename T>
void expect_padded_windows_hold_the_same_values() {
  std::uint64_t stream = 300;
  for (const Geometry& base : geometries()) {
    if (base.ah.kernel != 3) continue;
    for (std::int64_t channels : {8, 12, 24, 40}) {
      Geometry g = base;
      g.shape.c = channels;
      ExchangeSetup<T> s(g);
      ++stream;
      const auto [x, y] = s.random_tile_and_window(stream);
      Tensor<T> plain(s.window_shape(), -1.0);
      s.exchange->fill(x, plain);
      Tensor<T> ay_plain(s.in.local_shape());
      s.exchange->accumulate(y, ay_plain);
      s.exchange->set_window_layout(Layout::nchw16c);
      Tensor<T> padded(s.window_shape(), Layout::nchw16c, T(-7));
      s.exchange->fill(x, padded);
      Tensor<T> ay_padded(s.in.local_shape());
      s.exchange->accumulate(to_layout(y, Layout::nchw16c), ay_padded);
      const std::string what = std::to_string(channels) + " channels, kernel " +
                               std::to_string(g.ah.kernel) + " stride " +
                               std::to_string(g.ah.stride);
      const Tensor<T> back = to_layout(padded, Layout::nchw);
      EXPECT_TRUE(std::equal(back.span().begin(), back.span().end(), plain.span().begin()))
          << "fill, " << what;
      EXPECT_TRUE(
          std::equal(ay_padded.span().begin(), ay_padded.span().end(), ay_plain.span().begin()))
          << "accumulate, " << what;
      const Shape4 ws = s.window_shape();
      int touched = 0;
      for (std::int64_t n = 0; n < ws.n; ++n)
        for (std::int64_t c = ws.c; c < channel_blocks(ws.c) * kBlock; ++c)
          for (std::int64_t h = 0; h < ws.h; ++h)
            for (std::int64_t w = 0; w < ws.w; ++w)
              touched += padded.data()[blocked_offset(ws, kBlock, n, c, h, w)] != T(-7) &&
                         padded.data()[blocked_offset(ws, kBlock, n, c, h, w)] != T(0);
      EXPECT_EQ(touched, 0) << "padding channels given values, " << what;
      s.exchange->set_window_layout(Layout::nchw);
    }
  }
}

TEST(HaloExchange, ChannelPaddedWindowsHoldTheSameValues) {
  expect_padded_windows_hold_the_same_values<double>();
  expect_padded_windows_hold_the_same_values<float>();
}

// Accumulating over a tile gradient's old values (Into::overwrite, as layers do into a fresh
// tensor) gives, bit for bit, what adding into zeros gives.
TEST(HaloExchange, AccumulateCanOverwriteTheTile) {
  std::uint64_t stream = 200;
  for (const Geometry& g : geometries()) {
    ExchangeSetup<> s(g);
    ++stream;
    const Tensor<double> y = s.random_tile_and_window(stream).second;
    Tensor<double> added(s.in.local_shape()), overwritten(s.in.local_shape(), 123.0);
    s.exchange->accumulate(y, added);
    auto r = s.exchange->start_accumulate(y, overwritten, Into::overwrite);
    s.exchange->finish(r);
    EXPECT_TRUE(std::equal(added.span().begin(), added.span().end(), overwritten.span().begin()))
        << "kernel " << g.ah.kernel << " stride " << g.ah.stride << " dilation " << g.ah.dilation
        << " padding " << g.ah.pad_begin;
  }
}

TEST(HaloExchange, SplitPhaseRefusesASecondExchangeInFlight) {
  const WindowAxis a{.kernel = 3, .pad_begin = 1, .pad_end = 1};
  ExchangeSetup<> s({{3, 2, 17, 15}, a, a});
  Tensor<double> x(s.in.local_shape(), 1.0), window(s.window_shape());
  auto request = s.exchange->start_fill(x, window);
  Tensor<double> other(s.window_shape());
  EXPECT_THROW(s.exchange->start_fill(x, other), Error);
  s.exchange->finish(request);
  EXPECT_THROW(s.exchange->finish(request), Error);  // already finished
  s.exchange->fill(x, window);                       // usable again
}

// Queued uploads of an emulated device (below): the host bytes each read, and what they held.
using QueuedUploads = std::vector<std::pair<const void*, std::vector<unsigned char>>>;

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

// Host memory that counts the bytes taken from it, and the blocks freed while an upload queued
// from them (`queued`, when set) has not been waited for.
class CountingHostMemory final : public Allocator {
 public:
  MemorySpace space() const override { return MemorySpace::host; }
  void* allocate(std::size_t bytes) override {
    allocated += static_cast<std::int64_t>(bytes);
    return host_allocator().allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    if (queued != nullptr)
      for (const auto& [at, held] : *queued)
        if (overlaps(p, bytes, at, held.size())) ++freed_while_queued;
    host_allocator().deallocate(p, bytes);
  }
  void copy(void* dst, const void* src, std::size_t bytes) const override {
    host_allocator().copy(dst, src, bytes);
  }
  std::int64_t allocated = 0;
  const QueuedUploads* queued = nullptr;
  int freed_while_queued = 0;
};

// Emulated device memory whose staging memory is counted, as a GPU's is page-locked. Its ordered
// copies are done at once (as a device whose queue is empty), but it keeps what each ordered
// upload read until wait_ordered, and there compares: a write of other bytes in between shows
// (the contract a GPU's queued copy needs, Allocator::upload_ordered), as does the staging
// memory freed in between.
class DeviceWithStaging final : public Allocator {
 public:
  DeviceWithStaging() { staging_memory.queued = &queued; }
  void upload_ordered(void* dst, const void* host_src, std::size_t bytes) const override {
    upload(dst, host_src, bytes);
    const auto* from = static_cast<const unsigned char*>(host_src);
    queued.push_back({host_src, std::vector<unsigned char>(from, from + bytes)});
  }
  // A download queued after an upload from the same host bytes runs after it on the device: what
  // it writes is expected there, but the host still may not write them before wait_ordered.
  void download_ordered(void* host_dst, const void* src, std::size_t bytes) const override {
    download(host_dst, src, bytes);
    for (auto& [at, expected] : queued)
      if (overlaps(host_dst, bytes, at, expected.size()))
        std::memcpy(expected.data(), at, expected.size());
  }
  void wait_ordered() const override {
    for (const auto& [at, bytes] : queued)
      if (std::memcmp(at, bytes.data(), bytes.size()) != 0) ++overwritten;
    queued.clear();
  }
  mutable QueuedUploads queued;
  mutable int overwritten = 0;  // queued uploads whose source changed before wait_ordered

  MemorySpace space() const override { return device().space(); }
  void* allocate(std::size_t bytes) override { return device().allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) noexcept override { device().deallocate(p, bytes); }
  void copy(void* dst, const void* src, std::size_t bytes) const override {
    device().copy(dst, src, bytes);
  }
  bool host_accessible() const override { return device().host_accessible(); }
  Allocator& staging() const override { return staging_memory; }
  mutable CountingHostMemory staging_memory;

 private:
  static Allocator& device() { return emulated_device_allocator(); }
};

// Device halos that the MPI transport sends through host copies take those copies from the device
// allocator's staging memory; a transport that reaches the device memory (the emulated one) takes
// none. Either way the window is what the host exchange assembles.
TEST(HaloExchange, StagesDeviceBoxesInTheDeviceAllocatorsStagingMemory) {
  const WindowAxis a{.kernel = 3, .pad_begin = 1, .pad_end = 1};
  const Geometry g{{3, 2, 17, 15}, a, a};
  DeviceWithStaging device;
  ExchangeSetup<> on_host(g);
  ExchangeSetup<> on_device(g, emulated_backend().halo_copy<double>(), &device);
  const Tensor<double> tile = on_host.random_tile_and_window(7).first;
  Tensor<double> want(on_host.window_shape());
  on_host.exchange->fill(tile, want);
  const Tensor<double> device_tile = copy_to(tile, device);
  Tensor<double> device_window(on_device.window_shape(), Layout::nchw, uninitialized, device);
  on_device.exchange->fill(device_tile, device_window);
  const Tensor<double> got = copy_to(device_window, host_allocator());
  EXPECT_TRUE(std::equal(want.span().begin(), want.span().end(), got.span().begin()));

  const HaloPlan& plan = on_device.exchange->plan();
  std::int64_t host_copies = 0;
  for (const auto* transfers : {&plan.recv, &plan.send})
    for (const HaloTransfer& t : *transfers)
      host_copies += tile.shape().n * tile.shape().c * t.box.size() *
                     static_cast<std::int64_t>(sizeof(double));
  const bool staged = !test::world().reaches(MemorySpace::device);
  EXPECT_EQ(device.staging_memory.allocated, staged ? host_copies : 0)
      << (staged ? "staged" : "direct") << " transport";
}

// Through a staged transport, finish() queues the uploads of received boxes and returns (the
// host goes on queueing kernels); the next exchange waits for them before messages land in their
// buffers again, and before it frees them for a batch of another size. Every exchange sends other
// values, so a buffer written before the wait shows. Two geometries: halos on every side, and a
// 2x2 kernel without padding, whose windows reach only right and down, so that some ranks
// receive without sending (and the reverse).
TEST(HaloExchange, QueuesTheUploadsOfStagedBoxesAndWaitsBeforeReusingTheirBuffers) {
  if (test::world().reaches(MemorySpace::device)) GTEST_SKIP() << "the transport is not staged";
  const WindowAxis around{.kernel = 3, .pad_begin = 1, .pad_end = 1};
  const WindowAxis ahead{.kernel = 2};
  for (const WindowAxis& a : {around, ahead}) {
    const Geometry g{{3, 2, 17, 15}, a, a};
    DeviceWithStaging device;
    ExchangeSetup<> on_host(g);
    ExchangeSetup<> on_device(g, emulated_backend().halo_copy<double>(), &device);
    const HaloPlan& plan = on_device.exchange->plan();
    const auto salt = static_cast<std::uint64_t>(test::world().rank()) << 40;
    for (std::uint64_t round = 0; round < 4; ++round) {
      const std::string where =
          "kernel " + std::to_string(a.kernel) + ", round " + std::to_string(round);
      // Batches of 2 and 1 samples: the buffers are sized anew every other round.
      Shape4 tile_shape = on_host.in.local_shape(), window_shape = on_host.window_shape();
      tile_shape.n = window_shape.n = 2 - static_cast<std::int64_t>(round / 2);
      Tensor<double> tile(tile_shape), grad(window_shape);
      for (std::size_t k = 0; k < tile.span().size(); ++k)
        tile.span()[k] = uniform01(1, 30 + round, salt + k) - 0.5;
      for (std::size_t k = 0; k < grad.span().size(); ++k)
        grad.span()[k] = uniform01(2, 30 + round, salt + k) - 0.5;
      const Tensor<double> device_tile = copy_to(tile, device);
      const Tensor<double> device_grad = copy_to(grad, device);
      Tensor<double> window(window_shape, Layout::nchw, uninitialized, device);
      Tensor<double> tile_grad(tile_shape, Layout::nchw, uninitialized, device);
      // Two fills in a row (as predict's forward passes): a rank that receives without sending
      // has no downloads of its own to wait for before its second fill.
      Tensor<double> first_window(window_shape, Layout::nchw, uninitialized, device);
      for (Tensor<double>* w : {&first_window, &window}) {
        auto fill = on_device.exchange->start_fill(device_tile, *w);
        EXPECT_TRUE(device.queued.empty()) << where << ": start_fill did not wait";
        on_device.exchange->finish(fill);
        EXPECT_EQ(device.queued.size(), plan.recv.size())
            << where << ": the fill's uploads were not queued";
      }
      auto back = on_device.exchange->start_accumulate(device_grad, tile_grad, Into::overwrite);
      EXPECT_TRUE(device.queued.empty()) << where << ": start_accumulate did not wait";
      on_device.exchange->finish(back);
      EXPECT_EQ(device.queued.size(), plan.send.size())
          << where << ": the accumulate's uploads were not queued";

      Tensor<double> want_window(window_shape), want_grad(tile_shape);
      on_host.exchange->fill(tile, want_window);
      on_host.exchange->accumulate(grad, want_grad);
      for (const Tensor<double>* w : {&first_window, &window}) {
        const Tensor<double> got_window = copy_to(*w, host_allocator());
        EXPECT_TRUE(std::equal(want_window.span().begin(), want_window.span().end(),
                               got_window.span().begin()))
            << where;
      }
      const Tensor<double> got_grad = copy_to(tile_grad, host_allocator());
      EXPECT_TRUE(
          std::equal(want_grad.span().begin(), want_grad.span().end(), got_grad.span().begin()))
          << where;
    }
    on_device.exchange.reset();  // waits for the last uploads
    EXPECT_TRUE(device.queued.empty());
    EXPECT_EQ(device.overwritten, 0) << "kernel " << a.kernel;
    EXPECT_EQ(device.staging_memory.freed_while_queued, 0) << "kernel " << a.kernel;
  }
}

}  // namespace
}  // namespace tessera
