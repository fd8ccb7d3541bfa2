#!/usr/bin/python3
"""Models that leave Tessera for PyTorch and come back, and the pictures:
export_tests.py BUILD_DIR SCENARIO (exit 0 pass, 1 fail, 77 skip: no torch).

Shares the driver of cli_tests.py (every rank's exit code, one error line, no hang). Covers
scripts/tessera_torch.py, export_pytorch.py, import_pytorch.py, show_prediction.py and
seam_compare.py; Tessera's own forward pass (`gradcheck --mode eval --dump`) is the reference
the PyTorch modules are held to.
"""
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_tests as base  # noqa: E402  (exits 77 without h5py and numpy)
from cli_tests import fail, expect_error, expect_ok, scenario  # noqa: E402

import h5py  # noqa: E402
import numpy as np  # noqa: E402

SCRIPTS = base.REPO / "scripts"

# A small U-Net run: batch norm, pooling, transposed conv, skips; 32x32 images.
SMALL = ["--model", "unet-small", "--height", "32", "--width", "32", "--samples", "16",
         "--val-samples", "8", "--batch", "4"]


def tessera_torch():
    """scripts/tessera_torch.py, imported here (skips without torch)."""
    base.needs_torch()
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import tessera_torch as tt
    return tt


def script(env, name, *args):
    """scripts/NAME run in the scenario's directory."""
    return env.run_cmd([sys.executable, SCRIPTS / name, *args])


def expect_script_ok(r, *phrases):
    if r.rc != 0 or "Traceback" in r.output:
        fail("expected the script to succeed (exit 0, no traceback)", r)
    for p in phrases:
        if p not in r.output:
            fail(f"expected the output to contain {p!r}", r)


def expect_script_error(r, *phrases, rc=2):
    """A clean refusal: exit rc, one 'error:' line holding every phrase, no traceback."""
    if r.rc != rc:
        fail(f"expected exit code {rc}", r)
    if "Traceback" in r.output:
        fail("expected a clean error, not a traceback", r)
    lines = [line for line in r.output.splitlines() if line.startswith("error: ")]
    if len(lines) != 1:
        fail(f"expected one 'error:' line, got {len(lines)}", r)
    for p in phrases:
        if p not in lines[0]:
            fail(f"expected the error message to contain {p!r}", r)


def h5_group(path, group):
    with h5py.File(path, "r") as f:
        return base.read_group(f, group) if group in f else {}


def model_attr(path):
    with h5py.File(path, "r") as f:
        v = f.attrs["model"]
    return v.decode() if isinstance(v, bytes) else str(v)


def rel_err(got, want):
    got = np.asarray(got, dtype=np.float64).reshape(np.shape(want))
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def check_outputs(dump, want, rtol, what):
    """The dump's /sharded/output and /reference/output against `want` (PyTorch's logits)."""
    with h5py.File(dump, "r") as f:
        for run in ("sharded", "reference"):
            got = f[f"{run}/output"][()]
            if got.size != want.size:
                fail(f"{what}: {dump}'s /{run}/output is {got.shape}, PyTorch's {want.shape}")
            err = rel_err(got, want)
            if not err <= rtol:
                fail(f"{what}: Tessera's /{run}/output differs from PyTorch's logits by "
                     f"{err:.3e} relative (more than {rtol:g})")
            print(f"{what}: /{run}/output vs PyTorch: {err:.3e} relative")


# The exported module, loaded in a fresh interpreter that has only it and its weights: -I keeps
# PYTHONPATH, the user's site and the script's directory out of sys.path.
LOAD_EXPORTED = r"""
import sys
import numpy as np
import torch
directory, module, images, out = sys.argv[1:5]
sys.path.insert(0, directory)
m = __import__(module)
assert m.__file__.startswith(directory), m.__file__
assert "tessera_torch" not in sys.modules, "the exported module imported tessera_torch"
x = torch.from_numpy(np.load(images))
net = m.load()
assert not net.training, "load() must give the model in eval mode"
with torch.no_grad():
    y32 = net(x.float()).numpy()
    y64 = m.load().double()(x).numpy()
np.savez(out, float32=y32, float64=y64)
print("keys", len(torch.load(m.WEIGHTS)), "dtype", next(net.parameters()).dtype)
"""


