#include "command.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <type_traits>

#include "tessera/collectives.hpp"
#include "tessera/device_comm.hpp"
#include "tessera/engine/model_spec.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/placement.hpp"

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

po::options_description device_options() {
  po::options_description o("Device options");
  o.add_options()(
      "device", po::value<std::string>()->default_value("cpu"),
      "where the kernels compute: cpu; cuda (one GPU per rank, chosen from its place among the "
      "ranks of its node); auto (cuda when every rank has a usable GPU, else cpu)")(
      "share-devices", po::bool_switch(),
      "with cuda: let the ranks of a node share its GPUs when there are more ranks than GPUs "
      "(round robin); without it that is an error")(
      "allow-tf32", po::bool_switch(),
      "with cuda: float32 convolutions may use TF32 tensor cores (10-bit mantissa products); off "
      "by default, so float32 is checked against float32")(
      "deterministic", po::bool_switch(),
      "with cuda: only algorithms that give bitwise the same result every run")(
      "precision", po::value<std::string>()->default_value("float32"),
      "float32, or bf16: convolutions with bfloat16 products and float32 sums on CPUs that have "
      "bfloat16 instructions (AVX512_BF16: oneDNN's kernels, and the narrow AVX-512 "
      "convolutions in bfloat16 dot products, TESSERA_NARROW_BF16=0 keeps those float32; AMX: "
      "Tessera's for stride-1 convolutions between 16-channel blocks and for the wider narrow "
      "ones, TESSERA_AMX=0 leaves them to oneDNN); activations, weights, gradients, 1x1 heads "
      "to fewer than 16 channels and oneDNN's convolutions reading fewer than 16 channels in "
      "float32; with --dtype float32 and --device cpu")(
      "transport", po::value<std::string>()->default_value("auto"),
      "how halos and gradient sums travel between GPUs: nccl (device buffers, one GPU per "
      "rank); mpi (staged through host memory; works everywhere, also with --share-devices); "
      "auto (nccl with cuda, several ranks and no shared GPU, else mpi)");
  return o;
}

