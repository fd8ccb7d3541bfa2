// Helpers shared by the unit tests (one process): runtimes of this rank alone.
#pragma once

#include <vector>

#include "tessera/runtime.hpp"

namespace tessera::test {

// A 1x1x1 runtime of this process with the kernels of `kernels` (both backends live in one
// process; every other option is the default), built once and kept until the end of main. Local.
// Throws an Error for onednn in a build without it.
const Runtime& single_runtime(KernelBackend kernels = default_kernel_backend());

// The backends this build has: reference, and onednn when it was built. Local.
std::vector<KernelBackend> built_backends();

}  // namespace tessera::test
