#include "check_model.hpp"

#include <gtest/gtest.h>

#include <optional>
#include <utility>

#include "mpi_test.hpp"
#include "tessera/batch.hpp"
#include "tessera/error.hpp"

namespace tessera::test {
template <typename T>
void check_model(const ModelSpec& spec, Shape4 input, const std::string& what,
                 const CheckOptions& options) {
  const double tol =
      options.tolerance > 0 ? options.tolerance : (std::is_same_v<T, double> ? 1e-10 : 1e-4);
  const Runtime& grid = options.grid != nullptr ? *options.grid : world_runtime();
  const Runtime& single = single_runtime();

  std::optional<Model<T>> sharded, reference;
  const GridShape g = grid.comm().shape();
  const std::int64_t smallest_h = options.smallest_h > 0 ? options.smallest_h : input.h;
  const std::int64_t smallest_w = options.smallest_w > 0 ? options.smallest_w : input.w;
  const bool expect_refusal = smallest_h < g.h || smallest_w < g.w;
  try {
    sharded.emplace(spec, grid, input);
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(expect_refusal) << what << ": refused on " << g.str()
                                << ", whose smallest image is " << smallest_h << "x" << smallest_w
                                << ": " << m;
    // A refusal names the layer and the tile it would leave empty.
    EXPECT_TRUE(contains(m, "layer '")) << what << ": " << m;
    EXPECT_TRUE(contains(m, "no rows") || contains(m, "no columns")) << what << ": " << m;
    EXPECT_NO_THROW(reference.emplace(spec, single, input))
        << what << ": one rank refuses it as well";
    return;
  }
  EXPECT_FALSE(expect_refusal) << what << ": expected grid " << g.str()
                               << " to refuse a model whose smallest image is " << smallest_h << "x"
                               << smallest_w << ", and it accepted";
  reference.emplace(spec, single, input);
  for (Model<T>* m : {&*sharded, &*reference}) {
    m->init_params(options.seed);
    m->state() = {.mode = options.mode, .seed = options.seed, .step = 3};
  }

  DistTensor<T> x(sharded->input_distribution()), rx(reference->input_distribution());
  x.local = random_image_tile<T>(x.dist, options.seed);
  rx.local = random_image_tile<T>(rx.dist, options.seed);
  const auto labels = random_label_tile(sharded->output_distribution(), options.seed);
  const auto rlabels = random_label_tile(reference->output_distribution(), options.seed);

  StepResult<T> s = forward_backward(*sharded, x, labels);
  StepResult<T> r = forward_backward(*reference, rx, rlabels);

  EXPECT_NEAR(s.loss, r.loss, tol * std::abs(r.loss)) << what;
  if (!options.zero_input_grad) {
    EXPECT_GT(max_abs(std::as_const(r.input_grad.local).span()), 0.0)
        << what << ": the reference input gradient is zero";
  }
  // The sharded model may compute on a device (TESSERA_KERNELS=emulated): read in host copies.
  EXPECT_LE(tile_error(s.output, r.output.local), tol) << what << ": output";
  EXPECT_LE(tile_error(s.input_grad, r.input_grad.local), tol) << what << ": input gradient";
  auto ps = sharded->params(), pr = reference->params();
  EXPECT_EQ(ps.size(), pr.size()) << what;
  for (std::size_t k = 0; k < std::min(ps.size(), pr.size()); ++k) {
    const Tensor<T> mine = to_host(ps[k].param->grad), theirs = to_host(pr[k].param->grad);
    EXPECT_LE(rel_error(mine.span(), theirs.span()), tol)
        << what << ": gradient of " << ps[k].key();
  }
  auto bs = sharded->buffers(), br = reference->buffers();
  EXPECT_EQ(bs.size(), br.size()) << what;
  for (std::size_t k = 0; k < std::min(bs.size(), br.size()); ++k) {
    const Tensor<T> mine = to_host(bs[k].buffer->value), theirs = to_host(br[k].buffer->value);
    EXPECT_LE(rel_error(mine.span(), theirs.span()), tol) << what << ": buffer " << bs[k].key();
  }
}

template void check_model<float>(const ModelSpec&, Shape4, const std::string&, const CheckOptions&);
template void check_model<double>(const ModelSpec&, Shape4, const std::string&,
                                  const CheckOptions&);

}  // namespace tessera::test
