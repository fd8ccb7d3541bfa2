#!/usr/bin/python3
"""Check a `tessera gradcheck` dump against PyTorch, independently of Tessera's own kernels.

Usage: check_with_pytorch.py DUMP.h5 [--rtol X] [--which sharded|reference]

The dump holds the initial parameters and buffers, the batch, and the loss, logits, dL/dimages,
parameter gradients and updated batch-norm buffers of a sharded run (/sharded) and of a
single-rank run (/reference). This script rebuilds the model from the dump's model JSON in
PyTorch, in float64 whatever the run's dtype, recomputes all of those, and compares them with
/sharded (or /reference). Dropout's random mask cannot be redrawn here, so a training-mode dump
carries the mask Tessera used (/masks/<layer>); it is checked to hold only 0 and 1/(1-p).

Relative error = max |dump - torch| / max |torch|, per quantity. Default rtol is 1e-4 for a
float32 run and 1e-9 for a float64 run.

Exit status: 0 all within rtol, 1 some quantity is not, 2 the file is malformed (missing
group, dataset or attribute, unknown layer type, inconsistent shapes, ...).

Adding a layer type: its fields in tessera_torch.py (LAYER_FIELDS, and its module in make_layer),
and here one function decorated with @layer (see conv2d and relu below).
"""

import argparse
import sys
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.nn.functional as F

# The model JSON's field rules are shared with tessera_torch.py (the nn.Module builder), beside
# this script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tessera_torch import (LAYER_FIELDS, Malformed, batchnorm2d_fields,  # noqa: E402
                           batchnorm2d_values, check_fields, conv2d_geometry,
                           conv_transpose2d_geometry, dataset_names, dropout_p, input_names,
                           layer_header, leaky_relu_slope, linear_fields, linear_input,
                           parse_model, pool_geometry, read, same_shapes, spatial, text_attr,
                           upsample_scale)

FORMAT = "tessera-gradcheck-1"
DEFAULT_RTOL = {"float32": 1e-4, "float64": 1e-9}
MODES = ("train", "eval")


# --------------------------------------------------------------------------------------------
# Layer types. Each is one function (spec, inputs, ctx) -> output tensor, where `inputs` is the
# list of input tensors (the previous layer's output unless the layer names "inputs") and `ctx`
# (a Context, below) gives the layer its parameters, buffers, dropout mask and the mode.
# The JSON fields each type accepts and its number of inputs are tessera_torch.LAYER_FIELDS, so
# a field this script does not understand is reported rather than silently ignored.

LAYERS = {}


def layer(type_name):
    def register(fn):
        assert type_name in LAYER_FIELDS, f"{type_name}: add its fields to LAYER_FIELDS"
        LAYERS[type_name] = fn
        return fn
    return register


