#include "tessera/kernels/onednn_pool.hpp"

#include <oneapi/dnnl/dnnl.hpp>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "onednn_common.hpp"
#include "tessera/error.hpp"
#include "tessera/parallel.hpp"

namespace tessera {
namespace {

using dnnl::memory;

// Whether oneDNN pools every value of x inside `image` (rows x columns of x) as the reference
// does: not a NaN or an infinity (exponent bits all set), and not the lowest float, which is
// where oneDNN's max starts (a window of only that value would keep its first position, padding
// included, where the reference takes the first image position). One threaded pass.
bool image_ordinary(const Tensor<float>& x, Layout layout, const Box& image) {
  const Shape4& s = x.shape();
  const std::int64_t v = block_of(layout);
  const std::int64_t planes = s.n * s.c / v, rows = image.h.size();
  const std::int64_t segment = image.w.size() * v;
  std::atomic<bool> bad{false};
  parallel_for(
      planes * rows,
      [&](std::int64_t first, std::int64_t last) {
        std::uint32_t any = 0;
        for (std::int64_t k = first; k < last; ++k) {
          const std::int64_t plane = k / rows, row = image.h.begin + k % rows;
          const float* p = x.data() + ((plane * s.h + row) * s.w + image.w.begin) * v;
          for (std::int64_t j = 0; j < segment; ++j) {
            std::uint32_t bits;
            std::memcpy(&bits, p + j, sizeof bits);
            any |= static_cast<std::uint32_t>((bits & 0x7f800000u) == 0x7f800000u) |
                   static_cast<std::uint32_t>(bits == 0xff7fffffu);  // -FLT_MAX
          }
        }
        if (any != 0) bad.store(true, std::memory_order_relaxed);
      },
      grain_for(segment));
  return !bad.load();
}

bool is_jit(const dnnl::primitive_desc& pd) {
  return std::string_view(pd.impl_info_str()).starts_with("jit");
}

// The output extent oneDNN derives from a window of `in` with no padding, if it is `out`.
bool fits(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride) {
  return in >= kernel && (in - kernel) / stride + 1 == out;
}

}  // namespace

struct OneDnnPool::Plan {
  PoolKind kind;
  PoolShapes shapes;
  reference::PoolGeometry geometry;
  dnnl::stream stream{onednn::cpu_engine()};
  dnnl::pooling_forward::primitive_desc fwd_pd;
  dnnl::pooling_backward::primitive_desc bwd_pd;
  dnnl::pooling_forward fwd;
  dnnl::pooling_backward bwd;
  memory::desc x_desc, y_desc;
  // max: where each output's maximum lies, kept from forward to backward; its storage from the
  // host allocator, in huge pages where large (oneDNN's own allocation is in 4 KiB pages, which
  // cost hidden faults on some VMs: tessera/allocator.hpp, HostVector).
  Storage workspace_storage;
  memory workspace;
};

std::unique_ptr<OneDnnPool> OneDnnPool::create(PoolKind kind, const PoolShapes& shapes,
                                               const reference::PoolGeometry& g) {
  const Shape4 &x = shapes.x, &y = shapes.y;
  if (g.pad_top != 0 || g.pad_left != 0 || g.kernel_h <= 0 || g.kernel_w <= 0 || g.stride_h <= 0 ||
      g.stride_w <= 0 || x.n != y.n || x.c != y.c || x.numel() == 0 || y.numel() == 0 ||
      x.c % block_of(shapes.layout) != 0 || !fits(x.h, y.h, g.kernel_h, g.stride_h) ||
      !fits(x.w, y.w, g.kernel_w, g.stride_w) || g.image.empty() ||
      intersect(g.image, Box{{0, x.h}, {0, x.w}}) != g.image)
    return nullptr;
  onednn::apply_threads();
  auto plan = std::make_unique<Plan>();
  plan->kind = kind;
  plan->shapes = shapes;
  plan->geometry = g;
  try {
    using namespace dnnl;
    const algorithm alg =
        kind == PoolKind::max ? algorithm::pooling_max : algorithm::pooling_avg_include_padding;
    plan->x_desc = onednn::dense_desc(x, shapes.layout);
    plan->y_desc = onednn::dense_desc(y, shapes.layout);
    const memory::dims strides{g.stride_h, g.stride_w}, kernel{g.kernel_h, g.kernel_w};
    const memory::dims no_pad{0, 0};
    plan->fwd_pd = pooling_forward::primitive_desc(
        pooling_forward::desc(prop_kind::forward_training, alg, plan->x_desc, plan->y_desc, strides,
                              kernel, no_pad, no_pad),
        onednn::user_scratchpad(), onednn::cpu_engine());
    plan->bwd_pd = pooling_backward::primitive_desc(
        pooling_backward::desc(alg, plan->x_desc, plan->y_desc, strides, kernel, no_pad, no_pad),
        onednn::user_scratchpad(), onednn::cpu_engine(), plan->fwd_pd);
    // Only the JIT implementations pay: oneDNN's plain-loop ones ("ref", and "simple_nchw" for
    // NCHW) measured slower than Tessera's reference here (8 channels of 1024x1024 pooled by 2:
    // 35 + 12 ms forward + backward against 34 + 6 ms).
    if (!is_jit(plan->fwd_pd) || !is_jit(plan->bwd_pd)) return nullptr;
    plan->fwd = pooling_forward(plan->fwd_pd);
    plan->bwd = pooling_backward(plan->bwd_pd);
    if (kind == PoolKind::max) {
      const memory::desc ws = plan->fwd_pd.workspace_desc();
      plan->workspace_storage = Storage(host_allocator(), ws.get_size());
      plan->workspace = memory(ws, onednn::cpu_engine(), plan->workspace_storage.data());
    }
  } catch (const dnnl::error&) {
    return nullptr;  // declined: the reference takes the case
  }
  return std::unique_ptr<OneDnnPool>(new OneDnnPool(std::move(plan)));
}

OneDnnPool::OneDnnPool(std::unique_ptr<Plan> plan) : plan_(std::move(plan)) {}
OneDnnPool::~OneDnnPool() = default;

float OneDnnPool::window_padding() const {
  return plan_->kind == PoolKind::max ? -std::numeric_limits<float>::infinity() : 0.0f;
}

namespace {

void check_shape(const char* what, const Shape4& got, const Shape4& planned) {
  TESSERA_CHECK(got == planned, std::string("oneDNN pooling planned for ") + what + " " +
                                    planned.str() + ", called with " + got.str());
}

// f(in, out) on NCHW tensors, through copies when the plan's layout is blocked: the reference
// fallback reads NCHW only.
template <typename F>
void in_nchw(Layout layout, const Tensor<float>& in, Tensor<float>& out, F&& f) {
  if (layout == Layout::nchw) {
    f(in, out);
    return;
  }
  TESSERA_CHECK(in.layout() == layout && out.layout() == layout,
                std::string("oneDNN pooling planned for ") + to_string(layout) + ", called with " +
                    to_string(in.layout()) + " and " + to_string(out.layout()) + " tensors");
  Tensor<float> plain(out.shape(), uninitialized);
  f(to_layout(in, Layout::nchw), plain);
  out = to_layout(plain, layout);
}

// Runs `prim` of `pd` from `in` to `out`, with max pooling's workspace and the scratchpad it asks
// for.
void execute(const dnnl::primitive& prim, const dnnl::primitive_desc_base& pd, dnnl::stream& s,
             int in_arg, memory in, int out_arg, memory out, PoolKind kind,
             const memory& workspace) {
  std::unordered_map<int, memory> args{{in_arg, std::move(in)}, {out_arg, std::move(out)}};
  if (kind == PoolKind::max) args.insert({DNNL_ARG_WORKSPACE, workspace});
  Storage scratch;
  onednn::add_scratchpad(pd, args, scratch);
  prim.execute(s, args);
  s.wait();
}

}  // namespace

void OneDnnPool::forward(const Tensor<float>& x, Tensor<float>& y) {
  Plan& p = *plan_;
  check_shape("input", x.shape(), p.shapes.x);
  check_shape("output", y.shape(), p.shapes.y);
  fallback_.reset();
  if (!image_ordinary(x, p.shapes.layout, p.geometry.image)) {
    // The reference's rules for NaN, infinities and the lowest float; it reads NCHW.
    fallback_.emplace(p.kind, p.geometry);
    in_nchw(p.shapes.layout, x, y,
            [&](const Tensor<float>& in, Tensor<float>& out) { fallback_->forward(in, out); });
    return;
  }
  onednn::run("pooling forward", [&] {
    execute(p.fwd, p.fwd_pd, p.stream, DNNL_ARG_SRC,
            memory(p.x_desc, onednn::cpu_engine(), const_cast<float*>(x.data())), DNNL_ARG_DST,
            memory(p.y_desc, onednn::cpu_engine(), y.data()), p.kind, p.workspace);
  });
}

void OneDnnPool::backward(const Tensor<float>& dy, Tensor<float>& dx) {
  Plan& p = *plan_;
  check_shape("output gradient", dy.shape(), p.shapes.y);
  check_shape("input gradient", dx.shape(), p.shapes.x);
  if (fallback_) {
    in_nchw(p.shapes.layout, dy, dx,
            [&](const Tensor<float>& in, Tensor<float>& out) { fallback_->backward(in, out); });
    return;
  }
  onednn::run("pooling backward", [&] {
    execute(p.bwd, p.bwd_pd, p.stream, DNNL_ARG_DIFF_DST,
            memory(p.y_desc, onednn::cpu_engine(), const_cast<float*>(dy.data())),
            DNNL_ARG_DIFF_SRC, memory(p.x_desc, onednn::cpu_engine(), dx.data()), p.kind,
            p.workspace);
  });
}

std::string OneDnnPool::name() const {
  return std::string("onednn ") + plan_->fwd_pd.impl_info_str() + "/" +
         plan_->bwd_pd.impl_info_str();
}

}  // namespace tessera
