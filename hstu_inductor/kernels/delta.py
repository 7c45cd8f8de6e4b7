"""Cached (delta) attention for few new rows per sequence: the key range split across programs.

With D <= 64 new rows per sequence, the work of one (sequence, head) is one narrow row block that
streams the whole K/V cache: B * H programs, each reading ~n * (Dq + Dv) * 2 bytes. At B * H = 512
programs on 132 SMs that is ~1.3 waves of long programs, so the tail leaves SMs idle, and the full
forward's 128-row blocks spend tensor-core time on rows that do not exist (issue 22 item 4).

Here each (sequence, head, row block) is split into ``S`` programs over disjoint key ranges. HSTU
has no softmax: the output is a plain sum over keys, so the partial outputs add exactly, without a
rescaling pass. Each program writes its scaled fp32 partial ``[S, rows, H, Dv]`` once and a small
kernel sums the ``S`` partials in a fixed order (deterministic; no atomics, no zeroing). ``S = 1``
stores straight into the output. Row blocks are the delta rows rounded up to 16-64. (At 128 rows the
full forward's row blocks were faster on the H100: 0.129 against 0.183 ms at N=1024, B=128.)

The key ranges, the element-wise mask and the silu are the full forward's own jit helpers, so every
mask option of cached attention means the same here.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import attention as A
from .. import _compat
from .common import address_source, interpret, launcher, new_tensor

__all__ = ["delta_attention_fwd", "delta_forward", "max_delta_rows", "choose_split"]

# (BLOCK_N, num_stages, num_warps). Row blocks of 16-32 rows use mma.sync with K/V in registers: sm90
# ptxas gives (32, 4, 8) 125 registers (two CTAs per SM), (64, 3, 8) 230, (64, 3, 4) 255 with spills;
# yet (64, 3, 8) was the fastest on the H100 at 1 and 16 rows (0.107 / 0.111 ms against 0.110 / 0.116).
_CONFIGS = [(32, 4, 8), (64, 3, 8), (64, 2, 8), (32, 3, 4), (128, 2, 8)]


def max_delta_rows() -> int:
    """Delta rows per sequence up to which this kernel is used (beyond: the full forward's row blocks)."""
    return 64


@triton.jit
def _hstu_delta_kernel(
    Q, K, V, O, P, SEQ_OFFSETS, NUM_TARGETS, ATTN_SCALE,
    stride_qm, stride_qh, stride_qd, stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
    stride_om, stride_oh, stride_od, stride_sm,
    alpha, scale_const,
    H, DQ, DV, ROWS, MAX_N, DELTA_ROWS, CTX, WINDOW, SPLIT, RQ,
    CAUSAL: tl.constexpr, HAS_TGT: tl.constexpr, HAS_CTX: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SCALE_MODE: tl.constexpr, PARTIAL: tl.constexpr, FAST: tl.constexpr, PREC: tl.constexpr,
    EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    alpha, scale_const = tl.cast(alpha, tl.float32), tl.cast(scale_const, tl.float32)  # fp64 under Inductor
    # program order: split fastest, then row block, then (sequence, head)
    pid = tl.program_id(0)
    s = pid % SPLIT
    rest = pid // SPLIT
    n_blocks = (DELTA_ROWS + BLOCK_M - 1) // BLOCK_M
    m_blk = rest % n_blocks
    bh = rest // n_blocks
    b = bh // H
    h = bh % H
    start, n = A._seq_bounds(SEQ_OFFSETS, b, ROWS, MAX_N)
    pos0 = n - DELTA_ROWS
    q_row0 = b.to(tl.int64) * DELTA_ROWS
    r0 = m_blk * BLOCK_M
    M = A._id_end(n, b, NUM_TARGETS, CTX, HAS_CTX, HAS_TGT)
    offs_r = r0 + tl.arange(0, BLOCK_M)
    pos_m = pos0 + offs_r
    pi_m = A._ids(pos_m, CTX, M, HAS_CTX, HAS_TGT)

    q_base = Q + q_row0 * stride_qm + h * stride_qh
    q = A._load_rows(q_base, r0, DELTA_ROWS, DQ, stride_qm, stride_qd, True, EVEN_DQ, False, BLOCK_M, BLOCK_DQ)
    q = tl.where((pos_m >= 0)[:, None], q, tl.zeros_like(q))  # rows before a short sequence's start
    K_src = K + start * stride_km + h * stride_kh
    V_src = V + start * stride_vm + h * stride_vh
    RB = A._bias_operands(None, None, None, None, 0, MAX_N, b, h, start, 0, 0, 0, 0, None, None, False, False, False)

    m_first = tl.maximum(pos0 + r0, 0)
    m_last = tl.minimum(pos0 + r0 + BLOCK_M, n) - 1
    a, fs, fe, e = A._fwd_key_range(m_first, m_last, n, M, CTX, WINDOW, 0, BLOCK_N, CAUSAL, HAS_CTX, HAS_TGT,
                                    HAS_WINDOW, False)
    # this program's share of the visible key tiles [a, e): whole tiles, the first splits one tile longer
    tiles = (e - a) // BLOCK_N
    per = tiles // SPLIT
    extra = tiles % SPLIT
    lo = a + (s * per + tl.minimum(s, extra)) * BLOCK_N
    hi = lo + (per + (s < extra).to(tl.int32)) * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # the full forward's three segments (masked, full, masked), each cut to [lo, hi)
    acc = A._fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd,
                       tl.maximum(a, lo), tl.minimum(fs, hi), pos_m, pi_m, n, M, CTX, WINDOW, 0, alpha, DQ, DV, RB,
                       pos_m, pos_m, pos_m, True, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, False, False, FAST, PREC,
                       EVEN_DQ, EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, False, False, False, False, 0)
    acc = A._fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd,
                       tl.maximum(fs, lo), tl.minimum(fe, hi), pos_m, pi_m, n, M, CTX, WINDOW, 0, alpha, DQ, DV, RB,
                       pos_m, pos_m, pos_m, False, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, False, False, FAST, PREC,
                       EVEN_DQ, EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, False, False, False, False, 0)
    acc = A._fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd,
                       tl.maximum(fe, lo), tl.minimum(e, hi), pos_m, pi_m, n, M, CTX, WINDOW, 0, alpha, DQ, DV, RB,
                       pos_m, pos_m, pos_m, True, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, False, False, FAST, PREC,
                       EVEN_DQ, EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, False, False, False, False, 0)

    if SCALE_MODE == 0:
        acc = acc * scale_const
    elif SCALE_MODE == 1:
        acc = acc * tl.load(ATTN_SCALE).to(tl.float32)
    else:
        sc = tl.load(ATTN_SCALE + (q_row0 + offs_r) * stride_sm, mask=offs_r < DELTA_ROWS, other=0.0)
        acc = acc * sc.to(tl.float32)[:, None]
    offs_d = tl.arange(0, BLOCK_DV)
    ok = (offs_r < DELTA_ROWS)[:, None] & (offs_d < DV)[None, :]
    rows = (q_row0 + offs_r).to(tl.int64)[:, None]
    if PARTIAL:  # contiguous [SPLIT, RQ, H, DV] fp32, RQ = B * DELTA_ROWS
        p_ptr = P + ((s.to(tl.int64) * RQ + rows) * H + h) * DV + offs_d[None, :]
        tl.store(p_ptr, acc, mask=ok)
    else:
        o_ptr = O + rows * stride_om + h * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptr, acc.to(O.dtype.element_ty), mask=ok)


