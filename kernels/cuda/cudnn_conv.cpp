// Convolutions with cuDNN's convolution API (cudnnConvolutionForward, BackwardData,
// BackwardFilter, BackwardBias) behind ConvKernel (include/tessera/kernels/conv_kernel.hpp).
//
// cuDNN pads symmetrically. Tessera's windows carry their own padding (Conv2d plans pad 0), but the
// adjoint convolutions of ConvTranspose2d have any top/left padding, negative included, and an
// implied bottom/right one: those run on a padded copy of x (zeros around, or x cropped), made on
// the device before each pass that reads x, and the gradient is cut back out of the padded one.
// Box kernels address their boxes in place with strided descriptors (no copy).
#include <cudnn.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>

#include "cuda_backend.hpp"
#include "cuda_check.hpp"
#include "cuda_context.hpp"
#include "cuda_kernels.hpp"

namespace tessera::cuda {
namespace {

template <typename T>
constexpr cudnnDataType_t data_type() {
  return std::is_same_v<T, float> ? CUDNN_DATA_FLOAT : CUDNN_DATA_DOUBLE;
}

int to_int(std::int64_t v) {
  TESSERA_CHECK(v >= 0 && v <= INT32_MAX,
                "cuDNN: extent " + std::to_string(v) + " does not fit cuDNN's int dimensions");
  return static_cast<int>(v);
}

// An owning handle of a cuDNN descriptor.
template <typename Handle, cudnnStatus_t (*create)(Handle*), cudnnStatus_t (*destroy)(Handle)>
struct Descriptor {
  Handle d = nullptr;
  Descriptor() { TESSERA_CHECK_CUDNN(create(&d)); }
  ~Descriptor() { destroy(d); }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
};
using TensorDesc =
    Descriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor>;
using FilterDesc =
    Descriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor>;
using ConvDesc = Descriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
                            cudnnDestroyConvolutionDescriptor>;

// `desc` as a tensor of `s` inside one of shape `outer` (NCHW strides of outer).
template <typename T>
void set_tensor(TensorDesc& desc, const Shape4& s, const Shape4& outer) {
  TESSERA_CHECK_CUDNN(cudnnSetTensor4dDescriptorEx(
      desc.d, data_type<T>(), to_int(s.n), to_int(s.c), to_int(s.h), to_int(s.w),
      to_int(outer.c * outer.h * outer.w), to_int(outer.h * outer.w), to_int(outer.w), 1));
}

// One spatial axis: x extent `in`, y extent `out`. cuDNN's symmetric `pad` when it yields exactly
// `out` outputs reading the same rows; otherwise x is copied into `padded` rows, x's row r at
// padded row r + begin.
struct AxisPad {
  std::int64_t pad = 0;
  bool copy = false;
  std::int64_t padded = 0, begin = 0;
};
AxisPad axis_pad(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride,
                 std::int64_t dilation, std::int64_t pad_begin) {
  const std::int64_t need = (out - 1) * stride + dilation * (kernel - 1) + 1;
  const std::int64_t pad_end = need - in - pad_begin;
  // cuDNN's output extent floor((in + 2 pad - dilation (kernel - 1) - 1) / stride) + 1 is `out`
  // when the rows past the last one read are fewer than a stride.
  if (pad_begin >= 0 && pad_end <= pad_begin && pad_begin - pad_end < stride)
    return {.pad = pad_begin};
  return {.copy = true, .padded = need, .begin = pad_begin};
}

// The largest workspace one pass may take: a quarter of the free device memory, at most 2 GiB
// (the activations need the rest).
std::size_t workspace_limit() {
  std::size_t free = 0, total = 0;
  TESSERA_CHECK_CUDA(cudaMemGetInfo(&free, &total));
  // Memory the stream-ordered pool keeps but nothing uses is free to us, not to cudaMemGetInfo.
  int device = 0;
  cudaMemPool_t pool = nullptr;
  std::uint64_t reserved = 0, used = 0;
  TESSERA_CHECK_CUDA(cudaGetDevice(&device));
  TESSERA_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device));
  TESSERA_CHECK_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
  TESSERA_CHECK_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
  free += static_cast<std::size_t>(reserved > used ? reserved - used : 0);
  // And the blocks the allocator keeps for reuse (the pool counts them used): the limit does not
  // depend on what the process freed before.
  free += kept_device_bytes();
  return std::min<std::size_t>(free / 4, std::size_t{2} << 30);
}

