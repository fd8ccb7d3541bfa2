#include "tessera/batch.hpp"

#include <algorithm>
#include <cmath>

#include "tessera/error.hpp"
#include "tessera/random.hpp"

namespace tessera {

BatchFileInfo inspect_batch_file(const h5::File& file, bool labels_required) {
  const std::string& path = file.path();
  TESSERA_CHECK(file.has("/images"),
                "'" + path + "' has no dataset '/images' (float32, float64 or uint8 [N, C, H, W])");
  const bool has_labels = file.has("/labels");
  TESSERA_CHECK(has_labels || !labels_required,
                "'" + path + "' has no dataset '/labels' (int32 or int64 [N, H, W])");
  const h5::DatasetInfo im = file.info("/images");
  TESSERA_CHECK(im.dims.size() == 4, "'" + path + "': /images has " +
                                         std::to_string(im.dims.size()) +
                                         " dimensions, expected 4 [N, C, H, W]");
  const bool uint8 = im.kind == h5::Kind::integer && im.bytes == 1 && !im.is_signed;
  TESSERA_CHECK(
      im.kind == h5::Kind::floating || uint8,
      "'" + path + "': /images holds " + im.type_name() + ", expected float32, float64 or uint8");
  for (auto d : im.dims)
    TESSERA_CHECK(d > 0, "'" + path + "': /images is empty");
  if (!has_labels) {
    file.check_written("/images", "sample");
    return {{im.dims[0], im.dims[1], im.dims[2], im.dims[3]}, {im.dims[0], 0, 0}, false};
  }
  const h5::DatasetInfo lb = file.info("/labels");
  TESSERA_CHECK(lb.dims.size() == 3 || lb.dims.size() == 1,
                "'" + path + "': /labels has " + std::to_string(lb.dims.size()) +
                    " dimensions, expected 3 [N, H, W] (per-pixel classes) or 1 [N] (one class "
                    "per image)");
  TESSERA_CHECK(lb.kind == h5::Kind::integer,
                "'" + path + "': /labels holds " + lb.type_name() + ", expected int32 or int64");
  TESSERA_CHECK(lb.dims[0] == im.dims[0], "'" + path + "': /labels has " +
                                              std::to_string(lb.dims[0]) + " samples, /images " +
                                              std::to_string(im.dims[0]));
  file.check_written("/images", "sample");
  file.check_written("/labels", "sample");
  // One class per image reads as an N x 1 x 1 map, the shape of a classifier's output.
  const std::array<std::int64_t, 3> labels =
      lb.dims.size() == 1 ? std::array<std::int64_t, 3>{lb.dims[0], 1, 1}
                          : std::array<std::int64_t, 3>{lb.dims[0], lb.dims[1], lb.dims[2]};
  return {{im.dims[0], im.dims[1], im.dims[2], im.dims[3]}, labels};
}

template <typename T>
Tensor<T> read_image_tile(const h5::File& file, const Distribution& d) {
  const Shape4 s = d.local_shape();
  const std::array<std::int64_t, 4> offset{d.samples().begin, 0, d.rows().begin, d.cols().begin};
  const std::array<std::int64_t, 4> count{s.n, s.c, s.h, s.w};
  const h5::DatasetInfo im = file.info("/images");
  Tensor<T> out(s);
  if (s.numel() == 0) return out;
  std::vector<T> values = file.read<T>("/images", offset, count);
  if (im.kind == h5::Kind::integer)
    for (T& v : values)
      v /= T(255);
  const auto bad =
      std::find_if(values.begin(), values.end(), [](T v) { return !std::isfinite(v); });
  TESSERA_CHECK(bad == values.end(),
                "'" + file.path() + "': /images holds " + std::to_string(*bad) + " in samples " +
                    to_string(d.samples()) + ", rows " + to_string(d.rows()) + ", columns " +
                    to_string(d.cols()) + " (every pixel must be finite)");
  std::copy(values.begin(), values.end(), out.data());
  return out;
}

Labels read_label_tile(const h5::File& file, const Distribution& d) {
  const std::array<std::int64_t, 3> offset{d.samples().begin, d.rows().begin, d.cols().begin};
  const std::array<std::int64_t, 3> count{d.samples().size(), d.rows().size(), d.cols().size()};
  const bool per_image = file.info("/labels").dims.size() == 1;
  std::vector<std::int64_t> wide =
      per_image ? file.read<std::int64_t>("/labels", std::span(offset).first(1),
                                          std::span(count).first(1))
                : file.read<std::int64_t>("/labels", offset, count);
  Labels out(wide.size());
  for (std::size_t k = 0; k < wide.size(); ++k) {
    TESSERA_CHECK(wide[k] >= 0 && wide[k] < d.global.c,
                  "'" + file.path() + "': /labels holds " + std::to_string(wide[k]) +
                      ", outside [0, " + std::to_string(d.global.c) + "): the model has " +
                      std::to_string(d.global.c) + " output channels");
    out[k] = static_cast<std::int32_t>(wide[k]);
  }
  return out;
}

template <typename T>
Tensor<T> random_image_tile(const Distribution& d, std::uint64_t seed) {
  const Shape4& g = d.global;
  const Range ns = d.samples(), hs = d.rows(), ws = d.cols();
  Tensor<T> out(d.local_shape());
  const std::uint64_t stream = hash_string("images");
  for (std::int64_t n = ns.begin; n < ns.end; ++n)
    for (std::int64_t c = 0; c < g.c; ++c)
      for (std::int64_t h = hs.begin; h < hs.end; ++h)
        for (std::int64_t w = ws.begin; w < ws.end; ++w) {
          const auto index = static_cast<std::uint64_t>(((n * g.c + c) * g.h + h) * g.w + w);
          out.at(n - ns.begin, c, h - hs.begin, w - ws.begin) =
              static_cast<T>(2 * uniform01(seed, stream, index) - 1);
        }
  return out;
}

Labels random_label_tile(const Distribution& d, std::uint64_t seed) {
  const Shape4& g = d.global;
  const Range ns = d.samples(), hs = d.rows(), ws = d.cols();
  Labels out;
  out.reserve(static_cast<std::size_t>(ns.size() * hs.size() * ws.size()));
  const std::uint64_t stream = hash_string("labels");
  for (std::int64_t n = ns.begin; n < ns.end; ++n)
    for (std::int64_t h = hs.begin; h < hs.end; ++h)
      for (std::int64_t w = ws.begin; w < ws.end; ++w) {
        const auto index = static_cast<std::uint64_t>((n * g.h + h) * g.w + w);
        out.push_back(static_cast<std::int32_t>(random_bits(seed, stream, index) %
                                                static_cast<std::uint64_t>(g.c)));
      }
  return out;
}

template <typename T>
void write_batch(h5::File& file, const std::string& group, const Tensor<T>& images,
                 std::span<const std::int32_t> labels, const Distribution& logits) {
  const Shape4& s = images.shape();
  const Shape4& g = logits.global;
  file.write<T>(group + "/images", images.span(), {s.n, s.c, s.h, s.w});
  file.write<std::int32_t>(group + "/labels", labels,
                           logits.replicated ? std::vector<std::int64_t>{g.n}
                                             : std::vector<std::int64_t>{g.n, g.h, g.w});
}

template Tensor<float> read_image_tile(const h5::File&, const Distribution&);
template Tensor<double> read_image_tile(const h5::File&, const Distribution&);
template Tensor<float> random_image_tile(const Distribution&, std::uint64_t);
template Tensor<double> random_image_tile(const Distribution&, std::uint64_t);
template void write_batch(h5::File&, const std::string&, const Tensor<float>&,
                          std::span<const std::int32_t>, const Distribution&);
template void write_batch(h5::File&, const std::string&, const Tensor<double>&,
                          std::span<const std::int32_t>, const Distribution&);

}  // namespace tessera
