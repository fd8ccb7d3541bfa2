#!/usr/bin/python3
"""How far is "patch and blend" from the exact prediction? And Tessera's?

Usage: seam_compare.py WEIGHTS [MODEL.json] --images IMAGES.h5 --patch P --overlap O
                       [--image K] [--tessera PRED.h5] [--json OUT.json]

WEIGHTS: a Tessera checkpoint, a checkpoint directory (its highest step) or a params file
(then MODEL.json is required). The model must be a segmentation model (output [N, K, H', W']).

Image K of IMAGES.h5 (/images [N, C, H, W], float or uint8 scaled to [0, 1]) is predicted in
PyTorch, in float64, with the model in eval mode:
  exact            the whole image in one forward pass: the reference;
  patch-and-blend  the usual way around memory limits: P x P patches overlapping by O (the last
                   patch of a row or column moved back to end at the image's edge), each
                   predicted alone (so with the model's zero padding at the patch's border),
                   their class probabilities blended with linear (tent) weights over the
                   overlap, then the argmax;
  tessera          (--tessera) a Tessera prediction file's image K: /probabilities [N, K, H', W'],
                   or /logits, to which softmax is applied.
For each it reports max and mean |probability - exact| (over every class and pixel) and the
fraction of pixels whose label (argmax) differs from the exact one, over the whole output and
over the seams: the output pixels within the model's receptive-field radius (per axis, from
its layers) of a patch border inside the image, where a patch's padding replaces real pixels.
Away from the seams, patch-and-blend equals the exact answer to rounding (also reported).

P and P - O must be multiples of the model's output stride (2 for a model that halves the
image). The exact reference needs the whole image's activations in memory.

Exit status: 0 compared, 1 OUT.json could not be written, 2 bad input (missing file or
dataset, a model that does not fit, sizes that do not divide).
"""

import argparse
import json
import math
import sys
from pathlib import Path

import h5py
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tessera_torch as tt  # noqa: E402
from tessera_torch import Malformed  # noqa: E402


def read_image(path, k):
    with tt.open_h5(path) as f:
        d = f.get("images")
        if not isinstance(d, h5py.Dataset) or d.ndim != 4:
            raise Malformed(f"'{path}' has no /images [N, C, H, W]")
        if not 0 <= k < d.shape[0]:
            raise Malformed(f"--image {k} is out of range: '{path}' holds {d.shape[0]} images")
        a = d[k]
    if a.dtype == np.uint8:
        a = a.astype(np.float64) / 255
    elif a.dtype.kind == "f":
        a = a.astype(np.float64)
    else:
        raise Malformed(f"'{path}': /images holds {a.dtype}, expected float32, float64 or uint8")
    if not np.all(np.isfinite(a)):
        raise Malformed(f"'{path}': image {k} holds NaN or infinity")
    return torch.from_numpy(a)[None]


def receptive_window(net):
    """(before, after), each (rows, columns): output pixel o of the model reads input pixels
    from o * S - before to o * S + after (S its output stride), from the layers' windows along
    the deepest path (real-valued bounds, so an upper bound where strides do not divide)."""
    window = {"input": (np.zeros(2), np.zeros(2), np.ones(2))}  # name -> (before, after, jump)

    def pair(v):
        return np.array(v if isinstance(v, tuple) else (v, v), dtype=float)

    for name, kind, inputs, _ in net.tessera_graph:
        before = np.max([window[n][0] for n in inputs], axis=0)
        after = np.max([window[n][1] for n in inputs], axis=0)
        j = window[inputs[0]][2]
        m = net[name]
        if kind in ("conv2d", "maxpool2d", "avgpool2d"):
            # Output pixel o reads the input's o * s - pad_before + t * d, t < k.
            k, s = pair(m.kernel_size), pair(m.stride)
            d = pair(m.dilation) if kind != "avgpool2d" else np.ones(2)
            pad = pair(m.padding)
            if kind == "conv2d" and m.uneven_pad is not None:
                left, right, top, bottom = m.uneven_pad
                pad = np.array([top, left], dtype=float)
            before, after, j = before + j * pad, after + j * (d * (k - 1) - pad), j * s
        elif kind == "conv_transpose2d":
            # Output pixel o gets input i when i * s - p + t = o, t < k.
            k, s, p = pair(m.kernel_size), pair(m.stride), pair(m.padding)
            before, after, j = before + j * (k - 1 - p) / s, after + j * p / s, j / s
        elif kind == "upsample_nearest":
            sc = pair(m.scale_factor)
            before, j = before + j * (sc - 1) / sc, j / sc
        elif kind in ("global_avgpool", "linear"):
            raise Malformed("seam_compare needs a segmentation model (output [N, K, H, W]); "
                            f"layer '{name}' ({kind}) sees the whole image")
        window[name] = (before, after, j)
    before, after, _ = window[net.tessera_graph[-1][0]]
    return tuple(int(math.ceil(v)) for v in before), tuple(int(math.ceil(v)) for v in after)


