#!/usr/bin/env python3
"""Reads a kernel timeline written by scripts/gpu/cupti_trace.cpp and says where a step's GPU time
goes: the kernels by total time, the GPU's idle gaps and what the host was doing in them.

Steps are cut at a kernel that runs once per step (--marker, a substring of its name; default the
pixel cross-entropy); the first --skip steps (warm-up) are left out. Names are demangled with
c++filt where it is installed.

Usage: trace_report.py TRACE [--marker NAME] [--skip N] [--top N] [--gap-us N]
"""
import argparse
import collections
import re
import shutil
import subprocess


def demangle(names):
    names = sorted(set(names))
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    run = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    out = run.stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def short(name, width=90):
    # Template arguments and parameter lists say little here: keep the function's own name.
    depth, kept = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
            if depth == 1:
                kept.append("<>" if ch == "<" else "()")
            continue
        if ch in ">)":
            depth -= 1
            continue
        if depth == 0:
            kept.append(ch)
    s = "".join(kept).replace("void ", "")
    # Tessera's generic launchers (for_each_index, plane reductions) run a lambda: name the
    # function that holds it, the first tessera::cuda function among the template arguments.
    inner = re.findall(r"tessera::cuda::(?:\(anonymous namespace\)::)?(\w+)<", name)
    inner = [n for n in inner if n not in ("for_each_index", "for_each_plane_row_col",
                                          "launch_plane_reduce", "chunk_reduce")]
    if inner and inner[0] not in s:
        s += " [" + inner[0] + "]"
    return s if len(s) <= width else s[:width - 3] + "..."


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--marker", default="cross_entropy")
    p.add_argument("--skip", type=int, default=1, help="steps left out at the start (warm-up)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--gap-us", type=float, default=20.0, help="idle gaps listed from this long")
    a = p.parse_args()

    kernels, copies, api = [], [], []
    for line in open(a.trace, errors="replace"):
        f = line.rstrip("\n").split(" ", 4)
        if f[0] == "K":
            kernels.append((int(f[1]), int(f[2]), int(f[3]), f[4]))
        elif f[0] in ("M", "S"):
            what = ("copy kind " + f[4].split()[0]) if f[0] == "M" else "memset"
            copies.append((int(f[1]), int(f[2]), int(f[3]), what))
        elif f[0] == "A":
            api.append((int(f[1]), int(f[2]), f[4]))
    names = demangle([k[3] for k in kernels])
    gpu = sorted([(s, e, st, short(names[n])) for s, e, st, n in kernels] + copies)
    api.sort()
    marks = sorted(s for s, e, st, n in kernels if a.marker in names[n])
    if len(marks) < a.skip + 2:
        raise SystemExit(f"trace_report: {len(marks)} '{a.marker}' kernels: too few steps")
    windows = list(zip(marks[a.skip:-1], marks[a.skip + 1:]))
    steps = len(windows)
    begin, end = windows[0][0], windows[-1][1]
    print(f"{steps} steps (from one '{a.marker}' kernel to the next), {len(gpu)} GPU records")

    per_name = collections.defaultdict(lambda: [0, 0])
    busy = 0
    gaps = []
    last_end = None
    last_name = ""
    for s, e, st, n in gpu:
        if e <= begin or s >= end:
            continue
        per_name[n][0] += e - s
        per_name[n][1] += 1
        if last_end is not None and s > last_end:
            gaps.append((s - last_end, last_end, s, last_name, n))
        busy += max(0, e - max(s, last_end or s))
        if last_end is None or e > last_end:
            last_end, last_name = e, n
    span = end - begin
    idle = sum(g[0] for g in gaps)
    print(f"per step: {span / steps / 1e6:.2f} ms from marker to marker, GPU busy "
          f"{busy / steps / 1e6:.2f} ms, idle {idle / steps / 1e6:.2f} ms "
          f"({100 * idle / span:.1f}%)")
    print(f"\nkernels and copies by time per step (top {a.top}):")
    print(f"{'ms/step':>8} {'calls':>6} {'us/call':>8}  name")
    for n, (t, c) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"{t / steps / 1e6:8.3f} {c / steps:6.1f} {t / c / 1e3:8.1f}  {n}")

    long_gaps = [g for g in gaps if g[0] >= a.gap_us * 1e3]
    print(f"\nidle gaps of {a.gap_us:.0f} us or more: {len(long_gaps) / steps:.1f} per step, "
          f"{sum(g[0] for g in long_gaps) / steps / 1e6:.2f} ms per step; the longest "
          f"(what the host ran during each, longest calls first):")
    for d, s, e, before, after in sorted(long_gaps, reverse=True)[:a.top]:
        inside = collections.defaultdict(int)
        for as_, ae, an in api:
            if ae > s and as_ < e:
                inside[an] += min(ae, e) - max(as_, s)
        calls = ", ".join(f"{n} {t / 1e3:.0f}" for n, t in
                          sorted(inside.items(), key=lambda kv: -kv[1])[:4])
        print(f"{d / 1e3:8.1f} us after {before[:45]} | before {after[:45]} | host: {calls}")


if __name__ == "__main__":
    main()
