#include "tessera/kernels/onednn_conv.hpp"

#include <oneapi/dnnl/dnnl.hpp>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "onednn_common.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/amx_conv.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/simd.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

using dnnl::memory;
using onednn::apply_threads;
using onednn::cpu_engine;
using onednn::dims_of;
using Tag = memory::format_tag;

const char* runtime_name(unsigned runtime) {
  switch (runtime) {
    case DNNL_RUNTIME_OMP:
      return "OpenMP";
    case DNNL_RUNTIME_TBB:
      return "TBB";
    case DNNL_RUNTIME_SEQ:
      return "sequential";
    case DNNL_RUNTIME_THREADPOOL:
      return "threadpool";
    default:
      return "unknown runtime";
  }
}

// Tessera's layout of `s`: a dense tensor, or a box at `at` of a dense tensor of shape `outer`.
// An NCHW box is a strided view whose first element the caller points at; an nchw16c box is a
// sub-memory of its outer tensor, whose first element the caller points at.
memory::desc user_desc(const Shape4& s, Layout layout, const Shape4& outer = {}, BoxAt at = {}) {
  if (outer.numel() == 0) return onednn::dense_desc(s, layout);
  if (layout == Layout::nchw)
    return {dims_of(s), memory::data_type::f32,
            memory::dims{outer.c * outer.h * outer.w, outer.h * outer.w, outer.w, 1}};
  return onednn::dense_desc(outer, layout).submemory_desc(dims_of(s), {0, 0, at.h, at.w});
}

// PyTorch's [O, C/groups, KH, KW] is oneDNN's goihw with the groups split off O: same bytes.
// `tag`: any (the primitive chooses), or anything else for that plain layout.
// `type`: the weights' data type (bf16 for the primitive's own copy under --precision bf16).
memory::desc weight_desc(const Shape4& w, std::int64_t groups, Tag tag,
                         memory::data_type type = memory::data_type::f32) {
  if (groups == 1) return {dims_of(w), type, tag == Tag::any ? Tag::any : Tag::oihw};
  return {{groups, w.n / groups, w.c, w.h, w.w}, type, tag == Tag::any ? Tag::any : Tag::goihw};
}

// One tensor argument of a primitive: Tessera's plain layout, the layout the primitive chose, and
// the reorder between them (user -> primitive for inputs, primitive -> user for outputs), planned
// once; no reorder when the two agree. Converted copies live in blocks of host_allocator() that
// the caller holds for the call (onednn_common.hpp says why).
struct Port {
  memory::desc user, prim;
  dnnl::reorder::primitive_desc reorder_pd;
  std::optional<dnnl::reorder> reorder;

  static Port input(const memory::desc& user, const memory::desc& prim) {
    Port p{user, prim, {}, {}};
    if (user != prim) p.plan_reorder(user, prim);
    return p;
  }
  static Port output(const memory::desc& prim, const memory::desc& user) {
    Port p{user, prim, {}, {}};
    if (user != prim) p.plan_reorder(prim, user);
    return p;
  }

  // `data` in the primitive's layout: the caller's buffer itself, or a reorder of it into `into`
  // (a buffer of `buffer` when empty).
  memory read(const float* data, dnnl::stream& s, Storage& buffer, memory into = {}) const {
    memory mine(user, cpu_engine(), const_cast<float*>(data));
    if (!reorder) return mine;
    if (!into) into = onednn::buffer_memory(prim, buffer);
    convert(mine, into, s);
    return into;
  }
  // Where the primitive writes `data`: the caller's buffer itself, or a block of `buffer` that
  // finish() reorders into it.
  memory target(float* data, Storage& buffer) const {
    return reorder ? onednn::buffer_memory(prim, buffer) : memory(user, cpu_engine(), data);
  }
  void finish(memory& written, float* data, dnnl::stream& s) const {
    if (!reorder) return;
    memory mine(user, cpu_engine(), data);
    convert(written, mine, s);
  }

 private:
  void plan_reorder(const memory::desc& from, const memory::desc& to) {
    reorder_pd = dnnl::reorder::primitive_desc(cpu_engine(), from, cpu_engine(), to,
                                               onednn::user_scratchpad());
    reorder.emplace(reorder_pd);
  }
  void convert(memory& from, memory& to, dnnl::stream& s) const {
    std::unordered_map<int, memory> args{{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
    Storage scratch;
    onednn::add_scratchpad(reorder_pd, args, scratch);
    reorder->execute(s, args);
    s.wait();  // before `scratch` goes
  }
};

// oneDNN's padding for one axis, or nothing when oneDNN cannot express the reference's semantics
// (an output size taken from the output tensor, zeros read outside the input).
struct AxisPad {
  std::int64_t begin = 0, end = 0;
};
std::optional<AxisPad> axis_pad(std::int64_t in, std::int64_t out, std::int64_t kernel,
                                std::int64_t stride, std::int64_t dilation, std::int64_t begin) {
  if (begin < 0 || in <= 0 || out <= 0) return std::nullopt;
  // Rows past the input's end that the last output reads; negative: rows no output reads.
  const std::int64_t end = (out - 1) * stride + dilation * (kernel - 1) + 1 - in - begin;
  // oneDNN derives the output size as (in + begin + end - span) / stride + 1 (rounding down), so
  // fewer than `stride` unread trailing rows are padding 0; more would give it more outputs.
  if (end <= -stride) return std::nullopt;
  return AxisPad{begin, std::max<std::int64_t>(end, 0)};
}

// A Winograd primitive whose scratchpad is larger than this is planned direct instead: oneDNN
// 2.6 gives some shapes a schedule that transforms the whole tensor at once (32 channels at
// 1024x1024 on backward-data: 587 MiB of scratchpad), slower than the direct kernel wherever
// measured, while its tiled schedule takes 6-10 MiB whatever the image (16 to 128 channels). The
// whole-tensor scratchpad grows with the image: 12 MiB for 16 -> 32 channels at 128x128, 60 MiB
// at 512x256, the forward of unet-small's m1 on each of 2 ranks: 27 ms against 10 ms direct (one
// Skylake-SP core; 256x256: 13 against 5 ms), so the limit sits just above the tiled sizes.
constexpr std::size_t kWinogradScratchLimit = std::size_t{16} << 20;

bool is_winograd(const dnnl::primitive_desc& pd) {
  return pd && std::string(pd.impl_info_str()).find("wino") != std::string::npos;
}

// Whether a conv of weight shape `w` (OIHW) computes in float32 under --precision bf16 too:
// - a 1x1 conv to fewer than 16 channels (a segmentation head) is memory-bound, so bfloat16
//   products gain it nothing, while converting its input costs a pass and oneDNN's bf16 kernels
//   want 16-channel blocks on both sides, so the layer before it wrote NCHW to feed it
//   (conv-bench's 32 -> 2 head under bf16 at 2048x2048: 1 rank x 2 threads, head and the conv
//   before it 1.76 s per step against 0.98 s with the head in float32);
// - a conv reading fewer than 16 channels a group (a first layer's 3 colour channels, a
//   depthwise conv) has few products a pixel for the bytes it writes: conv-bench's 3 -> 32 3x3
//   forward at 2048x2048 took 170-186 ms in bfloat16 on the Intel Xeon with AMX (oneDNN's AMX
//   kernel, which writes NHWC, then 81 ms converting its output to 16-channel blocks) against
//   46 ms in float32 (1 rank x 2 threads, 2026-11-28);
// - a strided conv with fewer than 128 products an input value (output channels x taps per
//   stride step: O x KH x KW / (SH x SW)), such as a 2x2 stride-2 transposed conv's adjoint (each
//   input value meets one tap): oneDNN's bf16 kernels for strides gain less than the conversions
//   cost. On the Intel Xeon with AMX (1 rank x 2 threads, 2026-11-29, forward + backward ms, bf16
//   against float32): unet-small's up2 (32 -> 16, 2x2 stride 2, 512x512 in; 32 products) 73 vs
//   55, 64 -> 32 (64) 165 vs 147, 3x3 stride 2 16 -> 32 (72) at 1024x1024 41 vs 33; above the
//   line, 3x3 stride 2 32 -> 64 (144) 120 vs 136. (At stride 1, a 1x1 64 -> 64 gained: 80 vs 123.)
bool computes_in_float32_under_bf16(const Shape4& w, const reference::ConvGeometry& g) {
  const std::int64_t steps = g.stride_h * g.stride_w;
  const bool few_products_strided = steps > 1 && w.n * w.h * w.w < 128 * steps;
  return (w.h == 1 && w.w == 1 && w.n < kBlock) || w.c < kBlock || few_products_strided;
}

// Whether `pd` is oneDNN 2.x's AMX backward-weights kernel (jit:avx512_core_amx_bf16), which
// Tessera does not run. With oneDNN 2.6.3 on an Intel Xeon with AMX (Emerald Rapids, 2 vCPUs,
// 2026-11-28; a standalone program and tessera bench, 32 -> 32 channels 3x3): creating the
// primitive for an output wider than 736 columns did not finish in 5 minutes (736: 2 ms), and calls
// at 512x512 corrupted the heap ("free(): invalid pointer" when the buffers were freed) or crashed
// with a segmentation fault at an address not mapped. Its forward (brgconv) and backward-data
// kernels match the reference (test OneDnnConv.Bf16ConvolutionsMatchTheReference) and are kept.
bool onednn_amx_weights_unusable(const dnnl::primitive_desc& pd) {
  return dnnl::version()->major < 3 &&
         std::string(pd.impl_info_str()).find("amx") != std::string::npos;
}

// A backward-weights primitive whose scratchpad is larger than this runs over strips of output
// rows instead, each strip's scratchpad within it (onednn_weights_scratch_limit). oneDNN 2.6's
// bf16 backward-weights kernel (jit_bf16:avx512_core_bf16) copies its whole input and output
// gradient into the scratchpad, transposed: 1024.5 MiB for 32 -> 32 channels 3x3 at 2048x2048.
// In strips of 128 rows it asks 64.6 MiB and takes about the same time: 198-200 against 190-198 ms
// a call, the conversions of x and dy included (a standalone program, AMD EPYC Zen 5, 2 threads,
// 2026-11-28; 512-row strips 195 ms, 16-row strips 219 ms); conv-bench's peak under --precision
// bf16, 1 rank, 4311 -> 3030 MiB (float32: 2806 MiB).
std::size_t g_weights_scratch_limit = std::size_t{64} << 20;

// The first element's offset of row `row` of a tensor described by `user` (NCHW or channel
// blocks), in elements: its rows are `strides[2]` apart in every layout Tessera uses.
std::int64_t row_offset(const memory::desc& user, std::int64_t row) {
  return row * user.data.format_desc.blocking.strides[2];
}

// The first `rows` rows of the tensor described by `user`: the same strides, fewer rows (the
// caller points at the strip's first row, row_offset).
memory::desc first_rows(const memory::desc& user, std::int64_t rows) {
  memory::dims dims = user.dims();
  dims[2] = rows;
  return user.submemory_desc(dims, {0, 0, 0, 0});
}

// A backward-weights pass in strips (g_weights_scratch_limit): a strip's primitive, planned once
// for each distinct strip (the first and last, whose windows reach into the padding, and those
// between), reading `x_rows` rows of x padded by `pad_top` and `pad_bottom` rows and `y_rows` rows
// of dy, each through a Port from Tessera's float32 rows.
struct WeightsStripShape {
  std::int64_t y_rows = 0, x_rows = 0, pad_top = 0, pad_bottom = 0;
  dnnl::convolution_backward_weights::primitive_desc pd;
  dnnl::convolution_backward_weights prim;
  Port src, diff_dst;
};

// One strip: rows [y_begin, y_begin + y_rows) of dy and rows [x_begin, x_begin + x_rows) of x,
// computed by WeightsStrips::shapes[shape].
struct WeightsStrip {
  std::int64_t y_begin = 0, x_begin = 0;
  std::size_t shape = 0;
};

// A backward-weights pass planned in strips of output rows (empty: whole).
struct WeightsStrips {
  std::vector<WeightsStrip> strips;
  std::vector<WeightsStripShape> shapes;
};

}  // namespace

struct OneDnnConv::Plan {
  ConvShapes shapes;
  reference::ConvGeometry geometry;
  bool bf16 = false;  // the primitives read bfloat16 (set_conv_bf16 when planned)
  dnnl::stream stream{cpu_engine()};
  memory::desc bias;

  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_backward_data::primitive_desc data_pd;
  dnnl::convolution_backward_weights::primitive_desc weights_pd;
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data data;
  dnnl::convolution_backward_weights weights;