namespace {

// --device: cpu keeps the environment's kernels; cuda places each rank on a GPU, sets the CUDA
// options and prints where every rank runs; auto is cuda when every rank has a usable GPU.
// Collective over `world` (errors are agreed).
void apply_device(const po::variables_map& vm, const Comm& world, RuntimeOptions& runtime) {
  std::string device = vm["device"].as<std::string>();
  agree(world, [&] {
    TESSERA_CHECK(device == "cpu" || device == "cuda" || device == "auto",
                  "bad --device '" + device + "': expected cpu, cuda or auto");
  });
  if (device == "auto") {
    const GpuInfo gpu = gpu_info();
    const bool everywhere = allreduce_min(world, gpu.devices > 0 ? 1 : 0) == 1;
    device = everywhere ? "cuda" : "cpu";
    if (is_root(world) && !everywhere)
      std::cout << "device: cpu (--device auto: "
                << (gpu.devices > 0 ? std::string("a rank has no usable GPU") : gpu.error) << ")\n";
  }
  const std::string transport = vm["transport"].as<std::string>();
  agree(world, [&] {
    TESSERA_CHECK(transport == "auto" || transport == "mpi" || transport == "nccl",
                  "bad --transport '" + transport + "': expected auto, mpi or nccl");
    TESSERA_CHECK(transport != "nccl" || device == "cuda",
                  "--transport nccl moves GPU memory: it needs --device cuda (or auto on ranks "
                  "that all have a GPU)");
  });
  if (transport == "mpi") runtime.transport = Transport::mpi;
  const std::string precision = vm["precision"].as<std::string>();
  agree(world, [&] {
    TESSERA_CHECK(precision == "float32" || precision == "bf16",
                  "bad --precision '" + precision + "': expected float32 or bf16");
    if (precision != "bf16") return;
    TESSERA_CHECK(device == "cpu" && runtime.kernels == KernelBackend::onednn,
                  "--precision bf16 runs oneDNN's bfloat16 convolutions: it needs --device cpu and "
                  "the onednn kernels (the default where built; TESSERA_KERNELS=" +
                      std::string(to_string(runtime.kernels)) + " here)");
    TESSERA_CHECK(bf16_supported(),
                  "--precision bf16: this CPU has no bfloat16 instructions oneDNN uses "
                  "(AVX512_BF16 or AMX); run --precision float32");
  });
  runtime.bf16 = precision == "bf16";
  if (device != "cuda") return;
  const Placement placement = place_on_device(world, vm["share-devices"].as<bool>());
  set_cuda_options({.deterministic = vm["deterministic"].as<bool>(),
                    .allow_tf32 = vm["allow-tf32"].as<bool>(),
                    .measure_algorithms = runtime.cudnn_measure,
                    .log_algorithms = runtime.cudnn_log});
  agree(world, [&] { (void)backend_of(KernelBackend::cuda); });  // names why it is unusable
  runtime.kernels = KernelBackend::cuda;
  // NCCL refuses two ranks on one GPU.
  const bool shared = allreduce_max(world, placement.shared ? 1 : 0) == 1;
  agree(world, [&] {
    TESSERA_CHECK(transport != "nccl" || !shared,
                  "--transport nccl: NCCL refuses two ranks on one GPU, and ranks share GPUs "
                  "here (--share-devices): use --transport mpi");
  });
  if (transport == "nccl" || (transport == "auto" && !shared && world.size(Group::world) > 1))
    runtime.transport = Transport::nccl;
  const std::vector<std::string> lines = placement_report(world, placement);
  if (is_root(world)) {
    std::cout << "transport: " << to_string(runtime.transport) << "\n";
    std::cout << "devices:\n";
    for (const std::string& line : lines)
      std::cout << "  " << line << "\n";
  }
}

// The value of a parsed option as text; empty for an option given without one (a switch such as
// --help). Local; an option type this does not know is an Error, caught by the CLI tests.
template <typename T, typename... More>
std::string any_text(const boost::any& v, const std::string& name) {
  if (const T* p = boost::any_cast<T>(&v)) {
    if constexpr (std::is_same_v<T, std::string>) {
      return *p;
    } else if constexpr (std::is_same_v<T, bool>) {
      return *p ? "true" : "false";
    } else if constexpr (std::is_floating_point_v<T>) {
      std::ostringstream o;
      o << std::setprecision(17) << *p;
      return o.str();
    } else {
      return std::to_string(*p);
    }
  }
  if constexpr (sizeof...(More) > 0) {
    return any_text<More...>(v, name);
  } else {
    throw Error("option --" + name + " has a type the start-up agreement cannot compare");
  }
}

// Every option of `options` (its value, or its default, or "" when neither) and the environment's
// settings that change what or how the ranks compute, as fields for agree_on_fields. --config is
// left out: its file's values are in `vm` already. Local.
std::vector<Field> option_fields(const po::options_description& options,
                                 const po::variables_map& vm, const RuntimeOptions& runtime) {
  std::vector<Field> fields;
  for (const auto& option : options.options()) {
    const std::string& name = option->long_name();
    if (name == "config") continue;
    std::string value;
    if (vm.count(name)) {
      value = any_text<std::string, bool, int, unsigned, long, unsigned long, long long,
                       unsigned long long, double, float>(vm[name].value(), name);
      if (value.empty()) value = "(given)";
    }
    fields.push_back({"--" + name, value});
  }
  fields.push_back({"TESSERA_KERNELS", to_string(runtime.kernels)});
  fields.push_back({"TESSERA_TRANSPORT", to_string(runtime.transport)});
  fields.push_back({"TESSERA_OVERLAP", runtime.overlap ? "1" : "0"});
  fields.push_back({"TESSERA_FUSE", runtime.fuse ? "1" : "0"});
  fields.push_back({"TESSERA_WINDOWLESS", runtime.windowless ? "1" : "0"});
  fields.push_back({"TESSERA_WINOGRAD", runtime.winograd ? "1" : "0"});
  fields.push_back({"TESSERA_NARROW_CONV", runtime.narrow_conv ? "1" : "0"});
  fields.push_back({"TESSERA_BN_ALONE", runtime.batchnorm_alone ? "1" : "0"});
  return fields;
}

// Boost.Program_options (1.74) makes an error's message by substituting each %name% field of its
// template with the name's value until none is left, so a value holding such a field itself
// (`--steps %value%`, found by tests/fuzz/fuzz_ini) looped forever, the message growing until
// memory ran out. The message is made from a copy whose values hold a stand-in for '%'.
// ambiguous_option formats its own (its tokens are prefixes of option names: no '%').
constexpr char kStandIn = '\x1f';

std::string message(const po::error& e) {
  const auto* named = dynamic_cast<const po::error_with_option_name*>(&e);
  if (named == nullptr || dynamic_cast<const po::ambiguous_option*>(&e) != nullptr) return e.what();
  struct Escaped : po::error_with_option_name {
    explicit Escaped(const po::error_with_option_name& from) : po::error_with_option_name(from) {
      for (auto& [name, value] : m_substitutions)
        std::replace(value.begin(), value.end(), '%', kStandIn);
      for (auto& [name, fallback] : m_substitution_defaults)
        std::replace(fallback.second.begin(), fallback.second.end(), '%', kStandIn);
    }
  };
  std::string text = Escaped(*named).what();
  std::replace(text.begin(), text.end(), kStandIn, '%');
  return text;
}

}  // namespace

