#!/usr/bin/python3
"""Time one training step of the same model, image and cores in PyTorch and in Tessera, in one run.

Usage: scripts/bench/compare_pytorch.py [--model conv-bench] [--image 3x2048x2048] [--cores N]
                                        [--device cpu|cuda] [--steps 3] [--repeat 3]
                                        [--baseline tuned|default|both] [--tessera build/tessera]
                                        [--no-scaling] [--json OUT]

The model is one of Tessera's built-ins, written out here in PyTorch as well:
  conv-bench (default): four 3x3 convolutions to 32 channels with ReLU (padding 1) and a 1x1 head
    to 2 classes;
  unet-small: the three-level U-Net (conv + batch norm + ReLU blocks of 8, 16, 32 channels, max
    pooling, a transposed conv and a nearest upsampling, concat skips, a 1x1 head to 2 classes);
with per-pixel cross-entropy, one image. A step is forward, loss, backward and a plain SGD update,
in both tools. In order, one after the other on an otherwise
idle machine:

  1. PyTorch (float32) with torch.set_num_threads(cores), each way in a process of its own:
     tuned, as PyTorch's CPU performance guide tells its users to run it: a caching allocator
     preloaded (LD_PRELOAD of Debian's libtcmalloc_minimal.so.4, package libtcmalloc-minimal4) and
     the model and the batch in channels_last; timed in both orders of converting the model and
     allocating the batch (which moved the step by 2x on this machine), the faster reported. And
     default (--baseline both, the default): glibc malloc and NCHW tensors, for reference. The
     ratio that counts is against the tuned run. Each reports its peak resident memory;
  2. `tessera bench` on 1 rank with `cores` kernel threads (it also measures oneDNN's SGEMM rate
     with the same threads, the yardstick of the conv GFLOP/s);
  3. unless --no-scaling: `tessera bench` on 1 rank x 1 thread and on 2 ranks x 1 thread
     (grid 1x2x1, tessera's default: the image split in two bands of rows), for spatial strong scaling; --repeat pairs of
     runs, one after the other, and the median pair (by ratio) is reported with the range, since
     a 2-core machine shared with other work drifts by 10% from run to run.

With --device cuda both run on the first GPU: PyTorch with cuDNN's autotuner on
(torch.backends.cudnn.benchmark) and TF32 off, as Tessera's default (--allow-tf32 is the opt-in
of both), timed with torch.cuda.synchronize(); Tessera as `tessera bench --device cuda`, and the
scaling pair as 1 rank and 2 ranks sharing that GPU (--share-devices, the MPI transport), whose
exposed fraction says how much of the halo traffic the overlap hides. No SGEMM yardstick there.

It prints each step time and peak memory, the ratio tuned PyTorch / Tessera (Tessera's best of
1 rank x `cores` threads and, with the scaling runs, 2 ranks x 1 thread), the convolutions'
GFLOP/s against SGEMM, the 1 -> 2 rank speedup and how much of the 2-rank step is communication
not hidden behind compute. Each step time is the mean over --steps steps after warm-up steps:
two for PyTorch; for Tessera one, and up to 4 more while a step still faults pages in (`tessera
bench --warmup`; at 2048x2048 one more in float32).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_image(text):
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"compare_pytorch: bad --image '{text}': expected CxHxW, e.g. 3x2048x2048")
    return tuple(int(p) for p in parts)


MODELS = ("conv-bench", "unet-small")


def conv_bench(torch, c):
    layers = []
    channels = c
    for _ in range(4):
        layers += [torch.nn.Conv2d(channels, 32, 3, padding=1), torch.nn.ReLU()]
        channels = 32
    layers.append(torch.nn.Conv2d(32, 2, 1))
    return torch.nn.Sequential(*layers)


def unet_small(torch, c):
    """src/engine/model_spec.cpp's unet-small, layer for layer."""
    nn = torch.nn

    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU())

    class UNetSmall(nn.Module):
        def __init__(self):
            super().__init__()
            self.e1 = nn.Sequential(block(c, 8), block(8, 8))
            self.e2 = nn.Sequential(block(8, 16), block(16, 16))
            self.m = nn.Sequential(block(16, 32), block(32, 32))
            self.up2 = nn.ConvTranspose2d(32, 16, 2, stride=2)
            self.d2 = block(32, 16)
            self.up1 = nn.Upsample(scale_factor=2, mode="nearest")
            self.d1 = block(24, 8)
            self.head = nn.Conv2d(8, 2, 1)

        def forward(self, x):
            e1 = self.e1(x)
            e2 = self.e2(nn.functional.max_pool2d(e1, 2))
            m = self.m(nn.functional.max_pool2d(e2, 2))
            d2 = self.d2(torch.cat([self.up2(m), e2], 1))
            return self.head(self.d1(torch.cat([self.up1(d2), e1], 1)))

    return UNetSmall()


