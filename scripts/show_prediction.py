#!/usr/bin/python3
"""Draws a segmentation prediction beside its image and, where known, the true labels.

Usage: show_prediction.py PRED.h5 [--input IMAGES.h5] [--image K] [--max-pixels 1024] OUT.png

Panels, left to right: image K of --input (/images [N, C, H, W], float or uint8; one channel in
grey, three or more as RGB from the first three, two as the first in grey), the prediction
(PRED.h5 /labels [N, H, W] of integers, or else the argmax over classes of /probabilities or
/logits [N, K, H, W]) in a categorical colour map, and, when --input has /labels [N, H, W], the
true labels and where the prediction differs from them. Float images outside [0, 1] are scaled
to it.

Images of any size: every panel is read with an integer stride, the smallest that leaves at most
--max-pixels rows and columns (dset[k, :, ::s, ::s]), so that a 50k x 50k image is never read
whole; the title gives the stride. Panels of different sizes (a model whose output is smaller
than its input) are drawn over the same extent, in the input's pixel coordinates.

Exit status: 0 drawn, 1 OUT.png could not be written, 2 bad input (missing file or dataset,
wrong shape or dtype, K out of range).
"""

import argparse
import math
import os
import sys

import h5py
import numpy as np

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402


class Malformed(Exception):
    """Bad input: exit 2."""


def open_h5(path):
    if not os.path.exists(path):
        raise Malformed(f"'{path}' does not exist")
    try:
        if os.path.isdir(path) or not h5py.is_hdf5(path):
            raise Malformed(f"'{path}' is not an HDF5 file")
        return h5py.File(path, "r")
    except OSError as e:
        raise Malformed(f"cannot open '{path}' as HDF5: {e}")


def dataset(f, name, path, ndim, kinds):
    d = f.get(name)
    if not isinstance(d, h5py.Dataset):
        return None
    if d.ndim != ndim or d.dtype.kind not in kinds:
        raise Malformed(f"'{path}': /{name} is {d.dtype} {list(d.shape)}, expected "
                        f"{ndim} dimensions of {'integers' if kinds == 'iu' else 'numbers'}")
    return d


def stride_for(shape, max_pixels):
    return max(1, math.ceil(max(shape) / max_pixels))


def sample(d, k, path):
    if not 0 <= k < d.shape[0]:
        raise Malformed(f"'{path}': --image {k} is out of range: /{d.name.lstrip('/')} holds "
                        f"{d.shape[0]} image(s)")


def read_prediction(f, path, k, max_pixels):
    """(labels [h, w], full (H, W), stride, what, classes or None) of image k."""
    scores = {name: dataset(f, name, path, 4, "fiu") for name in ("probabilities", "logits")}
    classes = next((d.shape[1] for d in scores.values() if d is not None), None)
    labels = dataset(f, "labels", path, 3, "iu")
    if labels is not None:
        sample(labels, k, path)
        s = stride_for(labels.shape[1:], max_pixels)
        return labels[k, ::s, ::s], labels.shape[1:], s, "/labels", classes
    for name, d in scores.items():
        if d is not None:
            sample(d, k, path)
            s = stride_for(d.shape[2:], max_pixels)
            return np.argmax(d[k, :, ::s, ::s], axis=0), d.shape[2:], s, \
                f"argmax of /{name}", classes
    raise Malformed(f"'{path}' has no prediction: neither /labels [N, H, W] nor /probabilities "
                    f"(or /logits) [N, K, H, W]")


def read_image(d, k, path, max_pixels):
    """(RGB or grey [h, w(, 3)] in [0, 1], full (H, W), stride) of image k."""
    sample(d, k, path)
    s = stride_for(d.shape[2:], max_pixels)
    channels = slice(0, 3) if d.shape[1] >= 3 else slice(0, 1)
    a = d[k, channels, ::s, ::s]
    if d.dtype == np.uint8:
        a = a.astype(np.float32) / 255
    else:
        a = a.astype(np.float64)
        if not np.all(np.isfinite(a)):
            raise Malformed(f"'{path}': image {k} holds NaN or infinity")
        lo, hi = float(a.min()), float(a.max())
        if lo < 0 or hi > 1:
            a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
    a = np.moveaxis(a, 0, -1)
    return (a[..., 0] if a.shape[-1] == 1 else a), d.shape[2:], s


