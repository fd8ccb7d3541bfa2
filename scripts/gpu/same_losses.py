#!/usr/bin/env python3
"""Checks that two `tessera train --metrics` files agree: the train and validation losses of the
steps given, each present in both, within a relative tolerance. An uninterrupted run against one
stopped and resumed from its checkpoint (scripts/gpu/verify.sh): the validation loss reads batch
norm's running statistics, which a checkpoint must carry across.

Usage: same_losses.py A.jsonl B.jsonl STEP... [--rtol R]   (exit 1 on a difference)
"""
import argparse
import json
import sys


def losses(path):
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[(r["split"], r["step"])] = r["loss"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("steps", type=int, nargs="+")
    p.add_argument("--rtol", type=float, default=1e-5)
    args = p.parse_args()
    a, b = losses(args.a), losses(args.b)
    bad = 0
    for step in args.steps:
        for split in ("train", "val"):
            key = (split, step)
            if key not in a or key not in b:
                if split == "train" or key in a or key in b:
                    print(f"same_losses: {split} step {step} missing from "
                          f"{args.a if key not in a else args.b}")
                    bad += 1
                continue
            x, y = a[key], b[key]
            ok = abs(x - y) <= args.rtol * max(abs(x), abs(y))
            print(f"same_losses: {split} step {step}: {x!r} and {y!r} {'agree' if ok else 'DIFFER'}")
            bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
