"""Time the STU block kernels against what Inductor generates for the same ATen code.

    python benchmarks/stu_kernels.py [--rows 62000] [--width 512]

Each line: microseconds (``do_bench`` median) and effective GB/s (bytes each must move once).
Tile variants of the reducing backward kernels are timed too, to pick their defaults.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hstu_inductor.kernels import norms  # noqa: E402
from hstu_inductor.kernels import stu_blocks as SB  # noqa: E402
from hstu_inductor.ops.stu import _activate  # noqa: E402  (the op's silu(u), ATen; v, q, k are views)

aten = torch.ops.aten


def us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def line(name, t, nbytes):
    print(f"  {name:55s} {t:8.1f} us  {nbytes / (t * 1e-6) / 1e9:7.0f} GB/s", flush=True)


def timed_variants(label, module, fn, nbytes, variants):
    """Time ``fn`` once per ``(name, {attribute: replacement})`` variant, with ``module``'s attributes
    replaced for that timing (``{}``: the shipped default)."""
    for name, attrs in variants:
        with mock.patch.multiple(module, **attrs) if attrs else contextlib.nullcontext():
            line(f"{label}: ours {name}", us(fn), nbytes)


def bwd_tiles(module, variants):
    """The reducing backward kernels' tile forced to each ``(rows per step, warps, programs per SM)``; ``None``
    is the shipped default (``norms.bwd_tile``/``num_partials``)."""
    tile_of, sms = module.bwd_tile, torch.cuda.get_device_properties(0).multi_processor_count
    return [("default", {}) if v is None else
            (f"tile={v[0]} warps={v[1]} parts={v[2]}xSM",
             dict(bwd_tile=lambda C_, G_, v=v: (v[0], *tile_of(C_, G_)[1:3], v[1]),
                  num_partials=lambda d, v=v: v[2] * sms))
            for v in variants]


def fwd_tiles(module, variants):
    """The forward kernels' row tile (``module.tile``) forced to each ``(rows per program, warps)``; ``None`` is
    the shipped default."""
    tile_of = module.tile
    return [("default", {}) if v is None else
            ("rows=%d warps=%d" % v, dict(tile=lambda C_, G_, rows_target=0, v=v: (v[0], *tile_of(C_, G_)[1:3], v[1])))
            for v in variants]


FWD_TILES = (None, (1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (16, 16))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=62000)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    L, C, dt, dev = args.rows, args.width, torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x, dy, u = (torch.randn(L, C, device=dev, dtype=dt, generator=g) for _ in range(3))
    w, b = (torch.randn(C, device=dev, generator=g) for _ in range(2))
    e = x.element_size()
    for G in args.groups:
        print(f"rows={L} C={C} groups={G} bf16")
        _, mean, rstd = norms.norm_fwd(x, w, b, 1e-6, G)

        def ind_fwd(x, w, b):
            x32 = x.float()
            if G == 1:
                return F.layer_norm(x32, (C,), w, b, 1e-6).to(x.dtype)
            return F.group_norm(x32, G, w, b, 1e-6).to(x.dtype)

        cf = torch.compile(ind_fwd)
        timed_variants("norm fwd", norms, lambda: norms.norm_fwd(x, w, b, 1e-6, G), 2 * L * C * e,
                       fwd_tiles(norms, FWD_TILES))
        line("norm fwd: inductor", us(lambda: cf(x, w, b)), 2 * L * C * e)

        def ind_bwd(dy, x, mean, rstd, w):
            x32 = x.float()
            if G == 1:
                return aten.native_layer_norm_backward(dy.float(), x32, [C], mean.view(L, 1), rstd.view(L, 1), w,
                                                       None, [True, True, False])
            return aten.native_group_norm_backward(dy.float(), x32, mean, rstd, w, L, C, 1, G, [True, True, False])

        cb = torch.compile(ind_bwd)
        line("norm bwd: inductor", us(lambda: cb(dy, x, mean, rstd, w)), 3 * L * C * e)
        timed_variants("norm bwd", norms, lambda: norms.norm_bwd(dy, x, w, mean, rstd, G), 3 * L * C * e,
                       bwd_tiles(norms, (None, (1, 4, 4), (2, 4, 4), (4, 4, 4), (4, 8, 4), (8, 8, 4), (2, 4, 8),
                                         (4, 4, 8), (1, 2, 8), (8, 16, 2))))
        # output block: y = u * Norm(attn) and its backward
        timed_variants("out fwd (y)", SB, lambda: SB.output_y(x, u, w, b, 1e-6, G, False), 3 * L * C * e,
                       fwd_tiles(SB, FWD_TILES))

        def ind_out(a, u, w, b):
            return u * ind_fwd(a, w, b)

        co = torch.compile(ind_out)
        line("out fwd (y): inductor", us(lambda: co(a=x, u=u, w=w, b=b)), 3 * L * C * e)
        timed_variants("out bwd", SB, lambda: SB.output_y_bwd(dy, x, u, w, b, mean, rstd, G, False), 5 * L * C * e,
                       bwd_tiles(SB, (None, (1, 4, 16), (1, 8, 8), (1, 8, 4), (1, 2, 16), (1, 16, 2), (2, 4, 8),
                                      (8, 16, 2))))
        xr, ur = (t.detach().requires_grad_() for t in (x, u))
        outc = co(xr, ur, w, b)
        line("out bwd: inductor (autograd of the fwd)",
             us(lambda: torch.autograd.grad(outc, (xr, ur), dy, retain_graph=True)), 5 * L * C * e)
    # preprocess activation: silu(u) of a [L, 4 * 4 * 128] projection (v, q, k are views of it, no copy)
    width, ud = 2048, 512
    p = torch.randn(L, width, device=dev, dtype=dt, generator=g)
    line("silu(u): op body run eagerly (ATen; compiled, it is the inductor line)",
         us(lambda: _activate(p, ud, False)), 2 * L * ud * e)
    cs = torch.compile(lambda p: F.silu(p[:, :ud]))
    line("silu(u): inductor", us(lambda: cs(p)), 2 * L * ud * e)


if __name__ == "__main__":
    main()
