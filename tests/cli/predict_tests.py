#!/usr/bin/python3
"""End-to-end tests of `tessera predict` and `tessera evaluate`: predict_tests.py BUILD_DIR SCENARIO
(exit 0 pass, 1 fail).

Shares the driver of cli_tests.py (every rank's exit code, one error line, no hang).
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_tests as base  # noqa: E402
from cli_tests import fail, expect_ok, expect_error, scenario  # noqa: E402

import h5py  # noqa: E402
import numpy as np  # noqa: E402


def trained(env, model="unet-small", task="segmentation", dtype="float32"):
    """A short training run's checkpoint directory and a test set of another size (5 images)."""
    ck = env.path(f"ck-{model}")
    if not ck.exists():
        size = ["--height", "32", "--width", "32"]
        expect_ok(env.tessera(1, "datagen", "--output", env.path(f"train-{model}.h5"), "--task",
                              task, "--samples", "16", *size))
        expect_ok(env.tessera(2, "train", "--model", model, "--data",
                              env.path(f"train-{model}.h5"), "--steps", "6", "--batch", "4",
                              "--checkpoint-dir", ck, "--progress", "plain", "--dtype", dtype))
        test_size = ["--height", "40", "--width", "56"] if task == "segmentation" else size
        expect_ok(env.tessera(1, "datagen", "--output", env.path(f"test-{model}.h5"), "--task",
                              task, "--samples", "5", "--seed", "9", *test_size))
    return ck, env.path(f"test-{model}.h5")


def read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}, dict(f.attrs)


def no_temporaries(env):
    left = [p.name for p in env.tmp.iterdir() if ".tmp." in p.name]
    if left:
        fail(f"expected no temporary files left behind, found {left}")


def torch_logits(ck_file, images, model_json):
    """PyTorch's forward of the checkpoint's weights, float64 (scripts/tessera_torch.py)."""
    sys.path.insert(0, str(base.REPO / "scripts"))
    import torch
    import tessera_torch
    net = tessera_torch.build(model_json).double().eval()
    tessera_torch.load_tessera_h5(net, str(ck_file))
    with torch.no_grad():
        return net(torch.from_numpy(images.astype(np.float64))).numpy()


@scenario
def predict_grids_exact(env):
    ck, test = trained(env)
    outs = {}
    for grid, ranks in (("1x1x1", 1), ("1x2x2", 4), ("1x2x3", 6), ("2x1x2", 4)):
        for dtype in ("float64", "float32"):
            out = env.path(f"p-{grid}-{dtype}.h5")
            r = env.tessera(ranks, "predict", "--checkpoint", ck, "--input", test, "--output", out,
                            "--grid", grid, "--dtype", dtype, "--write",
                            "labels,probabilities,logits", "--progress", "plain")
            expect_ok(r, f"grid {grid}", "5 images of 3x40x56", "image 5/5", "done: 5 images",
                      "wrote")
            outs[grid, dtype] = read(out)[0]
    no_temporaries(env)
    ref = outs["1x1x1", "float64"]
    if ref["logits"].shape != (5, 2, 40, 56) or ref["labels"].shape != (5, 40, 56):
        fail(f"unexpected shapes {ref['logits'].shape}, {ref['labels'].shape}")
    if ref["logits"].dtype != np.float64 or ref["labels"].dtype != np.uint8:
        fail(f"unexpected types {ref['logits'].dtype}, {ref['labels'].dtype}")
    for (grid, dtype), o in outs.items():
        base_ = ref if dtype == "float64" else outs["1x1x1", "float32"]
        d = np.abs(o["logits"] - base_["logits"]).max()
        tol = 1e-12 if dtype == "float64" else 1e-5
        if d > tol:
            fail(f"{grid} {dtype}: logits differ from 1x1x1's by {d} (tolerance {tol})")
        if dtype == "float64" and (o["labels"] != ref["labels"]).any():
            fail(f"{grid}: labels differ from 1x1x1's")
        p = o["probabilities"]
        if p.dtype != np.float32 or np.abs(p.sum(axis=1) - 1).max() > 1e-5:
            fail(f"{grid} {dtype}: probabilities are not float32 softmaxes")
        if (np.argmax(o["logits"], axis=1) != o["labels"]).any():
            fail(f"{grid} {dtype}: labels are not the argmax of the logits")
    # float32 against float64: within float32 rounding.
    d = np.abs(outs["1x2x3", "float32"]["logits"] - ref["logits"]).max()
    if d > 1e-4 * np.abs(ref["logits"]).max():
        fail(f"float32 logits differ from float64's by {d}")
    # PyTorch's forward of the same weights.
    with h5py.File(test, "r") as f:
        images = f["images"][()]
    if images.dtype == np.uint8:
        images = images / 255.0
    ck_file = sorted(ck.glob("checkpoint-*.h5"))[-1]
    with h5py.File(ck_file, "r") as f:
        model_json = f.attrs["model"]
    model_json = model_json.decode() if isinstance(model_json, bytes) else model_json
    want = torch_logits(ck_file, images, model_json)
    err = np.abs(outs["1x2x3", "float64"]["logits"] - want).max() / np.abs(want).max()
    if err > 1e-10:
        fail(f"1x2x3 float64 logits differ from PyTorch's by {err} (relative)")
    print(f"float64 logits vs PyTorch: max relative error {err:.2e}")


