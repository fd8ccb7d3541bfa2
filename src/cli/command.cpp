#include "command.hpp"

#include <filesystem>
#include <fstream>
#include <iostream>

#include "tessera/collectives.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"

namespace tessera::cli {

po::options_description common_options() {
  po::options_description o("Common options");
  o.add_options()("help,h", "show this help and exit")(
      "config", po::value<std::string>(),
      "read options from this INI file (key = value; the command line wins)")(
      "wait", po::value<std::string>(),
      "how ranks wait for messages: spin, or sleep (polite polling for more ranks than "
      "cores); default: detected, or $TESSERA_WAIT")(
      "timeout", po::value<double>(),
      "seconds any one wait for other ranks may take before the job ends with a message naming "
      "the operation and the ranks that did not answer (default 600, or $TESSERA_TIMEOUT)");
  return o;
}

GridShape grid_or_default(const std::string& text, const Comm& world) {
  if (!text.empty()) return parse_grid(text);
  return GridShape{1, 1, world.size(Group::world)};
}

Shape4 parse_image(const std::string& text) {
  const std::vector<std::int64_t> v = parse_sizes(
      text, 3,
      "bad image '" + text +
          "': expected CxHxW, three positive integers (channels x height x width), e.g. "
          "3x1024x1024");
  return {0, v[0], v[1], v[2]};
}

std::string model_option_help() {
  std::string models;
  for (const auto& n : builtin_model_names())
    models += (models.empty() ? "" : ", ") + n;
  return "model JSON file or built-in name (" + models + ")";
}

bool parse(const std::string& command, const std::string& summary,
           const po::options_description& options, const std::vector<std::string>& args,
           po::variables_map& vm, const Comm& world, RuntimeOptions& runtime) {
  po::options_description all;
  all.add(options).add(common_options());
  agree(world, [&] {
    try {
      const po::parsed_options parsed = po::command_line_parser(args).options(all).run();
      // Without this, boost silently drops words that are not options ("gradcheck m.json").
      for (const po::option& o : parsed.options)
        if (o.position_key >= 0)
          throw Error("tessera " + command + ": unexpected argument '" +
                      (o.value.empty() ? o.string_key : o.value.front()) +
                      "': options take the form --name value (see tessera " + command + " --help)");
      po::store(parsed, vm);
      if (vm.count("config")) {
        const std::string path = vm["config"].as<std::string>();
        TESSERA_CHECK(std::filesystem::exists(path), "config file '" + path + "' does not exist");
        std::ifstream in(path);
        // The common options too: `timeout = 1200` and `wait = sleep` belong in a job's file.
        po::store(po::parse_config_file(in, all), vm);
      }
      po::notify(vm);
    } catch (const po::error& e) {
      throw Error("tessera " + command + ": " + e.what() + " (see tessera " + command + " --help)");
    }
  });
  if (vm.count("help")) {
    if (is_root(world))
      std::cout << "Usage: mpiexec -n P tessera " << command << " [options]\n\n"
                << summary << "\n\n"
                << all << std::endl;
    return false;
  }
  agree(world, [&] {
    if (vm.count("wait")) runtime.wait = parse_wait_policy(vm["wait"].as<std::string>());
    if (vm.count("timeout")) runtime.timeout = check_timeout(vm["timeout"].as<double>());
  });
  return true;
}

}  // namespace tessera::cli