  Port fwd_src, fwd_weights, fwd_dst;
  Port data_diff_dst, data_weights, data_diff_src;
  Port weights_src, weights_diff_dst, weights_diff_weights;

  // Small buffers kept from call to call: weights in the forward and backward-data layouts, the
  // weight and bias gradients as oneDNN writes them, and the weight gradient in OIHW.
  memory fwd_w, data_w, diff_w, diff_w_plain, diff_b;

  // backward-data's conversion of dy, kept for the backward_filter that follows on the same dy
  // when both primitives read one layout: one reorder of the largest tensor instead of two.
  memory dy_converted;
  Storage dy_buffer;
  const float* dy_source = nullptr;

  // Backward-weights in strips of output rows when the whole pass's scratchpad is too large
  // (g_weights_scratch_limit); empty: one call over the whole tensors.
  WeightsStrips weights_strips;

  // Under bf16 on CPUs with AMX: Tessera's AMX kernels for the three passes (kernels/amx_conv.hpp),
  // reading and writing nchw16c where oneDNN 2.6's AMX kernels convert to and from NHWC; all three
  // or none (oneDNN's primitives run then, and are made only then).
  std::unique_ptr<amx::Conv> amx_forward, amx_data;
  std::unique_ptr<amx::ConvWeights> amx_weights;
};

std::unique_ptr<OneDnnConv> OneDnnConv::create(const ConvShapes& shapes,
                                               const reference::ConvGeometry& g) {
  // A preferred layout oneDNN has no fast kernel for (its 8-channel kernels do not dilate, for
  // one) falls back to oneDNN's own choice, not to the reference; an nchw8c window is declined
  // instead, so that the conv takes its next window layout (Conv2d::bind_kernel). A case oneDNN
  // declines either way is tried twice, at plan time only.
  if (std::unique_ptr<OneDnnConv> k = plan_in(shapes, g, true)) return k;
  if (shapes.x_layout == Layout::nchw8c) return nullptr;
  return plan_in(shapes, g, false);
}

namespace {

// The backward-weights pass `whole` of a conv of `shapes` and `g` in strips of output rows, each
// strip's scratchpad within g_weights_scratch_limit (whole's is larger), or nothing (the pass stays
// whole) where a strip would read no row of x or oneDNN declines one. `x_low` and `y_low`: x and
// dy as whole's primitives read them; `y_f32`: the forward's output; `x_user`, `y_user`: x and dy
// as Tessera holds them; `bias`: the bias's descriptor (zero: none).
WeightsStrips plan_weights_strips(const ConvShapes& shapes, const reference::ConvGeometry& g,
                                  const dnnl::convolution_backward_weights::primitive_desc& whole,
                                  const memory::desc& x_low, const memory::desc& y_low,
                                  const memory::desc& y_f32, const memory::desc& bias,
                                  const memory::desc& x_user, const memory::desc& y_user,
                                  const dnnl::primitive_attr& attr) {
  using namespace dnnl;
  const Shape4 &x = shapes.x, &y = shapes.y, &w = shapes.w;
  const std::size_t scratch = whole.scratchpad_desc().get_size();
  // The scratchpad grows with the rows (its transposed copies of x and dy).
  const std::int64_t rows = std::max<std::int64_t>(
      1, static_cast<std::int64_t>(static_cast<double>(y.h) * g_weights_scratch_limit / scratch));
  if (rows >= y.h) return {};
  const std::optional<AxisPad> pw = axis_pad(x.w, y.w, w.w, g.stride_w, g.dilation_w, g.pad_left);
  if (!pw) return {};
  const auto alg =
      is_winograd(whole) ? algorithm::convolution_winograd : algorithm::convolution_direct;
  auto rows_desc = [](const memory::desc& d, std::int64_t n) {
    memory::dims dims = d.dims();
    dims[2] = n;
    return memory::desc(dims, d.data_type(), Tag::any);
  };
  WeightsStrips out;
  for (std::int64_t y0 = 0; y0 < y.h; y0 += rows) {
    const std::int64_t y_rows = std::min(rows, y.h - y0);
    // Rows of x the strip's outputs read, first to last, and where they lie in x.
    const std::int64_t first = y0 * g.stride_h - g.pad_top;
    const std::int64_t last = (y0 + y_rows - 1) * g.stride_h - g.pad_top + g.dilation_h * (w.h - 1);
    const std::int64_t x_begin = std::max<std::int64_t>(0, first);
    const std::int64_t x_rows = std::min(x.h, last + 1) - x_begin;
    if (x_rows <= 0) return {};  // outputs of padding alone: oneDNN takes no empty input
    const std::int64_t pad_top = x_begin - first;
    const std::optional<AxisPad> ph =
        axis_pad(x_rows, y_rows, w.h, g.stride_h, g.dilation_h, pad_top);
    if (!ph) return {};
    auto same = [&](const WeightsStripShape& s) {
      return s.y_rows == y_rows && s.x_rows == x_rows && s.pad_top == pad_top &&
             s.pad_bottom == ph->end;
    };
    auto found = std::find_if(out.shapes.begin(), out.shapes.end(), same);
    if (found == out.shapes.end()) {
      WeightsStripShape s{y_rows, x_rows, pad_top, ph->end, {}, {}, {}, {}};
      const memory::dims strides{g.stride_h, g.stride_w};
      const memory::dims dilates{g.dilation_h - 1, g.dilation_w - 1};
      const memory::dims pad_l{pad_top, pw->begin}, pad_r{ph->end, pw->end};
      const memory::desc xs = rows_desc(x_low, x_rows), ys = rows_desc(y_low, y_rows);
      const convolution_forward::primitive_desc hint(
          convolution_forward::desc(
              prop_kind::forward_training, alg, xs,
              memory::desc(whole.diff_weights_desc().dims(), x_low.data_type(), Tag::any), bias,
              rows_desc(y_f32, y_rows), strides, dilates, pad_l, pad_r),
          attr, cpu_engine(), true);
      if (!hint) return {};
      s.pd = convolution_backward_weights::primitive_desc(
          convolution_backward_weights::desc(alg, xs, whole.diff_weights_desc(), bias, ys, strides,
                                             dilates, pad_l, pad_r),
          attr, cpu_engine(), hint, true);
      // Each strip writes the whole pass's gradient buffers as they lie.
      if (!s.pd || onednn::is_reference(s.pd) ||
          s.pd.diff_weights_desc() != whole.diff_weights_desc() ||
          (shapes.bias && s.pd.diff_bias_desc() != whole.diff_bias_desc()))
        return {};
      s.prim = convolution_backward_weights(s.pd);
      s.src = Port::input(first_rows(x_user, x_rows), s.pd.src_desc());
      s.diff_dst = Port::input(first_rows(y_user, y_rows), s.pd.diff_dst_desc());
      out.shapes.push_back(std::move(s));
      found = std::prev(out.shapes.end());
    }
    out.strips.push_back({y0, x_begin, static_cast<std::size_t>(found - out.shapes.begin())});
  }
  return out;
}

}  // namespace

std::unique_ptr<OneDnnConv> OneDnnConv::plan_in(const ConvShapes& shapes,
                                                const reference::ConvGeometry& g, bool preferred) {
  const Shape4 &x = shapes.x, &w = shapes.w, &y = shapes.y;
  if (g.groups <= 0 || x.c % g.groups != 0 || w.n % g.groups != 0 || w.c * g.groups != x.c ||
      y.c != w.n || y.n != x.n || x.n <= 0 || g.stride_h <= 0 || g.stride_w <= 0 ||
      g.dilation_h <= 0 || g.dilation_w <= 0)
    return nullptr;
  const std::optional<AxisPad> ph = axis_pad(x.h, y.h, w.h, g.stride_h, g.dilation_h, g.pad_top);
  const std::optional<AxisPad> pw = axis_pad(x.w, y.w, w.w, g.stride_w, g.dilation_w, g.pad_left);
  if (!ph || !pw) return nullptr;
  apply_threads();

  auto plan = std::make_unique<Plan>();
  plan->shapes = shapes;
  plan->geometry = g;
  try {
    using namespace dnnl;
    const memory::dims strides{g.stride_h, g.stride_w};
    const memory::dims dilates{g.dilation_h - 1, g.dilation_w - 1};  // oneDNN: 0 is dense
    const memory::dims pad_l{ph->begin, pw->begin}, pad_r{ph->end, pw->end};
    const auto f32 = memory::data_type::f32;
    // --precision bf16 (set_conv_bf16): the primitives read bf16 inputs, weights and output
    // gradients (the Ports convert Tessera's float32 on the way in) and write float32. Not a 1x1
    // conv to fewer than 16 channels (a segmentation head), one reading fewer than 16 channels a
    // group, nor a strided conv of few products (computes_in_float32_under_bf16): float32.
    const auto low =
        conv_bf16() && !computes_in_float32_under_bf16(w, g) ? memory::data_type::bf16 : f32;
    plan->bf16 = low != f32;
    // 8 channels in and out: oneDNN's own choice (16-channel blocks, half of them padding, for
    // the output and both gradients) takes 2-3x the time of its 8-channel blocked kernels, which
    // the Ports then feed with converted copies (8 -> 8 3x3 at 2048x2048, the three passes:
    // 420 -> 190 ms, the conversions included; README.md "Winograd convolutions").
    // A window in nchw8c (channels a multiple of 8 but not of 16: Conv2d::bind_kernel) is read
    // as it lies, by the same kernels: 24 -> 8 3x3 at 2048x2048, the three passes, 629 ms with
    // the window in 16-channel blocks (a third of them padding), 334 ms.
    const bool eight_channel_window = shapes.x_layout == Layout::nchw8c;
    const bool eight_channel_blocks =
        preferred && (eight_channel_window ||
                      (!shapes.is_box() && g.groups == 1 && x.c == 8 && y.c == 8 && low == f32));
    // A 1x1 conv of fewer than 16 channels on each side between NCHW tensors (a segmentation
    // head's): oneDNN's own choice pads both to 16-channel blocks and converts; as they lie, it is
    // one GEMM (8 -> 2 at 2048x2048, the three passes: 57 ms before the conversions, 16 ms).
    const bool plain_1x1 = preferred && !shapes.is_box() && g.groups == 1 && low == f32 &&
                           w.h == 1 && w.w == 1 && g.stride_h == 1 && g.stride_w == 1 &&
                           shapes.x_layout == Layout::nchw && shapes.y_layout == Layout::nchw &&
                           x.c < kBlock && y.c < kBlock;
    const Tag xt = eight_channel_blocks ? Tag::nChw8c : plain_1x1 ? Tag::nchw : Tag::any;
    // An output wanted in nchw8c (Conv2d::bind_kernel) is asked of the 8-channel kernels too:
    // the first layer's (3 -> 8) writes it so instead of padding to 16 channels and converting.
    const Tag yt = preferred && shapes.y_layout == Layout::nchw8c && low == f32 ? Tag::nChw8c : xt;
    const memory::desc x_any(dims_of(x), f32, xt), y_any(dims_of(y), f32, yt);
    const memory::desc x_low(dims_of(x), low, xt), y_low(dims_of(y), low, yt);
    const memory::desc w_any = weight_desc(w, g.groups, Tag::any, low);
    const memory::desc dw_any = weight_desc(w, g.groups, Tag::any);
    const memory::desc x_user = user_desc(x, shapes.x_layout, shapes.x_outer, shapes.x_at);
    const memory::desc y_user = user_desc(y, shapes.y_layout, shapes.y_outer, shapes.y_at);
    const memory::desc w_user = weight_desc(w, g.groups, Tag::oihw);
    const memory::desc no_bias;
    const primitive_attr attr = onednn::user_scratchpad();
    plan->bias = shapes.bias ? memory::desc({w.n}, f32, Tag::x) : no_bias;
    // A fused (leaky) ReLU is oneDNN's eltwise_relu post-op: x > 0 ? x : alpha * x, computed in
    // float32 on the accumulator as elementwise::leaky_relu computes it on the stored output.
    primitive_attr fwd_attr = onednn::user_scratchpad();
    if (const std::optional<FusedActivation>& f = shapes.activation) {
      if (f->kind == ActivationKind::sigmoid) return nullptr;
      post_ops ops;
      ops.append_eltwise(
          1.0f, algorithm::eltwise_relu,
          f->kind == ActivationKind::leaky_relu ? static_cast<float>(f->slope) : 0.0f, 0.0f);
      fwd_attr.set_post_ops(ops);
    }

    // Winograd's F(4x4, 3x3) (oneDNN's jit_wino_4x3: 2.25x fewer products, float32 only) where it
    // pays: 3x3, stride 1, no dilation, no groups, and channels it is faster on than the direct
    // kernel on every pass measured (README.md "Winograd convolutions"). Box kernels recompute
    // thin strips: direct; so is an output thinner than one of its 4x4 output tiles (a windowless
    // conv's border strip through backward-data, one column of 512 rows: 2-18 ms per call in
    // jit_wino_4x3 on the AMD EPYC Zen 5 VM, 2026-11-27). Each pass takes it where oneDNN plans
    // it with a small scratchpad (some shapes get a schedule that transforms the whole tensor at
    // once: direct then).
    const bool winograd_geometry = conv_winograd() && g.groups == 1 && w.h == 3 && w.w == 3 &&
                                   g.stride_h == 1 && g.stride_w == 1 && g.dilation_h == 1 &&
                                   g.dilation_w == 1 && std::min(x.c, y.c) >= 16 &&
                                   std::max(x.c, y.c) >= 32;
    const bool winograd_shape = winograd_geometry && low == f32;
    // (A float32 pass of a bf16 plan, below, takes Winograd where a float32 plan would.)
    const bool winograd_f32 = winograd_geometry && !shapes.is_box() && std::min(y.h, y.w) >= 4;
    const bool winograd = winograd_shape && winograd_f32;
    // Winograd computes from 16-channel blocks, and bf16 has no 8-channel kernels: an nchw8c
    // window is declined then (the conv takes its next layout, Conv2d::bind_kernel).
    if (eight_channel_window && (winograd_shape || low != f32)) return nullptr;
    // A Winograd plan oneDNN rejects, even by throwing, leaves the pass direct: never the whole
    // conv declined to the reference for it.
    auto planned_as = [&](bool try_winograd, auto make) {
      if (try_winograd) {
        try {
          auto pd = make(algorithm::convolution_winograd);
          if (pd && !onednn::is_reference(pd) &&
              pd.scratchpad_desc().get_size() <= kWinogradScratchLimit)
            return pd;
        } catch (const dnnl::error&) {
        }
      }
      return make(algorithm::convolution_direct);
    };
    // The forward reading x as `xs` and weights as `ws`; backward-weights reading x as `xs` and dy
    // as `ys`, planned after the forward `hint`.
    auto forward_pd = [&](bool try_winograd, const primitive_attr& a, const memory::desc& xs,
                          const memory::desc& ws) {
      return planned_as(try_winograd, [&](algorithm alg) {
        const convolution_forward::desc fwd(prop_kind::forward_training, alg, xs, ws, plan->bias,
                                            y_any, strides, dilates, pad_l, pad_r);
        return convolution_forward::primitive_desc(fwd, a, cpu_engine(), true);
      });
    };
    auto weights_pd = [&](bool try_winograd, const memory::desc& xs, const memory::desc& ys,
                          const convolution_forward::primitive_desc& hint) {
      return planned_as(try_winograd, [&](algorithm alg) {
        const convolution_backward_weights::desc weights(alg, xs, dw_any, plan->bias, ys, strides,
                                                         dilates, pad_l, pad_r);
        return convolution_backward_weights::primitive_desc(weights, attr, cpu_engine(), hint,
                                                            true);
      });
    };
    plan->fwd_pd = forward_pd(winograd, fwd_attr, x_low, w_any);
    if (!plan->fwd_pd) return nullptr;
    // Winograd takes ReLU as its post-op but not leaky ReLU: rather than lose it for the fusion,
    // decline the activation (the conv is planned again without it, README "Fused activations").
    if (winograd && shapes.activation && !is_winograd(plan->fwd_pd) &&
        is_winograd(forward_pd(winograd, attr, x_low, w_any)))
      return nullptr;
    if (shapes.is_box()) {
      // Box kernels run forward only.
      if (onednn::is_reference(plan->fwd_pd)) return nullptr;
      plan->fwd = convolution_forward(plan->fwd_pd);
      plan->fwd_src = Port::input(x_user, plan->fwd_pd.src_desc());
      plan->fwd_weights = Port::input(w_user, plan->fwd_pd.weights_desc());
      plan->fwd_dst = Port::output(plan->fwd_pd.dst_desc(), y_user);
      if (plan->fwd_weights.reorder) plan->fwd_w = memory(plan->fwd_weights.prim, cpu_engine());
      return std::unique_ptr<OneDnnConv>(new OneDnnConv(std::move(plan)));
    }
    plan->data_pd = planned_as(winograd, [&](algorithm alg) {
      const convolution_backward_data::desc data(alg, x_any, w_any, y_low, strides, dilates, pad_l,
                                                 pad_r);
      return convolution_backward_data::primitive_desc(data, attr, cpu_engine(), plan->fwd_pd,
                                                       true);
    });
    if (!plan->data_pd) return nullptr;
    plan->weights_pd = weights_pd(winograd, x_low, y_low, plan->fwd_pd);
    if (!plan->weights_pd) return nullptr;
    // Under bf16 on CPUs with AMX, oneDNN 2.x plans backward-weights with its AMX kernel, which
    // is unusable there (onednn_amx_weights_unusable): that pass computes in float32 instead,
    // from Tessera's float32 x and dy as they lie (Winograd where a float32 plan takes it).
    memory::desc x_weights = x_low, y_weights = y_low;
    if (low != f32 && onednn_amx_weights_unusable(plan->weights_pd)) {
      x_weights = x_any;
      y_weights = y_any;
      const auto hint = forward_pd(winograd_f32, attr, x_any, dw_any);
      if (!hint) return nullptr;
      plan->weights_pd = weights_pd(winograd_f32, x_any, y_any, hint);
      if (!plan->weights_pd) return nullptr;
    }
    if (onednn::is_reference(plan->fwd_pd) || onednn::is_reference(plan->data_pd) ||
        onednn::is_reference(plan->weights_pd))
      return nullptr;

    // bf16 with both tensors in 16-channel blocks, stride 1, no groups: on CPUs with AMX, Tessera's
    // AMX kernels take the three passes (backward-data as the correlation of dy with the flipped
    // weights), reading and writing the blocks as they lie. oneDNN's descriptors above stay (they
    // decided the layouts and name what oneDNN would run); its primitives, reorders and buffers
    // are not made.
    if (low != f32 && g.groups == 1 && g.stride_h == 1 && g.stride_w == 1 &&
        shapes.x_layout == Layout::nchw16c && shapes.y_layout == Layout::nchw16c &&
        (!shapes.activation || shapes.activation->kind != ActivationKind::sigmoid)) {
      const amx::Correlation forward{.in = x,
                                     .out = y,
                                     .kh = w.h,
                                     .kw = w.w,
                                     .pad_top = g.pad_top,
                                     .pad_left = g.pad_left,
                                     .dil_h = g.dilation_h,
                                     .dil_w = g.dilation_w};
      plan->amx_forward = amx::Conv::plan(forward);
      plan->amx_data = amx::Conv::plan(amx::adjoint(forward));
      plan->amx_weights = amx::ConvWeights::plan(forward);
      if (plan->amx_forward && plan->amx_data && plan->amx_weights)
        return std::unique_ptr<OneDnnConv>(new OneDnnConv(std::move(plan)));
      plan->amx_forward.reset();
      plan->amx_data.reset();
      plan->amx_weights.reset();
    }

    plan->fwd = convolution_forward(plan->fwd_pd);
    plan->data = convolution_backward_data(plan->data_pd);
    plan->fwd_src = Port::input(x_user, plan->fwd_pd.src_desc());
    plan->fwd_weights = Port::input(w_user, plan->fwd_pd.weights_desc());
    plan->fwd_dst = Port::output(plan->fwd_pd.dst_desc(), y_user);
    plan->data_diff_dst = Port::input(y_user, plan->data_pd.diff_dst_desc());
    plan->data_weights = Port::input(w_user, plan->data_pd.weights_desc());
    plan->data_diff_src = Port::output(plan->data_pd.diff_src_desc(), x_user);
    plan->weights_src = Port::input(x_user, plan->weights_pd.src_desc());
    plan->weights_diff_dst = Port::input(y_user, plan->weights_pd.diff_dst_desc());
    plan->weights_diff_weights = Port::output(plan->weights_pd.diff_weights_desc(), w_user);

    if (plan->fwd_weights.reorder) plan->fwd_w = memory(plan->fwd_weights.prim, cpu_engine());
    if (plan->data_weights.reorder) plan->data_w = memory(plan->data_weights.prim, cpu_engine());
    plan->diff_w = memory(plan->weights_pd.diff_weights_desc(), cpu_engine());
    plan->diff_w_plain = memory(w_user, cpu_engine());
    if (shapes.bias) plan->diff_b = memory(plan->weights_pd.diff_bias_desc(), cpu_engine());
    if (plan->weights_pd.scratchpad_desc().get_size() > g_weights_scratch_limit) try {
        plan->weights_strips =
            plan_weights_strips(shapes, g, plan->weights_pd, x_weights, y_weights,
                                plan->fwd_pd.dst_desc(), plan->bias, x_user, y_user, attr);
      } catch (const dnnl::error&) {  // a strip oneDNN rejects: the pass stays whole
      }
    // The whole pass's primitive, only where it runs (its pd still names the kernel and lays out
    // the gradient buffers the strips write).
    if (plan->weights_strips.strips.empty())
      plan->weights = convolution_backward_weights(plan->weights_pd);
  } catch (const dnnl::error&) {
    // Shapes or parameters oneDNN rejects: declined, the reference takes the case.
    return nullptr;
  }
  return std::unique_ptr<OneDnnConv>(new OneDnnConv(std::move(plan)));
}

OneDnnConv::OneDnnConv(std::unique_ptr<Plan> plan) : plan_(std::move(plan)) {}
OneDnnConv::~OneDnnConv() = default;

namespace {

void check_shape(const char* what, const Shape4& got, const Shape4& planned) {
  TESSERA_CHECK(got == planned, std::string("oneDNN conv planned for ") + what + " " +
                                    planned.str() + ", called with " + got.str());
}

}  // namespace

// Below, beside the one-pass backward.
static bool pointwise_forward_one_pass(const ConvShapes& s, const reference::ConvGeometry& g,
                                       const Tensor<float>& x, const Tensor<float>& w,
                                       std::span<const float> bias, Tensor<float>& y);

void OneDnnConv::forward(const Tensor<float>& x, const Tensor<float>& w,
                         std::span<const float> bias, Tensor<float>& y) {
  const Plan& p = *plan_;
  TESSERA_CHECK(!p.shapes.is_box(), "oneDNN conv: a box kernel runs forward_box only");
  check_shape("input", x.shape(), p.shapes.x);
  check_shape("output", y.shape(), p.shapes.y);
  if (!p.bf16 && pointwise_forward_one_pass(p.shapes, p.geometry, x, w, bias, y)) return;
  run_forward(x.data(), w, bias, y.data());
}

void OneDnnConv::forward_box(const Tensor<float>& x, BoxAt x_at, const Tensor<float>& w,
                             std::span<const float> bias, Tensor<float>& y, BoxAt y_at) {
  const Plan& p = *plan_;
  TESSERA_CHECK(p.shapes.is_box(), "oneDNN conv: forward_box on a kernel planned for tensors");
  check_shape("outer input", x.shape(), p.shapes.x_outer);
  check_shape("outer output", y.shape(), p.shapes.y_outer);
  const Shape4 &xs = p.shapes.x, &ys = p.shapes.y, &xo = x.shape(), &yo = y.shape();
  TESSERA_CHECK(x_at.h >= 0 && x_at.w >= 0 && x_at.h + xs.h <= xo.h && x_at.w + xs.w <= xo.w &&
                    y_at.h >= 0 && y_at.w >= 0 && y_at.h + ys.h <= yo.h && y_at.w + ys.w <= yo.w,
                "oneDNN conv forward_box: a box does not fit in its tensor");
  // A blocked box's descriptor holds its offset (planned); an NCHW box is pointed at.
  const bool x_blocked = p.shapes.x_layout != Layout::nchw;
  const bool y_blocked = p.shapes.y_layout != Layout::nchw;
  TESSERA_CHECK((!x_blocked || x_at == p.shapes.x_at) && (!y_blocked || y_at == p.shapes.y_at),
                "oneDNN conv forward_box: a blocked box must be at its planned place");
  run_forward(x_blocked ? x.data() : x.data() + x_at.h * xo.w + x_at.w, w, bias,
              y_blocked ? y.data() : y.data() + y_at.h * yo.w + y_at.w);
}

void OneDnnConv::run_forward(const float* x, const Tensor<float>& w, std::span<const float> bias,
                             float* y) {
  Plan& p = *plan_;
  check_shape("weight", w.shape(), p.shapes.w);
  TESSERA_CHECK(static_cast<std::int64_t>(bias.size()) == (p.shapes.bias ? p.shapes.w.n : 0),
                "oneDNN conv forward: bias of " + std::to_string(bias.size()) + " values for " +
                    std::to_string(p.shapes.w.n) + " output channels" +
                    (p.shapes.bias ? "" : " (planned without bias)"));
  if (p.amx_forward) {
    p.amx_forward->set_weights(w.data(), false);
    p.amx_forward->run(x, p.shapes.bias ? bias : std::span<const float>(), p.shapes.activation, y);
    return;
  }
  onednn::run("convolution forward", [&] {
    Storage src_buffer, dst_buffer, scratch, unused;
    memory src = p.fwd_src.read(x, p.stream, src_buffer);
    memory weights = p.fwd_weights.read(w.data(), p.stream, unused, p.fwd_w);
    memory dst = p.fwd_dst.target(y, dst_buffer);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}};
    if (p.shapes.bias)
      args.insert({DNNL_ARG_BIAS, memory(p.bias, cpu_engine(), const_cast<float*>(bias.data()))});
    onednn::add_scratchpad(p.fwd_pd, args, scratch);
    p.fwd.execute(p.stream, args);
    p.fwd_dst.finish(dst, y, p.stream);
    p.stream.wait();
  });
}

