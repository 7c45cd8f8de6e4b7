"""Row normalisation of a ``[L, C]`` tensor with ``G`` groups of ``D = C / G`` contiguous channels
per row (``G = 1``: LayerNorm; ``G = H``: the per-head group norm of the STU output block), with
per-channel weight/bias. Statistics are fp32, outputs are in the input dtype.

A program owns ``BLOCK_R`` whole rows as a ``[BLOCK_R, BLOCK_G, BLOCK_D]`` tile, so the group
reductions are register reductions over the last axis (one pass over memory, no atomics).
The backward accumulates dweight/dbias in registers over a fixed, strided set of row blocks per
program and writes one fp32 partial row per program; the partials are summed afterwards
(deterministic: the row-block -> program assignment depends only on L).

The ``@triton.jit`` helpers are shared with the fused STU output kernels (:mod:`.stu_blocks`).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import interpret, launch, new_tensor, rowmajor

__all__ = ["norm_fwd", "norm_bwd", "supported_channels", "ones_column_width"]

# Widest row the one-tile-per-row kernels take (fp32 tile in registers); wider rows use ATen.
MAX_TILE = 16384


def supported_channels(channels: int, groups: int) -> bool:
    """Whether the kernels take a row of ``channels`` in ``groups`` groups."""
    # block sizes are compile-time constants: a symbolic channel count is specialised here
    channels, g = int(channels), max(int(groups), 1)
    return channels % g == 0 and triton.next_power_of_2(g) * triton.next_power_of_2(channels // g) <= MAX_TILE


ONES_BLOCK = 64  # see ones_column_width; the kernels' ``ONES`` tile of the ones/zeros columns (0: none)


def ones_column_width(C: int) -> int:
    """Width of a ``[L, C]`` GEMM operand stored with a ones column: column C is 1, the rest up to a multiple of
    64 is 0, so that ``grad^T @ operand`` also yields the bias gradient ``grad.sum(0)`` as its column C (one
    GEMM instead of the GEMM plus a pass over ``grad``; ``reference.stu.linear_param_grads``). Rounded to 64
    columns: the forward GEMM reads the ``[:, :C]`` view with that row stride (H100, L=62k, C=512: 208 us at
    stride 576 against 206 at 512, 217 at 520; benchmarks/bias_grad_gemm.py, RESULTS.md 2026-11-24)."""
    return -(-(int(C) + 1) // ONES_BLOCK) * ONES_BLOCK


def ones_column_layout(C: int, ones_column: bool):
    """``(width, n_ones, ONES)`` of a kernel output of C columns: its allocated width, the ones/zeros columns
    after it, and the kernels' ``ONES`` constexpr (0: none)."""
    width = ones_column_width(C) if ones_column else C
    return width, width - C, ONES_BLOCK * ones_column


