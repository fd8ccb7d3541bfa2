#include "tessera/engine/model.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "tessera/collectives.hpp"
#include "tessera/engine/graph.hpp"
#include "tessera/error.hpp"
#include "tessera/partition.hpp"
#include "tessera/random.hpp"

namespace tessera {
namespace {

// A gradient bucket closes once it holds this much: small enough that the last layers'
// reduction starts while the first layers still run backward, large enough that a deep model
// does not pay one message latency per layer.
constexpr std::size_t kBucketBytes = 64 * 1024;

// Adds the wall time and communication of a scope to `t`; with `sync`, the backend's kernels
// enqueued before the scope and in it are waited for at its ends (Model::set_synchronized_timings).
class PassTimer {
 public:
  PassTimer(PassTiming& t, const Backend* sync)
      : t_(t), sync_(sync), start_(begin(sync)), before_(activity_totals()) {}
  ~PassTimer() {
    // A failed kernel is not lost: the stream's error returns from the next call that waits.
    try {
      if (sync_ != nullptr) sync_->synchronize();
    } catch (const std::exception&) {
    }
    t_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    t_.activities += activity_totals() - before_;
  }
  PassTimer(const PassTimer&) = delete;
  PassTimer& operator=(const PassTimer&) = delete;

 private:
  static std::chrono::steady_clock::time_point begin(const Backend* sync) {
    if (sync != nullptr) sync->synchronize();
    return std::chrono::steady_clock::now();
  }
  PassTiming& t_;
  const Backend* sync_;
  std::chrono::steady_clock::time_point start_;
  ActivityTimes before_;
};

}  // namespace

template <typename T>
Model<T>::Model(const ModelSpec& spec, const Runtime& runtime, Shape4 input)
    : spec_(spec),
      runtime_(runtime),
      loss_kernel_(runtime.backend().loss<T>()),
      merge_kernel_(runtime.backend().merge<T>()) {
  const Comm& grid = runtime.comm();
  TESSERA_CHECK(input.c == spec.input_channels,
                "model '" + spec.name + "' takes " + std::to_string(spec.input_channels) +
                    " input channels, the batch has " + std::to_string(input.c));
  TESSERA_CHECK(input.n >= grid.shape().n,
                "the batch has " + std::to_string(input.n) + " samples, fewer than the grid's " +
                    std::to_string(grid.shape().n) +
                    " data-parallel groups: every group needs at least one sample");
  check_splittable("the " + std::to_string(input.h) + "x" + std::to_string(input.w) + " image",
                   input.h, input.w, grid.shape().h, grid.shape().w);
  input_ = with_aligned_split(spec, {input, grid.shape(), grid.coords()});
  std::vector<LayerNode<T>> graph = set_up_layers<T>(spec, input_);
  for (std::size_t k = 0; k < graph.size(); ++k) {
    LayerNode<T>& n = graph[k];
    for (int i : n.inputs)
      if (i >= 0) ++nodes_[static_cast<std::size_t>(i)].consumers;
    timings_.push_back({.name = spec.layers[k].name,
                        .type = spec.layers[k].type,
                        .flops = n.layer->flops(),
                        .forward = {},
                        .backward = {}});
    nodes_.push_back({std::move(n.layer), std::move(n.inputs), n.out});
  }
  std::vector<std::vector<std::size_t>> consumers(nodes_.size());
  for (std::size_t k = 0; k < nodes_.size(); ++k)
    for (int i : nodes_[k].inputs)
      if (i >= 0) consumers[static_cast<std::size_t>(i)].push_back(k);
  // Which nodes' outputs come in NCHW whatever their consumers take (Layer::expect_nchw_input):
  // the batch, a layer that computes in NCHW, one that passes the layout of such an input on, a
  // concat of such. In order, so that each layer is told before it is asked computes_in_nchw.
  std::vector<bool> nchw_out(nodes_.size(), false);
  const auto comes_nchw = [&](int i) { return i < 0 || nchw_out[static_cast<std::size_t>(i)]; };
  for (std::size_t k = 0; k < nodes_.size(); ++k) {
    const std::vector<int>& in = nodes_[k].inputs;
    const bool all = !in.empty() && std::all_of(in.begin(), in.end(), comes_nchw);
    Layer<T>& layer = *nodes_[k].layer;
    layer.expect_nchw_input(all);
    nchw_out[k] = spec.layers[k].type == "concat"
                      ? all
                      : layer.computes_in_nchw(runtime.backend()) || (layer.passes_layout() && all);
  }
  // A concat of other layers' outputs whose only consumer computes from the inputs directly
  // (Layer::offer_concat; a halo layer plans an exchange per input at bind()). Offered first: the
  // inputs then go to that consumer, in the layouts it takes.
  std::vector<std::size_t> concats;
  for (std::size_t k = 0; k < nodes_.size() && runtime.fuse(); ++k) {
    const std::vector<int>& in = nodes_[k].inputs;
    if (spec.layers[k].type != "concat" || consumers[k].size() != 1 ||
        std::any_of(in.begin(), in.end(), [](int i) { return i < 0; }))
      continue;
    std::vector<Distribution> dists;
    for (int i : in)
      dists.push_back(nodes_[static_cast<std::size_t>(i)].out);
    if (nodes_[consumers[k][0]].layer->offer_concat(std::move(dists), runtime.backend()))
      concats.push_back(k);
  }
  // A taken concat's inputs are read by its consumer.
  const auto reader = [&](std::size_t c) {
    return std::find(concats.begin(), concats.end(), c) != concats.end() ? consumers[c][0] : c;
  };
  // A node may give its output in nchw16c when every consumer (for a taken concat, the concat's
  // reader) takes it, and every consumer that passes its input's layout on (an activation) may
  // give nchw16c too. The model's output is NCHW (the loss reads it). Decided before bind(),
  // where the kernels are planned for it.
  // A layer that computes in NCHW (narrow convs: Layer::computes_in_nchw) neither gives nchw16c
  // nor is given it.
  const Backend& backend = runtime.backend();
  std::vector<bool> blocked_ok(nodes_.size(), false);
  for (std::size_t k = nodes_.size() - 1; k-- > 0;) {
    bool ok = !consumers[k].empty() && !nodes_[k].layer->computes_in_nchw(backend);
    for (std::size_t c : consumers[k]) {
      const std::size_t r = reader(c);
      ok = ok && nodes_[r].layer->takes_blocked() && !nodes_[r].layer->computes_in_nchw(backend) &&
           (!nodes_[r].layer->passes_layout() || blocked_ok[r]);
    }
    blocked_ok[k] = ok;
  }
  // Whether a node's output may come blocked: allowed, and, for a layer that passes its input's
  // layout on, its input may (the hint of Layer::expect_blocked_input).
  std::vector<bool> blocked_may_come(nodes_.size(), false);
  for (std::size_t k = 0; k < nodes_.size(); ++k) {
    const std::vector<int>& in = nodes_[k].inputs;
    blocked_may_come[k] =
        blocked_ok[k] &&
        (!nodes_[k].layer->passes_layout() ||
         (in.size() == 1 && in[0] >= 0 && blocked_may_come[static_cast<std::size_t>(in[0])]));
  }
  // Activations their neighbours compute: the producer applies f as it writes its output when
  // the activation is its only consumer; the consumer applies f' to its input gradient when it is
  // the activation's only one (a halo layer, from the window it keeps), else the producer that
  // applies f where it can (batch norm; after bind). The activation then moves tensors through.
  // Offered before bind(), where kernels are planned for it.
  struct Fusion {
    std::size_t activation;
    std::optional<std::size_t> producer, consumer;
  };
  std::vector<Fusion> fusions;
  for (std::size_t k = 0; k < nodes_.size() && runtime.fuse(); ++k) {
    const std::optional<FusedActivation> f = nodes_[k].layer->fusable_activation(runtime.backend());
    if (!f || nodes_[k].inputs.size() != 1) continue;
    Fusion u{.activation = k, .producer = {}, .consumer = {}};
    if (const int i = nodes_[k].inputs[0];
        i >= 0 && consumers[static_cast<std::size_t>(i)].size() == 1) {
      u.producer = static_cast<std::size_t>(i);
      nodes_[*u.producer].layer->offer_output_activation(*f);
    }
    if (consumers[k].size() == 1) {
      u.consumer = consumers[k][0];
      nodes_[*u.consumer].layer->offer_input_activation_grad(*f);
    }
    fusions.push_back(u);
  }
  // Inputs whose values come in 2x2 blocks (Layer::output_doubled): per input of each node, or
  // of the concat it took.
  for (std::size_t k = 0; k < nodes_.size(); ++k) {
    std::vector<int> in = nodes_[k].inputs;
    if (in.size() == 1 && in[0] >= 0 && reader(static_cast<std::size_t>(in[0])) == k)
      in = nodes_[static_cast<std::size_t>(in[0])].inputs;  // a concat this node took
    std::vector<bool> doubled;
    for (int i : in)
      doubled.push_back(i >= 0 && nodes_[static_cast<std::size_t>(i)].layer->output_doubled());
    nodes_[k].layer->offer_doubled_inputs(std::move(doubled));
  }
  Allocator& memory = runtime.allocator();
  for (std::size_t k = 0; k < nodes_.size(); ++k) {
    nodes_[k].layer->allow_blocked_output(blocked_ok[k]);
    const std::vector<int>& in = nodes_[k].inputs;
    nodes_[k].layer->expect_blocked_input(in.size() == 1 && in[0] >= 0 &&
                                          blocked_may_come[static_cast<std::size_t>(in[0])]);
    nodes_[k].layer->hand_over_input(in.size() == 1 && in[0] >= 0 &&
                                     consumers[static_cast<std::size_t>(in[0])].size() == 1);
    batch_readers_ += static_cast<int>(std::count(in.begin(), in.end(), -1));
    nodes_[k].layer->use_allocator(memory);
    // Parameters and their gradients live where the kernels compute (layers make them in host
    // memory at setup); buffers (batch norm's running statistics) stay on the host, which alone
    // reads them.
    for (Param<T>* p : nodes_[k].layer->params())
      if (&p->value.allocator() != &memory) {
        p->value = copy_to(p->value, memory);
        p->grad = copy_to(p->grad, memory);
      }
    nodes_[k].layer->bind(runtime);
  }
  for (const Fusion& u : fusions) {
    const bool by_producer = u.producer && nodes_[*u.producer].layer->output_activation_fused();
    const bool by_consumer = u.consumer && nodes_[*u.consumer].layer->input_activation_grad_fused();
    // f' where no consumer applies it: by the producer that applies f, where it can.
    const bool grad_by_producer =
        by_producer && !by_consumer && nodes_[*u.producer].layer->take_output_activation_grad();
    nodes_[u.activation].layer->set_fused(by_producer, by_consumer || grad_by_producer);
    if (by_producer || by_consumer)
      fused_.push_back({.activation = nodes_[u.activation].layer->name(),
                        .producer = by_producer ? nodes_[*u.producer].layer->name() : "",
                        .consumer = by_consumer        ? nodes_[*u.consumer].layer->name()
                                    : grad_by_producer ? nodes_[*u.producer].layer->name()
                                                       : ""});
  }
  // A concat taken: its consumer is given the concat's inputs instead (the same number of
  // consumers each), and the concat is never run.
  for (std::size_t c : concats) {
    Node& consumer = nodes_[consumers[c][0]];
    consumer.inputs = nodes_[c].inputs;
    consumer.layer->hand_over_input(false);
    // An input that no node reads after the concat's consumer (nodes run in order; a taken
    // concat's inputs are read by its consumer), given once.
    std::vector<bool> handed;
    for (int i : consumer.inputs) {
      std::size_t last = 0;
      for (std::size_t k : consumers[static_cast<std::size_t>(i)])
        last = std::max(last, reader(k));
      handed.push_back(last == consumers[c][0] &&
                       std::count(consumer.inputs.begin(), consumer.inputs.end(), i) == 1);
    }
    consumer.layer->hand_over_concat_inputs(std::move(handed));
    nodes_[c].taken = true;
    nodes_[c].consumers = 0;
    concats_taken_.push_back(
        {.concat = nodes_[c].layer->name(), .consumer = consumer.layer->name()});
  }
  build_buckets();
}

template <typename T>
Model<T>::~Model() {
  // Uploads of reduced gradients that reduce_gradients queued may still read the staging buffers.
  if (uploads_queued_in_ != nullptr) uploads_queued_in_->wait_ordered_quietly();
  for (Bucket& b : buckets_)
    if (b.request.pending()) new Tensor<T>(std::move(b.flat));  // deliberately leaked
}

template <typename T>
DistTensor<T> Model<T>::forward(const DistTensor<T>& input) {
  return run_forward(&input, std::nullopt);
}

template <typename T>
DistTensor<T> Model<T>::forward(DistTensor<T>&& input) {
  return run_forward(nullptr, std::optional<DistTensor<T>>(std::move(input)));
}

template <typename T>
DistTensor<T> Model<T>::run_forward(const DistTensor<T>* borrowed,
                                    std::optional<DistTensor<T>> owned) {
  // The batch comes from the host: on a device backend it is copied there first (the model
  // then holds the copy).
  const DistTensor<T>& given = owned ? *owned : *borrowed;
  if (&given.local.allocator() != &runtime_.allocator()) {
    DistTensor<T> copy;
    copy.dist = given.dist;
    copy.local = copy_to(given.local, runtime_.allocator());
    owned = std::move(copy);
  }
  const DistTensor<T>& x = owned ? *owned : *borrowed;
  // Outputs are kept until their last consumer has run.
  std::vector<std::optional<DistTensor<T>>> outputs(nodes_.size());
  std::vector<int> pending(nodes_.size());
  for (std::size_t k = 0; k < nodes_.size(); ++k)
    pending[k] = nodes_[k].consumers;
  for (std::size_t k = 0; k < nodes_.size(); ++k) {
    if (nodes_[k].taken) continue;  // its consumer reads its inputs
    const bool reads_batch = nodes_[k].inputs.size() == 1 && nodes_[k].inputs.front() < 0;
    // The batch's one reader may keep it where the model holds it.
    if (reads_batch) nodes_[k].layer->hand_over_input(owned.has_value() && batch_readers_ == 1);
    std::vector<const DistTensor<T>*> ins;
    for (int i : nodes_[k].inputs) {
      ins.push_back(i >= 0 ? &*outputs[i] : &x);
      // The construction above gives nchw16c only to layers that take it.
      TESSERA_CHECK(ins.back()->layout() == Layout::nchw || nodes_[k].layer->takes_blocked(),
                    "layer '" + nodes_[k].layer->name() + "' was handed an nchw16c input");
    }
    {
      PassTimer timer(timings_[k].forward, timing_sync());
      try {
        Layer<T>& layer = *nodes_[k].layer;
        if (layer.forward_identity()) {
          // Fused only when it is its producer's one consumer (the constructor): moved through.
          const int i = nodes_[k].inputs.front();
          TESSERA_CHECK(
              i >= 0 && pending[i] == 1,
              "layer '" + layer.name() + "': fused, but not its producer's last consumer");
          layer.keep_forward(*ins[0], state_);
          outputs[k] = std::move(outputs[i]);
        } else {
          outputs[k] = layer.forward(ins, state_);
          if (layer.input_handed_over()) {  // its only consumer: kept by the layer, or freed
            const int i = nodes_[k].inputs.front();
            std::optional<DistTensor<T>>& in = i >= 0 ? outputs[i] : owned;
            layer.take_input(std::move(*in));
            in.reset();
          }
          for (std::size_t j = 0; j < ins.size(); ++j)
            if (layer.concat_input_handed_over(j)) {  // its last consumer
              const int i = nodes_[k].inputs[j];
              layer.take_concat_input(j, std::move(*outputs[i]));
              outputs[i].reset();
            }
        }
      } catch (const OutOfDeviceMemory& e) {
        throw OutOfDeviceMemory("layer '" + nodes_[k].layer->name() + "' (forward): " + e.what());
      }
    }
    for (int i : nodes_[k].inputs)
      if (i >= 0 && --pending[i] == 0 && static_cast<std::size_t>(i) + 1 != nodes_.size())
        outputs[i].reset();
  }
  return std::move(*outputs.back());
}

template <typename T>
DistTensor<T> Model<T>::backward(const DistTensor<T>& dy) {
  std::vector<std::optional<DistTensor<T>>> grads(nodes_.size());
  std::optional<DistTensor<T>> input_grad;
  auto add = [this](std::optional<DistTensor<T>>& to, DistTensor<T>&& g) {
    if (to) {
      merge_kernel_->add(g.local, to->local);
    } else {
      to = std::move(g);
    }
  };
  grads.back() = dy;
  std::size_t next_bucket = 0;
  for (std::size_t k = nodes_.size(); k-- > 0;) {
    // A node whose output reaches no loss has no gradient: its parameters get none either.
    if (grads[k]) {
      PassTimer timer(timings_[k].backward, timing_sync());
      std::vector<DistTensor<T>> g;
      try {
        // An input whose gradient another consumer gave already: added into as computed, where
        // the layer can (Layer::backward_adding), instead of returned and added here.
        const std::vector<int>& inputs = nodes_[k].inputs;
        const bool adding =
            inputs.size() == 1 && inputs.front() >= 0 && grads[inputs.front()] &&
            !nodes_[k].layer->backward_identity() &&
            nodes_[k].layer->backward_adding(*grads[k], state_, *grads[inputs.front()]);
        if (adding) {
          // g stays empty: nothing to add below
        } else if (nodes_[k].layer->backward_identity())
          g.push_back(std::move(*grads[k]));
        else
          g = nodes_[k].layer->backward(*grads[k], state_);
      } catch (const OutOfDeviceMemory& e) {
        throw OutOfDeviceMemory("layer '" + nodes_[k].layer->name() + "' (backward): " + e.what());
      }
      grads[k].reset();
      for (std::size_t j = 0; j < g.size(); ++j) {
        const int i = nodes_[k].inputs[j];
        if (i < 0 && !input_grad_) continue;  // not asked for (the layer may have skipped it)
        add(i >= 0 ? grads[i] : input_grad, std::move(g[j]));
      }
    }
    // Every rank walks the same graph, so the buckets start in the same order everywhere.
    for (; next_bucket < buckets_.size() && buckets_[next_bucket].first == k; ++next_bucket)
      start_bucket(next_bucket);
    poll_buckets();
  }
  if (!input_grad_) return {};
  if (!input_grad) return DistTensor<T>(input_);  // nothing depends on the input
  return std::move(*input_grad);
}

template <typename T>
void Model<T>::set_input_grad(bool needed) {
  input_grad_ = needed;
  for (std::size_t k = 0; k < nodes_.size(); ++k) {
    const std::vector<int>& ins = nodes_[k].inputs;
    if (std::all_of(ins.begin(), ins.end(), [](int i) { return i < 0; })) {
      nodes_[k].layer->set_input_grad(needed);
      timings_[k].flops = nodes_[k].layer->flops();
    }
  }
}

template <typename T>
void Model<T>::zero_grad() {
  for (auto& p : params())
    p.param->grad.zero();
}

template <typename T>
void Model<T>::build_buckets() {
  // One rank: the sum over the world is each gradient itself, so nothing is packed, copied or
  // reduced (on a GPU with the MPI transport each bucket was copied out, waited for and copied
  // back in every step).
  if (runtime_.comm().size(Group::world) == 1) return;
  Bucket b;
  b.last = nodes_.size();
  std::size_t count = 0;
  for (std::size_t k = nodes_.size(); k-- > 0;) {
    for (Param<T>* p : nodes_[k].layer->params())
      count += p->grad.size();
    if (count * sizeof(T) >= kBucketBytes || k == 0) {
      b.first = k;
      if (buckets_on_device())
        b.device_flat = Tensor<T>(Shape4{1, 1, 1, std::int64_t(count)}, Layout::nchw, uninitialized,
                                  runtime_.allocator());
      else  // host memory; staging memory (page-locked for a GPU) when the gradients lie on one
        b.flat = Tensor<T>(Shape4{1, 1, 1, std::int64_t(count)}, Layout::nchw, uninitialized,
                           runtime_.allocator().staging());
      b.what = "allreduce of gradient bucket " + std::to_string(buckets_.size()) + " (layers '" +
               nodes_[b.first].layer->name() + "' to '" + nodes_[b.last - 1].layer->name() + "')";
      if (count > 0) buckets_.push_back(std::move(b));
      b = Bucket{};
      b.last = k;
      count = 0;
    }
  }
}

template <typename T>
void Model<T>::start_bucket(std::size_t index) {
  Bucket& b = buckets_[index];
  // A reduction still in flight (a backward pass repeated without reduce_gradients) completes
  // before its buffer is packed again.
  runtime_.comm().wait(b.request);
  if (buckets_on_device()) {  // device-to-device copies; the Comm (NCCL) reduces device memory
    Allocator& memory = runtime_.allocator();
    const std::span<T> flat = b.device_flat.span_in(memory.space());
    T* at = flat.data();
    for (std::size_t k = b.first; k < b.last; ++k)
      for (Param<T>* p : nodes_[k].layer->params()) {
        memory.copy(at, std::as_const(p->grad).data_in(memory.space()), p->grad.size() * sizeof(T));
        at += p->grad.size();
      }
    b.request = runtime_.comm().start_allreduce(flat, ReduceOp::sum, Group::world, b.what);
    b.started = true;
    return;
  }
  // The MPI transport reduces host memory: device gradients are copied out (host staging),
  // queued together and waited for once. The wait also covers the uploads of the last reduction
  // from this buffer (queued before), so the reduction may write it.
  T* at = b.flat.data();
  for (std::size_t k = b.first; k < b.last; ++k)
    for (Param<T>* p : nodes_[k].layer->params()) {
      download_ordered(p->grad, at);
      at += p->grad.size();
    }
  runtime_.allocator().wait_ordered();
  b.request = runtime_.comm().start_allreduce(b.flat.span(), ReduceOp::sum, Group::world, b.what);
  b.started = true;
}

template <typename T>
void Model<T>::poll_buckets() {
  // MPICH moves a nonblocking collective on only inside MPI calls: a test between layers lets
  // the reductions proceed while the next layer computes.
  for (Bucket& b : buckets_)
    runtime_.comm().test(b.request);
}

template <typename T>
void Model<T>::reduce_gradients() {
  PassTimer timer(reduce_timing_, timing_sync());
  // Buckets backward() did not start (no backward since the last reduction) start now, so this
  // always sums every gradient.
  for (std::size_t k = 0; k < buckets_.size(); ++k)
    if (!buckets_[k].started) start_bucket(k);
  {
    Timed timed(Activity::allreduce);
    for (Bucket& b : buckets_)
      runtime_.comm().wait(b.request);
  }
  Allocator& memory = runtime_.allocator();
  for (Bucket& b : buckets_) {
    b.started = false;
    if (buckets_on_device()) {
      const T* at = std::as_const(b.device_flat).data_in(memory.space());
      for (std::size_t k = b.first; k < b.last; ++k)
        for (Param<T>* p : nodes_[k].layer->params()) {
          memory.copy(p->grad.data_in(memory.space()), at, p->grad.size() * sizeof(T));
          at += p->grad.size();
        }
      continue;
    }
    // Queued: the optimizer's kernels follow them on the device; start_bucket waits for them
    // before the buffer is written again.
    uploads_queued_in_ = &memory;  // before the copies: an exception after one still waits
    const T* at = b.flat.data();
    for (std::size_t k = b.first; k < b.last; ++k)
      for (Param<T>* p : nodes_[k].layer->params()) {
        upload_ordered(at, p->grad);
        at += p->grad.size();
      }
  }
}

template <typename T>
bool Model<T>::buckets_on_device() const {
  const MemorySpace space = runtime_.allocator().space();
  return space != MemorySpace::host && runtime_.comm().reaches(space);
}

template <typename T>
void Model<T>::reset_timings() {
  for (LayerTiming& t : timings_)
    t.forward = t.backward = {};
  reduce_timing_ = {};
}

template <typename T>
std::vector<std::pair<std::string, std::string>> Model<T>::kernel_summaries() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Node& node : nodes_)
    if (std::string s = node.layer->kernel_summary(); !s.empty())
      out.emplace_back(node.layer->name(), std::move(s));
  return out;
}

