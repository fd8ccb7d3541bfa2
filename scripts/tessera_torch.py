#!/usr/bin/python3
"""Tessera models as real PyTorch modules, and Tessera's parameter files and checkpoints loaded
into them.

Usage (a module: put scripts/ on sys.path):

    import tessera_torch
    net = tessera_torch.build("model.json")            # or the JSON text, or a dict
    tessera_torch.load_tessera_h5(net, "params.h5")     # a params file or a checkpoint
    net = tessera_torch.build_from_checkpoint("ckpt/checkpoint-40.h5")  # its own model, eval mode
    logits = net(images)                                # [N, C, H, W] -> the last layer's output

`build` returns a TesseraNet: a torch.nn.ModuleDict of nn.Conv2d, nn.ConvTranspose2d,
nn.BatchNorm2d, nn.Linear, ... keyed by layer name, whose forward follows the model's graph
("inputs"; the previous layer by default; "input" is the model's input). Its state_dict keys are
<layer>.weight, <layer>.bias, <layer>.running_mean, <layer>.running_var (and BatchNorm2d's
<layer>.num_batches_tracked, which Tessera ignores) in PyTorch's layouts, which are Tessera's:
conv OIHW, transposed conv [in, out, kh, kw], linear [out, in], bias and batch norm [C].

The layer semantics are those of Tessera and of check_with_pytorch.py (which imports the field
helpers below): "same" padding is dilation * (kernel - 1) in total, the smaller half first
(applied with F.pad where it is uneven); average pooling counts the padding; pooling uses floor
mode. Anything this module cannot build or run raises Malformed (a ValueError) naming the layer
and the field.

The part between the EXPORTED markers needs only PyTorch: scripts/export_pytorch.py copies it
verbatim into the self-contained module files it writes. The HDF5 readers below it need h5py.
"""

import re  # for the file readers below the builder
from pathlib import Path

# ==== BEGIN EXPORTED: the builder (needs only torch; copied into exported model files) ====
import json
import math
import os
from types import SimpleNamespace as Geometry  # a layer's parsed fields

import torch
import torch.nn.functional as F
from torch import nn


class Malformed(ValueError):
    """A model, file or input this code cannot build, load or run, with the reason."""


# --------------------------------------------------------------------------------------------
# JSON fields. Shapes may hold strings ("N", "H", "W") for extents not known when a model is
# built; checks that need them wait for the forward pass.

def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)  # bool is an int in Python


def int_pair(spec, field, default, minimum):
    """An int or [h, w] field, as (h, w)."""
    v = spec.get(field, default)
    pair = v if isinstance(v, list) else [v, v]
    if len(pair) != 2 or not all(is_int(x) and x >= minimum for x in pair):
        raise Malformed(f"field '{field}' must be an integer >= {minimum} or [h, w], got {v!r}")
    return tuple(pair)


def integer(spec, field, default, minimum):
    """An int field; required when default is None."""
    if field not in spec and default is None:
        raise Malformed(f"needs field '{field}'")
    v = spec.get(field, default)
    if not is_int(v) or v < minimum:
        raise Malformed(f"field '{field}' must be an integer >= {minimum}, got {v!r}")
    return v


def number(spec, field, default, low, high, low_open=False):
    """A finite number in [low, high] ((low, high] when low_open)."""
    v = spec.get(field, default)
    if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
            or v > high or v < low or (low_open and v == low)):
        if math.isinf(low) and math.isinf(high):
            wanted = "a finite number"
        elif math.isinf(high):
            wanted = f"a number {'>' if low_open else '>='} {low:g}"
        else:
            wanted = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise Malformed(f"field '{field}' must be {wanted}, got {v!r}")
    return float(v)


def boolean(spec, field, default):
    v = spec.get(field, default)
    if not isinstance(v, bool):
        raise Malformed(f"field '{field}' must be true or false, got {v!r}")
    return v


def fmt_shape(shape):
    """(2, 3, 4, 5) as Python prints a tuple, unknown extents by their letter: (N, 3, H, W)."""
    shape = tuple(shape)
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def dims_str(shape):
    """[2, 3, 4, 5], as Tessera's messages give shapes."""
    return "[" + ", ".join(map(str, tuple(shape))) + "]"