@scenario
def export_pytorch_roundtrip(env):
    """A trained unet-small leaves as OUT.py + OUT.pt, runs in a Python that has only those, and
    gives Tessera's eval-mode logits (float64 to 1e-10, float32 to 1e-5); the .pt comes back
    through import_pytorch.py bit for bit."""
    tessera_torch()
    import torch
    ck = env.path("ck")
    r = env.tessera(2, "train", *SMALL, "--steps", "3", "--checkpoint-every", "2",
                    "--checkpoint-dir", ck, "--progress", "plain")
    expect_ok(r, "step 3/3")
    checkpoint = ck / "checkpoint-3.h5"
    if not checkpoint.exists() or not (ck / "checkpoint-2.h5").exists():
        fail(f"expected checkpoint-2.h5 and checkpoint-3.h5 in {ck}", r)

    # The directory gives its highest step; OUT defaults to its name, here.
    r = script(env, "export_pytorch.py", ck)
    expect_script_ok(r, "wrote checkpoint_3.pt", "checkpoint_3.py", "step 3")
    for name in ("checkpoint_3.pt", "checkpoint_3.py"):
        if not env.path(name).is_file():
            fail(f"expected {name} in the current directory", r)
    # -o a directory: the default names there (it wrote <dir>.pt beside it); -o "" refused.
    env.path("here").mkdir()
    expect_script_ok(script(env, "export_pytorch.py", ck, "-o", env.path("here")),
                     "wrote", "checkpoint_3.pt")
    if sorted(p.name for p in env.path("here").iterdir()) != ["checkpoint_3.pt",
                                                             "checkpoint_3.py"]:
        fail("expected checkpoint_3.pt and .py inside the directory given as -o")
    expect_script_error(script(env, "export_pytorch.py", ck, "-o", ""), "-o/--out names nothing")
    out = env.path("out")
    out.mkdir()
    r = script(env, "export_pytorch.py", checkpoint, "-o", out / "unet")
    expect_script_ok(r, "wrote", "unet.pt", "unet.py", "unet-small")
    if sorted(p.name for p in out.iterdir()) != ["unet.pt", "unet.py"]:
        fail(f"expected only unet.pt and unet.py in {out}: {sorted(out.iterdir())}", r)

    # The state_dict holds the checkpoint's parameters and buffers exactly.
    state = torch.load(out / "unet.pt")
    stored = {**{f"{k.replace('/', '.')}": v for k, v in h5_group(checkpoint, "params").items()},
              **{f"{k.replace('/', '.')}": v for k, v in h5_group(checkpoint, "buffers").items()}}
    keys = {k for k in state if not k.endswith("num_batches_tracked")}
    if keys != set(stored):
        fail(f"unet.pt holds {sorted(keys)}, the checkpoint {sorted(stored)}")
    for k, v in stored.items():
        if state[k].dtype != torch.float32 or not np.array_equal(state[k].numpy(), v):
            fail(f"unet.pt's {k} ({state[k].dtype}) differs from the checkpoint's")

    # Back to Tessera: params files in both dtypes, the float32 one the checkpoint's bit for bit.
    env.path("model.json").write_text(model_attr(checkpoint))
    p32, p64 = env.path("p32.h5"), env.path("p64.h5")
    expect_script_ok(script(env, "import_pytorch.py", out / "unet.pt", "model.json", p32),
                     "wrote", "float32")
    expect_script_ok(script(env, "import_pytorch.py", out / "unet.pt", "model.json", p64,
                            "--dtype", "float64"), "float64")
    for group in ("params", "buffers"):
        want, got = h5_group(checkpoint, group), h5_group(p32, group)
        if sorted(want) != sorted(got) or not all(
                got[k].dtype == np.float32 and np.array_equal(got[k], want[k]) for k in want):
            fail(f"p32.h5's /{group} is not the checkpoint's, bit for bit")

    # The exported module alone, in a fresh interpreter.
    rng = np.random.default_rng(5)
    images = rng.uniform(0, 1, size=(2, 3, 32, 32))
    np.save(env.path("images.npy"), images)
    base.write_batch(env.path("batch.h5"), images, np.zeros((2, 32, 32), dtype=np.int64))
    r = env.run_cmd([sys.executable, "-I", "-c", LOAD_EXPORTED, out, "unet",
                     env.path("images.npy"), env.path("logits.npz")])
    expect_script_ok(r, "dtype torch.float32")
    logits = np.load(env.path("logits.npz"))

    # Tessera's eval-mode forward of the same weights.
    for dtype, params, rtol in (("float64", p64, 1e-10), ("float32", p32, 1e-5)):
        dump = env.path(f"d_{dtype}.h5")
        r = env.tessera(2, "gradcheck", "--model", "unet-small", "--init", params, "--input",
                        "batch.h5", "--mode", "eval", "--dtype", dtype, "--dump", dump)
        expect_ok(r, "PASS")
        check_outputs(dump, logits[dtype], rtol, f"unet-small {dtype}")

    # Training goes on from the imported weights.
    r = env.tessera(2, "train", *SMALL, "--steps", "1", "--init", p32, "--progress", "plain")
    expect_ok(r, "step 1/1")

    # Refusals.
    expect_script_error(script(env, "export_pytorch.py", p32), "carries no model",
                        "model JSON")
    r = script(env, "export_pytorch.py", p32, "model.json", "-o", env.path("fromparams"))
    expect_script_ok(r, "wrote")
    base.write_json(env.path("other.json"), base.ALL_LAYERS_MODEL)
    expect_script_error(script(env, "export_pytorch.py", checkpoint, "other.json"),
                        "other.json", "describes other layers")
    expect_script_error(script(env, "export_pytorch.py", "model.json"), "not an HDF5 file")
    expect_script_error(script(env, "export_pytorch.py", "nothere.h5"), "does not exist")
    expect_script_error(script(env, "export_pytorch.py", "batch.h5"),
                        "not a Tessera file", "format")


