// The `tessera` command. Only this file decides how a process ends: agreed errors (every rank
// holds the same one) end normally with exit 1; any other error aborts the job, so no rank is
// left waiting in a collective.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "command.hpp"
#include "tessera/collectives.hpp"
#include "tessera/drivers/driver.hpp"
#include "tessera/error.hpp"
#include "tessera/gpu.hpp"
#include "tessera/io/hdf5.hpp"
#include "tessera/kernels/backend.hpp"
#include "tessera/mpi_comm.hpp"
#include "tessera/runtime.hpp"
#include "tessera_config.h"

#if TESSERA_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace {

constexpr const char* kUsage =
    "Usage: mpiexec -n P tessera <command> [options]\n"
    "\n"
    "Trains convolutional networks on images tiled over a grid of MPI ranks, exactly.\n"
    "\n"
    "Commands:\n"
    "  train       train a model with its images tiled over the grid\n"
    "  gradcheck   compare sharded and single-rank gradients of a model on a grid\n"
    "  plan        tiles, halo widths, bytes per step and memory per rank (one process)\n"
    "  predict     run a trained model over images of any size, writing every rank's tile\n"
    "  evaluate    loss, accuracy and IoU per class of a trained model over labelled images\n"
    "  datagen     write a synthetic segmentation or classification dataset (HDF5)\n"
    "  bench       time training steps per layer: compute, halo, waiting, allreduce, GFLOP/s\n"
    "\n"
    "Run 'tessera <command> --help' for a command's options; 'tessera --version' for the build.\n";

