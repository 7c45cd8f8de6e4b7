"""Time the warp-specialised Gluon backward against the Triton backward side by side (issue 22, item 1).

    PYTHONPATH=. python benchmarks/gluon_backward.py [--n 1024 2048 4096] [--variants default nopp ...]
                                                     [--rep 200] [--out DIR]

Inputs as benchmarks/attention.py: B=128, H=4, D=128, bf16, lengths ~ U[0.9N, N), 1..20 targets, alpha = 1/D,
q/k/v strided views of one fused projection, dout random. FLOPs: bwd = sum_b H n_b^2 (3 Dq + 2 Dv) (the counted
5 GEMMs; the split kernels execute 7). Times: do_bench medians. The Triton backward is
``attention.hstu_attention_bwd`` (the op's kernels, split algorithm, configs as HSTU_INDUCTOR_AUTOTUNE says), timed
at the start and the end of each N. Every Gluon variant is first checked against it (rel-norm error per gradient)
before it is timed. Variants "dkdv_only" / "dq_only" launch one of the two kernels (timing probes: their TFLOP/s
use the full backward FLOP count, so the two add up as times, not rates). Writes gluon_backward.csv and .txt under
--out (default $OUT).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from hstu_inductor.kernels.gluon_backward import BWD_VARIANTS as VARIANTS  # noqa: E402

DEFAULT_VARIANTS = ["default", "nopp", "nooverlap", "dq_regs_noovl", "kv3", "dkdv_only", "dq_only"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--h", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()

    import triton.testing

    from attention import flops, make_inputs
    from hstu_inductor.kernels.attention import hstu_attention_bwd
    from hstu_inductor.kernels.gluon_backward import GLUON_BWD_CONFIG, gluon_backward

    dev = "cuda"
    D = 128
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, HSTU_INDUCTOR_AUTOTUNE="
          f"{os.environ.get('HSTU_INDUCTOR_AUTOTUNE', '1')}, base config {GLUON_BWD_CONFIG}", flush=True)
    for N in args.n:
        q, k, v, off, nt, lengths = make_inputs(args.b, N, args.h, D, D, torch.bfloat16, dev)
        dout = torch.randn_like(q)
        alpha = 1.0 / D
        fl = flops(lengths, args.h, D, D)[1]

        def tri():
            return hstu_attention_bwd(dout, q, k, v, off, N, alpha, nt)

        def tf(ms):
            return fl / (ms * 1e-3) / 1e12

        ref = [t.clone() for t in tri()[:3]]
        ms0 = triton.testing.do_bench(tri, warmup=25, rep=args.rep, return_mode="median")
        rows.append(dict(N=N, provider="triton_bwd", ms=ms0, tflops=tf(ms0), err_dq=0.0, err_dk=0.0, err_dv=0.0))
        print(f"N={N} triton_bwd {ms0:.3f} ms {tf(ms0):.1f} TFLOP/s", flush=True)
        for name in args.variants:
            cfg = VARIANTS[name]
            try:
                got = gluon_backward(dout, q, k, v, off, N, alpha, nt, config=cfg)
                torch.cuda.synchronize()
                errs = {}
                computed = {"both": ("dq", "dk", "dv"), "dkdv": ("dk", "dv"), "dq": ("dq",)}[cfg.get("RUN", "both")]
                for gname, x, r in zip(("dq", "dk", "dv"), got, ref):
                    if gname not in computed:
                        errs[gname] = float("nan")  # not computed by this probe
                        continue
                    if not torch.isfinite(x).all():
                        errs[gname] = float("inf")
                        continue
                    errs[gname] = ((x.double() - r.double()).norm() / r.double().norm()).item()
                ms = triton.testing.do_bench(lambda: gluon_backward(dout, q, k, v, off, N, alpha, nt, config=cfg),
                                             warmup=25, rep=args.rep, return_mode="median")
                rows.append(dict(N=N, provider=f"gluon_{name}", ms=ms, tflops=tf(ms), err_dq=errs["dq"],
                                 err_dk=errs["dk"], err_dv=errs["dv"]))
                print(f"N={N} gluon_{name} {ms:.3f} ms {tf(ms):.1f} TFLOP/s err_vs_triton dq={errs['dq']:.2e} "
                      f"dk={errs['dk']:.2e} dv={errs['dv']:.2e}", flush=True)
            except Exception as e:  # keep timing the other variants
                import traceback

                traceback.print_exc()
                rows.append(dict(N=N, provider=f"gluon_{name}", ms=float("nan"), tflops=float("nan"),
                                 err_dq=float("nan"), err_dk=float("nan"), err_dv=float("nan")))
                print(f"N={N} gluon_{name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
        ms1 = triton.testing.do_bench(tri, warmup=25, rep=args.rep, return_mode="median")
        rows.append(dict(N=N, provider="triton_bwd(again)", ms=ms1, tflops=tf(ms1), err_dq=0.0, err_dk=0.0,
                         err_dv=0.0))
        del q, k, v, off, nt, dout, ref
        torch.cuda.empty_cache()

    lines = [f"{'N':>5} {'provider':<24} {'ms':>8} {'TFLOP/s':>8} {'err_dq':>9} {'err_dk':>9} {'err_dv':>9}"]
    for r in rows:
        lines.append(f"{r['N']:>5} {r['provider']:<24} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r['err_dq']:>9.2e} "
                     f"{r['err_dk']:>9.2e} {r['err_dv']:>9.2e}")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gluon_backward.txt"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(args.out, "gluon_backward.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
