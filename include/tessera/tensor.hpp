// A dense, owning tensor on one rank: NCHW or channel-blocked, in host or device memory. Local.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/allocator.hpp"

namespace tessera {

struct Shape4 {
  std::int64_t n = 0;
  std::int64_t c = 0;
  std::int64_t h = 0;
  std::int64_t w = 0;

  std::int64_t numel() const { return n * c * h * w; }
  std::string str() const;
  friend bool operator==(const Shape4&, const Shape4&) = default;
};

// How a tensor's elements lie in memory: NCHW, or channel-blocked, the layouts oneDNN's
// convolutions compute in: nChw16c ([N][ceil(C/16)][H][W][16]), which conv windows and the
// activations between convs use (DistTensor::layout), and nChw8c ([N][ceil(C/8)][H][W][8]), which
// only conv windows and their gradients use, for channels that are a multiple of 8 but not of 16
// (Conv2d::bind_kernel). The shape is the logical [N, C, H, W] either way. With C not a multiple
// of the block the last block of each sample is padded with channels that hold zeros: only conv
// windows and their gradients are padded (Conv2d); activations in nchw16c have a multiple of 16
// channels.
enum class Layout { nchw, nchw16c, nchw8c };
inline constexpr std::int64_t kBlock = 16;  // channels per block in nchw16c
inline const char* to_string(Layout layout) {
  switch (layout) {
    case Layout::nchw16c:
      return "nchw16c";
    case Layout::nchw8c:
      return "nchw8c";
    case Layout::nchw:
      break;
  }
  return "nchw";
}

// Channels per block of `layout`: 16, 8, or 1 for NCHW.
inline constexpr std::int64_t block_of(Layout layout) {
  return layout == Layout::nchw16c ? kBlock : layout == Layout::nchw8c ? 8 : 1;
}

// The blocked layout a tensor of `channels` channels goes on in between layers where the model
// allows it: nchw16c for a multiple of 16, nchw8c for another multiple of 8 (oneDNN's 8-channel
// kernels read it unpadded), else NCHW.
inline constexpr Layout blocked_layout_for(std::int64_t channels) {
  return channels % kBlock == 0 ? Layout::nchw16c
         : channels % 8 == 0    ? Layout::nchw8c
                                : Layout::nchw;
}

// Channel blocks of `block` channels: ceil(c / block).
inline std::int64_t channel_blocks(std::int64_t c, std::int64_t block = kBlock) {
  return (c + block - 1) / block;
}

// Where element (n, c, h, w) of a tensor of shape `s` lies in the blocked layout of `block`
// channels per block.
inline std::int64_t blocked_offset(const Shape4& s, std::int64_t block, std::int64_t n,
                                   std::int64_t c, std::int64_t h, std::int64_t w) {
  return (((n * channel_blocks(s.c, block) + c / block) * s.h + h) * s.w + w) * block + c % block;
}

// Where element (n, c, h, w) of a tensor of shape `s` lies in `layout`.
inline std::int64_t layout_offset(const Shape4& s, Layout layout, std::int64_t n, std::int64_t c,
                                  std::int64_t h, std::int64_t w) {
  if (layout == Layout::nchw) return ((n * s.c + c) * s.h + h) * s.w + w;
  return blocked_offset(s, block_of(layout), n, c, h, w);
}

// The elements a tensor of shape `s` holds in `layout`: numel, or with the blocks' padding.
inline std::int64_t storage_size(const Shape4& s, Layout layout) {
  const std::int64_t b = block_of(layout);
  return s.n * channel_blocks(s.c, b) * b * s.h * s.w;
}

// The elements of storage_size(s, layout), checked: an Error naming the shape when they, or their
// bytes at `element_bytes` each, do not fit 64-bit sizes (a wrapped size would allocate a small
// block and write past it).
std::size_t checked_storage_size(const Shape4& s, Layout layout, std::size_t element_bytes);

// Asks for a tensor whose values the caller overwrites before reading: it is not zeroed (a pass
// over the memory saved, 35 ms for a 512 MiB activation here).
struct Uninitialized {};
inline constexpr Uninitialized uninitialized{};

// A tensor owns its storage (from an Allocator, host_allocator() unless given), knows the memory
// space that storage lies in and its layout. Host accessors (data, span, at, fill) check that the
// host may reach the storage (Allocator::host_accessible): device tensors are reached through
// their backend's kernels and the copies below only. Copies allocate from the same allocator.
template <typename T>
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(Shape4 shape, T fill = T(0)) : Tensor(shape, Layout::nchw, fill) {}
  Tensor(Shape4 shape, Uninitialized) : Tensor(shape, Layout::nchw, uninitialized) {}
  // Storage for `layout` (nchw16c with C not a multiple of 16 holds padding channels).
  Tensor(Shape4 shape, Layout layout, T fill = T(0)) : Tensor(shape, layout, uninitialized) {
    this->fill(fill);
  }
  Tensor(Shape4 shape, Layout layout, Uninitialized, Allocator& allocator = host_allocator())
      : shape_(shape),
        layout_(layout),
        size_(checked_storage_size(shape, layout, sizeof(T))),
        storage_(allocator, size_ * sizeof(T)) {}
  // Zeros in the memory of `allocator` (any space).
  Tensor(Shape4 shape, Layout layout, Allocator& allocator)
      : Tensor(shape, layout, uninitialized, allocator) {
    zero();
  }

