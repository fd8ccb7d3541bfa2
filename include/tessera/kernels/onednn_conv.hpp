// The oneDNN (libdnnl) 2-D convolution, float32: forward, backward-data and backward-weights
// (with bias) primitives planned once for fixed shapes, executed every step. Built
// only when TESSERA_HAVE_ONEDNN; layers reach it through Backend::conv (kernels/backend.hpp).
//
// Each primitive picks its own layout (format_tag::any) and a reorder planned with it converts on
// the way in and out when Tessera's layout differs. Weights are converted at every call (they
// change every step; they are small). The window x and its gradient dx, and the output y and its
// gradient dy, may be nchw16c (ConvShapes::x_layout, y_layout), which is what the primitives pick
// on AVX-512: then they are read and written with no reorder. NCHW ones are converted at every
// call into buffers that live for the call (dy once for both backward primitives). A box kernel
// (ConvShapes::x_outer) reads and writes boxes of larger tensors through strided (NCHW) or
// sub-memory (nchw16c) descriptors; oneDNN's fast convolutions then convert the box.
#pragma once

#include <memory>
#include <string>

#include "tessera/kernels/conv_kernel.hpp"

namespace tessera {

class OneDnnConv final : public ConvKernel<float> {
 public:
  // Plans the three primitives for `shapes` and `g`, or returns nullptr when oneDNN does not take
  // the case, as its own implementation lists decline: negative padding (a window that starts
  // inside the input, as transposed convs use), more unused trailing input rows or columns than
  // one stride, shapes that do not fit `g`, or a case only oneDNN's own reference implementation
  // accepts (then Tessera's reference is as good and is the oracle). Never throws for a case it
  // declines. Local.
  static std::unique_ptr<OneDnnConv> create(const ConvShapes& shapes,
                                            const reference::ConvGeometry& g);
  ~OneDnnConv() override;

  void forward(const Tensor<float>& x, const Tensor<float>& w, std::span<const float> bias,
               Tensor<float>& y) override;
  void backward_data(const Tensor<float>& dy, const Tensor<float>& w, Tensor<float>& dx) override;
  void backward_filter(const Tensor<float>& x, const Tensor<float>& dy, Tensor<float>& dw,
                       std::span<float> dbias) override;
  void forward_box(const Tensor<float>& x, BoxAt x_at, const Tensor<float>& w,
                   std::span<const float> bias, Tensor<float>& y, BoxAt y_at) override;
  // A 1x1 conv of at most 8 outputs from NCHW or nchw16c x (a segmentation head) in float32: one
  // pass over x and dy with Tessera's AVX-512 loops instead of oneDNN's two GEMMs and a separate
  // f' (kernels/cpu/onednn_conv.cpp, pointwise_backward_one_pass). False for any other case.
  bool backward_fused(const Tensor<float>& x, const Tensor<float>& dy, const Tensor<float>& w,
                      const std::optional<FusedActivation>& f, Tensor<float>& dx, Tensor<float>& dw,
                      std::span<float> dbias) override;
  // "onednn " and the implementations oneDNN chose for forward / backward-data /
  // backward-weights, e.g. "onednn jit:avx512_core/jit:avx512_core/jit:avx512_core", and
  // ", backward-weights in N strips" where weights_strips() is N.
  std::string name() const override;
  // In how many strips of output rows backward_filter runs: 0 for one call over the whole
  // tensors, which it is unless that call's scratchpad would be larger than
  // onednn_weights_scratch_limit() (oneDNN's bfloat16 backward-weights kernel copies x and dy
  // whole into its scratchpad: 1 GiB for 32 channels at 2048x2048).
  std::int64_t weights_strips() const;
  // Planned with ConvShapes::activation: the forward applies it as oneDNN's post-op.
  bool applies_activation() const override;

 private:
  struct Plan;
  explicit OneDnnConv(std::unique_ptr<Plan> plan);
  // create, computing in the layouts Tessera prefers for these shapes (8-channel blocks, NCHW
  // GEMMs) where `preferred`, else in those oneDNN chooses.
  static std::unique_ptr<OneDnnConv> plan_in(const ConvShapes& shapes,
                                             const reference::ConvGeometry& g, bool preferred);
  // x and y point at the first element of the planned (possibly strided) boxes.
  void run_forward(const float* x, const Tensor<float>& w, std::span<const float> bias, float* y);
  std::unique_ptr<Plan> plan_;
};

// A 1x1 convolution (stride 1, no padding, no groups, no fused activation, float32 products)
// from a window in nchw8c of 8, 24, ... channels to an NCHW output of fewer than 16 channels (a
// segmentation head after 8-channel activations). A sample's 8-channel block is a pixels x 8
// matrix, so each pass is one dnnl_sgemm per block, reading the window and writing its gradient
// as they lie; oneDNN's convolutions would need the window in NCHW (a conversion each way) or pad
// the output to 8 channels and convert it. Returns nullptr for any other case. Local.
std::unique_ptr<ConvKernel<float>> make_onednn_blocked_pointwise(const ConvShapes& shapes,
                                                                 const reference::ConvGeometry& g);

// The largest scratchpad, in bytes, a convolution's backward-weights call may take before it runs
// in strips of output rows instead (OneDnnConv::weights_strips); 64 MiB. Process-wide, read when a
// convolution is planned; set_onednn_weights_scratch_limit returns the previous limit (tests set
// small ones). Local.
std::size_t onednn_weights_scratch_limit();
std::size_t set_onednn_weights_scratch_limit(std::size_t bytes);

// oneDNN's version, CPU threading runtime and the threads it uses, e.g. "oneDNN 2.6.3, OpenMP,
// 2 threads per rank: 8 cores / 4 ranks on this node". Applies kernel_threads() to the runtime if
// that has not happened yet. Local.
std::string onednn_description();

// dnnl_sgemm's rate on n x n matrices, best of `repeats`, in GFLOP/s (see sgemm_gflops). Local.
double onednn_sgemm_gflops(std::int64_t n, int repeats);

// Whether oneDNN plans a small bfloat16 convolution with a kernel of its own rather than its
// reference loops: with the CPU's bfloat16 instructions, or emulating them with AVX-512 float
// multiplies (its jit_bf16:avx512_core, on AVX-512 CPUs without them: 3.7x slower than float32
// on conv-bench). The bf16 kernel tests run wherever this holds. Local.
bool onednn_bf16_supported();
// Whether oneDNN's effective instruction set has the bfloat16 instructions themselves
// (avx512_core_bf16: AVX512_BF16, or AMX), so that it does not emulate them. Local.
bool onednn_bf16_native();

}  // namespace tessera
