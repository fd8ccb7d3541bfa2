#!/usr/bin/env python3
"""The GPU kernels of PyTorch's training step of a built-in model, by time, beside Tessera's
timeline (scripts/gpu/cupti_trace.cpp, scripts/gpu/trace_report.py): the same model, image and
step as scripts/bench/compare_pytorch.py --device cuda, under torch.profiler.

Usage: profile_pytorch.py [--model unet-small] [--image 3x2048x2048] [--nchw] [--steps 5]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import compare_pytorch  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="unet-small", choices=("unet-small", "conv-bench"))
    p.add_argument("--image", default="3x2048x2048")
    p.add_argument("--nchw", action="store_true",
                   help="PyTorch's default layout, not channels_last")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    c, h, w = compare_pytorch.parse_image(a.image)
    fmt = torch.contiguous_format if a.nchw else torch.channels_last
    build = compare_pytorch.unet_small if a.model == "unet-small" else compare_pytorch.conv_bench
    model = build(torch, c).to("cuda", memory_format=fmt)
    x = torch.rand(1, c, h, w, device="cuda").contiguous(memory_format=fmt)
    y = torch.randint(0, 2, (1, h, w), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.steps):
        step()
    stop.record()
    torch.cuda.synchronize()
    print(f"{a.model} {'NCHW' if a.nchw else 'channels_last'}: "
          f"{start.elapsed_time(stop) / a.steps:.2f} ms per step (events, {a.steps} steps)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.top,
                                    max_name_column_width=90))


if __name__ == "__main__":
    main()
