#include "tessera/gather.hpp"

#include "tessera/error.hpp"

namespace tessera {
namespace {

// Gathers each rank's tile of `planes_per_sample` planes onto rank 0 and places it with `put`.
template <typename T, typename Put>
void gather_tiles(std::span<const T> mine, const Distribution& d, std::int64_t planes,
                  const Comm& comm, Put&& put) {
  constexpr int kTag = 7001;
  const std::string what = "gather of a tensor to rank 0";
  if (comm.rank() != 0) {
    const Message<const T> send{0, mine.data(), std::ssize(mine)};
    Request r = comm.start_exchange(Group::world, kTag, std::span<const Message<T>>(),
                                    std::span<const Message<const T>>(&send, 1), what);
    comm.wait(r);
    return;
  }
  const int ranks = comm.shape().size();
  std::vector<std::vector<T>> tiles(static_cast<std::size_t>(ranks));
  std::vector<Message<T>> recv;
  for (int r = 1; r < ranks; ++r) {
    const Distribution theirs = d.at(comm.coords_of(r));
    const Shape4 s = theirs.local_shape();
    tiles[r].resize(static_cast<std::size_t>(s.n * planes * s.h * s.w));
    recv.push_back({r, tiles[r].data(), std::ssize(tiles[r])});
  }
  tiles[0].assign(mine.begin(), mine.end());
  Request q = comm.start_exchange(Group::world, kTag, std::span<const Message<T>>(recv),
                                  std::span<const Message<const T>>(), what);
  comm.wait(q);
  for (int r = 0; r < ranks; ++r)
    put(d.at(comm.coords_of(r)), tiles[r]);
}

}  // namespace

template <typename T>
Tensor<T> gather_to_root(const DistTensor<T>& x, const Comm& grid) {
  const Shape4& g = x.dist.global;
  Tensor<T> whole(grid.rank() == 0 ? g : Shape4{});
  const Tensor<T> mine = to_host(x.local);
  gather_tiles<T>(mine.span(), x.dist, g.c, grid,
                  [&](const Distribution& d, const std::vector<T>& t) {
                    const Range ns = d.samples(), hs = d.rows(), ws = d.cols();
                    std::size_t k = 0;
                    for (std::int64_t n = ns.begin; n < ns.end; ++n)
                      for (std::int64_t c = 0; c < g.c; ++c)
                        for (std::int64_t h = hs.begin; h < hs.end; ++h)
                          for (std::int64_t w = ws.begin; w < ws.end; ++w)
                            whole.at(n, c, h, w) = t[k++];
                  });
  return whole;
}

template Tensor<float> gather_to_root(const DistTensor<float>&, const Comm&);
template Tensor<double> gather_to_root(const DistTensor<double>&, const Comm&);

}  // namespace tessera
