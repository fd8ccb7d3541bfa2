// What the oneDNN kernels share (private to kernels/cpu): the engine, the thread count handed to
// oneDNN's runtime, error translation and descriptor helpers. All local.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <string>

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
  return {dims_of(s), dnnl::memory::data_type::f32,
          layout == Layout::nchw16c ? dnnl::memory::format_tag::nChw16c
                                    : dnnl::memory::format_tag::nchw};
}

// Whether oneDNN chose its own reference implementation (plain loops): Tessera's reference is then
// as good and is the oracle, so the fast kernels decline such cases.
bool is_reference(const dnnl::primitive_desc& pd);

}  // namespace tessera::onednn
