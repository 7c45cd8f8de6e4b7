"""The jagged HSTU attention forward kernel: one program per (sequence, head, query block), visiting only
the key blocks its rows can see (:func:`attention_jit._fwd_key_range`; the element-wise mask only where a
block needs it). With ``DELTA`` it computes the last rows of every sequence (cached attention). Its key-block
loop :func:`_fwd_inner` is also the loop of delta.py's cached-attention kernel.
Host side (launch, autotuning, arguments): attention.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_jit import (_bias_operands, _fwd_key_range, _id_end, _ids, _iv_key_range, _iv_rows, _load_rows,
                            _pre_silu, _row_tile_mask, _rows, _seq_bounds, _silu, _silu_packed, _store_rows, _tile)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, lo, hi, pos_m, i0, pi_m,
               n, M, ml, alpha, DQ, DV, RB, x0, x1, x2,
               MASKED: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr, FAST: tl.constexpr,
               PREC: tl.constexpr, EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
               HAS_RAB: tl.constexpr, HAS_IV: tl.constexpr,
               HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, TS_STEPS: tl.constexpr):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k = _load_rows(K_src, start_n, n, DQ, stride_km, stride_kd, MASKED, EVEN_DQ, TMA, BLOCK_N, BLOCK_DQ)
        v = _load_rows(V_src, start_n, n, DV, stride_vm, stride_vd, MASKED, EVEN_DV, TMA, BLOCK_N, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        s, a, bk = _pre_silu(s, alpha, RB, pos_m, offs_n, i0, start_n, n, HAS_RAB, HAS_POS, HAS_TS, TS_STEPS,
                             False)
        if FAST == 2:
            p = _silu_packed((s * (0.5 * a)).to(v.dtype))
        else:
            p = _silu(s, a, FAST).to(v.dtype)
        if MASKED:
            ok = _row_tile_mask(pos_m, offs_n, pi_m, x0, x1, x2, n, M, ml, MASK, HAS_IV)
            p = tl.where(ok, p, 0.0)
        acc = tl.dot(p, v, acc, input_precision=PREC)
    return acc


@triton.jit
def _hstu_fwd_kernel(
    Q, K, V, O, SEQ_OFFSETS, NUM_TARGETS, ATTN_SCALE,
    stride_qm, stride_qh, stride_qd, stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
    stride_om, stride_oh, stride_od, stride_sm,
    alpha, scale_const, one,
    H, DQ, DV, ROWS, MAX_N, DELTA_ROWS, ML0, ML1, ML2, ML3, N_BUCKET,
    RAB, stride_rb, stride_rh, stride_ri, stride_rj, IV, stride_ih, stride_ir, stride_ic,
    TS, POSW, TSW, NB, TSB, TSP,
    MASK: tl.constexpr, SCALE_MODE: tl.constexpr, DELTA: tl.constexpr, TMA: tl.constexpr,
    FAST: tl.constexpr, PREC: tl.constexpr, EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEQ_MAJOR: tl.constexpr = True, Q_IN_REGS: tl.constexpr = False,
    HAS_RAB: tl.constexpr = False, HAS_IV: tl.constexpr = False,
    HAS_POS: tl.constexpr = False, HAS_TS: tl.constexpr = False, TS_STEPS: tl.constexpr = 0,
    TAB_HEADS: tl.constexpr = 0,
):
    # Inductor passes Python float arguments of user kernels as fp64 (a direct launch passes fp32):
    # cast once so the score math and the fp32-only inline-asm silu see fp32 on both paths.
    alpha, scale_const, one = tl.cast(alpha, tl.float32), tl.cast(scale_const, tl.float32), tl.cast(one, tl.float32)
    ml = (ML0, ML1, ML2, ML3)  # the mask lengths (attention_jit reads them)
    # heaviest row blocks (largest start row under a causal mask) are launched first
    if DELTA:
        pid_bh, m_blk = _tile(DELTA_ROWS, BLOCK_M, True, SEQ_MAJOR)
    else:
        pid_bh, m_blk = _tile(MAX_N, BLOCK_M, True, SEQ_MAJOR)
    b = pid_bh // H
    h = pid_bh % H
    start, n = _seq_bounds(SEQ_OFFSETS, b, ROWS, MAX_N)
    if DELTA:
        nq = n * 0 + DELTA_ROWS
        pos0 = n - DELTA_ROWS
        q_row0 = b.to(tl.int64) * DELTA_ROWS
    else:
        nq = n
        pos0 = n * 0
        q_row0 = start
    r0 = m_blk * BLOCK_M
    if r0 >= nq:
        return

    M = _id_end(n, b, NUM_TARGETS, ml, MASK)

    offs_r = r0 + tl.arange(0, BLOCK_M)
    pos_m = pos0 + offs_r
    pi_m = _ids(pos_m, M, ml, MASK)

    q_base = Q + q_row0 * stride_qm + h * stride_qh
    k_base = K + start * stride_km + h * stride_kh
    v_base = V + start * stride_vm + h * stride_vh
    q_src = _rows(q_base, nq, DQ, stride_qm, BLOCK_M, BLOCK_DQ, TMA)
    K_src = _rows(k_base, n, DQ, stride_km, BLOCK_N, BLOCK_DQ, TMA)
    V_src = _rows(v_base, n, DV, stride_vm, BLOCK_N, BLOCK_DV, TMA)
    q = _load_rows(q_src, r0, nq, DQ, stride_qm, stride_qd, True, EVEN_DQ, TMA, BLOCK_M, BLOCK_DQ)
    if DELTA:  # query rows before the sequence start (n_b < D) contribute nothing
        q = tl.where((pos_m >= 0)[:, None], q, tl.zeros_like(q))
    if Q_IN_REGS:
        # q * 1.0 (a runtime one, exact): q becomes a register operand, so S = Q K^T's wgmma reads only K
        # from shared memory (with Q in shared memory, BLOCK_N <= 64 tiles are shared-memory bound).
        q = (q.to(tl.float32) * one).to(q.dtype)

    RB = _bias_operands(RAB, TS, POSW, TSW, NB, MAX_N, b, h, start, n, stride_rb, stride_rh, stride_ri, stride_rj,
                        TSB, TSP, HAS_RAB, HAS_POS, HAS_TS, TAB_HEADS)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_IV:  # intervals replace the HSTU mask: every visited tile is masked, invisible tiles skipped
        x0, x1, x2 = _iv_rows(IV + h.to(tl.int64) * stride_ih, start + r0, tl.arange(0, BLOCK_M), n - r0,
                              stride_ir, stride_ic)
        a, b2, e = _iv_key_range(x0, x1, x2, n, BLOCK_N)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, 0, a, pos_m, pos0 + r0, pi_m,
                         n, M, ml, alpha, DQ, DV, RB, x0, x1, x2, True,
                         MASK, TMA, FAST, PREC, EVEN_DQ, EVEN_DV,
                         BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, b2, e, pos_m, pos0 + r0, pi_m,
                         n, M, ml, alpha, DQ, DV, RB, x0, x1, x2, True,
                         MASK, TMA, FAST, PREC, EVEN_DQ, EVEN_DV,
                         BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
    else:
        m_first = tl.maximum(pos0 + r0, 0)
        m_last = tl.minimum(pos0 + r0 + BLOCK_M, n) - 1
        a, fs, fe, e = _fwd_key_range(m_first, m_last, n, M, ml, BLOCK_N, MASK)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, a, fs, pos_m, pos0 + r0, pi_m,
                         n, M, ml, alpha, DQ, DV, RB, pos_m, pos_m,
                         pos_m, True, MASK, TMA, FAST, PREC, EVEN_DQ,
                         EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, fs, fe, pos_m, pos0 + r0, pi_m,
                         n, M, ml, alpha, DQ, DV, RB, pos_m, pos_m,
                         pos_m, False, MASK, TMA, FAST, PREC, EVEN_DQ,
                         EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, fe, e, pos_m, pos0 + r0, pi_m,
                         n, M, ml, alpha, DQ, DV, RB, pos_m, pos_m,
                         pos_m, True, MASK, TMA, FAST, PREC, EVEN_DQ,
                         EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)

    if SCALE_MODE == 0:
        acc = acc * scale_const
    elif SCALE_MODE == 1:
        acc = acc * tl.load(ATTN_SCALE).to(tl.float32)
    else:
        sc = tl.load(ATTN_SCALE + (q_row0 + offs_r) * stride_sm, mask=offs_r < nq, other=0.0).to(tl.float32)
        acc = acc * sc[:, None]
    out = acc.to(O.dtype.element_ty)
    o_base = O + q_row0 * stride_om + h * stride_oh
    _store_rows(_rows(o_base, nq, DV, stride_om, BLOCK_M, BLOCK_DV, TMA), r0, out, nq, DV, stride_om, stride_od, TMA,
                BLOCK_M, BLOCK_DV)
