// libFuzzer target: a model's JSON text (README.md "Models (JSON)") through parse_model, and a
// model it accepts through make_plan (every layer set up for a small image on a 1x2x2 grid:
// shapes, windows and halo sizes), as `tessera plan --model FILE` does. Seeds: the built-in models
// and tests/fuzz/params_model.json (fuzz_tests.py).
#include <cstdint>
#include <string>

#include "fuzz_common.hpp"
#include "tessera/drivers/plan.hpp"
#include "tessera/engine/model_spec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  return tessera::fuzz::run_one([&] {
    const tessera::ModelSpec spec = tessera::parse_model(text, "fuzz.json");
    tessera::PlanOptions options;
    options.grid = {1, 2, 2};
    options.input = {2, spec.input_channels, 16, 12};
    (void)tessera::make_plan(spec, options);
  });
}
