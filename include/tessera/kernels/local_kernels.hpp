// Planned kernels a Backend hands out for the layers that compute on one rank's data alone:
// nearest upsampling of a window, and the classification head (spatial sums for global average
// pooling, linear layers). The layers do the communication around them. Every method is local.
// Memory: tensors, raw pointers and spans of T (parameters, their gradients, sums of T) lie in the
// backend's memory (Backend::allocator: the device's for a GPU backend); labels, seeds and the
// loss lie in host memory.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "tessera/error.hpp"
#include "tessera/kernels/elementwise.hpp"
#include "tessera/kernels/reference_upsample.hpp"
#include "tessera/random.hpp"
#include "tessera/tensor.hpp"

namespace tessera {

enum class ActivationKind { relu, leaky_relu, sigmoid };

// An activation that neighbouring layers compute for its layer (engine/model.cpp fuses them): the
// producer applies f to its output as it writes it, the consumer applies f' to its input gradient.
struct FusedActivation {
  ActivationKind kind = ActivationKind::relu;
  double slope = 0;  // leaky_relu's
};

// An elementwise activation planned for one layer: it keeps what its backward needs (ReLU: which
// inputs were positive, a byte each; sigmoid: its output), so each layer holds its own. Works on
// the storage as it is (any layout).
template <typename T>
class ActivationKernel {
 public:
  virtual ~ActivationKernel() = default;
  virtual std::string name() const = 0;
  // y = f(x), y of x's shape and storage size.
  virtual void forward(const Tensor<T>& x, Tensor<T>& y) = 0;
  // dx = f'(x) * dy from what the last forward kept.
  virtual void backward(const Tensor<T>& dy, Tensor<T>& dx) const = 0;