@triton.jit
def _split_sum_kernel(P, O, numel, SPLIT, BLOCK: tl.constexpr):
    """O (contiguous) = sum over s of P[s] (fp32, summed in the order s = 0, 1, ...), in O's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(P + s * numel + offs, mask=ok, other=0.0)
    tl.store(O + offs, acc.to(O.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=16)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_split(programs: int, key_tiles: int, sms: int) -> int:
    """Key splits per row block: enough programs for ~4 per SM (the tail of the last wave then costs
    little), each split keeping >= 4 key tiles so a program still pipelines its loads."""
    want = -(-4 * sms // max(programs, 1))
    return max(1, min(want, key_tiles // 4, 16))


def _block_m(rows: int) -> int:
    return max(16, A._pow2(rows))


def delta_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                        max_attn_len=0, contextual_seq_len=0, *, tma=None) -> torch.Tensor:
    """Cached attention (``attention.delta_hstu_attention_fwd``'s contract): the key-range split for up to
    :func:`max_delta_rows` rows per sequence, the full forward's row blocks beyond."""
    B = seq_offsets.shape[0] - 1
    D = delta_q.shape[0] // B if B > 0 else 0
    if B > 0 and 0 < D <= max_delta_rows() and D * B == delta_q.shape[0]:
        return delta_forward(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                             max_attn_len, contextual_seq_len)
    return A.delta_hstu_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                                      max_attn_len, contextual_seq_len, tma=tma)


