// The CPU halo copies of include/tessera/kernels/halo_copy.hpp.
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "tessera/kernels/halo_copy.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

// Runs this short are copied with plain stores even into a large target: a streaming store of
// part of a cache line costs more than it saves.
constexpr std::int64_t kStreamRun = 64;

// Copies n values with streaming stores (SSE2's, 16 bytes at a time where `out` is so aligned;
// plain stores for the few values before and after): the target's lines are not read first. The
// caller fences (fence_streams) before the values are read elsewhere.
template <typename T>
void stream_copy(const T* in, T* out, std::int64_t n) {
#if defined(__x86_64__)
  constexpr std::int64_t per = 16 / sizeof(T);
  std::int64_t k = 0;
  for (; k < n && reinterpret_cast<std::uintptr_t>(out + k) % 16 != 0; ++k)
    out[k] = in[k];
  for (; k + per <= n; k += per)
    _mm_stream_si128(reinterpret_cast<__m128i*>(out + k),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + k)));
  for (; k < n; ++k)
    out[k] = in[k];
#else
  std::copy(in, in + n, out);
#endif
}

void fence_streams() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// Copies (fill) or adds (accumulate) `n` values `in_step` apart to `n` places `out_step` apart;
// a long contiguous copy with streaming stores when `stream`.
template <typename T>
void move_row(const T* in, std::int64_t in_step, T* out, std::int64_t out_step, std::int64_t n,
              Direction how, bool stream = false) {
  if (in_step == 1 && out_step == 1) {
    if (how == Direction::fill) {
      if (stream && n >= kStreamRun)
        stream_copy(in, out, n);
      else if (n >= kStreamRun)
        std::copy(in, in + n, out);
      else  // a few values (a column strip's row): no call to memmove
        for (std::int64_t k = 0; k < n; ++k)
          out[k] = in[k];
    } else {
      for (std::int64_t k = 0; k < n; ++k)
        out[k] += in[k];
    }
  } else if (how == Direction::fill) {
    for (std::int64_t k = 0; k < n; ++k)
      out[k * out_step] = in[k * in_step];
  } else {
    for (std::int64_t k = 0; k < n; ++k)
      out[k * out_step] += in[k * in_step];
  }
}

// One row of a full block of B planes from NCHW (B rows, `plain`) into a blocked layout of B
// channels (one interleaved row, `blocked`), through tiles of 16 columns: the B plain rows are
// read and the interleaved row written contiguously, with sizes the compiler knows.
template <std::int64_t B, typename T>
void interleave_row(const T* const* plain, T* blocked, std::int64_t n, Direction how, bool stream) {
  constexpr std::int64_t kTile = 16;
  T tile[kTile * B];
  for (std::int64_t w0 = 0; w0 < n; w0 += kTile) {
    const std::int64_t m = std::min(kTile, n - w0);
    for (std::int64_t p = 0; p < B; ++p)
      for (std::int64_t k = 0; k < m; ++k)
        tile[k * B + p] = plain[p][w0 + k];
    move_row(static_cast<const T*>(tile), 1, blocked + w0 * B, 1, m * B, how, stream);
  }
}

// The inverse: one row of a full block of B channels (`blocked`) into B plain rows, through the
// same tiles of 16 columns.
template <std::int64_t B, typename T>
void deinterleave_row(const T* blocked, T* const* plain, std::int64_t n, Direction how) {
  constexpr std::int64_t kTile = 16;
  T tile[kTile * B];
  for (std::int64_t w0 = 0; w0 < n; w0 += kTile) {
    const std::int64_t m = std::min(kTile, n - w0);
    for (std::int64_t k = 0; k < m; ++k)
      for (std::int64_t p = 0; p < B; ++p)
        tile[p * kTile + k] = blocked[(w0 + k) * B + p];
    for (std::int64_t p = 0; p < B; ++p)
      move_row(static_cast<const T*>(tile + p * kTile), 1, plain[p] + w0, 1, m, how);
  }
}

// Between blocks of 16 and of 8 channels: each column's 8 channels of a half block move whole,
// `n` columns with the blocks' strides. Into 8-channel blocks (one contiguous run) with streaming
// stores when `stream`.
template <typename T>
void move_half_blocks(const T* in, std::int64_t in_step, T* out, std::int64_t out_step,
                      std::int64_t n, Direction how, bool stream) {
  constexpr std::int64_t kHalf = 8;
  if (how == Direction::fill && stream && out_step == kHalf && n * kHalf >= kStreamRun) {
    for (std::int64_t k = 0; k < n; ++k)
      stream_copy(in + k * in_step, out + k * kHalf, kHalf);
    return;
  }
  for (std::int64_t k = 0; k < n; ++k) {
    const T* __restrict a = in + k * in_step;
    T* __restrict b = out + k * out_step;
    if (how == Direction::fill) {
      for (std::int64_t v = 0; v < kHalf; ++v)
        b[v] = a[v];
    } else {
      for (std::int64_t v = 0; v < kHalf; ++v)
        b[v] += a[v];
    }
  }
}