def tile(C: int, G: int, rows_target: int = 4096):
    """(BLOCK_R, BLOCK_G, BLOCK_D, num_warps) for rows of C channels in G groups."""
    C, G = int(C), int(G)
    bg, bd = triton.next_power_of_2(G), triton.next_power_of_2(C // G)
    width = bg * bd
    target = 1024 if interpret() else rows_target
    br = max(1, min(16, target // width))
    # ~8 fp32 elements per thread and tensor keeps the fused backward (5 live tiles) spill-free;
    # untuned heuristic, see docs/kernels.md
    warps = 1 if interpret() else min(16, max(4, width * br // 256))
    return br, bg, bd, warps


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def bwd_tile(C: int, G: int):
    """Tile of the reducing backward kernels: one row per step and 4 warps, with 8 programs per SM
    (:func:`num_partials`). Measured on H100 (L=62k, C=512, bf16; benchmarks/stu_kernels.py):
    LayerNorm backward 108 us against 626 us for the forward's tile (8 rows, 16 warps, 2/SM) and
    111 us for Inductor's kernel; the fused output-block backward 149 us (Inductor: 139 us)."""
    br, bg, bd, warps = tile(C, G)
    return (br, bg, bd, warps) if interpret() else (1, bg, bd, 4)


def num_partials(device: torch.device) -> int:
    """Programs (and partial rows) of the reducing backward kernels: a constant per device, so the
    dweight summation order never depends on the data."""
    if interpret() or device.type != "cuda":
        return 3
    return 8 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# --------------------------------------------------------------------------------------------
# Shared tile helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def row_tile(row0, L, G, D, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Index tensors of a row tile: rows [R,1,1] (int64), channel [1,G,D] and its mask, tile mask
    [R,G,D], plus 2-D rows/groups ([R,1], [1,G]) and their mask for the [L, G] statistics."""
    r = row0 + tl.arange(0, BLOCK_R)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    rows = r.to(tl.int64)[:, None, None]
    ch = g[None, :, None] * D + d[None, None, :]
    cmask = (g[None, :, None] < G) & (d[None, None, :] < D)
    mask = (rows < L) & cmask
    rows2 = r.to(tl.int64)[:, None]
    g2 = g[None, :]
    mask2 = (rows2 < L) & (g2 < G)
    return rows, ch, cmask, mask, rows2, g2, mask2


@triton.jit
def store_ones_column(Y, rows2, L, stride_y, C, n, BLOCK: tl.constexpr):
    """Columns ``[C, C + n)`` (``n <= BLOCK``) of the tile's rows (``rows2: [R, 1]``): 1 in column C, 0 after
    (:func:`ones_column_width`)."""
    p = tl.arange(0, BLOCK)[None, :]
    tl.store(Y + rows2 * stride_y + C + p, (p == 0).to(Y.dtype.element_ty), mask=(rows2 < L) & (p < n))


@triton.jit
def normalize(x, mask, D, eps):
    """(xhat, mean, rstd) of an fp32 [R, G, D] tile over its last axis; padding lanes of xhat are 0."""
    mean = tl.sum(x, axis=2) / D
    xc = tl.where(mask, x - mean[:, :, None], 0.0)
    var = tl.sum(xc * xc, axis=2) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    return xc * rstd[:, :, None], mean, rstd


@triton.jit
def xhat_from_stats(x, mask, MEAN, RSTD, rows2, g2, mask2, G):
    """(xhat, rstd) of an fp32 tile from saved [L, G] statistics."""
    mean = tl.load(MEAN + rows2 * G + g2, mask=mask2, other=0.0)
    rstd = tl.load(RSTD + rows2 * G + g2, mask=mask2, other=0.0)
    return tl.where(mask, (x - mean[:, :, None]) * rstd[:, :, None], 0.0), rstd


@triton.jit
def normalize_grad(dxhat, xhat, rstd, D):
    """d x from d xhat: ``rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))`` per group."""
    c1 = tl.sum(dxhat * xhat, axis=2) / D
    c2 = tl.sum(dxhat, axis=2) / D
    return (dxhat - xhat * c1[:, :, None] - c2[:, :, None]) * rstd[:, :, None]


@triton.jit
def affine_norm_grad(dn, xhat, rstd, w, acc_dw, acc_db, D, HAS_W: tl.constexpr, NEED_DW: tl.constexpr,
                     NEED_DB: tl.constexpr):
    """``(d x, acc_dw, acc_db)`` for the gradient ``dn`` of ``xhat * w + b``: the input gradient and
    this tile's row sums added to the per-channel weight/bias partials (``w`` unused without HAS_W)."""
    if NEED_DW:
        acc_dw += tl.sum(dn * xhat, axis=0)
    if NEED_DB:
        acc_db += tl.sum(dn, axis=0)
    if HAS_W:
        dn = dn * w
    return normalize_grad(dn, xhat, rstd, D), acc_dw, acc_db


@triton.jit
def store_partials(DW_PART, DB_PART, acc_dw, acc_db, pid, C, ch0, cmask, NEED_DW: tl.constexpr,
                   NEED_DB: tl.constexpr):
    """Write this program's weight/bias gradient partial rows (summed on the host afterwards)."""
    if NEED_DW:
        tl.store(DW_PART + pid * C + ch0, acc_dw[None, :, :], mask=cmask)
    if NEED_DB:
        tl.store(DB_PART + pid * C + ch0, acc_db[None, :, :], mask=cmask)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _norm_fwd_kernel(X, Y, W, B, MEAN, RSTD, L, stride_x, stride_y, G, D, eps, n_ones,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, ONES: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64
    rows, ch, cmask, mask, rows2, g2, mask2 = row_tile(tl.program_id(0) * BLOCK_R, L, G, D, BLOCK_R, BLOCK_G,
                                                       BLOCK_D)
    x = tl.load(X + rows * stride_x + ch, mask=mask, other=0.0).to(tl.float32)
    xhat, mean, rstd = normalize(x, mask, D, eps)
    y = xhat
    if HAS_W:
        y = y * tl.load(W + ch, mask=cmask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + ch, mask=cmask, other=0.0).to(tl.float32)
    tl.store(Y + rows * stride_y + ch, y.to(Y.dtype.element_ty), mask=mask)
    if ONES:
        store_ones_column(Y, rows2, L, stride_y, G * D, n_ones, ONES)
    tl.store(MEAN + rows2 * G + g2, mean, mask=mask2)
    tl.store(RSTD + rows2 * G + g2, rstd, mask=mask2)


@triton.jit
def _norm_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, L, stride_dy, stride_x, stride_dx, G, D,
                     n_blocks, HAS_W: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    acc_dw = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # distinct throwaway names: Triton types loop-carried names, '_' is reassigned below
    r0_, ch0, cmask, m0_, r20_, g20_, m20_ = row_tile(0, 1, G, D, 1, BLOCK_G, BLOCK_D)
    w = 0.0
    if HAS_W:
        w = tl.load(W + ch0, mask=cmask, other=0.0).to(tl.float32)
    for blk in range(pid, n_blocks, n_prog):
        rows, ch, cm_, mask, rows2, g2, mask2 = row_tile(blk * BLOCK_R, L, G, D, BLOCK_R, BLOCK_G, BLOCK_D)
        x = tl.load(X + rows * stride_x + ch, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows * stride_dy + ch, mask=mask, other=0.0).to(tl.float32)
        xhat, rstd = xhat_from_stats(x, mask, MEAN, RSTD, rows2, g2, mask2, G)
        dx, acc_dw, acc_db = affine_norm_grad(dy, xhat, rstd, w, acc_dw, acc_db, D, HAS_W, NEED_DW, NEED_DB)
        tl.store(DX + rows * stride_dx + ch, dx.to(DX.dtype.element_ty), mask=mask)
    store_partials(DW_PART, DB_PART, acc_dw, acc_db, pid, G * D, ch0, cmask, NEED_DW, NEED_DB)


# --------------------------------------------------------------------------------------------
# Host wrappers (tensors must be 2-D with a contiguous last dim)
# --------------------------------------------------------------------------------------------


def norm_fwd(x, weight, bias, eps: float, groups: int = 1, ones_column: bool = False):
    """``(y [L, C] in x.dtype, mean [L, G] fp32, rstd [L, G] fp32)``; with ``ones_column`` y is
    ``[L, ones_column_width(C)]`` whose first C columns are the result."""
    x = rowmajor(x)
    L, C = x.shape
    G = max(groups, 1)
    D = C // G
    width, n_ones, ones = ones_column_layout(C, ones_column)
    y = new_tensor((L, width), x.dtype, x.device)
    mean = new_tensor((L, G), torch.float32, x.device)
    rstd = new_tensor((L, G), torch.float32, x.device)
    br, bg, bd, warps = tile(C, G)
    launch(_norm_fwd_kernel, (triton.cdiv(L, br),), x, y, weight, bias, mean, rstd, L, x.stride(0), y.stride(0),
           G, D, eps, n_ones, HAS_W=weight is not None, HAS_B=bias is not None, ONES=ones, BLOCK_R=br,
           BLOCK_G=bg, BLOCK_D=bd, num_warps=warps)
    return y, mean, rstd


def norm_bwd(dy, x, weight, mean, rstd, groups: int = 1, need_dw: bool = True, need_db: bool = True):
    """``(dx in x.dtype, dweight fp32 or None, dbias fp32 or None)``; the reductions over rows are
    per-program fp32 partials summed afterwards."""
    dy, x = rowmajor(dy), rowmajor(x)
    L, C = x.shape
    G = max(groups, 1)
    D = C // G
    need_dw = need_dw and weight is not None
    dx = new_tensor((L, C), x.dtype, x.device)
    br, bg, bd, warps = bwd_tile(C, G)
    P = num_partials(x.device)
    dw_part = torch.empty((P, C), dtype=torch.float32, device=x.device) if need_dw else None
    db_part = torch.empty((P, C), dtype=torch.float32, device=x.device) if need_db else None
    launch(_norm_bwd_kernel, (P,), dy, x, weight, mean, rstd, dx, dw_part, db_part, L, dy.stride(0), x.stride(0),
           dx.stride(0), G, D, triton.cdiv(L, br), HAS_W=weight is not None, NEED_DW=need_dw, NEED_DB=need_db,
           BLOCK_R=br, BLOCK_G=bg, BLOCK_D=bd, num_warps=warps)
    return dx, (dw_part.sum(0) if need_dw else None), (db_part.sum(0) if need_db else None)