void OneDnnConv::backward_data(const Tensor<float>& dy, const Tensor<float>& w, Tensor<float>& dx) {
  Plan& p = *plan_;
  TESSERA_CHECK(!p.shapes.is_box(), "oneDNN conv: a box kernel runs forward_box only");
  check_shape("output gradient", dy.shape(), p.shapes.y);
  check_shape("weight", w.shape(), p.shapes.w);
  check_shape("input gradient", dx.shape(), p.shapes.x);
  // What a previous call kept for its backward_filter goes now: nothing stale survives a throw.
  p.dy_converted = memory();
  p.dy_source = nullptr;
  p.dy_buffer.reset();
  if (p.amx_data) {
    p.amx_data->set_weights(w.data(), true);
    p.amx_data->run(dy.data(), {}, std::nullopt, dx.data());
    return;
  }
  onednn::run("convolution backward-data", [&] {
    Storage dy_buffer, dx_buffer, scratch, unused;
    memory diff_dst = p.data_diff_dst.read(dy.data(), p.stream, dy_buffer);
    // (A backward-weights in strips converts dy strip by strip: nothing to keep.)
    const bool shared = p.data_diff_dst.reorder &&
                        p.data_diff_dst.prim == p.weights_diff_dst.prim &&
                        p.weights_strips.strips.empty();
    memory weights = p.data_weights.read(w.data(), p.stream, unused, p.data_w);
    memory diff_src = p.data_diff_src.target(dx.data(), dx_buffer);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DIFF_SRC, diff_src}};
    onednn::add_scratchpad(p.data_pd, args, scratch);
    p.data.execute(p.stream, args);
    p.data_diff_src.finish(diff_src, dx.data(), p.stream);
    p.stream.wait();
    if (shared) {  // backward_filter reads it
      p.dy_converted = diff_dst;
      p.dy_source = dy.data();
      p.dy_buffer = std::move(dy_buffer);
    }
  });
}

