"""Time the warp-specialised Gluon forward against the Triton op side by side (issue 22, item 1).

    PYTHONPATH=. python benchmarks/gluon_attention.py [--n 1024 2048 4096] [--variants default s3 nopp]
                                                      [--rep 300] [--out DIR]

Inputs as benchmarks/attention.py: B=128, H=4, D=128, bf16, lengths ~ U[0.9N, N), 1..20 targets, alpha = 1/D,
q/k/v strided views of one fused projection. FLOPs: fwd = sum_b H n_b^2 (Dq + Dv). Times: do_bench medians.
Every variant is first checked against the Triton op (rel-norm error) before it is timed; the Triton op is timed
twice (start and end) so the spread of one provider is visible. Prints one table last.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

VARIANTS = {
    "default": {},  # persistent, dynamic scheduling
    "pers": dict(PERSISTENT=True),
    "pers_static": dict(PERSISTENT=True, DYNAMIC=False),
    "pers_nopp": dict(PERSISTENT=True, PINGPONG=False),
    "pers_bn64": dict(PERSISTENT=True, BLOCK_N=64, STAGES=4),
    "pers_packed": dict(PERSISTENT=True, PACKED=1),
    "pers_probe_nosilu": dict(PERSISTENT=True, PACKED=2),  # timing probe only: no silu (wrong results)
    "nonpers": dict(PERSISTENT=False),
    "nonpers_s3": dict(PERSISTENT=False, STAGES=3),
    "nonpers_nopp": dict(PERSISTENT=False, PINGPONG=False),
    "nonpers_probe_nosilu": dict(PERSISTENT=False, PACKED=2),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--h", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=["nonpers", "default"])
    ap.add_argument("--rep", type=int, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()

    import triton.testing

    import hstu_inductor  # noqa: F401  (torch.ops.hstu.attention)
    from attention import flops, make_inputs
    from hstu_inductor.kernels.gluon_attention import GLUON_CONFIG, gluon_forward

    dev = "cuda"
    D = 128
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, base config {GLUON_CONFIG}", flush=True)
    for N in args.n:
        q, k, v, off, nt, lengths = make_inputs(args.b, N, args.h, D, D, torch.bfloat16, dev)
        alpha = 1.0 / D
        fl = flops(lengths, args.h, D, D)[0]

        def tri():  # the Triton kernel: the op would pick the Gluon one for these inputs
            with hstu_inductor.config.patch(gluon="off"):
                return torch.ops.hstu.attention(q, k, v, off, N, alpha, nt, None, 0, 0, 0, True)

        def tf(ms):
            return fl / (ms * 1e-3) / 1e12

        ref = tri()
        ms0 = triton.testing.do_bench(tri, warmup=50, rep=args.rep, return_mode="median")
        rows.append((N, "triton_op", ms0, tf(ms0), 0.0))
        print(f"N={N} triton_op {ms0:.3f} ms {tf(ms0):.1f} TFLOP/s", flush=True)
        for name in args.variants:
            cfg = VARIANTS[name]
            try:
                out = gluon_forward(q, k, v, off, N, alpha, nt, config=cfg)
                torch.cuda.synchronize()
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                finite = bool(torch.isfinite(out).all())
                ms = triton.testing.do_bench(lambda: gluon_forward(q, k, v, off, N, alpha, nt, config=cfg),
                                             warmup=50, rep=args.rep, return_mode="median")
                rows.append((N, f"gluon_{name}", ms, tf(ms), err if finite else float("nan")))
                print(f"N={N} gluon_{name} {ms:.3f} ms {tf(ms):.1f} TFLOP/s err_vs_triton={err:.2e} "
                      f"finite={finite}", flush=True)
            except Exception as e:  # keep timing the other variants
                import traceback

                traceback.print_exc()
                rows.append((N, f"gluon_{name}", float("nan"), float("nan"), float("nan")))
                print(f"N={N} gluon_{name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
        ms1 = triton.testing.do_bench(tri, warmup=50, rep=args.rep, return_mode="median")
        rows.append((N, "triton_op(again)", ms1, tf(ms1), 0.0))
        del q, k, v, off, nt, ref
        torch.cuda.empty_cache()

    lines = [f"{'N':>5} {'provider':<18} {'ms':>8} {'TFLOP/s':>8} {'err_vs_triton':>13}"]
    for N, name, ms, t, e in rows:
        lines.append(f"{N:>5} {name:<18} {ms:>8.3f} {t:>8.1f} {e:>13.2e}")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gluon_attention.txt"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