GridShape grid_or_default(const std::string& text, const GridShape& fallback) {
  return text.empty() ? fallback : parse_grid(text);
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

std::unique_ptr<Comm> command_world(const Comm& world, const RuntimeOptions& runtime) {
  return world.make_grid(world.shape(),
                         {runtime.wait.value_or(world.wait_settings().policy), runtime.timeout});
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
      for (const po::option& o : parsed.options) {
        if (o.position_key >= 0)
          throw Error("tessera " + command + ": unexpected argument '" +
                      (o.value.empty() ? o.string_key : o.value.front()) +
                      "': options take the form --name value (see tessera " + command + " --help)");
        // `--json ""` (an unset shell variable) was taken as no --json, `--grid ""` as the
        // default grid, `--sgemm ""` as on.
        if (!o.value.empty() && o.value.front().empty())
          throw Error("tessera " + command + ": --" + o.string_key +
                      " was given an empty value (see tessera " + command + " --help)");
      }
      po::store(parsed, vm);
      if (vm.count("config")) {
        const std::string path = vm["config"].as<std::string>();
        TESSERA_CHECK(std::filesystem::exists(path), "config file '" + path + "' does not exist");
        TESSERA_CHECK(!std::filesystem::is_directory(path),
                      "config file '" + path + "' is a directory");
        std::ifstream in(path);
        TESSERA_CHECK(in.good(), "cannot read the config file '" + path + "'");
        // The common options too: `timeout = 1200` and `wait = sleep` belong in a job's file.
        po::store(po::parse_config_file(in, all), vm);
      }
      po::notify(vm);
    } catch (const po::error& e) {
      throw Error("tessera " + command + ": " + message(e) + " (see tessera " + command +
                  " --help)");
    }
  });
  // Before anything else the ranks do together: the same command with other options on some
  // ranks (another --dtype, --grid or --model; --help on one) would wait in other collectives.
  agree_on_fields(world, option_fields(all, vm, runtime));
  if (vm.count("help")) {
    if (is_root(world))
      // plan (and datagen, whose rank 0 writes alone) run as one process: no mpiexec to show.
      std::cout << "Usage: " << (command == "plan" || command == "datagen" ? "" : "mpiexec -n P ")
                << "tessera " << command << " [options]\n\n"
                << summary << "\n\n"
                << all << std::endl;
    return false;
  }
  agree(world, [&] {
    if (vm.count("wait")) runtime.wait = parse_wait_policy(vm["wait"].as<std::string>());
    if (vm.count("timeout")) runtime.timeout = check_timeout(vm["timeout"].as<double>());
  });
  // The commands that compute (device_options(): --transport has a default); plan's --device
  // only says what to estimate.
  if (vm.count("device") && vm.count("transport")) apply_device(vm, world, runtime);
  return true;
}

}  // namespace tessera::cli
