"""The jagged HSTU attention backward kernels: dK/dV (one program per key block, walking the query blocks
that see it; dQ optionally through fp32 atomics, then :func:`_dq_finalize_kernel`) and the deterministic
dQ kernel (one program per query block, walking key blocks, no atomics).
Host side (which algorithm, launch, autotuning, arguments): attention.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_jit import (_CONTEXT, _bias_grad, _bias_operands, _bwd_query_range, _fwd_key_range, _id_end, _ids,
                            _iv_key_range, _iv_rows, _iv_valid, _load_rows, _pre_silu, _row_tile_mask, _rows,
                            _seq_bounds, _silu_and_grad, _silu_bwd_packed, _store_rows, _tile, _valid)


# --------------------------------------------------------------------------------------------
# Backward: dK, dV (+ dQ through atomics)
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_step(dk, dv, k, v, Q_src, DO_src, DQ_dst, S_base, stride_qm, stride_qd, stride_dom, stride_dod,
                   stride_dqm, stride_sm, start_m, offs_n, n0, pi_n, n, M, ml, alpha, DQ, DV,
                   RB, GB, x0, x1, x2,
                   MASKED: tl.constexpr, MASK: tl.constexpr, SCALE_MODE: tl.constexpr,
                   TMA: tl.constexpr, DQ_MODE: tl.constexpr, FAST: tl.constexpr, PREC: tl.constexpr,
                   EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
                   HAS_RAB: tl.constexpr, RAB_GRAD: tl.constexpr, HAS_IV: tl.constexpr,
                   HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, TAB_GRAD: tl.constexpr, TS_STEPS: tl.constexpr):
    """One query block [start_m, start_m + BLOCK_M) against the key block of this program."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, BLOCK_DQ)
    q = _load_rows(Q_src, start_m, n, DQ, stride_qm, stride_qd, MASKED, EVEN_DQ, TMA, BLOCK_M, BLOCK_DQ)
    do = _load_rows(DO_src, start_m, n, DV, stride_dom, stride_dod, MASKED, EVEN_DV, TMA, BLOCK_M, BLOCK_DV)
    if SCALE_MODE == 2:
        sc = tl.load(S_base + offs_m * stride_sm, mask=offs_m < n, other=0.0).to(tl.float32)
        do = (do.to(tl.float32) * sc[:, None]).to(q.dtype)
    s_t = tl.dot(k, tl.trans(q), input_precision=PREC)  # [BLOCK_N, BLOCK_M]
    if HAS_POS and HAS_TS:
        # both tables: the bias before dP, so that its temporaries and dP's accumulator are not live at once
        # (fewer spills at the register cap; faster at both configs measured, though it no longer overlaps dP's
        # MMA; with one table the overlap wins: benchmarks/RESULTS.md, 2026-11-29)
        s_t, a, bk = _pre_silu(s_t, alpha, RB, offs_m, offs_n, start_m, n0, n, HAS_RAB, HAS_POS, HAS_TS,
                               TS_STEPS, True)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
    else:
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        s_t, a, bk = _pre_silu(s_t, alpha, RB, offs_m, offs_n, start_m, n0, n, HAS_RAB, HAS_POS, HAS_TS,
                               TS_STEPS, True)
    if FAST == 2:
        p16, ds16 = _silu_bwd_packed((s_t * (0.5 * a)).to(q.dtype), dp_t.to(q.dtype))
    else:
        p_t, dsilu_t = _silu_and_grad(s_t, a, FAST)
        p16 = p_t.to(q.dtype)
        ds16 = (dp_t * dsilu_t).to(q.dtype)
    if MASKED:
        if HAS_IV:
            ok = _iv_valid(offs_m[None, :], offs_n[:, None], x0[None, :], x1[None, :], x2[None, :], n)
        else:
            pi_m = _ids(offs_m, M, ml, MASK)
            ok = _valid(offs_m[None, :], offs_n[:, None], pi_m[None, :], pi_n[:, None], n, M, ml, MASK)
        p16 = tl.where(ok, p16, 0.0)
        ds16 = tl.where(ok, ds16, 0.0)
    if RAB_GRAD != 0:
        # bias gradients are dS_pre (per-row scales are already in dO; GB carries a scalar scale)
        _bias_grad(ds16, bk, GB, offs_m, offs_n, start_m, n, RAB_GRAD, False, HAS_POS, HAS_TS, BLOCK_M,
                   ds16.shape[0])
    dv = tl.dot(p16, do, dv, input_precision=PREC)
    dk = tl.dot(ds16, q, dk, input_precision=PREC)
    if TAB_GRAD:  # after the dots: fewer values live across the reductions (spills 3.0 -> 2.8 KB, sm90)
        _bias_grad(ds16, bk, GB, offs_m, offs_n, start_m, n, 0, TAB_GRAD, HAS_POS, HAS_TS, BLOCK_M, ds16.shape[0])
    if DQ_MODE == 1:
        dq = tl.dot(tl.trans(ds16), k, input_precision=PREC)
        # 32-bit offsets from the (sequence, head) base: 64-bit per-element pointers cost registers
        dq_off = offs_m[:, None] * stride_dqm + offs_dq[None, :]
        tl.atomic_add(DQ_dst + dq_off, dq, mask=(offs_m[:, None] < n) & (offs_dq[None, :] < DQ),
                      sem="relaxed")
    elif DQ_MODE == 3:  # vectorized fp32 reduction, two adjacent columns per instruction (sm90)
        dq = tl.dot(tl.trans(ds16), k, input_precision=PREC)
        dq_off = offs_m[:, None] * stride_dqm + offs_dq[None, :]
        row_ok = ((offs_m[:, None] < n) & (offs_dq[None, :] < DQ)).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $4, 0; @p red.relaxed.gpu.global.add.v2.f32 [$2], {$6, $7}; "
            "mov.b32 $0, 0; mov.b32 $1, 0; }",
            "=r,=r,l,l,r,r,r,r", [(DQ_dst + dq_off).to(tl.int64), row_ok, dq], dtype=tl.int32,
            is_pure=False, pack=2)
    elif DQ_MODE == 2:
        dq = tl.dot(tl.trans(ds16), k, input_precision=PREC)
        DQ_dst.atomic_add([start_m, 0], dq)
    return dk, dv


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q_src, DO_src, DQ_dst, S_base, stride_qm, stride_qd, stride_dom, stride_dod,
                    stride_dqm, stride_sm, lo, hi, offs_n, pi_n, n, M, ml, alpha, DQ, DV,
                    RB, GB, IV_h, stride_ir, stride_ic,
                    n0, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MASK: tl.constexpr, SCALE_MODE: tl.constexpr,
                    TMA: tl.constexpr, DQ_MODE: tl.constexpr, FAST: tl.constexpr, PREC: tl.constexpr,
                    EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
                    HAS_RAB: tl.constexpr, RAB_GRAD: tl.constexpr, HAS_IV: tl.constexpr,
                    HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, TAB_GRAD: tl.constexpr, TS_STEPS: tl.constexpr):
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        if HAS_IV:
            # skip query blocks none of whose rows sees a key of this block (intervals from IV_h rows)
            x0, x1, x2 = _iv_rows(IV_h, start_m, offs_m0, n - start_m, stride_ir, stride_ic)
            key_hi = tl.minimum(n0 + BLOCK_N, n)
            row_hit = (x0 > n0) | (tl.maximum(x1, n0) < tl.minimum(x2, key_hi))
            if tl.max(row_hit.to(tl.int32), axis=0) > 0:
                dk, dv = _bwd_dkdv_step(dk, dv, k, v, Q_src, DO_src, DQ_dst, S_base, stride_qm, stride_qd,
                                        stride_dom, stride_dod, stride_dqm, stride_sm, start_m, offs_n, n0, pi_n, n, M, ml, alpha, DQ, DV, RB, GB, x0, x1, x2, MASKED, MASK, SCALE_MODE, TMA, DQ_MODE, FAST, PREC, EVEN_DQ,
                                        EVEN_DV, BLOCK_M, BLOCK_DQ, BLOCK_DV, HAS_RAB, RAB_GRAD, HAS_IV, HAS_POS,
                                        HAS_TS, TAB_GRAD, TS_STEPS)
        else:
            dk, dv = _bwd_dkdv_step(dk, dv, k, v, Q_src, DO_src, DQ_dst, S_base, stride_qm, stride_qd, stride_dom,
                                    stride_dod, stride_dqm, stride_sm, start_m, offs_n, n0, pi_n, n, M, ml, alpha,
                                    DQ, DV, RB, GB,
                                    offs_m0, offs_m0, offs_m0, MASKED, MASK, SCALE_MODE, TMA, DQ_MODE, FAST, PREC, EVEN_DQ, EVEN_DV, BLOCK_M,
                                    BLOCK_DQ, BLOCK_DV, HAS_RAB, RAB_GRAD, HAS_IV, HAS_POS, HAS_TS, TAB_GRAD, TS_STEPS)
    return dk, dv