  // For fused activations: whether the three below compute from f's output alone (y > 0 tells
  // (leaky) ReLU's f'; sigmoid's f' is y (1 - y)). Backends that cannot say false, and the model
  // then fuses nothing with this activation.
  virtual bool works_from_output() const { return false; }
  // y = f(x) with nothing kept: its consumer applies f' (backward_from_output). Same contract as
  // forward otherwise.
  virtual void forward_unkept(const Tensor<T>& x, Tensor<T>& y) { forward(x, y); }
  // The producer already wrote y = f(x): keep from y what backward() needs, as forward would.
  virtual void keep_output(const Tensor<T>& y);
  // grad *= f'(x) in place, where y = f(x): y and grad of one shape and storage (a halo layer's
  // window and its gradient, any layout).
  virtual void backward_from_output(const Tensor<T>& y, Tensor<T>& grad) const;
};

// Only called where works_from_output() is true; these say so where it is not.
template <typename T>
void ActivationKernel<T>::keep_output(const Tensor<T>&) {
  throw Error("the " + name() + " activation cannot keep what its backward needs from its output");
}
template <typename T>
void ActivationKernel<T>::backward_from_output(const Tensor<T>&, Tensor<T>&) const {
  throw Error("the " + name() + " activation cannot take its gradient from its output");
}

// Softmax cross-entropy over the channels of a tile of logits [N, C, H, W] (H = W = 1 for a
// classifier's vectors) with labels [N, H, W] (values in [0, C), checked): the sum of
// -log softmax(logits)[label] over the tile, in double; with `dlogits`, scale * (softmax -
// onehot(label)) into it. The caller reduces the sum over the grid.
// prepare() may start moving the labels of the next cross_entropy where the kernel computes
// (the CUDA loss: while the forward pass runs); it reads `labels` until cross_entropy or
// settle() returns, whichever comes first, so the caller keeps them alive and unchanged until
// then. Local.
template <typename T>
class LossKernel {
 public:
  virtual ~LossKernel() = default;
  virtual std::string name() const = 0;
  virtual double cross_entropy(const Tensor<T>& logits, std::span<const std::int32_t> labels,
                               T scale, Tensor<T>* dlogits) const = 0;
  virtual void prepare(std::span<const std::int32_t> /*labels*/) const {}
  // Returns once nothing reads the labels given to prepare(); never throws.
  virtual void settle() const noexcept {}
};

// The optimizers' per-element updates on one parameter of n values (elementwise::sgd and
// elementwise::adam over every element; the scalars are in kernels/elementwise.hpp).
template <typename T>
class UpdateKernel {
 public:
  virtual ~UpdateKernel() = default;
  virtual std::string name() const = 0;
  // d = g (+ wd * p); with a momentum buffer: buf = first_step ? d : buf * momentum + d, d = buf;
  // p += -lr * d. `buf` may be null (no momentum).
  virtual void sgd(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars<T>& s) const = 0;
  // d = g (+ wd * p); m = m * beta1 + (1 - beta1) d; v = v * beta2 + (1 - beta2) d^2;
  // p += -step_size * m / (sqrt(v) / sqrt(bias_correction2) + eps).
  virtual void adam(T* p, const T* g, T* m, T* v, std::int64_t n,
                    const AdamScalars<T>& s) const = 0;
};

// Concat and add on NCHW tiles: channel blocks copied into and out of a wider tensor, and sums.
template <typename T>
class MergeKernel {
 public:
  virtual ~MergeKernel() = default;
  virtual std::string name() const = 0;
  // y[n, offset + c, h, w] = x[n, c, h, w] for x's channels (y has as many samples and pixels).
  virtual void put_channels(const Tensor<T>& x, Tensor<T>& y, std::int64_t offset) const = 0;
  // x[n, c, h, w] = y[n, offset + c, h, w] for x's channels.
  virtual void take_channels(const Tensor<T>& y, std::int64_t offset, Tensor<T>& x) const = 0;
  // a += b, element by element (the same shape and layout).
  virtual void add(const Tensor<T>& b, Tensor<T>& a) const = 0;
  // y[n, c, h, w] += bias[c] (y NCHW; the CPU's kernel takes the blocked layouts too, the
  // layouts a kernel that writes y in them gives).
  virtual void add_bias(std::span<const T> bias, Tensor<T>& y) const = 0;
  // dbias[c] += the sum of dy[n, c, :, :] (layouts as add_bias): each plane summed in order, the
  // planes added in (n, c) order, as the reference conv does.
  virtual void add_bias_grad(const Tensor<T>& dy, std::span<T> dbias) const = 0;
};

using elementwise::dropout_scale;

// Where a tile lies in its tensor: the global shape and the tile's first sample, row and column.
struct TileOrigin {
  Shape4 global;
  std::int64_t n = 0, h = 0, w = 0;
};
// The index arithmetic of a tile of shape `tile` at `at` (elementwise::global_index). Local.
inline TileIndex tile_index(const TileOrigin& at, const Shape4& tile) {
  return {tile.n, tile.c, tile.h, tile.w, at.global.c, at.global.h, at.global.w, at.n, at.h, at.w};
}

// The shape checks every backend's merge and dropout kernels make before they touch memory:
// Errors naming the shapes. Local.
void check_concat(const Shape4& x, const Shape4& y, std::int64_t offset);
// Labels (one per pixel, each in [0, C)) and a gradient (the logits' shape) for cross-entropy
// over logits of shape `logits`; `dlogits` may be null. check_cross_entropy is the two below:
// the shapes (`labels` labels), and each label in [0, classes) (a pass over the labels, which
// the CUDA loss makes only when the device's sum came back non-finite).
void check_cross_entropy(const Shape4& logits, std::span<const std::int32_t> labels,
                         const Shape4* dlogits);
void check_cross_entropy_shapes(const Shape4& logits, std::size_t labels, const Shape4* dlogits);
void check_labels(std::span<const std::int32_t> labels, std::int64_t classes);
// A per-channel bias (or its gradient) of `size` values for a tensor of shape `t`, NCHW unless
// the kernel takes blocked layouts too (`blocked_ok`).
void check_bias_shape(std::size_t size, const Shape4& t, Layout layout, const char* what,
                      bool blocked_ok = false);
void check_dropout_tile(const Shape4& x, Layout layout, const TileOrigin& at, const Shape4& mask,
                        const Shape4& y);
void check_dropout_backward(const Shape4& dy, const Shape4& mask, const Shape4& dx);

// Dropout of one layer with probability p, on NCHW tiles.
template <typename T>
class DropoutKernel {
 public:
  virtual ~DropoutKernel() = default;
  virtual std::string name() const = 0;
  // mask = dropout_scale of each element of the tile at `origin`, y = x * mask (both overwritten,
  // x's shape).
  virtual void forward(const Tensor<T>& x, const TileOrigin& origin, std::uint64_t seed,
                       std::uint64_t stream, Tensor<T>& mask, Tensor<T>& y) const = 0;
  // dx = dy * mask (overwritten).
  virtual void backward(const Tensor<T>& dy, const Tensor<T>& mask, Tensor<T>& dx) const = 0;
};

// Nearest upsampling planned for one geometry (scale and phase of a tile).
template <typename T>
class UpsampleKernel {
 public:
  virtual ~UpsampleKernel() = default;
  virtual std::string name() const = 0;
  // Whether x and y (dy and dx) may be in a blocked layout, both in the same one; else NCHW.
  virtual bool takes_blocked() const { return false; }
  // Whether x (dx) may be in a blocked layout while y (dy) is in NCHW: the layout converted as the
  // values are widened (narrowed), with no pass of its own.
  virtual bool converts_blocked_to_nchw() const { return false; }
  // y (its shape gives the output extent) from the window x.
  virtual void forward(const Tensor<T>& x, Tensor<T>& y) const = 0;
  // dx (overwritten, the window's shape): each input's sum of the gradients of the outputs that
  // read it, in row-major order of the outputs.
  virtual void backward(const Tensor<T>& dy, Tensor<T>& dx) const = 0;
};

// Global average pooling's local halves: per-plane sums of a tile, and a gradient spread over a
// tile.
template <typename T>
class SpatialSumKernel {
 public:
  virtual ~SpatialSumKernel() = default;
  virtual std::string name() const = 0;
  // sums[n * C + c] = sum over the tile's h, w of x[n, c, h, w] (overwritten).
  virtual void sums(const Tensor<T>& x, std::span<T> sums) const = 0;
  // dx[n, c, h, w] = g[n * C + c] for every h, w of the tile (overwritten).
  virtual void spread(std::span<const T> g, Tensor<T>& dx) const = 0;
};

// A linear layer y [N, O] = x [N, I] w^T + bias planned for I inputs and O outputs (w [O, I],
// PyTorch's layout; bias [O] or empty).
template <typename T>
class LinearKernel {
 public:
  virtual ~LinearKernel() = default;
  virtual std::string name() const = 0;
  virtual void forward(std::span<const T> x, std::span<const T> w, std::span<const T> bias,
                       std::span<T> y, std::int64_t n) const = 0;
  // dx [N, I] = dy [N, O] w (overwritten).
  virtual void backward_data(std::span<const T> dy, std::span<const T> w, std::span<T> dx,
                             std::int64_t n) const = 0;
  // dw += dy^T x, dbias += column sums of dy (dbias may be empty).
  virtual void backward_weights(std::span<const T> x, std::span<const T> dy, std::span<T> dw,
                                std::span<T> dbias, std::int64_t n) const = 0;
};

// Tessera's CPU activations: vectorised loops over the kernel threads (ReLU and leaky ReLU keep a
// byte mask), sigmoid the reference's. `slope`: leaky ReLU's. Local.
template <typename T>
std::unique_ptr<ActivationKernel<T>> make_cpu_activation(ActivationKind kind, double slope);

// Dropout's loops over rows, split over the kernel threads.
template <typename T>
std::unique_ptr<DropoutKernel<T>> make_cpu_dropout(double p);

// Nearest upsampling: by 2 across the columns, contiguous loops over the kernel threads (same
// results as the reference bit for bit, kernels/cpu/upsample_kernels.cpp); else the reference.
template <typename T>
std::unique_ptr<UpsampleKernel<T>> make_cpu_upsample(const reference::UpsampleGeometry& g);

// Softmax cross-entropy over the kernel threads: the reference's arithmetic per pixel, partial
// sums over fixed chunks of pixels (kernels/cpu/loss_kernels.cpp).
template <typename T>
std::unique_ptr<LossKernel<T>> make_cpu_loss();

// The reference implementations (plain loops of kernels/reference_*.hpp). Local.
template <typename T>
std::unique_ptr<UpsampleKernel<T>> make_reference_upsample(const reference::UpsampleGeometry& g);
template <typename T>
std::unique_ptr<SpatialSumKernel<T>> make_reference_spatial_sum();
template <typename T>
std::unique_ptr<LossKernel<T>> make_reference_loss();
// Threaded copies (parallel.hpp) and a plain add.
template <typename T>
std::unique_ptr<MergeKernel<T>> make_cpu_merge();
template <typename T>
std::unique_ptr<UpdateKernel<T>> make_reference_update();
template <typename T>
std::unique_ptr<LinearKernel<T>> make_reference_linear(std::int64_t in, std::int64_t out);

}  // namespace tessera
