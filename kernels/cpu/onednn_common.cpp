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

}  // namespace tessera::onednn
