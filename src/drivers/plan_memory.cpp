#include "plan_memory.hpp"

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "tessera/checked.hpp"
#include "tessera/kernels/narrow_conv.hpp"
#include "tessera/layers/conv2d.hpp"

namespace tessera {

namespace {

constexpr std::int64_t kMiB = std::int64_t{1} << 20;

// The host pool serves blocks of 1 MiB and more in 2 MiB pages (src/allocator.cpp).
std::int64_t pooled(std::int64_t bytes) {
  if (bytes <= 0) return 0;
  if (bytes < kMiB || bytes >= kSizeMax) return bytes;
  return (bytes + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB);
}

bool is_activation(const std::string& type) {
  return type == "relu" || type == "leaky_relu";
}

}  // namespace

struct MemoryWalk::Node {
  std::string name, type;
  std::vector<int> ins;  // -1: the model input; a taken concat's reader: the concat's inputs
  std::vector<int> consumers;
  Distribution out;
  std::vector<Distribution> in;  // of `ins`
  std::optional<WindowMap> map;  // layers that read a window of their input
  std::int64_t cin = 0;          // channels of all inputs
  std::optional<Conv2dSpec> conv;
  bool handed = false;  // its one input has no other reader: the layer may take it over
  bool taken = false;   // a concat whose reader computes from its inputs (never run)
  bool parts = false;   // a convolution reading a taken concat's inputs
  bool by_producer = false, by_consumer = false;  // an activation fused into its neighbours
  bool windowless = false, narrow = false, pointwise = false, blocked_ok = false;
  bool few = false;          // few channels: the narrow kernels' where they are on
  bool nchw_out = false;     // its output comes in NCHW whatever its consumers take
  std::int64_t scratch = 0;  // bytes of oneDNN's scratchpad (Winograd)
};

MemoryWalk::MemoryWalk(const ModelSpec& spec, const std::vector<LayerNode<double>>& graph,
                       const Distribution& input, std::int64_t samples, std::int64_t dtype_bytes,
                       const PlanEngine& engine)
    : input_(input),
      samples_(samples),
      dtype_bytes_(dtype_bytes),
      engine_(engine),
      fast_(engine.kernels == KernelBackend::onednn && dtype_bytes == 4) {
  const GridShape& g = input.grid;
  ranks_ = g.n * g.h * g.w;
  for (std::size_t k = 0; k < graph.size(); ++k) {
    const LayerNode<double>& n = graph[k];
    Node w;
    w.name = n.layer->name();
    w.type = spec.layers[k].type;
    w.ins = n.inputs;
    w.out = n.out;
    w.in = n.in;
    w.map = n.layer->window();
    for (const Distribution& d : n.in)
      w.cin += d.global.c;
    if (w.type == "conv2d") w.conv = parse_conv2d(spec.layers[k]);
    params_ = saturating_add(params_, n.layer->parameter_elements());
    nodes_.push_back(std::move(w));
  }
  const std::size_t count = nodes_.size();
  for (std::size_t k = 0; k < count; ++k)
    for (int i : nodes_[k].ins)
      if (i >= 0) nodes_[static_cast<std::size_t>(i)].consumers.push_back(static_cast<int>(k));
  for (Node& n : nodes_)
    n.handed = n.ins.size() == 1 && n.ins[0] >= 0 &&
               nodes_[static_cast<std::size_t>(n.ins[0])].consumers.size() == 1;
  // A concat whose one reader is a convolution, its inputs starting on multiples of 16 channels
  // (Conv2d::offer_concat): the convolution reads the inputs.
  for (Node& n : nodes_) {
    if (!engine.fuse || n.type != "concat" || n.consumers.size() != 1) continue;
    Node& reader = nodes_[static_cast<std::size_t>(n.consumers[0])];
    bool ok = reader.type == "conv2d";
    std::int64_t channels = 0;
    for (std::size_t m = 0; m < n.ins.size(); ++m) {
      ok = ok && n.ins[m] >= 0 && channels % 16 == 0;
      channels += n.in[m].global.c;
    }
    if (!ok) continue;
    n.taken = true;
    reader.parts = true;
    reader.ins = n.ins;
    reader.in = n.in;
  }
  // Activations fused into their producer (a batch norm, oneDNN's float32 convolutions) and their
  // one consumer that reads a window (README "Fused activations").
  for (Node& n : nodes_) {
    if (!engine.fuse || n.type != "relu") continue;  // leaky_relu: counted unfused (costlier)
    const int i = n.ins[0];
    const Node* producer = i >= 0 ? &nodes_[static_cast<std::size_t>(i)] : nullptr;
    const bool by_producer =
        producer != nullptr && producer->consumers.size() == 1 &&
        (producer->type == "batchnorm2d" || (producer->type == "conv2d" && fast_));
    const bool by_consumer =
        n.consumers.size() == 1 && nodes_[static_cast<std::size_t>(n.consumers[0])].map;
    n.by_producer = by_producer;
    n.by_consumer = by_consumer || (by_producer && producer->type == "batchnorm2d");
  }
  // The narrow AVX-512 kernels (kernels/cpu/narrow_conv.cpp narrow_conv_fits) and the one-pass
  // pointwise head of few outputs; in order, as the model decides (Layer::expect_nchw_input),
  // whether a node's output comes in NCHW whatever its consumers take (the batch, narrow kernels,
  // batch norms and activations of such, concats of such): 16 -> 16 convolutions from NCHW are
  // narrow too.
  for (Node& n : nodes_) {
    const auto comes_nchw = [&](int i) {
      return i < 0 || nodes_[static_cast<std::size_t>(i)].nchw_out;
    };
    const bool all = !n.ins.empty() && std::all_of(n.ins.begin(), n.ins.end(), comes_nchw);
    n.nchw_out = (n.type == "concat" || n.type == "batchnorm2d" || is_activation(n.type) ||
                  n.type == "sigmoid") &&
                 all;
    if (!n.conv || !fast_) continue;
    const Conv2dSpec& c = *n.conv;
    const bool stride1 = c.stride == Pair{1, 1};
    const bool one = c.axis(0).span() == 1 && c.axis(1).span() == 1;
    const std::int64_t i = n.cin, o = c.out_channels;
    const bool few = narrow_conv_channels(i, o, all);
    n.few = few;
    n.narrow = engine.narrow_conv && stride1 && few &&
               narrow_conv_kernel(c.groups, c.kernel[0], c.kernel[1]);
    n.nchw_out = n.narrow;
    n.pointwise = stride1 && one && o <= 8;
    if (c.kernel == Pair{3, 3} && stride1 && c.dilation == Pair{1, 1} && std::min(i, o) >= 16 &&
        std::max(i, o) >= 32)
      n.scratch = 16 * kMiB;  // onednn_conv.cpp kWinogradScratchLimit
  }
  // Windowless convolutions (Conv2d::windowless_fits), where every tile is wider and taller than
  // twice the kernel's span (the strips must fit: else the engine keeps the window, which costs
  // more, so a doubtful case is counted with its window).
  for (Node& n : nodes_) {
    if (!n.conv || !engine.windowless) continue;
    const Conv2dSpec& c = *n.conv;
    const std::int64_t sh = c.axis(0).span(), sw = c.axis(1).span();
    const Distribution& in = n.in[0];
    bool ok = c.stride == Pair{1, 1} && !(sh == 1 && sw == 1) && in.global.h == n.out.global.h &&
              in.global.w == n.out.global.w;
    if (!n.parts && n.cin > 16 && n.cin % 16 != 0) ok = false;
    if (n.parts && fast_ && !n.narrow) ok = false;  // only the narrow kernels read the parts
    for (int a = 0; ok && a < g.h; ++a)
      ok = n.out.tile_of(a, 0).h.size() > 2 * sh;
    for (int b = 0; ok && b < g.w; ++b)
      ok = n.out.tile_of(0, b).w.size() > 2 * sw;
    n.windowless = ok;
  }
  // Outputs in a blocked layout (Model's blocked_ok): else a oneDNN convolution reorders its
  // output and the gradient into it.
  const auto reader = [&](int c) {
    const Node& n = nodes_[static_cast<std::size_t>(c)];
    return n.taken ? n.consumers[0] : c;
  };
  for (std::size_t k = count; k-- > 0;) {
    Node& n = nodes_[k];
    bool ok = !n.consumers.empty() && !n.narrow;
    for (int c : n.consumers) {
      const Node& r = nodes_[static_cast<std::size_t>(reader(c))];
      const bool takes = r.type == "conv2d" || r.type == "conv_transpose2d" ||
                         r.type == "batchnorm2d" || is_activation(r.type) ||
                         r.type == "maxpool2d" || r.type == "upsample_nearest";
      const bool passes = r.type == "batchnorm2d" || is_activation(r.type);
      ok = ok && takes && !r.narrow && (!passes || r.blocked_ok);
    }
    n.blocked_ok = ok;
  }
  // Ranks of one row (column) of the grid alike on every layer share a class: the tiles' and
  // windows' extents along that axis, and whether each window is the input tile.
  const auto classes = [&](int parts, bool rows) {
    const auto extent = [rows](const Distribution& d, int a) {
      return rows ? d.tile_of(a, 0).h : d.tile_of(0, a).w;
    };
    std::vector<int> id(static_cast<std::size_t>(parts));
    std::map<std::vector<std::int64_t>, int> seen;
    for (int a = 0; a < parts; ++a) {
      std::vector<std::int64_t> s{extent(input_, a).size()};
      for (const Node& n : nodes_) {
        const Range o = extent(n.out, a);
        s.push_back(o.size());
        for (const Distribution& d : n.in)
          s.push_back(extent(d, a).size());
        if (n.map) {
          const Range w = rows ? n.map->rows(o) : n.map->cols(o);
          s.push_back(w.size());
          s.push_back(w == extent(n.in[0], a) ? 1 : 0);
        }
      }
      const int next = static_cast<int>(seen.size());
      id[static_cast<std::size_t>(a)] = seen.emplace(std::move(s), next).first->second;
    }
    return std::pair{id, static_cast<int>(seen.size())};
  };
  row_class_ = classes(g.h, true).first;
  std::tie(col_class_, col_classes_) = classes(g.w, false);
}

MemoryWalk::~MemoryWalk() = default;

const RankWalk& MemoryWalk::walk(int i, int j) {
  const int key = row_class_[static_cast<std::size_t>(i)] * col_classes_ +
                  col_class_[static_cast<std::size_t>(j)];
  auto it = cache_.find(key);
  if (it == cache_.end()) it = cache_.emplace(key, run(i, j)).first;
  return it->second;
}

std::int64_t MemoryWalk::halo_bytes(std::size_t k, std::int64_t moved) const {
  const Node& n = nodes_[k];
  const std::int64_t per = saturating_mul(saturating_mul(moved, n.cin), samples_);
  if (!n.windowless) return saturating_mul(per, dtype_bytes_);
  // Fill and accumulate exchanges each with their buffers, and the strips' x and gradient
  // (about the received boxes) and dy (the output's channels).
  const std::int64_t dy = saturating_mul(saturating_mul(moved, n.conv->out_channels), samples_);
  return saturating_mul(saturating_add(saturating_mul(4, per), dy), dtype_bytes_);
}

namespace {

// One walk's live tensors by name, their total and its peak. Sizes saturate (a saturated total
// reads kSizeMax: too large for any machine).
class Live {
 public:
  void alloc(const std::string& key, std::int64_t bytes, const std::string& why) {
    if (bytes >= kSizeMax) saturated_ = true;
    live_[key] += bytes;
    current_ = saturating_add(current_, bytes);
    if (current_ > peak_.bytes) peak_ = {current_, why};
  }
  void free(const std::string& key) {
    const auto it = live_.find(key);
    if (it == live_.end()) return;
    current_ -= it->second;
    live_.erase(it);
  }
  // Takes `key` out of the count and returns its bytes (to be counted again under another name).
  std::int64_t release(const std::string& key) {
    const auto it = live_.find(key);
    if (it == live_.end()) return 0;
    const std::int64_t b = it->second;
    free(key);
    return b;
  }
  bool holds(const std::string& key) const { return live_.count(key) != 0; }
  WalkPeak peak() const { return saturated_ ? WalkPeak{kSizeMax, peak_.at} : peak_; }

