// The NCCL transport (include/tessera/device_comm.hpp: make_nccl_comm): device buffers move by
// NCCL on a communication stream of their own; host buffers, grids and the watchdog are the MPI
// Comm's. A started operation waits (on the device) for everything enqueued on the compute stream
// before it, so it sends what the pack kernels wrote; a Request completes when its event has
// passed, which the host observes before it enqueues anything that reads what arrived.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda_check.hpp"
#include "cuda_context.hpp"
#include "tessera/collectives.hpp"
#include "tessera/device_comm.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera/kernels/backend.hpp"

namespace tessera {
namespace {

// One NCCL communicator per group (world, spatial, sample), destroyed with the last Comm using it.
struct NcclGroups {
  ncclComm_t world = nullptr, spatial = nullptr, sample = nullptr;
  cudaStream_t stream = nullptr;
  // Recorded on the compute stream before each operation, which the stream above waits for
  // (cudaStreamWaitEvent takes the event as recorded then, so one event serves every operation).
  cudaEvent_t ready = nullptr;
  ~NcclGroups() {
    if (ready != nullptr) (void)cudaEventDestroy(ready);
    for (ncclComm_t c : {sample, spatial, world})
      if (c != nullptr) (void)ncclCommDestroy(c);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
  ncclComm_t of(Group g) const {
    return g == Group::world ? world : g == Group::spatial ? spatial : sample;
  }
};

// Completed when the event recorded after the operation has passed; an asynchronous NCCL error
// of its communicator is an Error here.
class NcclState final : public Request::State {
 public:
  NcclState(std::shared_ptr<const NcclGroups> groups, ncclComm_t comm, cudaEvent_t done)
      : groups_(std::move(groups)), comm_(comm), done_(done) {}
  ~NcclState() override {
    if (done_ != nullptr) (void)cudaEventDestroy(done_);
  }
  bool test() override {
    ncclResult_t async = ncclSuccess;
    TESSERA_CHECK_NCCL(ncclCommGetAsyncError(comm_, &async));
    if (async != ncclSuccess && async != ncclInProgress)
      throw Error(std::string("NCCL: an operation failed: ") + ncclGetErrorString(async));
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return false;
    TESSERA_CHECK_CUDA(e);
    return true;
  }
  std::vector<int> missing_peers() override { return {}; }  // NCCL cannot say
  // The buffers are the caller's (the halo exchange keeps an abandoned exchange's); the event
  // may go.
  bool release() noexcept override { return true; }

 private:
  std::shared_ptr<const NcclGroups> groups_;  // kept alive while in flight
  ncclComm_t comm_;
  cudaEvent_t done_ = nullptr;
};

ncclDataType_t nccl_type(bool is_double) {
  return is_double ? ncclFloat64 : ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

class NcclComm final : public DeviceComm {
 public:
  explicit NcclComm(std::unique_ptr<Comm> host) : DeviceComm(std::move(host)) {
    auto groups = std::make_shared<NcclGroups>();
    const Comm& h = this->host();
    // Rank 0's id to every rank, through MPI.
    ncclUniqueId id{};
    std::string bytes(sizeof(id), '\0');
    if (h.rank() == 0) {
      TESSERA_CHECK_NCCL(ncclGetUniqueId(&id));
      std::memcpy(bytes.data(), &id, sizeof(id));
    }
    broadcast(h, bytes, 0, Group::world);
    TESSERA_CHECK(bytes.size() == sizeof(id), "NCCL's communicator id arrived truncated");
    std::memcpy(&id, bytes.data(), sizeof(id));
    TESSERA_CHECK_NCCL(ncclCommInitRank(&groups->world, h.size(Group::world), id, h.rank()));
    const GridCoords& c = h.coords();
    TESSERA_CHECK_NCCL(ncclCommSplit(groups->world, static_cast<int>(c.n), h.rank(Group::spatial),
                                     &groups->spatial, nullptr));
    TESSERA_CHECK_NCCL(ncclCommSplit(groups->world, h.rank(Group::spatial), h.rank(Group::sample),
                                     &groups->sample, nullptr));
    TESSERA_CHECK_CUDA(cudaStreamCreateWithFlags(&groups->stream, cudaStreamNonBlocking));
    TESSERA_CHECK_CUDA(cudaEventCreateWithFlags(&groups->ready, cudaEventDisableTiming));
    groups_ = std::move(groups);
  }

 protected:
  bool on_device(const void* p) const override {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // a host pointer CUDA never saw
      return false;
    }
    return a.type == cudaMemoryTypeDevice;
  }

  Request device_allreduce(void* data, std::int64_t count, bool is_double, ReduceOp op, Group group,
                           std::string what) const override {
    const ncclComm_t comm = groups_->of(group);
    after_compute();
    TESSERA_CHECK_NCCL(ncclAllReduce(data, data, static_cast<std::size_t>(count),
                                     nccl_type(is_double), nccl_op(op), comm, groups_->stream));
    return finished(comm, std::move(what));
  }

  Request device_exchange(Group group, int, bool is_double, std::span<const DeviceMessage> recv,
                          std::span<const DeviceMessage> send, std::string what) const override {
    const ncclComm_t comm = groups_->of(group);
    const ncclDataType_t type = nccl_type(is_double);
    after_compute();
    TESSERA_CHECK_NCCL(ncclGroupStart());
    for (const DeviceMessage& m : recv)
      if (m.count > 0)
        TESSERA_CHECK_NCCL(ncclRecv(const_cast<void*>(m.data), static_cast<std::size_t>(m.count),
                                    type, m.peer, comm, groups_->stream));
    for (const DeviceMessage& m : send)
      if (m.count > 0)
        TESSERA_CHECK_NCCL(ncclSend(m.data, static_cast<std::size_t>(m.count), type, m.peer, comm,
                                    groups_->stream));
    TESSERA_CHECK_NCCL(ncclGroupEnd());
    return finished(comm, std::move(what));
  }

  std::unique_ptr<Comm> wrap(std::unique_ptr<Comm> host) const override {
    return std::make_unique<NcclComm>(std::move(host));
  }

 private:
  // The communication stream waits for the work enqueued on the compute stream so far.
  void after_compute() const {
    TESSERA_CHECK_CUDA(cudaEventRecord(groups_->ready, cuda::Context::get().stream()));
    TESSERA_CHECK_CUDA(cudaStreamWaitEvent(groups_->stream, groups_->ready, 0));
  }
  Request finished(ncclComm_t comm, std::string what) const {
    cudaEvent_t done = nullptr;
    TESSERA_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    TESSERA_CHECK_CUDA(cudaEventRecord(done, groups_->stream));
    return Request(std::make_unique<NcclState>(groups_, comm, done), std::move(what));
  }

  std::shared_ptr<const NcclGroups> groups_;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host) {
  // Agreed: every rank learns whether every rank has a GPU before any NCCL call.
  agree(
      host->host(),
      [] {
        TESSERA_CHECK(cuda_backend() != nullptr,
                      "the NCCL transport needs a usable GPU on every "
                      "rank (" +
                          gpu_info().error + "): run with --transport mpi or --device cpu");
      },
      "NCCL transport agreement");
  return std::make_unique<NcclComm>(std::move(host));
}

}  // namespace tessera
