// The instruction set the threaded CPU loops run with (batch norm's, kernels/cpu/
// batchnorm_kernels.cpp): AVX-512 (F, BW, DQ, VL) where the CPU has it and the build compiled the
// wide loops (GCC on x86-64), else the baseline x86-64 one (SSE2). Both compile the same source:
// no contractions (meson.build: -ffp-contract=off) and every lane sums in the same order, so they
// give the same results bit for bit; the wide loops only do the double arithmetic of memory-bound
// passes faster, so that they run at the memory's speed rather than the core's.
#pragma once

#include <cstdint>
#include <string>

// Whether this compiler builds the wide (AVX-512) loops: GCC on x86-64 (its #pragma GCC target).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TESSERA_HAS_WIDE_LOOPS 1
#else
#define TESSERA_HAS_WIDE_LOOPS 0
#endif

namespace tessera {

enum class SimdLevel { baseline, avx512 };

// "baseline" or "avx512". Local and pure.
const char* to_string(SimdLevel level);
// "baseline" or "avx512"; throws an Error naming the choices otherwise. Local.
SimdLevel parse_simd_level(const std::string& name);

// Whether this build and this CPU can run the loops at `level`. Local.
bool simd_available(SimdLevel level);

// The level the loops run at: the widest available one unless set_simd_level chose another (as
// make_runtime does for TESSERA_SIMD). Local.
SimdLevel simd_level();

// Makes the loops run at `level` from now on (to compare the levels' speed); throws an Error
// when it is not available. Local; not while kernels run on other threads.
void set_simd_level(SimdLevel level);

// Output tensors of at least this many bytes are written with streaming (non-temporal) stores by
// the batch-norm loops and the halo copies (kernels/cpu/halo_copy.cpp): such a tensor does not stay
// in the last-level cache until its consumer reads it, and streaming saves reading each written
// line in first. Half the last-level cache (ranks on one node share it), 16 MiB where the size is
// not known. Local.
std::int64_t streaming_store_bytes();
// Makes streaming_store_bytes() return `bytes` from now on (tests: 0 streams every output). Local;
// not while kernels run on other threads.
void set_streaming_store_bytes(std::int64_t bytes);

// The memory bandwidth one thread of this rank draws, in GB/s: STREAM's triad a = b + 3 c over
// three float arrays of `bytes_per_array` each (so 3 x bytes_per_array counted per pass, as STREAM
// counts; make them several times the last-level cache), the median of `repeats` timed passes after
// one untimed pass that maps the pages (the median: ranks measuring at once start and end apart).
// Run on every rank of a node at once, it shows how much of the node's bandwidth one core already
// draws: the memory-bound passes (batch norm, pooling, windows) cannot run faster on more ranks
// than that allows (tessera bench's "memory:" line). Local.
double triad_bandwidth_gbs(std::int64_t bytes_per_array, int repeats);

}  // namespace tessera