def class_colours(n):
    base = plt.get_cmap("tab10" if n <= 10 else "tab20")
    if n <= 20:
        return ListedColormap([base(i) for i in range(n)])
    return ListedColormap(plt.get_cmap("nipy_spectral")(np.linspace(0, 1, n)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pred", metavar="PRED.h5")
    ap.add_argument("out", metavar="OUT.png")
    ap.add_argument("--input", metavar="IMAGES.h5", help="the images (and true labels)")
    ap.add_argument("--image", metavar="K", type=int, default=0, help="which image (default 0)")
    ap.add_argument("--max-pixels", type=int, default=1024,
                    help="read at most this many rows and columns per panel (default 1024)")
    args = ap.parse_args()
    if args.max_pixels < 1:
        ap.error("--max-pixels must be at least 1")

    k = args.image
    panels = []  # (title, array, kind)
    try:
        with open_h5(args.pred) as f:
            pred, size, stride, what, classes = read_prediction(f, args.pred, k,
                                                                args.max_pixels)
        strides = [stride]
        truth = None
        if args.input:
            with open_h5(args.input) as f:
                images = dataset(f, "images", args.input, 4, "fiu")
                if images is None:
                    raise Malformed(f"'{args.input}' has no /images [N, C, H, W]")
                image, image_size, s = read_image(images, k, args.input, args.max_pixels)
                panels.append((f"image {k} ({images.shape[1]} channel"
                               f"{'s' if images.shape[1] > 1 else ''})", image, "image"))
                strides.append(s)
                labels = dataset(f, "labels", args.input, 3, "iu")
                if labels is not None:
                    sample(labels, k, args.input)
                    if tuple(labels.shape[1:]) != tuple(size):
                        raise Malformed(f"'{args.input}': /labels is {list(labels.shape[1:])} "
                                        f"per image, the prediction {list(size)}")
                    truth = labels[k, ::stride, ::stride]
    except Malformed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    extent_size = image_size if args.input else size
    # The classes: from the scores' shape where there are scores, else those seen (at least 2).
    seen = int(max(pred.max(), truth.max() if truth is not None else 0)) + 1
    classes = max(classes or 2, seen)
    panels.append((f"prediction ({what})", pred, "labels"))
    if truth is not None:
        panels.append(("true labels", truth, "labels"))
        wrong = pred != truth
        panels.append((f"prediction != label: {100 * wrong.mean():.2f}%", wrong, "wrong"))

    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 1, 4), squeeze=False,
                             layout="constrained")
    cmap = class_colours(classes)
    for ax, (title, a, kind) in zip(axes[0], panels):
        extent = (0, extent_size[1], extent_size[0], 0)  # the input's pixel coordinates
        if kind == "image":
            ax.imshow(a, cmap="gray" if a.ndim == 2 else None, vmin=0, vmax=1, extent=extent,
                      interpolation="nearest")
        elif kind == "labels":
            im = ax.imshow(a, cmap=cmap, vmin=-0.5, vmax=classes - 0.5, extent=extent,
                           interpolation="nearest")
        else:
            ax.imshow(a, cmap=ListedColormap(["white", "crimson"]), vmin=0, vmax=1,
                      extent=extent, interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    if classes <= 20:
        fig.colorbar(im, ax=axes[0].tolist(), ticks=range(classes), shrink=0.8, label="class")
    if max(strides) == 1:
        stride_note = "every pixel"
    elif len(set(strides)) == 1:
        stride_note = f"stride {stride}: one row and column in {stride}"
    else:
        stride_note = f"stride {strides[1]} for the image, {stride} for the labels"
    sizes = f"{size[0]}x{size[1]}"
    if args.input and tuple(image_size) != tuple(size):
        sizes = f"image {image_size[0]}x{image_size[1]}, prediction {sizes}"
    fig.suptitle(f"{os.path.basename(args.pred)}, image {k}: {sizes} ({stride_note})",
                 fontsize=11)
    try:
        fig.savefig(args.out, dpi=100)
    except OSError as e:
        print(f"error: cannot write '{args.out}': {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: image {k} of {args.pred}, {sizes}, {classes} classes, {stride_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