@scenario
def predict_outputs(env):
    ck, test = trained(env)
    out = env.path("p16.h5")
    # 5 images, 2 groups, 4 per pass: the second pass pads, and only real images are written.
    r = env.tessera(4, "predict", "--checkpoint", ck, "--input", test, "--output", out, "--grid",
                    "2x1x2", "--batch", "4", "--write", "probabilities,labels",
                    "--probabilities-type", "float16", "--compress", "4", "--progress", "plain")
    expect_ok(r, "4 per pass", "image 5/5", "deflate 4")
    data, attrs = read(out)
    ref = env.path("p32.h5")
    expect_ok(env.tessera(1, "predict", "--checkpoint", ck, "--input", test, "--output", ref,
                          "--write", "probabilities,labels", "--progress", "plain"))
    want, _ = read(ref)
    with h5py.File(out, "r") as f:
        if f["probabilities"].dtype != np.float16 or f["probabilities"].compression != "gzip":
            fail(f"expected gzip-compressed float16 probabilities, got "
                 f"{f['probabilities'].dtype} {f['probabilities'].compression}")
        if f["probabilities"].chunks != (1, 1, 40, 28):
            fail(f"expected chunks of a tile (1, 1, 40, 28), got {f['probabilities'].chunks}")
    d = np.abs(data["probabilities"].astype(np.float64) - want["probabilities"]).max()
    if d > 1e-3:  # half precision: 2^-11 relative
        fail(f"float16 probabilities differ from float32's by {d}")
    if (data["labels"] != want["labels"]).any():
        fail("labels differ between 2x1x2 and 1x1x1")
    for key, value in (("format", "tessera-predictions-1"), ("grid", "2x1x2")):
        got = attrs.get(key)
        got = got.decode() if isinstance(got, bytes) else got
        if got != value:
            fail(f"expected root attribute {key} = {value!r}, got {got!r}")
    no_temporaries(env)
    # A classifier writes [N, K] and [N].
    ck, test = trained(env, model="convnet-small", task="classification")
    outs = []
    for grid, ranks in (("1x1x1", 1), ("2x1x2", 4)):
        o = env.path(f"c-{grid}.h5")
        expect_ok(env.tessera(ranks, "predict", "--checkpoint", ck, "--input", test, "--output", o,
                              "--grid", grid, "--write", "labels,probabilities,logits",
                              "--progress", "plain", "--dtype", "float64"))
        outs.append(read(o)[0])
    if outs[0]["probabilities"].shape != (5, 10) or outs[0]["labels"].shape != (5,):
        fail(f"classifier: expected [5, 10] and [5], got {outs[0]['probabilities'].shape}, "
             f"{outs[0]['labels'].shape}")
    if np.abs(outs[0]["logits"] - outs[1]["logits"]).max() > 1e-12:
        fail("classifier: 2x1x2 logits differ from 1x1x1's")


