#!/usr/bin/python3
"""Check a `tessera gradcheck` dump against PyTorch, independently of Tessera's own kernels.

Usage: check_with_pytorch.py DUMP.h5 [--rtol X] [--which sharded|reference]

The dump holds the initial parameters, the batch, and the loss, logits, dL/dimages and
parameter gradients of a sharded run (/sharded) and of a single-rank run (/reference). This
script rebuilds the model from the dump's model JSON in PyTorch, in float64 whatever the run's
dtype, recomputes all of those, and compares them with /sharded (or /reference).

Relative error = max |dump - torch| / max |torch|, per quantity. Default rtol is 1e-4 for a
float32 run and 1e-9 for a float64 run.

Exit status: 0 all within rtol, 1 some quantity is not, 2 the file is malformed (missing
group, dataset or attribute, unknown layer type, inconsistent shapes, ...).

Adding a layer type is one function decorated with @layer (see conv2d and relu below).
"""

import argparse
import json
import sys

import h5py
import numpy as np
import torch
import torch.nn.functional as F

FORMAT = "tessera-gradcheck-1"
DEFAULT_RTOL = {"float32": 1e-4, "float64": 1e-9}


class Malformed(Exception):
    """The dump (or its model JSON) is not what this script can check: exit 2, not 1."""


# --------------------------------------------------------------------------------------------
# Layer types. Each is one function (spec, inputs, param) -> output tensor, where `inputs` is
# the list of input tensors (the previous layer's output unless the layer names "inputs"), and
# `param(name)` returns /params/<layer>/<name> as a float64 leaf whose gradient is compared
# with /<which>/grads/<layer>/<name>. `fields` lists the JSON fields the type accepts, so a
# field this script does not understand is reported rather than silently ignored.

LAYERS = {}


def layer(type_name, fields=()):
    def register(fn):
        LAYERS[type_name] = (fn, {"name", "type", "inputs", *fields})
        return fn
    return register


def single_input(inputs):
    if len(inputs) != 1:
        raise Malformed(f"takes one input, got {len(inputs)}")
    return inputs[0]


def int_pair(spec, field, default, minimum):
    """An int or [h, w] field, as (h, w)."""
    v = spec.get(field, default)
    pair = v if isinstance(v, list) else [v, v]
    # bool is an int in Python; `true` is never a valid size.
    if len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= minimum
                                 for x in pair):
        raise Malformed(f"field '{field}' must be an integer >= {minimum} or [h, w], got {v!r}")
    return tuple(pair)