 private:
  std::map<std::string, std::int64_t> live_;
  std::int64_t current_ = 0;
  WalkPeak peak_;
  bool saturated_ = false;
};

}  // namespace

RankWalk MemoryWalk::run(int i, int j) const {
  const std::int64_t d = dtype_bytes_, samples = samples_;
  const auto bytes = [&](std::int64_t elements, std::int64_t per) {
    return pooled(saturating_mul(elements, per));
  };
  const auto el = [&](const Distribution& dist) {
    return saturating_mul(saturating_mul(dist.tile_of(i, j).size(), dist.global.c), samples);
  };
  const std::size_t count = nodes_.size();
  struct Sizes {
    std::int64_t out = 0, in = 0, window = 0, window_padded = 0;
    bool window_is_tile = false;
  };
  std::vector<Sizes> sizes(count);
  for (std::size_t k = 0; k < count; ++k) {
    const Node& n = nodes_[k];
    Sizes& z = sizes[k];
    z.out = el(n.out);
    for (const Distribution& dist : n.in)
      z.in = saturating_add(z.in, el(dist));
    if (!n.map) continue;
    const Box t = n.out.tile_of(i, j);
    const Box w{n.map->rows(t.h), n.map->cols(t.w)};
    const std::int64_t area = saturating_mul(w.size(), samples);
    z.window = saturating_mul(area, n.cin);
    // Blocked windows pad more than 16 channels to a multiple of 16 (Conv2d::bind_kernel).
    const bool pad = fast_ && n.cin > 16 && n.cin % 16 != 0;
    z.window_padded = pad ? saturating_mul(area, (n.cin + 15) / 16 * 16) : z.window;
    z.window_is_tile = w == n.in[0].tile_of(i, j);
  }

  RankWalk result;
  const Node& last = nodes_.back();
  for (const bool inference : {false, true}) {
    Live live;
    const std::int64_t p = saturating_mul(params_, d);
    live.alloc("params", p >= kMiB ? saturating_mul(2, pooled(p)) : saturating_mul(2, p),
               "parameters and their gradients");
    if (ranks_ > 1) live.alloc("buckets", pooled(p), "gradient buckets");
    live.alloc("X", bytes(el(input_), d), "the input batch");
    if (!last.out.replicated && !inference)
      live.alloc("labels", bytes(saturating_mul(last.out.tile_of(i, j).size(), samples), 4),
                 "the labels");

    std::vector<std::string> out(count);  // the live key of each node's output
    std::vector<std::vector<std::string>> kept(count);
    const auto out_key = [&](int k) { return k < 0 ? std::string("X") : out[std::size_t(k)]; };
    const int passes = inference ? 2 : 1;
    for (int pass = 0; pass < passes; ++pass) {
      const std::string sfx = "#" + std::to_string(pass);
      std::vector<std::size_t> pending(count);
      for (std::size_t k = 0; k < count; ++k)
        pending[k] = nodes_[k].consumers.size();
      for (std::size_t k = 0; k < count; ++k) {
        const Node& n = nodes_[k];
        if (n.taken) continue;
        const Sizes& z = sizes[k];
        const std::string& name = n.name;
        const std::string& t = n.type;
        const std::vector<int>& ins = n.ins;
        std::vector<std::string> keep;
        std::vector<int> adopted;
        bool moved = false;
        const auto adopt = [&] {
          keep.push_back(out_key(ins[0]));
          adopted.push_back(ins[0]);
        };
        const auto own = [&](const std::string& suffix, std::int64_t b, const std::string& why) {
          live.alloc(name + suffix, b, name + ": " + why);
          keep.push_back(name + suffix);
        };
        // The last pass's kept state: the layer's own buffers go as it starts again; what it
        // took over, a convolution drops only after allocating its new output.
        std::vector<std::string> old = std::move(kept[k]);
        for (auto it = old.begin(); it != old.end();)
          if (!n.conv || it->starts_with(name + ".")) {
            live.free(*it);
            it = old.erase(it);
          } else {
            ++it;
          }
        const std::string y = name + ".y" + sfx;
        if (n.conv) {
          if (n.parts) {
            for (std::size_t m = 0; m < ins.size(); ++m) {
              const int src = ins[m];
              if (pending[std::size_t(src)] == 1) {
                keep.push_back(out_key(src));
                adopted.push_back(src);
              } else {
                own(".part" + std::to_string(m), bytes(el(n.in[m]), d), "copy of a concat input");
              }
            }
            if (!n.windowless) {
              for (std::size_t m = 0; m < ins.size(); ++m)
                live.free(name + ".part" + std::to_string(m));
              std::erase_if(
                  keep, [&](const std::string& key) { return key.starts_with(name + ".part"); });
              adopted.clear();
              own(".window", bytes(z.window_padded, d), "window of the concat's inputs");
            } else if (!fast_) {  // the reference kernels gather the parts for each call
              live.alloc(name + ".gather", bytes(z.in, d), name + ": the parts gathered");
              live.free(name + ".gather");
            }
          } else if (n.windowless) {
            if (n.handed && !fast_)
              adopt();
            else
              own(".tile", bytes(z.in, d), "the input tile kept");
          } else if (z.window_is_tile && n.handed) {
            adopt();
          } else {
            own(".window", bytes(z.window_padded, d), "window");
          }
        } else if (n.map) {  // pooling, upsampling, transposed convolution
          bool fused_grad = false;
          if (ins[0] >= 0) {
            const Node& prev = nodes_[std::size_t(ins[0])];
            fused_grad = prev.type == "relu" && prev.by_consumer && prev.consumers.size() == 1;
          }
          const bool reads_window = t == "conv_transpose2d";
          if (z.window_is_tile && !reads_window && !fused_grad) {
            // computed in place: nothing kept
          } else if (z.window_is_tile && n.handed) {
            adopt();
          } else {
            own(".window", bytes(z.window, d), "window");
          }
          if (t == "maxpool2d" && !live.holds(name + ".argmax"))
            live.alloc(name + ".argmax", bytes(z.out, fast_ ? 1 : 8), name + ": argmax");
        } else if (t == "batchnorm2d") {
          if (n.handed)
            adopt();
          else
            own(".x", bytes(z.in, d), "input kept");
        } else if (is_activation(t)) {
          if (!n.by_consumer && !live.holds(name + ".mask"))
            live.alloc(name + ".mask", bytes(z.out, 1), name + ": mask");
          if (n.by_producer) {
            out[k] = out_key(ins[0]);
            pending[std::size_t(ins[0])] = 1;
            moved = true;
          }
        } else if (t == "sigmoid" || t == "dropout") {
          own(".kept", bytes(z.out, d), t == "sigmoid" ? "output kept" : "mask");
        } else if (t == "linear") {
          own(".x", bytes(z.in, d), "input kept");
        }  // concat, add, global_avgpool: nothing kept
        // A new output, but for an activation its producer computed.
        if (!moved) {
          live.alloc(y, bytes(z.out, d), name + ": output, forward");
          out[k] = y;
        }
        // What a convolution took over goes only after its new output came.
        for (const std::string& key : old)
          live.free(key);
        if (n.conv && fast_) {
          live.alloc(name + ".scratch", scratch_bytes(k, z.out, z.window),
                     name + ": oneDNN's scratch, forward");
          live.free(name + ".scratch");
        }
        // A transposed convolution under bf16: oneDNN's stride-2 kernels, with their copies.
        if (t == "conv_transpose2d" && fast_ && engine_.bf16) {
          live.alloc(name + ".scratch", bf16_copies(z.out, z.window),
                     name + ": bfloat16 copies, forward");
          live.free(name + ".scratch");
        }
        kept[k] = std::move(keep);
        // Inputs this node read last go, unless it took them over.
        for (const int src : ins) {
          if (src < 0) continue;
          const std::size_t s = std::size_t(src);
          if (--pending[s] != 0 || s == count - 1) continue;
          if (std::find(adopted.begin(), adopted.end(), src) != adopted.end()) continue;
          if (moved && src == ins[0]) continue;
          live.free(out[s]);
        }
      }
      if (inference && pass + 1 < passes) live.free(out[count - 1]);
    }
    if (inference) {
      result.inference = live.peak();
      continue;
    }
    // The loss's gradient and the copy the backward pass starts from.
    result.loss_gradient = bytes(sizes.back().out, d);
    live.alloc("loss.grad", result.loss_gradient, "the loss gradient");
    live.alloc("dy", result.loss_gradient, "the loss gradient's copy");
    std::map<int, std::string> grads{{static_cast<int>(count - 1), "dy"}};
    int made = 0;
    const auto add_grad = [&](int src, std::int64_t b, const std::string& why) {
      if (src < 0) return;  // training asks for no input gradient
      const std::string key = "g" + std::to_string(++made);
      live.alloc(key, b, why);
      if (grads.count(src) != 0)
        live.free(key);  // added into the one there
      else
        grads[src] = key;
    };
    for (std::size_t k = count; k-- > 0;) {
      const Node& n = nodes_[k];
      const auto g = grads.find(static_cast<int>(k));
      if (n.taken || g == grads.end()) {
        for (const std::string& key : kept[k])
          live.free(key);
        continue;
      }
      std::optional<std::string> dy = g->second;
      grads.erase(g);
      const Sizes& z = sizes[k];
      const std::string& name = n.name;
      const std::vector<int>& ins = n.ins;
      const auto free_kept = [&] {
        for (const std::string& key : kept[k])
          live.free(key);
      };
      const std::string why = name + ": input gradient, backward";
      const auto part_grads = [&] {
        for (std::size_t m = 0; m < ins.size(); ++m)
          add_grad(ins[m], bytes(el(n.in[m]), d), why);
      };
      if (n.conv) {
        const bool first = std::all_of(ins.begin(), ins.end(), [](int s) { return s < 0; });
        if (fast_)
          live.alloc(name + ".scratch", scratch_bytes(k, z.out, z.window),
                     name + ": oneDNN's scratch and reorders, backward");
        if (first) {
          // no input gradient
        } else if (n.windowless) {
          if (n.parts) {
            std::vector<std::pair<int, std::string>> dx;
            for (std::size_t m = 0; m < ins.size(); ++m) {
              const std::string key = name + ".dx" + std::to_string(m);
              live.alloc(key, bytes(el(n.in[m]), d), why);
              dx.emplace_back(ins[m], key);
            }
            if (!fast_) {
              live.alloc(name + ".gather", bytes(z.in, d), name + ": the parts gathered, backward");
              live.free(name + ".gather");
            }
            free_kept();
            for (const auto& [src, key] : dx) {
              if (grads.count(src) != 0) {
                live.free(key);
              } else {
                add_grad(src, live.release(key), why);
              }
            }
          } else {
            live.alloc(name + ".dx", bytes(z.in, d), why);
            free_kept();
            add_grad(ins[0], live.release(name + ".dx"), why);
          }
        } else {
          live.alloc(name + ".dwindow", bytes(z.window_padded, d), name + ": window gradient");
          if (z.window_is_tile) {
            free_kept();
            const std::int64_t b = live.release(name + ".dwindow");
            if (n.parts)
              part_grads();
            else
              add_grad(ins[0], b, why);
          } else {
            if (n.parts)
              part_grads();
            else
              add_grad(ins[0], bytes(z.in, d), why);
            free_kept();
            live.free(name + ".dwindow");
          }
        }
        free_kept();
        live.free(name + ".scratch");
      } else if (n.map) {
        const bool copies = n.type == "conv_transpose2d" && fast_ && engine_.bf16;
        if (copies)
          live.alloc(name + ".scratch", bf16_copies(z.out, z.window),
                     name + ": bfloat16 copies, backward");
        live.alloc(name + ".dwindow", bytes(z.window, d), name + ": window gradient");
        if (z.window_is_tile) {
          const std::int64_t b = live.release(name + ".dwindow");
          free_kept();
          add_grad(ins[0], b, why);
        } else {
          add_grad(ins[0], bytes(z.in, d), why);
          free_kept();
          live.free(name + ".dwindow");
        }
        if (copies) live.free(name + ".scratch");
      } else if (n.by_consumer) {  // an activation whose consumer applied f
        grads[ins[0]] = *dy;       // moved through
        dy.reset();
      } else {
        // batch norm, activations, dropout, linear, pooling to a point, concat, add: a gradient
        // per input
        part_grads();
        free_kept();
      }
      if (dy) live.free(*dy);
    }
    result.step = live.peak();
  }
  return result;
}

std::int64_t MemoryWalk::scratch_bytes(std::size_t k, std::int64_t out, std::int64_t window) const {
  const Node& n = nodes_[k];
  std::int64_t b = n.scratch;
  if (n.narrow || n.pointwise) return b;
  // An output no consumer takes blocked: y and dy reordered, padded to 16 channels. Few channels
  // where the narrow kernels are off (TESSERA_NARROW_CONV=0, or a CPU without AVX-512): oneDNN may
  // compute y and dy padded to 16 channels (aBcd16b) and reorder them (ONEDNN_VERBOSE,
  // convstack-small; measured at 512x512 to 2048x2048, cli_plan_bounds_measured_peak).
  const std::int64_t c = n.conv->out_channels;
  const bool odd = n.few && !engine_.narrow_conv && (c % 16 != 0 || n.cin % 16 != 0);
  if (!n.blocked_ok || odd)
    b = saturating_add(b, pooled(saturating_mul(out / c * ((c + 15) / 16 * 16), dtype_bytes_)));
  // --precision bf16 (kernels/cpu/onednn_conv.cpp): a bfloat16 copy of the convolution's input
  // (the window forward, dy backward) and its result in another layout (CPUs with AMX: oneDNN 2's
  // AMX kernels read and write only NHWC, so y or dx is computed in NHWC, then reordered: float32,
  // the size of the output forward and of the window backward), and backward-weights' scratchpad
  // in strips of at most 64 MiB with a strip's dy. Not for a conv that computes in float32 under
  // bf16 (a 1x1 to fewer than 16 channels, one reading fewer than 16 channels a group), nor one
  // Tessera's AMX kernels take (stride 1, no groups, 16-channel blocks in and out: they convert
  // a few rows at a time).
  const Conv2dSpec& s = *n.conv;
  const std::int64_t in_group = n.cin / std::max<std::int64_t>(s.groups, 1);
  const bool float32 = (s.kernel[0] == 1 && s.kernel[1] == 1 && c < 16) || in_group < 16;
  const bool amx = engine_.amx && s.groups == 1 && s.stride[0] == 1 && s.stride[1] == 1 &&
                   n.cin % 16 == 0 && c % 16 == 0 && n.blocked_ok;
  if (engine_.bf16 && !float32 && !amx) b = saturating_add(b, bf16_copies(out, window));
  return b;
}

std::int64_t MemoryWalk::bf16_copies(std::int64_t out, std::int64_t window) const {
  const auto two = [](std::int64_t e) { return pooled(saturating_mul(2, e)); };
  const auto four = [](std::int64_t e) { return pooled(saturating_mul(4, e)); };
  const std::int64_t copies =
      std::max(saturating_add(two(window), four(out)), saturating_add(two(out), four(window)));
  return saturating_add(80 * kMiB, copies);
}

}  // namespace tessera
