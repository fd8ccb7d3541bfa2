#include "tessera/drivers/plan.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "plan_memory.hpp"
#include "tessera/checked.hpp"
#include "tessera/engine/graph.hpp"
#include "tessera/error.hpp"
#include "tessera/kernels/amx_conv.hpp"
#include "tessera/kernels/narrow_conv.hpp"
#include "tessera/partition.hpp"

namespace tessera {
namespace {

using Node = LayerNode<double>;

// Sizes in the plan saturate at kSizeMax ("more than 8 EiB") instead of wrapping around: a 10^9 x
// 10^9 image must read as too large, never as a negative or small count.
constexpr std::int64_t mul(std::int64_t a, std::int64_t b) {
  return saturating_mul(a, b);
}
constexpr std::int64_t add(std::int64_t a, std::int64_t b) {
  return saturating_add(a, b);
}
std::int64_t elements(const Box& b) {
  return mul(b.h.size(), b.w.size());
}

std::int64_t dtype_size(const std::string& dtype) {
  TESSERA_CHECK(dtype == "float32" || dtype == "float64",
                "bad dtype '" + dtype + "': expected float32 or float64");
  return dtype == "float32" ? 4 : 8;
}

// The input distribution as rank (0, 0, 0) sees it: global shapes, which are all that setup
// reads, do not depend on the rank.
Distribution input_distribution(const ModelSpec& spec, const PlanOptions& o) {
  const Shape4& in = o.input;
  const GridShape& g = o.grid;
  TESSERA_CHECK(in.c == spec.input_channels,
                "model '" + spec.name + "' takes " + std::to_string(spec.input_channels) +
                    " input channels, the image has " + std::to_string(in.c) + " (--image " +
                    std::to_string(spec.input_channels) + "x" + std::to_string(in.h) + "x" +
                    std::to_string(in.w) + ")");
  TESSERA_CHECK(in.n >= g.n, "the batch has " + std::to_string(in.n) +
                                 " samples, fewer than the grid's " + std::to_string(g.n) +
                                 " data-parallel groups: every group needs at least one sample");
  check_splittable("the " + std::to_string(in.h) + "x" + std::to_string(in.w) + " image", in.h,
                   in.w, g.h, g.w);
  // The plan keeps a few numbers per spatial rank and layer: bound them to what one process holds.
  constexpr std::int64_t max_ranks = std::int64_t{1} << 22;
  TESSERA_CHECK(static_cast<std::int64_t>(g.h) * g.w <= max_ranks,
                "grid " + std::to_string(g.n) + "x" + std::to_string(g.h) + "x" +
                    std::to_string(g.w) + " has " +
                    std::to_string(static_cast<std::int64_t>(g.h) * g.w) +
                    " spatial ranks; tessera plan handles up to " + std::to_string(max_ranks));
  return with_aligned_split(spec, {in, g, GridCoords{}});
}

// Builds and sets up every layer as Model does, without binding any to a grid: shapes only, the
// parameters counted, not allocated. A training step is planned: a layer that cannot train on
// this input (Layer::check_trainable) is refused, as tessera train refuses it.
std::vector<Node> set_up(const ModelSpec& spec, const Distribution& input) {
  std::vector<Node> nodes = set_up_layers<double>(spec, input, Parameters::count);
  for (const Node& node : nodes)
    node.layer->check_trainable();
  return nodes;
}

// One spatial rank's part in a halo layer's exchange.
struct RankHalo {
  Box owned;               // its input tile
  Box window;              // the input box it reads, not clipped to the image
  std::int64_t moved = 0;  // elements per channel plane received + sent in fill
};

// The boxes window_plan gives every rank (same owned tiles, same windows from the same map, same
// intersections), but each window is intersected only with the tiles it can reach (the owners of
// its ends), and a rank's sends are counted as its peers' receives. A layer costs O(ranks x
// neighbours) instead of window_plan's O(ranks) per rank, so a 1024-rank grid plans at once;
// tests/unit/test_plan.cpp checks the two agree.
std::vector<RankHalo> halo_of_every_rank(const Distribution& in, const Distribution& out,
                                         const WindowMap& map) {
  const GridShape& g = in.grid;
  std::vector<RankHalo> ranks(static_cast<std::size_t>(g.h) * g.w);
  for (int i = 0; i < g.h; ++i)
    for (int j = 0; j < g.w; ++j) {
      const Box t = out.tile_of(i, j);
      ranks[i * g.w + j] = {in.tile_of(i, j), {map.rows(t.h), map.cols(t.w)}};
    }
  // The parts [first, last] of one axis whose tiles meet `want` (all of them when every tile is
  // the whole image); last < first when `want` lies in the padding.
  auto reach = [&](Range want, bool rows) -> std::pair<int, int> {
    const std::int64_t extent = rows ? in.global.h : in.global.w;
    const int parts = rows ? g.h : g.w;
    const Range c = intersect(want, {0, extent});
    if (c.empty()) return {0, -1};
    if (in.replicated) return {0, parts - 1};
    const auto owner = [&](std::int64_t k) { return rows ? in.row_owner(k) : in.col_owner(k); };
    return {owner(c.begin), owner(c.end - 1)};
  };
  for (int k = 0; k < g.h * g.w; ++k) {
    const Box& window = ranks[k].window;
    if (window.empty()) continue;
    const auto [a0, a1] = reach(window.h, true);
    const auto [b0, b1] = reach(window.w, false);
    for (int a = a0; a <= a1; ++a)
      for (int b = b0; b <= b1; ++b) {
        const int peer = a * g.w + b;
        if (peer == k) continue;
        const std::int64_t n = elements(intersect(ranks[peer].owned, window));
        ranks[k].moved = add(ranks[k].moved, n);        // k receives it in fill
        ranks[peer].moved = add(ranks[peer].moved, n);  // and the peer sends it
      }
  }
  return ranks;
}

void widen(Spread& s, std::int64_t v, bool first) {
  if (first) {
    s = {v, v};
  } else {
    s.min = std::min(s.min, v);
    s.max = std::max(s.max, v);
  }
}

// Per-sample element counts of one spatial rank, summed over the model.
struct RankTotals {
  std::int64_t activations = 0;
  std::int64_t windows = 0;
  std::int64_t gradients = 0;   // the largest single layer's
  std::int64_t halo = 0;        // forward + backward
  std::int64_t staging = 0;     // halo boxes kept in device memory (elements)
  std::int64_t kept_bytes = 0;  // bytes the CUDA kernels keep for backward
  std::int64_t host_halo = 0;   // bytes of the host's halo buffers
};

MemoryEstimate to_bytes(const RankTotals& t, std::int64_t samples, std::int64_t params,
                        std::int64_t bytes) {
  MemoryEstimate m;
  m.params = mul(mul(2, params), bytes);
  m.activations = mul(mul(t.activations, samples), bytes);
  m.windows = mul(mul(t.windows, samples), bytes);
  m.gradients = mul(mul(t.gradients, samples), bytes);
  m.device_buffers = add(mul(mul(t.staging, samples), bytes), mul(t.kept_bytes, samples));
  return m;
}

// Bytes per output element the CUDA kernel of layer type `type` keeps for backward
// (kernels/cuda/cuda_local_kernels.cpp, cuda_layer_kernels.cpp).
std::int64_t kept_per_output(const std::string& type, std::int64_t dtype_bytes) {
  if (type == "relu" || type == "leaky_relu") return 1;  // x > 0
  if (type == "maxpool2d") return 8;                     // the argmax
  if (type == "sigmoid") return dtype_bytes;             // its output
  return 0;
}

Plan analyse(const ModelSpec& spec, const PlanOptions& o) {
  Plan plan;
  plan.model = spec.name;
  plan.options = o;
  plan.dtype_bytes = dtype_size(o.dtype);
  const Distribution input = input_distribution(spec, o);
  const std::vector<Node> nodes = set_up(spec, input);
  plan.split_units = split_units_text(input);
  const GridShape& g = o.grid;
  for (int n = 0; n < g.n; ++n)
    widen(plan.samples, input.samples_of(n).size(), n == 0);
  const std::int64_t bytes = plan.dtype_bytes;
  // Group 0 holds the most samples (block partition), so per-sample counts times its samples
  // bound every rank.
  const std::int64_t samples = plan.samples.max;
  MemoryWalk walk(spec, nodes, input, samples, plan.dtype_bytes, o.engine);

  std::vector<RankTotals> ranks(static_cast<std::size_t>(g.h) * g.w);
  for (int i = 0; i < g.h; ++i)
    for (int j = 0; j < g.w; ++j) {
      const Box tile = input.tile_of(i, j);
      widen(plan.input_rows, tile.h.size(), i == 0 && j == 0);
      widen(plan.input_cols, tile.w.size(), i == 0 && j == 0);
      ranks[i * g.w + j].activations = mul(elements(tile), input.global.c);
    }

  for (std::size_t k = 0; k < nodes.size(); ++k) {
    const Node& node = nodes[k];
    LayerPlan lp;
    lp.name = node.layer->name();
    lp.type = spec.layers[plan.layers.size()].type;
    lp.output = node.out.global;
    lp.params = node.layer->parameter_elements();
    plan.params = add(plan.params, lp.params);
    const std::optional<WindowMap> map = node.layer->window();
    lp.halo = map.has_value();
    const Distribution& from = node.in.front();
    const std::vector<RankHalo> halos =
        map ? halo_of_every_rank(from, node.out, *map) : std::vector<RankHalo>{};
    std::int64_t halo_max = 0;
    for (int i = 0; i < g.h; ++i)
      for (int j = 0; j < g.w; ++j) {
        const bool first = i == 0 && j == 0;
        RankTotals& r = ranks[i * g.w + j];
        const Box tile = node.out.tile_of(i, j);
        widen(lp.tile_rows, tile.h.size(), first);
        widen(lp.tile_cols, tile.w.size(), first);
        const std::int64_t out = mul(elements(tile), node.out.global.c);
        std::int64_t in = 0;
        for (const Distribution& d : node.in)
          in = add(in, mul(elements(d.tile_of(i, j)), d.global.c));
        std::int64_t window = 0;
        if (map) {
          const RankHalo& h = halos[i * g.w + j];
          window = mul(elements(h.window), from.global.c);
          const std::int64_t moved = mul(h.moved, from.global.c);
          halo_max = std::max(halo_max, moved);
          r.halo = add(r.halo, mul(2, moved));  // fill, then accumulate
          r.staging = add(r.staging, moved);    // one device buffer per box sent or received
          r.host_halo = add(r.host_halo, walk.halo_bytes(k, h.moved));
          // Only the part inside the image is exchanged: clip the window to it. A window wholly
          // in the padding clips to an empty range, its sides then sum to minus the owned tile.
          auto clip = [](Range w, std::int64_t extent) {
            const std::int64_t b = std::clamp<std::int64_t>(w.begin, 0, extent);
            return Range{b, std::clamp<std::int64_t>(w.end, b, extent)};
          };
          const Range rows = clip(h.window.h, from.global.h);
          const Range cols = clip(h.window.w, from.global.w);
          widen(lp.top, h.owned.h.begin - rows.begin, first);
          widen(lp.bottom, rows.end - h.owned.h.end, first);
          widen(lp.left, h.owned.w.begin - cols.begin, first);
          widen(lp.right, cols.end - h.owned.w.end, first);
        }
        r.activations = add(r.activations, out);
        r.windows = add(r.windows, window);
        r.kept_bytes = add(r.kept_bytes, mul(out, kept_per_output(lp.type, bytes)));
        r.gradients = std::max(r.gradients, add(add(out, window), in));
      }
    lp.forward_bytes = lp.backward_bytes = mul(mul(halo_max, samples), bytes);
    plan.layers.push_back(std::move(lp));
  }

  std::int64_t step_max = 0;
  for (int i = 0; i < g.h; ++i)
    for (int j = 0; j < g.w; ++j) {
      const RankTotals& r = ranks[i * g.w + j];
      step_max = std::max(step_max, r.halo);
      MemoryEstimate m = to_bytes(r, samples, plan.params, bytes);
      const RankWalk& w = walk.walk(i, j);
      m.step = w.step.bytes;
      m.step_at = w.step.at;
      m.evaluation = w.inference.bytes;
      m.evaluation_at = w.inference.at;
      m.loss_gradient = w.loss_gradient;
      m.halo = r.host_halo;
      const std::int64_t total = o.device ? m.device_total() : m.total();
      const std::int64_t best = o.device ? plan.memory.device_total() : plan.memory.total();
      if ((i == 0 && j == 0) || total > best) {
        plan.memory = m;
        plan.busiest = {0, i, j};
      }
    }
  plan.step_bytes = mul(mul(step_max, samples), bytes);
  return plan;
}

bool plans(const ModelSpec& spec, const PlanOptions& o) {
  try {
    set_up(spec, input_distribution(spec, o));
    return true;
  } catch (const Error&) {
    return false;
  }
}

std::string spread(const Spread& s) {
  return s.min == s.max ? std::to_string(s.min)
                        : std::to_string(s.min) + ".." + std::to_string(s.max);
}

}  // namespace

std::string human_bytes(std::int64_t bytes) {
  if (bytes >= kSizeMax) return "more than 8 EiB";
  if (bytes < 1024) return std::to_string(bytes) + " B";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes) / 1024;
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char text[32];
  std::snprintf(text, sizeof text,
                v < 10    ? "%.2f %s"
                : v < 100 ? "%.1f %s"
                          : "%.0f %s",
                v, units[u]);
  return text;
}