  Tensor(const Tensor&) = default;
  // A moved-from tensor is empty (no storage, no elements).
  Tensor(Tensor&& other) noexcept
      : shape_(std::exchange(other.shape_, {})),
        layout_(other.layout_),
        size_(std::exchange(other.size_, 0)),
        storage_(std::move(other.storage_)) {}
  // Copies in place when the storage fits (same allocator and size), else allocates first: a
  // failed allocation leaves the tensor as it was.
  Tensor& operator=(const Tensor& other) {
    if (this == &other) return *this;
    storage_ = other.storage_;
    shape_ = other.shape_;
    layout_ = other.layout_;
    size_ = other.size_;
    return *this;
  }
  Tensor& operator=(Tensor&& other) noexcept {
    if (this == &other) return *this;
    storage_ = std::move(other.storage_);
    shape_ = std::exchange(other.shape_, {});
    layout_ = other.layout_;
    size_ = std::exchange(other.size_, 0);
    return *this;
  }

  const Shape4& shape() const { return shape_; }
  Layout layout() const { return layout_; }
  MemorySpace space() const { return storage_.space(); }
  // Logical elements N * C * H * W; size() and the storage may hold more (nchw16c padding).
  std::int64_t numel() const { return shape_.numel(); }
  std::size_t size() const { return size_; }
  const Storage& storage() const { return storage_; }
  // Where the storage came from (host_allocator() for an empty tensor).
  Allocator& allocator() const {
    return storage_.allocator() != nullptr ? *storage_.allocator() : host_allocator();
  }
  // Sets every element (padding included) to zero, in any memory space.
  void zero() { allocator().zero(storage_.data(), size_ * sizeof(T)); }

  T* data() { return host(); }
  const T* data() const { return host(); }
  std::span<T> span() { return {host(), size_}; }
  std::span<const T> span() const { return {host(), size_}; }
  // The storage wherever it lies, for the backend of that space; checks that it lies in `space`.
  T* data_in(MemorySpace space) {
    if (size_ == 0) return nullptr;  // an empty tensor lies anywhere
    if (space != this->space()) not_on_host(this->space());
    return static_cast<T*>(storage_.data());
  }
  const T* data_in(MemorySpace space) const { return const_cast<Tensor*>(this)->data_in(space); }
  std::span<T> span_in(MemorySpace space) { return {data_in(space), size_}; }
  std::span<const T> span_in(MemorySpace space) const { return {data_in(space), size_}; }

  std::int64_t offset(std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) const {
    return ((n * shape_.c + c) * shape_.h + h) * shape_.w + w;
  }
  T& at(std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) {
    return host()[offset(n, c, h, w)];
  }
  const T& at(std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) const {
    return host()[offset(n, c, h, w)];
  }
  void fill(T v) { std::fill_n(host(), size_, v); }