// The first of cuDNN's ranked candidates that ran, fits `limit`, is deterministic if asked and
// uses no TF32 unless allowed; -1 when none.
template <typename Perf>
int pick(const Perf* perf, int count, std::size_t limit, bool deterministic, bool fma_only,
         std::size_t* bytes, cudnnMathType_t* math) {
  for (int i = 0; i < count; ++i) {
    const Perf& p = perf[i];
    if (p.status != CUDNN_STATUS_SUCCESS || p.memory > limit) continue;
    if (deterministic && p.determinism != CUDNN_DETERMINISTIC) continue;
    // The descriptor's FMA math already restricts the kernels; a candidate ranked for tensor
    // cores would not run as ranked.
    if (fma_only &&
        (p.mathType == CUDNN_TENSOR_OP_MATH || p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION))
      continue;
    *bytes = p.memory;
    *math = p.mathType;
    return static_cast<int>(p.algo);
  }
  return -1;
}

// One pass's algorithm, its workspace and the math type it was ranked with; algo -1: none.
struct Chosen {
  int algo = -1;
  std::size_t bytes = 0;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
};

// The choice for `key`, from the process's cache or from `rank(max, &count, perf)` (cuDNN's
// ranked candidates: measured, options.measure_algorithms, or by heuristics) through pick(). A
// choice that no longer fits `limit` is made again. Local.
template <typename Rank, typename Perf>
Chosen choose(const std::string& key, std::size_t limit, Rank rank, const CudaOptions& options,
              bool fma_only, Perf*) {
  static std::map<std::string, Chosen> cache;
  const auto hit = cache.find(key);
  if (hit != cache.end() && hit->second.bytes <= limit) return hit->second;
  constexpr int kMax = 16;
  Perf perf[kMax];
  int count = 0;
  TESSERA_CHECK_CUDNN(rank(kMax, &count, perf));
  Chosen c;
  c.algo = pick(perf, count, limit, options.deterministic, fma_only, &c.bytes, &c.math);
  if (c.algo >= 0) cache[key] = c;
  if (options.log_algorithms) {  // every candidate, as cuDNN ranked them
    std::ostringstream line;
    line << "cuDNN " << key << ": algorithm " << c.algo << " of";
    for (int i = 0; i < count; ++i)
      if (perf[i].status == CUDNN_STATUS_SUCCESS)
        line << " " << static_cast<int>(perf[i].algo) << " (" << perf[i].time << " ms, "
             << (perf[i].memory >> 20) << " MiB, math " << static_cast<int>(perf[i].mathType)
             << (perf[i].determinism == CUDNN_DETERMINISTIC ? ", deterministic" : "") << ")";
    std::cerr << line.str() + "\n";
  }
  return c;
}

template <typename T>
class CudnnConv final : public ConvKernel<T> {
 public:
  // Null with `why` set when cuDNN cannot take the case.
  static std::unique_ptr<CudnnConv> create(const ConvShapes& shapes,
                                           const reference::ConvGeometry& g,
                                           const CudaOptions& options, std::string& why);

  void forward(const Tensor<T>& x, const Tensor<T>& w, std::span<const T> bias,
               Tensor<T>& y) override {
    check(x, shapes_.x, "x");
    check(w, shapes_.w, "w");
    check(y, shapes_.y, "y");
    run_forward(input(x), w, bias, y.data_in(MemorySpace::device));
  }