template <typename T>
std::vector<NamedParam<T>> Model<T>::params() {
  std::vector<NamedParam<T>> out;
  for (auto& n : nodes_)
    for (Param<T>* p : n.layer->params())
      out.push_back({n.layer->name(), p});
  return out;
}

template <typename T>
std::vector<NamedBuffer<T>> Model<T>::buffers() {
  std::vector<NamedBuffer<T>> out;
  for (auto& n : nodes_)
    for (Buffer<T>* b : n.layer->buffers())
      out.push_back({n.layer->name(), b});
  return out;
}

template <typename T>
std::vector<NamedBuffer<T>> Model<T>::masks() {
  std::vector<NamedBuffer<T>> out;
  for (auto& n : nodes_)
    for (Buffer<T>* b : n.layer->masks())
      out.push_back({n.layer->name(), b});
  return out;
}

template <typename T>
std::int64_t Model<T>::parameter_count() {
  std::int64_t n = 0;
  for (auto& p : params())
    n += p.param->value.numel();
  return n;
}

template <typename T>
void Model<T>::check_trainable() const {
  for (const Node& node : nodes_)
    node.layer->check_trainable();
}

template <typename T>
void Model<T>::init_params(std::uint64_t seed) {
  for (std::size_t k = 0; k < nodes_.size(); ++k) {
    auto ps = nodes_[k].layer->params();
    if (ps.empty()) continue;
    // Computed on the host, then copied to where the parameters live.
    if (spec_.layers[k].type == "batchnorm2d") {
      std::vector<T> ones(ps[0]->value.size(), T(1));
      upload(ones.data(), ps[0]->value);
      if (ps.size() > 1) ps[1]->value.zero();
      continue;
    }
    // fan_in as PyTorch's _calculate_fan_in_and_fan_out: dim 1 times the kernel area. For
    // transposed convolutions (weight [in, out/groups, kh, kw]) that is out/groups * area, as in
    // PyTorch.
    const Shape4& ws = ps.front()->value.shape();
    const double bound = 1.0 / std::sqrt(static_cast<double>(ws.c * ws.h * ws.w));
    for (Param<T>* p : ps) {
      const std::uint64_t stream = hash_string(nodes_[k].layer->name() + "/" + p->name);
      std::vector<T> v(p->value.size());
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = static_cast<T>((2 * uniform01(seed, stream, i) - 1) * bound);
      upload(v.data(), p->value);
    }
  }
}