 private:
  T* host() const {
    if (!storage_.host_accessible()) [[unlikely]]
      not_on_host(storage_.space());
    return static_cast<T*>(storage_.data());
  }

  Shape4 shape_;
  Layout layout_ = Layout::nchw;
  std::size_t size_ = 0;
  Storage storage_;
};

// Copies the storage of `t` (t.size() values) into host memory at `to`, finished on return.
// Local.
template <typename T>
void download(const Tensor<T>& t, T* to) {
  t.allocator().download(to, t.data_in(t.space()), t.size() * sizeof(T));
}
// Overwrites the storage of `t` with t.size() values from host memory at `from`. Local.
template <typename T>
void upload(const T* from, Tensor<T>& t) {
  t.allocator().upload(t.data_in(t.space()), from, t.size() * sizeof(T));
}
// download and upload in the order of the allocator's queue, returning before they are done:
// `to` / `from` are staging memory, read or written again only after t.allocator().wait_ordered()
// (Allocator::download_ordered). Local.
template <typename T>
void download_ordered(const Tensor<T>& t, T* to) {
  t.allocator().download_ordered(to, t.data_in(t.space()), t.size() * sizeof(T));
}
template <typename T>
void upload_ordered(const T* from, Tensor<T>& t) {
  t.allocator().upload_ordered(t.data_in(t.space()), from, t.size() * sizeof(T));
}

// `t` with its shape and layout in the memory of `allocator` (a plain copy when it is already
// there). Local.
template <typename T>
Tensor<T> copy_to(const Tensor<T>& t, Allocator& allocator) {
  if (&t.allocator() == &allocator) return t;
  Tensor<T> out(t.shape(), t.layout(), uninitialized, allocator);
  if (allocator.space() == MemorySpace::host) {
    download(t, out.data_in(MemorySpace::host));
  } else if (t.space() == MemorySpace::host) {
    upload(t.data_in(MemorySpace::host), out);
  } else {  // between two device allocators: through the host
    Tensor<T> staged = copy_to(t, host_allocator());
    upload(staged.data(), out);
  }
  return out;
}
// `t` in host memory. Local.
template <typename T>
Tensor<T> to_host(const Tensor<T>& t) {
  return copy_to(t, host_allocator());
}

// The values of a tensor in host memory for a short host computation on a small tensor (a
// layer's per-channel sums, a classifier's logits): the tensor's own storage when the host may
// reach it, else a copy that store() writes back. Local.
template <typename T>
class HostValues {
 public:
  explicit HostValues(Tensor<T>& t) : t_(t), direct_(t.storage().host_accessible()) {
    if (!direct_) {
      copy_.resize(t.size());
      download(t, copy_.data());
    }
  }
  std::span<T> span() { return direct_ ? t_.span() : std::span<T>(copy_); }
  // Writes the values back into the tensor (nothing to do when they are its own).
  void store() {
    if (!direct_) upload(copy_.data(), t_);
  }

 private:
  Tensor<T>& t_;
  bool direct_;
  std::vector<T> copy_;
};

// The same tensor in another layout, element by element (for tests and rare fallbacks: the hot
// paths convert while they copy); blocked layouts pad the channels to a multiple of the block.
// Local.
template <typename T>
Tensor<T> to_layout(const Tensor<T>& t, Layout to) {
  const Layout from = t.layout();
  if (from == to) return t;
  const Shape4& s = t.shape();
  Tensor<T> out(s, to);  // padding channels zero
  for (std::int64_t n = 0; n < s.n; ++n)
    for (std::int64_t c = 0; c < s.c; ++c)
      for (std::int64_t h = 0; h < s.h; ++h)
        for (std::int64_t w = 0; w < s.w; ++w)
          out.data()[layout_offset(s, to, n, c, h, w)] =
              t.data()[layout_offset(s, from, n, c, h, w)];
  return out;
}

}  // namespace tessera