@layer("conv2d", fields=("out_channels", "kernel", "stride", "padding", "dilation", "bias"))
def conv2d(spec, inputs, param):
    x = single_input(inputs)
    if "out_channels" not in spec or "kernel" not in spec:
        raise Malformed("needs fields 'out_channels' and 'kernel'")
    out_channels = int_pair(spec, "out_channels", None, 1)[0]
    kernel = int_pair(spec, "kernel", None, 1)
    stride = int_pair(spec, "stride", 1, 1)
    dilation = int_pair(spec, "dilation", 1, 1)
    padding = spec.get("padding", 0)
    if padding == "valid":
        pad = [(0, 0), (0, 0)]
    elif padding == "same":
        # PyTorch's rule (and Tessera's): total = dilation * (kernel - 1), the smaller half first.
        # Spelled out with F.pad rather than padding='same' so the rule itself is checked.
        if stride != (1, 1):
            raise Malformed("padding 'same' needs stride 1")
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        pad = [(t // 2, t - t // 2) for t in totals]
    elif isinstance(padding, str):
        raise Malformed(f"field 'padding' must be an integer, [h, w], 'same' or 'valid', "
                        f"got {padding!r}")
    else:
        pad = [(p, p) for p in int_pair(spec, "padding", 0, 0)]
    bias = spec.get("bias", True)
    if not isinstance(bias, bool):
        raise Malformed(f"field 'bias' must be true or false, got {bias!r}")

    # Check the dump's shapes here so that a mismatch is reported against the layer, rather
    # than as a bare error from inside F.conv2d.
    w = param("weight", (out_channels, x.shape[1], *kernel))
    b = param("bias", (out_channels,)) if bias else None
    (top, bottom), (left, right) = pad
    x = F.pad(x, (left, right, top, bottom))  # F.pad lists the last axis first
    return F.conv2d(x, w, b, stride=stride, padding=0, dilation=dilation)


@layer("relu")
def relu(spec, inputs, param):
    return F.relu(single_input(inputs))


# --------------------------------------------------------------------------------------------
# Losses: (logits, labels) -> scalar.

def pixel_cross_entropy(logits, labels):
    # Out-of-range labels would make cross_entropy raise mid-computation; say which file is bad.
    n, c, h, w = logits.shape
    if tuple(labels.shape) != (n, h, w):
        raise Malformed(f"/batch/labels has shape {tuple(labels.shape)}, the model output "
                        f"needs {(n, h, w)}")
    if labels.numel() and (labels.min() < 0 or labels.max() >= c):
        raise Malformed(f"/batch/labels holds values outside [0, {c})")
    return F.cross_entropy(logits, labels.long(), reduction="mean")


LOSSES = {"pixel_cross_entropy": pixel_cross_entropy}


# --------------------------------------------------------------------------------------------
# Reading the dump.

def text_attr(f, key):
    if key not in f.attrs:
        raise Malformed(f"missing root attribute '{key}'")
    v = f.attrs[key]
    # The C++ writer may store fixed- or variable-length strings, scalar or as a 1-element
    # array; h5py hands these back as str, bytes or arrays of either.
    if isinstance(v, np.ndarray) and v.size == 1:
        v = v.reshape(()).item()
    if isinstance(v, (bytes, np.bytes_)):
        v = v.decode()
    if not isinstance(v, str):
        raise Malformed(f"root attribute '{key}' must be a string, got {v!r}")
    return v


def read(f, path, kind="f"):
    """A dataset as a numpy array; kind 'f' for floating point, 'i' for integer data."""
    obj = f.get(path)
    if not isinstance(obj, h5py.Dataset):
        raise Malformed(f"missing dataset '{path}'")
    a = np.asarray(obj[()])
    if a.dtype.kind not in ("f" if kind == "f" else "iu"):
        raise Malformed(f"dataset '{path}' has dtype {a.dtype}, expected "
                        f"{'floating point' if kind == 'f' else 'integer'} data")
    return a


def dataset_names(f, path):
    """'a/b' paths of all datasets under a group (empty if the group is absent: a model
    without parameters need not write one; a parameter the model does use is looked up
    on its own and reported missing there)."""
    group = f.get(path)
    if not isinstance(group, h5py.Group):
        return set()
    names = []
    group.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset)
                     else None)
    return set(names)


def parse_model(text):
    try:
        model = json.loads(text)
    except json.JSONDecodeError as e:
        raise Malformed(f"root attribute 'model' is not valid JSON: {e}")
    if not isinstance(model, dict) or not isinstance(model.get("layers"), list) \
            or not model["layers"]:
        raise Malformed("the model must be a JSON object with a non-empty list 'layers'")
    return model


# --------------------------------------------------------------------------------------------
# The PyTorch run.

def run_model(f, model):
    """Forward and backward in float64. Returns {quantity: torch value} using the dump's names."""
    images = torch.from_numpy(read(f, "/batch/images").astype(np.float64)).requires_grad_()
    labels = torch.from_numpy(read(f, "/batch/labels", kind="i").astype(np.int64))
    if images.dim() != 4:
        raise Malformed(f"/batch/images must be [N, C, H, W], got shape {tuple(images.shape)}")
    if model.get("input_channels") != images.shape[1]:
        raise Malformed(f"model input_channels is {model.get('input_channels')!r} but "
                        f"/batch/images has {images.shape[1]} channels")
    loss_name = model.get("loss", "pixel_cross_entropy")
    if loss_name not in LOSSES:
        raise Malformed(f"unknown loss '{loss_name}' (known: {', '.join(LOSSES)})")

    params = {}  # 'layer/name' -> leaf tensor, in the order the model uses them
    outputs = {"input": images}
    previous = "input"
    for index, spec in enumerate(model["layers"], start=1):
        if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
            raise Malformed(f"model layer {index} must be an object with a string 'type'")
        kind = spec["type"]
        name = spec.get("name", f"{kind}{index}")
        where = f"layer '{name}' ({kind})"
        if kind not in LAYERS:
            raise Malformed(f"{where}: unknown layer type '{kind}' "
                            f"(known: {', '.join(sorted(LAYERS))})")
        if name in outputs:
            raise Malformed(f"{where}: the name is used twice")
        fn, fields = LAYERS[kind]
        unknown = sorted(set(spec) - fields)
        if unknown:
            raise Malformed(f"{where}: unknown field(s) {', '.join(unknown)}")
        input_names = spec.get("inputs", [previous])
        missing = [n for n in input_names if n not in outputs]
        if missing:
            raise Malformed(f"{where}: inputs {missing} are not earlier layers")

        def param(pname, shape, layer_name=name):
            path = f"/params/{layer_name}/{pname}"
            value = read(f, path)
            if value.shape != tuple(shape):
                raise Malformed(f"dataset '{path}' has shape {value.shape}, expected "
                                f"{tuple(shape)}")
            t = torch.from_numpy(value.astype(np.float64)).requires_grad_()
            params[f"{layer_name}/{pname}"] = t
            return t

        try:
            outputs[name] = fn(spec, [outputs[n] for n in input_names], param)
        except Malformed as e:
            raise Malformed(f"{where}: {e}") from None
        previous = name

    logits = outputs[previous]
    if logits.dim() != 4:
        raise Malformed(f"the model output must be [N, O, Ho, Wo], got {tuple(logits.shape)}")
    # A parameter in the file that the model never used means the file and the model disagree
    # (e.g. a renamed layer): its gradient would otherwise go unchecked.
    extra = dataset_names(f, "/params") - set(params)
    if extra:
        raise Malformed(f"/params holds {sorted(extra)}, which the model does not use")

    loss = LOSSES[loss_name](logits, labels)
    loss.backward()
    result = {"loss": loss.detach(), "output": logits.detach(), "input_grad": images.grad}
    for key, t in params.items():
        result[f"grads/{key}"] = t.grad
    return result