void OneDnnConv::backward_filter(const Tensor<float>& x, const Tensor<float>& dy, Tensor<float>& dw,
                                 std::span<float> dbias) {
  Plan& p = *plan_;
  TESSERA_CHECK(!p.shapes.is_box(), "oneDNN conv: a box kernel runs forward_box only");
  check_shape("input", x.shape(), p.shapes.x);
  check_shape("output gradient", dy.shape(), p.shapes.y);
  check_shape("weight gradient", dw.shape(), p.shapes.w);
  TESSERA_CHECK(
      dbias.empty() || (p.shapes.bias && static_cast<std::int64_t>(dbias.size()) == p.shapes.w.n),
      "oneDNN conv backward-filter: bias gradient of " + std::to_string(dbias.size()) +
          " values for " + std::to_string(p.shapes.w.n) + " output channels" +
          (p.shapes.bias ? "" : " (planned without bias)"));
  // backward_data's conversion of dy, taken whatever happens next (released after this call).
  const memory kept = std::exchange(p.dy_converted, memory());
  const float* kept_source = std::exchange(p.dy_source, nullptr);
  Storage dy_buffer = std::move(p.dy_buffer);
  if (p.amx_weights) {
    p.amx_weights->run(x.data(), dy.data(), dw.data(), p.shapes.bias ? dbias : std::span<float>());
    return;
  }
  // oneDNN overwrites its gradients; the kernel contract adds into the caller's.
  auto add_gradients = [&] {
    p.weights_diff_weights.finish(p.diff_w, static_cast<float*>(p.diff_w_plain.get_data_handle()),
                                  p.stream);
    p.stream.wait();
    const float* grad = static_cast<const float*>(
        (p.weights_diff_weights.reorder ? p.diff_w_plain : p.diff_w).get_data_handle());
    float* out = dw.data();
    for (std::int64_t k = 0; k < dw.numel(); ++k)
      out[k] += grad[k];
    if (!dbias.empty()) {
      const float* b = static_cast<const float*>(p.diff_b.get_data_handle());
      for (std::size_t k = 0; k < dbias.size(); ++k)
        dbias[k] += b[k];
    }
  };
  auto arguments = [&](const memory& src, const memory& diff_dst) {
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_WEIGHTS, p.diff_w}};
    if (p.shapes.bias) args.insert({DNNL_ARG_DIFF_BIAS, p.diff_b});
    return args;
  };
  if (!p.weights_strips.strips.empty()) {
    // Strip by strip, in order, each added into dw and dbias as it is done.
    onednn::run("convolution backward-weights", [&] {
      Storage x_buffer, scratch;
      for (const WeightsStrip& strip : p.weights_strips.strips) {
        const WeightsStripShape& s = p.weights_strips.shapes[strip.shape];
        memory src =
            s.src.read(x.data() + row_offset(s.src.user, strip.x_begin), p.stream, x_buffer);
        memory diff_dst = s.diff_dst.read(dy.data() + row_offset(s.diff_dst.user, strip.y_begin),
                                          p.stream, dy_buffer);
        std::unordered_map<int, memory> args = arguments(src, diff_dst);
        onednn::add_scratchpad(s.pd, args, scratch);
        s.prim.execute(p.stream, args);
        add_gradients();
      }
    });
    return;
  }
  onednn::run("convolution backward-weights", [&] {
    Storage x_buffer, scratch;
    memory src = p.weights_src.read(x.data(), p.stream, x_buffer);
    memory diff_dst =
        kept_source == dy.data() ? kept : p.weights_diff_dst.read(dy.data(), p.stream, dy_buffer);
    std::unordered_map<int, memory> args = arguments(src, diff_dst);
    onednn::add_scratchpad(p.weights_pd, args, scratch);
    p.weights.execute(p.stream, args);
    add_gradients();
  });
}