@scenario
def evaluate_metrics(env):
    ck, test = trained(env)
    reports = []
    for grid, ranks in (("1x1x1", 1), ("1x2x2", 4)):
        js = env.path(f"e-{grid}.json")
        r = env.tessera(ranks, "evaluate", "--checkpoint", ck, "--input", test, "--grid", grid,
                        "--json", js, "--dtype", "float64", "--progress", "plain")
        expect_ok(r, "evaluation: 5 images", "loss", "accuracy", "mIoU", "class  IoU")
        reports.append(json.loads(js.read_text()))
    a, b = reports
    if a["confusion"] != b["confusion"] or abs(a["loss"] - b["loss"]) > 1e-12:
        fail(f"1x1x1 and 1x2x2 disagree: {a} vs {b}")
    # The same numbers from the predictions and the labels, in numpy.
    out = env.path("p.h5")
    expect_ok(env.tessera(1, "predict", "--checkpoint", ck, "--input", test, "--output", out,
                          "--write", "logits,labels", "--dtype", "float64"))
    p, _ = read(out)
    with h5py.File(test, "r") as f:
        labels = f["labels"][()]
    logits = p["logits"]
    top = logits.max(axis=1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))[:, 0]
    picked = np.take_along_axis(logits, labels[:, None].astype(np.int64), axis=1)[:, 0]
    loss = float((lse - picked).mean())
    pred = p["labels"].astype(np.int64)
    confusion = np.zeros((2, 2), dtype=np.int64)
    np.add.at(confusion, (labels.ravel(), pred.ravel()), 1)
    if confusion.tolist() != a["confusion"]:
        fail(f"confusion {a['confusion']}, numpy says {confusion.tolist()}")
    if abs(loss - a["loss"]) > 1e-9:
        fail(f"loss {a['loss']}, numpy says {loss}")
    iou = [confusion[k, k] / (confusion[k].sum() + confusion[:, k].sum() - confusion[k, k])
           for k in range(2)]
    if max(abs(x - y) for x, y in zip(iou, a["class_iou"])) > 1e-12:
        fail(f"class IoU {a['class_iou']}, numpy says {iou}")
    if abs(np.mean(iou) - a["mean_iou"]) > 1e-12 or abs(a["accuracy"] - np.trace(confusion)
                                                        / confusion.sum()) > 1e-12:
        fail("mean IoU or accuracy disagree with numpy")


