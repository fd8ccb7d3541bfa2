#!/usr/bin/python3
"""No hang, no crash: nohang_tests.py BUILD_DIR SCENARIO (exit 0 pass, 1 fail, 77 skip).

Ranks that run different commands or options (an MPMD launch, `mpiexec -n 1 tessera train :
-n 1 tessera gradcheck`) and runs too large for any machine end within seconds, with one message
naming what differs or what is needed against what is available, and a non-zero exit on every
rank. Nothing here allocates more than a small run does. Shares the driver of cli_tests.py.
"""
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_tests as base  # noqa: E402
from cli_tests import fail, expect_ok, expect_error, scenario, write_json  # noqa: E402

# A broken run used to hang until mpiexec's timeout: a short limit fails it quickly instead.
LIMIT_S = 30
# What a refused run must end within (it ends in well under a second here; the margin is for a
# loaded machine).
QUICK_S = 10


def mpmd(env, *commands):
    """`mpiexec -n 1 tessera A : -n 1 tessera B ...`: one rank per command, each rank's exit code
    reported as env.tessera does. A command given as (variables, args) runs with those
    environment variables set on its rank alone (Hydra's per-section -env)."""
    argv = [env.mpiexec]
    for k, args in enumerate(commands):
        if k:
            argv.append(":")
        variables = {}
        if isinstance(args, tuple):
            variables, args = args
        argv += ["-n", "1"]
        for name, value in variables.items():
            argv += ["-env", name, value]
        argv += ["/bin/sh", "-c", base.RANK_WRAPPER, env.exe, *args]
    r = env.run_cmd(argv, timeout=LIMIT_S)
    r.ranks = len(commands)
    r.rank_rcs = [int(m) for m in base.RANK_EXIT.findall(r.output)]
    return r


def quickly(run):
    """Runs `run()` and fails unless it returned within QUICK_S seconds."""
    began = time.monotonic()
    r = run()
    took = time.monotonic() - began
    if took > QUICK_S:
        fail(f"expected the command to end within {QUICK_S} s, it took {took:.1f} s", r)
    return r


def expect_refused(r, *phrases):
    """A run refused for its size: one error line with what it needs per rank and what is
    available."""
    line = expect_error(r, "needs", "per rank", *phrases)
    if not re.search(r"available|more than any machine holds", line):
        fail("expected the message to say what memory is available", r)
    return line


@scenario
def nohang_mixed_commands(env):
    """train on one rank, gradcheck on the other: used to spin at 100% CPU until mpiexec's
    timeout."""
    r = quickly(lambda: mpmd(env, ["train", "--steps", "1"], ["gradcheck"]))
    expect_error(r, "ranks disagree on the command", "rank 0 train", "rank 1 gradcheck")
    # A command word on one rank only, and the other way round.
    r = quickly(lambda: mpmd(env, ["plan", "--grid", "1x1x1", "--image", "3x16x16"],
                             ["gradcheck"], ["gradcheck"]))
    expect_error(r, "ranks disagree on the command", "rank 0 plan", "ranks 1-2 gradcheck")


@scenario
def nohang_mixed_options(env):
    """The same command with another --dtype (bench: used to end in an MPI error stack), another
    --grid or --help on one rank only: one message naming the option, the ranks and their
    values."""
    bench = ["bench", "--image", "3x32x32", "--steps", "1", "--warmup", "0"]
    r = quickly(lambda: mpmd(env, [*bench, "--dtype", "float32"], [*bench, "--dtype", "float64"]))
    expect_error(r, "ranks disagree on --dtype: rank 0 float32, rank 1 float64")
    train = ["train", "--steps", "1", "--height", "32", "--width", "32", "--samples", "4",
             "--batch", "2"]
    r = quickly(lambda: mpmd(env, [*train, "--dtype", "float64"], train))
    expect_error(r, "ranks disagree on --dtype: rank 0 float64, rank 1 float32")
    r = quickly(lambda: mpmd(env, ["gradcheck", "--grid", "1x1x2"], ["gradcheck", "--help"]))
    expect_error(r, "--grid: rank 0 1x1x2, rank 1 (not given)",
                 "--help: rank 0 (not given), rank 1 (given)")
    # The documented environment switches are agreed too (one rank with direct convolutions
    # only would give another model's rounding).
    r = quickly(lambda: mpmd(env, ({"TESSERA_WINOGRAD": "0"}, bench), bench))
    expect_error(r, "ranks disagree on TESSERA_WINOGRAD: rank 0 0, rank 1 1")
    # Both set: its default depends on the CPU (on by default only on Intel with AVX-512).
    r = quickly(lambda: mpmd(env, ({"TESSERA_NARROW_CONV": "1"}, bench),
                             ({"TESSERA_NARROW_CONV": "0"}, bench)))
    expect_error(r, "ranks disagree on TESSERA_NARROW_CONV: rank 0 1, rank 1 0")
    # Agreeing ranks are unaffected.
    expect_ok(env.tessera(2, *train, "--dtype", "float64"), "step 1/1")


@scenario
def nohang_huge_image(env):
    """An image of 10^9 rows: refused before the model is built (that used to spin in the
    set-up of the convolutions), by every command that computes."""
    r = quickly(lambda: env.tessera(2, "train", "--steps", "1", "--height", "1000000000",
                                    timeout=LIMIT_S))
    expect_refused(r, "image 8x3x1000000000x128")
    r = quickly(lambda: env.tessera(2, "gradcheck", "--height", "1000000000", timeout=LIMIT_S))
    expect_refused(r, "the single-rank reference")
    r = quickly(lambda: env.tessera(2, "bench", "--image", "3x1000000000x64", timeout=LIMIT_S))
    expect_refused(r, "image 1x3x1000000000x64")


