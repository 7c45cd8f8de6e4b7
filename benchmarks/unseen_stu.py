"""A plain-PyTorch STU layer written in spellings the pattern tables never listed, trained under
stock Inductor and under ``backend="hstu"`` side by side (issue 20's measurement).

    python benchmarks/unseen_stu.py --out OUTDIR            # B=32, N=1024, E=512, H=4, D=128, bf16

Spellings (``--spelling``):
- ``index_copy``: q, k, v padded by ``index_copy`` into a zero ``[B*N, H, D]`` buffer at the row
  index ``seg * N + (arange(L) - offsets[seg])``, ``seg`` from ``repeat_interleave``; unpadded by a
  ``gather`` whose index is expanded over the features.
- ``embedding``: padded by ``F.embedding`` over ``cat([zeros(1, F), x])`` (row 0 is the padding);
  unpadded by ``index_select`` of flat rows.

Each compile is the first (static) one of a fresh Dynamo cache, as a user's first run is. For every
mode (``--modes``) the script reports what ``explain`` says was rewritten, the relative error of the
output and of dx against eager, and the forward+backward time of one training step (``do_bench``
median) for stock Inductor and for ``backend="hstu"``, measured in the same process. Writes
``unseen_stu.csv`` under ``--out``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import write_csv  # noqa: E402

log = logging.getLogger("unseen_stu")


def pad_index_copy(x, offsets, N):
    B, L = offsets.numel() - 1, x.shape[0]
    seg = torch.repeat_interleave(torch.arange(B, device=x.device), offsets[1:] - offsets[:-1], output_size=L)
    rows = seg * N + (torch.arange(L, device=x.device) - offsets[seg])
    buf = torch.zeros(B * N, *x.shape[1:], dtype=x.dtype, device=x.device)
    return buf.index_copy(0, rows, x).view(B, N, *x.shape[1:]), rows


def pad_embedding(x, offsets, N):
    B, L = offsets.numel() - 1, x.shape[0]
    flat = x.reshape(L, -1)
    table = torch.cat([flat.new_zeros(1, flat.shape[1]), flat])
    p = torch.arange(N, device=x.device)
    lengths = offsets[1:] - offsets[:-1]
    idx = torch.where(p[None] < lengths[:, None], offsets[:-1, None] + p[None] + 1, 0)
    seg = torch.repeat_interleave(torch.arange(B, device=x.device), lengths, output_size=L)
    rows = seg * N + (torch.arange(L, device=x.device) - offsets[seg])
    return F.embedding(idx, table).view(B, N, *x.shape[1:]), rows


class UnseenSTU(torch.nn.Module):
    def __init__(self, E, H, D, N, spelling):
        super().__init__()
        self.H, self.D, self.N, self.spelling = H, D, N, spelling
        self.norm = torch.nn.LayerNorm(E)
        self.uvqk = torch.nn.Linear(E, 4 * H * D)
        self.out_norm = torch.nn.LayerNorm(H * D)
        self.out = torch.nn.Linear(H * D, E)

    def forward(self, x, offsets):
        H, D, N = self.H, self.D, self.N
        L, B = x.shape[0], offsets.numel() - 1
        u, v, q, k = self.uvqk(self.norm(x)).split(H * D, dim=-1)
        u = F.silu(u)
        pad = pad_index_copy if self.spelling == "index_copy" else pad_embedding
        (qp, rows), (kp, _), (vp, _) = (pad(t.reshape(L, H, D), offsets, N) for t in (q, k, v))
        s = torch.matmul(qp.transpose(1, 2), kp.permute(0, 2, 3, 1))
        p = F.silu(s / D ** 0.5) * torch.tril(torch.ones(N, N, device=x.device, dtype=x.dtype)) / N
        o = torch.matmul(p, vp.transpose(1, 2)).transpose(1, 2).reshape(B * N, H * D)
        if self.spelling == "index_copy":
            a = o.gather(0, rows[:, None].expand(-1, H * D))
        else:
            a = o.index_select(0, rows)
        return x + self.out(u * self.out_norm(a))


def make_batch(B, N, E, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.9 * N), N + 1, (B,), generator=g)
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    x = torch.randn(int(offsets[-1]), E, generator=g).to(device=device, dtype=dtype)
    return x, offsets.to(device)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--embedding", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--spelling", nargs="+", default=["index_copy", "embedding"], choices=["index_copy", "embedding"])
    ap.add_argument("--modes", nargs="+", default=["default", "max-autotune", "reduce-overhead"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep time in ms")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out")))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import hstu_inductor
    from triton.testing import do_bench

    device = "cuda"
    dtype = getattr(torch, args.dtype)
    rows = []
    for spelling in args.spelling:
        torch.manual_seed(0)
        model = UnseenSTU(args.embedding, args.heads, args.dim, args.n, spelling).to(device=device, dtype=dtype)
        x, off = make_batch(args.batch, args.n, args.embedding, device, dtype)
        x.requires_grad_(True)
        ref = model(x, off)
        gy = torch.randn_like(ref)
        (dx_ref,) = torch.autograd.grad(ref, x, gy)
        for mode in args.modes:
            kw = {} if mode == "default" else {"mode": mode}
            times = {}
            for backend in ("inductor", "hstu"):
                torch._dynamo.reset()
                counts = ""
                if backend == "hstu":
                    rep = hstu_inductor.explain(model, x, off, backend="hstu_eager")
                    counts = "/".join(str(rep.counts[k]) for k in ("attention", "preprocess", "output"))
                    if rep.near_misses:
                        log.info("%s %s near misses: %s", spelling, mode, rep.near_misses)
                    torch._dynamo.reset()
                compiled = torch.compile(model, backend=backend, **kw)

                def step():
                    y = compiled(x, off)
                    return torch.autograd.grad(y, x, gy)[0], y

                dx, y = step()
                err, derr = rel(y, ref), rel(dx, dx_ref)
                ms = do_bench(lambda: step(), rep=args.rep)
                times[backend] = ms
                rows.append(dict(spelling=spelling, mode=mode, backend=backend, rewritten=counts, ms=round(ms, 3),
                                 rel_err_out=f"{err:.2e}", rel_err_dx=f"{derr:.2e}"))
                log.info("%-10s %-15s %-8s rewritten %-5s %.3f ms  err out %.2e dx %.2e", spelling, mode, backend,
                         counts or "-", ms, err, derr)
            log.info("%-10s %-15s speed-up of hstu over stock Inductor: %.2fx", spelling, mode,
                     times["inductor"] / times["hstu"])
    write_csv(rows, args.out, "unseen_stu.csv")


if __name__ == "__main__":
    main()