namespace {

std::string human(std::int64_t bytes) {
  return human_bytes(bytes);
}

void print_table(const std::vector<std::vector<std::string>>& rows, std::ostream& out) {
  std::vector<std::size_t> width;
  for (const auto& row : rows)
    for (std::size_t k = 0; k < row.size(); ++k) {
      if (width.size() <= k) width.push_back(0);
      width[k] = std::max(width[k], row[k].size());
    }
  for (const auto& row : rows) {
    std::string line = " ";
    for (std::size_t k = 0; k < row.size(); ++k) {
      // Names left-aligned, numbers right-aligned.
      const std::string pad(width[k] - row[k].size(), ' ');
      line += " " + (k < 3 ? row[k] + pad : pad + row[k]);
    }
    while (!line.empty() && line.back() == ' ')
      line.pop_back();
    out << line << "\n";
  }
}

}  // namespace

PlanEngine plan_engine(const RuntimeOptions& o) {
  return {.kernels = o.kernels,
          .fuse = o.fuse,
          .windowless = o.windowless,
          .narrow_conv = o.narrow_conv && narrow_conv_available(),
          .bf16 = o.bf16,
          .amx = amx::available()};
}

Plan make_plan(const ModelSpec& spec, const PlanOptions& options) {
  Plan plan = analyse(spec, options);
  PlanOptions single = options;
  single.grid = GridShape{1, 1, 1};
  plan.single = analyse(spec, single).memory;
  return plan;
}