@scenario
def nohang_huge_model(env):
    """A conv layer with 2^40 output channels: refused with the memory it needs (it used to end
    in the allocator's out-of-memory error, or std::bad_alloc), by train, gradcheck, bench and
    plan."""
    write_json(env.path("wide.json"), {"name": "wide", "input_channels": 3, "layers": [
        {"name": "c1", "type": "conv2d", "out_channels": 2 ** 40, "kernel": 3, "padding": 1},
        {"name": "head", "type": "conv2d", "out_channels": 2, "kernel": 1}]})
    small = ["--height", "32", "--width", "32"]
    r = quickly(lambda: env.tessera(2, "train", "--model", "wide.json", "--steps", "1", *small,
                                    timeout=LIMIT_S))
    expect_refused(r, "params x2", "optimizer state")
    r = quickly(lambda: env.tessera(2, "gradcheck", "--model", "wide.json", *small,
                                    timeout=LIMIT_S))
    expect_refused(r, "params x2")
    r = quickly(lambda: env.tessera(2, "bench", "--model", "wide.json", "--image", "3x32x32",
                                    timeout=LIMIT_S))
    expect_refused(r, "params x2")
    r = quickly(lambda: base.plan_cmd(env, "--model", "wide.json", "--grid", "1x1x1",
                                      "--image", "3x32x32"))
    expect_refused(r, "the estimate above")


@scenario
def nohang_huge_dataset(env):
    """Data sets that declare 10^12 samples in a tiny file: refused at once, not after work linear
    in their samples. A virtual one (its source absent, so nothing to check chunk by chunk) is
    refused before its sample order is built (that grew until std::bad_alloc); a chunked one
    whose chunks were never written, without counting 10^12 missing chunks."""
    h5py = base.h5py
    with h5py.File(env.path("virtual.h5"), "w") as f:
        for name, shape, dtype in [("images", (10 ** 12, 3, 32, 32), "f4"),
                                   ("labels", (10 ** 12, 32, 32), "i4")]:
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            layout[:] = h5py.VirtualSource("absent.h5", name, shape=shape)
            f.create_virtual_dataset(name, layout, fillvalue=0)
    r = quickly(lambda: env.tessera(2, "train", "--data", "virtual.h5", "--steps", "1",
                                    timeout=LIMIT_S))
    expect_refused(r, "the order of the 1000000000000 samples of 'virtual.h5'")
    with h5py.File(env.path("unwritten.h5"), "w") as f:
        f.create_dataset("images", shape=(10 ** 12, 3, 32, 32), dtype="f4", chunks=(1, 3, 32, 32))
        f.create_dataset("labels", shape=(10 ** 12, 32, 32), dtype="i4", chunks=(1, 32, 32))
    r = quickly(lambda: env.tessera(2, "train", "--data", "unwritten.h5", "--steps", "1",
                                    timeout=LIMIT_S))
    expect_error(r, "declares 1000000000000 samples but at least", "never written",
                 "the first: sample 0")


@scenario
def nohang_plan_overflow(env):
    """tessera plan of a 10^9 x 10^9 image: no negative or wrapped byte counts, and a non-zero
    exit (it used to print negative sizes and exit 0); a plan beyond --host-memory is an error
    too, one within it is not."""
    r = quickly(lambda: base.plan_cmd(env, "--model", "unet-small", "--grid", "1x2x2",
                                      "--image", "3x1000000000x1000000000"))
    expect_refused(r, "more than 8 EiB")
    if re.search(r"-\d+(\.\d+)? ?[KMGTPE]?i?B\b", r.output) or "-0." in r.output:
        fail("expected no negative size in the plan", r)
    if "peak memory per rank (estimate): more than 8 EiB" not in r.output:
        fail("expected the plan to print the per-rank peak as more than 8 EiB", r)
    args = ["--model", "unet-small", "--grid", "1x2x2", "--image", "3x512x512"]
    r = base.plan_cmd(env, *args, "--host-memory", "0.01")
    expect_refused(r, "10.2 MiB available (--host-memory)")
    if "host memory per rank: 10.2 MiB (--host-memory): does NOT fit" not in r.output:
        fail("expected the plan to say that it does not fit --host-memory", r)
    for bad in ("inf", "nan", "0"):  # inf planned "7.81 EiB: fits"
        expect_error(base.plan_cmd(env, *args, "--host-memory", bad),
                     "--host-memory takes a finite number of GiB > 0")
    expect_error(base.plan_cmd(env, "--model", env.tmp, "--grid", "1x1x1", "--image", "3x8x8"),
                 "is a directory")  # it was nlohmann's "unexpected end of input"
    r = base.plan_cmd(env, *args, "--host-memory", "64")
    expect_ok(r, "host memory per rank: 64.0 GiB (--host-memory): fits")
    # Without --host-memory: this machine's memory (a 512x512 image fits any test machine).
    expect_ok(base.plan_cmd(env, *args), "host memory per rank:", "on this machine): fits")


if __name__ == "__main__":
    sys.exit(base.main(sys.argv))