  void backward_data(const Tensor<T>& dy, const Tensor<T>& w, Tensor<T>& dx) override {
    check(dy, shapes_.y, "dy");
    check(w, shapes_.w, "w");
    check(dx, shapes_.x, "dx");
    Context& ctx = Context::get();
    const T one = 1, zero = 0;
    T* out = copy_ ? static_cast<T*>(padded_.data()) : dx.data_in(MemorySpace::device);
    TESSERA_CHECK_CUDNN(cudnnSetConvolutionMathType(conv_.d, data_math_));
    TESSERA_CHECK_CUDNN(
        cudnnConvolutionBackwardData(ctx.cudnn(), &one, w_.d, w.data_in(MemorySpace::device), y_.d,
                                     dy.data_in(MemorySpace::device), conv_.d, data_algo_,
                                     ctx.workspace(data_bytes_), data_bytes_, &zero, xp_.d, out));
    if (copy_) cut_out(dx);
  }

  void backward_filter(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>& dw,
                       std::span<T> dbias) override {
    check(x, shapes_.x, "x");
    check(dy, shapes_.y, "dy");
    check(dw, shapes_.w, "dw");
    Context& ctx = Context::get();
    const T one = 1;
    const T* in = input(x);
    if (pointwise_) {
      const Shape4 &xs = shapes_.x, &ys = shapes_.y;
      double* sums = sums_.get<double>(
          static_cast<std::size_t>(plane_sums_size(ys.c * xs.c, xs.n * xs.h * xs.w, 1)));
      pointwise_filter_grad(in, dy.data_in(MemorySpace::device), dw.data_in(MemorySpace::device),
                            xs.n, xs.c, ys.c, xs.h * xs.w, sums, ctx.stream());
    } else {
      TESSERA_CHECK_CUDNN(cudnnSetConvolutionMathType(conv_.d, filter_math_));
      TESSERA_CHECK_CUDNN(cudnnConvolutionBackwardFilter(
          ctx.cudnn(), &one, xp_.d, in, y_.d, dy.data_in(MemorySpace::device), conv_.d,
          filter_algo_, ctx.workspace(filter_bytes_), filter_bytes_, &one, w_.d,
          dw.data_in(MemorySpace::device)));
    }
    if (!dbias.empty()) {
      TESSERA_CHECK(static_cast<std::int64_t>(dbias.size()) == shapes_.y.c,
                    "conv: bias gradient of " + std::to_string(dbias.size()) + " for " +
                        std::to_string(shapes_.y.c) + " channels");
      // Tessera's chunked sums (kernels/cuda/layers.cu), not cudnnConvolutionBackwardBias: on
      // an H100 that took ~4 ms for 32 channels of 2048x2048, a pass over 512 MiB.
      const Shape4& ys = shapes_.y;
      double* sums =
          sums_.get<double>(static_cast<std::size_t>(plane_sums_size(ys.n * ys.c, ys.h * ys.w, 1)));
      add_bias_grad(dy.data_in(MemorySpace::device), dbias.data(), ys.n, ys.c, ys.h * ys.w, sums,
                    ctx.stream());
    }
  }

  void forward_box(const Tensor<T>& x, BoxAt x_at, const Tensor<T>& w, std::span<const T> bias,
                   Tensor<T>& y, BoxAt y_at) override {
    check(x, shapes_.x_outer, "x");
    check(w, shapes_.w, "w");
    check(y, shapes_.y_outer, "y");
    const Shape4 &xo = shapes_.x_outer, &yo = shapes_.y_outer;
    const T* in = x.data_in(MemorySpace::device) + x_at.h * xo.w + x_at.w;
    T* out = y.data_in(MemorySpace::device) + y_at.h * yo.w + y_at.w;
    run_forward(in, w, bias, out);
  }

  std::string name() const override { return name_; }