def spatial_shape(shape):
    """The input of a layer that works on images must be [N, C, H, W]."""
    if len(shape) != 4:
        raise Malformed(f"needs an [N, C, H, W] input, got {fmt_shape(shape)} (after "
                        f"global_avgpool or linear there are no pixels left)")
    return tuple(shape)


def spatial(x):
    spatial_shape(tuple(x.shape))
    return x


def window_extent(size, kernel, stride, pad_before, pad_after, dilation, axis):
    """Output extent of a strided window along one axis; Malformed when the window does not
    fit, rather than PyTorch's error from inside the call. An unknown size gives None."""
    if not is_int(size):
        return None
    span = dilation * (kernel - 1) + 1
    if size + pad_before + pad_after < span:
        raise Malformed(f"the {axis} window ({span}) is larger than the padded input "
                        f"({size} + {pad_before} + {pad_after})")
    return (size + pad_before + pad_after - span) // stride + 1


def same_shapes(shapes, what, skip_dim=None):
    def key(s):
        return tuple(n for d, n in enumerate(s) if d != skip_dim)
    shapes = [tuple(s) for s in shapes]
    if len({len(s) for s in shapes}) != 1 or len({key(s) for s in shapes}) != 1:
        raise Malformed(f"{what}, got {', '.join(fmt_shape(s) for s in shapes)}")


# --------------------------------------------------------------------------------------------
# Layer types: the JSON fields each accepts (so that a field not understood is reported, not
# silently ignored) and how many inputs it takes ((min, max), max None = any); then the
# geometry of each, checked against its input shape.

LAYER_FIELDS = {
    "conv2d": (("out_channels", "kernel", "stride", "padding", "dilation", "groups", "bias"),
               (1, 1)),
    "conv_transpose2d": (("out_channels", "kernel", "stride", "padding", "output_padding",
                          "bias"), (1, 1)),
    "maxpool2d": (("kernel", "stride", "padding"), (1, 1)),
    "avgpool2d": (("kernel", "stride", "padding"), (1, 1)),
    "batchnorm2d": (("eps", "momentum"), (1, 1)),
    "relu": ((), (1, 1)),
    "leaky_relu": (("slope",), (1, 1)),
    "sigmoid": ((), (1, 1)),
    "dropout": (("p",), (1, 1)),
    "upsample_nearest": (("scale",), (1, 1)),
    "concat": ((), (2, None)),
    "add": ((), (2, None)),
    "global_avgpool": ((), (1, 1)),
    "linear": (("out_features", "bias"), (1, 1)),
}


