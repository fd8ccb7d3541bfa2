// Transports that move device memory: a Comm whose halo exchanges and float/double allreduces
// also take buffers in device memory, so the halo exchange and the gradient buckets hand it their
// device buffers instead of staging them through the host. Host buffers (losses, batch-norm
// sums, metrics, the watchdog) still go through the MPI Comm it wraps. Point-to-point exchanges on
// a device transport complete in the order they are started, on every rank: the engine starts
// them in layer order everywhere, and MPI tags are not needed to keep them apart.
#pragma once

#include <memory>
#include <string>

#include "tessera/allocator.hpp"
#include "tessera/comm.hpp"

namespace tessera {

// mpi: host buffers only (device memory is staged through host copies; works everywhere, also
// with several ranks on one GPU). nccl: NCCL for device buffers (one GPU per rank).
// emulated: device buffers (of the emulated device, which is host memory) handed to MPI as a
// device-aware transport would take them: the direct path checked without a GPU (tests).
enum class Transport { mpi, nccl, emulated };
const char* to_string(Transport t);
// "mpi" | "nccl" | "emulated"; throws an Error otherwise. Local.
Transport parse_transport(const std::string& text);

// A Comm over `host`'s grid that takes device buffers where host is given host ones. Every
// operation on host buffers, the grids it makes and the watchdog are `host`'s.
class DeviceComm : public Comm {
 public:
  ~DeviceComm() override;

  bool reaches(MemorySpace) const override { return true; }
  const Comm& host() const override { return *host_; }

  Request start_allreduce(std::span<float> data, ReduceOp op, Group group,
                          std::string what) const override;
  Request start_allreduce(std::span<double> data, ReduceOp op, Group group,
                          std::string what) const override;
  Request start_allreduce(std::span<long long> data, ReduceOp op, Group group,
                          std::string what) const override;
  Request start_allreduce(std::span<int> data, ReduceOp op, Group group,
                          std::string what) const override;
  Request start_broadcast(std::span<char> data, int root, Group group,
                          std::string what) const override;
  Request start_broadcast(std::span<long long> data, int root, Group group,
                          std::string what) const override;
  Request start_allgather(const long long& mine, std::span<long long> all, Group group,
                          std::string what) const override;
  Request start_exchange(Group group, int tag, std::span<const Message<float>> recv,
                         std::span<const Message<const float>> send,
                         std::string what) const override;
  Request start_exchange(Group group, int tag, std::span<const Message<double>> recv,
                         std::span<const Message<const double>> send,
                         std::string what) const override;
  // The host grid `grid` under the same transport. Collective over the world group.
  std::unique_ptr<Comm> make_grid(GridShape grid, WaitSettings wait) const override;
  // host's: one rank sends no messages, and its gradient sums need no device transport.
  std::unique_ptr<Comm> make_single() const override;

 protected:
  explicit DeviceComm(std::unique_ptr<Comm> host);

  // Whether `p` points into device memory (the transport's part). Local.
  virtual bool on_device(const void* p) const = 0;
  // The transport's operations on device buffers, as Comm's.
  virtual Request device_allreduce(void* data, std::int64_t count, bool is_double, ReduceOp op,
                                   Group group, std::string what) const = 0;
  struct DeviceMessage {
    int peer = 0;
    const void* data = nullptr;
    std::int64_t count = 0;
  };
  virtual Request device_exchange(Group group, int tag, bool is_double,
                                  std::span<const DeviceMessage> recv,
                                  std::span<const DeviceMessage> send, std::string what) const = 0;
  // The same transport over another host grid. Collective over the world group.
  virtual std::unique_ptr<Comm> wrap(std::unique_ptr<Comm> host) const = 0;

  void answer_watchdog() const override;
  std::vector<int> silent_ranks(double grace) const override;

 private:
  template <typename T>
  Request allreduce(std::span<T> data, ReduceOp op, Group group, std::string what) const;
  template <typename T>
  Request exchange(Group group, int tag, std::span<const Message<T>> recv,
                   std::span<const Message<const T>> send, std::string what) const;

  std::unique_ptr<Comm> host_;
};

// `host` under `transport`: itself for mpi, else a DeviceComm wrapping it. Collective over the
// world group (NCCL builds its communicators); throws an agreed Error when the transport cannot
// run here (nccl in a build without CUDA or without a usable GPU).
std::unique_ptr<Comm> with_transport(std::unique_ptr<Comm> host, Transport transport);

// The NCCL transport (kernels/cuda/nccl_comm.cpp): NCCL communicators for the world, spatial and
// sample groups, split from one world communicator whose id rank 0 broadcasts through `host`;
// its operations run on a stream of their own after the work already enqueued on the compute
// stream. Collective over the world group. Throws an Error in a build without CUDA.
std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host);

}  // namespace tessera
