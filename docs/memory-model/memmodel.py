#!/usr/bin/env python3
"""Liveness model of one rank's memory in a Tessera training step / inference pass.

Walks the graph as engine/model.cpp does (forward in order, backward in reverse), with per-layer
rules for what each layer allocates, keeps and frees. Bytes of each tensor are rounded to the host
pool's 2 MiB blocks when >= 1 MiB (src/allocator.cpp). Returns the largest live total.
"""
import math, sys

MIB = 1 << 20
HUGE = 2 << 20


def rnd(b):
    if b <= 0:
        return 0
    if b >= MIB:
        return (b + HUGE - 1) // HUGE * HUGE
    return b


# ---- built-in models (src/engine/model_spec.cpp) ----
def conv(name, c, k, s=1, p=None, d=1, bias=True, inp=None):
    kh, kw = (k, k) if isinstance(k, int) else k
    if p == "same":
        ph = (d * (kh - 1) // 2, d * (kh - 1) - d * (kh - 1) // 2)
        pw = (d * (kw - 1) // 2, d * (kw - 1) - d * (kw - 1) // 2)
    else:
        p = p or 0
        ph = pw = (p, p)
    return dict(name=name, type="conv2d", c=c, k=(kh, kw), s=s, ph=ph, pw=pw, d=d, bias=bias, inp=inp)


def L(name, type, inp=None, **kw):
    return dict(name=name, type=type, inp=inp, **kw)


MODELS = {
    "convstack-small": [
        conv("c1", 8, 3, p=1), L("r1", "relu"),
        conv("c2", 8, 4, s=2, p=1), L("r2", "relu"),
        conv("c3", 8, 3, d=2, p="same"), L("r3", "relu"),
        conv("c4", 8, (5, 2), p="same"), L("r4", "relu"),
        conv("head", 2, 1)],
    "conv-bench": [
        conv("c1", 32, 3, p=1), L("r1", "relu"), conv("c2", 32, 3, p=1), L("r2", "relu"),
        conv("c3", 32, 3, p=1), L("r3", "relu"), conv("c4", 32, 3, p=1), L("r4", "relu"),
        conv("head", 2, 1)],
    "convnet-small": [
        conv("c1", 16, 3, p=1, bias=False), L("bn1", "bn"), L("r1", "relu"),
        conv("c2", 32, 3, s=2, p=1, bias=False), L("bn2", "bn"), L("r2", "relu"),
        conv("c3", 64, 3, s=2, p=1, bias=False), L("bn3", "bn"), L("r3", "relu"),
        L("gap", "gap"), L("fc", "linear", out=10)],
    "unet-small": [
        conv("e1a", 8, 3, p=1, bias=False), L("e1a_bn", "bn"), L("e1a_relu", "relu"),
        conv("e1b", 8, 3, p=1, bias=False), L("e1b_bn", "bn"), L("e1", "relu"),
        L("pool1", "maxpool", k=2),
        conv("e2a", 16, 3, p=1, bias=False), L("e2a_bn", "bn"), L("e2a_relu", "relu"),
        conv("e2b", 16, 3, p=1, bias=False), L("e2b_bn", "bn"), L("e2", "relu"),
        L("pool2", "maxpool", k=2),
        conv("m1", 32, 3, p=1, bias=False), L("m1_bn", "bn"), L("m1_relu", "relu"),
        conv("m2", 32, 3, p=1, bias=False), L("m2_bn", "bn"), L("m", "relu"),
        L("up2", "convT", c=16, k=2, s=2),
        L("cat2", "concat", inp=["up2", "e2"]),
        conv("d2", 16, 3, p=1, bias=False), L("d2_bn", "bn"), L("d2_relu", "relu"),
        L("up1", "upsample", scale=2),
        L("cat1", "concat", inp=["up1", "e1"]),
        conv("d1", 8, 3, p=1, bias=False), L("d1_bn", "bn"), L("d1_relu", "relu"),
        conv("head", 2, 1)],
}
WINDOW_TYPES = {"conv2d", "maxpool", "upsample", "convT"}


def block(extent, parts, i):
    q, r = divmod(extent, parts)
    return (i * q + min(i, r), (i + 1) * q + min(i + 1, r))


def build(model, C, H, W):
    """Global shapes, inputs (indices, -1 = model input), params."""
    layers = MODELS[model]
    names = {}
    nodes = []
    shape = (C, H, W)
    for k, l in enumerate(layers):
        if l["inp"] is None:
            ins = [k - 1]
        else:
            ins = [names[n] for n in l["inp"]]
        ishapes = [(C, H, W) if i < 0 else nodes[i]["out"] for i in ins]
        c, h, w = ishapes[0]
        t = l["type"]
        n = dict(l, ins=ins, ishapes=ishapes, params=0)
        if t == "conv2d":
            kh, kw = l["k"]
            sh = ((kh - 1) * l["d"] + 1, (kw - 1) * l["d"] + 1)
            oh = (h + l["ph"][0] + l["ph"][1] - sh[0]) // l["s"] + 1
            ow = (w + l["pw"][0] + l["pw"][1] - sh[1]) // l["s"] + 1
            n["out"] = (l["c"], oh, ow)
            n["span"] = sh
            n["params"] = l["c"] * c * kh * kw + (l["c"] if l["bias"] else 0)
        elif t == "bn":
            n["out"] = (c, h, w); n["params"] = 2 * c
        elif t == "relu":
            n["out"] = (c, h, w)
        elif t == "maxpool":
            n["out"] = (c, h // l["k"], w // l["k"])
        elif t == "upsample":
            n["out"] = (c, h * l["scale"], w * l["scale"])
        elif t == "convT":
            n["out"] = (l["c"], h * l["s"], w * l["s"]); n["params"] = c * l["c"] * 4 + l["c"]
        elif t == "concat":
            n["out"] = (sum(s[0] for s in ishapes), h, w)
        elif t == "gap":
            n["out"] = (c, 1, 1); n["replicated"] = True
        elif t == "linear":
            n["out"] = (l["out"], 1, 1); n["replicated"] = True; n["params"] = l["out"] * c + l["out"]
        names[l["name"]] = k
        nodes.append(n)
    for k, n in enumerate(nodes):
        n["consumers"] = [j for j, m in enumerate(nodes) if k in m["ins"]]
    return nodes


def window_rows(n, r, axis):
    """Input range a window layer reads for output range r (not clipped)."""
    t = n["type"]
    if t == "conv2d":
        s = n["s"]; pad = (n["ph"] if axis == 0 else n["pw"])[0]; span = n["span"][axis]
        return (r[0] * s - pad, (r[1] - 1) * s - pad + span)
    if t == "maxpool":
        k = n["k"]
        return (r[0] * k, (r[1] - 1) * k + k)
    if t == "upsample":
        s = n["scale"]
        return (r[0] // s, (r[1] - 1) // s + 1)
    if t == "convT":  # kernel 2 stride 2, no padding
        return (r[0] // 2, (r[1] - 1) // 2 + 1)
    raise ValueError(t)


def simulate(model, C, H, W, grid=(1, 1), rank=(0, 0), dtype=4, kernels="onednn", batch=1,
             fuse=True, windowless=True, inference=False, trace=False, bf16=False):
    nodes = build(model, C, H, W)
    gh, gw = grid
    fast = kernels == "onednn" and dtype == 4  # oneDNN / narrow / tiled kernels compute float32
    N = len(nodes)

    def tile(shape, replicated=False):
        c, h, w = shape
        if replicated:
            return (c, 1, 1)
        rr = block(h, gh, rank[0]); cc = block(w, gw, rank[1])
        return (c, rr[1] - rr[0], cc[1] - cc[0])

    def ranges(shape):
        c, h, w = shape
        return block(h, gh, rank[0]), block(w, gw, rank[1])

    def el(s):
        return s[0] * s[1] * s[2] * batch

    def B(elems, per=None):
        return rnd(elems * (per or dtype))

    # ---- decisions (engine/model.cpp constructor) ----
    for k, n in enumerate(nodes):
        n["out_t"] = tile(n["out"], n.get("replicated"))
        n["in_t"] = [tile(s, (nodes[i].get("replicated") if i >= 0 else False)) for i, s in zip(n["ins"], n["ishapes"])]
        n["in_el"] = sum(el(s) for s in n["in_t"])
        n["handed"] = len(n["ins"]) == 1 and n["ins"][0] >= 0 and len(nodes[n["ins"][0]]["consumers"]) == 1
        if n["type"] in WINDOW_TYPES:
            rr, cc = ranges(n["out"])
            wr = window_rows(n, rr, 0); wc = window_rows(n, cc, 1)
            cin = sum(s[0] for s in n["ishapes"])
            irr, icc = ranges(n["ishapes"][0])
            n["win_tile"] = (wr == irr and wc == icc)
            wch = cin
            n["win_el"] = wch * (wr[1] - wr[0]) * (wc[1] - wc[0]) * batch
            # blocked windows pad channels to 16 (conv2d.cpp bind_kernel) with the fast kernels
            n["win_el_pad"] = (((cin + 15) // 16 * 16) if (fast and cin > 16 and cin % 16) else cin) * \
                (wr[1] - wr[0]) * (wc[1] - wc[0]) * batch
    # taken concats
    for k, n in enumerate(nodes):
        n["taken"] = False
        if fuse and n["type"] == "concat" and len(n["consumers"]) == 1:
            cons = nodes[n["consumers"][0]]
            ch = 0; ok = cons["type"] == "conv2d"
            for s in n["ishapes"]:
                if ch % 16: ok = False
                ch += s[0]
            if ok:
                n["taken"] = True
                cons["parts"] = n["ins"]
                cons["parts_t"] = n["in_t"]
    # reader of a taken concat, for hand-over of concat inputs
    # activation fusion
    for k, n in enumerate(nodes):
        n["by_producer"] = n["by_consumer"] = False
        if n["type"] != "relu" or not fuse:
            continue
        i = n["ins"][0]
        prod = nodes[i] if i >= 0 else None
        prod_applies = prod is not None and len(prod["consumers"]) == 1 and (
            prod["type"] == "bn" or (prod["type"] == "conv2d" and fast))
        cons_applies = len(n["consumers"]) == 1 and nodes[n["consumers"][0]]["type"] in WINDOW_TYPES \
            and not nodes[n["consumers"][0]].get("taken")
        grad_by_prod = prod_applies and not cons_applies and prod["type"] == "bn"
        n["by_producer"] = prod_applies
        n["by_consumer"] = cons_applies or grad_by_prod
    # windowless convs (conv2d.cpp windowless_fits), on host
    for k, n in enumerate(nodes):
        n["windowless"] = False
        if n["type"] != "conv2d" or not windowless:
            continue
        cin = n["ishapes"][0][0] if "parts" not in n else sum(s[0] for s in n["ishapes"])
        if n["s"] != 1 or n["span"] == (1, 1):
            continue
        if "parts" not in n and cin > 16 and cin % 16:
            continue
        if n["ishapes"][0][1:] != n["out"][1:]:
            continue
        if "parts" in n and not (not fast or n["c"] < 16):  # narrow kernel (few channels) or reference
            continue
        # interior on every rank: tile larger than the reach (approximation)
        rr, cc = ranges(n["out"])
        if (rr[1] - rr[0]) <= n["span"][0] or (cc[1] - cc[0]) <= n["span"][1]:
            continue
        n["windowless"] = True

    # halo buffers (halo/halo_exchange.cpp: recv + send buffers per exchange, kept): per window
    # layer the boxes this rank receives and sends; a windowless conv has two exchanges per strip
    # side (fill, accumulate) of about the same boxes, and its strips' buffers (x, grad, dy).
    halo_bytes = 0
    for k, n in enumerate(nodes):
        if n["type"] not in WINDOW_TYPES or gh * gw == 1:
            continue
        cin = sum(s[0] for s in n["ishapes"])
        def tiles_of(shape, a, b):
            c, h, w = shape
            return block(h, gh, a), block(w, gw, b)
        def win_of(a, b):
            rr, cc = tiles_of(n["out"], a, b)
            return window_rows(n, rr, 0), window_rows(n, cc, 1)
        def inter(r1, r2):
            return max(0, min(r1[1], r2[1]) - max(r1[0], r2[0]))
        me = rank
        wr, wc = win_of(*me)
        tr, tc = tiles_of(n["ishapes"][0], *me)
        moved = 0
        for a in range(gh):
            for b in range(gw):
                if (a, b) == me:
                    continue
                pr, pc = tiles_of(n["ishapes"][0], a, b)
                moved += inter(wr, pr) * inter(wc, pc)          # received
                qr, qc = win_of(a, b)
                moved += inter(qr, tr) * inter(qc, tc)          # sent
        per = moved * cin * batch * dtype
        if n.get("windowless"):
            per = 2 * per
            # strips: footprint (x and grad) and dy per side, about the received boxes' sizes
            per += 2 * moved * cin * batch * dtype + moved * n["c"] * batch * dtype
        halo_bytes += per
    # which convs the narrow AVX-512 kernels compute (NCHW; narrow_conv.cpp narrow_conv_fits)
    def few(i, o):
        return i <= 64 if o <= 8 else (o <= 16 and i < 32 and i % 16 != 0)
    for n in nodes:
        n["narrow"] = fast and n["type"] == "conv2d" and n["s"] == 1 and n["span"] != (1, 1) and \
            few(sum(s[0] for s in n["ishapes"]), n["c"])
        n["pointwise1"] = fast and n["type"] == "conv2d" and n["span"] == (1, 1) and n["s"] == 1 and n["c"] <= 8
    # blocked_ok as engine/model.cpp decides it
    TAKES = {"conv2d", "convT", "bn", "relu", "maxpool", "upsample"}
    PASSES = {"bn", "relu"}
    def reader(c):
        return nodes[c]["consumers"][0] if nodes[c]["taken"] else c
    for k in range(N - 1, -1, -1):
        n = nodes[k]
        ok = bool(n["consumers"]) and not n["narrow"]
        for c in n["consumers"]:
            r = reader(c)
            ok = ok and nodes[r]["type"] in TAKES and not nodes[r]["narrow"] and \
                (nodes[r]["type"] not in PASSES or nodes[r]["blocked_ok"])
        n["blocked_ok"] = ok
    for n in nodes:
        n["bf16"] = 0
        if bf16 and fast and n["type"] == "conv2d" and not n["narrow"] and not n["pointwise1"]:
            # --precision bf16 (onednn_conv.cpp): bf16 copies of x and dy, backward-weights'
            # scratchpad in strips of <= 64 MiB (g_weights_scratch_limit) and a strip's dy
            n["bf16"] = B(2 * n["win_el"] // dtype * dtype // 2 * 2 // 2) if False else \
                rnd(2 * n["win_el"]) + rnd(2 * el(n["out_t"])) + 80 * MIB
        # Winograd-shaped convs (onednn_conv.cpp winograd_shape): a scratchpad of at most 16 MiB
        cin = sum(s[0] for s in n["ishapes"])
        n["scratch"] = 16 * MIB if (fast and n["type"] == "conv2d" and n["k"] == (3, 3) and n["s"] == 1
                                    and n["d"] == 1 and min(cin, n["c"]) >= 16 and max(cin, n["c"]) >= 32) else 0
        # a oneDNN conv whose output must be NCHW: its dy (and y) reordered, padded to 16 channels
        n["reorder"] = 0
        if fast and n["type"] == "conv2d" and not n["narrow"] and not n["pointwise1"] and not n["blocked_ok"]:
            c, h, w = n["out_t"]
            n["reorder"] = (c + 15) // 16 * 16 * h * w * batch
    # ---- the walk ----
    live = {}
    cur = [0]
    peak = [0, ""]
    log = []

    def alloc(key, b, why):
        assert key not in live, key
        live[key] = b
        cur[0] += b
        if cur[0] > peak[0]:
            peak[0] = cur[0]; peak[1] = why
        if trace:
            log.append("A %7.1f %8.1f %s" % (b / MIB, cur[0] / MIB, why))

    def free(key):
        if key in live:
            cur[0] -= live.pop(key)
            if trace:
                log.append("F          %8.1f %s" % (cur[0] / MIB, key))

    P = sum(n["params"] for n in nodes)
    alloc("params", rnd(P * dtype) * 2 if P * dtype >= MIB else 2 * P * dtype, "params")
    if gh * gw > 1:
        alloc("bucket", rnd(P * dtype), "gradient buckets")
    if halo_bytes:
        alloc("halo", halo_bytes, "halo buffers")
    x_el = el(tile((C, H, W)))
    alloc("X", B(x_el), "input batch")
    last = nodes[-1]
    if not last.get("replicated") and not inference:
        alloc("labels", B(el(last["out_t"]) // last["out_t"][0], 4), "labels")

    out = {}  # node -> key of its live output (a taken concat's reader counts as its inputs' reader)
    kept = {}  # node -> list of keys kept for backward
    passes = 2 if inference else 1

    def out_key(i):
        return "X" if i < 0 else out[i]

    for p in range(passes):
        sfx = str(p)
        out.clear()
        pending = {k: len(n["consumers"]) for k, n in enumerate(nodes)}
        for k, n in enumerate(nodes):
            if n["taken"]:
                continue
            t = n["type"]
            name = n["name"]
            ins = n.get("parts", n["ins"])
            kk = []

            def adopt():  # the layer keeps its (handed-over) input itself
                kk.append(out_key(ins[0]))
                n["adopted"] = [ins[0]]

            def keep(suffix, b, why):  # the layer keeps a buffer of its own
                alloc(name + suffix, b, why)
                kk.append(name + suffix)

            # the last pass's kept state: buffers of the layer's own are reused (freed here, taken
            # again below); an adopted input goes as this forward starts, a conv's only after its
            # output is allocated (keep_tile / keep_concat_tiles run after the output's allocation)
            old_kept = kept.get(k, [])
            for key in list(old_kept):
                if n["type"] != "conv2d" or key.startswith(n["name"] + "."):
                    free(key)
                    old_kept.remove(key)
            n["adopted"] = []
            n["moved"] = False
            if t == "conv2d":
                if "parts" in n:
                    # each part kept: itself where handed (its last reader), else a copy
                    for j, i in enumerate(ins):
                        last_reader = pending[i] == 1
                        if not (i >= 0 and last_reader):
                            alloc(name + ".part%d" % j, B(el(n["parts_t"][j])), name + " part copy")
                            kk.append(name + ".part%d" % j)
                        else:
                            kk.append(out_key(i)); n.setdefault("adopted", []).append(i)
                    if not n["windowless"]:
                        for key in kk:
                            if key.startswith(name + ".part"):
                                free(key)
                        kk = [key for key in kk if not key.startswith(name + ".part")]
                        n["adopted"] = []
                        keep(".win", B(n["win_el_pad"]), name + " window (parts)")
                    elif not fast:  # reference: parts gathered into one tensor per call
                        alloc(name + ".gather", B(n["in_el"]), name + " gather")
                        free(name + ".gather")
                elif n["windowless"]:
                    # keep_tile: a copy, conservatively (the input is freed below if this is its last reader)
                    if n["handed"] and not fast:
                        adopt()
                    else:
                        keep(".keep", B(n["in_el"]), name + " kept tile")
                else:
                    if n["win_tile"] and n["handed"]:
                        adopt()
                    else:
                        keep(".win", B(n["win_el_pad"]), name + " window")
                alloc(name + ".y" + sfx, B(el(n["out_t"])), name + " output")
                for key in old_kept:
                    free(key)
                if fast:
                    alloc(name + ".scratch", n["scratch"] + B(n["reorder"]) + n["bf16"], name + " oneDNN scratch + y reorder")
                    free(name + ".scratch")
            elif t in ("maxpool", "upsample", "convT"):
                fused_grad = False  # (the activation before it is fused as consumer only for single consumers)
                prev = nodes[ins[0]] if ins[0] >= 0 else None
                if prev is not None and prev["type"] == "relu" and prev["by_consumer"] and len(prev["consumers"]) == 1:
                    fused_grad = True
                reads_window = t == "convT"
                if n["win_tile"] and not reads_window and not fused_grad:
                    pass  # in place: nothing kept
                elif n["win_tile"] and n["handed"]:
                    adopt()
                else:
                    keep(".win", B(n["win_el"]), name + " window")
                alloc(name + ".y" + sfx, B(el(n["out_t"])), name + " output")
                if t == "maxpool":
                    if "pool.idx" + name not in live:
                        alloc("pool.idx" + name, B(el(n["out_t"]), 1 if fast else 8), name + " argmax")
            elif t == "bn":
                if n["handed"]:
                    adopt()
                else:
                    keep(".x", B(n["in_el"]), name + " x copy")
                alloc(name + ".y" + sfx, B(el(n["out_t"])), name + " output")
            elif t == "relu":
                if not n["by_consumer"] and ("mask" + name) not in live:
                    alloc("mask" + name, B(el(n["out_t"]), 1), name + " mask")
                if n["by_producer"]:
                    out[k] = out[ins[0]]; pending[ins[0]] = 1  # moved through
                    n["moved"] = True
                else:
                    alloc(name + ".y" + sfx, B(el(n["out_t"])), name + " output")
            elif t == "concat":
                alloc(name + ".y" + sfx, B(el(n["out_t"])), name + " output")
            elif t in ("gap", "linear"):
                alloc(name + ".y" + sfx, B(el(n["out_t"])), name + " output")
                if t == "linear":
                    alloc(name + ".x", B(n["in_el"]), name + " x"); kk.append(name + ".x")
            if not n.get("moved"):
                out[k] = name + ".y" + sfx
            kept[k] = kk
            # inputs whose last reader this is are freed, unless adopted
            for i in ins:
                if i < 0:
                    continue
                pending[i] -= 1
                if pending[i] == 0 and i != N - 1 and i not in n.get("adopted", []):
                    if not (n.get("moved") and i == ins[0]):
                        free(out[i])

        if inference and p + 1 < passes:
            free(out[N - 1])  # the pass's logits go when the pass ends
    if inference:
        return peak[0], peak[1], log

    # ---- loss and backward ----
    yk = out[N - 1]
    alloc("loss.grad", B(el(last["out_t"])), "loss gradient")
    alloc("dy.copy", B(el(last["out_t"])), "grads.back() copy")
    grads = {N - 1: "dy.copy"}
    gcount = [0]

    def add_grad(i, b, why):
        if i < 0:
            return  # the model input's gradient is not asked for in training
        gcount[0] += 1
        key = "g%d" % gcount[0]
        alloc(key, b, why)
        if i in grads:
            free(key)  # added into the existing one
        else:
            grads[i] = key

    for k in range(N - 1, -1, -1):
        n = nodes[k]
        if n["taken"] or k not in grads:
            for key in kept.get(k, []):
                free(key)
            continue
        t = n["type"]; name = n["name"]
        ins = n.get("parts", n["ins"])
        first = all(i < 0 for i in ins)
        dy = grads.pop(k)
        if t == "conv2d":
            if fast:
                # oneDNN's scratchpad (Winograd <= 16 MiB, onednn_conv.cpp kWinogradScratchLimit)
                # and, for a conv that keeps its window, a reorder of dy (Port::read), held from
                # backward-data through backward-filter
                alloc(name + ".scratchb", n["scratch"] + B(n["reorder"]) + n["bf16"],
                      name + " oneDNN scratch + dy reorder (bwd)")
            if first:
                pass
            elif n["windowless"]:
                if "parts" in n:
                    for j, i in enumerate(ins):
                        add_grad_key = None
                    dxs = []
                    for j, i in enumerate(ins):
                        key = name + ".dx%d" % j
                        alloc(key, B(el(n["parts_t"][j])), name + " dx part")
                        dxs.append((i, key))
                    if not fast:
                        alloc(name + ".gather", B(n["in_el"]), name + " gather (bwd)")
                        free(name + ".gather")
                    for key in kept[k]:
                        free(key)
                    for i, key in dxs:
                        if i in grads:
                            free(key)
                        else:
                            live_b = live.pop(key); cur[0] -= live_b
                            add_grad(i, live_b, name + " dx")
                else:
                    alloc(name + ".dx", B(n["in_el"]), name + " dx")
                    for key in kept[k]:
                        free(key)
                    b = live.pop(name + ".dx"); cur[0] -= b
                    add_grad(ins[0], b, name + " dx")
            else:
                alloc(name + ".wg", B(n["win_el_pad"]), name + " window grad")
                if n["win_tile"]:
                    for key in kept[k]:
                        free(key)
                    b = live.pop(name + ".wg"); cur[0] -= b
                    if "parts" in n:
                        for j, i in enumerate(ins):
                            add_grad(i, B(el(n["parts_t"][j])), name + " dx part")
                    else:
                        add_grad(ins[0], b, name + " dx")
                else:
                    if "parts" in n:
                        for j, i in enumerate(ins):
                            add_grad(i, B(el(n["parts_t"][j])), name + " dx part")
                    else:
                        add_grad(ins[0], B(n["in_el"]), name + " dx")
                    for key in kept[k]:
                        free(key)
                    free(name + ".wg")
            for key in kept[k]:
                free(key)
            free(name + ".scratchb")
        elif t in ("maxpool", "upsample", "convT"):
            alloc(name + ".wg", B(n["win_el"]), name + " window grad")
            if n["win_tile"]:
                b = live.pop(name + ".wg"); cur[0] -= b
                for key in kept[k]:
                    free(key)
                add_grad(ins[0], b, name + " dx")
            else:
                add_grad(ins[0], B(n["in_el"]), name + " dx")
                for key in kept[k]:
                    free(key)
                free(name + ".wg")
        elif t == "bn":
            add_grad(ins[0], B(n["in_el"]), name + " dx")
            for key in kept[k]:
                free(key)
        elif t == "relu":
            if n["by_consumer"]:
                grads[ins[0]] = dy  # moved through
                dy = None
            else:
                add_grad(ins[0], B(n["in_el"]), name + " dx")
        elif t == "concat":
            for i, s in zip(n["ins"], n["in_t"]):
                add_grad(i, B(el(s)), name + " dx")
        elif t in ("gap", "linear"):
            add_grad(ins[0], B(n["in_el"]), name + " dx")
            for key in kept[k]:
                free(key)
        if dy is not None:
            free(dy)
    return peak[0], peak[1], log


def model_peak(model, C, H, W, grid=(1, 1), dtype=4, kernels="onednn", inference=False, batch=1,
               fuse=True, windowless=True, bf16=False):
    best = (0, "")
    for i in range(grid[0]):
        for j in range(grid[1]):
            p, why, _ = simulate(model, C, H, W, grid, (i, j), dtype, kernels, batch=batch,
                                 inference=inference, fuse=fuse, windowless=windowless, bf16=bf16)
            best = max(best, (p, why))
    return best


if __name__ == "__main__":
    import argparse
    a = argparse.ArgumentParser()
    a.add_argument("model"); a.add_argument("--image", default="3x512x512")
    a.add_argument("--grid", default="1x1"); a.add_argument("--dtype", type=int, default=4)
    a.add_argument("--kernels", default="onednn"); a.add_argument("--trace", action="store_true")
    a.add_argument("--inference", action="store_true")
    o = a.parse_args()
    C, H, W = map(int, o.image.split("x"))
    gh, gw = map(int, o.grid.split("x"))
    best = (0, "")
    for i in range(gh):
        for j in range(gw):
            p, why, log = simulate(o.model, C, H, W, (gh, gw), (i, j), o.dtype, o.kernels,
                                   inference=o.inference, trace=o.trace)
            if p > best[0]:
                best = (p, why, log)
    if o.trace:
        print("\n".join(best[2]))
    print("peak %.1f MiB at %s" % (best[0] / MIB, best[1]))