@triton.jit
def _hstu_bwd_dkdv_kernel(
    Q, K, V, DO, DQA, DK, DVo, SEQ_OFFSETS, NUM_TARGETS, ATTN_SCALE,
    stride_qm, stride_qh, stride_qd, stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
    stride_dom, stride_doh, stride_dod, stride_dqm, stride_dqh, stride_dkm, stride_dkh, stride_dvm, stride_dvh,
    stride_sm,
    alpha, scale_const,
    H, DQ, DV, ROWS, MAX_N, ML0, ML1, ML2, ML3, N_BUCKET,
    RAB, stride_rb, stride_rh, stride_ri, stride_rj, IV, stride_ih, stride_ir, stride_ic,
    DRAB, stride_gb, stride_gh, stride_gi, stride_gj,
    TS, POSW, TSW, NB, DPOS, DTS, TAB_COPIES, stride_pc, stride_tc, TSB, TSP,
    MASK: tl.constexpr, SCALE_MODE: tl.constexpr, TMA: tl.constexpr, DQ_MODE: tl.constexpr,
    FAST: tl.constexpr, PREC: tl.constexpr, EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEQ_MAJOR: tl.constexpr = True,
    HAS_RAB: tl.constexpr = False, RAB_GRAD: tl.constexpr = 0, HAS_IV: tl.constexpr = False,
    HAS_POS: tl.constexpr = False, HAS_TS: tl.constexpr = False, TAB_GRAD: tl.constexpr = False,
    TS_STEPS: tl.constexpr = 0, TAB_HEADS: tl.constexpr = 0,
):
    alpha, scale_const = tl.cast(alpha, tl.float32), tl.cast(scale_const, tl.float32)  # fp64 under Inductor
    ml = (ML0, ML1, ML2, ML3)  # the mask lengths (attention_jit reads them)
    # early key blocks are seen by the most query rows: launched first
    pid_bh, n_blk = _tile(MAX_N, BLOCK_N, False, SEQ_MAJOR)
    b = pid_bh // H
    h = pid_bh % H
    start, n = _seq_bounds(SEQ_OFFSETS, b, ROWS, MAX_N)
    n0 = n_blk * BLOCK_N
    if n0 >= n:
        return
    M = _id_end(n, b, NUM_TARGETS, ml, MASK)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    pi_n = _ids(offs_n, M, ml, MASK)

    q_base = Q + start * stride_qm + h * stride_qh
    k_base = K + start * stride_km + h * stride_kh
    v_base = V + start * stride_vm + h * stride_vh
    do_base = DO + start * stride_dom + h * stride_doh
    dk_base = DK + start * stride_dkm + h * stride_dkh
    dv_base = DVo + start * stride_dvm + h * stride_dvh
    if DQ_MODE != 0:
        dq_base = DQA + start * stride_dqm + h * stride_dqh
    else:
        dq_base = DQA
    if SCALE_MODE == 2:
        s_base = ATTN_SCALE + start * stride_sm
    else:
        s_base = ATTN_SCALE

    Q_src = _rows(q_base, n, DQ, stride_qm, BLOCK_M, BLOCK_DQ, TMA)
    DO_src = _rows(do_base, n, DV, stride_dom, BLOCK_M, BLOCK_DV, TMA)
    k_src = _rows(k_base, n, DQ, stride_km, BLOCK_N, BLOCK_DQ, TMA)
    v_src = _rows(v_base, n, DV, stride_vm, BLOCK_N, BLOCK_DV, TMA)
    k = _load_rows(k_src, n0, n, DQ, stride_km, stride_kd, True, EVEN_DQ, TMA, BLOCK_N, BLOCK_DQ)
    v = _load_rows(v_src, n0, n, DV, stride_vm, stride_vd, True, EVEN_DV, TMA, BLOCK_N, BLOCK_DV)
    DQ_dst = _rows(dq_base, n, DQ, stride_dqm, BLOCK_M, BLOCK_DQ, DQ_MODE == 2)  # TMA reduce-add target

    # gradient operands as a tuple; 0 stands for an absent (None) pointer (a tuple cannot hold None)
    DRAB_b = 0
    IV_h = IV
    DPOS_s = 0
    DTS_s = 0
    gsc = 1.0
    if RAB_GRAD != 0:
        DRAB_b = DRAB + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
    if TAB_GRAD:  # TAB_COPIES copies of the table gradients spread the atomics (summed on the host)
        slot = tl.program_id(0) % TAB_COPIES
        if HAS_POS:
            DPOS_s = DPOS + slot * stride_pc
            if TAB_HEADS % 2 == 1:  # [copies, H, 2N-1]
                DPOS_s += h.to(tl.int64) * (2 * MAX_N - 1)
        if HAS_TS:
            DTS_s = DTS + slot * stride_tc
            if TAB_HEADS >= 2:  # [copies, H, NB+1]
                DTS_s += h.to(tl.int64) * (NB + 1)
    if RAB_GRAD != 0 or TAB_GRAD:  # bias gradients leave the kernel scaled (rab-sized, no host pass)
        if SCALE_MODE == 0:
            gsc = scale_const
        elif SCALE_MODE == 1:
            gsc = tl.load(ATTN_SCALE).to(tl.float32)
    if HAS_IV:
        IV_h = IV + h.to(tl.int64) * stride_ih + start * stride_ir
    RB = _bias_operands(RAB, TS, POSW, TSW, NB, MAX_N, b, h, start, n, stride_rb, stride_rh, stride_ri, stride_rj,
                        TSB, TSP, HAS_RAB, HAS_POS, HAS_TS, TAB_HEADS)
    GB = (DRAB_b, stride_gi, stride_gj, DPOS_s, DTS_s, gsc, MAX_N)
    dk = tl.zeros([BLOCK_N, BLOCK_DQ], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # Query-row segments (_bwd_query_range): [0, cb) contextual rows (masked), [qa, qf) masked, [qf, qe)
    # full, [qe, qz) masked. Intervals: one masked segment over all rows, each block skipped unless one
    # of its rows sees this key block.
    if HAS_IV:
        cb, qa, qf, qe, qz = n * 0, n * 0, n, n, n
    else:
        cb, qa, qf, qe, qz = _bwd_query_range(n0, n, M, ml, BLOCK_M, BLOCK_N, MASK)
    for seg in tl.static_range(4):
        if (seg == 0 and (_CONTEXT & MASK) != 0 and not HAS_IV) or seg == 1 or (seg >= 2 and not HAS_IV):
            if seg == 0:
                lo, hi = cb * 0, cb
            elif seg == 1:
                lo, hi = qa, qf
            elif seg == 2:
                lo, hi = qf, qe
            else:
                lo, hi = qe, qz
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_src, DO_src, DQ_dst, s_base, stride_qm, stride_qd, stride_dom,
                                     stride_dod, stride_dqm, stride_sm, lo, hi, offs_n, pi_n, n, M, ml, alpha, DQ, DV, RB, GB, IV_h, stride_ir, stride_ic, n0, BLOCK_N,
                                     seg != 2, MASK, SCALE_MODE, TMA,
                                     DQ_MODE, FAST, PREC, EVEN_DQ, EVEN_DV, BLOCK_M, BLOCK_DQ, BLOCK_DV, HAS_RAB,
                                     RAB_GRAD, HAS_IV, HAS_POS, HAS_TS, TAB_GRAD, TS_STEPS)

    if SCALE_MODE == 0:
        sc = scale_const
    elif SCALE_MODE == 1:
        sc = tl.load(ATTN_SCALE).to(tl.float32)
    else:
        sc = 1.0
    dk = (dk * (alpha * sc)).to(DK.dtype.element_ty)
    dv = (dv * sc).to(DVo.dtype.element_ty)
    dk_dst = _rows(dk_base, n, DQ, stride_dkm, BLOCK_N, BLOCK_DQ, TMA)
    dv_dst = _rows(dv_base, n, DV, stride_dvm, BLOCK_N, BLOCK_DV, TMA)
    _store_rows(dk_dst, n0, dk, n, DQ, stride_dkm, 1, TMA, BLOCK_N, BLOCK_DQ)
    _store_rows(dv_dst, n0, dv, n, DV, stride_dvm, 1, TMA, BLOCK_N, BLOCK_DV)