def randomise(net, seed):
    """Random parameters and batch-norm statistics, so that eval mode is not the identity."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, t in net.state_dict().items():
            if key.endswith("running_var"):
                t.copy_(0.5 + 1.5 * torch.rand(t.shape, generator=gen, dtype=t.dtype))
            elif t.is_floating_point():
                t.copy_(0.5 * torch.randn(t.shape, generator=gen, dtype=t.dtype))


@scenario
def import_pytorch_init(env):
    """Weights made in PyTorch (every layer type, a segmentation net and a classifier) go into
    `tessera gradcheck --init` on 2 ranks and give PyTorch's eval-mode output (float64); a
    state_dict that does not fit is refused naming the key."""
    tt = tessera_torch()
    import torch
    torch.manual_seed(3)
    rng = np.random.default_rng(3)
    for tag, model, seed in (("seg", base.ALL_LAYERS_MODEL, 1), ("cls", base.ALL_HEAD_MODEL, 2)):
        net = tt.build(model, torch.float64)
        randomise(net, seed)
        net.eval()
        sd, params, dump = (env.path(f"{tag}.pt"), env.path(f"{tag}.h5"),
                            env.path(f"{tag}_dump.h5"))
        torch.save(net.state_dict(), sd)
        base.write_json(env.path(f"{tag}.json"), model)
        r = script(env, "import_pytorch.py", sd, f"{tag}.json", params, "--dtype", "float64")
        expect_script_ok(r, "wrote", model["name"], "float64")
        with h5py.File(params, "r") as f:
            fmt = f.attrs.get("format")
            if (fmt.decode() if isinstance(fmt, bytes) else fmt) != base.PARAMS_FORMAT:
                fail(f"{params}: root attribute format is {fmt!r}, not {base.PARAMS_FORMAT}")

        images = rng.uniform(-1, 1, size=(2, 3, 19, 23))
        with torch.no_grad():
            want = net(torch.from_numpy(images)).numpy()
        labels = (np.zeros(want.shape[:1], dtype=np.int64) if want.ndim == 2 else
                  np.zeros((want.shape[0], *want.shape[2:]), dtype=np.int64))
        base.write_batch(env.path(f"{tag}_batch.h5"), images, labels)
        r = env.tessera(2, "gradcheck", "--model", f"{tag}.json", "--grid", "1x1x2", "--init",
                        params, "--input", f"{tag}_batch.h5", "--mode", "eval", "--dtype",
                        "float64", "--dump", dump)
        expect_ok(r, "PASS", "grid 1x1x2")
        # The dump holds the weights as used: exactly the state_dict's.
        used = {**h5_group(dump, "params"), **h5_group(dump, "buffers")}
        state = {k.replace(".", "/", 1): v.numpy() for k, v in net.state_dict().items()
                 if not k.endswith("num_batches_tracked")}
        if sorted(used) != sorted(state) or not all(np.array_equal(used[k], state[k])
                                                    for k in state):
            fail(f"{dump}'s /params and /buffers are not the state_dict's values", r)
        check_outputs(dump, want, 1e-10, model["name"])

    # The default dtype is float32.
    expect_script_ok(script(env, "import_pytorch.py", "seg.pt", "seg.json", "seg32.h5"))
    if {v.dtype.name for v in h5_group(env.path("seg32.h5"), "params").values()} != {"float32"}:
        fail("expected float32 datasets in seg32.h5 by default")

    # What does not fit is refused, naming the key.
    state = torch.load(env.path("seg.pt"))
    wrong = dict(state, **{"c2.weight": torch.zeros(8, 6, 3, 3, dtype=torch.float64)})
    torch.save(wrong, env.path("wrong.pt"))
    expect_script_error(script(env, "import_pytorch.py", "wrong.pt", "seg.json", "w.h5"),
                        "'c2.weight'", "[8, 6, 3, 3]", "[8, 6, 3, 2]")
    missing = {k: v for k, v in state.items() if k != "bn2.running_var"}
    torch.save(missing, env.path("missing.pt"))
    expect_script_error(script(env, "import_pytorch.py", "missing.pt", "seg.json", "w.h5"),
                        "missing bn2.running_var")
    expect_script_error(script(env, "import_pytorch.py", "cls.pt", "seg.json", "w.h5"),
                        "does not fit", "unexpected fc1.weight")
    # A value beyond float32 (infinity once cast) and a negative running variance (every
    # normalised value NaN: predictions of NaN, exit 0) are refused by the script and by --init.
    big = dict(state, **{"c2.weight": state["c2.weight"].clone()})
    big["c2.weight"].view(-1)[0] = 1e300
    torch.save(big, env.path("big.pt"))
    expect_script_ok(script(env, "import_pytorch.py", "big.pt", "seg.json", "w64.h5", "--dtype",
                            "float64"))
    expect_script_error(script(env, "import_pytorch.py", "big.pt", "seg.json", "w.h5"),
                        "'c2.weight' overflows float32")
    negative = dict(state, **{"bn2.running_var": -state["bn2.running_var"].abs() - 1})
    torch.save(negative, env.path("negative.pt"))
    expect_script_error(script(env, "import_pytorch.py", "negative.pt", "seg.json", "w.h5"),
                        "'bn2.running_var' holds a negative variance")
    if env.path("w.h5").exists():
        fail("a refused import must not leave w.h5 behind")
    shutil.copy(env.path("seg.h5"), env.path("negative.h5"))
    with h5py.File(env.path("negative.h5"), "r+") as f:
        f["buffers/bn2/running_var"][0] = -1
    expect_error(env.tessera(2, "gradcheck", "--model", "seg.json", "--init",
                             env.path("negative.h5"), "--input", "seg_batch.h5", "--mode", "eval",
                             "--dtype", "float64"), "running_var", "negative variance")


@scenario
def show_prediction_draws(env):
    """A prediction beside its image, labels and errors; a strided read for large images; a
    file without a prediction is refused cleanly."""
    yy, xx = np.mgrid[0:64, 0:64]
    disc = ((xx - 30) ** 2 + (yy - 34) ** 2 < 300).astype(np.uint8)
    pred = disc.copy()
    pred[5:15, 5:25] = 1
    with h5py.File(env.path("pred.h5"), "w") as f:
        f["labels"] = np.stack([pred, 1 - pred])
    rng = np.random.default_rng(2)
    images = (rng.uniform(0, 80, size=(2, 3, 64, 64)) + 150 * disc).astype(np.uint8)
    base.write_batch(env.path("in.h5"), images, np.stack([disc, 1 - disc]).astype(np.int64))
    r = script(env, "show_prediction.py", "pred.h5", "--input", "in.h5", "--image", "1", "a.png")
    expect_script_ok(r, "wrote a.png", "64x64", "every pixel")
    png = env.path("a.png").read_bytes()
    if len(png) < 1000 or not png.startswith(b"\x89PNG"):
        fail(f"expected a PNG of over 1000 bytes, got {len(png)} bytes", r)
    r = script(env, "show_prediction.py", "pred.h5", "--input", "in.h5", "--max-pixels", "16",
               "b.png")
    expect_script_ok(r, "stride 4")
    # Only class scores: their argmax.
    with h5py.File(env.path("probs.h5"), "w") as f:
        f["probabilities"] = np.stack([1 - pred, pred])[None].astype(np.float32)
    expect_script_ok(script(env, "show_prediction.py", "probs.h5", "c.png"), "wrote c.png")
    if env.path("c.png").stat().st_size < 1000:
        fail("expected c.png to be drawn")
    with h5py.File(env.path("nolabels.h5"), "w") as f:
        f["something"] = np.zeros(3)
    expect_script_error(script(env, "show_prediction.py", "nolabels.h5", "d.png"),
                        "/labels", "/probabilities")
    expect_script_error(script(env, "show_prediction.py", "pred.h5", "--image", "2", "d.png"),
                        "out of range")
    if env.path("d.png").exists():
        fail("a refused drawing must not leave d.png behind")


@scenario
def seam_compare_runs(env):
    """Patch and blend differs from the exact prediction near the seams and only there; the exact
    reference as the "Tessera" file differs by nothing; `tessera predict` (2 ranks, float64)
    agrees to rounding."""
    tt = tessera_torch()
    import torch
    seed = base.seed_params(env)  # convstack-small, seeded random weights
    base.write_params_from(seed, env.path("params.h5"))
    env.path("model.json").write_text(model_attr(seed))
    rng = np.random.default_rng(4)
    images = rng.uniform(0, 1, size=(2, 3, 64, 64))
    base.write_batch(env.path("img.h5"), images, np.zeros((2, 32, 32), dtype=np.int64))

    common = ["params.h5", "model.json", "--images", "img.h5", "--image", "1", "--patch", "32",
              "--overlap", "8"]
    r = script(env, "seam_compare.py", *common, "--json", "s.json")
    expect_script_ok(r, "patch-and-blend", "3x3 patches of 32x32", "wrote s.json")
    s = json.loads(env.path("s.json").read_text())
    blend = s["patch_and_blend"]
    if not blend["all"]["max_abs_prob_diff"] > 1e-6:
        fail(f"expected patch and blend to differ from the exact prediction: {blend}", r)
    if blend["seams"]["max_abs_prob_diff"] != blend["all"]["max_abs_prob_diff"]:
        fail(f"expected the largest difference at a seam: {blend}", r)
    if not (blend["away"]["pixels"] > 0 and blend["away"]["max_abs_prob_diff"] < 1e-12):
        fail(f"expected patch and blend to be exact away from the seams: {blend}", r)
    if s["output"] != [2, 32, 32] or s["output_stride"] != [2, 2]:
        fail(f"expected a 2x32x32 output at stride 2: {s}", r)

    # The exact reference itself, as probabilities and as logits.
    net, _ = tt.build_from_file(env.path("params.h5"), env.path("model.json"),
                                dtype=torch.float64)
    with torch.no_grad():
        logits = net(torch.from_numpy(images)).numpy()
    with h5py.File(env.path("exact.h5"), "w") as f:
        f["probabilities"] = torch.softmax(torch.from_numpy(logits), dim=1).numpy()
    with h5py.File(env.path("exact_logits.h5"), "w") as f:
        f["logits"] = logits
    for pred, tol in (("exact.h5", 0.0), ("exact_logits.h5", 1e-15)):
        r = script(env, "seam_compare.py", *common, "--tessera", pred, "--json", "t.json")
        expect_script_ok(r, "tessera")
        t = json.loads(env.path("t.json").read_text())["tessera"]["all"]
        if not (t["max_abs_prob_diff"] <= tol and t["label_diff_fraction"] == 0):
            fail(f"expected {pred} to match the exact prediction (to {tol}): {t}", r)

    # `tessera predict` on 2 ranks, float64: exact to rounding, no seams.
    r = env.tessera(2, "predict", "--checkpoint", "params.h5", "--model", "model.json",
                    "--input", "img.h5", "--output", "tessera.h5", "--write",
                    "labels,probabilities", "--probabilities-type", "float64", "--dtype",
                    "float64", "--progress", "plain")
    expect_ok(r, "wrote tessera.h5")
    r = script(env, "seam_compare.py", *common, "--tessera", "tessera.h5", "--json", "u.json")
    expect_script_ok(r, "tessera (/probabilities)")
    t = json.loads(env.path("u.json").read_text())["tessera"]["all"]
    if not (t["max_abs_prob_diff"] < 1e-12 and t["label_diff_fraction"] == 0):
        fail(f"expected Tessera's prediction to be exact to rounding: {t}", r)
    # ... and it draws.
    r = script(env, "show_prediction.py", "tessera.h5", "--input", "img.h5", "p.png")
    expect_script_ok(r, "image 64x64, prediction 32x32", "2 classes")

    # Sizes that do not fit the model's stride, and a missing model.
    expect_script_error(script(env, "seam_compare.py", *common[:6], "--patch", "31",
                               "--overlap", "8"), "multiples of the output stride 2")
    expect_script_error(script(env, "seam_compare.py", "params.h5", "--images", "img.h5",
                               "--patch", "32", "--overlap", "8"), "carries no model")


if __name__ == "__main__":
    sys.exit(base.main(sys.argv))
