"""Fused Triton kernels for the dense STU blocks around attention (HSTU_SEMANTICS.md, "STU layer").

preprocess  ``uvqk = LayerNorm(x) @ W^T + b; act = silu(u)`` (or ``silu(uvqk)``); v, q, k are views
    forward : LayerNorm kernel -> ``addmm`` (cuBLAS) (:func:`preprocess_projection`); the op then
              activates the projection with an ATen silu that Inductor fuses.
    backward: the normalised x, the statistics and the pre-activations are either saved by the
              forward (``stu_preprocess_save``) or recomputed (LayerNorm kernel plus a matmul of
              only the u columns unless ``silu_all``) -> the silu backward added to ``d_uvqk``
              (ATen) -> ``dW`` and ``db`` (one GEMM: the forward stored ``normed`` with a ones column,
              ``norms.ones_column_width``), ``d_normed`` by cuBLAS -> LayerNorm backward kernel.
output      ``out = x + drop([u, attn,] u * Norm(attn)) @ W^T + b``  (Norm: layer or per-head group)
    forward : one kernel normalises attn (fp32 stats), multiplies by u (``silu_u``: u is the
              pre-activation and the kernel applies the silu: no silu(u) tensor), applies dropout and
              writes the projection input (for ``concat_ua`` the ``[L, 3C]`` buffer ``[u, attn, y]``
              directly, no cat; with a bias followed by a ones column) -> ``addmm`` with the bias in its
              epilogue -> the residual added (:func:`stu_output_fwd`).
    backward: the projection input and the statistics are saved by the forward (``stu_output_save``) or
              recomputed by the forward kernel -> ``d_y = grad @ W`` and ``[dW | db] = grad^T @ [y | 1]``
              by cuBLAS -> one kernel producing ``d_attn``, ``d_u`` (``silu_u``: w.r.t. the pre-activation)
              and norm dweight/dbias partials.
Dropout masks are regenerated from ``(seed, flat index)`` (:mod:`.rng`); nothing is saved.

All tensors are ``[rows, channels]`` with a contiguous last dim (host wrappers make them so).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.dropout import keep_threshold
from ..reference.stu import linear_param_grads, uvqk_grad
from .common import launch, new_tensor, rowmajor
from .norms import (affine_norm_grad, bwd_tile, norm_bwd, norm_fwd, normalize, num_partials, ones_column_layout,
                    row_tile, store_ones_column, store_partials, supported_channels, tile, xhat_from_stats)
from .rng import keep, seed_keys

__all__ = ["supported_channels", "output_y", "output_y_bwd", "linear", "stu_output_fwd", "stu_output_bwd",
           "preprocess_projection", "stu_preprocess_bwd"]


# --------------------------------------------------------------------------------------------
# output block
# --------------------------------------------------------------------------------------------


@triton.jit
def _dropped(v, idx, k1, k2, thresh, scale, DROPOUT: tl.constexpr):
    if DROPOUT:
        v = tl.where(keep(idx, k1, k2, thresh), v * scale, 0.0)
    return v


@triton.jit
def _out_fwd_kernel(A, U, Y, W, B, MEAN, RSTD, SEED, L, stride_a, stride_u, stride_y, G, D, eps, thresh, scale,
                    n_ones, HAS_W: tl.constexpr, HAS_B: tl.constexpr, CONCAT: tl.constexpr, DROPOUT: tl.constexpr,
                    SILU_U: tl.constexpr, ONES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    eps, scale = tl.cast(eps, tl.float32), tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    rows, ch, cmask, mask, rows2, g2, mask2 = row_tile(tl.program_id(0) * BLOCK_R, L, G, D, BLOCK_R, BLOCK_G,
                                                       BLOCK_D)
    a = tl.load(A + rows * stride_a + ch, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows * stride_u + ch, mask=mask, other=0.0).to(tl.float32)
    if SILU_U:  # U holds the pre-activation: the block's u (also the one concatenated) is silu(U)
        u = u * tl.sigmoid(u)
    normed, mean, rstd = normalize(a, mask, D, eps)
    if HAS_W:
        normed = normed * tl.load(W + ch, mask=cmask, other=0.0).to(tl.float32)
    if HAS_B:
        normed = normed + tl.load(B + ch, mask=cmask, other=0.0).to(tl.float32)
    y = u * normed
    C = G * D
    k1 = 0
    k2 = 0
    if DROPOUT:
        k1, k2 = seed_keys(SEED)
    # flat index in the [L, C or 3C] projection input: the mask is a function of (seed, index) only
    if CONCAT:
        base = rows * (3 * C) + ch
        tl.store(Y + rows * stride_y + ch, _dropped(u, base, k1, k2, thresh, scale, DROPOUT)
                 .to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + rows * stride_y + C + ch, _dropped(a, base + C, k1, k2, thresh, scale, DROPOUT)
                 .to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + rows * stride_y + 2 * C + ch, _dropped(y, base + 2 * C, k1, k2, thresh, scale, DROPOUT)
                 .to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(Y + rows * stride_y + ch, _dropped(y, rows * C + ch, k1, k2, thresh, scale, DROPOUT)
                 .to(Y.dtype.element_ty), mask=mask)
    if ONES:  # after the (dropped) projection input, never dropped itself
        store_ones_column(Y, rows2, L, stride_y, (3 if CONCAT else 1) * C, n_ones, ONES)
    tl.store(MEAN + rows2 * G + g2, mean, mask=mask2)
    tl.store(RSTD + rows2 * G + g2, rstd, mask=mask2)


@triton.jit
def _out_bwd_kernel(DYC, A, U, W, B, MEAN, RSTD, SEED, DA, DU, DW_PART, DB_PART, L, stride_dy, stride_a,
                    stride_u, stride_da, stride_du, G, D, n_blocks, thresh, scale,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
                    CONCAT: tl.constexpr, DROPOUT: tl.constexpr, SILU_U: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """d_attn, d_u from the gradient of the projection input ``DYC`` ([L, C] or [L, 3C]); with ``SILU_U``,
    ``U`` holds the pre-activation and ``DU`` is the gradient w.r.t. it."""
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    C = G * D
    acc_dw = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # distinct throwaway names: Triton types loop-carried names, '_' is reassigned below
    r0_, ch0, cmask, m0_, r20_, g20_, m20_ = row_tile(0, 1, G, D, 1, BLOCK_G, BLOCK_D)
    w = 0.0
    if HAS_W:
        w = tl.load(W + ch0, mask=cmask, other=0.0).to(tl.float32)
    if HAS_B:
        b = tl.load(B + ch0, mask=cmask, other=0.0).to(tl.float32)
    k1 = 0
    k2 = 0
    if DROPOUT:
        k1, k2 = seed_keys(SEED)
    for blk in range(pid, n_blocks, n_prog):
        rows, ch, cm_, mask, rows2, g2, mask2 = row_tile(blk * BLOCK_R, L, G, D, BLOCK_R, BLOCK_G, BLOCK_D)
        a = tl.load(A + rows * stride_a + ch, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + rows * stride_u + ch, mask=mask, other=0.0).to(tl.float32)
        if SILU_U:
            u_pre = u
            sig = tl.sigmoid(u_pre)
            u = u_pre * sig
        xhat, rstd = xhat_from_stats(a, mask, MEAN, RSTD, rows2, g2, mask2, G)
        normed = xhat
        if HAS_W:
            normed = normed * w
        if HAS_B:
            normed = normed + b
        if CONCAT:
            base = rows * (3 * C) + ch
            dy_ptr = DYC + rows * stride_dy + ch
            du = _dropped(tl.load(dy_ptr, mask=mask, other=0.0).to(tl.float32), base, k1, k2, thresh, scale,
                          DROPOUT)
            da = _dropped(tl.load(dy_ptr + C, mask=mask, other=0.0).to(tl.float32), base + C, k1, k2, thresh,
                          scale, DROPOUT)
            dy = _dropped(tl.load(dy_ptr + 2 * C, mask=mask, other=0.0).to(tl.float32), base + 2 * C, k1, k2,
                          thresh, scale, DROPOUT)
            du += dy * normed
        else:
            dy = _dropped(tl.load(DYC + rows * stride_dy + ch, mask=mask, other=0.0).to(tl.float32),
                          rows * C + ch, k1, k2, thresh, scale, DROPOUT)
            du = dy * normed
        dn = dy * u
        if SILU_U:  # silu'(x) = s * (1 + x * (1 - s)), s = sigmoid(x)
            du = du * sig * (1.0 + u_pre * (1.0 - sig))
        d_attn, acc_dw, acc_db = affine_norm_grad(dn, xhat, rstd, w, acc_dw, acc_db, D, HAS_W, NEED_DW, NEED_DB)
        if CONCAT:
            d_attn += da
        tl.store(DA + rows * stride_da + ch, d_attn.to(DA.dtype.element_ty), mask=mask)
        tl.store(DU + rows * stride_du + ch, du.to(DU.dtype.element_ty), mask=mask)
    store_partials(DW_PART, DB_PART, acc_dw, acc_db, pid, C, ch0, cmask, NEED_DW, NEED_DB)


def _dropout_args(dropout_p: float, seed, device):
    if dropout_p <= 0.0:
        return False, None, 0, 1.0
    if seed is None:
        raise ValueError("dropout_p > 0 needs a seed tensor")
    return True, seed.to(device=device, dtype=torch.int64).reshape(1), keep_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def output_y(attn, u, norm_weight, norm_bias, eps: float, groups: int, concat_ua: bool, dropout_p: float = 0.0,
             seed=None, silu_u: bool = False, ones_column: bool = False):
    """The projection input ``drop(u * Norm(attn))`` (or ``drop([u, attn, u * Norm(attn)])``) in
    attn's dtype, plus fp32 ``mean, rstd [L, G]``. ``silu_u``: ``u`` is the pre-activation, the block's
    u is ``silu(u)`` (fp32, in the kernel). ``ones_column``: the input is followed by a ones column
    (``norms.ones_column_width``)."""
    attn, u = rowmajor(attn), rowmajor(u)
    L, C = attn.shape
    G = max(groups, 1)
    drop, seed_t, thresh, scale = _dropout_args(dropout_p, seed, attn.device)
    width, n_ones, ones = ones_column_layout(3 * C if concat_ua else C, ones_column)
    y = new_tensor((L, width), attn.dtype, attn.device)
    mean = new_tensor((L, G), torch.float32, attn.device)
    rstd = new_tensor((L, G), torch.float32, attn.device)
    br, bg, bd, warps = tile(C, G, rows_target=2048)
    launch(_out_fwd_kernel, (triton.cdiv(L, br),), attn, u, y, norm_weight, norm_bias, mean, rstd, seed_t, L,
           attn.stride(0), u.stride(0), y.stride(0), G, C // G, eps, thresh, scale, n_ones,
           HAS_W=norm_weight is not None, HAS_B=norm_bias is not None, CONCAT=concat_ua, DROPOUT=drop,
           SILU_U=silu_u, ONES=ones, BLOCK_R=br, BLOCK_G=bg, BLOCK_D=bd, num_warps=warps)
    return y, mean, rstd


def output_y_bwd(d_y, attn, u, norm_weight, norm_bias, mean, rstd, groups: int, concat_ua: bool,
                 dropout_p: float = 0.0, seed=None, need_dw: bool = True, need_db: bool = True, silu_u: bool = False):
    """``(d_attn, d_u, d_norm_weight fp32 | None, d_norm_bias fp32 | None)`` from the gradient of the
    projection input (shape of :func:`output_y`'s result); with ``silu_u``, ``d_u`` is w.r.t. the
    pre-activation ``u``."""
    d_y, attn, u = rowmajor(d_y), rowmajor(attn), rowmajor(u)
    L, C = attn.shape
    G = max(groups, 1)
    drop, seed_t, thresh, scale = _dropout_args(dropout_p, seed, attn.device)
    need_dw = need_dw and norm_weight is not None
    need_db = need_db and norm_bias is not None
    d_attn = new_tensor((L, C), attn.dtype, attn.device)
    d_u = new_tensor((L, C), u.dtype, u.device)
    P = num_partials(attn.device)
    dw_part = torch.empty((P, C), dtype=torch.float32, device=attn.device) if need_dw else None
    db_part = torch.empty((P, C), dtype=torch.float32, device=attn.device) if need_db else None
    br, bg, bd, warps = bwd_tile(C, G)
    launch(_out_bwd_kernel, (P,), d_y, attn, u, norm_weight, norm_bias, mean, rstd, seed_t, d_attn, d_u, dw_part,
           db_part, L, d_y.stride(0), attn.stride(0), u.stride(0), d_attn.stride(0), d_u.stride(0), G, C // G,
           triton.cdiv(L, br), thresh, scale, HAS_W=norm_weight is not None, HAS_B=norm_bias is not None,
           NEED_DW=need_dw, NEED_DB=need_db, CONCAT=concat_ua, DROPOUT=drop, SILU_U=silu_u, BLOCK_R=br, BLOCK_G=bg,
           BLOCK_D=bd, num_warps=warps)
    return d_attn, d_u, (dw_part.sum(0) if need_dw else None), (db_part.sum(0) if need_db else None)


def stu_output_fwd(attn, u, x, norm_weight, norm_bias, eps, groups, weight, bias, concat_ua, dropout_p=0.0,
                   seed=None, silu_u=False):
    """``(x + drop(y) @ weight^T (+ bias), y, mean, rstd)``: the bias in the matmul's epilogue, the residual
    added after it. (With the residual as addmm's C input, addmm first copies x into its output, and the bias
    took one more pass: 165 us against 129 us for these two kernels at L=62k, E=512 on H100, RESULTS.md
    2026-11-24; under Inductor the add is one fused pointwise kernel.) With a bias, ``y`` carries a ones
    column, so that the backward's weight-gradient GEMM also gives the bias gradient."""
    y, mean, rstd = output_y(attn, u, norm_weight, norm_bias, eps, groups, concat_ua, dropout_p, seed, silu_u,
                             ones_column=bias is not None)
    return linear(y[:, :weight.shape[1]], weight, bias) + x, y, mean, rstd


def stu_output_bwd(grad, attn, u, x, norm_weight, norm_bias, eps, groups, weight, bias, concat_ua, dropout_p=0.0,
                   seed=None, y=None, mean=None, rstd=None, silu_u=False):
    """Gradients ``[d_attn, d_u, d_x, d_norm_weight, d_norm_bias, d_weight, d_bias]`` (Nones dropped).
    Without the forward's ``y, mean, rstd`` the forward kernel recomputes them."""
    if y is None:
        y, mean, rstd = output_y(attn, u, norm_weight, norm_bias, eps, groups, concat_ua, dropout_p, seed, silu_u,
                                 ones_column=bias is not None)
    d_y = grad.mm(weight)
    d_w, d_b = linear_param_grads(grad, y, weight.shape[1], bias is not None)
    d_attn, d_u, d_nw, d_nb = output_y_bwd(d_y, attn, u, norm_weight, norm_bias, mean, rstd, groups, concat_ua,
                                           dropout_p, seed, silu_u=silu_u)
    grads = [d_attn, d_u, grad.clone(),
             d_nw.to(norm_weight.dtype) if norm_weight is not None else None,
             d_nb.to(norm_bias.dtype) if norm_bias is not None else None, d_w, d_b]
    return [g for g in grads if g is not None]


# --------------------------------------------------------------------------------------------
# preprocess block
# --------------------------------------------------------------------------------------------


# The silu of the projection (in the op) and its gradient (reference.stu.uvqk_grad) are plain ATen on
# purpose: inside the triton_op, Inductor fuses them with their neighbours (e.g. the assembly of d_uvqk
# from the gradients of the v, q, k views). For the former split + copies, Inductor's kernels measured
# 187 us against 368 us for our per-segment Triton copies (H100, L=62k, width 2048, bf16;
# benchmarks/stu_kernels.py).


def linear(inp, weight, bias):
    """``F.linear`` on cuBLAS with the bias as addmm's C input."""
    return torch.addmm(bias, inp, weight.t()) if bias is not None else inp.mm(weight.t())


def preprocess_projection(x, ln_weight, ln_bias, eps, weight, bias):
    """``(normed, uvqk, mean [L, 1], rstd [L, 1])``: LayerNorm kernel, then the projection on cuBLAS
    (the op splits ``uvqk`` into its outputs). With a bias, ``normed`` carries a ones column
    (``norms.ones_column_width``): the backward's weight-gradient GEMM then also gives the bias gradient."""
    normed, mean, rstd = norm_fwd(x, ln_weight, ln_bias, eps, ones_column=bias is not None)
    return normed, linear(normed[:, :x.shape[1]], weight, bias), mean, rstd


def stu_preprocess_bwd(d_act, d_uvqk, x, ln_weight, ln_bias, eps, weight, bias, u_dim, qk_dim, silu_all,
                       uvqk=None, normed=None, mean=None, rstd=None):
    """Gradients ``[d_x, d_ln_weight, d_ln_bias, d_weight, d_bias]`` (Nones dropped) from those of the
    op's ``(act, uvqk)`` (None: zero). Without the forward's intermediates it recomputes the
    normalised x and the pre-activations the silu backward needs (only the u columns unless silu_all)."""
    E = x.shape[1]
    if normed is None:
        normed, mean, rstd = norm_fwd(x, ln_weight, ln_bias, eps, ones_column=bias is not None)
        if d_act is None:  # act unused (e.g. silu(u) moved into the output block): no silu backward
            uvqk = normed  # uvqk_grad then reads only its rows
        elif silu_all:
            uvqk = linear(normed[:, :E], weight, bias)
        else:
            uvqk = linear(normed[:, :E], weight[:u_dim], bias[:u_dim] if bias is not None else None)
    d_p = uvqk_grad(d_act, d_uvqk, uvqk, weight.shape[0])
    d_w, d_b = linear_param_grads(d_p, normed, E, bias is not None)
    d_normed = d_p.mm(weight)
    dx, d_lw, d_lb = norm_bwd(d_normed, x, ln_weight, mean, rstd, 1, need_db=ln_bias is not None)
    grads = [dx, d_lw.to(ln_weight.dtype) if ln_weight is not None else None,
             d_lb.to(ln_bias.dtype) if ln_bias is not None else None, d_w, d_b]
    return [g for g in grads if g is not None]