def delta_forward(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                  max_attn_len=0, contextual_seq_len=0, *, split=None, config=None) -> torch.Tensor:
    """Cached attention (:func:`hstu_inductor.kernels.attention.delta_hstu_attention_fwd`'s contract) for
    ``D <= max_delta_rows()`` rows per sequence. ``split`` / ``config`` ((BLOCK_N, stages, warps)) override
    the automatic choices (tests, benchmarks)."""
    A._check_inputs(delta_q, k, v, seq_offsets, num_targets)
    seq_offsets = address_source(seq_offsets)
    B = seq_offsets.shape[0] - 1
    rq, H, Dq = delta_q.shape
    Dv = v.shape[2]
    D = rq // B
    out = new_tensor((rq, H, Dv), delta_q.dtype, delta_q.device)
    if rq == 0 or H == 0 or max_seq_len <= 0:
        return out.zero_()
    scale_mode, scale_const, scale_t, stride_s = A._scale_args(attn_scale, max_seq_len, delta_q.device, rq)
    flags = A._flags(True, num_targets, max_attn_len, contextual_seq_len, 0)
    flags.pop("HAS_MINFULL")
    bdq, bdv = A._block_d(Dq), A._block_d(Dv)
    if config is None:
        pick = os.environ.get("HSTU_INDUCTOR_DELTA_CONFIG")
        if pick is not None:
            config = _CONFIGS[int(pick)]
        elif delta_q.dtype == torch.float32:  # fp32 tiles are twice as wide
            config = (32, 3, 8)
        else:  # measured on the H100 (benchmarks/RESULTS.md, session 9): (64, 3, 8) at 1 and 16 rows
            config = _CONFIGS[1]
    block_n, stages, warps = config
    block_m = _block_m(D)
    n_blocks = -(-D // block_m)
    programs = B * H * n_blocks
    if split is None:
        sms = 132 if delta_q.device.type != "cuda" else _num_sms(delta_q.device.index or 0)
        split = choose_split(_compat.size_hint(programs), -(-_compat.size_hint(max_seq_len) // block_n), sms)
    partial = split > 1
    part = torch.empty((split, rq, H, Dv), device=delta_q.device, dtype=torch.float32) if partial else None
    args = (delta_q, k, v, out, part, seq_offsets, num_targets, scale_t,
            *delta_q.stride(), *k.stride(), *v.stride(), *out.stride(), stride_s,
            float(alpha), float(scale_const), H, Dq, Dv, k.shape[0], max_seq_len, D, int(contextual_seq_len),
            int(max_attn_len), split, rq)
    kwargs = dict(flags, SCALE_MODE=scale_mode, PARTIAL=partial, FAST=A._fast_silu(delta_q.dtype, delta_q.device),
                  PREC=A._prec(delta_q.dtype), EVEN_DQ=bdq == Dq, EVEN_DV=bdv == Dv, BLOCK_DQ=bdq, BLOCK_DV=bdv,
                  BLOCK_M=block_m, BLOCK_N=block_n)
    with A._device_ctx(delta_q.device):
        launcher(_hstu_delta_kernel, args)[(programs * split,)](*args, **kwargs, num_warps=warps,
                                                                 num_stages=stages)
        if partial:
            numel = rq * H * Dv
            block = 1024 if interpret() else 2048
            sargs = (part, out, numel, split)
            launcher(_split_sum_kernel, sargs)[(triton.cdiv(numel, block),)](*sargs, BLOCK=block)
    return out