bool OneDnnConv::applies_activation() const {
  return plan_->shapes.activation.has_value();
}

std::string OneDnnConv::name() const {
  if (plan_->shapes.is_box()) return std::string("onednn ") + plan_->fwd_pd.impl_info_str();
  const std::int64_t strips = weights_strips();
  if (plan_->amx_forward) return "onednn tessera amx/tessera amx/tessera amx";
  return std::string("onednn ") + plan_->fwd_pd.impl_info_str() + "/" +
         plan_->data_pd.impl_info_str() + "/" + plan_->weights_pd.impl_info_str() +
         (strips > 0 ? ", backward-weights in " + std::to_string(strips) + " strips" : "");
}

std::int64_t OneDnnConv::weights_strips() const {
  return std::ssize(plan_->weights_strips.strips);
}

std::size_t onednn_weights_scratch_limit() {
  return g_weights_scratch_limit;
}

std::size_t set_onednn_weights_scratch_limit(std::size_t bytes) {
  return std::exchange(g_weights_scratch_limit, bytes);
}

bool onednn_bf16_supported() {
  static const bool supported = [] {
    try {
      using namespace dnnl;
      const auto bf16 = memory::data_type::bf16;
      const memory::desc x({1, 16, 8, 8}, bf16, Tag::any), w({16, 16, 3, 3}, bf16, Tag::any);
      const memory::desc y({1, 16, 8, 8}, memory::data_type::f32, Tag::any);
      const convolution_forward::desc d(prop_kind::forward_training, algorithm::convolution_direct,
                                        x, w, memory::desc(), y, {1, 1}, {1, 1}, {1, 1});
      const convolution_forward::primitive_desc pd(d, cpu_engine(), true);
      return bool(pd) && !onednn::is_reference(pd);
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return supported;
}

bool onednn_bf16_native() {
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (isa & bf16) == bf16;  // the ISA values are nested masks: AMX includes it
}

namespace {

void sgemm(char ta, char tb, std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
           std::int64_t ldc) {
  const dnnl_status_t status = dnnl_sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  TESSERA_CHECK(status == dnnl_success,
                "oneDNN dnnl_sgemm failed (status " + std::to_string(status) + ")");
}

// Whether `s` and `g` are a plain 1x1 conv of whole tensors: no groups, stride 1, no padding,
// the output the input's size, no box. What the one-pass loops and the blocked GEMMs below take
// (each with its own layouts and counts besides). Local.
bool plain_pointwise(const ConvShapes& s, const reference::ConvGeometry& g) {
  return !s.is_box() && s.w == Shape4{s.y.c, s.x.c, 1, 1} && s.x.n == s.y.n && s.x.h == s.y.h &&
         s.x.w == s.y.w && g.groups == 1 && g.stride_h == 1 && g.stride_w == 1 && g.pad_top == 0 &&
         g.pad_left == 0;
}

#if TESSERA_HAS_WIDE_LOOPS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
namespace wide {

constexpr std::int64_t kMaxPointwiseOutputs = 8, kMaxPointwiseSums = 64, kMaxPointwiseBlocks = 8;

// Pixels [begin, end) of one 8-channel block of a 1x1 conv's backward in one pass (x, dx: the
// block's pixels x 8; dy: `outs` planes `dy_plane` apart; w: the block's 8 weights of output o at
// w + o * w_row): dx = sum over o of dy[o] w[o] (overwritten; then times f' of a (leaky) ReLU read
// from x where `activate`), dw_sums[o * w_row + c] += sum of dy[o] x[c], and bias_sums[o] += sum
// of dy[o] unless null. Two pixels a vector; the sums go per lane in float for 1024 pixels at a
// time, then into the doubles. The last pixels (fewer than 16) go one at a time with the same
// fused multiply-adds, so dx does not depend on where a tile's pixels start.
void pointwise_backward_block(const float* x, const float* dy, std::int64_t dy_plane,
                              std::int64_t outs, const float* w, std::int64_t w_row,
                              std::int64_t begin, std::int64_t end, bool activate, float slope,
                              bool stream, float* dx, double* dw_sums, double* bias_sums) {
  constexpr std::int64_t kBlock8 = 8, kPixels = 16, kFlush = 64;
  __m512 weight[kMaxPointwiseOutputs], acc[kMaxPointwiseOutputs], bias[kMaxPointwiseOutputs];
  // The maskz forms: GCC 12's unmasked ones start from an "undefined" vector that
  // -Wmaybe-uninitialized flags (as in kernels/cpu/narrow_conv.cpp).
  for (std::int64_t o = 0; o < outs; ++o) {
    weight[o] = _mm512_maskz_broadcast_f32x8(0xffff, _mm256_loadu_ps(w + o * w_row));
    acc[o] = bias[o] = _mm512_setzero_ps();
  }
  // Lanes 0-7 take pixel 2j's dy, lanes 8-15 pixel 2j + 1's.
  __m512i pair[kBlock8];
  for (int j = 0; j < kBlock8; ++j)
    pair[j] =
        _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(2 * j), _mm512_set1_epi32(2 * j + 1));
  const __m512 zero = _mm512_setzero_ps(), slopes = _mm512_set1_ps(slope);
  const auto flush = [&] {
    alignas(64) float lanes[kPixels];
    for (std::int64_t o = 0; o < outs; ++o) {
      _mm512_store_ps(lanes, acc[o]);
      for (std::int64_t c = 0; c < kBlock8; ++c)
        dw_sums[o * w_row + c] += double(lanes[c]) + double(lanes[kBlock8 + c]);
      acc[o] = _mm512_setzero_ps();
      if (bias_sums == nullptr) continue;
      _mm512_store_ps(lanes, bias[o]);
      for (float v : lanes)
        bias_sums[o] += v;
      bias[o] = _mm512_setzero_ps();
    }
  };
  std::int64_t p = begin;
  for (std::int64_t count = 1; p + kPixels <= end; p += kPixels, ++count) {
    __m512 d[kMaxPointwiseOutputs];
    for (std::int64_t o = 0; o < outs; ++o) {
      d[o] = _mm512_loadu_ps(dy + o * dy_plane + p);
      bias[o] = _mm512_add_ps(bias[o], d[o]);
    }
    for (int j = 0; j < kBlock8; ++j) {
      const std::int64_t at = (p + 2 * j) * kBlock8;
      const __m512 v = _mm512_loadu_ps(x + at);
      __m512 g = zero;
      for (std::int64_t o = 0; o < outs; ++o) {
        const __m512 dv = _mm512_maskz_permutexvar_ps(0xffff, pair[j], d[o]);
        g = _mm512_fmadd_ps(dv, weight[o], g);
        acc[o] = _mm512_fmadd_ps(dv, v, acc[o]);
      }
      if (activate) {
        // elementwise::leaky_relu_grad: x > 0 ? g : slope * g.
        const __mmask16 positive = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
        g = _mm512_mask_blend_ps(positive, _mm512_mul_ps(slopes, g), g);
      }
      if (stream)
        _mm512_stream_ps(dx + at, g);
      else
        _mm512_storeu_ps(dx + at, g);
    }
    if (count % kFlush == 0) flush();
  }
  flush();
  for (; p < end; ++p)
    for (std::int64_t c = 0; c < kBlock8; ++c) {
      const float v = x[p * kBlock8 + c];
      float g = 0;
      for (std::int64_t o = 0; o < outs; ++o) {
        const float d = dy[o * dy_plane + p];
        g = std::fma(d, w[o * w_row + c], g);
        dw_sums[o * w_row + c] += double(d) * double(v);
        if (bias_sums != nullptr && c == 0) bias_sums[o] += d;
      }
      dx[p * kBlock8 + c] = activate ? elementwise::leaky_relu_grad(v > 0.0f, g, slope) : g;
    }
}

// The same for a 16-channel block (nchw16c x and dx): a pixel a vector, each output's dy
// broadcast from its plane; w: the block's 16 weights of output o at w + o * w_row. The bias sums
// go pixel by pixel in double.
void pointwise_backward_block16(const float* x, const float* dy, std::int64_t dy_plane,
                                std::int64_t outs, const float* w, std::int64_t w_row,
                                std::int64_t begin, std::int64_t end, bool activate, float slope,
                                bool stream, float* dx, double* dw_sums, double* bias_sums) {
  constexpr std::int64_t kLanes = 16, kFlush = 1024;
  __m512 weight[kMaxPointwiseOutputs], acc[kMaxPointwiseOutputs];
  double bias[kMaxPointwiseOutputs] = {};
  for (std::int64_t o = 0; o < outs; ++o) {
    weight[o] = _mm512_loadu_ps(w + o * w_row);
    acc[o] = _mm512_setzero_ps();
  }
  const __m512 zero = _mm512_setzero_ps(), slopes = _mm512_set1_ps(slope);
  const auto flush = [&] {
    alignas(64) float lanes[kLanes];
    for (std::int64_t o = 0; o < outs; ++o) {
      _mm512_store_ps(lanes, acc[o]);
      for (std::int64_t c = 0; c < kLanes; ++c)
        dw_sums[o * w_row + c] += lanes[c];
      acc[o] = _mm512_setzero_ps();
    }
  };
  for (std::int64_t p = begin; p < end; ++p) {
    const __m512 v = _mm512_loadu_ps(x + p * kLanes);
    __m512 g = zero;
    for (std::int64_t o = 0; o < outs; ++o) {
      const float d = dy[o * dy_plane + p];
      const __m512 dv = _mm512_set1_ps(d);
      g = _mm512_fmadd_ps(dv, weight[o], g);
      acc[o] = _mm512_fmadd_ps(dv, v, acc[o]);
      bias[o] += d;
    }
    if (activate) {
      const __mmask16 positive = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
      g = _mm512_mask_blend_ps(positive, _mm512_mul_ps(slopes, g), g);
    }
    if (stream)
      _mm512_stream_ps(dx + p * kLanes, g);
    else
      _mm512_storeu_ps(dx + p * kLanes, g);
    if ((p - begin) % kFlush == kFlush - 1) flush();
  }
  flush();
  if (bias_sums != nullptr)
    for (std::int64_t o = 0; o < outs; ++o)
      bias_sums[o] += bias[o];
}

// The sum of a vector's 16 lanes: halves added, then quarters, down to one (a fixed tree; the
// maskz extract: GCC 12's _mm512_reduce_add_ps trips -Wmaybe-uninitialized).
inline float lanes_sum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xff, v, 0),
                                 _mm512_maskz_extractf32x8_ps(0xff, v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// A 1x1 conv's forward from nchw16c x (`blocks` blocks of `plane` pixels) into NCHW y (`outs`
// planes), pixels [begin, end) of one sample: per pixel and output the blocks' products summed
// lane by lane, then the 16 lanes (a fixed tree), then the bias.
void pointwise_forward_blocks16(const float* x, std::int64_t plane, std::int64_t blocks,
                                std::int64_t outs, const float* w, const float* bias,
                                std::int64_t begin, std::int64_t end, float* y) {
  constexpr std::int64_t kLanes = 16;
  for (std::int64_t p = begin; p < end; ++p) {
    __m512 v[kMaxPointwiseBlocks];
    for (std::int64_t b = 0; b < blocks; ++b)
      v[b] = _mm512_loadu_ps(x + (b * plane + p) * kLanes);
    for (std::int64_t o = 0; o < outs; ++o) {
      __m512 acc = _mm512_setzero_ps();
      for (std::int64_t b = 0; b < blocks; ++b)
        acc = _mm512_fmadd_ps(v[b], _mm512_loadu_ps(w + (o * blocks + b) * kLanes), acc);
      const float sum = lanes_sum(acc);
      y[o * plane + p] = bias != nullptr ? sum + bias[o] : sum;
    }
  }
}

// The same for NCHW x and dx (`channels` planes `plane` apart, as dy's), pixels [begin, end) of
// every channel: 16 pixels a vector, the last ones masked; w is O x C row-major, dw_sums too.
void pointwise_backward_planes(const float* x, std::int64_t plane, const float* dy,
                               std::int64_t outs, std::int64_t channels, const float* w,
                               std::int64_t begin, std::int64_t end, bool activate, float slope,
                               bool stream, float* dx, double* dw_sums, double* bias_sums) {
  constexpr std::int64_t kPixels = 16, kFlush = 64;
  __m512 acc[kMaxPointwiseSums], bias[kMaxPointwiseOutputs];
  for (std::int64_t k = 0; k < outs * channels; ++k)
    acc[k] = _mm512_setzero_ps();
  for (std::int64_t o = 0; o < outs; ++o)
    bias[o] = _mm512_setzero_ps();
  const __m512 zero = _mm512_setzero_ps(), slopes = _mm512_set1_ps(slope);
  const auto flush = [&] {
    alignas(64) float lanes[kPixels];
    for (std::int64_t k = 0; k < outs * channels; ++k) {
      _mm512_store_ps(lanes, acc[k]);
      for (float v : lanes)
        dw_sums[k] += v;
      acc[k] = _mm512_setzero_ps();
    }
    if (bias_sums == nullptr) return;
    for (std::int64_t o = 0; o < outs; ++o) {
      _mm512_store_ps(lanes, bias[o]);
      for (float v : lanes)
        bias_sums[o] += v;
      bias[o] = _mm512_setzero_ps();
    }
  };
  std::int64_t count = 0;
  for (std::int64_t p = begin; p < end; p += kPixels) {
    const bool whole = p + kPixels <= end;
    const __mmask16 lanes = whole ? __mmask16(0xffff) : __mmask16((1u << (end - p)) - 1u);
    __m512 d[kMaxPointwiseOutputs];
    for (std::int64_t o = 0; o < outs; ++o) {
      d[o] = _mm512_maskz_loadu_ps(lanes, dy + o * plane + p);
      bias[o] = _mm512_add_ps(bias[o], d[o]);
    }
    for (std::int64_t c = 0; c < channels; ++c) {
      const __m512 v = _mm512_maskz_loadu_ps(lanes, x + c * plane + p);
      __m512 g = zero;
      for (std::int64_t o = 0; o < outs; ++o) {
        g = _mm512_fmadd_ps(d[o], _mm512_set1_ps(w[o * channels + c]), g);
        acc[o * channels + c] = _mm512_fmadd_ps(d[o], v, acc[o * channels + c]);
      }
      if (activate) {
        const __mmask16 positive = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
        g = _mm512_mask_blend_ps(positive, _mm512_mul_ps(slopes, g), g);
      }
      if (stream && whole)
        _mm512_stream_ps(dx + c * plane + p, g);
      else
        _mm512_mask_storeu_ps(dx + c * plane + p, lanes, g);
    }
    if (++count % kFlush == 0) flush();
  }
  flush();
}

}  // namespace wide
#pragma GCC pop_options
#endif

// backward_data and backward_filter of a 1x1 conv in one pass over x and dy, with f' of a fused
// input activation read from x (ConvKernel::backward_fused): float32 products (the caller's to
// say), plain_pointwise, x and dx in NCHW, nchw8c or nchw16c, y in NCHW, at most 8 outputs (and
// 64 products per pixel in NCHW, the sums kept in registers), not a sigmoid's f', the AVX-512
// loops chosen
// (simd_level()). False, nothing done, otherwise. The two GEMMs and the separate f' read the
// tensors three times: 8 -> 2 channels at 2048x2048 from nchw8c, one Skylake-SP core, 74 -> 29 ms
// (43 -> 14 ms on two threads); unet-small's head (NCHW), `tessera bench` 1 rank x 1 thread,
// backward 69-85 -> 34-47 ms per step.
bool pointwise_backward_one_pass(const ConvShapes& s, const reference::ConvGeometry& g,
                                 const Tensor<float>& x, const Tensor<float>& dy,
                                 const Tensor<float>& w, const std::optional<FusedActivation>& f,
                                 Tensor<float>& dx, Tensor<float>& dw, std::span<float> dbias) {
#if TESSERA_HAS_WIDE_LOOPS
  const std::int64_t outs = s.y.c, channels = s.x.c;
  const std::int64_t block = block_of(s.x_layout);
  const bool blocked = s.x_layout == Layout::nchw8c || s.x_layout == Layout::nchw16c;
  const bool fits =
      simd_level() == SimdLevel::avx512 && plain_pointwise(s, g) && s.y_layout == Layout::nchw &&
      (blocked ? channels % block == 0
               : s.x_layout == Layout::nchw && outs * channels <= wide::kMaxPointwiseSums) &&
      outs <= wide::kMaxPointwiseOutputs && !(f && f->kind == ActivationKind::sigmoid);
  if (!fits) return false;
  const auto check = [](const Tensor<float>& t, const Shape4& planned, Layout layout,
                        const char* what) {
    TESSERA_CHECK(t.shape() == planned && t.layout() == layout,
                  std::string("1x1 conv backward: the ") + what + " is " + t.shape().str() +
                      " in " + to_string(t.layout()) + ", planned " + planned.str() + " in " +
                      to_string(layout));
  };
  check(x, s.x, s.x_layout, "input");
  check(dx, s.x, s.x_layout, "input gradient");
  check(dy, s.y, Layout::nchw, "output gradient");
  check(w, s.w, Layout::nchw, "weight");
  check(dw, s.w, Layout::nchw, "weight gradient");
  TESSERA_CHECK(dbias.empty() || (s.bias && std::ssize(dbias) == outs),
                "1x1 conv backward: a bias gradient of " + std::to_string(dbias.size()) +
                    " values for " + std::to_string(outs) + " outputs" +
                    (s.bias ? "" : " (planned without bias)"));
  // Each part of the pixels sums into its own doubles, added part by part in order: the same
  // result on every run with the same thread count. Parts start on whole vectors; a part for
  // each kernel thread, from 65536 values of x each (parallel_for's grain).
  constexpr std::int64_t kPixels = 16, kBlock8 = 8;
  const std::int64_t n = s.x.h * s.x.w, vectors = (n + kPixels - 1) / kPixels;
  if (n == 0) return true;  // nothing to add, nothing to write
  const std::int64_t parts = std::clamp<std::int64_t>(
      kernel_threads().count, 1, std::min(vectors, std::max<std::int64_t>(1, x.numel() >> 16)));
  const std::int64_t per_part = outs * (channels + 1);
  std::vector<double> sums(static_cast<std::size_t>(parts * per_part), 0.0);
  // Streaming stores need every block's and sample's start on 64 bytes: n * block floats apart
  // (an odd pixel count leaves nchw8c's odd blocks on 32), n apart per channel in NCHW.
  const bool stream = x.numel() * std::int64_t(sizeof(float)) >= streaming_store_bytes() &&
                      reinterpret_cast<std::uintptr_t>(dx.data()) % 64 == 0 &&
                      (blocked ? n * block : n) % kPixels == 0;
  // A ReLU's slope is 0 whatever the field holds (as the CPU activation kernel's).
  const float slope =
      f && f->kind == ActivationKind::leaky_relu ? static_cast<float>(f->slope) : 0.0f;
  const std::int64_t x_sample = channels * n, y_sample = outs * n;
  parallel_for(
      parts,
      [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t part = first; part < last; ++part) {
          const std::int64_t begin = std::min(n, vectors * part / parts * kPixels);
          const std::int64_t end = std::min(n, vectors * (part + 1) / parts * kPixels);
          double* dw_sums = sums.data() + part * per_part;
          double* bias_sums = s.bias && !dbias.empty() ? dw_sums + outs * channels : nullptr;
          for (std::int64_t i = 0; i < s.x.n; ++i) {
            const float* xi = x.data() + i * x_sample;
            const float* dyi = dy.data() + i * y_sample;
            float* dxi = dx.data() + i * x_sample;
            if (!blocked) {
              wide::pointwise_backward_planes(xi, n, dyi, outs, channels, w.data(), begin, end,
                                              f.has_value(), slope, stream, dxi, dw_sums,
                                              bias_sums);
              continue;
            }
            const auto pass = block == kBlock8 ? wide::pointwise_backward_block
                                               : wide::pointwise_backward_block16;
            for (std::int64_t b = 0; b < channels / block; ++b)
              pass(xi + b * n * block, dyi, n, outs, w.data() + b * block, channels, begin, end,
                   f.has_value(), slope, stream, dxi + b * n * block, dw_sums + b * block,
                   b == 0 ? bias_sums : nullptr);
          }
        }
        if (stream) _mm_sfence();
      },
      1);
  for (std::int64_t k = 0; k < per_part; ++k) {
    double total = 0;
    for (std::int64_t part = 0; part < parts; ++part)
      total += sums[part * per_part + k];
    if (k < outs * channels)
      dw.data()[k] += static_cast<float>(total);
    else if (s.bias && !dbias.empty())
      dbias[k - outs * channels] += static_cast<float>(total);
  }
  return true;
#else
  (void)s, (void)g, (void)x, (void)dy, (void)w, (void)f, (void)dx, (void)dw, (void)dbias;
  return false;
#endif
}

// make_onednn_blocked_pointwise's kernel. Per sample, block b of the window is the row-major
// pixels x 8 matrix X_b, the weight's columns [8b, 8b + 8) the O x 8 matrix W_b (OIHW of a 1x1
// conv is O x C row-major) and y the O x pixels matrix Y: Y = sum_b W_b X_b^T (+ bias),
// dX_b = dY^T W_b, dW_b += dY X_b. The bias and its gradient are the CPU merge kernel's
// (add_bias, add_bias_grad), as the transposed convolutions' (src/layers/conv_transpose2d.cpp).
class OneDnnBlockedPointwise final : public ConvKernel<float> {
 public:
  explicit OneDnnBlockedPointwise(const ConvShapes& shapes)
      : s_(shapes), merge_(make_cpu_merge<float>()) {}

  void forward(const Tensor<float>& x, const Tensor<float>& w, std::span<const float> bias,
               Tensor<float>& y) override {
    check(x, s_.x, "input");
    check(w, s_.w, "weight");
    check(y, s_.y, "output");
    each_block([&](std::int64_t i, std::int64_t b) {
      sgemm('N', 'T', outputs(), pixels(), kBlock8, w.data() + b * kBlock8, channels(),
            block(x.data(), i, b), kBlock8, b == 0 ? 0.0f : 1.0f, plane(y.data(), i), pixels());
    });
    if (s_.bias) merge_->add_bias(bias, y);
  }
  void backward_data(const Tensor<float>& dy, const Tensor<float>& w, Tensor<float>& dx) override {
    check(dy, s_.y, "output gradient");
    check(w, s_.w, "weight");
    check(dx, s_.x, "input gradient");
    each_block([&](std::int64_t i, std::int64_t b) {
      sgemm('T', 'N', pixels(), kBlock8, outputs(), plane(dy.data(), i), pixels(),
            w.data() + b * kBlock8, channels(), 0.0f, block(dx.data(), i, b), kBlock8);
    });
  }
  void backward_filter(const Tensor<float>& x, const Tensor<float>& dy, Tensor<float>& dw,
                       std::span<float> dbias) override {
    check(x, s_.x, "input");
    check(dy, s_.y, "output gradient");
    check(dw, s_.w, "weight gradient");
    each_block([&](std::int64_t i, std::int64_t b) {
      sgemm('N', 'N', outputs(), kBlock8, pixels(), plane(dy.data(), i), pixels(),
            block(x.data(), i, b), kBlock8, 1.0f, dw.data() + b * kBlock8, channels());
    });
    if (s_.bias) merge_->add_bias_grad(dy, dbias);
  }
  bool backward_fused(const Tensor<float>& x, const Tensor<float>& dy, const Tensor<float>& w,
                      const std::optional<FusedActivation>& f, Tensor<float>& dx, Tensor<float>& dw,
                      std::span<float> dbias) override {
    return pointwise_backward_one_pass(s_, reference::ConvGeometry{}, x, dy, w, f, dx, dw, dbias);
  }
  void forward_box(const Tensor<float>&, BoxAt, const Tensor<float>&, std::span<const float>,
                   Tensor<float>&, BoxAt) override {
    throw Error("the blocked 1x1 GEMM kernel has no box kernel");
  }
  std::string name() const override { return "onednn sgemm (1x1 from nchw8c)"; }

 private:
  static constexpr std::int64_t kBlock8 = 8;
  std::int64_t channels() const { return s_.x.c; }
  std::int64_t blocks() const { return s_.x.c / kBlock8; }
  std::int64_t outputs() const { return s_.y.c; }
  std::int64_t pixels() const { return s_.x.h * s_.x.w; }
  // Block b of sample i of the nchw8c window (pixels x 8).
  template <typename P>
  P* block(P* data, std::int64_t sample, std::int64_t b) const {
    return data + (sample * blocks() + b) * pixels() * kBlock8;
  }
  // Sample i of the NCHW output (outputs x pixels).
  template <typename P>
  P* plane(P* data, std::int64_t sample) const {
    return data + sample * outputs() * pixels();
  }
  // f(sample, block) for every block of every sample, blocks in order (the forward accumulates).
  template <typename F>
  void each_block(F&& f) const {
    for (std::int64_t i = 0; i < s_.x.n; ++i)
      for (std::int64_t b = 0; b < blocks(); ++b)
        f(i, b);
  }
  static void check(const Tensor<float>& t, const Shape4& planned, const char* what) {
    TESSERA_CHECK(t.shape() == planned, std::string("blocked 1x1 GEMM: the ") + what + " is " +
                                            t.shape().str() + ", planned " + planned.str());
  }
  ConvShapes s_;
  std::unique_ptr<MergeKernel<float>> merge_;
};

}  // namespace