 private:
  explicit CudnnConv(const ConvShapes& shapes) : shapes_(shapes) {}

  void check(const Tensor<T>& t, const Shape4& planned, const char* what) const {
    TESSERA_CHECK(
        t.shape() == planned && t.layout() == Layout::nchw && t.space() == MemorySpace::device,
        std::string("cuDNN conv: ") + what + " " + t.shape().str() + " in " + to_string(t.space()) +
            " memory; planned " + planned.str() + " NCHW on the device");
  }

  void run_forward(const T* in, const Tensor<T>& w, std::span<const T> bias, T* out) {
    Context& ctx = Context::get();
    const T one = 1, zero = 0;
    TESSERA_CHECK_CUDNN(cudnnSetConvolutionMathType(conv_.d, fwd_math_));
    TESSERA_CHECK_CUDNN(cudnnConvolutionForward(
        ctx.cudnn(), &one, xp_.d, in, w_.d, w.data_in(MemorySpace::device), conv_.d, fwd_algo_,
        ctx.workspace(fwd_bytes_), fwd_bytes_, &zero, y_.d, out));
    if (!bias.empty()) {
      TESSERA_CHECK(static_cast<std::int64_t>(bias.size()) == shapes_.y.c,
                    "conv: bias of " + std::to_string(bias.size()) + " for " +
                        std::to_string(shapes_.y.c) + " channels");
      TESSERA_CHECK_CUDNN(cudnnAddTensor(ctx.cudnn(), &one, bias_.d, bias.data(), &one, y_.d, out));
    }
  }

  // The padded copy's box of x rows and columns (the rest of it is zero), as planes x rows x
  // columns from x to the copy, and where it starts in each. Planned once.
  struct Inside {
    Box3 to_padded, from_padded;
    std::int64_t offset_x = 0, offset_padded = 0;
  };
  static Inside inside(const Shape4& x, const AxisPad& ph, const AxisPad& pw) {
    const std::int64_t r0 = std::max<std::int64_t>(0, -ph.begin),
                       r1 = std::min(x.h, ph.padded - ph.begin);
    const std::int64_t c0 = std::max<std::int64_t>(0, -pw.begin),
                       c1 = std::min(x.w, pw.padded - pw.begin);
    const std::int64_t rows = std::max<std::int64_t>(0, r1 - r0),
                       cols = std::max<std::int64_t>(0, c1 - c0);
    const Strides3 xs = plane_strides(x.h, x.w), ps = plane_strides(ph.padded, pw.padded);
    return {.to_padded = make_box3(x.n * x.c, rows, cols, xs, ps),
            .from_padded = make_box3(x.n * x.c, rows, cols, ps, xs),
            .offset_x = r0 * x.w + c0,
            .offset_padded = (r0 + ph.begin) * pw.padded + (c0 + pw.begin)};
  }

  // x as the convolution reads it: x itself, or its padded copy made now.
  const T* input(const Tensor<T>& x) {
    const T* in = x.data_in(MemorySpace::device);
    if (!copy_) return in;
    const cudaStream_t stream = Context::get().stream();
    T* p = static_cast<T*>(padded_.data());
    fill(p, static_cast<std::int64_t>(padded_.bytes() / sizeof(T)), T(0), stream);
    copy_box(in + inside_.offset_x, p + inside_.offset_padded, inside_.to_padded, false, stream);
    return p;
  }

  // dx from the padded copy's gradient: its inside, zeros where x was cropped away.
  void cut_out(Tensor<T>& dx) {
    const cudaStream_t stream = Context::get().stream();
    T* out = dx.data_in(MemorySpace::device);
    fill(out, dx.numel(), T(0), stream);
    copy_box(static_cast<const T*>(padded_.data()) + inside_.offset_padded, out + inside_.offset_x,
             inside_.from_padded, false, stream);
  }

