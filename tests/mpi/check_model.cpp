#include "check_model.hpp"

#include <gtest/gtest.h>

#include <optional>
#include <utility>

#include "mpi_test.hpp"
#include "tessera/batch.hpp"
#include "tessera/error.hpp"

namespace tessera::test {
namespace {

template <typename T>
double span_error(std::span<const T> a, std::span<const T> b) {
  return rel_error<T, T>(a, b, max_abs<T>(b));
}

}  // namespace

template <typename T>
void check_model(const ModelSpec& spec, Shape4 input, const std::string& what,
                 const CheckOptions& options) {
  const double tol =
      options.tolerance > 0 ? options.tolerance : (std::is_same_v<T, double> ? 1e-10 : 1e-4);
  const ProcessGrid& grid = world_grid();
  ProcessGrid single(MPI_COMM_SELF, GridShape{1, 1, 1});

  std::optional<Model<T>> sharded, reference;
  try {
    sharded.emplace(spec, grid, input);
  } catch (const Error& e) {
    // Only shapes this grid cannot split (or no grid can) may be refused, and the reason must
    // name the layer.
    EXPECT_NE(std::string(e.what()).find("layer '"), std::string::npos) << what << ": " << e.what();
    try {
      reference.emplace(spec, single, input);
    } catch (const Error&) {
      return;  // impossible on one rank too
    }
    const GridShape g = grid.shape();
    EXPECT_TRUE(std::string(e.what()).find("no rows") != std::string::npos ||
                std::string(e.what()).find("no columns") != std::string::npos)
        << what << ": refused on " << g.str() << " only: " << e.what();
    return;
  }
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

  StepResult<T> s = forward_backward(*sharded, x, labels, grid);
  StepResult<T> r = forward_backward(*reference, rx, rlabels, single);

  EXPECT_NEAR(s.loss, r.loss, tol * std::abs(r.loss)) << what;
  if (!options.zero_input_grad) {
    EXPECT_GT(max_abs<T>(std::as_const(r.input_grad.local).span()), 0.0)
        << what << ": the reference input gradient is zero";
  }
  EXPECT_LE(tile_error(s.output, r.output.local), tol) << what << ": output";
  EXPECT_LE(tile_error(s.input_grad, r.input_grad.local), tol) << what << ": input gradient";
  auto ps = sharded->params(), pr = reference->params();
  EXPECT_EQ(ps.size(), pr.size()) << what;
  for (std::size_t k = 0; k < std::min(ps.size(), pr.size()); ++k)
    EXPECT_LE(span_error<T>(std::as_const(ps[k].param->grad).span(),
                            std::as_const(pr[k].param->grad).span()),
              tol)
        << what << ": gradient of " << ps[k].key();
  auto bs = sharded->buffers(), br = reference->buffers();
  EXPECT_EQ(bs.size(), br.size()) << what;
  for (std::size_t k = 0; k < std::min(bs.size(), br.size()); ++k)
    EXPECT_LE(span_error<T>(std::as_const(bs[k].buffer->value).span(),
                            std::as_const(br[k].buffer->value).span()),
              tol)
        << what << ": buffer " << bs[k].key();
}

template void check_model<float>(const ModelSpec&, Shape4, const std::string&, const CheckOptions&);
template void check_model<double>(const ModelSpec&, Shape4, const std::string&,
                                  const CheckOptions&);

}  // namespace tessera::test