def conv2d_geometry(spec, shape):
    """Fields of a conv2d, checked against its input shape [N, C, H, W]. pad: ((top, bottom),
    (left, right))."""
    if "out_channels" not in spec or "kernel" not in spec:
        raise Malformed("needs fields 'out_channels' and 'kernel'")
    out_channels = integer(spec, "out_channels", None, 1)
    kernel = int_pair(spec, "kernel", None, 1)
    stride = int_pair(spec, "stride", 1, 1)
    dilation = int_pair(spec, "dilation", 1, 1)
    groups = integer(spec, "groups", 1, 1)
    padding = spec.get("padding", 0)
    if padding == "valid":
        pad = ((0, 0), (0, 0))
    elif padding == "same":
        # PyTorch's rule (and Tessera's): total = dilation * (kernel - 1), the smaller half first.
        if stride != (1, 1):
            raise Malformed("padding 'same' needs stride 1")
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        pad = tuple((t // 2, t - t // 2) for t in totals)
    elif isinstance(padding, str):
        raise Malformed(f"field 'padding' must be an integer, [h, w], 'same' or 'valid', "
                        f"got {padding!r}")
    else:
        pad = tuple((p, p) for p in int_pair(spec, "padding", 0, 0))
    bias = boolean(spec, "bias", True)
    in_channels = shape[1]
    if in_channels % groups or out_channels % groups:
        raise Malformed(f"groups = {groups} must divide the input channels ({in_channels}) "
                        f"and out_channels ({out_channels})")
    for axis, size, k, s, (p0, p1), d in zip(("row", "column"), shape[2:], kernel, stride, pad,
                                              dilation):
        window_extent(size, k, s, p0, p1, d, axis)
    return Geometry(out_channels=out_channels, kernel=kernel, stride=stride, dilation=dilation,
                    groups=groups, pad=pad, bias=bias)


def conv_transpose2d_geometry(spec, shape):
    if "out_channels" not in spec or "kernel" not in spec:
        raise Malformed("needs fields 'out_channels' and 'kernel'")
    out_channels = integer(spec, "out_channels", None, 1)
    kernel = int_pair(spec, "kernel", None, 1)
    stride = int_pair(spec, "stride", 1, 1)
    padding = int_pair(spec, "padding", 0, 0)
    output_padding = int_pair(spec, "output_padding", 0, 0)
    bias = boolean(spec, "bias", True)
    for axis, size, k, s, p, op in zip(("row", "column"), shape[2:], kernel, stride, padding,
                                       output_padding):
        if op >= s:
            raise Malformed(f"output_padding ({op}) must be smaller than stride ({s})")
        if is_int(size) and (size - 1) * s - 2 * p + k + op < 1:
            raise Malformed(f"the output would have {(size - 1) * s - 2 * p + k + op} "
                            f"{axis}s: padding {p} is too large")
    return Geometry(out_channels=out_channels, kernel=kernel, stride=stride, padding=padding,
                    output_padding=output_padding, bias=bias)


def pool_geometry(spec, shape):
    """(kernel, stride, padding) of maxpool2d and avgpool2d, checked against the input shape."""
    if "kernel" not in spec:
        raise Malformed("needs field 'kernel'")
    kernel = int_pair(spec, "kernel", None, 1)
    stride = int_pair(spec, "stride", list(kernel), 1)
    padding = int_pair(spec, "padding", 0, 0)
    for axis, size, k, s, p in zip(("row", "column"), shape[2:], kernel, stride, padding):
        if 2 * p > k:  # PyTorch's own limit: a window never lies wholly in the padding
            raise Malformed(f"padding ({p}) must be at most half the kernel ({k})")
        window_extent(size, k, s, p, p, 1, axis)
    return kernel, stride, padding


def batchnorm2d_fields(spec):
    """(eps, momentum)."""
    return (number(spec, "eps", 1e-5, 0, math.inf, low_open=True),
            number(spec, "momentum", 0.1, 0, 1))


def batchnorm2d_values(shape, training):
    """Batch statistics need more than one value per channel."""
    if training and all(is_int(n) for n in (shape[0], *shape[2:])) \
            and shape[0] * shape[2] * shape[3] < 2:
        raise Malformed(f"training mode needs more than one value per channel, the input is "
                        f"{fmt_shape(shape)}")


def leaky_relu_slope(spec):
    return number(spec, "slope", 0.01, -math.inf, math.inf)


def dropout_p(spec):
    return number(spec, "p", 0.5, 0, 1)


def upsample_scale(spec):
    return integer(spec, "scale", None, 1)


def linear_input(shape):
    if len(shape) != 2:
        raise Malformed(f"needs an [N, features] input (global_avgpool or linear), got "
                        f"{fmt_shape(shape)}")


def linear_fields(spec):
    """(out_features, bias)."""
    return integer(spec, "out_features", None, 1), boolean(spec, "bias", True)


# --------------------------------------------------------------------------------------------
# The layer list: names, types, fields and inputs, checked in the order Tessera checks them.

def layer_header(index, spec, defined):
    """(name, type, where) of the index-th layer (from 1); `defined`: the names above it,
    "input" included."""
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise Malformed(f"model layer {index} must be an object with a string 'type'")
    kind = spec["type"]
    name = spec.get("name", f"{kind}{index}")
    where = f"layer '{name}' ({kind})"
    if kind not in LAYER_FIELDS:
        raise Malformed(f"{where}: unknown layer type '{kind}' "
                        f"(known: {', '.join(sorted(LAYER_FIELDS))})")
    if not isinstance(name, str) or not name:
        raise Malformed(f"model layer {index}: 'name' must be a non-empty string")
    if name in defined:
        raise Malformed(f"{where}: the name is used twice")
    return name, kind, where


def check_fields(spec, kind):
    unknown = sorted(set(spec) - {"name", "type", "inputs", *LAYER_FIELDS[kind][0]})
    if unknown:
        raise Malformed(f"unknown field(s) {', '.join(unknown)}")


def input_names(spec, previous, defined, kind):
    """The names of a layer's inputs: its "inputs" (a name or a list), else the layer above."""
    names = spec.get("inputs", previous)
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise Malformed(f"field 'inputs' must be a layer name or a list of them, got {names!r}")
    low, high = LAYER_FIELDS[kind][1]
    if len(names) < low or (high is not None and len(names) > high):
        wanted = f"{low}" if low == high else f"{low} or more"
        raise Malformed(f"takes {wanted} input(s), got {len(names)}")
    missing = [n for n in names if n not in defined]
    if missing:
        raise Malformed(f"inputs {missing} are not earlier layers")
    return names


def parse_model(text, source="root attribute 'model'"):
    """A model JSON text as a dict with a non-empty list 'layers'."""
    try:
        model = json.loads(text)
    except json.JSONDecodeError as e:
        raise Malformed(f"{source} is not valid JSON: {e}")
    if not isinstance(model, dict) or not isinstance(model.get("layers"), list) \
            or not model["layers"]:
        raise Malformed("the model must be a JSON object with a non-empty list 'layers'")
    return model


def model_dict(model):
    """A model given as a dict, its JSON text, or the path of a JSON file, as a dict."""
    if isinstance(model, dict):
        return parse_model(json.dumps(model), "the model")
    if isinstance(model, str) and model.lstrip().startswith("{"):
        return parse_model(model, "the model text")
    if isinstance(model, (str, os.PathLike)):
        try:
            with open(model) as f:
                text = f.read()
        except OSError as e:
            raise Malformed(f"cannot read the model '{os.fspath(model)}': {e.strerror}")
        return parse_model(text, f"'{os.fspath(model)}'")
    raise Malformed(f"a model is a dict, JSON text or a file path, not {type(model).__name__}")


# --------------------------------------------------------------------------------------------
# Modules for what torch.nn has no module for, and a conv with uneven "same" padding.

class Conv2d(nn.Conv2d):
    """nn.Conv2d; uneven padding ("same" with an even span) is applied with F.pad first."""

    def __init__(self, in_channels, g):
        (top, bottom), (left, right) = g.pad
        even = top == bottom and left == right
        super().__init__(in_channels, g.out_channels, g.kernel, stride=g.stride,
                         padding=(top, left) if even else 0, dilation=g.dilation,
                         groups=g.groups, bias=g.bias)
        self.uneven_pad = None if even else (left, right, top, bottom)  # F.pad: last axis first

    def forward(self, x):
        if self.uneven_pad is not None:
            x = F.pad(x, self.uneven_pad)
        return super().forward(x)

    def extra_repr(self):
        return super().extra_repr() + (f", uneven_pad(l, r, t, b)={self.uneven_pad}"
                                       if self.uneven_pad else "")


class Concat(nn.Module):
    """Joins its inputs' channels."""

    def forward(self, *xs):
        return torch.cat(xs, dim=1)


class Add(nn.Module):
    def forward(self, *xs):
        out = xs[0]
        for t in xs[1:]:
            out = out + t
        return out


class GlobalAvgPool(nn.Module):
    """[N, C, H, W] -> [N, C]."""

    def forward(self, x):
        return x.mean(dim=(2, 3))


# The layer types that need [N, C, H, W]; the others also take [N, C].
SPATIAL = {"conv2d", "conv_transpose2d", "maxpool2d", "avgpool2d", "batchnorm2d",
           "upsample_nearest", "global_avgpool"}


def make_layer(kind, spec, shapes):
    """(module, output shape) of a layer whose inputs have `shapes`."""
    shape = shapes[0]
    if kind in SPATIAL:
        spatial_shape(shape)
    n, c = shape[0], shape[1]
    if kind == "conv2d":
        g = conv2d_geometry(spec, shape)
        return Conv2d(c, g), (n, g.out_channels, "H", "W")
    if kind == "conv_transpose2d":
        g = conv_transpose2d_geometry(spec, shape)
        module = nn.ConvTranspose2d(c, g.out_channels, g.kernel, stride=g.stride,
                                    padding=g.padding, output_padding=g.output_padding,
                                    bias=g.bias)
        return module, (n, g.out_channels, "H", "W")
    if kind in ("maxpool2d", "avgpool2d"):
        kernel, stride, padding = pool_geometry(spec, shape)
        module = (nn.MaxPool2d(kernel, stride=stride, padding=padding) if kind == "maxpool2d" else
                  nn.AvgPool2d(kernel, stride=stride, padding=padding, count_include_pad=True))
        return module, (n, c, "H", "W")
    if kind == "batchnorm2d":
        eps, momentum = batchnorm2d_fields(spec)
        return nn.BatchNorm2d(c, eps=eps, momentum=momentum), shape
    if kind == "relu":
        return nn.ReLU(), shape
    if kind == "leaky_relu":
        return nn.LeakyReLU(leaky_relu_slope(spec)), shape
    if kind == "sigmoid":
        return nn.Sigmoid(), shape
    if kind == "dropout":
        return nn.Dropout(dropout_p(spec)), shape
    if kind == "upsample_nearest":
        return nn.Upsample(scale_factor=upsample_scale(spec), mode="nearest"), (n, c, "H", "W")
    if kind == "concat":
        same_shapes(shapes, "inputs must agree in every dimension but channels", skip_dim=1)
        return Concat(), (n, sum(s[1] for s in shapes), "H", "W")
    if kind == "add":
        same_shapes(shapes, "inputs must have the same shape")
        return Add(), shape
    if kind == "global_avgpool":
        return GlobalAvgPool(), (n, c)
    if kind == "linear":
        linear_input(shape)
        out_features, bias = linear_fields(spec)
        return nn.Linear(c, out_features, bias=bias), (n, out_features)
    raise Malformed(f"unknown layer type '{kind}'")  # LAYER_FIELDS and this list disagree


def check_forward(kind, spec, shapes, training):
    """The checks that need the real extents, before PyTorch would fail inside the call."""
    if kind == "conv2d":
        conv2d_geometry(spec, shapes[0])
    elif kind == "conv_transpose2d":
        conv_transpose2d_geometry(spec, shapes[0])
    elif kind in ("maxpool2d", "avgpool2d"):
        pool_geometry(spec, shapes[0])
    elif kind == "batchnorm2d":
        batchnorm2d_values(shapes[0], training)
    elif kind == "concat":
        same_shapes(shapes, "inputs must agree in every dimension but channels", skip_dim=1)
    elif kind == "add":
        same_shapes(shapes, "inputs must have the same shape")


class TesseraNet(nn.ModuleDict):
    """A Tessera model as PyTorch modules keyed by layer name; forward follows the graph and
    returns the last layer's output (the logits). build() makes one."""

    def __init__(self, model):
        super().__init__()
        model = model_dict(model)
        # Own attributes first: a layer may not take a name that is an attribute.
        self.tessera_model = model
        self.tessera_graph = []  # (name, type, input names, spec)
        self.tessera_last_use = {}
        try:
            channels = integer(model, "input_channels", None, 1)
        except Malformed as e:
            raise Malformed(f"model: {e}") from None
        self.tessera_input_channels = channels
        shapes = {"input": ("N", channels, "H", "W")}
        previous = "input"
        for index, spec in enumerate(model["layers"], start=1):
            name, kind, where = layer_header(index, spec, shapes)
            try:
                check_fields(spec, kind)
                inputs = input_names(spec, previous, shapes, kind)
                module, shapes[name] = make_layer(kind, spec, [shapes[n] for n in inputs])
            except Malformed as e:
                raise Malformed(f"{where}: {e}") from None
            if "." in name or hasattr(self, name):
                why = ("it holds '.'" if "." in name else
                       f"torch.nn.ModuleDict has an attribute '{name}'")
                raise Malformed(f"{where}: the name cannot be a PyTorch module name ({why}); "
                                f"rename the layer")
            self[name] = module
            self.tessera_graph.append((name, kind, inputs, spec))
            for n in inputs:
                self.tessera_last_use[n] = index - 1
            previous = name
        self.tessera_output_shape = shapes[previous]  # (N, C, "H", "W") or (N, C)

    def forward(self, x):
        c = self.tessera_input_channels
        if x.dim() != 4 or x.shape[1] != c:
            raise Malformed(f"the model takes images [N, {c}, H, W], got {fmt_shape(x.shape)}")
        outputs = {"input": x}
        for index, (name, kind, inputs, spec) in enumerate(self.tessera_graph):
            xs = [outputs[n] for n in inputs]
            try:
                check_forward(kind, spec, [tuple(t.shape) for t in xs], self.training)
            except Malformed as e:
                raise Malformed(f"layer '{name}' ({kind}): {e}") from None
            outputs[name] = self[name](*xs)
            for n in set(inputs):  # free what no later layer reads
                if self.tessera_last_use.get(n) == index:
                    del outputs[n]
        return outputs[self.tessera_graph[-1][0]]


def build(model, dtype=None):
    """A TesseraNet for a model JSON (a dict, its text or a file path), its parameters
    initialised as PyTorch initialises each module; dtype, e.g. torch.float64, or the default."""
    net = TesseraNet(model)
    return net.to(dtype) if dtype is not None else net


def is_step_counter(key):
    return key.endswith(".num_batches_tracked") or key == "num_batches_tracked"


def copy_state_dict(net, state, source="the state_dict"):
    """Copies `state` (a state_dict) into net, every key and shape checked with a message naming
    it; BatchNorm2d's num_batches_tracked may be there or not. Returns net."""
    if not isinstance(state, dict):
        raise Malformed(f"{source} is a {type(state).__name__}, not a state_dict (a dict of "
                        f"tensors)")
    want = net.state_dict()
    needed = [k for k in want if not is_step_counter(k)]
    missing = [k for k in needed if k not in state]
    extra = [k for k in state if k not in want and not is_step_counter(k)]
    if missing or extra:
        def listed(keys):
            return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        what = ([f"missing {listed(missing)}"] if missing else []) + \
            ([f"unexpected {listed(extra)}"] if extra else [])
        raise Malformed(f"{source} does not fit the model '{net.tessera_model.get('name', '?')}'"
                        f": {'; '.join(what)}")
    for k in needed:
        t = state[k]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise Malformed(f"{source}: '{k}' must be a floating-point tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != tuple(want[k].shape):
            raise Malformed(f"{source}: '{k}' has shape {dims_str(t.shape)}, the model needs "
                            f"{dims_str(want[k].shape)}")
    with torch.no_grad():
        for k in needed:
            want[k].copy_(state[k])
        for k in want:
            if is_step_counter(k) and k in state and torch.is_tensor(state[k]) \
                    and state[k].numel() == 1:
                want[k].copy_(state[k].reshape(want[k].shape))
    return net
# ==== END EXPORTED ====


# --------------------------------------------------------------------------------------------
# Tessera's HDF5 files (README "Files"): parameter files and checkpoints. h5py is imported where
# it is needed, so that the builder works without it.

PARAMS_FORMAT = "tessera-params-1"
CHECKPOINT_FORMAT = "tessera-checkpoint-2"
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def text_attr(f, key):
    import numpy as np
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
    import h5py
    import numpy as np
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
    import h5py
    group = f.get(path)
    if not isinstance(group, h5py.Group):
        return set()
    names = []
    group.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset)
                     else None)
    return set(names)


def open_h5(path):
    """An h5py.File open for reading, or Malformed saying why not."""
    import h5py
    path = os.fspath(path)
    if not os.path.exists(path):
        raise Malformed(f"'{path}' does not exist")
    if os.path.isdir(path):
        raise Malformed(f"'{path}' is a directory, not an HDF5 file")
    try:
        if not h5py.is_hdf5(path):
            raise Malformed(f"'{path}' is not an HDF5 file")
        return h5py.File(path, "r")
    except OSError as e:
        raise Malformed(f"cannot open '{path}' as HDF5: {e}")


def file_format(f, path, allowed=(PARAMS_FORMAT, CHECKPOINT_FORMAT)):
    """The root attribute 'format', which must be one of `allowed`."""
    wanted = " or ".join(f"'{a}'" for a in allowed)
    if "format" not in f.attrs:
        raise Malformed(f"'{path}' is not a Tessera file: it has no root attribute 'format' "
                        f"({wanted})")
    fmt = text_attr(f, "format")
    if fmt not in allowed:
        raise Malformed(f"'{path}' is a '{fmt}' file, not {wanted}")
    return fmt


def load_tessera_h5(net, path):
    """Loads /params/<layer>/<param> and /buffers/<layer>/<buffer> of a Tessera params file or
    checkpoint into net (a TesseraNet), by the rules of `tessera --init`: every parameter there,
    none extra, each of the model's shape (a dataset with the same number of elements, e.g. with
    trailing singleton dimensions, is reshaped), floating point and finite; /buffers optional,
    but a layer's buffers all or none; num_batches_tracked ignored. Returns net."""
    import numpy as np
    path = os.fspath(path)
    with open_h5(path) as f:
        file_format(f, path)
        state = net.state_dict()
        params = {k.replace(".", "/", 1): k for k, _ in net.named_parameters()}
        buffers = {k.replace(".", "/", 1): k for k, _ in net.named_buffers()
                   if not is_step_counter(k)}
        values = {}

        def take(group, name, key):
            a = read(f, f"{group}/{name}")
            want = tuple(state[key].shape)
            if a.shape != want:
                if a.size != state[key].numel():
                    raise Malformed(f"'{path}': '{group}/{name}' has shape {dims_str(a.shape)}, "
                                    f"the model needs {dims_str(want)}")
                a = a.reshape(want)
            if not np.all(np.isfinite(a)):
                raise Malformed(f"'{path}': '{group}/{name}' holds NaN or infinity")
            values[key] = torch.from_numpy(np.ascontiguousarray(a))

        found = dataset_names(f, "/params")
        for name, key in params.items():
            if name not in found:
                raise Malformed(f"'{path}' has no parameter '/params/{name}' (shape "
                                f"{dims_str(state[key].shape)})")
        extra = sorted(found - set(params))
        if extra:
            raise Malformed(f"'{path}' has parameter(s) {', '.join('/params/' + e for e in extra)}"
                            f", which the model '{net.tessera_model.get('name', '?')}' does not "
                            f"have")
        for name, key in params.items():
            take("/params", name, key)

        found = {n for n in dataset_names(f, "/buffers")
                 if n.rsplit("/", 1)[-1] != "num_batches_tracked"}
        extra = sorted(found - set(buffers))
        if extra:
            raise Malformed(f"'{path}' has buffer(s) {', '.join('/buffers/' + e for e in extra)}"
                            f", which the model '{net.tessera_model.get('name', '?')}' does not "
                            f"have")
        layers = {n.split("/", 1)[0] for n in found}
        for name, key in buffers.items():
            layer = name.split("/", 1)[0]
            if layer not in layers:
                continue  # Tessera keeps the initial statistics then too
            if name not in found:
                raise Malformed(f"'{path}' has buffers of layer '{layer}' but not "
                                f"'/buffers/{name}' (shape {dims_str(state[key].shape)})")
            take("/buffers", name, key)
    with torch.no_grad():
        for key, v in values.items():
            state[key].copy_(v)
    return net


def checkpoint_model(path):
    """(model dict, dtype name) of a Tessera checkpoint (its root attributes 'model' and
    'dtype')."""
    path = os.fspath(path)
    with open_h5(path) as f:
        file_format(f, path, allowed=(CHECKPOINT_FORMAT,))
        try:
            model = parse_model(text_attr(f, "model"))
            dtype = text_attr(f, "dtype")
        except Malformed as e:
            raise Malformed(f"'{path}': {e}") from None
    if dtype not in TORCH_DTYPES:
        raise Malformed(f"'{path}': dtype is '{dtype}', expected float32 or float64")
    return model, dtype


def build_from_checkpoint(path, dtype=None):
    """The model of a Tessera checkpoint with its parameters and buffers, in eval mode, in the
    checkpoint's dtype unless dtype (a torch dtype) is given."""
    model, stored = checkpoint_model(path)
    net = build(model, dtype if dtype is not None else TORCH_DTYPES[stored])
    return load_tessera_h5(net, path).eval()


def named_layers(model):
    """The layer list with every default name filled in (Tessera's "<type><index>")."""
    return [dict(spec, name=spec.get("name", f"{spec.get('type')}{i}"))
            if isinstance(spec, dict) else spec
            for i, spec in enumerate(model["layers"], start=1)]


def layer_difference(a, b):
    """None when models a and b describe the same network (input channels and layers; their
    names and losses aside), else what differs first."""
    if a.get("input_channels") != b.get("input_channels"):
        return (f"input_channels {a.get('input_channels')!r} vs "
                f"{b.get('input_channels')!r}")
    la, lb = named_layers(a), named_layers(b)
    for k, (x, y) in enumerate(zip(la, lb), start=1):
        if x != y:
            return f"layer {k}: {json.dumps(x, sort_keys=True)} vs {json.dumps(y, sort_keys=True)}"
    if len(la) != len(lb):
        return f"{len(la)} layers vs {len(lb)}"
    return None


CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)\.h5")