// A 1x1 conv's forward from nchw16c x into NCHW y of at most 8 outputs (conv-bench's head, 32 ->
// 2 channels): one pass over x with the AVX-512 loops, where oneDNN's kernel for these layouts
// took 130 ms for the 512 MiB at 2048x2048 on one Skylake-SP core. Float32 products, stride 1, no
// padding, groups or fused activation, up to 128 channels; false, nothing done, otherwise.
static bool pointwise_forward_one_pass(const ConvShapes& s, const reference::ConvGeometry& g,
                                       const Tensor<float>& x, const Tensor<float>& w,
                                       std::span<const float> bias, Tensor<float>& y) {
#if TESSERA_HAS_WIDE_LOOPS
  const std::int64_t outs = s.y.c, channels = s.x.c, blocks = channels / kBlock;
  const bool fits = simd_level() == SimdLevel::avx512 && plain_pointwise(s, g) && !s.activation &&
                    s.x_layout == Layout::nchw16c && s.y_layout == Layout::nchw &&
                    channels % kBlock == 0 && blocks <= wide::kMaxPointwiseBlocks &&
                    outs <= wide::kMaxPointwiseOutputs;
  if (!fits) return false;
  TESSERA_CHECK(x.layout() == Layout::nchw16c && y.layout() == Layout::nchw && w.shape() == s.w &&
                    std::ssize(bias) == (s.bias ? outs : 0),
                std::string("1x1 conv forward: an input in ") + to_string(x.layout()) +
                    ", a weight of " + w.shape().str() + " (planned " + s.w.str() +
                    "), an output in " + to_string(y.layout()) + ", " +
                    std::to_string(bias.size()) + " biases");
  const std::int64_t n = s.x.h * s.x.w;
  const float* b = s.bias ? bias.data() : nullptr;
  for (std::int64_t i = 0; i < s.x.n; ++i)
    parallel_for(
        n,
        [&](std::int64_t begin, std::int64_t end) {
          wide::pointwise_forward_blocks16(x.data() + i * channels * n, n, blocks, outs, w.data(),
                                           b, begin, end, y.data() + i * outs * n);
        },
        grain_for(channels));
  return true;
#else
  (void)s, (void)g, (void)x, (void)w, (void)bias, (void)y;
  return false;
#endif
}