def starts(size, patch, step):
    """Patch origins along one axis: every `step`, the last one ending at the edge."""
    if size <= patch:
        return [0]
    out = list(range(0, size - patch, step))
    return out + [size - patch]


def tent(length, ramp):
    """Weights of one patch along one axis: rising over `ramp` pixels at each end, 1 between."""
    i = np.arange(length, dtype=np.float64)
    return np.minimum(1.0, np.minimum(i + 1, length - i) / (ramp + 1))


def predict(net, x):
    with torch.no_grad():
        return torch.softmax(net(x), dim=1)


def patch_and_blend(net, x, patch, overlap, scale, out_shape, batch=16):
    """Blended probabilities [K, H', W'], the patch origins per axis and the weights."""
    _, _, h, w = x.shape
    ph, pw = min(patch, h), min(patch, w)
    ys, xs = starts(h, ph, patch - overlap), starts(w, pw, patch - overlap)
    sy, sx = scale
    oh, ow = ph // sy, pw // sx
    wy, wx = tent(oh, overlap // sy), tent(ow, overlap // sx)
    weight = np.outer(wy, wx)
    k = out_shape[0]
    total = np.zeros(out_shape)
    norm = np.zeros(out_shape[1:])
    origins = [(y, x0) for y in ys for x0 in xs]
    for b in range(0, len(origins), batch):
        chunk = origins[b:b + batch]
        probs = predict(net, torch.cat([x[:, :, y:y + ph, x0:x0 + pw] for y, x0 in chunk]))
        if tuple(probs.shape[1:]) != (k, oh, ow):
            raise Malformed(f"a {ph}x{pw} patch gives an output of {probs.shape[2]}x"
                            f"{probs.shape[3]}, not {oh}x{ow} (the image's {sy}x{sx} output "
                            f"stride): choose another --patch")
        for (y, x0), p in zip(chunk, probs.numpy()):
            oy, ox = y // sy, x0 // sx
            total[:, oy:oy + oh, ox:ox + ow] += p * weight
            norm[oy:oy + oh, ox:ox + ow] += weight
    return total / norm, (ys, xs), (ph, pw)


def seam_mask(size, origins, patch, scale, before, after, out_size):
    """Output indices along one axis whose input window crosses a patch border inside the
    image (where a patch's zero padding replaces real pixels)."""
    borders = sorted({y for y in origins if y > 0} | {y + patch for y in origins
                                                     if y + patch < size})
    anchor = np.arange(out_size) * scale
    near = np.zeros(out_size, dtype=bool)
    for b in borders:  # the border lies between input pixels b - 1 and b
        near |= (anchor - before <= b - 1) & (anchor + after >= b)
    return near


def stats(probs, exact, mask):
    diff = np.abs(probs - exact)
    flips = probs.argmax(axis=0) != exact.argmax(axis=0)

    def over(m):
        if not m.any():
            return {"max_abs_prob_diff": 0.0, "mean_abs_prob_diff": 0.0,
                    "label_diff_fraction": 0.0, "pixels": 0}
        return {"max_abs_prob_diff": float(diff[:, m].max()),
                "mean_abs_prob_diff": float(diff[:, m].mean()),
                "label_diff_fraction": float(flips[m].mean()), "pixels": int(m.sum())}
    return {"all": over(np.ones_like(mask)), "seams": over(mask), "away": over(~mask)}


def read_tessera(path, k, shape):
    with tt.open_h5(path) as f:
        for name in ("probabilities", "logits"):
            d = f.get(name)
            if isinstance(d, h5py.Dataset):
                break
        else:
            raise Malformed(f"'{path}' has neither /probabilities nor /logits [N, K, H, W]")
        if d.ndim != 4 or d.dtype.kind != "f":
            raise Malformed(f"'{path}': /{name} is {d.dtype} {list(d.shape)}, expected "
                            f"floating point [N, K, H, W]")
        if not 0 <= k < d.shape[0]:
            raise Malformed(f"--image {k} is out of range: '{path}' holds {d.shape[0]} images")
        if tuple(d.shape[1:]) != tuple(shape):
            raise Malformed(f"'{path}': /{name} is {list(d.shape[1:])} per image, the model's "
                            f"output {list(shape)}")
        a = d[k].astype(np.float64)
    if name == "logits":
        a = torch.softmax(torch.from_numpy(a), dim=0).numpy()
    return a, name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("weights", metavar="WEIGHTS", help="checkpoint, its directory, or params file")
    ap.add_argument("model", metavar="MODEL.json", nargs="?",
                    help="the model (required with a params file)")
    ap.add_argument("--images", required=True, metavar="IMAGES.h5")
    ap.add_argument("--image", type=int, default=0, metavar="K", help="which image (default 0)")
    ap.add_argument("--patch", type=int, required=True, metavar="P", help="patch side, pixels")
    ap.add_argument("--overlap", type=int, required=True, metavar="O",
                    help="overlap of neighbouring patches, pixels (0 <= O < P)")
    ap.add_argument("--tessera", metavar="PRED.h5",
                    help="also compare a Tessera prediction (/probabilities or /logits)")
    ap.add_argument("--json", metavar="OUT.json", help="write the results as JSON")
    args = ap.parse_args()
    if args.patch < 1 or not 0 <= args.overlap < args.patch:
        ap.error("needs --patch >= 1 and 0 <= --overlap < --patch")

    try:
        net, info = tt.build_from_file(args.weights, args.model, dtype=torch.float64)
        before, after = receptive_window(net)
        x = read_image(args.images, args.image)
        _, c, h, w = x.shape
        with torch.no_grad():
            try:
                exact = predict(net, x)[0].numpy()
            except Malformed as e:
                raise Malformed(f"image {args.image} of '{args.images}': {e}") from None
        k, oh, ow = exact.shape
        if h % oh or w % ow:
            raise Malformed(f"the model's output ({oh}x{ow}) is not the image ({h}x{w}) "
                            f"scaled down by an integer: choose an image size that divides")
        scale = (h // oh, w // ow)
        for axis, s, size in (("rows", scale[0], h), ("columns", scale[1], w)):
            if min(args.patch, size) % s or (args.patch - args.overlap) % s or args.overlap % s:
                raise Malformed(f"--patch and --overlap must be multiples of the output stride "
                                f"{s} along the {axis}")
        blended, (ys, xs), (ph, pw) = patch_and_blend(net, x, args.patch, args.overlap, scale,
                                                      exact.shape)
        mask = (seam_mask(h, ys, ph, scale[0], before[0], after[0], oh)[:, None]
                | seam_mask(w, xs, pw, scale[1], before[1], after[1], ow)[None, :])
        results = {"patch_and_blend": stats(blended, exact, mask)}
        if args.tessera:
            tess, dataset = read_tessera(args.tessera, args.image, exact.shape)
            results["tessera"] = stats(tess, exact, mask)
    except Malformed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    model = info["model"]
    report = {
        "model": model.get("name"), "weights": str(info["path"]), "images": args.images,
        "image": args.image, "input": [c, h, w], "output": [k, oh, ow],
        "output_stride": list(scale), "patch": args.patch, "overlap": args.overlap,
        "patches": [len(ys), len(xs)],
        "receptive_field_radius": [max(before[0], after[0]), max(before[1], after[1])],
        "receptive_field_window": {"before": list(before), "after": list(after)},
        "seam_pixels": int(mask.sum()), "pixels": oh * ow, **results}
    print(f"seam_compare: model '{model.get('name', '?')}' ({info['path']}), image "
          f"{args.image} of {args.images}: {c}x{h}x{w} -> {k}x{oh}x{ow}")
    print(f"  {len(ys)}x{len(xs)} patches of {ph}x{pw} overlapping by {args.overlap}; "
          f"receptive field: {before[0]} rows above, {after[0]} below, {before[1]} "
          f"columns left, {after[1]} right; seams: "
          f"{int(mask.sum())} of {oh * ow} output pixels")
    rows = [("method", "pixels", "max |p - exact|", "mean |p - exact|", "labels differ")]
    for method, r in results.items():
        label = method.replace("_", "-") + (f" (/{dataset})" if method == "tessera" else "")
        for where in ("all", "seams", "away"):
            s = r[where]
            rows.append((label if where == "all" else "", f"{where} ({s['pixels']})",
                         f"{s['max_abs_prob_diff']:.3e}", f"{s['mean_abs_prob_diff']:.3e}",
                         f"{100 * s['label_diff_fraction']:.3f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(v.ljust(n) for v, n in zip(r, widths)).rstrip())
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        except OSError as e:
            print(f"error: cannot write '{args.json}': {e.strerror}", file=sys.stderr)
            return 1
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