def newest_checkpoint(directory):
    """The checkpoint-<step>.h5 of a directory with the highest step (not verified: that is
    `tessera train --resume`'s job)."""
    found = [(int(m.group(1)), p) for p in Path(directory).iterdir()
             if (m := CHECKPOINT_NAME.fullmatch(p.name)) and p.is_file()]
    if not found:
        raise Malformed(f"'{directory}' holds no checkpoint-<step>.h5")
    return max(found)[1]


def build_from_file(path, model=None, dtype=None):
    """A trained model from a checkpoint, a checkpoint directory (its highest step) or a params
    file with its model (a dict, JSON text or JSON file; required for a params file, and
    describing the checkpoint's layers if given with one). Returns (net in eval mode, info):
    info has 'path' (the file read), 'format', 'dtype' (the file's: 'float32' or 'float64'),
    'model' (a dict) and 'step' (a checkpoint's, from its name, or None). The net is in the
    file's dtype unless dtype (a torch dtype) is given."""
    path = Path(path)
    if path.is_dir():
        path = newest_checkpoint(path)
    with open_h5(path) as f:
        fmt = file_format(f, str(path))
        floats = {f[f"/params/{n}"].dtype.name for n in dataset_names(f, "/params")}
    given = model_dict(model) if model is not None else None
    if fmt == CHECKPOINT_FORMAT:
        stored_model, stored = checkpoint_model(path)
        if given is not None:
            diff = layer_difference(stored_model, given)
            if diff is not None:
                given_name = (f"'{os.fspath(model)}'" if isinstance(model, (str, os.PathLike))
                              and not str(model).lstrip().startswith("{") else "the model given")
                raise Malformed(f"{given_name} describes other layers than the model of "
                                f"'{path}': {diff}")
        model = stored_model
    else:
        if given is None:
            raise Malformed(f"'{path}' is a params file, which carries no model: give the "
                            f"model JSON too")
        model = given
        stored = "float64" if "float64" in floats else "float32"
    net = build(model, dtype if dtype is not None else TORCH_DTYPES[stored])
    load_tessera_h5(net, path)
    m = CHECKPOINT_NAME.fullmatch(path.name)
    step = int(m.group(1)) if m and fmt == CHECKPOINT_FORMAT else None
    return net.eval(), {"path": path, "format": fmt, "dtype": stored, "model": model,
                        "step": step}
