"""Benchmark cached (delta) HSTU attention: the last D rows of every sequence attend to the whole cache.

Providers, one process, same inputs (B sequences of lengths U[0.9N, N), H heads, bf16, causal):
  * ``ours``      ``kernels.delta.delta_attention_fwd`` (what the op runs) on ``delta_q: [B*D, H, Dq]`` (key range split
                  across programs for D <= 64 where the row blocks leave the GPU idle, the partials folded
                  in the same launch; kernels/delta.py); ``ours_rowblk``: the full forward's row blocks, one
                  program per (sequence, head, row block), as before issue 22;
  * ``s9``        (``--s9``) session 9's plan: config (64, 3, 8), its split rule (~4 programs per SM), the partials
                  summed by a second launch; ``s9_fold``: the same plan folded in one launch (bitwise equal to
                  ``s9``: checked); ``s9_fold_fresh`` (``--fresh``): with a zeroed counter buffer per call
                  (one memset, what traced and captured launches get);
  * ``cK`` / ``sS``  kernels/delta.py with its config K (``--configs``) / with split S (``--splits``);
  * ``NAME``      kernels/delta.py with the plan ``delta_plans.CANDIDATES[NAME]`` (``--plans NAME ... | all``), at
                  the rows its row block suits (half to all of the rows rounded up to a power of two, >= 16);
  * ``dense``     what a model without a delta path does: the full forward over all L rows
                  (``kernels.hstu_attention_fwd``), of which only the last D rows per sequence are used;
  * ``gr_tma`` / ``gr``  generative-recommenders' ``triton_cached_hstu_mha`` (TMA on / off), imported
                  like in ``attention.py`` from ``HSTU_ANCHOR_PATH`` (default ./.anchor) when present, at the
                  rows of ``--gr-rows`` (default: all; its autotuner compiles ~29 configs per TMA mode, again for
                  1 row, which Triton specialises).

Rows are the outer loop (in the order given), so a run cut short loses the last rows at every N. The last
lines are a summary: per (N, rows) the default, the fastest plan and GR's best, in ms.

Every provider's delta rows are checked against the dense forward's rows (relative norm error), and
against a second call of itself (``rep``: ``=`` when bitwise equal).
FLOPs counted for the delta rows only: sum_b H * D * n_b * (Dq + Dv) * 2.

    python benchmarks/delta_attention.py --n 1024 4096 --delta 128 64 16 1 --plans all [--s9 --fresh --configs 1 3]
    ncu --profile-from-start off --clock-control none --section SpeedOfLight --csv \
        python benchmarks/delta_attention.py --n 1024 --delta 64 --plans NAME --ncu   # one launch per provider
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from attention import _anchor, bench  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def _s9_split(programs, N, device):
    """Session 9's split rule: ~4 programs per SM, >= 4 key tiles of 64 per split, at most 16."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 132
    return max(1, min(-(-4 * sms // programs), -(-N // 64) // 4, 16))


def _fresh(Kd, fn):
    Kd.CACHE_COUNTERS = False
    try:
        return fn()
    finally:
        Kd.CACHE_COUNTERS = True


def _fits(plan, D):
    """A plan is timed at D rows when its row block is half to all of D rounded up to a power of two (>= 16)."""
    top = max(16, 1 << (D - 1).bit_length())
    return top // 2 <= plan.block_m <= top


def _inputs(N, B, H, Dm, device):
    g = torch.Generator().manual_seed(N)
    lengths = torch.randint(int(0.9 * N), N, (B,), generator=g)
    off = torch.zeros(B + 1, dtype=torch.int64)
    off[1:] = lengths.cumsum(0)
    L = int(off[-1])
    q, k, v = (torch.randn(L, H, Dm, generator=g).to(device, torch.bfloat16) for _ in range(3))
    return lengths, off.to(device), q, k, v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--delta", type=int, nargs="+", default=[1, 16, 128], help="rows per sequence (D)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--configs", type=int, nargs="*", default=[], help="also time kernels/delta.py's configs")
    ap.add_argument("--splits", type=int, nargs="*", default=[], help="also time these splits (default config)")
    ap.add_argument("--plans", nargs="*", default=[], help="also time these delta_plans.CANDIDATES ('all': every one)")
    ap.add_argument("--gr-rows", type=int, nargs="*", default=None, help="rows at which GR runs (default: all)")
    ap.add_argument("--s9", action="store_true", help="also time session 9's plan (two launches and folded)")
    ap.add_argument("--cudagraph", action="store_true",
                    help="time each provider's launch replayed from a CUDA graph (do_bench_cudagraph): no host time")
    ap.add_argument("--ncu", action="store_true",
                    help="run each provider once more between cudaProfilerStart/Stop, for ncu --profile-from-start off")
    ap.add_argument("--fresh", action="store_true", help="with --s9: s9_fold with a zeroed counter buffer per call")
    args = ap.parse_args()

    from hstu_inductor.kernels import attention as K
    from hstu_inductor.kernels import delta as Kd
    from hstu_inductor.kernels import delta_plans as P
    from hstu_inductor.spec import AttentionSpec

    if args.cudagraph:
        from triton.testing import do_bench_cudagraph

        def timer(fn, rep):
            return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    else:
        timer = bench
    plans = {name: P.CANDIDATES[name] for name in (P.CANDIDATES if args.plans == ["all"] else args.plans)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, H, Dm = args.batch, args.heads, args.dim
    alpha = 1.0 / Dm
    try:
        gr = _anchor()
    except ImportError:
        gr = None
        print("anchor not found (HSTU_ANCHOR_PATH): gr providers skipped")
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}  B={B} H={H} D={Dm} bf16")
    print(f"{'N':>5} {'D':>4} {'provider':18s} {'ms':>9} {'TFLOP/s':>8} {'x dense':>8}  rel_err  rep")
    data, summary = {}, []
    for D in args.delta:
        for N in args.n:
            if N not in data:  # inputs and the dense forward once per N
                lengths, off, q, k, v = _inputs(N, B, H, Dm, device)
                dense = K.hstu_attention_fwd(q, k, v, off, N, alpha)
                data[N] = (lengths, off, q, k, v, dense, bench(lambda: K.hstu_attention_fwd(q, k, v, off, N, alpha),
                                                             args.rep))
            lengths, off, q, k, v, dense, t_dense = data[N]
            if D > int(lengths.min()):
                continue
            # the last D rows of every sequence, [B*D, H, Dq]
            rows = (off[1:, None] - D + torch.arange(D, device=device)[None, :]).reshape(-1)
            dq = q[rows].contiguous()
            want = dense[rows].float()
            flops = 2.0 * H * D * float(lengths.sum()) * (2 * Dm)
            runs = {"ours": lambda: Kd.delta_attention_fwd(dq, k, v, off, N, alpha),
                    # the full forward's row blocks, one program per (sequence, head)
                    "ours_rowblk": lambda: K._fwd(dq, k, v, off, N, alpha, None, None, AttentionSpec(), D, None)}
            base = P.default_plan(D) or P.default_plan(P.max_rows())
            if args.s9 and D <= Kd.max_delta_rows():
                s9 = dict(config=Kd._CONFIGS[1], split=_s9_split(B * H * -(-D // base.block_m), N, device))
                runs["s9"] = lambda: Kd.delta_forward(dq, k, v, off, N, alpha, fold=False, **s9)
                runs["s9_fold"] = lambda: Kd.delta_forward(dq, k, v, off, N, alpha, **s9)
                if args.fresh:
                    runs["s9_fold_fresh"] = lambda: _fresh(Kd, lambda: Kd.delta_forward(dq, k, v, off, N, alpha, **s9))
            for cfg in args.configs:
                runs[f"c{cfg}"] = lambda cfg=cfg: Kd.delta_forward(dq, k, v, off, N, alpha, config=Kd._CONFIGS[cfg])
            for split in args.splits:
                runs[f"s{split}"] = lambda split=split: Kd.delta_forward(dq, k, v, off, N, alpha, split=split)
            for name, plan in plans.items():
                if _fits(plan, D):
                    runs[name] = lambda plan=plan: Kd.delta_forward(dq, k, v, off, N, alpha, plan=plan)
            if gr is not None and (args.gr_rows is None or D in args.gr_rows):
                for name, tma in (("gr_tma", True), ("gr", False)):
                    runs[name] = (lambda tma=tma: gr.triton_cached_hstu_mha(N, alpha, dq, k, v, off, None, 0, 0, tma))
            runs["dense"] = None
            outs, times = {}, {}
            for name, fn in runs.items():
                rep = ""
                if fn is None:
                    ms, err = t_dense, 0.0
                else:
                    try:
                        out = outs[name] = fn()
                        err = ((out.float() - want).norm() / want.norm()).item()
                        rep = "=" if torch.equal(out, fn()) else "DIFF"
                        if args.ncu:  # one launch per provider in the profiled range, after its warm-up/autotune
                            torch.cuda.synchronize()
                            torch.cuda.cudart().cudaProfilerStart()
                            fn()
                            torch.cuda.synchronize()
                            torch.cuda.cudart().cudaProfilerStop()
                        ms = timer(fn, args.rep)
                    except Exception as e:  # an anchor without this entry point / config
                        print(f"{N:5d} {D:4d} {name:18s} n/a: {type(e).__name__}: {str(e)[:100]}")
                        continue
                    if err < 2e-2:  # the summary ranks right answers only
                        times[name] = ms
                print(f"{N:5d} {D:4d} {name:18s} {ms:9.4f} {flops / (ms * 1e-3) / 1e12:8.1f} "
                      f"{t_dense / ms:8.1f}  {err:.2e} {rep}", flush=True)
            if "s9" in outs and not torch.equal(outs["s9"], outs["s9_fold"]):
                print(f"{N:5d} {D:4d} s9_fold differs from s9 bitwise", flush=True)
            summary.append((N, D, times))
    print("\nsummary, ms (x: best GR's time over this one; > 1 is faster than GR)")
    for N, D, times in sorted(summary):
        gr_best = min((times[n] for n in ("gr", "gr_tma") if n in times), default=None)
        ranked = sorted((t, n) for n, t in times.items() if n in plans or n == "ours_rowblk")[:3]
        ranked = ([(times["ours"], "ours")] if "ours" in times else []) + ranked  # the default, then the best 3
        cols = [f"{n} {t:.4f}" + (f" {gr_best / t:.2f}x" if gr_best else "") for t, n in ranked]
        print(f"N={N:5d} rows={D:4d}  gr {gr_best or 0:.4f} | " + " | ".join(cols), flush=True)

if __name__ == "__main__":
    main()
