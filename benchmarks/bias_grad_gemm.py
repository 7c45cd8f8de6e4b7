"""Bias gradients from the weight-gradient GEMM: a ones column appended to the GEMM's other operand.

    python benchmarks/bias_grad_gemm.py [--rows 62000] [--width 2048] [--embedding 512]

In the STU block backwards the bias gradient ``d_b = d_p.sum(0)`` is a pass of its own over ``d_p`` (97 us for
the uvqk projection at L=62k, width 2048 on H100; ncu, RESULTS.md session 13), while ``d_W = d_p^T @ normed``
reads ``d_p`` anyway. With ``normed`` stored as ``[L, E + 8]`` whose column E is 1 (and the rest 0), one GEMM
``d_p^T @ normed_aug`` gives ``[d_W | d_b | 0...]``. Times, side by side: the two kernels today, the augmented
GEMM, and the forward projection reading the ``[L, E]`` view of the augmented buffer (row stride E + 8).
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench


def us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=62000)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--embedding", type=int, nargs="+", default=[512])
    ap.add_argument("--pad", type=int, nargs="+", default=[8, 64])
    args = ap.parse_args()
    L, W, dt = args.rows, args.width, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    d_p = torch.randn(L, W, device="cuda", dtype=dt, generator=g)
    for E in args.embedding:
        normed = torch.randn(L, E, device="cuda", dtype=dt, generator=g)
        w = torch.randn(W, E, device="cuda", dtype=dt, generator=g)
        t_mm, t_sum = us(lambda: d_p.t().mm(normed)), us(lambda: d_p.sum(0))
        t_fwd = us(lambda: normed.mm(w.t()))
        print(f"L={L} W={W} E={E}: d_W GEMM {t_mm:.1f} us + d_b sum {t_sum:.1f} us = {t_mm + t_sum:.1f} us; "
              f"forward GEMM {t_fwd:.1f} us", flush=True)
        for pad in args.pad:
            aug = torch.zeros(L, E + pad, device="cuda", dtype=dt)
            aug[:, :E] = normed
            aug[:, E] = 1
            view = aug[:, :E]
            t_aug, t_fv = us(lambda: d_p.t().mm(aug)), us(lambda: view.mm(w.t()))
            got = d_p.t().mm(aug)
            err_w = ((got[:, :E].float() - d_p.t().float() @ normed.float()).norm() /
                     (d_p.t().float() @ normed.float()).norm()).item()
            ref_b = d_p.float().sum(0)
            err_b = ((got[:, E].float() - ref_b).norm() / ref_b.norm()).item()
            print(f"  pad {pad}: augmented GEMM {t_aug:.1f} us (saves {t_mm + t_sum - t_aug:.1f}); forward GEMM on "
                  f"the view {t_fv:.1f} us; rel err d_W {err_w:.1e} d_b {err_b:.1e}", flush=True)
    # the output block: d_W_o = grad^T @ y, d_b_o = grad.sum(0), grad [L, E_out], y [L, C]
    for C, Eo in ((512, 512),):
        grad = torch.randn(L, Eo, device="cuda", dtype=dt, generator=g)
        y = torch.randn(L, C, device="cuda", dtype=dt, generator=g)
        t_mm, t_sum = us(lambda: grad.t().mm(y)), us(lambda: grad.sum(0))
        print(f"output block L={L} C={C} E={Eo}: d_W {t_mm:.1f} + d_b {t_sum:.1f} = {t_mm + t_sum:.1f} us", flush=True)
        for pad in args.pad:
            aug = torch.zeros(L, C + pad, device="cuda", dtype=dt)
            aug[:, :C] = y
            aug[:, C] = 1
            t_aug = us(lambda: grad.t().mm(aug))
            print(f"  pad {pad}: augmented {t_aug:.1f} us (saves {t_mm + t_sum - t_aug:.1f})", flush=True)


if __name__ == "__main__":
    main()
