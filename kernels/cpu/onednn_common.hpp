// What the oneDNN kernels share (private to kernels/cpu): the engine, the thread count handed to
// oneDNN's runtime, error translation and descriptor helpers. All local.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <string>
#include <unordered_map>

#include "tessera/error.hpp"
#include "tessera/tensor.hpp"

namespace tessera::onednn {

// The one CPU engine of the process.
const dnnl::engine& cpu_engine();

// Hands kernel_threads() to the runtime once, before the first primitive runs; returns whether
// the runtime took it (only an OpenMP build of oneDNN can be told).
bool apply_threads();

// A oneDNN failure at run time (out of memory, ...) becomes Tessera's one exception type.
template <typename F>
void run(const char* what, F&& f) {
  try {
    f();
  } catch (const dnnl::error& e) {
    throw Error(std::string("oneDNN ") + what + ": " + e.what() + " (status " +
                std::to_string(static_cast<int>(e.status)) + ")");
  }
}

inline dnnl::memory::dims dims_of(const Shape4& s) {
  return {s.n, s.c, s.h, s.w};
}

// A dense float32 tensor of shape `s` in Tessera's `layout`.
inline dnnl::memory::desc dense_desc(const Shape4& s, Layout layout) {
  using Tag = dnnl::memory::format_tag;
  return {dims_of(s), dnnl::memory::data_type::f32,
          layout == Layout::nchw16c  ? Tag::nChw16c
          : layout == Layout::nchw8c ? Tag::nChw8c
                                     : Tag::nchw};
}

// Every primitive Tessera plans takes its scratchpad from the caller (user mode), and every buffer
// of a call (reorders' targets, scratchpads) comes from host_allocator(): a step's large blocks are
// then all Tessera's, and the host pool reuses their pages from step to step (oneDNN's own
// allocations were ~2 GiB per unet-small step at 2048x2048, mapped and faulted in afresh).
dnnl::primitive_attr user_scratchpad();

// A memory object of `desc` over a block of `buffer`, allocated from host_allocator() when
// `buffer` is smaller than the descriptor needs; an empty memory for an empty descriptor.
dnnl::memory buffer_memory(const dnnl::memory::desc& desc, Storage& buffer);

// Adds the scratchpad `pd` asks for (if any) to `args`, from `buffer`.
void add_scratchpad(const dnnl::primitive_desc_base& pd,
                    std::unordered_map<int, dnnl::memory>& args, Storage& buffer);

// Whether oneDNN chose its own reference implementation (plain loops): Tessera's reference is then
// as good and is the oracle, so the fast kernels decline such cases.
bool is_reference(const dnnl::primitive_desc& pd);

}  // namespace tessera::onednn
