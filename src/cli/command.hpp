// Shared pieces of the `tessera` subcommands. Each gets from main the job's ranks as a 1x1xP
// grid (`world`) and the runtime options of the environment, which its command line overrides.
#pragma once

#include <boost/program_options.hpp>

#include <memory>
#include <string>
#include <vector>

#include "tessera/comm.hpp"
#include "tessera/runtime.hpp"
#include "tessera/tensor.hpp"

namespace tessera::cli {

namespace po = boost::program_options;

// What every subcommand accepts: --help, --config FILE (INI; the command line wins), --wait,
// --timeout.
po::options_description common_options();

// --device cpu|cuda|auto, --share-devices, --allow-tf32, --deterministic: for the commands that
// compute (train, gradcheck, bench), which add them to their options.
po::options_description device_options();

// Parses `args` (the words after the subcommand) against `options` plus the common ones, reading
// --config when given; --wait and --timeout go into `runtime`; with device_options() among
// `options`, --device cuda places each rank on its GPU (an agreed error when that fails, or in a
// build without CUDA), sets the kernels to cuda and prints where every rank runs on rank 0. Returns
// false when --help was asked for (the help has been printed on rank 0). Collective over `world`
// (errors are agreed on every rank).
bool parse(const std::string& command, const std::string& summary,
           const po::options_description& options, const std::vector<std::string>& args,
           po::variables_map& vm, const Comm& world, RuntimeOptions& runtime);

// The job's ranks as `world` holds them (a 1x1xP grid), waiting as the command's options say
// (--wait, --timeout in `runtime`, after parse()). main's world exists before any command reads
// its options, so it waits as the environment says (TESSERA_TIMEOUT, else 600 s): a command that
// agreed, read its data or printed its progress through it waited that long for a stopped rank
// instead of --timeout (test train_watchdog_rank_stopped_early). Collective over `world`.
std::unique_ptr<Comm> command_world(const Comm& world, const RuntimeOptions& runtime);

inline bool is_root(const Comm& world) {
  return world.rank() == 0;
}

// The grid given as NxHxW, or `fallback` (default_grid of the job, placement.hpp) when `text` is
// empty. Local; a bad string throws (call it inside agree()).
GridShape grid_or_default(const std::string& text, const GridShape& fallback);
// --grid's help: what the default is.
inline constexpr const char* kGridHelp =
    "process grid NxHxW: N data-parallel groups of HxW spatial ranks; default: 1xPx1 for P ranks "
    "on one node (bands of rows), and on K nodes with P/K ranks each Kx(P/K)x1 (halos within a "
    "node)";

// "CxHxW": channels, height and width, three positive integers; returned with n = 0. Local; a bad
// string throws (call it inside agree()).
Shape4 parse_image(const std::string& text);

// "model JSON file or built-in name (...)", the built-in names listed. Local.
std::string model_option_help();

int gradcheck_command(const std::vector<std::string>& args, const Comm& world,
                      RuntimeOptions runtime);
// Collective over `world` (errors are agreed): every rank computes the same plan, rank 0 prints
// it. Needs no mpiexec: one process plans a grid of any size.
int plan_command(const std::vector<std::string>& args, const Comm& world, RuntimeOptions runtime);
// Collective over `world`: trains; rank 0 prints progress.
int train_command(const std::vector<std::string>& args, const Comm& world, RuntimeOptions runtime);
// Collective over `world`: times training steps; rank 0 prints the table.
int bench_command(const std::vector<std::string>& args, const Comm& world, RuntimeOptions runtime);
// Collective over `world`: predicts over a file of images with a trained model, each rank writing
// its tile of the outputs; rank 0 prints progress.
int predict_command(const std::vector<std::string>& args, const Comm& world,
                    RuntimeOptions runtime);
// Collective over `world`: the loss, accuracy and IoU of a trained model over labelled images.
int evaluate_command(const std::vector<std::string>& args, const Comm& world,
                     RuntimeOptions runtime);
// Collective over `world` (errors are agreed): rank 0 writes the synthetic dataset file, the
// other ranks wait for its outcome, without a deadline (the write takes as long as the file).
int datagen_command(const std::vector<std::string>& args, const Comm& world,
                    RuntimeOptions runtime);

}  // namespace tessera::cli