template <typename T>
LossResult<T> compute_loss(LossKind kind, const DistTensor<T>& logits,
                           std::span<const std::int32_t> labels, const Comm& comm,
                           const LossKernel<T>& kernel) {
  const Shape4& g = logits.dist.global;
  LossResult<T> r;
  // The kernel writes every element of the gradient: no zeros first.
  r.grad = DistTensor<T>(logits.dist, Layout::nchw, uninitialized, logits.local.allocator());
  // Replicated logits (one vector per sample) are whole on every spatial rank: all compute the
  // gradient, only the first rank of each sample group counts the loss.
  const bool counts = !logits.dist.replicated || (comm.coords().i == 0 && comm.coords().j == 0);
  const double count = static_cast<double>(g.n) * (kind == LossKind::cross_entropy ? 1 : g.h * g.w);
  double local =
      kernel.cross_entropy(logits.local, labels, static_cast<T>(1.0 / count), &r.grad.local);
  if (!counts) local = 0;
  allreduce_sum(comm, std::span<double>(&local, 1), Group::world, "allreduce of the loss");
  r.loss = local / count;
  return r;
}

namespace {
template <typename T, typename Input>
StepResult<T> step_of(Model<T>& model, Input&& input, std::span<const std::int32_t> labels) {
  StepResult<T> r;
  // The labels may travel while the forward pass runs (LossKernel::prepare); they are not read
  // after this function returns, nor after it throws.
  const LossKernel<T>& loss_kernel = model.loss_kernel();
  struct Settle {
    const LossKernel<T>& kernel;
    ~Settle() { kernel.settle(); }
  } settle{loss_kernel};
  loss_kernel.prepare(labels);
  model.zero_grad();
  r.output = model.forward(std::forward<Input>(input));
  LossResult<T> loss = compute_loss(model.spec().loss, r.output, labels, model.runtime().comm(),
                                    model.loss_kernel());
  r.loss = loss.loss;
  r.input_grad = model.backward(loss.grad);
  model.reduce_gradients();
  return r;
}
}  // namespace

