#include "tessera/device_comm.hpp"

#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/error.hpp"

namespace tessera {

const char* to_string(Transport t) {
  switch (t) {
    case Transport::mpi:
      return "mpi";
    case Transport::nccl:
      return "nccl";
    case Transport::emulated:
      return "emulated";
  }
  return "?";
}

Transport parse_transport(const std::string& text) {
  if (text == "mpi") return Transport::mpi;
  if (text == "nccl") return Transport::nccl;
  if (text == "emulated") return Transport::emulated;
  throw Error("unknown transport '" + text + "': expected mpi, nccl or emulated");
}

DeviceComm::DeviceComm(std::unique_ptr<Comm> host)
    : Comm(host->shape(), host->rank(), host->wait_settings()), host_(std::move(host)) {}

DeviceComm::~DeviceComm() = default;

template <typename T>
Request DeviceComm::allreduce(std::span<T> data, ReduceOp op, Group group, std::string what) const {
  if (data.empty() || !on_device(data.data()))
    return host_->start_allreduce(data, op, group, std::move(what));
  return device_allreduce(data.data(), std::ssize(data), std::is_same_v<T, double>, op, group,
                          std::move(what));
}

template <typename T>
Request DeviceComm::exchange(Group group, int tag, std::span<const Message<T>> recv,
                             std::span<const Message<const T>> send, std::string what) const {
  // Every buffer of one exchange lies in one memory: the halo exchange's are all staging
  // buffers, or all host ones.
  std::vector<DeviceMessage> in, out;
  int device = 0, host = 0;
  for (const Message<T>& m : recv) {
    if (m.count > 0) ++(on_device(m.data) ? device : host);
    in.push_back({m.peer, m.data, m.count});
  }
  for (const Message<const T>& m : send) {
    if (m.count > 0) ++(on_device(m.data) ? device : host);
    out.push_back({m.peer, m.data, m.count});
  }
  TESSERA_CHECK(device == 0 || host == 0, what + ": " + std::to_string(device) +
                                              " messages in device memory and " +
                                              std::to_string(host) + " in host memory");
  if (device == 0) return host_->start_exchange(group, tag, recv, send, std::move(what));
  return device_exchange(group, tag, std::is_same_v<T, double>, in, out, std::move(what));
}

Request DeviceComm::start_allreduce(std::span<float> data, ReduceOp op, Group group,
                                    std::string what) const {
  return allreduce(data, op, group, std::move(what));
}
Request DeviceComm::start_allreduce(std::span<double> data, ReduceOp op, Group group,
                                    std::string what) const {
  return allreduce(data, op, group, std::move(what));
}
Request DeviceComm::start_allreduce(std::span<long long> data, ReduceOp op, Group group,
                                    std::string what) const {
  return host_->start_allreduce(data, op, group, std::move(what));
}
Request DeviceComm::start_allreduce(std::span<int> data, ReduceOp op, Group group,
                                    std::string what) const {
  return host_->start_allreduce(data, op, group, std::move(what));
}
Request DeviceComm::start_broadcast(std::span<char> data, int root, Group group,
                                    std::string what) const {
  return host_->start_broadcast(data, root, group, std::move(what));
}
Request DeviceComm::start_broadcast(std::span<long long> data, int root, Group group,
                                    std::string what) const {
  return host_->start_broadcast(data, root, group, std::move(what));
}
Request DeviceComm::start_allgather(const long long& mine, std::span<long long> all, Group group,
                                    std::string what) const {
  return host_->start_allgather(mine, all, group, std::move(what));
}
Request DeviceComm::start_exchange(Group group, int tag, std::span<const Message<float>> recv,
                                   std::span<const Message<const float>> send,
                                   std::string what) const {
  return exchange(group, tag, recv, send, std::move(what));
}
Request DeviceComm::start_exchange(Group group, int tag, std::span<const Message<double>> recv,
                                   std::span<const Message<const double>> send,
                                   std::string what) const {
  return exchange(group, tag, recv, send, std::move(what));
}

std::unique_ptr<Comm> DeviceComm::make_grid(GridShape grid, WaitSettings wait) const {
  return wrap(host_->make_grid(grid, wait));
}
std::unique_ptr<Comm> DeviceComm::make_single() const {
  return host_->make_single();
}
void DeviceComm::answer_watchdog() const {
  answer_watchdog_of(*host_);
}
std::vector<int> DeviceComm::silent_ranks(double grace) const {
  return silent_ranks_of(*host_, grace);
}

namespace {

// Emulated device memory is host memory: MPI moves it as a device-aware transport would move
// device memory, so the engine's direct path (no host staging) runs without a GPU.
class EmulatedDeviceComm final : public DeviceComm {
 public:
  explicit EmulatedDeviceComm(std::unique_ptr<Comm> host) : DeviceComm(std::move(host)) {}

 protected:
  bool on_device(const void*) const override { return false; }  // all of it is MPI's to move
  Request device_allreduce(void*, std::int64_t, bool, ReduceOp, Group, std::string) const override {
    throw Error("the emulated transport has no device buffers");
  }
  Request device_exchange(Group, int, bool, std::span<const DeviceMessage>,
                          std::span<const DeviceMessage>, std::string) const override {
    throw Error("the emulated transport has no device buffers");
  }
  std::unique_ptr<Comm> wrap(std::unique_ptr<Comm> host) const override {
    return std::make_unique<EmulatedDeviceComm>(std::move(host));
  }
};

}  // namespace

std::unique_ptr<Comm> with_transport(std::unique_ptr<Comm> host, Transport transport) {
  switch (transport) {
    case Transport::mpi:
      return host;
    case Transport::emulated:
      return std::make_unique<EmulatedDeviceComm>(std::move(host));
    case Transport::nccl:
      return make_nccl_comm(std::move(host));
  }
  return host;
}

}  // namespace tessera
