#!/usr/bin/python3
"""End-to-end tests of `tessera bench` and scripts/bench/compare_pytorch.py:
bench_tests.py BUILD_DIR SCENARIO (exit 0 pass, 1 fail, 77 skip).

Shares the driver of cli_tests.py (every rank's exit code, one error line, no hang). Timings are
never asserted: only that they are there, add up and count the right work.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_tests as base  # noqa: E402
from cli_tests import fail, expect_ok, expect_error, scenario  # noqa: E402


def conv_flops(tile_h, tile_w, layers):
    """Forward + backward FLOPs of stride-1 'same' convs on one tile: backward is backward-data
    and backward-filter (2 x forward), except for the first layer, which has no input gradient
    to compute in training."""
    return sum((2 if i == 0 else 3) * 2.0 * tile_h * tile_w * o * c * k * k
               for i, (c, o, k) in enumerate(layers))


@scenario
def bench_runs(env):
    out = env.path("b.json")
    r = env.tessera(2, "bench", "--image", "3x32x48", "--steps", "2", "--json", out)
    expect_ok(r, "tessera bench: model conv-bench", "grid 1x2x1", "c1", "forward", "backward",
              "head", "exposed communication", "convolutions:", "sgemm:", "peak memory",
              "rank 0's tile rows [0, 16), columns [0, 48) of 32x48\n")
    j = json.loads(out.read_text())
    if j["grid"] != "1x2x1" or j["ranks"] != 2 or j["image"] != [3, 32, 48]:
        fail(f"wrong run settings in the JSON: {j}")
    want = {"row_units": 0, "col_units": 0, "spatial": [{"rows": [0, 16], "cols": [0, 48]},
                                                        {"rows": [16, 32], "cols": [0, 48]}]}
    if j["tiles"] != want:
        fail(f"expected the tiles {want}, got {j['tiles']}")
    if len(j["layers"]) != 2 * 9:
        fail(f"expected forward and backward rows for 9 layers, got {len(j['layers'])}")
    # Rank 0's tile is 16 x 48: the FLOP count is exact.
    want = conv_flops(16, 48, [(3, 32, 3), (32, 32, 3), (32, 32, 3), (32, 32, 3), (32, 2, 1)])
    if abs(j["conv_gflop_per_step"] * 1e9 - want) > 1e-6 * want:
        fail(f"expected {want / 1e9} GFLOP of convolutions per step, got "
             f"{j['conv_gflop_per_step']}")
    split = j["split"]
    if min(split.values()) < 0 or j["step_seconds"] <= 0:
        fail(f"negative or zero times: {j}")
    total = sum(split.values())
    if abs(total - j["step_seconds"]) > 0.05 * j["step_seconds"] + 1e-3:
        fail(f"the split {split} does not add up to the step {j['step_seconds']}")
    # Two ranks exchange halos in every conv with a 3x3 kernel: the exchange is measured.
    if split["halo"] <= 0:
        fail(f"expected halo time on 2 ranks, got {split}")
    if j["sgemm_gflops_per_rank"] <= 0:
        fail("expected an SGEMM rate")
    # The memory bandwidth of one rank alone and of the node's two ranks at once.
    if "memory: STREAM triad" not in r.output:
        fail("expected the memory bandwidth line", r)
    if j["membw_alone_gbs"] <= 0 or j["membw_node_gbs"] <= 0 or j["membw_ranks_per_node"] != 2:
        fail(f"expected bandwidths and 2 ranks per node, got {j['membw_alone_gbs']}, "
             f"{j['membw_node_gbs']}, {j['membw_ranks_per_node']}")

    # Batch norm reduces statistics over the grid: reductions are measured too.
    r = env.tessera(4, "bench", "--model", "unet-small", "--grid", "1x2x2", "--image",
                    "3x32x32", "--batch", "2", "--steps", "1", "--sgemm", "0", "--membw", "0",
                    "--json", out)
    expect_ok(r, "model unet-small", "e1a_bn", "batchnorm2d", "gradients")
    j = json.loads(out.read_text())
    if j["split"]["allreduce"] <= 0:
        fail(f"expected reduction time with batch norm on 4 ranks, got {j['split']}")
    if "sgemm:" in r.output:
        fail("--sgemm 0 still measured SGEMM", r)
    if "memory: STREAM" in r.output or "membw_node_gbs" in j:
        fail("--membw 0 still measured the memory bandwidth", r)

    # Uneven tiles, cut in units that line up unet-small's resolutions: said and written down.
    r = env.tessera(3, "bench", "--model", "unet-small", "--image", "3x64x64", "--steps", "1",
                    "--sgemm", "0", "--membw", "0", "--json", out)
    expect_ok(r, "grid 1x3x1", "rank 0's tile rows [0, 22), columns [0, 64) of 64x64; tiles from "
              "20x64 to 22x64, rows cut in 32 units of 2 to line up the resolutions")
    tiles = json.loads(out.read_text())["tiles"]
    if tiles["row_units"] != 32 or [t["rows"] for t in tiles["spatial"]] != [[0, 22], [22, 44],
                                                                               [44, 64]]:
        fail(f"expected rows cut in 32 units as 22/22/20, got {tiles}")


@scenario
def bench_errors(env):
    expect_error(env.tessera(2, "bench", "--steps", "0"), "--steps must be at least 1")
    for option in ("--json", "--grid", "--sgemm"):  # taken as unset, the default, on
        expect_error(env.tessera(2, "bench", option, ""), f"{option} was given an empty value")
    for lr in ("nan", "-1"):  # found by the optimizer after the first step, with MPI_Abort
        expect_error(env.tessera(2, "bench", "--lr", lr), "--lr must be a finite number >= 0")
    expect_error(env.tessera(2, "bench", "--grid", "1x1x3"), "grid 1x1x3 has 3 ranks",
                 "mpiexec -n 3")
    expect_error(env.tessera(2, "bench", "--image", "3x32"), "bad image '3x32'")
    expect_error(env.tessera(2, "bench", "--model", "nosuch"), "nosuch")
    # One row cannot be cut into the default grid's two bands: the columns can.
    expect_error(env.tessera(2, "bench", "--image", "3x1x32"), "cannot be split",
                 "at most 1x1; 1x2 takes the same 2 ranks")
    expect_error(env.tessera(2, "bench", "--json", env.path("no/such/dir/b.json"), "--image",
                             "3x16x16"), "cannot write")
    # A run refused after its options were checked leaves an existing --json file as it was.
    kept = env.path("kept.json")
    kept.write_text("precious\n")
    expect_error(env.tessera(2, "bench", "--json", kept, "--image", "3x60000x60000", "--steps",
                             "1", "--sgemm", "0", "--membw", "0"), "per rank")
    if kept.read_text() != "precious\n":
        fail(f"a refused bench run changed its --json file: {kept.read_text()[:80]!r}")
    # How the CUDA backend picks cuDNN's algorithms: read at start-up on every machine, with or
    # without a GPU.
    os.environ["TESSERA_CUDNN_SEARCH"] = "fastest"
    try:
        expect_error(env.tessera(2, "bench", "--image", "3x16x16"), "TESSERA_CUDNN_SEARCH",
                     "'fastest'", "expected measure or heuristic")
    finally:
        os.environ.pop("TESSERA_CUDNN_SEARCH")
    r = env.run_cmd([env.mpiexec, "-n", "1", "/usr/bin/env", "TESSERA_CUDNN_SEARCH=heuristic",
                     env.exe, "bench", "--image", "3x16x16", "--steps", "1", "--sgemm", "0"])
    expect_ok(r, "tessera bench")
    # The threaded loops' instruction set: named in the kernels line, a bad name refused.
    r = env.run_cmd([env.mpiexec, "-n", "1", "/usr/bin/env", "TESSERA_SIMD=baseline", env.exe,
                     "bench", "--model", "unet-small", "--image", "3x16x16", "--steps", "1",
                     "--sgemm", "0"])
    expect_ok(r, "threaded loops for batch norm (baseline)")
    r = env.run_cmd([env.mpiexec, "-n", "2", "/usr/bin/env", "TESSERA_SIMD=sse9", env.exe,
                     "bench", "--image", "3x16x16", "--steps", "1"])
    expect_error(r, "TESSERA_SIMD", "'sse9'", "expected baseline or avx512")


@scenario
def bench_memory_reuse(env):
    """A training step allocates what the last one freed: from the second step on, every large
    block is a kept one or assembled from kept pages, and no fresh page is mapped. Holds on one
    rank and on a 2x1 grid (halo windows, batch norm, every layer of unet-small). Warm-up goes on
    while a step faults pages in."""
    out = env.path("m.json")
    for ranks, grid in [(1, "1x1x1"), (2, "1x2x1")]:
        r = env.tessera(ranks, "bench", "--model", "unet-small", "--grid", grid, "--image",
                        "3x512x512", "--steps", "2", "--sgemm", "0", "--json", out)
        expect_ok(r, "host memory (pool), per timed step after")
        j = json.loads(out.read_text())
        m = j["host_memory"]
        # The first step faults every page in (more than 16 MiB at 512x512): one more warm-up
        # step at least, at most four more.
        if not 2 <= j["warmup_steps"] <= 5:
            fail(f"grid {grid}: expected 2 to 5 warm-up steps after --warmup 1, got "
                 f"{j['warmup_steps']}")
        if m["policy"] != "pool":
            fail(f"expected the pool by default, got {m}")
        if m["fresh_mib_per_step"] != 0 or m["fresh_per_step"] != 0:
            fail(f"grid {grid}: a repeated step mapped fresh pages: {m}")
        if m["reused_per_step"] + m["assembled_per_step"] < 20:
            fail(f"grid {grid}: expected the step's activations from the pool, got {m}")
    # No warm-up asked: none added.
    r = env.tessera(1, "bench", "--model", "unet-small", "--image", "3x64x64", "--steps", "1",
                    "--warmup", "0", "--sgemm", "0", "--membw", "0", "--json", out)
    expect_ok(r, "0 warm-up steps, then 1 timed", "after 0 warm-up steps")
    if json.loads(out.read_text())["warmup_steps"] != 0:
        fail("--warmup 0 still ran warm-up steps", r)
    # TESSERA_HOST_MEMORY=system: malloc and free, nothing kept.
    saved = os.environ.get("TESSERA_HOST_MEMORY")
    os.environ["TESSERA_HOST_MEMORY"] = "system"
    try:
        r = env.tessera(1, "bench", "--model", "unet-small", "--image", "3x256x256", "--steps",
                        "1", "--sgemm", "0", "--json", out)
        expect_ok(r, "host memory (system)")
        m = json.loads(out.read_text())["host_memory"]
        if m["reused_per_step"] + m["assembled_per_step"] + m["fresh_per_step"] != 0:
            fail(f"the system policy still used the pool: {m}")
        os.environ["TESSERA_HOST_MEMORY"] = "heap"
        expect_error(env.tessera(2, "bench", "--image", "3x16x16"), "TESSERA_HOST_MEMORY",
                     "expected pool or system")
    finally:
        if saved is None:
            os.environ.pop("TESSERA_HOST_MEMORY")
        else:
            os.environ["TESSERA_HOST_MEMORY"] = saved


@scenario
def bench_compare_pytorch(env):
    try:
        import torch  # noqa: F401
    except ImportError:
        print("SKIP: no PyTorch (Debian's python3-torch)")
        sys.exit(base.SKIP)
    script = base.REPO / "scripts" / "bench" / "compare_pytorch.py"
    out = env.path("c.json")
    r = env.run_cmd([sys.executable, script, "--image", "3x64x64", "--steps", "1",
                     "--cores", "1", "--repeat", "2", "--tessera", env.exe, "--json", out])
    if r.rc != 0:
        fail("compare_pytorch.py failed", r)
    for phrase in ["faster than PyTorch", "of oneDNN SGEMM", "spatial strong scaling",
                   "of which convolutions' compute", "memory bandwidth (STREAM triad) 1 -> 2"]:
        if phrase not in r.output:
            fail(f"expected {phrase!r} in the output", r)
    j = json.loads(out.read_text())
    for key in ["pytorch_step_seconds", "tessera_step_seconds", "speedup_vs_pytorch",
                "scaling_1_to_2", "two_rank_exposed_fraction", "sgemm_gflops"]:
        if not j.get(key, 0) > 0:
            fail(f"expected a positive {key} in the JSON, got {j.get(key)}")
    parts = j.get("scaling_parts", {})
    if not (min(parts.get("conv_seconds", [0])) > 0 and parts.get("membw_scaling", 0) > 0):
        fail(f"expected the scaling pair's convolution time and bandwidth ratio, got {parts}")
    # The baselines ran as asked: tuned with tcmalloc preloaded and channels_last tensors, in
    # both orders, the ratio against it; default with neither.
    runs = j.get("pytorch_runs", {})
    tuned, default = runs.get("tuned", {}), runs.get("default", {})
    if not (tuned.get("tcmalloc") and tuned.get("channels_last") and len(tuned.get("orders", {}))
            == 2 and default.get("tcmalloc") is False and default.get("channels_last") is False):
        fail(f"expected a tuned run (tcmalloc, channels_last, two orders) and a default one "
             f"(neither), got {runs}")
    if j.get("pytorch_baseline") != tuned.get("label") or not j.get("pytorch_peak_mib", 0) > 0:
        fail(f"expected the ratio against the tuned run and its peak memory, got {j}")
    if not j.get("speedup_best_vs_pytorch", 0) > 0:
        fail("expected speedup_best_vs_pytorch in the JSON")
    lo, hi = j["scaling_1_to_2_range"]
    if not lo <= j["scaling_1_to_2"] <= hi:
        fail(f"the median scaling {j['scaling_1_to_2']} lies outside its range {lo}..{hi}")
    # The U-Net, written out in PyTorch by the script: the same parameter count as Tessera's.
    out = env.path("u.json")
    r = env.run_cmd([sys.executable, script, "--model", "unet-small", "--image", "3x32x32",
                     "--steps", "1", "--cores", "1", "--no-scaling", "--tessera", env.exe,
                     "--json", out])
    if r.rc != 0:
        fail("compare_pytorch.py --model unet-small failed", r)
    j = json.loads(out.read_text())
    if j.get("model") != "unet-small" or not j.get("speedup_vs_pytorch", 0) > 0:
        fail(f"expected a unet-small comparison in the JSON, got {j}")
    if j.get("pytorch_parameters") != j.get("tessera_parameters"):
        fail(f"PyTorch's unet-small has {j.get('pytorch_parameters')} parameters, Tessera's "
             f"{j.get('tessera_parameters')}")


@scenario
def bench_trace_report(env):
    """scripts/gpu/trace_report.py on a made-up CUPTI timeline (scripts/gpu/cupti_trace.cpp's
    format): steps cut at the loss kernel, kernels by time per step, the GPU's idle gaps and the
    host's calls in them."""
    lines = []
    for k in range(5):  # one warm-up step, three timed, and the last marker's own
        t = k * 1_000_000  # 1 ms a step, in ns
        lines += [f"K {t} {t + 100_000} 7 cross_entropy_kernel",
                  f"K {t + 100_000} {t + 600_000} 7 conv_kernel",
                  f"A {t + 610_000} {t + 890_000} 1 cudaMemcpyAsync_v3020",
                  f"M {t + 900_000} {t + 1_000_000} 7 1 4096"]
    trace = env.path("trace.txt")
    trace.write_text("\n".join(lines) + "\n")
    script = base.REPO / "scripts" / "gpu" / "trace_report.py"
    r = env.run_cmd([sys.executable, script, str(trace), "--marker", "cross_entropy"])
    if r.rc != 0:
        fail("trace_report.py failed", r)
    for phrase in ["3 steps",
                   "1.00 ms from marker to marker, GPU busy 0.70 ms, idle 0.30 ms (30.0%)",
                   "   0.500    1.0    500.0  conv_kernel",
                   "   0.100    1.0    100.0  copy kind 1",
                   "1.0 per step, 0.30 ms per step",
                   "300.0 us after conv_kernel | before copy kind 1 | "
                   "host: cudaMemcpyAsync_v3020 280"]:
        if phrase not in r.output:
            fail(f"expected {phrase!r} in the report", r)
    r = env.run_cmd([sys.executable, script, str(trace), "--marker", "no_such_kernel"])
    if r.rc == 0 or "too few steps" not in r.output:
        fail("expected a trace without the marker kernel to be refused", r)


if __name__ == "__main__":
    sys.exit(base.main(sys.argv))
