#include "onednn_common.hpp"

#include <dlfcn.h>

#include <string_view>

#include "tessera/kernels/backend.hpp"

namespace tessera::onednn {

const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// The OpenMP library is the one libdnnl loaded (libgomp, libomp or libiomp5), so its
// omp_set_num_threads is looked up rather than linked. A TBB or threadpool build keeps its own
// count, a sequential one uses 1.
bool apply_threads() {
  static const bool applied = [] {
    if (dnnl_version()->cpu_runtime != DNNL_RUNTIME_OMP) return false;
    using SetThreads = void (*)(int);
    auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
    if (set == nullptr) return false;
    set(kernel_threads().count);
    return true;
  }();
  return applied;
}

bool is_reference(const dnnl::primitive_desc& pd) {
  return std::string_view(pd.impl_info_str()).starts_with("ref");
}

dnnl::primitive_attr user_scratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

dnnl::memory buffer_memory(const dnnl::memory::desc& desc, Storage& buffer) {
  const std::size_t bytes = desc.get_size();
  if (bytes == 0) return dnnl::memory(desc, cpu_engine(), DNNL_MEMORY_NONE);
  if (buffer.bytes() < bytes) buffer = Storage(host_allocator(), bytes);
  return dnnl::memory(desc, cpu_engine(), buffer.data());
}

void add_scratchpad(const dnnl::primitive_desc_base& pd,
                    std::unordered_map<int, dnnl::memory>& args, Storage& buffer) {
  const dnnl::memory::desc desc = pd.scratchpad_desc();
  if (desc.get_size() > 0) args.insert({DNNL_ARG_SCRATCHPAD, buffer_memory(desc, buffer)});
}

}  // namespace tessera::onednn
