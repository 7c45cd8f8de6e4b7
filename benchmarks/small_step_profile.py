"""Where does a small STU step spend its GPU time: stock Inductor against ``backend="hstu"``?

    python benchmarks/small_step_profile.py --batch 4 --n 256 [--train] [--out OUTDIR]
    ncu --profile-from-start off --clock-control none --section SpeedOfLight --csv \
        python benchmarks/small_step_profile.py --batch 64 --n 1024 --train --ncu --providers hstu

``benchmarks/never_slower.py`` finds ``hstu`` slower than Inductor when the whole layer takes well
under a millisecond (issue 22 item 6). This script compiles the same ``reference.STULayer`` (E=512,
H=4, D=128, bf16, static shapes, as a first compile sees them) with both, profiles 20 steps with
``torch.profiler`` and prints each one's CUDA kernels by total time, so the loss can be attributed to
kernels (ours or Inductor's) rather than guessed. ``--ncu``: no profiler; one step after the warm-up runs
between ``cudaProfilerStart``/``Stop``, so that ``ncu --profile-from-start off`` reads exactly one step's kernels.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--providers", nargs="+", default=["inductor", "hstu"],
                    help="inductor, hstu, or hstu_attention / hstu_blocks (only those rewrites; never_slower.PROVIDERS)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ncu", action="store_true", help="profile one step for ncu (see above) instead")
    args = ap.parse_args()
    import hstu_inductor  # registers the backend
    from hstu_inductor.reference import STULayer
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from never_slower import PROVIDERS, make_batch

    torch.manual_seed(0)
    layer = STULayer(512, 4, 128, 128).to("cuda", torch.bfloat16).train(args.train)
    x, off, nt = make_batch(args.batch, args.n, 512, seed=1)
    dout = torch.randn_like(x)
    report = []
    for name in args.providers:
        torch._dynamo.reset()
        model = torch.compile(layer, dynamic=False) if name == "inductor" else \
            torch.compile(layer, backend="hstu", dynamic=False)
        patterns = PROVIDERS[name] or {}

        def step():
            xx = x.detach().requires_grad_(args.train)
            with torch.set_grad_enabled(args.train):
                out = model(xx, off, args.n, nt)
                if args.train:
                    torch.autograd.grad(out, (xx, *layer.parameters()), dout)

        with hstu_inductor.config.patch(patterns=patterns):
            for _ in range(3):
                step()
        torch.cuda.synchronize()
        if args.ncu:
            torch.cuda.cudart().cudaProfilerStart()
            step()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"== {name}: one step profiled for ncu", flush=True)
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
        head = f"== {name}: B={args.batch} N={args.n} {'train' if args.train else 'infer'}, {args.steps} steps"
        print(head)
        print(table)
        kernels = _kernel_lines(prof, args.steps)
        print(kernels)
        report.append(head + "\n" + table + "\n" + kernels)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "small_step_profile.txt"), "w") as f:
            f.write("\n".join(report))


def _kernel_lines(prof, steps) -> str:
    """Every GPU kernel (self device time > 0), µs per step and launches per step, longest first, and the sum."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((t / steps, e.count / steps, e.key))
    rows.sort(reverse=True)
    lines = [f"  {us:9.1f} us  x{n:4.1f}  {name[:110]}" for us, n, name in rows]
    return "kernels per step:\n" + "\n".join(lines) + f"\n  {sum(r[0] for r in rows):9.1f} us  total"


if __name__ == "__main__":
    main()
