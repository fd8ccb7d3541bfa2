// A kernel timeline for any CUDA program, for GPU sessions where Nsight Systems cannot write a
// report (see scripts/gpu/verify.sh, step `trace`): an injection library that the CUDA driver loads
// at start-up (CUDA_INJECTION64_PATH), recording with CUPTI's activity API every kernel, memory
// copy and memset on the GPU and every CUDA runtime call on the host, and writing them at exit to
// the file TESSERA_TRACE_FILE (one record a line; scripts/gpu/trace_report.py reads it).
//
// Built by scripts/gpu/bundle.sh when CUPTI's header is found:
//   g++ -std=c++17 -O2 -shared -fPIC -I$CUDA/include scripts/gpu/cupti_trace.cpp -o
//   libcupti_trace.so
//     -L$CUDA/lib -lcupti
// Lines: K start end stream name | M start end stream kind bytes | S start end stream bytes |
//        A start end thread name (times in ns on CUPTI's clock).
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

constexpr size_t kBufferBytes = 8 << 20;
std::mutex write_lock;
FILE* out = nullptr;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(write_lock);
  CUpti_Activity* record = nullptr;
  while (out != nullptr && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(record);
        std::fprintf(out, "K %llu %llu %u %s\n", static_cast<unsigned long long>(k->start),
                     static_cast<unsigned long long>(k->end), k->streamId,
                     k->name != nullptr ? k->name : "?");
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(record);
        std::fprintf(out, "M %llu %llu %u %u %llu\n", static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end), m->streamId,
                     static_cast<unsigned>(m->copyKind), static_cast<unsigned long long>(m->bytes));
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(record);
        std::fprintf(out, "S %llu %llu %u %llu\n", static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end), m->streamId,
                     static_cast<unsigned long long>(m->bytes));
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        auto* a = reinterpret_cast<CUpti_ActivityAPI*>(record);
        const char* name = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
        std::fprintf(out, "A %llu %llu %u %s\n", static_cast<unsigned long long>(a->start),
                     static_cast<unsigned long long>(a->end), a->threadId,
                     name != nullptr ? name : "?");
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

void finish() {
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(write_lock);
  if (out != nullptr) std::fclose(out);
  out = nullptr;
}

}  // namespace

extern "C" int InitializeInjection() {
  const char* path = std::getenv("TESSERA_TRACE_FILE");
  std::string name = path != nullptr ? path : "cupti_trace.txt";
  // One file per process: mpiexec's ranks each write their own (MPICH's, Open MPI's, Slurm's).
  for (const char* var : {"PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"})
    if (const char* rank = std::getenv(var)) {
      name += "." + std::string(rank);
      break;
    }
  out = std::fopen(name.c_str(), "w");
  if (out == nullptr) return 0;
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return 0;
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME);
  std::atexit(finish);
  return 1;
}