def compare(f, which, torch_values, rtol):
    """Prints the table; returns True when every quantity is within rtol."""
    extra = dataset_names(f, f"/{which}/grads") - {k[len("grads/"):] for k in torch_values
                                                   if k.startswith("grads/")}
    if extra:
        raise Malformed(f"/{which}/grads holds {sorted(extra)}, which the model does not use")
    dumped = {key: read(f, f"/{which}/{key}") for key in torch_values}  # all read before printing

    rows, ok = [], True
    for key, value in torch_values.items():
        want = value.numpy()
        got = dumped[key].astype(np.float64)
        if got.size == 1 and want.size == 1:
            got = got.reshape(want.shape)  # the loss may be stored as shape () or (1,)
        if got.shape != want.shape:
            rows.append((key, f"{got.shape} vs torch {want.shape}", "-", "shape", "FAIL"))
            ok = False
            continue
        err = float(np.max(np.abs(got - want))) if want.size else 0.0
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        # An all-zero torch value (e.g. a gradient behind dead ReLUs) must be matched exactly.
        rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
        good = rel <= rtol  # False for NaN, so a NaN in the dump fails
        ok &= good
        rows.append((key, "x".join(map(str, want.shape)) or "scalar",
                     f"{err:.3e}", f"{rel:.3e}", "ok" if good else "FAIL"))

    header = ("quantity", "shape", "max abs err", "rel err", "")
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", help="HDF5 file written by `tessera gradcheck`")
    ap.add_argument("--rtol", type=float, default=None,
                    help="max relative error (default 1e-4 for float32 runs, 1e-9 for float64)")
    ap.add_argument("--which", choices=("sharded", "reference"), default="sharded",
                    help="which run in the dump to check (default: sharded)")
    args = ap.parse_args()

    try:
        f = h5py.File(args.dump, "r")
    except OSError as e:
        print(f"error: cannot open {args.dump} as HDF5: {e}", file=sys.stderr)
        return 2
    try:
        with f:
            fmt = text_attr(f, "format")
            if fmt != FORMAT:
                raise Malformed(f"format is '{fmt}', expected '{FORMAT}'")
            grid = text_attr(f, "grid")
            dtype = text_attr(f, "dtype")
            if dtype not in DEFAULT_RTOL:
                raise Malformed(f"dtype is '{dtype}', expected float32 or float64")
            model = parse_model(text_attr(f, "model"))
            rtol = args.rtol if args.rtol is not None else DEFAULT_RTOL[dtype]
            print(f"{args.dump}: model '{model.get('name', '?')}', grid {grid}, {dtype}; "
                  f"checking /{args.which} against PyTorch {torch.__version__} (float64), "
                  f"rtol {rtol:g}")
            # Say which group is missing rather than the first dataset looked up in it.
            for group in ("/batch", f"/{args.which}"):
                if not isinstance(f.get(group), h5py.Group):
                    raise Malformed(f"missing group '{group}'")
            torch_values = run_model(f, model)
            ok = compare(f, args.which, torch_values, rtol)
    except Malformed as e:
        print(f"error: {args.dump}: {e}", file=sys.stderr)
        return 2
    print("PASS" if ok else f"FAIL: some quantity is not within rtol {rtol:g} (see FAIL rows)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