template <typename T>
StepResult<T> forward_backward(Model<T>& model, const DistTensor<T>& input,
                               std::span<const std::int32_t> labels) {
  return step_of(model, input, labels);
}

template <typename T>
StepResult<T> forward_backward(Model<T>& model, DistTensor<T>&& input,
                               std::span<const std::int32_t> labels) {
  return step_of(model, std::move(input), labels);
}

template class Model<float>;
template class Model<double>;
template LossResult<float> compute_loss(LossKind, const DistTensor<float>&,
                                        std::span<const std::int32_t>, const Comm&,
                                        const LossKernel<float>&);
template LossResult<double> compute_loss(LossKind, const DistTensor<double>&,
                                         std::span<const std::int32_t>, const Comm&,
                                         const LossKernel<double>&);
template StepResult<float> forward_backward(Model<float>&, const DistTensor<float>&,
                                            std::span<const std::int32_t>);
template StepResult<double> forward_backward(Model<double>&, const DistTensor<double>&,
                                             std::span<const std::int32_t>);
template StepResult<float> forward_backward(Model<float>&, DistTensor<float>&&,
                                            std::span<const std::int32_t>);
template StepResult<double> forward_backward(Model<double>&, DistTensor<double>&&,
                                             std::span<const std::int32_t>);

}  // namespace tessera
