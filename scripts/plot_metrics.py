#!/usr/bin/python3
"""Draws the loss and quality curves of a `tessera train --metrics` file into a PNG.

Usage: scripts/plot_metrics.py METRICS.csv|METRICS.jsonl OUT.png
Left: loss (train per log interval, validation per epoch). Right: mean IoU for segmentation,
accuracy for classification.
"""
import csv
import json
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    if path.endswith(".json") or path.endswith(".jsonl"):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    with open(path) as f:
        return list(csv.DictReader(f))


def series(rows, split, key):
    xs, ys = [], []
    for r in rows:
        if r["split"] != split or r.get(key) in (None, ""):
            continue
        xs.append(int(r["step"]))
        ys.append(float(r[key]))
    return xs, ys


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    rows = read(argv[1])
    if not rows:
        print(f"error: {argv[1]} holds no metrics", file=sys.stderr)
        return 1
    segmentation = any(r.get("mean_iou") not in (None, "") for r in rows)
    quality = "mean_iou" if segmentation else "accuracy"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for split, style in (("train", "-"), ("val", "o-")):
        left.plot(*series(rows, split, "loss"), style, label=split)
        right.plot(*series(rows, split, quality), style, label=split)
    left.set(xlabel="step", ylabel="loss", title="loss")
    right.set(xlabel="step", ylabel=quality.replace("_", " "),
              title="mean IoU" if segmentation else "accuracy")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(argv[2], dpi=100)
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
