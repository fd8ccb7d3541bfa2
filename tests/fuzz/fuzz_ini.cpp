// libFuzzer target: the INI file of `--config` (README.md "Training"), read by cli::parse
// (src/cli/command.cpp) on one rank against the common and device options and options of every
// value type the commands declare, then the values through the parsers the commands apply to them
// (grid, image, optimizer, schedule, synthetic task). Seeds: tests/fuzz/seeds/ini/.
#include <cstdint>
#include <memory>
#include <string>

#include "../../src/cli/command.hpp"
#include "fuzz_common.hpp"
#include "tessera/engine/optimizer.hpp"
#include "tessera/synthetic.hpp"

namespace po = boost::program_options;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tessera::fuzz::init_mpi_and_hdf5();
  (void)tessera::fuzz::world();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = tessera::fuzz::write_input(data, size, ".ini");
  return tessera::fuzz::run_one([&] {
    // The value types of the commands' options (src/cli/*_command.cpp), with their defaults.
    std::string model = "unet-small", grid, image = "3x64x64", optimizer = "adam",
                schedule = "constant", task = "segmentation";
    std::int64_t steps = 0, batch = 8;
    int ranks = 1;
    double lr = 1e-3, fraction = 0;
    std::uint64_t seed = 1;
    bool resume = false;
    po::options_description d("Fuzzed options");
    d.add_options()("model", po::value(&model)->default_value(model), "")(
        "grid", po::value(&grid), "")("image", po::value(&image)->default_value(image), "")(
        "optimizer", po::value(&optimizer)->default_value(optimizer), "")(
        "lr-schedule", po::value(&schedule)->default_value(schedule), "")(
        "task", po::value(&task)->default_value(task), "")(
        "steps", po::value(&steps)->default_value(steps), "")(
        "batch", po::value(&batch)->default_value(batch), "")(
        "ranks", po::value(&ranks)->default_value(ranks), "")(
        "lr", po::value(&lr)->default_value(lr), "")(
        "val-fraction", po::value(&fraction)->default_value(fraction), "")(
        "seed", po::value(&seed)->default_value(seed), "")("resume", po::bool_switch(&resume), "");
    d.add(tessera::cli::device_options());
    po::variables_map vm;
    tessera::RuntimeOptions runtime;
    if (!tessera::cli::parse("fuzz", "", d, {"--config", path}, vm, tessera::fuzz::world(),
                             runtime))
      return;
    (void)tessera::cli::grid_or_default(grid, {1, 1, 1});
    (void)tessera::cli::parse_image(image);
    (void)tessera::parse_optimizer(optimizer);
    (void)tessera::parse_schedule(schedule);
    (void)tessera::parse_synthetic_task(task);
  });
}