std::optional<GridShape> suggest_grid(const ModelSpec& spec, const PlanOptions& options) {
  auto fits = [&](int h, int w) {
    PlanOptions o = options;
    o.grid = {options.grid.n, h, w};
    return plans(spec, o);
  };
  if (!fits(1, 1)) return std::nullopt;
  // No grid splits the input image into more parts than it has rows or columns.
  const int max_w = static_cast<int>(std::min<std::int64_t>(options.grid.w, options.input.w));
  int best_h = 1, best_w = 1;
  for (int h = static_cast<int>(std::min<std::int64_t>(options.grid.h, options.input.h)); h >= 1;
       --h) {
    if (static_cast<std::int64_t>(h) * max_w <= static_cast<std::int64_t>(best_h) * best_w) break;
    if (!fits(h, 1)) continue;
    // Fewer columns give every tile more of them, so a fitting width stays fitting below it:
    // bisect for the largest.
    int lo = 1, hi = max_w;
    while (lo < hi) {
      const int mid = lo + (hi - lo + 1) / 2;
      if (fits(h, mid)) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    if (static_cast<std::int64_t>(h) * lo > static_cast<std::int64_t>(best_h) * best_w) {
      best_h = h;
      best_w = lo;
    }
  }
  return GridShape{options.grid.n, best_h, best_w};
}

namespace {

// The fewest spatial ranks (then the squarest grid) with options.grid's n, up to 64 x 64, whose
// busiest rank's cost(plan) fits in `bytes`.
template <typename Cost>
std::optional<GridShape> fewest_ranks_that_fit(const ModelSpec& spec, const PlanOptions& options,
                                               std::int64_t bytes, Cost cost) {
  const int max_h = static_cast<int>(std::min<std::int64_t>(64, options.input.h));
  const int max_w = static_cast<int>(std::min<std::int64_t>(64, options.input.w));
  // The most ranks hold the least per rank: when the grid of the most ranks the model plans on
  // does not fit, none does (saves the search over all 4096 grids, seconds for a hopeless image).
  {
    PlanOptions o = options;
    o.grid = {options.grid.n, max_h, max_w};
    const std::optional<GridShape> most = plans(spec, o) ? o.grid : suggest_grid(spec, o);
    if (!most) return std::nullopt;
    o.grid = *most;
    if (cost(analyse(spec, o)) > bytes) return std::nullopt;
  }
  for (int ranks = 1; ranks <= max_h * max_w; ++ranks) {
    std::optional<GridShape> found;
    for (int h = 1; h <= std::min(ranks, max_h); ++h) {
      if (ranks % h != 0 || ranks / h > max_w) continue;
      const int w = ranks / h;
      PlanOptions o = options;
      o.grid = {options.grid.n, h, w};
      if (!plans(spec, o)) continue;
      if (cost(analyse(spec, o)) > bytes) continue;
      // The squarest: the smallest difference of h and w.
      if (!found || std::abs(h - w) < std::abs(found->h - found->w)) found = o.grid;
    }
    if (found) return found;
  }
  return std::nullopt;
}

}  // namespace

std::optional<GridShape> grid_that_fits(const ModelSpec& spec, const PlanOptions& options,
                                        std::int64_t device_bytes) {
  // Parameters and their gradients are on every rank: no grid makes them smaller.
  if (add(analyse(spec, options).memory.params, kDeviceReserve) > device_bytes) return std::nullopt;
  PlanOptions o = options;
  o.device = true;
  return fewest_ranks_that_fit(spec, o, device_bytes, [](const Plan& p) {
    return add(p.memory.device_total(), kDeviceReserve);
  });
}

std::optional<GridShape> host_grid_that_fits(const ModelSpec& spec, const PlanOptions& options,
                                             std::int64_t host_bytes,
                                             const std::function<std::int64_t(const Plan&)>& cost) {
  if (analyse(spec, options).memory.params > host_bytes) return std::nullopt;
  return fewest_ranks_that_fit(spec, options, host_bytes, cost);
}

void print_plan(const Plan& p, std::ostream& out) {
  const PlanOptions& o = p.options;
  out << "tessera plan: model " << p.model << ", grid " << o.grid.str() << " ("
      << static_cast<std::int64_t>(o.grid.n) * o.grid.h * o.grid.w << " ranks), image " << o.input.c
      << "x" << o.input.h << "x" << o.input.w << ", batch " << o.input.n << ", " << o.dtype << "\n";
  out << "  samples per rank " << spread(p.samples) << "; " << p.params
      << " parameters; tiles and halos: min..max over ranks\n";
  if (!p.split_units.empty()) out << "  tiles: " << p.split_units << "\n";
  out << "\n";
  std::vector<std::vector<std::string>> rows = {{"layer", "type", "output", "tile rows x cols",
                                                 "top", "bottom", "left", "right", "fwd", "bwd"}};
  rows.push_back({"input", "", o.input.str(), spread(p.input_rows) + " x " + spread(p.input_cols),
                  "-", "-", "-", "-", "-", "-"});
  for (const LayerPlan& l : p.layers) {
    const bool h = l.halo;
    rows.push_back({l.name, l.type, l.output.str(),
                    spread(l.tile_rows) + " x " + spread(l.tile_cols), h ? spread(l.top) : "-",
                    h ? spread(l.bottom) : "-", h ? spread(l.left) : "-", h ? spread(l.right) : "-",
                    h ? human(l.forward_bytes) : "-", h ? human(l.backward_bytes) : "-"});
  }
  print_table(rows, out);
  out << "  top/bottom/left/right: input rows (columns) a rank's window reaches beyond its tile, "
         "inside\n    the image; fwd/bwd: halo bytes received + sent by the busiest rank\n\n";
  out << "  per step and rank: halo " << human(p.step_bytes)
      << " (received + sent, forward and backward)\n"
      << "                     gradient allreduce " << human(mul(p.params, p.dtype_bytes)) << "\n";
  const MemoryEstimate& m = p.memory;
  out << "  peak memory per rank (estimate): " << human(m.total()) << ", on rank (n, i, j) = ("
      << p.busiest.n << ", " << p.busiest.i << ", " << p.busiest.j << ")\n";
  out << "    training step " << human(m.step) << " at " << m.step_at
      << "\n    evaluation (validation, predict: two forward passes) " << human(m.evaluation)
      << " at " << m.evaluation_at << "\n    + halo buffers " << human(m.halo) << " + fixed "
      << human(kHostFixed) << " (the binary, MPI, oneDNN's code)\n";
  out << "  single device (estimate): " << human(p.single.total());
  if (p.single.total() < kSizeMax && m.total() < kSizeMax) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.2f",
                  static_cast<double>(p.single.total()) / static_cast<double>(m.total()));
    out << ", " << ratio << "x the per-rank peak";
  }
  out << "\n";
  out << "  memory model: the step walked as the engine runs it (outputs freed after their last "
         "reader,\n    what each layer keeps for backward, one layer's gradients at a time), "
         "the largest live total\n";
  out << "  inference (tessera predict, estimate): " << human(m.inference()) << " per rank\n";
  if (!o.device) return;
  out << "\n  on the GPU (--device cuda, estimate): " << human(m.device_total()) << " per rank\n"
      << "    activations " << human(m.activations) << " + windows " << human(m.windows)
      << " + grads " << human(m.gradients) << " + params x2 " << human(m.params)
      << "\n    + halo buffers and what the CUDA kernels keep for backward "
      << human(m.device_buffers)
      << "\n    (every output and window kept: not walked)\n    besides: the CUDA context and "
         "cuDNN's workspace, allow "
      << human(kDeviceReserve) << "\n";
  if (o.device_memory <= 0) {
    out << "  give --device-memory GIB (or run where a GPU is usable) to check that it fits\n";
    return;
  }
  const bool fits = add(m.device_total(), kDeviceReserve) <= o.device_memory;
  out << "  " << o.device_name << ": " << human(o.device_memory)
      << " per GPU: " << (fits ? "fits" : "does NOT fit") << "\n";
}

}  // namespace tessera