def pytorch_step(model_name, image, cores, steps, device="cpu", allow_tf32=False, seed=1,
                 channels_last=False, batch_first=False):
    """One process's PyTorch run: (mean step seconds, version, parameters, whether the batch and
    the conv weights were channels_last when it ran). channels_last: the model and the batch in
    that memory format; batch_first: the batch is allocated before the
    model is converted (the other order otherwise)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(cores)
    torch.manual_seed(seed)
    c, h, w = image
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("compare_pytorch: --device cuda, but PyTorch sees no GPU")
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = (unet_small if model_name == "unet-small" else conv_bench)(torch, c)

    def batch():
        return (torch.rand(1, c, h, w, device=device).contiguous(memory_format=fmt),
                torch.randint(0, 2, (1, h, w), device=device))

    if batch_first:
        x, y = batch()
        model = model.to(device, memory_format=fmt)
    else:
        model = model.to(device, memory_format=fmt)
        x, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    warmup = 2  # as many as Tessera's bench takes where its pages settle after the first
    for s in range(steps + warmup):
        sync()
        began = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sync()
        if s >= warmup:
            times.append(time.perf_counter() - began)
        print(f"  pytorch step {s}{' (warm-up)' if s < warmup else ''}: "
              f"{time.perf_counter() - began:.3f} s", flush=True)
    # What the step ran on: the batch's and the convolution weights' memory format.
    in_channels_last = x.is_contiguous(memory_format=torch.channels_last) and all(
        p.is_contiguous(memory_format=torch.channels_last) for p in model.parameters()
        if p.dim() == 4)
    return (sum(times) / len(times), torch.__version__,
            sum(p.numel() for p in model.parameters()), in_channels_last)


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def pytorch_worker(a):
    """--pytorch-worker: one PyTorch run in this process, its result as one JSON line."""
    s, version, params, in_channels_last = pytorch_step(
        a.model, parse_image(a.image), a.cores, a.steps, a.device, a.allow_tf32,
        channels_last=a.channels_last, batch_first=a.batch_first)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/maps") as f:
        tcmalloc = "libtcmalloc" in f.read()
    print("RESULT " + json.dumps({"step_seconds": s, "version": version, "parameters": params,
                                  "peak_mib": peak_mib, "tcmalloc": tcmalloc,
                                  "channels_last": in_channels_last}), flush=True)
    return 0


def pytorch_run(a, label, channels_last, batch_first, preload):
    """Runs pytorch_worker in a fresh process (so that LD_PRELOAD takes effect and no run
    inherits another's heap); returns its result dict with `label`."""
    env = dict(os.environ)
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [sys.executable, os.path.abspath(__file__), "--pytorch-worker", "--model", a.model,
           "--image", a.image, "--cores", str(a.cores), "--steps", str(a.steps),
           "--device", a.device] + (["--allow-tf32"] if a.allow_tf32 else []) + \
        (["--channels-last"] if channels_last else []) + (["--batch-first"] if batch_first else [])
    print(f"  PyTorch {label}" + (f" (LD_PRELOAD={preload})" if preload else ""), flush=True)
    run = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = None
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
        else:
            print("    " + line, flush=True)
    if run.returncode != 0 or result is None:
        raise SystemExit(f"compare_pytorch: the PyTorch run ({label}) failed (exit "
                         f"{run.returncode})")
    result["label"] = label
    print(f"    mean step {result['step_seconds']:.3f} s, peak memory "
          f"{result['peak_mib']:.0f} MiB", flush=True)
    return result


def pytorch_baselines(a):
    """{"tuned": best of both orders, "default": ...} as --baseline asks."""
    out = {}
    if a.baseline in ("tuned", "both"):
        preload = None
        if a.device == "cpu":
            if not os.path.exists(TCMALLOC):
                raise SystemExit(f"compare_pytorch: the tuned baseline preloads {TCMALLOC}: "
                                 "apt-get install libtcmalloc-minimal4 (scripts/setup.sh does), or "
                                 "--baseline default")
            preload = TCMALLOC
        runs = [pytorch_run(a, f"tuned, channels_last, {order}", True, order == "batch first",
                            preload) for order in ("model first", "batch first")]
        out["tuned"] = min(runs, key=lambda r: r["step_seconds"])
        out["tuned"]["orders"] = {r["label"].split(", ")[-1]: r["step_seconds"] for r in runs}
    if a.baseline in ("default", "both"):
        out["default"] = pytorch_run(a, "default (glibc malloc, NCHW)", False, False, None)
    return out


def tessera_bench(exe, model, ranks, threads, image, steps, sgemm, device="cpu", allow_tf32=False,
                  precision="float32"):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = ["mpiexec", "-n", str(ranks), exe, "bench", "--model", model, "--grid", f"1x{ranks}x1",
               "--image", "x".join(map(str, image)), "--steps", str(steps), "--warmup", "1",
               "--sgemm", "1" if sgemm else "0"]
        if device == "cuda":
            # One GPU here: two ranks share it (the MPI transport; NCCL refuses a shared GPU).
            cmd += ["--device", "cuda"] + (["--share-devices"] if ranks > 1 else [])
            cmd += ["--allow-tf32"] if allow_tf32 else []
        cmd += ["--precision", precision] if precision != "float32" else []
        cmd += ["--json", out]
        print(f"  $ OMP_NUM_THREADS={threads} {' '.join(cmd[:-2])}", flush=True)
        run = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        for line in run.stdout.splitlines():
            print("    " + line)
        if run.returncode != 0:
            raise SystemExit(f"compare_pytorch: tessera bench failed (exit {run.returncode})")
        with open(out) as f:
            return json.load(f)


def conv_compute_seconds(bench):
    """The convolutions' compute time per step in a `tessera bench` JSON (layers with FLOPs;
    each row the maximum over ranks)."""
    return sum(l["compute"] for l in bench["layers"] if l["gflops"] > 0)


def scaling_parts(one, two):
    """Where a 1 -> 2 rank pair's time went: the convolutions' compute and the rest of the step
    (batch norm, pooling, upsampling, activations, windows, loss, update, waiting), 1 and 2 ranks,
    and the node's memory bandwidth from 1 rank to 2 (tessera bench's memory line)."""
    c1, c2 = conv_compute_seconds(one), conv_compute_seconds(two)
    r1, r2 = one["step_seconds"] - c1, two["step_seconds"] - c2
    parts = {"conv_seconds": [c1, c2], "rest_seconds": [r1, r2],
             # the step's scaling were the convolutions' compute to halve exactly
             "scaling_with_ideal_convs": one["step_seconds"] / (c1 / 2 + r2) if r2 > 0 else None}
    if two.get("membw_alone_gbs", 0) > 0:
        parts["membw_scaling"] = two["membw_node_gbs"] / two["membw_alone_gbs"]
    return parts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="conv-bench", choices=MODELS,
                   help="built-in model, written out in PyTorch too (default conv-bench)")
    p.add_argument("--image", default="3x2048x2048", help="CxHxW (default 3x2048x2048)")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads for PyTorch and for the 1-rank Tessera run (default: all)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up ones")
    p.add_argument("--tessera", default=os.path.join(ROOT, "build", "tessera"))
    p.add_argument("--no-scaling", action="store_true", help="skip the 1 -> 2 rank runs")
    p.add_argument("--repeat", type=int, default=3, help="pairs of scaling runs (median reported)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where both compute (default cpu; cuda: the first GPU)")
    p.add_argument("--allow-tf32", action="store_true",
                   help="with cuda: TF32 convolutions in both (off by default in both)")
    p.add_argument("--precision", default="float32", choices=("float32", "bf16"),
                   help="Tessera's --precision (bf16: bfloat16 convolutions; PyTorch stays float32)")
    p.add_argument("--baseline", default="both", choices=("tuned", "default", "both"),
                   help="PyTorch tuned (tcmalloc preloaded, channels_last; the ratio that counts), "
                        "default (glibc malloc, NCHW), or both (default)")
    p.add_argument("--pytorch-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--channels-last", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch-first", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.pytorch_worker:
        return pytorch_worker(a)
    gpu = a.device == "cuda"
    image = parse_image(a.image)
    if not os.access(a.tessera, os.X_OK):
        raise SystemExit(f"compare_pytorch: no tessera binary at {a.tessera} (build first: "
                         "scripts/setup.sh)")

    print(f"compare_pytorch: {a.model}, image {a.image}, {a.cores} cores, "
          f"{a.steps} timed steps each, device {a.device}", flush=True)
    baselines = pytorch_baselines(a)
    base = baselines.get("tuned", baselines.get("default"))
    torch_s, torch_version, torch_params = (base["step_seconds"], base["version"],
                                            base["parameters"])
    t = tessera_bench(a.tessera, a.model, 1, a.cores, image, a.steps, sgemm=not gpu,
                      device=a.device, allow_tf32=a.allow_tf32, precision=a.precision)
    r = {"model": a.model, "pytorch_parameters": torch_params,
         "tessera_parameters": t["parameters"], "image": a.image, "cores": a.cores, "pytorch_version": torch_version,
         "pytorch_baseline": base["label"],
         "pytorch_step_seconds": torch_s, "tessera_step_seconds": t["step_seconds"],
         "pytorch_peak_mib": base["peak_mib"], "tessera_peak_mib": t.get("peak_mib"),
         "pytorch_runs": baselines,
         "speedup_vs_pytorch": torch_s / t["step_seconds"],
         "conv_gflop_per_step": t["conv_gflop_per_step"],
         "pytorch_gflops": t["conv_gflop_per_step"] / torch_s,
         "tessera_gflops": t["conv_gflop_per_step"] / t["step_seconds"],
         "tessera_conv32_gflops": t["conv32_gflops"],
         "sgemm_gflops": t["sgemm_gflops_per_rank"],
         "conv32_fraction_of_sgemm": (t["conv32_gflops"] / t["sgemm_gflops_per_rank"]
                                      if t["sgemm_gflops_per_rank"] > 0 else None),
         "device": a.device, "tessera_precision": a.precision,
         "split": t["split"]}
    if not a.no_scaling:
        pairs = []
        for _ in range(max(a.repeat, 1)):
            one = tessera_bench(a.tessera, a.model, 1, 1, image, a.steps, sgemm=False,
                                device=a.device, allow_tf32=a.allow_tf32, precision=a.precision)
            two = tessera_bench(a.tessera, a.model, 2, 1, image, a.steps, sgemm=False,
                                device=a.device, allow_tf32=a.allow_tf32, precision=a.precision)
            pairs.append((one["step_seconds"] / two["step_seconds"], one, two))
        pairs.sort(key=lambda p: p[0])
        ratio, one, two = pairs[len(pairs) // 2]
        r.update({"one_rank_step_seconds": one["step_seconds"],
                  "two_rank_step_seconds": two["step_seconds"],
                  "scaling_1_to_2": ratio,
                  "scaling_1_to_2_range": [pairs[0][0], pairs[-1][0]],
                  "two_rank_exposed_fraction": two["exposed_fraction"],
                  "two_rank_split": two["split"],
                  "scaling_parts": scaling_parts(one, two)})
    # Tessera's best configuration on these cores: 1 rank x `cores` threads, or (CPU, 2 cores)
    # 2 ranks x 1 thread.
    best = [("1 rank x %d threads" % a.cores, t["step_seconds"])]
    if not a.no_scaling and not gpu and a.cores == 2:
        best.append(("2 ranks x 1 thread", r["two_rank_step_seconds"]))
    best_label, best_s = min(best, key=lambda b: b[1])
    r.update({"tessera_best": best_label, "tessera_best_step_seconds": best_s,
              "speedup_best_vs_pytorch": torch_s / best_s})

    print()
    where = "GPU" if gpu else f"{a.cores} threads"
    gflop = r["conv_gflop_per_step"]
    print(f"{'':52}{'step s':>10}{'GFLOP/s':>10}{'peak MiB':>10}")
    for name, run in baselines.items():
        print(f"{f'PyTorch {torch_version} {name} ({where})':52}{run['step_seconds']:10.3f}"
              f"{gflop / run['step_seconds']:10.1f}{run['peak_mib']:10.0f}")
    peak = t.get("peak_mib")
    print(f"{f'Tessera 1 rank ({where})':52}{t['step_seconds']:10.3f}"
          f"{r['tessera_gflops']:10.1f}{peak if peak is not None else float('nan'):10.0f}")
    if "two_rank_step_seconds" in r:
        print(f"{'Tessera 2 ranks x 1 thread':52}{r['two_rank_step_seconds']:10.3f}"
              f"{gflop / r['two_rank_step_seconds']:10.1f}")
    if "tuned" in baselines:
        print("  (tuned PyTorch: " + ", ".join(f"{k} {v:.3f} s" for k, v in
                                              baselines["tuned"]["orders"].items()) + ")")
    target = "target >= 1.5x; " if not gpu else "target >= 1.0x; "
    print(f"Tessera ({r['tessera_best']}) is {r['speedup_best_vs_pytorch']:.2f}x faster than "
          f"PyTorch {base['label']} ({target}{gflop:.0f} GFLOP of convolutions per step)")
    if r["conv32_fraction_of_sgemm"] is not None:
        print(f"convolutions with >= 32 channels: {r['tessera_conv32_gflops']:.1f} GFLOP/s of "
              f"compute time = {100 * r['conv32_fraction_of_sgemm']:.0f}% of oneDNN SGEMM "
              f"{r['sgemm_gflops']:.1f} GFLOP/s on the same {a.cores} threads (target >= 50%)")
    s = t["split"]
    print("Tessera step split: " + ", ".join(f"{k} {v:.3f} s" for k, v in s.items()))
    if not a.no_scaling:
        lo, hi = r["scaling_1_to_2_range"]
        per_rank = "sharing one GPU" if gpu else "1 thread per rank"
        print(f"spatial strong scaling, {per_rank} (median of {max(a.repeat, 1)} pairs): "
              f"1 rank {r['one_rank_step_seconds']:.3f} s, 2 ranks {r['two_rank_step_seconds']:.3f} s: "
              f"{r['scaling_1_to_2']:.2f}x, range {lo:.2f}-{hi:.2f}x (target >= 1.9x); exposed "
              f"halo + allreduce {100 * r['two_rank_exposed_fraction']:.1f}% of the 2-rank step "
              f"(target <= 3%)")
        sp = r["scaling_parts"]
        (c1, c2), (r1, r2) = sp["conv_seconds"], sp["rest_seconds"]
        line = (f"  of which convolutions' compute {c1:.3f} -> {c2:.3f} s ({c1 / c2:.2f}x), the rest "
                f"{r1:.3f} -> {r2:.3f} s ({r1 / r2:.2f}x)" if c2 > 0 and r2 > 0 else "")
        if line and sp["scaling_with_ideal_convs"]:
            line += f"; with convolutions at 2.00x the step would scale {sp['scaling_with_ideal_convs']:.2f}x"
        if "membw_scaling" in sp:
            line += (f"; the node's memory bandwidth (STREAM triad) 1 -> 2 ranks "
                     f"{sp['membw_scaling']:.2f}x")
        if line:
            print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