bool OneDnnConv::backward_fused(const Tensor<float>& x, const Tensor<float>& dy,
                                const Tensor<float>& w, const std::optional<FusedActivation>& f,
                                Tensor<float>& dx, Tensor<float>& dw, std::span<float> dbias) {
  Plan& p = *plan_;
  // On Tessera's AMX kernels (bf16): backward-data with f' applied as its tiles are written (no
  // pass over dx after it), then backward-weights.
  if (p.amx_data && p.amx_weights && (!f || f->kind != ActivationKind::sigmoid)) {
    check_shape("input", x.shape(), p.shapes.x);
    check_shape("output gradient", dy.shape(), p.shapes.y);
    check_shape("weight", w.shape(), p.shapes.w);
    check_shape("input gradient", dx.shape(), p.shapes.x);
    check_shape("weight gradient", dw.shape(), p.shapes.w);
    p.amx_data->set_weights(w.data(), true);
    p.amx_data->run(dy.data(), {}, std::nullopt, dx.data(), f ? x.data() : nullptr, f);
    p.amx_weights->run(x.data(), dy.data(), dw.data(), p.shapes.bias ? dbias : std::span<float>());
    return true;
  }
  return !p.bf16 && pointwise_backward_one_pass(p.shapes, p.geometry, x, dy, w, f, dx, dw, dbias);
}

