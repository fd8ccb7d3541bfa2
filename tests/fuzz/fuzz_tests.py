#!/usr/bin/python3
"""Fuzzing: builds the libFuzzer targets of tests/fuzz/ with clang (AddressSanitizer and
UndefinedBehaviorSanitizer), replays valid seed files and the saved regressions, then fuzzes each
target for a bounded time.

Usage: fuzz_tests.py BUILD_DIR [TARGET ...]

BUILD_DIR is the normal build: its `tessera` writes the seed files (datasets, checkpoints). The
fuzz build lives beside it in BUILD_DIR-fuzz (TESSERA_FUZZ_BUILD overrides), configured with
-Dfuzz=true -Dcuda=disabled -Donednn=disabled and clang >= 15 (clang 14, Debian 12's default,
lacks std::source_location; Debian 12 has clang-16 and libclang-rt-16-dev, which holds libFuzzer).

In order, stopping at the first failure:
  1. configure and build BUILD_DIR-fuzz (ninja -j TESSERA_FUZZ_JOBS, default 2);
  2. write the seed corpus to BUILD_DIR-fuzz/seeds/<target>/: model JSON (the built-in models,
     the README's example, tests/fuzz/seeds/model_json/), INI files (tests/fuzz/seeds/ini/),
     datasets from `tessera datagen` (and an h5py variant), checkpoints from `tessera train
     --checkpoint-dir`, parameter files made from a checkpoint with h5py;
  3. replay every seed, each of which must be read without an Error
     (TESSERA_FUZZ_SEEDS_VALID=1: a seed that drifted from what its target expects fails here);
  4. replay every file of tests/fuzz/regressions/<target>/ (inputs that once failed);
  5. fuzz each target for TESSERA_FUZZ_SECONDS seconds (default 30) from its seeds, in
     libFuzzer's fork mode (a crash, a timeout or an out-of-memory ends one child process, the
     next goes on), then run each input it kept alone to see whose code failed.
A crash, a sanitizer report, a leak, an exception other than tessera::Error, a timeout (3 s for
one input) or an allocation beyond 2 GiB is a finding. One in Tessera (or the libraries compiled
into it) fails the test: the input is kept under BUILD_DIR-fuzz/findings/<target>/ and its path
and report printed; once the bug is fixed, copy it into tests/fuzz/regressions/<target>/. One
inside Debian's HDF5 library (1.10.8: damaged files crash it or make it loop, in its global heap,
object headers and chunk I/O) is only listed: Tessera cannot fix it. A timeout whose report has no
stack is run again with 60 s, and the report of how that run ends decides.

Exit status: 0 pass, 1 fail, 77 skip (no clang >= 15 with libFuzzer, no llvm-symbolizer, no h5py).
Environment: TESSERA_FUZZ_SECONDS, TESSERA_FUZZ_JOBS, TESSERA_FUZZ_BUILD, TESSERA_FUZZ_CXX (the
clang++ to use).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SKIP = 77
REPO = Path(__file__).resolve().parents[2]
FUZZ_DIR = REPO / "tests" / "fuzz"
TARGETS = ["fuzz_model_json", "fuzz_ini", "fuzz_params", "fuzz_checkpoint", "fuzz_dataset"]
# libFuzzer dictionaries (tests/fuzz/*.dict): words the mutations insert.
DICTIONARIES = {"fuzz_model_json": "model_json.dict", "fuzz_ini": "ini.dict",
                "fuzz_params": "hdf5.dict", "fuzz_checkpoint": "hdf5.dict",
                "fuzz_dataset": "hdf5.dict"}
PARAMS_FORMAT = "tessera-params-1"
# libFuzzer's limits for one input: a reader that takes longer or allocates more is a finding.
INPUT_TIMEOUT_S = 3
SYMBOLIZER = None  # set by main: find_symbolizer()
RSS_LIMIT_MB = 2048
# A timeout without a stack is run once more with this much time (fuzz()).
SLOW_REPLAY_TIMEOUT_S = 60
# Inputs of one target's fuzzing run alone to see whose code failed (a few seconds each).
MAX_REPLAYS = 40


class Failure(Exception):
    pass


class Skip(Exception):
    pass


def log(*args):
    print("fuzz:", *args, flush=True)


def run(argv, what, cwd=None, env=None, timeout=600):
    """Runs argv; its output is returned, or shown in the Failure when it exits non-zero."""
    try:
        r = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, timeout=timeout,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace")
    except subprocess.TimeoutExpired:
        raise Failure(f"{what}: still running after {timeout} s: {' '.join(map(str, argv))}")
    if r.returncode != 0:
        raise Failure(f"{what} failed (exit {r.returncode}): {' '.join(map(str, argv))}\n"
                      f"----- output -----\n{r.stdout[-6000:]}----- end -----")
    return r.stdout


# ----- the compiler -----

def clang_version(cxx):
    try:
        out = subprocess.run([cxx, "-dumpversion"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.match(r"(\d+)", out.strip())
    return int(m.group(1)) if m else None


def find_symbolizer():
    """llvm-symbolizer: reports must name the functions of the fuzz targets (their runtime's
    frames are told from Tessera's by name)."""
    for name in ("llvm-symbolizer-16", "llvm-symbolizer"):
        path = shutil.which(name)
        if path:
            return path
    raise Skip("no llvm-symbolizer (Debian: apt-get install llvm; scripts/setup.sh installs it)")


def find_clang():
    """(clang, clang++) of version >= 15 that links a libFuzzer program with ASan and UBSan."""
    wanted = [os.environ["TESSERA_FUZZ_CXX"]] if os.environ.get("TESSERA_FUZZ_CXX") else \
        ["clang++-16", "clang++-17", "clang++-18", "clang++-15", "clang++"]
    tried = []
    for cxx in wanted:
        path = shutil.which(cxx)
        if path is None:
            continue
        version = clang_version(path)
        if version is None or version < 15:
            tried.append(f"{cxx} (version {version}: std::source_location needs clang >= 15)")
            continue
        cc = shutil.which(re.sub(r"clang\+\+", "clang", Path(path).name))
        if cc is None:
            tried.append(f"{cxx} (no matching clang)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "t.cpp"
            src.write_text("#include <cstddef>\n#include <cstdint>\n#include <source_location>\n"
                           "extern \"C\" int LLVMFuzzerTestOneInput(const std::uint8_t*, "
                           "std::size_t) { return 0; }\n")
            r = subprocess.run([path, "-std=c++20", "-fsanitize=fuzzer,address,undefined",
                                str(src), "-o", str(Path(tmp) / "t")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            tried.append(f"{cxx} (cannot link a libFuzzer program: {r.stdout.strip()[:300]})")
            continue
        return cc, path
    raise Skip("no clang >= 15 with libFuzzer (Debian 12: apt-get install clang-16 "
               "libclang-rt-16-dev; scripts/setup.sh installs them)" +
               (": tried " + "; ".join(tried) if tried else ""))


# ----- the fuzz build -----

def configured_compiler(build):
    log_file = build / "meson-logs" / "meson-log.txt"
    if not log_file.exists():
        return None
    m = re.search(r"C\+\+ compiler for the host machine: (\S+)", log_file.read_text(errors="replace"))
    return m.group(1) if m else None


def build_targets(build, cc, cxx, jobs):
    env = dict(os.environ, CC=cc, CXX=cxx)
    options = ["-Dfuzz=true", "-Dcuda=disabled", "-Donednn=disabled", "-Dtests=false",
               "--buildtype=plain"]
    if not (build / "build.ninja").exists():
        run(["meson", "setup", build, REPO] + options, "meson setup of the fuzz build", env=env)
    elif configured_compiler(build) not in (cxx, Path(cxx).name):
        run(["meson", "setup", "--wipe", build, REPO] + options, "meson setup --wipe", env=env)
    started = time.monotonic()
    run(["ninja", "-C", build, "-j", str(jobs)] + [f"tests/fuzz/{t}" for t in TARGETS],
        "building the fuzz targets", env=env, timeout=1500)
    log(f"fuzz targets built in {build} ({time.monotonic() - started:.0f} s, {Path(cxx).name})")


# ----- the seed corpus -----

def model_json_seeds(out):
    # The built-in models, as model_spec.cpp holds them; the README's example.
    spec = (REPO / "src" / "engine" / "model_spec.cpp").read_text()
    models = re.findall(r'constexpr const char\* (\w+) = R"\((.*?)\)";', spec, re.S)
    if len(models) < 4:
        raise Failure("found fewer than 4 built-in models in src/engine/model_spec.cpp: the "
                      "pattern of fuzz_tests.py needs updating")
    for name, text in models:
        (out / f"builtin_{name}.json").write_text(text)
    readme = (REPO / "README.md").read_text()
    for k, text in enumerate(re.findall(r"```json\n(.*?)```", readme, re.S)):
        (out / f"readme_{k}.json").write_text(text)
    shutil.copy(FUZZ_DIR / "params_model.json", out / "params_model.json")
    for f in sorted((FUZZ_DIR / "seeds" / "model_json").iterdir()):
        shutil.copy(f, out / f.name)


def mpiexec_prefix():
    mpiexec = shutil.which("mpiexec")
    return [mpiexec, "-n", "1"] if mpiexec else []


def hdf5_seeds(tessera, seeds, work):
    """Datasets, checkpoints and parameter files written by `tessera` (and h5py for what it has
    no command for), into seeds/fuzz_dataset, fuzz_checkpoint and fuzz_params."""
    import h5py
    import numpy as np

    env = dict(os.environ, MPIEXEC_TIMEOUT="120", OMP_NUM_THREADS="1",
               TESSERA_KERNELS="reference")
    prefix = mpiexec_prefix()
    tessera_run = lambda *args, what: run(prefix + [tessera] + list(args), what, cwd=work,
                                          env=env, timeout=180)
    datasets = seeds / "fuzz_dataset"
    small = ["--samples", "2", "--channels", "2", "--height", "9", "--width", "7", "--chunk", "4x4"]
    tessera_run("datagen", "--output", datasets / "segmentation_f32.h5", *small,
                what="tessera datagen")
    tessera_run("datagen", "--output", datasets / "segmentation_u8.h5", *small, "--dtype", "uint8",
                "--classes", "3", what="tessera datagen")
    tessera_run("datagen", "--output", datasets / "classification_u8.h5", *small, "--dtype",
                "uint8", "--task", "classification", what="tessera datagen")
    # What h5py users write: contiguous (not chunked) float64 images and int64 labels.
    with h5py.File(datasets / "contiguous_f64.h5", "w") as f:
        rng = np.random.default_rng(1)
        f["images"] = rng.random((2, 1, 5, 6))
        f["labels"] = rng.integers(0, 2, (2, 5, 6)).astype(np.int64)

    # The run fuzz_model.hpp expects (seed_run): params_model.json, seed 7, batch 2, adam,
    # float32, 4 training samples of 2x8x8.
    train = work / "train.h5"
    tessera_run("datagen", "--output", train, "--samples", "4", "--channels", "2", "--height", "8",
                "--width", "8", "--task", "classification", "--classes", "3",
                what="tessera datagen (training set)")
    ck = work / "checkpoints"
    tessera_run("train", "--model", FUZZ_DIR / "params_model.json", "--data", train, "--seed", "7",
                "--batch", "2", "--optimizer", "adam", "--dtype", "float32", "--steps", "3",
                "--checkpoint-dir", ck, "--checkpoint-every", "2", "--progress", "plain",
                what="tessera train (seed checkpoints)")
    written = sorted(ck.glob("checkpoint-*.h5"))
    if not written:
        raise Failure(f"tessera train wrote no checkpoint into {ck}")
    for f in written:
        shutil.copy(f, seeds / "fuzz_checkpoint" / f.name)
    # Parameter files as a PyTorch export writes them (README "Files"): /params and /buffers of
    # the last checkpoint and the format attribute, as Tessera writes strings (fixed length) and
    # as h5py does by default (variable length), the latter without the optional buffers. The
    # second is only replayed: fuzzed, nearly every input that reaches its attribute fails inside
    # HDF5's global heap (H5HG_read), HDF5's bugs and not Tessera's.
    with h5py.File(written[-1], "r") as src:
        for path, fixed in ((seeds / "fuzz_params" / "params.h5", True),
                            (seeds / "replay-only" / "fuzz_params" / "params_vlen.h5", False)):
            with h5py.File(path, "w") as dst:
                dst.attrs["format"] = np.bytes_(PARAMS_FORMAT) if fixed else PARAMS_FORMAT
                src.copy("params", dst)
                if fixed:
                    src.copy("buffers", dst)


def write_seeds(tessera, fuzz_build):
    seeds = fuzz_build / "seeds"
    shutil.rmtree(seeds, ignore_errors=True)
    for t in TARGETS:
        (seeds / t).mkdir(parents=True)
        (seeds / "replay-only" / t).mkdir(parents=True)
    model_json_seeds(seeds / "fuzz_model_json")
    for f in sorted((FUZZ_DIR / "seeds" / "ini").iterdir()):
        shutil.copy(f, seeds / "fuzz_ini" / f.name)
    with tempfile.TemporaryDirectory(prefix="tessera-fuzz-seeds-") as tmp:
        hdf5_seeds(tessera, seeds, Path(tmp))
    for t in TARGETS:
        files = list((seeds / t).iterdir())
        log(f"{t}: {len(files)} seeds, {sum(f.stat().st_size for f in files)} bytes")
    return seeds


# ----- running the targets -----

def fuzz_env(full_stacks=False):
    # UCX (MPICH's transport) would catch the sanitizers' signals with its own handler.
    env = dict(os.environ, OMP_NUM_THREADS="1", UCX_HANDLE_ERRORS="none")
    # Leaks are findings too. An allocation beyond what ASan can serve (1 TiB) fails as malloc
    # would (NULL, std::bad_alloc); one beyond RSS_LIMIT_MB is a finding of libFuzzer's.
    env["ASAN_OPTIONS"] = "detect_leaks=1:allocator_may_return_null=1" + (
        # Whole stacks of allocations, through libraries built without frame pointers (slower:
        # for one input run alone).
        ":fast_unwind_on_malloc=0:malloc_context_size=40" if full_stacks else "")
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    env["LSAN_OPTIONS"] = f"suppressions={FUZZ_DIR / 'lsan.supp'}:print_suppressions=0"
    env["ASAN_SYMBOLIZER_PATH"] = SYMBOLIZER
    env.pop("TESSERA_FUZZ_SEEDS_VALID", None)
    return env


def run_input(binary, f, seeds_valid=False, timeout_s=INPUT_TIMEOUT_S, full_stacks=True):
    """Runs one file through the target (libFuzzer with a file argument)."""
    env = fuzz_env(full_stacks=full_stacks)
    if seeds_valid:
        env["TESSERA_FUZZ_SEEDS_VALID"] = "1"
    # -malloc_limit_mb given (its default is rss_limit_mb): only then does libFuzzer print the stack
    # of a single allocation beyond the limit, so culprit() can tell whose allocation it was (a
    # damaged file's sizes make HDF5's own H5Fopen ask for 16 GiB). The RSS limit above it, or
    # libFuzzer's RSS watcher kills the process while the stack is being printed.
    return subprocess.run([str(binary), f"-timeout={timeout_s}",
                           f"-rss_limit_mb={2 * RSS_LIMIT_MB}", f"-malloc_limit_mb={RSS_LIMIT_MB}",
                           "-error_exitcode=1", str(f)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", timeout=120)


def replay(binary, files, what, seeds_valid):
    for f in files:
        r = run_input(binary, f, seeds_valid)
        if r.returncode != 0:
            raise Failure(f"{binary.name}: {what} {f} failed (exit {r.returncode})\n"
                          f"----- output -----\n{r.stdout[-6000:]}----- end -----")
    if files:
        log(f"{binary.name}: {len(files)} {what}(s) read as expected")


# Frames of a report that say nothing about whose code failed: the sanitizers' and libFuzzer's
# own, the C and C++ runtimes (abort, raise, operator new, __cxa_throw, std::terminate).
RUNTIME_FUNCTION = re.compile(r"(__sanitizer|__asan|__lsan|__ubsan|__interceptor|fuzzer::|"
                              r"__cxa_|__gnu_cxx::__verbose|std::terminate|operator new|"
                              r"(malloc|calloc|realloc|free|raise|abort)\b|__pthread_kill)")
# A module, or for a symbolized frame of glibc its source directory.
RUNTIME_MODULE = re.compile(r"/(libc|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so|"
                            r"\s(sysdeps|nptl|stdlib|signal|string|csu|libio)/")
# A C function of the fuzz target itself without a source line: the sanitizers' interceptors
# (strdup, memcpy...), as Tessera's code is compiled with line tables and lives in namespaces.
RUNTIME_INTERCEPTOR = re.compile(r"^[A-Za-z_]\w* \((?![^)]*\.so)[^)]*\+0x[0-9a-f]+\)")
# "#3 0x7f.. in function location" or "#3 0x7f..  (module+offset)"
FRAME = re.compile(r"^\s*#\d+ 0x[0-9a-f]+ +(?:in )?(.*)$")


def culprit(report):
    """Whose code failed in a sanitizer's or libFuzzer's report: (in_hdf5, where). The first frame
    of its first stack that is neither runtime nor libFuzzer decides: in libhdf5 (where: HDF5's
    first named function and the frame that called into HDF5) or not (where: that frame)."""
    start = re.search(r"ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:", report)
    frames = []
    for line in report[start.start() if start else len(report):].splitlines():
        m = FRAME.match(line)
        if m:
            frames.append(m.group(1))
        elif frames:
            break  # the end of the first stack
    frames = [f for f in frames if not (RUNTIME_FUNCTION.match(f) or RUNTIME_MODULE.search(f) or
                                        RUNTIME_INTERCEPTOR.match(f))]
    if not frames:
        return False, "(no stack)"
    if "/libhdf5" not in frames[0]:
        return False, frames[0]
    named = next((f for f in frames if "/libhdf5" in f and not f.startswith("(")), frames[0])
    caller = next((f for f in frames if "/libhdf5" not in f), "?")
    return True, f"{named.split(' ')[0]} in libhdf5, called from {caller}"


def fuzz(binary, seeds, findings, seconds):
    """libFuzzer for `seconds` (fork mode: a child process fuzzes; after a crash, a timeout or an
    out-of-memory the next one goes on), new inputs into a fresh corpus beside the seeds. Each
    input libFuzzer kept is then run alone: one that fails inside Debian's HDF5 library (its
    stack from the fault up to the first other frame lies in libhdf5) is HDF5's bug, which
    Tessera cannot fix, and only reported; any other is a failure."""
    shutil.rmtree(findings, ignore_errors=True)
    findings.mkdir(parents=True)
    dictionary = FUZZ_DIR / DICTIONARIES[binary.name]
    # Mutations may grow an input by a quarter of the largest seed (HDF5 files are 10-70 KB).
    max_len = max(4096, max(f.stat().st_size for f in seeds.iterdir()) * 5 // 4)
    with tempfile.TemporaryDirectory(prefix=f"tessera-{binary.name}-") as corpus:
        argv = [str(binary), "-fork=1", "-ignore_crashes=1", "-ignore_timeouts=1",
                "-ignore_ooms=1", f"-max_total_time={seconds}", f"-timeout={INPUT_TIMEOUT_S}",
                f"-rss_limit_mb={RSS_LIMIT_MB}", f"-max_len={max_len}",
                f"-artifact_prefix={findings}/", f"-dict={dictionary}", corpus, str(seeds)]
        started = time.monotonic()
        r = subprocess.run(argv, env=fuzz_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace",
                           timeout=seconds + 300)
        elapsed = time.monotonic() - started
        corpus_size = len(os.listdir(corpus))
    progress = re.findall(r"^#(\d+): cov: (\d+) ", r.stdout, re.M)
    executed, coverage = progress[-1] if progress else ("?", "?")
    found = sorted(findings.iterdir())
    if r.returncode != 0 and not found:
        raise Failure(f"{binary.name}: libFuzzer exited with {r.returncode} and kept no input\n"
                      f"----- output -----\n{r.stdout[-8000:]}----- end -----")
    in_hdf5 = []
    if len(found) > MAX_REPLAYS:
        log(f"{binary.name}: {len(found)} inputs kept, only the first {MAX_REPLAYS} run alone")
    for f in found[:MAX_REPLAYS]:
        replayed = run_input(binary, f)
        hdf5, where = culprit(replayed.stdout)
        if replayed.returncode != 0 and where == "(no stack)" and "libFuzzer: timeout" in \
                replayed.stdout:
            # libFuzzer's timeout report can come with an empty stack (seen with HDF5 looping over
            # millions of small allocations of a damaged checkpoint): given time, and the fast
            # unwinder (whole stacks of 40 million allocations take minutes), the input runs into
            # the memory limit or its own end, whose report says whose code it was in.
            replayed = run_input(binary, f, timeout_s=SLOW_REPLAY_TIMEOUT_S, full_stacks=False)
            hdf5, where = culprit(replayed.stdout)
        if replayed.returncode == 0:
            # A timeout or an out-of-memory of a loaded machine, or a failure that depends on
            # earlier inputs of the run (HDF5's state after a damaged file, say).
            log(f"{binary.name}: {f} does not fail when run alone")
        elif hdf5:
            in_hdf5.append(f"  {f}: {where}")
        else:
            raise Failure(
                f"{binary.name} found a bug after {elapsed:.0f} s: {f}\n"
                f"replay: {binary} {f}\nonce fixed, copy the input into "
                f"{FUZZ_DIR / 'regressions' / binary.name}/\n"
                f"----- its report -----\n{replayed.stdout[-8000:]}----- end -----")
    log(f"{binary.name}: {executed} inputs in {elapsed:.0f} s, coverage {coverage}, "
        f"{corpus_size} new inputs; no bug in Tessera" +
        (f"; {len(in_hdf5)} failure(s) inside libhdf5 (Debian's HDF5, not Tessera):\n" +
         "\n".join(in_hdf5) if in_hdf5 else ""))
    if not any(findings.iterdir()):
        findings.rmdir()


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 1
    build = Path(sys.argv[1]).resolve()
    targets = sys.argv[2:] or TARGETS
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"unknown targets {unknown}; known: {TARGETS}")
        return 1
    fuzz_build = Path(os.environ.get("TESSERA_FUZZ_BUILD") or f"{build}-fuzz").resolve()
    seconds = int(os.environ.get("TESSERA_FUZZ_SECONDS", "30"))
    jobs = int(os.environ.get("TESSERA_FUZZ_JOBS", "2"))
    tessera = build / "tessera"
    started = time.monotonic()
    try:
        try:
            import h5py  # noqa: F401  (the parameter-file seeds)
        except ImportError as e:
            raise Skip(f"no h5py ({e}): Debian's python3-h5py")
        if not tessera.exists():
            raise Failure(f"{tessera} does not exist: build {build} first")
        cc, cxx = find_clang()
        global SYMBOLIZER
        SYMBOLIZER = find_symbolizer()
        build_targets(fuzz_build, cc, cxx, jobs)
        seeds = write_seeds(tessera, fuzz_build)
        for t in targets:
            binary = fuzz_build / "tests" / "fuzz" / t
            replay(binary, sorted((seeds / t).iterdir()) +
                   sorted((seeds / "replay-only" / t).iterdir()), "seed", seeds_valid=True)
            regressions = FUZZ_DIR / "regressions" / t
            replay(binary, sorted(regressions.iterdir()) if regressions.is_dir() else [],
                   "regression input", seeds_valid=False)
        for t in targets:
            fuzz(fuzz_build / "tests" / "fuzz" / t, seeds / t, fuzz_build / "findings" / t,
                 seconds)
    except Skip as e:
        print(f"SKIP: {e}")
        return SKIP
    except Failure as e:
        print(f"FAIL: {e}")
        return 1
    log(f"PASS: {len(targets)} targets, {seconds} s each, {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
