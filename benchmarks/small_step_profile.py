"""Where does a small STU step spend its GPU time: stock Inductor against ``backend="hstu"``?

    python benchmarks/small_step_profile.py --batch 4 --n 256 [--train] [--out OUTDIR]

``benchmarks/never_slower.py`` finds ``hstu`` slower than Inductor when the whole layer takes well
under a millisecond (issue 22 item 6). This script compiles the same ``reference.STULayer`` (E=512,
H=4, D=128, bf16, static shapes, as a first compile sees them) with both, profiles 20 steps with
``torch.profiler`` and prints each one's CUDA kernels by total time, so the loss can be attributed to
kernels (ours or Inductor's) rather than guessed.
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import hstu_inductor  # noqa: F401  (registers the backend)
    from hstu_inductor.reference import STULayer
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from never_slower import make_batch

    torch.manual_seed(0)
    layer = STULayer(512, 4, 128, 128).to("cuda", torch.bfloat16).train(args.train)
    x, off, nt = make_batch(args.batch, args.n, 512, seed=1)
    dout = torch.randn_like(x)
    report = []
    for name in ("inductor", "hstu"):
        torch._dynamo.reset()
        model = torch.compile(layer, dynamic=False) if name == "inductor" else \
            torch.compile(layer, backend="hstu", dynamic=False)

        def step():
            xx = x.detach().requires_grad_(args.train)
            with torch.set_grad_enabled(args.train):
                out = model(xx, off, args.n, nt)
                if args.train:
                    torch.autograd.grad(out, (xx, *layer.parameters()), dout)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
        head = f"== {name}: B={args.batch} N={args.n} {'train' if args.train else 'infer'}, {args.steps} steps"
        print(head)
        print(table)
        report.append(head + "\n" + table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "small_step_profile.txt"), "w") as f:
            f.write("\n".join(report))


if __name__ == "__main__":
    main()