std::unique_ptr<ConvKernel<float>> make_onednn_blocked_pointwise(const ConvShapes& shapes,
                                                                 const reference::ConvGeometry& g) {
  const Shape4 &x = shapes.x, &y = shapes.y;
  const bool takes = plain_pointwise(shapes, g) && !shapes.activation &&
                     shapes.x_layout == Layout::nchw8c && shapes.y_layout == Layout::nchw &&
                     x.c % 8 == 0 && y.c < kBlock && x.n > 0;
  if (!takes) return nullptr;
  apply_threads();
  return std::make_unique<OneDnnBlockedPointwise>(shapes);
}

double onednn_sgemm_gflops(std::int64_t n, int repeats) {
  apply_threads();
  const auto size = static_cast<std::size_t>(n * n);
  std::vector<float> a(size, 0.5f), b(size, 0.25f), c(size, 0.0f);
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    sgemm('N', 'N', n, n, n, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // The first product also pays for first-touch page faults of c; the best one does not.
    best = std::max(best, 2.0 * static_cast<double>(n) * static_cast<double>(n * n) / s / 1e9);
  }
  return best;
}

std::string onednn_description() {
  const bool applied = apply_threads();
  const dnnl_version_t* v = dnnl_version();
  const std::string text = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) +
                           "." + std::to_string(v->patch) + ", " + runtime_name(v->cpu_runtime);
  if (applied)
    return text + ", " + std::to_string(kernel_threads().count) +
           (kernel_threads().count == 1 ? " thread" : " threads") +
           " per rank: " + kernel_threads().reason;
  if (v->cpu_runtime == DNNL_RUNTIME_SEQ) return text + ", 1 thread per rank";
  return text + ", the runtime's own thread count";
}

}  // namespace tessera