// Copies (fill) or adds (accumulate) `box` of every plane from `from` to `to`, converting the
// layout on the way; the rows of groups of planes go to the kernel threads when the box is large.
// A group is a block of channels of one sample, the larger block of the two sides (fewer in the
// last block when a blocked side pads its channels; the padding channels are never read or
// written), or one plane when both sides are NCHW. In one layout a row of a group is contiguous.
// From NCHW into blocks of 8 or 16, a full block's row is interleaved (interleave_row), and out
// of a full block into NCHW deinterleaved (deinterleave_row; both run at about half the speed of
// a plain copy here, 25 ms each way for 8 channels of 2048x2048); between blocks of 16 and 8, 8
// channels of a column at a time; out of a partial block into NCHW, plane by plane along the
// group's row; other conversions plane by plane in tiles of 16 columns, so that the strided side
// stays within 16 cache lines (a plane at a time would stride over a whole row per channel: 5x
// slower here).
template <typename T>
void move_box(const Planes<const T>& from, const Planes<T>& to, const Box& box, Direction how) {
  if (box.empty()) return;
  const std::int64_t group = std::max(from.block(), to.block()), width = box.w.size();
  const std::int64_t channels = from.shape.c, per_sample = (channels + group - 1) / group;
  const std::int64_t rows = box.h.size();
  const bool same = from.layout == to.layout;
  // NCHW into 8- or 16-channel blocks (every window assembly from an NCHW tile).
  void (*const interleave)(const T* const*, T*, std::int64_t, Direction, bool) =
      from.block() != 1 ? nullptr
      : group == 8      ? interleave_row<8, T>
      : group == kBlock ? interleave_row<kBlock, T>
                        : nullptr;
  // And out of them into NCHW (an 8-channel activation into a 1x1 conv's NCHW window, a blocked
  // window's gradient into an NCHW input's).
  void (*const deinterleave)(const T*, T* const*, std::int64_t, Direction) =
      to.block() != 1   ? nullptr
      : group == 8      ? deinterleave_row<8, T>
      : group == kBlock ? deinterleave_row<kBlock, T>
                        : nullptr;
  // Into a target larger than the cache can keep until it is read (a window, a gradient).
  const Shape4& ts = to.shape;
  const bool stream =
      how == Direction::fill &&
      ts.n * ts.c * ts.h * ts.w * std::int64_t(sizeof(T)) >= streaming_store_bytes();
  // Within a plane a row lies shape.w * block() values after the previous one, on both sides:
  // each group's first row is located once (Planes::at divides), and the rows after it by steps,
  // so a narrow box (a column strip, one value per row and plane) costs a copy per row, not four
  // 64-bit divisions and a call to memmove (a halo of 24 x 2048 one-column NCHW rows, one
  // Skylake-SP core, cold caches: pack 9.1 -> 3.2 ms, unpack adding 8.1 -> 3.4 ms).
  const std::int64_t from_step = from.shape.w * from.block(), to_step = to.shape.w * to.block();
  parallel_for(
      from.shape.n * per_sample * rows,
      [&](std::int64_t first, std::int64_t last) {
        const T* in0[kBlock];  // the group's planes at (box.h.begin, box.w.begin)
        T* out0[kBlock];
        const T* in[kBlock];
        T* out[kBlock];
        std::int64_t g = first / rows, k = first % rows, count = 0;
        const auto start_group = [&] {
          const std::int64_t c0 = (g % per_sample) * group;
          const std::int64_t p0 = (g / per_sample) * channels + c0;
          count = std::min(group, channels - c0);
          for (std::int64_t p = 0; p < count; ++p) {
            in0[p] = from.at(p0 + p, box.h.begin, box.w.begin);
            out0[p] = to.at(p0 + p, box.h.begin, box.w.begin);
          }
        };
        start_group();
        for (std::int64_t item = first; item < last; ++item) {
          if (k == rows) {
            k = 0;
            ++g;
            start_group();
          }
          const std::int64_t a = k * from_step, b = k * to_step;
          ++k;
          if (same && count == group) {
            move_row(in0[0] + a, 1, out0[0] + b, 1, width * group, how, stream);
          } else if (interleave != nullptr && count == group) {
            for (std::int64_t p = 0; p < group; ++p)
              in[p] = in0[p] + a;
            interleave(in, out0[0] + b, width, how, stream);
          } else if (deinterleave != nullptr && count == group) {
            for (std::int64_t p = 0; p < group; ++p)
              out[p] = out0[p] + b;
            deinterleave(in0[0] + a, out, width, how);
          } else if (from.block() * to.block() == 8 * kBlock && count % 8 == 0) {
            // nchw16c <-> nchw8c: each half block's columns of 8 channels.
            for (std::int64_t p = 0; p < count; p += 8)
              move_half_blocks(in0[p] + a, from.block(), out0[p] + b, to.block(), width, how,
                               stream);
          } else if (from.block() == group && to.block() == 1) {
            // Out of a block into NCHW: each plane's row whole, read with the block's stride
            // (the group's row is one contiguous run; a few percent faster than tiles here).
            for (std::int64_t p = 0; p < count; ++p)
              move_row(in0[p] + a, group, out0[p] + b, 1, width, how);
          } else {
            for (std::int64_t w0 = 0; w0 < width; w0 += kBlock)
              for (std::int64_t p = 0; p < count; ++p)
                move_row(in0[p] + a + w0 * from.block(), from.block(),
                         out0[p] + b + w0 * to.block(), to.block(), std::min(kBlock, width - w0),
                         how);
          }
        }
        if (stream) fence_streams();
      },
      grain_for(group * width));
}

