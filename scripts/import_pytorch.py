#!/usr/bin/python3
"""Imports PyTorch weights into Tessera: a state_dict to a Tessera params file (`--init`).

Usage: import_pytorch.py STATE_DICT.pt MODEL.json OUT.h5 [--dtype float32|float64]

STATE_DICT.pt is what torch.save wrote: a state_dict (as export_pytorch.py writes, or any
nn.Module's whose keys are <layer>.weight, <layer>.bias, <layer>.running_mean,
<layer>.running_var; <layer>.num_batches_tracked is ignored), a dict holding one under
"state_dict", or a whole nn.Module. MODEL.json is the Tessera model (or a Tessera checkpoint,
whose model is taken). Every key and shape is checked against the model as
tessera_torch.build(MODEL.json) makes it, as load_state_dict(strict=True) would, and the values
must be finite in --dtype and running variances >= 0, as `tessera --init` requires.

OUT.h5 gets root attribute format = "tessera-params-1", /params/<layer>/<weight|bias> and
/buffers/<layer>/<running_mean|running_var> in --dtype (default float32); it is written to a
temporary file and renamed, so a failed run leaves no half file. Use it with
`tessera gradcheck --init OUT.h5` or `tessera train --init OUT.h5`.

Exit status: 0 written, 1 OUT.h5 could not be written, 2 bad input (unreadable file, a key
missing, unexpected or of the wrong shape, NaN or infinity).
"""

import argparse
import os
import sys
from pathlib import Path

import h5py
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tessera_torch as tt  # noqa: E402

DTYPES = {"float32": np.float32, "float64": np.float64}


def read_state_dict(path):
    if not os.path.exists(path):
        raise tt.Malformed(f"'{path}' does not exist")
    try:
        obj = torch.load(path, map_location="cpu")
    except Exception as e:  # torch.load raises whatever unpickling meets
        raise tt.Malformed(f"cannot read '{path}' with torch.load: {e}") from None
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise tt.Malformed(f"'{path}' holds a {type(obj).__name__}, not a state_dict")
    return obj


def read_model(path):
    """A model JSON file, or the model of a Tessera checkpoint."""
    try:
        if h5py.is_hdf5(path):
            return tt.checkpoint_model(path)[0]
    except OSError:
        pass  # not readable as HDF5: let model_dict say what is wrong
    return tt.model_dict(path)


def write_params(net, path, dtype):
    """/params and /buffers of net, written to a temporary file renamed to path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = tt.PARAMS_FORMAT
            for key, t in net.named_parameters():
                layer, name = key.split(".", 1)
                f.create_dataset(f"params/{layer}/{name}", data=t.detach().numpy().astype(dtype))
            for key, t in net.named_buffers():
                if not tt.is_step_counter(key):
                    layer, name = key.split(".", 1)
                    f.create_dataset(f"buffers/{layer}/{name}", data=t.numpy().astype(dtype))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("state_dict", metavar="STATE_DICT.pt")
    ap.add_argument("model", metavar="MODEL.json",
                    help="the Tessera model JSON (or a checkpoint holding it)")
    ap.add_argument("out", metavar="OUT.h5")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="dtype of the datasets written (default float32)")
    args = ap.parse_args()

    try:
        state = read_state_dict(args.state_dict)
        model = read_model(args.model)
        net = tt.build(model, torch.float64)
        tt.copy_state_dict(net, state, source=f"'{args.state_dict}'")
        dtype = DTYPES[args.dtype]
        for key, t in net.state_dict().items():
            if not t.is_floating_point():
                continue
            if not torch.isfinite(t).all():
                raise tt.Malformed(f"'{args.state_dict}': '{key}' holds NaN or infinity")
            # Finite in --dtype too: 1e300 is a float64 but overflows to infinity in float32.
            with np.errstate(over="ignore"):
                if not np.isfinite(t.numpy().astype(dtype)).all():
                    raise tt.Malformed(f"'{args.state_dict}': '{key}' overflows {args.dtype} "
                                       "(a value beyond its largest finite number)")
            if key.endswith("running_var") and (t < 0).any():
                raise tt.Malformed(f"'{args.state_dict}': '{key}' holds a negative variance")
    except tt.Malformed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        write_params(net, args.out, dtype)
    except OSError as e:
        print(f"error: cannot write '{args.out}': {e.strerror or e}", file=sys.stderr)
        return 1
    params = sum(1 for _ in net.parameters())
    buffers = sum(1 for k, _ in net.named_buffers() if not tt.is_step_counter(k))
    values = sum(p.numel() for p in net.parameters())
    print(f"wrote {args.out}: {params} parameters ({values} values) and {buffers} buffers of "
          f"model '{model.get('name', '?')}', {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
