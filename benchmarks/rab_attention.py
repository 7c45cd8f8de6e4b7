"""Attention with a dense relative attention bias (rab), forward + backward, on the GPU.

    python benchmarks/rab_attention.py --n 1024 2048 --out OUTDIR

Providers, measured side by side in one process (B=128, H=4, D=128, bf16, lengths ~ U[0.9N, N],
causal, alpha = 1/D):
- ``hstu_no_rab``: ``torch.ops.hstu.attention`` without a bias (the baseline kernel);
- ``hstu_rab_1h``: the op with a learned dense rab ``[1, H, N, N]`` (gradient summed over the batch);
- ``hstu_rab_b1``: the op with a per-sequence rab ``[B, 1, N, N]`` (e.g. a time bias), gradient too;
- ``inductor_rab_1h``: stock Inductor (``torch.compile``) on the plain reference
  ``reference.hstu_mha(..., rab=...)``, which materialises the ``[B, H, N, N]`` scores.

For each: forward+backward time (``do_bench`` median), TFLOP/s with the FLOP count of
HSTU_SEMANTICS.md (the bias adds no matrix FLOPs), and the peak memory of one forward+backward above
what was allocated before it. Errors of the output and of ``d_rab`` against the fp32 reference on
the same inputs are printed too. Writes ``rab_attention.csv`` under ``--out``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import write_csv  # noqa: E402

log = logging.getLogger("rab_attention")
PROVIDERS = ["hstu_no_rab", "hstu_rab_1h", "hstu_rab_b1", "inductor_rab_1h"]


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out")))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import hstu_inductor  # noqa: F401  (registers torch.ops.hstu)
    from hstu_inductor.reference import hstu_mha
    from triton.testing import do_bench

    dev, dt = "cuda", torch.bfloat16
    B, H, D = args.batch, args.heads, args.dim
    rows = []
    for N in args.n:
        g = torch.Generator().manual_seed(N)
        lengths = torch.randint(int(0.9 * N), N + 1, (B,), generator=g)
        off = torch.zeros(B + 1, dtype=torch.int64)
        off[1:] = lengths.cumsum(0)
        off = off.to(dev)
        L = int(lengths.sum())
        q, k, v = (torch.randn(L, H, D, generator=g).to(dev, dt).requires_grad_() for _ in range(3))
        do = torch.randn(L, H, D, generator=g).to(dev, dt)
        rabs = {"1h": (0.5 * torch.randn(1, H, N, N, generator=g)).to(dev, dt).requires_grad_(),
                "b1": (0.5 * torch.randn(B, 1, N, N, generator=g)).to(dev, dt).requires_grad_()}
        flops = float(H * (lengths.double() ** 2).sum() * (D + D) + H * (lengths.double() ** 2).sum() * (3 * D + 2 * D))
        alpha = 1.0 / D
        ref_fn = torch.compile(lambda q, k, v, r: hstu_mha(N, alpha, q, k, v, off, rab=r))
        for prov in args.providers:
            rab = None if prov == "hstu_no_rab" else rabs[prov[-2:]]
            ins = (q, k, v) + ((rab,) if rab is not None else ())

            if prov.startswith("inductor"):
                def fwd():
                    return ref_fn(q, k, v, rab)
            else:
                def fwd():
                    return torch.ops.hstu.attention(q, k, v, off, N, alpha, rab=rab)

            def step():
                return torch.autograd.grad(fwd(), ins, do)

            try:
                step()
            except torch.OutOfMemoryError:
                rows.append(dict(N=N, provider=prov, ms="OOM", tflops="", peak_mib="", rel_err_out="", rel_err_drab=""))
                log.info("N=%d %-16s out of memory", N, prov)
                torch.cuda.empty_cache()
                continue
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            ms = do_bench(step, rep=args.rep)
            err = drab_err = float("nan")
            if rab is not None and N <= 1024:  # the fp32 eager reference holds several [B, H, N, N] tensors
                r32 = [t.detach().float().requires_grad_() for t in ins]
                ref = hstu_mha(N, alpha, *r32[:3], off, rab=r32[3])
                want = torch.autograd.grad(ref, r32, do.float())
                out = fwd()
                got = torch.autograd.grad(out, ins, do)
                err, drab_err = rel(out, ref), rel(got[3], want[3])
            rows.append(dict(N=N, provider=prov, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                             peak_mib=round(peak, 1), rel_err_out=f"{err:.2e}", rel_err_drab=f"{drab_err:.2e}"))
            log.info("N=%d %-16s %.3f ms  %.1f TFLOP/s  peak %.0f MiB  err out %.2e d_rab %.2e", N, prov, ms,
                     flops / ms / 1e9, peak, err, drab_err)
    write_csv(rows, args.out, "rab_attention.csv")


if __name__ == "__main__":
    main()
