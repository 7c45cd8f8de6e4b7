"""Attention with a relative attention bias (rab), forward + backward, on the GPU.

    python benchmarks/rab_attention.py --n 1024 2048 4096 --out OUTDIR

Providers, measured side by side in one process (B=128, H=4, D=128, bf16, lengths ~ U[0.9N, N),
causal, alpha = 1/D):
- ``hstu_no_rab``: ``torch.ops.hstu.attention`` without a bias (the baseline kernel);
- ``hstu_rab_1h``: the op with a learned dense rab ``[1, H, N, N]`` (path a; gradient summed over the batch
  in the kernel);
- ``hstu_rab_b1``: the op with a per-sequence dense rab ``[B, 1, N, N]`` (path a), gradient too;
- ``inductor_rab_1h``: stock Inductor (``torch.compile``) on the plain reference
  ``reference.hstu_mha(..., rab=...)``, which materialises the ``[B, H, N, N]`` scores;
- the original HSTU's bias from timestamps and two tables (``pos_w [2N-1]``, ``ts_w [129]``, int64
  timestamps with log-spread gaps), gradients to q, k, v and both tables:
  - ``hstu_tables``: path (b), the bias computed in the kernels, table gradients reduced in-kernel;
  - ``hstu_tables_dense``: path (a) on ``reference.relative_bias(...)`` (the ``[B, 1, N, N]`` bias
    materialised by PyTorch each step, its gradient scattered into the tables by autograd);
  - ``hstu_tables_compiled_dense``: path (a) as the backend runs it on a table model: the bias built by
    Inductor (``torch.compile(relative_bias)``), the op with the dense bias;
  - ``inductor_tables``: stock Inductor on the plain model (``relative_bias`` + ``hstu_mha``).
- breakdown of path (b): ``hstu_tables_pos`` / ``hstu_tables_ts`` (one table), ``hstu_tables_frozen`` (no
  table gradients), ``hstu_tables_fwd`` and ``hstu_no_rab_fwd`` (forward only). ``--profile`` adds the
  CUDA time per kernel of each provider (torch.profiler) to the log.

For each: forward+backward time (``do_bench`` median), TFLOP/s with the FLOP count of
HSTU_SEMANTICS.md (the bias adds no matrix FLOPs), the peak memory of one forward+backward above
what was allocated before it (``peak_mib``: what the step itself needs, e.g. N x N buffers) and the
absolute ``torch.cuda.max_memory_allocated`` (``peak_total_mib``, inputs included). Errors of the output
and of the bias gradient (``d_rab``, or ``d_pos_w`` / ``d_ts_w``) against the fp32 reference on the same
inputs are printed for N <= 1024 (the breakdown's too, its frozen or absent tables as constants; none for the
forward-only rows). Writes ``rab_attention.csv`` under ``--out``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import peak_mib, write_csv  # noqa: E402

log = logging.getLogger("rab_attention")
PROVIDERS = ["hstu_no_rab", "hstu_rab_1h", "hstu_rab_b1", "inductor_rab_1h", "hstu_tables", "hstu_tables_dense",
             "hstu_tables_compiled_dense", "inductor_tables"]
# where path (b)'s time goes: one table, frozen tables (no table gradients), forward only
BREAKDOWN = ["hstu_tables_pos", "hstu_tables_ts", "hstu_tables_frozen", "hstu_tables_fwd", "hstu_no_rab_fwd"]
NUM_BUCKETS = 128


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _timestamps(lengths, g):
    """int64 timestamps per sequence: increasing, gaps of 1 s .. 1e6 s spread on a log scale (the buckets
    in use then range over ~0..46 of 128, like real event logs)."""
    parts = [1.7e9 + (10 ** (torch.rand(int(n), generator=g, dtype=torch.float64) * 6)).floor().cumsum(0)
             for n in lengths]
    return torch.cat(parts).to(torch.int64)


def _profile(step, title):
    """CUDA time per kernel over 5 steps, the largest first."""
    from _common import kernel_profile, top_kernels
    log.info("%s: %s", title, top_kernels(kernel_profile(step, 5)[1], 6))
    from hstu_inductor.kernels import attention as K
    for name, tuner in K._TUNERS.items():  # the configs the kernels ran with (tuned or default)
        best = getattr(tuner, "best_config", None)
        if best is not None:
            log.info("%s: %s %s", title, name, best)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS + BREAKDOWN)
    ap.add_argument("--profile", action="store_true", help="log the CUDA time per kernel of each provider")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--configs", nargs="+", default=[], metavar="KIND=BM,BN,WARPS,STAGES",
                    help="fixed kernel configs instead of the autotuner's, e.g. fwd=64,32,4,3 dkdv=32,64,4,3 "
                         "(kernels fwd / dkdv / dq; the providers that call the op directly)")
    ap.add_argument("--reduction-tile", metavar="DIAGONALS,ROWS,WARPS,SPAN",
                    help="the table-gradient reduction's tile (kernels/table_grad.py), e.g. 32,64,4,8: diagonals x "
                         "rows, warps, and from how many buckets in a tile each element is added on its own")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out")))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from hstu_inductor.kernels.attention import force_configs

    if args.reduction_tile:
        from hstu_inductor.kernels import table_grad
        table_grad._BLOCK_D, table_grad._BLOCK_I, table_grad._WARPS, table_grad._SPAN = (
            int(x) for x in args.reduction_tile.split(","))

    configs = {c.split("=")[0]: tuple(int(x) for x in c.split("=")[1].split(",")) for c in args.configs}
    with force_configs(**configs):
        _run(args)


def _run(args):
    import hstu_inductor  # noqa: F401  (registers torch.ops.hstu)
    from hstu_inductor.reference import hstu_mha, relative_bias
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
        ts = _timestamps(lengths.tolist(), g).to(dev)
        pos_w = (0.5 * torch.randn(2 * N - 1, generator=g)).to(dev).requires_grad_()
        ts_w = (0.5 * torch.randn(NUM_BUCKETS + 1, generator=g)).to(dev).requires_grad_()
        rabs = {"1h": (0.5 * torch.randn(1, H, N, N, generator=g)).to(dev, dt).requires_grad_(),
                "b1": (0.5 * torch.randn(B, 1, N, N, generator=g)).to(dev, dt).requires_grad_()}
        fwd_flops = float(H * (lengths.double() ** 2).sum() * (D + D))
        bwd_flops = float(H * (lengths.double() ** 2).sum() * (3 * D + 2 * D))
        alpha = 1.0 / D
        ref_fn = torch.compile(lambda q, k, v, r: hstu_mha(N, alpha, q, k, v, off, rab=r))
        ref_tab = torch.compile(lambda q, k, v, p, t: hstu_mha(N, alpha, q, k, v, off,
                                                               rab=relative_bias(ts, off, N, p, t).to(dt)))
        bias_compiled = torch.compile(relative_bias)
        for prov in args.providers:
            tables = "tables" in prov
            rab = None if prov.startswith("hstu_no_rab") or tables else rabs[prov[-2:]]
            tabs = {"hstu_tables_pos": (pos_w, None), "hstu_tables_ts": (None, ts_w)}.get(prov, (pos_w, ts_w))
            grads = () if prov == "hstu_tables_frozen" else tuple(t for t in tabs if t is not None) if tables else ()
            ins = (q, k, v) + ((rab,) if rab is not None else ()) + grads

            if prov == "inductor_tables":
                def fwd():
                    return ref_tab(q, k, v, pos_w, ts_w)
            elif prov == "hstu_tables_dense":  # path (a): the bias materialised by PyTorch, autograd to the tables
                def fwd():
                    return torch.ops.hstu.attention(q, k, v, off, N, alpha,
                                                    rab=relative_bias(ts, off, N, pos_w, ts_w).to(dt))
            elif prov == "hstu_tables_compiled_dense":
                def fwd():
                    return torch.ops.hstu.attention(q, k, v, off, N, alpha,
                                                    rab=bias_compiled(ts, off, N, pos_w, ts_w).to(dt))
            elif tables:  # path (b)
                p_w, t_w = (tabs[0], tabs[1]) if prov != "hstu_tables_frozen" else (pos_w.detach(), ts_w.detach())

                def fwd():
                    return torch.ops.hstu.attention(q, k, v, off, N, alpha, timestamps=ts if t_w is not None else None,
                                                    pos_w=p_w, ts_w=t_w)
            elif prov.startswith("inductor"):
                def fwd():
                    return ref_fn(q, k, v, rab)
            else:
                def fwd():
                    return torch.ops.hstu.attention(q, k, v, off, N, alpha, rab=rab)

            flops = fwd_flops if prov.endswith("_fwd") else fwd_flops + bwd_flops
            if prov.endswith("_fwd"):
                def step():
                    with torch.no_grad():
                        return fwd()
            else:
                def step():
                    return torch.autograd.grad(fwd(), ins, do)

            try:
                step()
                peak, peak_total = peak_mib(step)
                ms = do_bench(step, rep=args.rep, return_mode="median")
            except Exception as e:  # noqa: BLE001  (out of memory, or a kernel that does not fit: report, go on)
                what = "OOM" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
                rows.append(dict(N=N, provider=prov, ms=what, tflops="", peak_mib="", peak_total_mib="",
                                 rel_err_out="", rel_err_bias_grad=""))
                log.info("N=%d %-18s failed: %s", N, prov, (str(e).strip().splitlines() or [what])[-1][:200])
                torch.cuda.empty_cache()
                continue
            if args.profile:
                _profile(step, f"N={N} {prov}")
            err = grad_err = float("nan")
            checked = prov in PROVIDERS[1:] or (prov in BREAKDOWN and not prov.endswith("_fwd"))
            if checked and N <= 1024:  # the fp32 eager reference holds several [B, H, N, N] tensors
                r32 = [t.detach().float().requires_grad_() for t in ins]
                if tables:  # the tables the provider differentiates are leaves; frozen ones constants
                    leaf = {id(t): c for t, c in zip(ins, r32)}
                    p32, t32 = (None if t is None else leaf.get(id(t), t.detach().float()) for t in tabs)
                    bias = relative_bias(ts, off, N, p32, t32)
                else:
                    bias = r32[3]
                ref = hstu_mha(N, alpha, *r32[:3], off, rab=bias)
                want = torch.autograd.grad(ref, r32, do.float())
                out = fwd()
                got = torch.autograd.grad(out, ins, do)
                err = rel(out, ref)
                grad_err = max((rel(a, b) for a, b in zip(got[3:], want[3:])), default=float("nan"))
                del ref, want, bias, r32
                torch.cuda.empty_cache()
            rows.append(dict(N=N, provider=prov, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                             peak_mib=round(peak, 1), peak_total_mib=round(peak_total, 1), rel_err_out=f"{err:.2e}",
                             rel_err_bias_grad=f"{grad_err:.2e}"))
            log.info("N=%d %-18s %.3f ms  %.1f TFLOP/s  peak +%.0f MiB (total %.0f)  err out %.2e bias grad %.2e", N,
                     prov, ms, flops / ms / 1e9, peak, peak_total, err, grad_err)
    write_csv(rows, args.out, "rab_attention.csv")
    log.info("%-6s %-18s %10s %8s %12s %14s", "N", "provider", "ms", "TFLOP/s", "peak+MiB", "peak_total")
    for r in rows:
        log.info("%-6s %-18s %10s %8s %12s %14s", r["N"], r["provider"], r["ms"], r["tflops"], r["peak_mib"],
                 r["peak_total_mib"])


if __name__ == "__main__":
    main()