  ConvShapes shapes_;
  // Whether x runs through the padded copy (then both axes are explicit, pad 0 for cuDNN).
  bool copy_ = false;
  Inside inside_;   // copy_ only
  Storage padded_;  // the padded copy of x, or of dx's gradient (copy_ only)
  // A pointwise conv of few weights: its filter gradient by pointwise_filter_grad (create()).
  bool pointwise_ = false;
  // The chunked sums of the filter (pointwise_) and bias gradients, one after the other.
  Scratch sums_;
  TensorDesc xp_, y_, bias_;  // xp_: x as the convolution reads it
  FilterDesc w_;
  ConvDesc conv_;
  cudnnConvolutionFwdAlgo_t fwd_algo_{};
  cudnnConvolutionBwdDataAlgo_t data_algo_{};
  cudnnConvolutionBwdFilterAlgo_t filter_algo_{};
  std::size_t fwd_bytes_ = 0, data_bytes_ = 0, filter_bytes_ = 0;
  // Each pass runs with the math type its algorithm was ranked with (cuDNN 7.4+ wants both).
  cudnnMathType_t fwd_math_ = CUDNN_FMA_MATH, data_math_ = CUDNN_FMA_MATH,
                  filter_math_ = CUDNN_FMA_MATH;
  std::string name_;
};