// A message holds `box` of every plane in NCHW order, whatever the layouts at both ends.
template <typename T>
void pack(const Planes<const T>& t, const Box& box, T* out) {
  const Planes<T> message{
      out, {t.shape.n, t.shape.c, box.h.size(), box.w.size()}, box, Layout::nchw};
  move_box(t, message, box, Direction::fill);
}

template <typename T>
void unpack(const T* in, const Box& box, const Planes<T>& t, Direction how) {
  const Planes<const T> message{
      in, {t.shape.n, t.shape.c, box.h.size(), box.w.size()}, box, Layout::nchw};
  move_box(message, t, box, how);
}

// Sets the elements of `t` outside `keep` to `value`: a window's padding, which no tile owns, or
// (zero) the part of a tile gradient the own window does not reach. Everything inside `keep` is
// written otherwise.
template <typename T>
void fill_outside(const Planes<T>& t, const Box& keep, T value) {
  const Shape4& s = t.shape;
  const Box& origin = t.origin;
  // Physical rows: in a blocked layout a row of a channel block holds `block` values per column.
  const std::int64_t v = t.block(), width = s.w * v;
  const std::int64_t rows_total = s.n * channel_blocks(s.c, v) * s.h;
  const Range rows = intersect(keep.h, origin.h), cols = intersect(keep.w, origin.w);
  parallel_for(
      rows_total,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t k = first; k < last; ++k) {
          T* row = t.row(k);
          const std::int64_t global = origin.h.begin + k % s.h;
          if (!rows.contains(global) || cols.empty()) {
            std::fill(row, row + width, value);
            continue;
          }
          std::fill(row, row + (cols.begin - origin.w.begin) * v, value);
          std::fill(row + (cols.end - origin.w.begin) * v, row + width, value);
        }
      },
      grain_for(width));
}

template <typename T>
class CpuHaloCopy final : public HaloCopyKernel<T> {
 public:
  std::string name() const override { return "threaded"; }
  MemorySpace space() const override { return MemorySpace::host; }
  void move(const Planes<const T>& from, const Planes<T>& to, const Box& box,
            Direction how) const override {
    move_box(from, to, box, how);
  }
  void pack(const Planes<const T>& t, const Box& box, T* message) const override {
    tessera::pack(t, box, message);
  }
  void unpack(const T* message, const Box& box, const Planes<T>& t, Direction how) const override {
    tessera::unpack(message, box, t, how);
  }
  void fill_outside(const Planes<T>& t, const Box& keep, T value) const override {
    tessera::fill_outside(t, keep, value);
  }
  bool takes_channel_slices() const override { return true; }
};

}  // namespace

template <typename T>
std::unique_ptr<HaloCopyKernel<T>> make_cpu_halo_copy() {
  return std::make_unique<CpuHaloCopy<T>>();
}

template std::unique_ptr<HaloCopyKernel<float>> make_cpu_halo_copy<float>();
template std::unique_ptr<HaloCopyKernel<double>> make_cpu_halo_copy<double>();

}  // namespace tessera