@layer("conv2d")
def conv2d(spec, inputs, ctx):
    x = spatial(inputs[0])
    g = conv2d_geometry(spec, tuple(x.shape))
    # Check the dump's shapes here so that a mismatch is reported against the layer, rather
    # than as a bare error from inside F.conv2d.
    w = ctx.param("weight", (g.out_channels, x.shape[1] // g.groups, *g.kernel))
    b = ctx.param("bias", (g.out_channels,), sums_output_grad=(0, 2, 3)) if g.bias else None
    # "same" padding spelled out with F.pad rather than padding='same', so the rule itself
    # (tessera_torch.conv2d_geometry) is checked.
    (top, bottom), (left, right) = g.pad
    x = F.pad(x, (left, right, top, bottom))  # F.pad lists the last axis first
    return F.conv2d(x, w, b, stride=g.stride, padding=0, dilation=g.dilation, groups=g.groups)


@layer("conv_transpose2d")
def conv_transpose2d(spec, inputs, ctx):
    x = spatial(inputs[0])
    g = conv_transpose2d_geometry(spec, tuple(x.shape))
    # PyTorch's ConvTranspose2d layout: [in, out, kh, kw].
    w = ctx.param("weight", (x.shape[1], g.out_channels, *g.kernel))
    b = ctx.param("bias", (g.out_channels,), sums_output_grad=(0, 2, 3)) if g.bias else None
    return F.conv_transpose2d(x, w, b, stride=g.stride, padding=g.padding,
                              output_padding=g.output_padding)


@layer("maxpool2d")
def maxpool2d(spec, inputs, ctx):
    # Padding counts as -inf (never the max). On ties PyTorch's gradient goes to the first
    # maximum in row-major window order.
    x = spatial(inputs[0])
    kernel, stride, padding = pool_geometry(spec, tuple(x.shape))
    return F.max_pool2d(x, kernel, stride=stride, padding=padding, ceil_mode=False)


@layer("avgpool2d")
def avgpool2d(spec, inputs, ctx):
    # Padding counts as zeros in the average (count_include_pad=True): divisor kh * kw always.
    x = spatial(inputs[0])
    kernel, stride, padding = pool_geometry(spec, tuple(x.shape))
    return F.avg_pool2d(x, kernel, stride=stride, padding=padding, ceil_mode=False,
                        count_include_pad=True)


@layer("batchnorm2d")
def batchnorm2d(spec, inputs, ctx):
    x = spatial(inputs[0])
    eps, momentum = batchnorm2d_fields(spec)
    c = x.shape[1]
    batchnorm2d_values(tuple(x.shape), ctx.training)
    weight = ctx.param("weight", (c,))
    bias = ctx.param("bias", (c,), sums_output_grad=(0, 2, 3))
    # In training mode F.batch_norm updates these in place: running = (1 - momentum) * running
    # + momentum * batch statistic, the variance unbiased (n / (n - 1)); they are compared
    # with /<run>/buffers/<layer>/... after the step.
    running_mean = ctx.buffer("running_mean", (c,))
    running_var = ctx.buffer("running_var", (c,))
    return F.batch_norm(x, running_mean, running_var, weight, bias, training=ctx.training,
                        momentum=momentum, eps=eps)


@layer("relu")
def relu(spec, inputs, ctx):
    return F.relu(inputs[0])


@layer("leaky_relu")
def leaky_relu(spec, inputs, ctx):
    return F.leaky_relu(inputs[0], leaky_relu_slope(spec))


@layer("sigmoid")
def sigmoid(spec, inputs, ctx):
    return torch.sigmoid(inputs[0])


@layer("dropout")
def dropout(spec, inputs, ctx):
    x = inputs[0]
    p = dropout_p(spec)
    if not ctx.training or p == 0:
        return x
    return x * ctx.mask(x.shape, p)


@layer("upsample_nearest")
def upsample_nearest(spec, inputs, ctx):
    x = spatial(inputs[0])
    return F.interpolate(x, scale_factor=upsample_scale(spec), mode="nearest")


@layer("concat")
def concat(spec, inputs, ctx):
    same_shapes([t.shape for t in inputs], "inputs must agree in every dimension but channels",
                skip_dim=1)
    return torch.cat(inputs, dim=1)


@layer("add")
def add(spec, inputs, ctx):
    same_shapes([t.shape for t in inputs], "inputs must have the same shape")
    out = inputs[0]
    for t in inputs[1:]:
        out = out + t
    return out


@layer("global_avgpool")
def global_avgpool(spec, inputs, ctx):
    return spatial(inputs[0]).mean(dim=(2, 3))  # [N, C, H, W] -> [N, C]


@layer("linear")
def linear(spec, inputs, ctx):
    x = inputs[0]
    linear_input(tuple(x.shape))
    out_features, bias = linear_fields(spec)
    w = ctx.param("weight", (out_features, x.shape[1]))
    b = ctx.param("bias", (out_features,), sums_output_grad=(0,)) if bias else None
    return F.linear(x, w, b)


assert set(LAYERS) == set(LAYER_FIELDS), "every layer type of tessera_torch needs a function"


# --------------------------------------------------------------------------------------------
# Losses: (logits, labels) -> scalar. Out-of-range labels would make cross_entropy raise
# mid-computation; say which file is bad.

def check_labels(labels, c):
    if labels.numel() and (labels.min() < 0 or labels.max() >= c):
        raise Malformed(f"/batch/labels holds values outside [0, {c})")


def pixel_cross_entropy(logits, labels):
    if logits.dim() != 4:
        raise Malformed(f"pixel_cross_entropy needs a model output [N, C, H, W], got "
                        f"{tuple(logits.shape)}")
    n, c, h, w = logits.shape
    if tuple(labels.shape) != (n, h, w):
        raise Malformed(f"/batch/labels has shape {tuple(labels.shape)}, the model output "
                        f"needs {(n, h, w)}")
    check_labels(labels, c)
    return F.cross_entropy(logits, labels.long(), reduction="mean")


def cross_entropy(logits, labels):
    if logits.dim() not in (2, 4) or squeeze_hw(logits.shape) != tuple(logits.shape[:2]):
        raise Malformed(f"cross_entropy needs a model output [N, C] (or [N, C, 1, 1]), got "
                        f"{tuple(logits.shape)}")
    n, c = logits.shape[:2]
    if tuple(labels.shape) not in ((n,), (n, 1, 1)):
        raise Malformed(f"/batch/labels has shape {tuple(labels.shape)}, the model output "
                        f"needs {(n,)}")
    check_labels(labels, c)
    return F.cross_entropy(logits.reshape(n, c), labels.reshape(n).long(), reduction="mean")


LOSSES = {"pixel_cross_entropy": pixel_cross_entropy, "cross_entropy": cross_entropy}


def squeeze_hw(shape):
    """[N, C, 1, 1] and [N, C] are the same data: the dump may store an image-level tensor
    either way."""
    shape = tuple(shape)
    return shape[:2] if len(shape) == 4 and shape[2:] == (1, 1) else shape


# --------------------------------------------------------------------------------------------
# Reading the dump: text_attr, read, dataset_names and parse_model come from tessera_torch.

# --------------------------------------------------------------------------------------------
# The PyTorch run.

class Context:
    """What a layer function may read from the dump, recording what it used so that unused
    datasets are reported and the used ones compared."""

    def __init__(self, f, layer_name, training, used):
        self.f, self.name, self.training, self.used = f, layer_name, training, used

    def _read(self, path, shape):
        value = read(self.f, path)
        if value.shape != tuple(shape):
            raise Malformed(f"dataset '{path}' has shape {value.shape}, expected {tuple(shape)}")
        return torch.from_numpy(value.astype(np.float64))

    def param(self, pname, shape, sums_output_grad=None):
        """/params/<layer>/<pname> as a float64 leaf; its gradient is compared with
        /<run>/grads/<layer>/<pname>. sums_output_grad: the dimensions over which the layer's
        output gradient is summed to give this one (a bias), so that a gradient that is zero in
        exact arithmetic can be recognised (see ZERO_BY_CANCELLATION)."""
        t = self._read(f"/params/{self.name}/{pname}", shape).requires_grad_()
        self.used["params"][f"{self.name}/{pname}"] = t
        if sums_output_grad is not None:
            self.used["sums"][f"{self.name}/{pname}"] = (self.name, sums_output_grad)
        return t

    def buffer(self, bname, shape):
        """/buffers/<layer>/<bname> (its value before the step) as a float64 tensor the layer
        may update in place; the value after the step is compared with
        /<run>/buffers/<layer>/<bname>."""
        t = self._read(f"/buffers/{self.name}/{bname}", shape)
        self.used["buffers"][f"{self.name}/{bname}"] = t
        return t

    def mask(self, shape, p):
        """The dropout mask Tessera used, /masks/<layer>: 0 or 1/(1-p) per element, shaped like
        the layer's output ([N, C] may be stored as [N, C, 1, 1]). Returns the mask PyTorch
        applies: the dump's pattern of kept elements with the exact scale 1/(1-p), so a wrong
        scale fails the mask's own row (and, where Tessera applied it, everything after)."""
        path = f"/masks/{self.name}"
        if path not in self.f:
            raise Malformed(f"cannot check dropout in training mode: the dump has no '{path}' "
                            f"(the mask Tessera used)")
        dumped = read(self.f, path)
        if squeeze_hw(dumped.shape) != squeeze_hw(shape):
            raise Malformed(f"dataset '{path}' has shape {dumped.shape}, expected "
                            f"{tuple(shape)} (the layer's output)")
        kept = torch.from_numpy(dumped.reshape(tuple(shape)) != 0)
        scale = 0.0 if p == 1 else 1 / (1 - p)  # p = 1 drops everything
        expected = kept.to(torch.float64) * scale
        self.used["masks"][self.name] = expected
        return expected


class Quantity:
    """One row of the table. path: in the dump, relative to /<run> unless absolute. flexible:
    [N, C] and [N, C, 1, 1] match. summands: for a gradient that sums the layer's output
    gradient, max over channels of sum |dL/d(output)|."""

    def __init__(self, key, path, value, flexible=False, summands=None):
        self.key, self.path, self.value = key, path, value
        self.flexible, self.summands = flexible, summands


# A bias gradient this much smaller than its summands is zero in exact arithmetic: a conv's
# bias feeding a training-mode batch norm, which subtracts the per-channel mean. PyTorch and
# Tessera then both hold rounding noise (~1e-17 of the summands in float64, ~1e-8 in float32),
# and noise / noise says nothing, so such a row is measured against the summands instead.
# A real (non-cancelling) bias gradient is never this small next to its own summands.
ZERO_BY_CANCELLATION = 1e-10

# A batch norm's running mean is measured against at least this fraction of the layer's standard
# deviation (the square root of its largest running variance), as tessera gradcheck does in
# float64 (1e-1 in float32; here 1e-3 for both: a float32 dump's noise is ~6e-8 of it): the
# mean of an input that is normalised already (batch norm, pooling, batch norm) is zero in exact
# arithmetic, rounding noise (~1e-18) on both sides.
RUNNING_MEAN_FLOOR = 1e-3


def run_model(f, model, training):
    """Forward and backward in float64. Returns the Quantity rows, named as in the dump."""
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

    # What the layers read, in the order the model uses them: 'layer/name' -> tensor.
    used = {"params": {}, "buffers": {}, "masks": {}, "sums": {}}
    outputs = {"input": images}
    previous = "input"
    for index, spec in enumerate(model["layers"], start=1):
        name, kind, where = layer_header(index, spec, outputs)
        try:
            check_fields(spec, kind)
            inputs = [outputs[n] for n in input_names(spec, previous, outputs, kind)]
            outputs[name] = LAYERS[kind](spec, inputs, Context(f, name, training, used))
        except Malformed as e:
            raise Malformed(f"{where}: {e}") from None
        except (RuntimeError, ValueError) as e:  # a case the checks above do not foresee
            raise Malformed(f"{where}: PyTorch cannot run it: {e}") from None
        if any(layer_name == name for layer_name, _ in used["sums"].values()):
            outputs[name].retain_grad()
        previous = name

    # A dataset in the file that the model never used means the file and the model disagree
    # (e.g. a renamed layer): it would otherwise go unchecked.
    for group, names in (("/params", used["params"]), ("/buffers", used["buffers"]),
                         ("/masks", used["masks"])):
        extra = dataset_names(f, group) - set(names)
        if extra:
            raise Malformed(f"{group} holds {sorted(extra)}, which the model does not use"
                            + (" (masks are for dropout layers in training mode with p > 0)"
                               if group == "/masks" else ""))

    logits = outputs[previous]
    loss = LOSSES[loss_name](logits, labels)
    loss.backward()

    def grad(t):  # None when nothing reaches the loss from t (a dead branch): zero gradient
        return t.grad if t.grad is not None else torch.zeros_like(t)

    def summands(key):  # max over channels of sum |dL/d(layer output)|, or None
        if key not in used["sums"]:
            return None
        layer_name, dims = used["sums"][key]
        return float(grad(outputs[layer_name]).abs().sum(dim=dims).max())

    result = [Quantity("loss", "loss", loss.detach()),
              Quantity("output", "output", logits.detach(), flexible=True),
              Quantity("input_grad", "input_grad", grad(images))]
    result += [Quantity(f"grads/{key}", f"grads/{key}", grad(t), summands=summands(key))
               for key, t in used["params"].items()]
    result += [Quantity(f"buffers/{key}", f"buffers/{key}", t)
               for key, t in used["buffers"].items()]
    result += [Quantity(f"masks/{key}", f"/masks/{key}", t, flexible=True)
               for key, t in used["masks"].items()]
    return result


def compare(f, which, torch_values, rtol):
    """Prints the table; returns True when every quantity is within rtol."""
    for sub in ("grads", "buffers"):
        extra = dataset_names(f, f"/{which}/{sub}") - {
            q.key[len(sub) + 1:] for q in torch_values if q.key.startswith(sub + "/")}
        if extra:
            raise Malformed(f"/{which}/{sub} holds {sorted(extra)}, which the model does not "
                            f"use")
    # All read before printing.
    dumped = {q.key: read(f, q.path if q.path.startswith("/") else f"/{which}/{q.path}")
              for q in torch_values}

    rows, notes, ok = [], [], True
    for q in torch_values:
        key = q.key
        want = q.value.numpy()
        got = dumped[key].astype(np.float64)
        if got.size == 1 and want.size == 1:
            got = got.reshape(want.shape)  # the loss may be stored as shape () or (1,)
        if q.flexible and squeeze_hw(got.shape) == squeeze_hw(want.shape):
            want = want.reshape(got.shape)  # [N, C] stored as [N, C, 1, 1]: the dump's shape
        if got.shape != want.shape:
            rows.append((key, f"{got.shape} vs torch {want.shape}", "-", "shape", "FAIL"))
            ok = False
            continue
        err = float(np.max(np.abs(got - want))) if want.size else 0.0
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        if q.summands and scale <= ZERO_BY_CANCELLATION * q.summands:
            scale = q.summands
            notes.append(f"{key}: zero in exact arithmetic (torch {float(np.max(np.abs(want))):.1e}"
                         f"), so rel err is against max sum |dL/d output| = {scale:.3e}")
        if key.startswith("buffers/") and key.endswith("/running_mean"):
            var = next((v.value.numpy() for v in torch_values
                        if v.key == key[:-len("running_mean")] + "running_var"), None)
            if var is not None and var.size:
                floor = RUNNING_MEAN_FLOOR * float(np.sqrt(np.max(np.abs(var))))
                if scale < floor:
                    scale = floor
                    notes.append(f"{key}: near zero (torch {float(np.max(np.abs(want))):.1e}), "
                                 f"so rel err is against {RUNNING_MEAN_FLOOR:g} x the layer's "
                                 f"standard deviation = {scale:.3e}")
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
    for note in notes:
        print(f"note: {note}")
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
            mode = text_attr(f, "mode") if "mode" in f.attrs else "train"
            if mode not in MODES:
                raise Malformed(f"mode is '{mode}', expected train or eval")
            rtol = args.rtol if args.rtol is not None else DEFAULT_RTOL[dtype]
            print(f"{args.dump}: model '{model.get('name', '?')}', grid {grid}, {dtype}, "
                  f"{mode} mode; "
                  f"checking /{args.which} against PyTorch {torch.__version__} (float64), "
                  f"rtol {rtol:g}")
            # Say which group is missing rather than the first dataset looked up in it.
            for group in ("/batch", f"/{args.which}"):
                if not isinstance(f.get(group), h5py.Group):
                    raise Malformed(f"missing group '{group}'")
            torch_values = run_model(f, model, training=(mode == "train"))
            ok = compare(f, args.which, torch_values, rtol)
    except Malformed as e:
        print(f"error: {args.dump}: {e}", file=sys.stderr)
        return 2
    print("PASS" if ok else f"FAIL: some quantity is not within rtol {rtol:g} (see FAIL rows)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