template <typename T>
std::unique_ptr<CudnnConv<T>> CudnnConv<T>::create(const ConvShapes& shapes,
                                                   const reference::ConvGeometry& g,
                                                   const CudaOptions& options, std::string& why) {
  const Shape4 &x = shapes.x, &w = shapes.w, &y = shapes.y;
  if (shapes.x_layout != Layout::nchw || shapes.y_layout != Layout::nchw) {
    why = "cuDNN takes NCHW tensors only";
    return nullptr;
  }
  if (g.groups <= 0 || x.c % g.groups != 0 || w.n % g.groups != 0 || w.c * g.groups != x.c ||
      y.c != w.n || y.n != x.n || x.n <= 0 || y.h <= 0 || y.w <= 0 || g.stride_h <= 0 ||
      g.stride_w <= 0 || g.dilation_h <= 0 || g.dilation_w <= 0) {
    why = "shapes and geometry do not describe a convolution";
    return nullptr;
  }
  std::unique_ptr<CudnnConv> k(new CudnnConv(shapes));
  AxisPad ph = axis_pad(x.h, y.h, w.h, g.stride_h, g.dilation_h, g.pad_top);
  AxisPad pw = axis_pad(x.w, y.w, w.w, g.stride_w, g.dilation_w, g.pad_left);
  k->copy_ = ph.copy || pw.copy;
  if (k->copy_ && shapes.is_box()) {  // box kernels serve Conv2d's pad-0 windows
    why = "a box kernel with padding cuDNN cannot express";
    return nullptr;
  }
  if (k->copy_) {
    // Both axes explicit: the copy holds every row and column the outputs read.
    if (!ph.copy) ph = {.copy = true, .padded = x.h + 2 * ph.pad, .begin = ph.pad};
    if (!pw.copy) pw = {.copy = true, .padded = x.w + 2 * pw.pad, .begin = pw.pad};
    k->inside_ = inside(x, ph, pw);
    k->padded_ = Storage(*device_allocator(),
                         static_cast<std::size_t>(x.n * x.c * ph.padded * pw.padded) * sizeof(T));
  }
  const Shape4 xp = k->copy_ ? Shape4{x.n, x.c, ph.padded, pw.padded} : x;
  set_tensor<T>(k->xp_, xp, shapes.is_box() ? shapes.x_outer : xp);
  set_tensor<T>(k->y_, y, shapes.is_box() ? shapes.y_outer : y);
  set_tensor<T>(k->bias_, {1, y.c, 1, 1}, {1, y.c, 1, 1});
  TESSERA_CHECK_CUDNN(cudnnSetFilter4dDescriptor(k->w_.d, data_type<T>(), CUDNN_TENSOR_NCHW,
                                                 to_int(w.n), to_int(w.c), to_int(w.h),
                                                 to_int(w.w)));
  const int pad_h = k->copy_ ? 0 : to_int(ph.pad), pad_w = k->copy_ ? 0 : to_int(pw.pad);
  TESSERA_CHECK_CUDNN(cudnnSetConvolution2dDescriptor(
      k->conv_.d, pad_h, pad_w, to_int(g.stride_h), to_int(g.stride_w), to_int(g.dilation_h),
      to_int(g.dilation_w), CUDNN_CROSS_CORRELATION, data_type<T>()));
  TESSERA_CHECK_CUDNN(cudnnSetConvolutionGroupCount(k->conv_.d, to_int(g.groups)));
  const bool fma_only = std::is_same_v<T, float> && !options.allow_tf32;
  TESSERA_CHECK_CUDNN(
      cudnnSetConvolutionMathType(k->conv_.d, fma_only ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH));

  // cuDNN computes the output extent itself: it must be the planned one.
  int n = 0, c = 0, h = 0, wd = 0;
  TESSERA_CHECK_CUDNN(
      cudnnGetConvolution2dForwardOutputDim(k->conv_.d, k->xp_.d, k->w_.d, &n, &c, &h, &wd));
  if (n != y.n || c != y.c || h != y.h || wd != y.w) {
    why = "cuDNN computes an output of " + Shape4{n, c, h, wd}.str();
    return nullptr;
  }

  const std::size_t limit = workspace_limit();
  const std::string none = std::string("no ") + (options.deterministic ? "deterministic " : "") +
                           "algorithm fits the workspace limit of " + std::to_string(limit >> 20) +
                           " MiB";
  // The same convolution planned again (another layer of the same shapes, the next grid of a
  // test) reuses the choice: measuring runs every algorithm.
  const Shape4 x_outer = shapes.is_box() ? shapes.x_outer : xp,
               y_outer = shapes.is_box() ? shapes.y_outer : y;
  const std::string key =
      std::string(std::is_same_v<T, float> ? "f32 " : "f64 ") + xp.str() + " in " + x_outer.str() +
      " w " + w.str() + " y " + y.str() + " in " + y_outer.str() + " pad " + std::to_string(pad_h) +
      "," + std::to_string(pad_w) + " stride " + std::to_string(g.stride_h) + "," +
      std::to_string(g.stride_w) + " dilation " + std::to_string(g.dilation_h) + "," +
      std::to_string(g.dilation_w) + " groups " + std::to_string(g.groups) +
      (fma_only ? " fma" : "") + (options.deterministic ? " deterministic" : "") +
      (options.measure_algorithms ? " measured" : " heuristic");
  const bool measuring = options.measure_algorithms;
  const Chosen fwd = choose(
      key + " forward", limit,
      [&](int max, int* count, auto* perf) {
        return measuring
                   ? cudnnFindConvolutionForwardAlgorithm(Context::get().cudnn(), k->xp_.d, k->w_.d,
                                                          k->conv_.d, k->y_.d, max, count, perf)
                   : cudnnGetConvolutionForwardAlgorithm_v7(Context::get().cudnn(), k->xp_.d,
                                                            k->w_.d, k->conv_.d, k->y_.d, max,
                                                            count, perf);
      },
      options, fma_only, static_cast<cudnnConvolutionFwdAlgoPerf_t*>(nullptr));
  if (fwd.algo < 0) {
    why = none + " (forward)";
    return nullptr;
  }
  k->fwd_algo_ = static_cast<cudnnConvolutionFwdAlgo_t>(fwd.algo);
  k->fwd_bytes_ = fwd.bytes;
  k->fwd_math_ = fwd.math;
  // cuDNN's backward-filter algorithms for a pointwise conv to few channels (a segmentation head:
  // 32 -> 2 channels over 2048x2048 pixels) all took ~21 ms on an H100, a reduction of 4M pixels
  // into 64 weights; the chunked sums read x and dy once per weight, 0.5 to 1 ms. For at most
  // 256 weights; no cuDNN filter algorithm is chosen for those.
  k->pointwise_ = !shapes.is_box() && !k->copy_ && w.h == 1 && w.w == 1 && g.groups == 1 &&
                  g.stride_h == 1 && g.stride_w == 1 && pad_h == 0 && pad_w == 0 && y.h == x.h &&
                  y.w == x.w && w.n * w.c <= 256;
  if (!shapes.is_box()) {
    const Chosen data = choose(
        key + " backward data", limit,
        [&](int max, int* count, auto* perf) {
          return measuring ? cudnnFindConvolutionBackwardDataAlgorithm(Context::get().cudnn(),
                                                                       k->w_.d, k->y_.d, k->conv_.d,
                                                                       k->xp_.d, max, count, perf)
                           : cudnnGetConvolutionBackwardDataAlgorithm_v7(
                                 Context::get().cudnn(), k->w_.d, k->y_.d, k->conv_.d, k->xp_.d,
                                 max, count, perf);
        },
        options, fma_only, static_cast<cudnnConvolutionBwdDataAlgoPerf_t*>(nullptr));
    Chosen filter{.algo = 0};  // unused by a pointwise conv
    if (!k->pointwise_)
      filter = choose(
          key + " backward filter", limit,
          [&](int max, int* count, auto* perf) {
            return measuring ? cudnnFindConvolutionBackwardFilterAlgorithm(
                                   Context::get().cudnn(), k->xp_.d, k->y_.d, k->conv_.d, k->w_.d,
                                   max, count, perf)
                             : cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                                   Context::get().cudnn(), k->xp_.d, k->y_.d, k->conv_.d, k->w_.d,
                                   max, count, perf);
          },
          options, fma_only, static_cast<cudnnConvolutionBwdFilterAlgoPerf_t*>(nullptr));
    if (data.algo < 0 || filter.algo < 0) {
      why = none + (data.algo < 0 ? " (backward data)" : " (backward filter)");
      return nullptr;
    }
    k->data_algo_ = static_cast<cudnnConvolutionBwdDataAlgo_t>(data.algo);
    k->data_bytes_ = data.bytes;
    k->data_math_ = data.math;
    k->filter_algo_ = static_cast<cudnnConvolutionBwdFilterAlgo_t>(filter.algo);
    k->filter_bytes_ = filter.bytes;
    k->filter_math_ = filter.math;
  }
  k->name_ = "cudnn " + std::to_string(cudnnGetVersion()) + " algos " + std::to_string(fwd.algo) +
             "/" + std::to_string(static_cast<int>(k->data_algo_)) + "/" +
             (k->pointwise_ ? std::string("Tessera's sums")
                            : std::to_string(static_cast<int>(k->filter_algo_))) +
             (k->copy_ ? " (padded copy)" : "") +
             (std::is_same_v<T, float> && options.allow_tf32 ? " tf32 allowed" : "");
  return k;
}

}  // namespace

template <typename T>
std::unique_ptr<ConvKernel<T>> make_cudnn_conv(const ConvShapes& shapes,
                                               const reference::ConvGeometry& g,
                                               const CudaOptions& options, std::string& why) {
  return CudnnConv<T>::create(shapes, g, options, why);
}

template std::unique_ptr<ConvKernel<float>> make_cudnn_conv<float>(const ConvShapes&,
                                                                   const reference::ConvGeometry&,
                                                                   const CudaOptions&,
                                                                   std::string&);
template std::unique_ptr<ConvKernel<double>> make_cudnn_conv<double>(const ConvShapes&,
                                                                     const reference::ConvGeometry&,
                                                                     const CudaOptions&,
                                                                     std::string&);

}  // namespace tessera::cuda