void print_version(const tessera::RuntimeOptions& runtime) {
  std::cout << "tessera " << TESSERA_VERSION << "\n";
  int major = 0, minor = 0;
  MPI_Get_version(&major, &minor);
  char library[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(library, &length);
  std::string mpi(library, static_cast<std::size_t>(length));
  std::cout << "  MPI " << major << "." << minor << ": " << mpi.substr(0, mpi.find('\n')) << "\n";
  unsigned h5major = 0, h5minor = 0, h5release = 0;
  H5get_libversion(&h5major, &h5minor, &h5release);
  std::cout << "  HDF5 " << h5major << "." << h5minor << "." << h5release << "\n";
#if TESSERA_HAVE_ONEDNN
  const dnnl_version_t* v = dnnl_version();
  std::cout << "  oneDNN " << v->major << "." << v->minor << "." << v->patch << "\n";
#else
  std::cout << "  oneDNN: not built\n";
#endif
  const tessera::GpuInfo gpu = tessera::gpu_info();
  if (gpu.built) {
    std::cout << "  CUDA runtime " << gpu.runtime_version / 1000 << "."
              << gpu.runtime_version % 1000 / 10 << ": " << gpu.devices << " device(s)"
              << (gpu.error.empty() ? "" : " (" + gpu.error + ")")
              << "; cuDNN convolutions and a CUDA kernel for every layer built (--device cuda); "
                 "verified on one H100 (README \"GPU\")\n";
  } else {
    std::cout << "  CUDA: not built\n";
  }
  std::cout << "  kernels: " << tessera::backend_of(runtime.kernels).description() << "\n";
  std::cout << "  host memory: " << tessera::to_string(runtime.host_memory)
            << (runtime.host_memory == tessera::HostMemory::pool
                    ? " (freed pages kept and moved into the next large block; "
                      "TESSERA_HOST_MEMORY=system for malloc)"
                    : " (malloc and free)")
            << "\n";
}

// Prints `line` and ends the whole job. One write, then a moment for the launcher to forward it:
// MPI_Abort tears down the job, output still in flight included. Alone, the process ends at once
// (exit status 1) without MPI_Finalize or exit handlers: a rank that failed this way may hold
// files HDF5 would close there, which after a failed parallel write crashes (tessera predict on a
// full disk).
void end_job(const std::string& line, int ranks) {
  const std::string text = line + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::cout.flush();
  std::fflush(nullptr);
  if (ranks <= 1) std::_Exit(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  MPI_Abort(MPI_COMM_WORLD, 1);
}

}  // namespace

int main(int argc, char** argv) {
  // The environment's defaults, read once (runtime.hpp); a bad value is reported below, once the
  // ranks can agree on it.
  tessera::RuntimeOptions runtime;
  std::string bad_environment;
  try {
    runtime = tessera::runtime_options_from_environment();
  } catch (const tessera::Error& e) {
    bad_environment = e.what();
  }
  // Every step allocates and frees the same large activations; the host pool keeps their pages
  // for the next step (allocator.hpp, README "Memory").
  tessera::set_host_memory(runtime.host_memory);
  tessera::set_kernel_threads(runtime.threads);
  // The commands that stop cleanly on SIGUSR1 and SIGTERM take them from the start: one that came
  // before their driver installed the handler (Slurm's time-limit warning while the job starts,
  // forwarded by its batch script) ended the rank with the signal's default action.
  const std::string first = argc > 1 ? argv[1] : "";
  std::string early_error;
  if (first == "train" || first == "predict" || first == "evaluate" || first == "datagen") {
    try {
      tessera::install_stop_signals();
    } catch (const tessera::Error& e) {
      early_error = e.what();
    }
  }
  MPI_Init(&argc, &argv);
  // MPI failures come back as error codes, which TESSERA_CHECK_MPI turns into Errors.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  tessera::h5::quiet();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<std::string> args(argv + 1, argv + argc);
  int rc = 0;
  try {
    const std::string command = args.empty() ? "" : args.front();
    const std::vector<std::string> rest(args.begin() + (args.empty() ? 0 : 1), args.end());
    // The job's ranks as a 1x1xP grid, for the commands' agreements before they build their grid.
    const tessera::WaitPolicy detected = tessera::MpiComm::detect_wait_policy(MPI_COMM_WORLD);
    const tessera::MpiComm world(MPI_COMM_WORLD, {1, 1, size},
                                 {runtime.wait.value_or(detected), runtime.timeout});
    // Before any command's collective work: ranks that run different commands (an MPMD launch,
    // `mpiexec -n 1 tessera train : -n 1 tessera gradcheck`) or builds would otherwise wait on
    // each other in different collectives. Each command then agrees on its options (parse()).
    tessera::agree_on_fields(world, {{"the command", command},
                                     {"the tessera build", std::string(TESSERA_VERSION) + " " +
                                                               __DATE__ + " " + __TIME__}});
    // A bad environment variable stops every rank with one message before any command runs.
    tessera::agree(world, [&] {
      if (!bad_environment.empty()) throw tessera::Error(bad_environment);
      if (!early_error.empty()) throw tessera::Error(early_error);
    });
    if (command == "--version" || command == "version") {
      if (rank == 0) print_version(runtime);
    } else if (command.empty() || command == "--help" || command == "-h" || command == "help") {
      if (rank == 0) std::cout << kUsage;
      rc = command.empty() ? 2 : 0;
    } else if (command == "gradcheck") {
      rc = tessera::cli::gradcheck_command(rest, world, runtime);
    } else if (command == "train") {
      rc = tessera::cli::train_command(rest, world, runtime);
    } else if (command == "plan") {
      rc = tessera::cli::plan_command(rest, world, runtime);
    } else if (command == "bench") {
      rc = tessera::cli::bench_command(rest, world, runtime);
    } else if (command == "predict") {
      rc = tessera::cli::predict_command(rest, world, runtime);
    } else if (command == "evaluate") {
      rc = tessera::cli::evaluate_command(rest, world, runtime);
    } else if (command == "datagen") {
      rc = tessera::cli::datagen_command(rest, world, runtime);
    } else {
      if (rank == 0)
        std::cerr << "tessera: error: unknown command '" << command << "'\n\n" << kUsage;
      rc = 2;
    }
  } catch (const tessera::Error& e) {
    if (e.agreed()) {
      if (rank == 0) std::cerr << "tessera: error: " << e.what() << "\n";
      rc = 1;
    } else {
      end_job(
          "tessera: error on rank " + std::to_string(rank) + " (" + e.where() + "): " + e.what(),
          size);
      rc = 1;
    }
  } catch (const std::exception& e) {
    end_job("tessera: internal error on rank " + std::to_string(rank) + ": " + e.what(), size);
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
