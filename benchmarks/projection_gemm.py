"""cuBLAS or a Triton (TMA) GEMM for the STU layer's projections? Measured, not assumed.

    python benchmarks/projection_gemm.py [--rows 124000] [--embedding 512] [--width 2048]

The STU ops run their projections on cuBLAS (``addmm``/``mm``). This script times, for every GEMM
of one layer's forward and backward at the benchmark shapes, cuBLAS against Inductor's Triton
matmul templates chosen by max-autotune with only the Triton backend allowed, once with the
persistent TMA template enabled (Hopper) and once without. Output: µs (``do_bench`` median) and
TFLOP/s per variant, and which one wins.
"""
from __future__ import annotations

import argparse
import os

import torch
from triton.testing import do_bench


def us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def gemms(L, E, W, C):
    """``(name, fn, operand shapes, (m, k, n))`` for the layer's GEMMs, ``fn`` in cuBLAS form."""
    return [
        ("pre fwd  normed@Wp^T + b   [L,E]x[E,W]", lambda a, b, c: torch.addmm(c, a, b), ((L, E), (E, W), (W,)),
         (L, E, W)),
        ("pre bwd  d_p@Wp            [L,W]x[W,E]", lambda a, b: a @ b, ((L, W), (W, E)), (L, W, E)),
        ("pre bwd  d_p^T@normed      [W,L]x[L,E]", lambda a, b: a.t() @ b, ((L, W), (L, E)), (W, L, E)),
        ("out fwd  x + y@Wo^T        [L,C]x[C,E]", lambda a, b, c: torch.addmm(c, a, b), ((L, C), (C, E), (L, E)),
         (L, C, E)),
        ("out bwd  g@Wo              [L,E]x[E,C]", lambda a, b: a @ b, ((L, E), (E, C)), (L, E, C)),
        ("out bwd  g^T@y             [E,L]x[L,C]", lambda a, b: a.t() @ b, ((L, E), (L, C)), (E, L, C)),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=124000, help="L: B=64 sequences of ~0.95*2048 rows")
    ap.add_argument("--embedding", type=int, default=512)
    ap.add_argument("--width", type=int, default=2048, help="2*(u_dim+qk_dim)")
    ap.add_argument("--channels", type=int, default=512, help="H*Dv")
    ap.add_argument("--only", type=int, nargs="+", help="indices of the GEMMs to time (default: all six)")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  L={args.rows} E={args.embedding} "
          f"W={args.width} C={args.channels} bf16", flush=True)
    variants = {
        "cublas": None,
        "triton_tma": {"max_autotune": True, "max_autotune_gemm_backends": "TRITON",
                       "triton.enable_persistent_tma_matmul": True},
        "triton": {"max_autotune": True, "max_autotune_gemm_backends": "TRITON",
                   "triton.enable_persistent_tma_matmul": False},
    }
    print(f"  {'GEMM':40s} " + " ".join(f"{v:>20s}" for v in variants) + "  winner", flush=True)
    todo = gemms(args.rows, args.embedding, args.width, args.channels)
    for name, fn, shapes, (m, k, n) in [todo[i] for i in (args.only or range(len(todo)))]:
        ops_ = [torch.randn(s, device=dev, dtype=dt, generator=g) for s in shapes]
        ref = fn(*ops_)
        fl = 2 * m * k * n
        times = {}
        for vname, opts in variants.items():
            try:
                torch._dynamo.reset()
                f = fn if opts is None else torch.compile(fn, options=opts, dynamic=False)
                out = f(*ops_)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 1e-2:
                    raise RuntimeError(f"wrong result, rel err {err:.1e}")
                times[vname] = us(lambda: f(*ops_))
            except Exception as e:  # a template that does not apply reports n/a
                print(f"    {vname}: n/a ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})")
                times[vname] = float("nan")
        cells = " ".join(f"{t:8.1f} us {fl / (t * 1e-6) / 1e12:5.0f} TF" for t in times.values())
        best = min((t, v) for v, t in times.items() if t == t)[1]
        print(f"  {name:40s} {cells}  {best}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_MAX_AUTOTUNE_REPORT_CHOICES_STATS", "0")
    main()
