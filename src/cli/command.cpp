#include "command.hpp"

#include <filesystem>
#include <fstream>
#include <iostream>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/model_spec.hpp"
#include "tessera/wait.hpp"

namespace tessera::cli {

po::options_description common_options() {
  po::options_description o("Common options");
  o.add_options()("help,h", "show this help and exit")(
      "config", po::value<std::string>(),
      "read options from this INI file (key = value; the command line wins)")(
      "wait", po::value<std::string>(),
      "how ranks wait for messages: spin, or sleep (polite polling for more ranks than "
      "cores); default: detected, or $TESSERA_WAIT");
  return o;
}

GridShape grid_or_default(const std::string& text, MPI_Comm world) {
  if (!text.empty()) return parse_grid(text);
  int size = 1;
  MPI_Comm_size(world, &size);
  return GridShape{1, 1, size};
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

bool is_root(MPI_Comm world) {
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  return rank == 0;
}

bool parse(const std::string& command, const std::string& summary,
           const po::options_description& options, const std::vector<std::string>& args,
           po::variables_map& vm, MPI_Comm world) {
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
        po::store(po::parse_config_file(in, options), vm);
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
  WaitPolicy policy = detect_wait_policy(world);
  if (vm.count("wait"))
    agree(world, [&] { policy = parse_wait_policy(vm["wait"].as<std::string>()); });
  set_wait_policy(policy);
  return true;
}

}  // namespace tessera::cli