# --------------------------------------------------------------------------------------------
# Backward: deterministic dQ (one program per query block, walks key blocks, no atomics)
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, lo, hi, pos_m, i0, pi_m,
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
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        s, a, bk = _pre_silu(s, alpha, RB, pos_m, offs_n, i0, start_n, n, HAS_RAB, HAS_POS, HAS_TS, TS_STEPS,
                             False)
        if FAST == 2:
            _, ds = _silu_bwd_packed((s * (0.5 * a)).to(k.dtype), dp.to(k.dtype))
        else:
            _, dsilu = _silu_and_grad(s, a, FAST)
            ds = (dp * dsilu).to(k.dtype)
        if MASKED:
            ok = _row_tile_mask(pos_m, offs_n, pi_m, x0, x1, x2, n, M, ml, MASK, HAS_IV)
            ds = tl.where(ok, ds, 0.0)
        dq = tl.dot(ds, k, dq, input_precision=PREC)
    return dq


@triton.jit
def _hstu_bwd_dq_kernel(
    Q, K, V, DO, DQo, SEQ_OFFSETS, NUM_TARGETS, ATTN_SCALE,
    stride_qm, stride_qh, stride_qd, stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
    stride_dom, stride_doh, stride_dod, stride_dqm, stride_dqh, stride_sm,
    alpha, scale_const, one,
    H, DQ, DV, ROWS, MAX_N, ML0, ML1, ML2, ML3, N_BUCKET,
    RAB, stride_rb, stride_rh, stride_ri, stride_rj, IV, stride_ih, stride_ir, stride_ic,
    TS, POSW, TSW, NB, TSB, TSP,
    MASK: tl.constexpr, SCALE_MODE: tl.constexpr, TMA: tl.constexpr,
    FAST: tl.constexpr, PREC: tl.constexpr, EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEQ_MAJOR: tl.constexpr = True, Q_IN_REGS: tl.constexpr = False,
    HAS_RAB: tl.constexpr = False, HAS_IV: tl.constexpr = False,
    HAS_POS: tl.constexpr = False, HAS_TS: tl.constexpr = False, TS_STEPS: tl.constexpr = 0,
    TAB_HEADS: tl.constexpr = 0,
):
    # fp64 under Inductor: see the forward kernel
    alpha, scale_const, one = tl.cast(alpha, tl.float32), tl.cast(scale_const, tl.float32), tl.cast(one, tl.float32)
    ml = (ML0, ML1, ML2, ML3)  # the mask lengths (attention_jit reads them)
    pid_bh, m_blk = _tile(MAX_N, BLOCK_M, True, SEQ_MAJOR)
    b = pid_bh // H
    h = pid_bh % H
    start, n = _seq_bounds(SEQ_OFFSETS, b, ROWS, MAX_N)
    r0 = m_blk * BLOCK_M
    if r0 >= n:
        return
    M = _id_end(n, b, NUM_TARGETS, ml, MASK)
    offs_r = r0 + tl.arange(0, BLOCK_M)
    pi_m = _ids(offs_r, M, ml, MASK)

    q_base = Q + start * stride_qm + h * stride_qh
    k_base = K + start * stride_km + h * stride_kh
    v_base = V + start * stride_vm + h * stride_vh
    do_base = DO + start * stride_dom + h * stride_doh
    q_src = _rows(q_base, n, DQ, stride_qm, BLOCK_M, BLOCK_DQ, TMA)
    do_src = _rows(do_base, n, DV, stride_dom, BLOCK_M, BLOCK_DV, TMA)
    K_src = _rows(k_base, n, DQ, stride_km, BLOCK_N, BLOCK_DQ, TMA)
    V_src = _rows(v_base, n, DV, stride_vm, BLOCK_N, BLOCK_DV, TMA)
    q = _load_rows(q_src, r0, n, DQ, stride_qm, stride_qd, True, EVEN_DQ, TMA, BLOCK_M, BLOCK_DQ)
    do = _load_rows(do_src, r0, n, DV, stride_dom, stride_dod, True, EVEN_DV, TMA, BLOCK_M, BLOCK_DV)
    if SCALE_MODE == 2:
        sc_rows = tl.load(ATTN_SCALE + (start + offs_r) * stride_sm, mask=offs_r < n, other=0.0).to(tl.float32)
        do = (do.to(tl.float32) * sc_rows[:, None]).to(q.dtype)
    if Q_IN_REGS:  # register A operands for S = Q K^T and dP = dO V^T (see the forward kernel)
        q = (q.to(tl.float32) * one).to(q.dtype)
        if SCALE_MODE != 2:
            do = (do.to(tl.float32) * one).to(q.dtype)

    RB = _bias_operands(RAB, TS, POSW, TSW, NB, MAX_N, b, h, start, n, stride_rb, stride_rh, stride_ri, stride_rj,
                        TSB, TSP, HAS_RAB, HAS_POS, HAS_TS, TAB_HEADS)
    dq = tl.zeros([BLOCK_M, BLOCK_DQ], dtype=tl.float32)
    if HAS_IV:  # as in the forward kernel
        x0, x1, x2 = _iv_rows(IV + h.to(tl.int64) * stride_ih, start + r0, tl.arange(0, BLOCK_M), n - r0,
                              stride_ir, stride_ic)
        a, b2, e = _iv_key_range(x0, x1, x2, n, BLOCK_N)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, 0, a, offs_r, r0, pi_m,
                           n, M, ml, alpha, DQ, DV, RB, x0, x1, x2, True,
                           MASK, TMA, FAST, PREC, EVEN_DQ, EVEN_DV,
                           BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, b2, e, offs_r, r0, pi_m,
                           n, M, ml, alpha, DQ, DV, RB, x0, x1, x2, True,
                           MASK, TMA, FAST, PREC, EVEN_DQ, EVEN_DV,
                           BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
    else:
        m_last = tl.minimum(r0 + BLOCK_M, n) - 1
        a, fs, fe, e = _fwd_key_range(r0, m_last, n, M, ml, BLOCK_N, MASK)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, a, fs, offs_r, r0, pi_m,
                           n, M, ml, alpha, DQ, DV, RB, offs_r, offs_r,
                           offs_r, True, MASK, TMA, FAST, PREC, EVEN_DQ,
                           EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, fs, fe, offs_r, r0, pi_m,
                           n, M, ml, alpha, DQ, DV, RB, offs_r, offs_r,
                           offs_r, False, MASK, TMA, FAST, PREC, EVEN_DQ,
                           EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, fe, e, offs_r, r0, pi_m,
                           n, M, ml, alpha, DQ, DV, RB, offs_r, offs_r,
                           offs_r, True, MASK, TMA, FAST, PREC, EVEN_DQ,
                           EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
    if SCALE_MODE == 0:
        sc = scale_const
    elif SCALE_MODE == 1:
        sc = tl.load(ATTN_SCALE).to(tl.float32)
    else:
        sc = 1.0
    out = (dq * (alpha * sc)).to(DQo.dtype.element_ty)
    dq_base = DQo + start * stride_dqm + h * stride_dqh
    _store_rows(_rows(dq_base, n, DQ, stride_dqm, BLOCK_M, BLOCK_DQ, TMA), r0, out, n, DQ, stride_dqm, 1, TMA,
                BLOCK_M, BLOCK_DQ)


@triton.jit
def _dq_finalize_kernel(DQA, DQo, ATTN_SCALE, numel, factor, SCALE_MODE: tl.constexpr, BLOCK: tl.constexpr):
    """dq = dq_acc * factor (* attn_scale when it is a 0-d tensor), cast to the output dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(DQA + offs, mask=mask, other=0.0) * tl.cast(factor, tl.float32)  # fp64 under Inductor
    if SCALE_MODE == 1:
        x = x * tl.load(ATTN_SCALE).to(tl.float32)
    tl.store(DQo + offs, x.to(DQo.dtype.element_ty), mask=mask)