@scenario
def predict_errors(env):
    ck, test = trained(env)
    # An image far beyond memory: refused before any work, with the memory per rank it needs and
    # a grid that would fit. The file is sparse: declared, allocated, never written.
    from h5py import h5d, h5p, h5s, h5t
    with h5py.File(env.path("big.h5"), "w") as f:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        h5d.create(f.id, b"images", h5t.NATIVE_UINT8, h5s.create_simple((1, 3, 20000, 20000)),
                   dcpl=dcpl)
    r = env.tessera(2, "predict", "--checkpoint", ck, "--input", env.path("big.h5"), "--output",
                    env.path("big-out.h5"))
    expect_error(r, "the run needs", "per rank", "available", "image 1x3x20000x20000",
                 "would fit")
    # A truncated input.
    data = test.read_bytes()
    env.path("cut.h5").write_bytes(data[: len(data) // 2])
    r = env.tessera(2, "predict", "--checkpoint", ck, "--input", env.path("cut.h5"), "--output",
                    env.path("o.h5"))
    expect_error(r, "cut.h5", any_of=["damaged", "truncated"])
    # Unwritable outputs: a directory that does not exist, one where nothing can be created.
    r = env.tessera(2, "predict", "--checkpoint", ck, "--input", test, "--output",
                    env.path("nodir/o.h5"))
    expect_error(r, "does not exist")
    r = env.tessera(2, "predict", "--checkpoint", ck, "--input", test, "--output", "/proc/o.h5")
    expect_error(r, "cannot write --output '/proc/o.h5'")
    # Weights that do not fit the model, a params file without --model, a damaged checkpoint.
    r = env.tessera(2, "predict", "--checkpoint", ck, "--model", "convstack-small", "--input",
                    test, "--output", env.path("o.h5"))
    expect_error(r, "was trained with model 'unet-small'", "convstack-small")
    newest = sorted(ck.glob("checkpoint-*.h5"))[-1]
    with h5py.File(newest, "r") as f, h5py.File(env.path("params.h5"), "w") as g:
        f.copy("params", g)
        f.copy("buffers", g)
        g.attrs["format"] = base.PARAMS_FORMAT
    r = env.tessera(2, "predict", "--checkpoint", env.path("params.h5"), "--input", test,
                    "--output", env.path("o.h5"))
    expect_error(r, "--model is needed with a parameter file")
    r = env.tessera(2, "predict", "--checkpoint", env.path("params.h5"), "--model", "unet-small",
                    "--input", test, "--output", env.path("o.h5"), "--progress", "plain")
    expect_ok(r, "parameters", "done: 5 images")
    junk = env.path("junk")
    junk.mkdir()
    (junk / "checkpoint-5.h5").write_bytes(newest.read_bytes()[:3000])
    r = env.tessera(2, "predict", "--checkpoint", junk, "--input", test, "--output",
                    env.path("o2.h5"))
    expect_error(r, "no checkpoint in", "verifies")
    r = env.tessera(2, "evaluate", "--checkpoint", ck, "--input", test, "--json",
                    env.path("nodir/e.json"))
    expect_error(r, "cannot write --json", "does not exist")
    # Found before the images are evaluated, not when the report is written.
    r = env.tessera(2, "evaluate", "--checkpoint", ck, "--input", test, "--json", junk,
                    "--progress", "plain")
    expect_error(r, "cannot write --json", "it is a directory")
    if "image " in r.output:
        fail("expected --json refused before evaluating", r)
    # An output that names a file the run reads (through a link too), or another output: refused
    # before anything is written, the files as they were.
    link = env.path("link.h5")
    link.symlink_to(newest)
    before = {p: p.read_bytes() for p in (newest, test)}
    for command, args, words in [
            ("predict", ["--checkpoint", newest, "--input", test, "--output", link],
             ["--output", "is the --checkpoint file"]),
            ("predict", ["--checkpoint", ck, "--input", test, "--output", newest],
             ["is a checkpoint in the --checkpoint directory"]),
            ("evaluate", ["--checkpoint", ck, "--input", test, "--json", test],
             ["--json", "is the --input file"]),
            ("evaluate", ["--checkpoint", ck, "--input", test, "--json", env.path("x.json"),
                          "--output", env.path("x.json")], ["is the --output file"])]:
        expect_error(env.tessera(2, command, *args), *words)
    if any(p.read_bytes() != data for p, data in before.items()):
        fail("a refused run changed a file it reads")
    # Evaluation needs labels.
    with h5py.File(test, "r") as f, h5py.File(env.path("nolabels.h5"), "w") as g:
        g["images"] = f["images"][()]
    r = env.tessera(2, "evaluate", "--checkpoint", ck, "--input", env.path("nolabels.h5"))
    expect_error(r, "has no dataset '/labels'")
    r = env.tessera(2, "predict", "--checkpoint", ck, "--input", env.path("nolabels.h5"),
                    "--output", env.path("o3.h5"), "--write", "labels,nonsense")
    expect_error(r, "bad --write 'nonsense'")
    for name in ("big-out.h5", "o2.h5", "o3.h5"):
        if env.path(name).exists():
            fail(f"a failed run left its output {name}")
    no_temporaries(env)
    # Images alone (no /labels) predict fine.
    expect_ok(env.tessera(2, "predict", "--checkpoint", ck, "--input", env.path("nolabels.h5"),
                          "--output", env.path("o3.h5"), "--progress", "plain"), "done: 5 images")


@scenario
def predict_disk_full(env):
    """A filesystem too small for the output: refused up front when the size is known; with
    --compress the write fails mid-run and the job ends (MPI_Abort: HDF5 cannot close a parallel
    file after a failed write) without a hang, a crash or a file left behind, on 1 and 2 ranks,
    also where it fills up in a later write on one rank alone."""
    ck, test = trained(env)
    small = env.path("small")
    small.mkdir()
    if os.geteuid() != 0 or env.run_cmd(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                         small]).rc != 0:
        print("SKIP: mounting a small tmpfs needs root")
        sys.exit(base.SKIP)

    def unmount():
        # Aborted ranks may hold the filesystem a moment longer: retry, then detach it lazily.
        import time
        for _ in range(20):
            if env.run_cmd(["umount", small]).rc == 0:
                return
            time.sleep(0.5)
        env.run_cmd(["umount", "-l", small])

    def fills_up(r):
        if r.rc == 0 or "is the disk full?" not in r.output or "was not written" not in r.output:
            fail("expected the full disk to end the run with its message", r)
        # "timeout:": a rank whose write failed waited for ranks still inside HDF5's collective
        # write of compressed chunks (before, until --timeout; 600 s by default).
        for marker in ("Segmentation fault", "core dumped", "HDF5-DIAG", "Traceback",
                       "APPLICATION TIMED OUT", "timeout:"):
            if marker in r.output:
                fail(f"expected no {marker!r} after a full disk", r)
        left = sorted(p.name for p in small.iterdir())
        if left:
            fail(f"expected nothing left on the full filesystem, found {left}", r)

    args = ["predict", "--checkpoint", ck, "--input", test, "--write",
            "labels,probabilities,logits", "--dtype", "float64", "--timeout", "30"]
    try:
        out = small / "o.h5"
        expect_error(env.tessera(2, *args, "--output", out), "needs about", "free", "--compress")
        for ranks in (1, 2):
            fills_up(env.tessera(ranks, *args, "--output", out, "--compress", "1", "--grid",
                                 f"1x1x{ranks}"))
    finally:
        unmount()
    # Room for part of the compressed output: the disk fills up in a later write, where one
    # rank's write can fail while the other's goes on into the collective's next steps.
    whole = env.path("whole.h5")
    expect_ok(env.tessera(2, *args, "--output", whole, "--compress", "1"))
    size = whole.stat().st_size
    for part in (2, 3):
        room = size * part // 4 // 4096 * 4
        if env.run_cmd(["mount", "-t", "tmpfs", "-o", f"size={room}k", "tmpfs", small]).rc != 0:
            fail(f"could mount a tmpfs of 64k but not of {room}k")
        try:
            fills_up(env.tessera(2, *args, "--output", small / "o.h5", "--compress", "1"))
        finally:
            unmount()


@scenario
def train_init_from_params(env):
    ck, test = trained(env)
    newest = sorted(ck.glob("checkpoint-*.h5"))[-1]
    with h5py.File(newest, "r") as f, h5py.File(env.path("params.h5"), "w") as g:
        f.copy("params", g)
        f.copy("buffers", g)
        g.attrs["format"] = base.PARAMS_FORMAT
        want = {k: f["params"][k][name][()] for k in f["params"] for name in f["params"][k]
                if name == "weight"}
    # lr 0: the parameters stay what --init gave them (batch-norm statistics move in training).
    r = env.tessera(2, "train", "--model", "unet-small", "--init", env.path("params.h5"),
                    "--steps", "1", "--lr", "0", "--height", "32", "--width", "32", "--samples",
                    "8", "--batch", "4", "--val-samples", "0", "--checkpoint-dir",
                    env.path("ck2"), "--progress", "plain")
    expect_ok(r, "done: 1 steps")
    with h5py.File(env.path("ck2/checkpoint-1.h5"), "r") as f:
        for layer, w in want.items():
            if not np.array_equal(f["params"][layer]["weight"][()], w):
                fail(f"--init: {layer}/weight is not the file's")
    # Resumed (a batch script passes --resume --init on every start): the checkpoint's, said so.
    r = env.tessera(2, "train", "--model", "unet-small", "--init", env.path("params.h5"),
                    "--steps", "2", "--lr", "0", "--height", "32", "--width", "32", "--samples",
                    "8", "--batch", "4", "--val-samples", "0", "--checkpoint-dir",
                    env.path("ck2"), "--progress", "plain", "--resume", "--allow-changes")
    expect_ok(r, "checkpoint-1.h5 (step 1)", "the parameters are the checkpoint's; --init",
              "applies to a fresh start only", "done: 1 steps")
    # Without --init the first step starts elsewhere (the test can fail).
    r = env.tessera(2, "train", "--model", "unet-small", "--steps", "1", "--lr", "0", "--height",
                    "32", "--width", "32", "--samples", "8", "--batch", "4", "--val-samples", "0",
                    "--checkpoint-dir", env.path("ck3"), "--progress", "plain")
    expect_ok(r)
    with h5py.File(env.path("ck3/checkpoint-1.h5"), "r") as f:
        if all(np.array_equal(f["params"][k]["weight"][()], w) for k, w in want.items()):
            fail("a run without --init has the same weights")
    # A file for another model is refused.
    r = env.tessera(2, "train", "--model", "convnet-small", "--init", env.path("params.h5"),
                    "--steps", "1", "--height", "32", "--width", "32", "--samples", "8")
    expect_error(r, "params.h5")


if __name__ == "__main__":
    sys.exit(base.main(sys.argv))
