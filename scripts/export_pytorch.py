#!/usr/bin/python3
"""Exports a trained Tessera model to PyTorch: a state_dict and a self-contained module file.

Usage: export_pytorch.py CHECKPOINT [MODEL.json] [-o OUT]

CHECKPOINT is a Tessera checkpoint (checkpoint-<step>.h5), a checkpoint directory (its
checkpoint with the highest step is taken; `tessera train --resume` is what verifies
checksums), or a Tessera params file (`--init`), which carries no model, so MODEL.json is then
required. A checkpoint carries its model; a MODEL.json given with one must describe the same
layers.

Writes OUT.pt, the parameters and buffers as a plain state_dict (torch.save; keys
<layer>.weight, <layer>.bias, <layer>.running_mean, <layer>.running_var,
<layer>.num_batches_tracked; in the file's dtype), and OUT.py, a module that needs only PyTorch:

    import OUT
    net = OUT.load()            # the model in eval mode with OUT.pt's weights, on the CPU
    logits = net(images)        # OUT.load(weights=PATH, device="cuda") for others

OUT defaults to the checkpoint's (or params file's) name without .h5, in the current directory,
with characters a Python module name cannot hold replaced by '_' (checkpoint-40.h5 ->
checkpoint_40.py and checkpoint_40.pt), so that `import checkpoint_40` works.

Exit status: 0 written, 1 the output could not be written, 2 bad input (missing file, not HDF5,
not a Tessera checkpoint or params file, a model that does not fit the parameters).
"""

import argparse
import pprint
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tessera_torch as tt  # noqa: E402

def builder_source():
    """The part of tessera_torch.py that needs only torch, verbatim."""
    text = (HERE / "tessera_torch.py").read_text()
    begin = text.index("# ==== BEGIN EXPORTED")
    end = text.index("# ==== END EXPORTED ====")
    return text[begin:end] + "# ==== END EXPORTED ====\n"


MODULE_TEMPLATE = '''"""{title}: a Tessera model as a PyTorch module (written by Tessera's export_pytorch.py).

Exported from {source}{step}.
Weights ({dtype}): {weights} beside this file, a state_dict with keys
<layer>.weight, <layer>.bias, <layer>.running_mean, <layer>.running_var.

    import {module}
    net = {module}.load()
    logits = net(images)

load() gives the network in eval mode with the weights loaded, on the CPU; images are
[N, {channels}, H, W], the logits {output}. load(weights=PATH, device="cuda") loads other
weights or onto a GPU; build(MODEL) gives the network with fresh weights. Needs only PyTorch:
the builder below is a copy of Tessera's scripts/tessera_torch.py. `python3 {module}.py`
prints the network.
"""

{builder}

MODEL = {model}

WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), {weights!r})


def load(weights=WEIGHTS, device="cpu"):
    """The model with the weights of `weights` (a state_dict file), in eval mode on `device`,
    in the weights' dtype."""
    state = torch.load(weights, map_location=device)
    dtype = next((t.dtype for t in state.values()
                  if torch.is_tensor(t) and t.is_floating_point()), torch.float32)
    net = build(MODEL, dtype=dtype).to(device)
    return copy_state_dict(net, state, source=str(weights)).eval()


if __name__ == "__main__":
    net = load()
    print(net)
    print(f"{{sum(p.numel() for p in net.parameters())}} parameters")
'''


def module_name(stem):
    name = re.sub(r"\W", "_", stem)
    return "_" + name if not name or name[0].isdigit() else name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", metavar="CHECKPOINT",
                    help="checkpoint file, checkpoint directory, or params file")
    ap.add_argument("model", metavar="MODEL.json", nargs="?",
                    help="the model (required with a params file)")
    ap.add_argument("-o", "--out", metavar="OUT",
                    help="write OUT.pt and OUT.py (default: the checkpoint's name, here; a "
                         "directory: the checkpoint's name there)")
    args = ap.parse_args()

    try:
        net, info = tt.build_from_file(args.checkpoint, args.model)
    except tt.Malformed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path, model, dtype = info["path"], info["model"], info["dtype"]
    step = f" (step {info['step']})" if info["step"] is not None else ""

    if args.out is not None and not args.out.strip():
        print("error: -o/--out names nothing", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(module_name(path.stem))
    if out.is_dir():  # a directory: the default names, written there
        out = out / module_name(path.stem)
    if out.suffix in (".pt", ".py"):
        out = out.with_suffix("")
    pt, py = out.with_name(out.name + ".pt"), out.with_name(out.name + ".py")
    text = MODULE_TEMPLATE.format(
        title=model.get("name", "model"), source=path.name, step=step, dtype=dtype,
        weights=pt.name, module=out.name, channels=model["input_channels"],
        output=("[N, classes]" if len(net.tessera_output_shape) == 2 else
                "[N, classes, H', W']"),
        builder=builder_source().rstrip("\n"),
        model=pprint.pformat(model, sort_dicts=False, width=100))
    try:
        if not pt.parent.is_dir():
            raise OSError(f"no directory '{pt.parent}'")
        torch.save(net.state_dict(), pt)
        py.write_text(text)
    except (OSError, RuntimeError) as e:  # torch.save raises RuntimeError for some
        print(f"error: cannot write {pt} and {py}: {e}", file=sys.stderr)
        return 1
    count = sum(p.numel() for p in net.parameters())
    print(f"wrote {pt} ({len(net.state_dict())} tensors, {count} parameters, {dtype}) and {py} "
          f"(model '{model.get('name', '?')}' from {path}{step}; "
          f"`import {out.name}; net = {out.name}.load()`)")
    if not out.name.isidentifier():
        print(f"note: '{out.name}' is not a Python module name: load {py} with "
              f"importlib.util.spec_from_file_location")
    return 0


if __name__ == "__main__":
    sys.exit(main())
