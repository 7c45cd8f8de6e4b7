"""Warp-specialised Hopper (sm90) backward of jagged HSTU attention, written in Gluon.

Gradients of ``out_i = (1/N) sum_j valid(i, j) silu(alpha <q_i, k_j>) v_j`` (causal, optional targets, D = 128,
16-bit inputs; the scope of ``gluon_attention.gluon_forward``). HSTU has no softmax, so there are no row statistics
and no ``rowsum(dO * O)`` pre-pass: with ``S = Q K^T``, ``dP = dO V^T``, ``P = silu(alpha S)``,
``dS = dP * silu'(alpha S)`` (masked),

    dV = (1/N) P^T dO        dK = (alpha/N) dS^T Q        dQ = (alpha/N) dS K

computed as ``attention._hstu_bwd_dkdv_kernel`` + ``attention._hstu_bwd_dq_kernel`` do (the "split" algorithm:
deterministic, no atomics): P and dS rounded to the input dtype before their GEMMs, fp32 accumulation, the
scales applied once at the end, silu in the tanh.approx form (``attention._silu_and_grad(FAST=1)``).

Two persistent kernels with the forward's skeleton (``gluon_attention._hstu_fwd_ws_persistent_kernel``): one CTA
per SM takes work items from a global counter (the producer fetches them and passes them on through a 2-slot
ring, ``gluon_attention._post_item`` / ``_get_item``), three ``gl.warp_specialize`` partitions:

* producer (1 warp, 24 registers): per item, the two warpgroups' *resident* tiles (2 x 64 rows of two operands,
  double-buffered across items), then the *stream* tiles of the item into two rings (one per operand);
* two consumer warpgroups (240 registers each), each owning 64 resident rows; optionally ping-pong ordered GEMM
  issue (turn barriers), so one warpgroup's silu backward overlaps the other's wgmmas.

dK/dV kernel (``_hstu_bwd_dkdv_ws_kernel``): item = (sequence, head, 128 keys), the first key block (seen by the
most queries) of each (sequence, head) first. Resident: K and V of the warpgroup's 64 keys. Stream: (Q, dO) tiles
of 64 query rows, from the block's first row to the end of the sequence (``_bwd_query_range`` for this mask).
Per tile: ``S^T = K Q^T``, ``dP^T = V dO^T`` (wgmma from shared memory), ``P^T``, ``dS^T`` elementwise (mask only
on the diagonal tile, the sequence's partial last tile and key blocks holding target keys), ``dV += P^T dO``,
``dK += dS^T Q`` (A operands from registers). Warpgroup 1 skips the block's first query tile (all rows before its
keys). Epilogue: dK, dV staged in the warpgroup's own K and V tiles, TMA store (masked rows at the sequence end).

dQ kernel (``_hstu_bwd_dq_ws_kernel``): item = (sequence, head, 128 query rows), the last (heaviest) first.
Resident: Q and dO of the warpgroup's 64 rows. Stream: (K, V) tiles of ``BLOCK_N`` keys up to the block's last
row. Per tile ``S = Q K^T``, ``dP = dO V^T``, ``dS``, ``dQ += dS K`` (one K tile serves both as K^T and K). With
``OVERLAP`` the GEMMs of tile t are issued together with ``dQ += dS_{t-1} K_{t-1}``, and the silu backward of
tile t runs while that last one is in flight (the forward's intra-warpgroup overlap). Epilogue: dQ staged in the
warpgroup's Q tile.

Loads past a sequence read the next sequence's rows (or zeros past L): such keys are masked in dQ (``j < n``),
such query rows are masked in dK/dV (``i < n``); rows past the end are never stored.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import new_tensor
from .fastlaunch import launch
from .gluon_attention import (
    _check,
    _desc_2d,
    _get_item,
    _item,
    _load_k,
    _mask_tile,
    _scheduling,
    _smem_layout,
    _pass_tiles,
    _post_item,
    _store_rows,
    _tanh_approx,
    gluon_supported,
)

__all__ = ["gluon_backward", "gluon_supported", "GLUON_BWD_CONFIG", "BWD_VARIANTS"]

GLUON_BWD_CONFIG = dict(
    BLOCK_N=64,          # dQ kernel: keys per stream tile
    DQ_KSTAGES=3,        # dQ kernel: K ring depth (with OVERLAP a K tile is held one tile longer than its V)
    DQ_VSTAGES=2,        # dQ kernel: V ring depth
    KV_STAGES=2,         # dK/dV kernel: depth of the Q and dO rings
    PINGPONG=True,       # order the two consumer warpgroups' GEMM issue with the turn barriers (both kernels)
    OVERLAP=True,        # dQ kernel: silu backward of tile t under dQ += dS_{t-1} K_{t-1}
    DQ_REGS=False,       # dQ kernel: Q and dO as register A operands of S and dP (half the shared-memory operand
                         # traffic of those wgmmas, 64 more registers)
    DYNAMIC=True,        # items from a global counter (False: strided over the CTAs)
    CONSUMER_REGS=240,
    PRODUCER_REGS=24,
    MAXNREG=168,         # 65536 / (12 warps * 32)
    RUN="both",          # "dkdv" / "dq": launch only that kernel (timing probes; the other gradients stay empty)
)

# Named overrides of GLUON_BWD_CONFIG (benchmarks/gluon_backward.py, scripts/gluon_bwd_smoke.py): the variants
# measured on the H100; RUN times one kernel alone.
BWD_VARIANTS = {
    "default": {},
    "nopp": dict(PINGPONG=False),
    "nooverlap": dict(OVERLAP=False),
    "nopp_nooverlap": dict(PINGPONG=False, OVERLAP=False),
    "static": dict(DYNAMIC=False),
    "kv3": dict(KV_STAGES=3),
    "dq_k2v2": dict(DQ_KSTAGES=2, DQ_VSTAGES=2),
    "dq_k3v3": dict(DQ_KSTAGES=3, DQ_VSTAGES=3),
    "dq_regs": dict(DQ_REGS=True),
    "dq_regs_noovl": dict(DQ_REGS=True, OVERLAP=False),
    "dkdv_only": dict(RUN="dkdv"),
    "dq_only": dict(RUN="dq"),
    "dkdv_only_nopp": dict(RUN="dkdv", PINGPONG=False),
    "dq_only_nopp": dict(RUN="dq", PINGPONG=False),
}

BLOCK_M: int = 64  # rows per consumer warpgroup (resident tiles) and query rows per dK/dV stream tile


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


@gluon.jit
def _silu_bwd(s, dp, half_alpha):
    """(silu(alpha s), dp * silu'(alpha s)) with one MUFU op: hx = alpha s / 2, t = tanh(hx), sig = (1 + t) / 2,
    silu = hx + hx t, silu' = sig + silu (1 - sig) (the Triton kernels' ``_silu_and_grad(FAST=1)``)."""
    hx = s * half_alpha
    t = _tanh_approx(hx)
    sig = 0.5 + 0.5 * t
    y = hx + hx * t
    return y, dp * (sig + y * (1.0 - sig))


@gluon.jit
def _kv_item(w, n_blocks, H, SEQ_OFFSETS, NUM_TARGETS, ROWS, MAX_N, CTA_M: gl.constexpr, D: gl.constexpr,
             HAS_TGT: gl.constexpr):
    """dK/dV work item w: key block ``blk`` of one (sequence, head), the first (most queries) first. Returns
    (start, n, M, r0, n_tiles, col): keys [r0, r0 + CTA_M), query tiles of CTA_M // 2 rows from r0 to n."""
    BQ: gl.constexpr = CTA_M // 2
    bh = w // n_blocks
    blk = w % n_blocks
    b = bh // H
    h = bh % H
    start = gl.load(SEQ_OFFSETS + b).to(gl.int32)
    end = gl.load(SEQ_OFFSETS + b + 1).to(gl.int32)
    start = gl.minimum(gl.maximum(start, 0), ROWS)
    end = gl.minimum(gl.maximum(end, start), ROWS)
    n = gl.minimum(end - start, MAX_N)
    if HAS_TGT:
        M = n - gl.minimum(gl.maximum(gl.load(NUM_TARGETS + b).to(gl.int32), 0), n)
    else:
        M = n
    r0 = blk * CTA_M
    n_tiles = (n - r0 + BQ - 1) // BQ
    return start, n, M, r0, n_tiles, h * D


@gluon.jit
def _bwd_item(w, n_blocks, H, SEQ_OFFSETS, NUM_TARGETS, ROWS, MAX_N, CTA_M: gl.constexpr, BLOCK_S: gl.constexpr,
              D: gl.constexpr, HAS_TGT: gl.constexpr, KEY_MAJOR: gl.constexpr):
    """(start, n, M, r0, n_tiles, col, s0): resident rows [r0, r0 + CTA_M), stream tiles of BLOCK_S rows from s0."""
    if KEY_MAJOR:
        start, n, M, r0, n_tiles, col = _kv_item(w, n_blocks, H, SEQ_OFFSETS, NUM_TARGETS, ROWS, MAX_N, CTA_M, D,
                                                 HAS_TGT)
        s0 = r0
    else:
        start, n, M, r0, n_tiles, col = _item(w, n_blocks, H, SEQ_OFFSETS, NUM_TARGETS, ROWS, MAX_N, CTA_M,
                                              BLOCK_S, D, HAS_TGT)
        s0 = r0 * 0
    return start, n, M, r0, n_tiles, col, s0


@gluon.jit
def _bwd_producer(a_desc, b_desc, x_desc, y_desc, a_smem, b_smem, x_smem, y_smem, res_ready, res_empty,
                  x_ready, x_empty, y_ready, y_empty, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items, sched,
                  BLOCK_S: gl.constexpr, HAS_TGT: gl.constexpr, DYNAMIC: gl.constexpr, KEY_MAJOR: gl.constexpr):
    """Per item: resident tiles A, B (rows r0 and r0 + 64 of each, one barrier, buffer i % 2), then stream tiles
    X_t, Y_t (rows s0 + t * BLOCK_S) into their rings; ring counter c continues across items."""
    D: gl.constexpr = a_desc.block_type.shape[1]
    RM: gl.constexpr = a_desc.block_type.shape[0]
    CTA_M: gl.constexpr = 2 * RM
    n_blocks = N_BLOCKS
    c = 0
    i = 0
    j = 0
    if DYNAMIC:
        w = gl.atomic_add(sched[0], 1)
    else:
        w = gl.program_id(0)
    while w < n_items:
        if DYNAMIC:
            _post_item(sched, j, w)
        j += 1
        start, n, M, r0, n_tiles, col, s0 = _bwd_item(w, n_blocks, H, SEQ_OFFSETS, NUM_TARGETS, ROWS, MAX_N, CTA_M,
                                                      BLOCK_S, D, HAS_TGT, KEY_MAJOR)
        if r0 < n:
            rb = i % 2
            mbarrier.wait(res_empty.index(rb), ((i // 2) & 1) ^ 1)
            mbarrier.expect(res_ready.index(rb), 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [start + r0, col], res_ready.index(rb), a_smem.index(2 * rb))
            tma.async_copy_global_to_shared(b_desc, [start + r0, col], res_ready.index(rb), b_smem.index(2 * rb))
            tma.async_copy_global_to_shared(a_desc, [start + r0 + RM, col], res_ready.index(rb),
                                            a_smem.index(2 * rb + 1))
            tma.async_copy_global_to_shared(b_desc, [start + r0 + RM, col], res_ready.index(rb),
                                            b_smem.index(2 * rb + 1))
            for t in range(n_tiles):
                row = start + s0 + t * BLOCK_S
                _load_k(x_desc, x_smem, x_ready, x_empty, c, row, col, BLOCK_S)
                _load_k(y_desc, y_smem, y_ready, y_empty, c, row, col, BLOCK_S)
                c += 1
            i += 1
        if DYNAMIC:
            w = gl.atomic_add(sched[0], 1)
        else:
            w += gl.num_programs(0)
    if DYNAMIC:  # the end marker for the consumers
        _post_item(sched, j, w)


@gluon.jit
def _release_res(res_empty, rb):
    """The warpgroup is done with its resident tiles of buffer rb (and their output staging has been read by the
    TMA store): generic-proxy writes ordered before the producer's next TMA load, then one arrival."""
    tma.store_wait(0)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(res_empty.index(rb), count=1)


# --------------------------------------------------------------------------------------------
# dQ kernel: per warpgroup 64 query rows, K/V tiles streamed
# --------------------------------------------------------------------------------------------


@gluon.jit
def _dq_tiles(q, do, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn_me, turn_other, c0, tph, m0, n, M,
              n_all, half_alpha, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, REGS: gl.constexpr):
    """One warpgroup's rows [m0, m0 + BLOCK_M) against key tiles 0 .. n_all - 1 (ring slots c0, c0 + 1, ...).
    Returns the unscaled fp32 dQ accumulator and the turn parity."""
    dtype: gl.constexpr = q.dtype
    KS: gl.constexpr = k_smem.shape[0]
    VS: gl.constexpr = v_smem.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if HAS_TGT:
        pi_rows = gl.minimum(rows, M)
        P0 = gl.minimum(m0, M)
    else:
        pi_rows = rows
        P0 = m0
    # tiles past the one holding this warpgroup's last row are invisible to it (passed on); tiles [0, fe) are
    # visible to every row (keys with id < the first row's id)
    n_tiles = gl.minimum(n_all, (m0 + BLOCK_M - 1) // BLOCK_N + 1)
    fe = gl.minimum(P0 // BLOCK_N, n_tiles)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    if REGS:  # register A operands (loaded once per item)
        q = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        do = do.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))

    # ---- tile 0: S_0, dP_0, dS_0
    ks = c0 % KS
    vs = c0 % VS
    mbarrier.wait(k_ready.index(ks), (c0 // KS) & 1)
    mbarrier.wait(v_ready.index(vs), (c0 // VS) & 1)
    if PINGPONG:
        mbarrier.wait(turn_me, tph)
    s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, v_smem.index(vs).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_other, count=1)
        tph ^= 1
    s_acc, dp_acc = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
    gl.thread_barrier()
    mbarrier.arrive(v_empty.index(vs), count=1)
    _, ds = _silu_bwd(s_acc, dp_acc, half_alpha)
    if fe <= 0:
        ds = _mask_tile(ds, 0, rows, pi_rows, cols0, n, M, BLOCK_N, HAS_TGT)
    ds16 = gl.convert_layout(ds.to(dtype), a_layout)
    if not OVERLAP:
        acc = warpgroup_mma(ds16, k_smem.index(ks), acc, is_async=True)
        acc, ds16 = warpgroup_mma_wait(0, deps=(acc, ds16))
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(ks), count=1)

    for t in range(1, n_tiles):
        c = c0 + t
        ks = c % KS
        vs = c % VS
        kp = (c - 1) % KS
        mbarrier.wait(k_ready.index(ks), (c // KS) & 1)
        mbarrier.wait(v_ready.index(vs), (c // VS) & 1)
        if PINGPONG:
            mbarrier.wait(turn_me, tph)
        # use_acc=False: the previous S / dP (dead by now) only lend their registers
        s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_acc, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, v_smem.index(vs).permute((1, 0)), dp_acc, use_acc=False, is_async=True)
        if OVERLAP:
            acc = warpgroup_mma(ds16, k_smem.index(kp), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_other, count=1)
            tph ^= 1
        if OVERLAP:  # wgmma groups retire in order: one outstanding = S_t and dP_t done, dQ_{t-1} running
            s_acc, dp_acc = warpgroup_mma_wait(1, deps=(s_tok, dp_tok))
        else:
            s_acc, dp_acc = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
        gl.thread_barrier()
        mbarrier.arrive(v_empty.index(vs), count=1)
        _, ds = _silu_bwd(s_acc, dp_acc, half_alpha)
        if t >= fe:
            ds = _mask_tile(ds, t, rows, pi_rows, cols0, n, M, BLOCK_N, HAS_TGT)
        ds_next = gl.convert_layout(ds.to(dtype), a_layout)
        if OVERLAP:
            acc, ds16 = warpgroup_mma_wait(0, deps=(acc, ds16))
            gl.thread_barrier()
            mbarrier.arrive(k_empty.index(kp), count=1)
            ds16 = ds_next
        else:
            acc = warpgroup_mma(ds_next, k_smem.index(ks), acc, is_async=True)
            acc, ds16 = warpgroup_mma_wait(0, deps=(acc, ds_next))
            gl.thread_barrier()
            mbarrier.arrive(k_empty.index(ks), count=1)
    if OVERLAP:  # ---- the last dQ += dS K
        c = c0 + n_tiles - 1
        ks = c % KS
        acc = warpgroup_mma(ds16, k_smem.index(ks), acc, is_async=True)
        acc, ds16 = warpgroup_mma_wait(0, deps=(acc, ds16))
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(ks), count=1)
    # tiles invisible to this warpgroup: wait until loaded, release, keep the turn order
    tph = _pass_tiles(k_ready, k_empty, v_ready, v_empty, turn_me, turn_other, c0, n_tiles, n_all, tph,
                      KS, VS, PINGPONG)
    return acc, tph


@gluon.jit
def _dq_consumer(o_desc, q_smem, do_smem, k_smem, v_smem, res_ready, res_empty, k_ready, k_empty, v_ready, v_empty,
                 turn, O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items, half_alpha, out_scale, sched,
                 WG: gl.constexpr, BLOCK_N: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr,
                 OVERLAP: gl.constexpr, DYNAMIC: gl.constexpr, REGS: gl.constexpr):
    RM: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    CTA_M: gl.constexpr = 2 * RM
    n_blocks = N_BLOCKS
    c = 0
    i = 0
    j = 0
    tph = 1 - WG  # warpgroup 0 issues first
    if DYNAMIC:
        w = _get_item(sched, j)
    else:
        w = gl.program_id(0)
    while w < n_items:
        j += 1
        start, n, M, r0, n_tiles, col = _item(w, n_blocks, H, SEQ_OFFSETS, NUM_TARGETS, ROWS, MAX_N, CTA_M,
                                              BLOCK_N, D, HAS_TGT)
        if r0 < n:
            rb = i % 2
            m0 = r0 + WG * RM
            mbarrier.wait(res_ready.index(rb), (i // 2) & 1)
            q = q_smem.index(2 * rb + WG)
            acc, tph = _dq_tiles(q, do_smem.index(2 * rb + WG), k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                                 turn.index(WG), turn.index(1 - WG), c, tph, m0, n, M, n_tiles, half_alpha,
                                 RM, BLOCK_N, D, HAS_TGT, PINGPONG, OVERLAP, REGS)
            c += n_tiles
            i += 1
            # every wgmma reading q is complete (waits + thread barrier in _dq_tiles): q stages the output
            _store_rows((acc * out_scale).to(q_smem.dtype), q, o_desc, O, stride_om, col, start, m0, n, RM, D)
            _release_res(res_empty, rb)
        if DYNAMIC:
            w = _get_item(sched, j)
        else:
            w += gl.num_programs(0)


@gluon.jit
def _dq_consumer_default(o_desc, q_smem, do_smem, k_smem, v_smem, res_ready, res_empty, k_ready, k_empty, v_ready,
                         v_empty, turn, O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items, half_alpha,
                         out_scale, sched, BLOCK_N: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr,
                         OVERLAP: gl.constexpr, DYNAMIC: gl.constexpr, REGS: gl.constexpr):
    _dq_consumer(o_desc, q_smem, do_smem, k_smem, v_smem, res_ready, res_empty, k_ready, k_empty, v_ready, v_empty,
                 turn, O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items, half_alpha, out_scale, sched,
                 0, BLOCK_N, HAS_TGT, PINGPONG, OVERLAP, DYNAMIC, REGS)


@gluon.jit
def _dq_consumer_worker(o_desc, q_smem, do_smem, k_smem, v_smem, res_ready, res_empty, k_ready, k_empty, v_ready,
                        v_empty, turn, O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items, half_alpha,
                        out_scale, sched, BLOCK_N: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr,
                        OVERLAP: gl.constexpr, DYNAMIC: gl.constexpr, REGS: gl.constexpr):
    _dq_consumer(o_desc, q_smem, do_smem, k_smem, v_smem, res_ready, res_empty, k_ready, k_empty, v_ready, v_empty,
                 turn, O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items, half_alpha, out_scale, sched,
                 1, BLOCK_N, HAS_TGT, PINGPONG, OVERLAP, DYNAMIC, REGS)


@gluon.jit
def _hstu_bwd_dq_ws_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, DQ, SEQ_OFFSETS, NUM_TARGETS, COUNTER,
                           stride_om, H, ROWS, MAX_N, N_BLOCKS, n_items, half_alpha, out_scale,
                           HAS_TGT: gl.constexpr, BLOCK_N: gl.constexpr, KSTAGES: gl.constexpr,
                           VSTAGES: gl.constexpr, PINGPONG: gl.constexpr, OVERLAP: gl.constexpr,
                           DYNAMIC: gl.constexpr, REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr):
    RM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    # resident: [buffer, warpgroup] Q and dO; stream: K and V rings
    q_smem = gl.allocate_shared_memory(dtype, [4, RM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [4, RM, D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [KSTAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [VSTAGES, BLOCK_N, D], v_desc.layout)
    res_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    res_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [KSTAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [KSTAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [VSTAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [VSTAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(res_ready.index(i), count=1)
        mbarrier.init(res_empty.index(i), count=2)
        mbarrier.init(turn.index(i), count=1)
        mbarrier.init(item_ready.index(i), count=1)
        mbarrier.init(item_empty.index(i), count=2)
    for i in gl.static_range(KSTAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
    for i in gl.static_range(VSTAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_dq_consumer_default, (dq_desc, q_smem, do_smem, k_smem, v_smem, res_ready, res_empty, k_ready, k_empty,
                                v_ready, v_empty, turn, DQ, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N,
                                N_BLOCKS, n_items, half_alpha, out_scale, (COUNTER, item_smem, item_ready, item_empty),
                                BLOCK_N, HAS_TGT, PINGPONG, OVERLAP, DYNAMIC, REGS)),
        (_dq_consumer_worker, (dq_desc, q_smem, do_smem, k_smem, v_smem, res_ready, res_empty, k_ready, k_empty,
                               v_ready, v_empty, turn, DQ, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N,
                               N_BLOCKS, n_items, half_alpha, out_scale, (COUNTER, item_smem, item_ready, item_empty),
                               BLOCK_N, HAS_TGT, PINGPONG, OVERLAP, DYNAMIC, REGS)),
        (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, res_ready, res_empty,
                         k_ready, k_empty, v_ready, v_empty, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items,
                         (COUNTER, item_smem, item_ready, item_empty), BLOCK_N, HAS_TGT, DYNAMIC, False)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# dK/dV kernel: per warpgroup 64 keys, (Q, dO) tiles streamed
# --------------------------------------------------------------------------------------------


@gluon.jit
def _mask_tile_t(x, q0, keys, pi_keys, qcols0, n, M, HAS_TGT: gl.constexpr):
    """valid(i, j) on a transposed [keys, queries] tile (queries q0 + qcols0): i < n and (i == j or pi(i) > pi(j))."""
    qs = q0 + qcols0
    if HAS_TGT:
        pi_q = gl.minimum(qs, M)
    else:
        pi_q = qs
    ok = ((qs[None, :] == keys[:, None]) | (pi_q[None, :] > pi_keys[:, None])) & (qs[None, :] < n)
    return gl.where(ok, x, gl.zeros_like(x))


@gluon.jit
def _dkdv_range(dk, dv, s_acc, dp_acc, k, v, q_smem, do_smem, q_ready, q_empty, do_ready, do_empty, turn_me,
                turn_other, c0, tph, r0, k0, n, M, lo, hi, half_alpha, BQ: gl.constexpr, HAS_TGT: gl.constexpr,
                PINGPONG: gl.constexpr, MASKED: gl.constexpr):
    """Query tiles t in [lo, hi) (rows r0 + t * BQ, ring slots c0 + t) against the keys [k0, k0 + 64) of one
    warpgroup: dK, dV accumulated; the mask only when MASKED (its index tensors live in this loop only)."""
    dtype: gl.constexpr = k.dtype
    KM: gl.constexpr = k.shape[0]
    QS: gl.constexpr = q_smem.shape[0]
    DS: gl.constexpr = do_smem.shape[0]
    s_layout: gl.constexpr = s_acc.type.layout
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    if MASKED:
        keys = k0 + gl.arange(0, KM, layout=gl.SliceLayout(1, s_layout))
        qcols0 = gl.arange(0, BQ, layout=gl.SliceLayout(0, s_layout))
        if HAS_TGT:
            pi_keys = gl.minimum(keys, M)
        else:
            pi_keys = keys
    for t in range(lo, hi):
        c = c0 + t
        qs = c % QS
        ds_ = c % DS
        mbarrier.wait(q_ready.index(qs), (c // QS) & 1)
        mbarrier.wait(do_ready.index(ds_), (c // DS) & 1)
        if PINGPONG:
            mbarrier.wait(turn_me, tph)
        # use_acc=False: the previous tile's S^T / dP^T only lend their registers
        s_tok = warpgroup_mma(k, q_smem.index(qs).permute((1, 0)), s_acc, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(v, do_smem.index(ds_).permute((1, 0)), dp_acc, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_other, count=1)
            tph ^= 1
        s_acc, dp_acc = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
        p, ds = _silu_bwd(s_acc, dp_acc, half_alpha)
        if MASKED:
            q0 = r0 + t * BQ
            p = _mask_tile_t(p, q0, keys, pi_keys, qcols0, n, M, HAS_TGT)
            ds = _mask_tile_t(ds, q0, keys, pi_keys, qcols0, n, M, HAS_TGT)
        p16 = gl.convert_layout(p.to(dtype), a_layout)
        ds16 = gl.convert_layout(ds.to(dtype), a_layout)
        dv = warpgroup_mma(p16, do_smem.index(ds_), dv, is_async=True)
        dk = warpgroup_mma(ds16, q_smem.index(qs), dk, is_async=True)
        dv, dk, p16, ds16 = warpgroup_mma_wait(0, deps=(dv, dk, p16, ds16))
        gl.thread_barrier()
        mbarrier.arrive(q_empty.index(qs), count=1)
        mbarrier.arrive(do_empty.index(ds_), count=1)
    return dk, dv, s_acc, dp_acc, tph


@gluon.jit
def _dkdv_tiles(k, v, q_smem, do_smem, q_ready, q_empty, do_ready, do_empty, turn_me, turn_other, c0, tph, r0, k0,
                n, M, n_tiles, half_alpha, BQ: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr):
    """One warpgroup's keys [k0, k0 + 64) against the query tiles t = 0 .. n_tiles - 1 (rows r0 + t * BQ, ring
    slots c0 + t). Returns the unscaled fp32 dK and dV accumulators and the turn parity.

    Segments: tiles before t0 (rows all before the keys: warpgroup 1's first tile) are passed on; [t0, t0 + 1)
    holds the diagonal (masked); [t0 + 1, tf) see every key (rows past the keys, inside the sequence) unless the
    keys include targets (then everything is masked: target rows see only themselves among targets); [tf,
    n_tiles) is the sequence's partial last tile (masked)."""
    KM: gl.constexpr = k.shape[0]
    D: gl.constexpr = k.shape[1]
    QS: gl.constexpr = q_smem.shape[0]
    DS: gl.constexpr = do_smem.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BQ, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    t0 = gl.minimum((k0 - r0) // BQ, n_tiles)
    if k0 >= n:  # no keys: every tile passed on
        t0 = n_tiles
    tph = _pass_tiles(q_ready, q_empty, do_ready, do_empty, turn_me, turn_other, c0, 0, t0, tph, QS, DS, PINGPONG)
    tf = gl.maximum(gl.minimum((n - r0) // BQ, n_tiles), t0)  # tiles wholly inside the sequence end at tf
    t1 = gl.minimum(t0 + 1, tf)
    if k0 + KM > M:  # keys holding targets (or past the sequence): all masked
        t1 = t0
        tf = t0
    s_acc = gl.zeros([KM, BQ], gl.float32, s_layout)
    dp_acc = gl.zeros([KM, BQ], gl.float32, s_layout)
    dk = gl.zeros([KM, D], gl.float32, o_layout)
    dv = gl.zeros([KM, D], gl.float32, o_layout)
    dk, dv, s_acc, dp_acc, tph = _dkdv_range(dk, dv, s_acc, dp_acc, k, v, q_smem, do_smem, q_ready, q_empty,
                                             do_ready, do_empty, turn_me, turn_other, c0, tph, r0, k0, n, M, t0, t1,
                                             half_alpha, BQ, HAS_TGT, PINGPONG, True)
    dk, dv, s_acc, dp_acc, tph = _dkdv_range(dk, dv, s_acc, dp_acc, k, v, q_smem, do_smem, q_ready, q_empty,
                                             do_ready, do_empty, turn_me, turn_other, c0, tph, r0, k0, n, M, t1, tf,
                                             half_alpha, BQ, HAS_TGT, PINGPONG, False)
    dk, dv, s_acc, dp_acc, tph = _dkdv_range(dk, dv, s_acc, dp_acc, k, v, q_smem, do_smem, q_ready, q_empty,
                                             do_ready, do_empty, turn_me, turn_other, c0, tph, r0, k0, n, M,
                                             tf, n_tiles, half_alpha, BQ, HAS_TGT, PINGPONG, True)
    return dk, dv, tph


@gluon.jit
def _dkdv_consumer(dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, res_ready, res_empty, q_ready, q_empty,
                   do_ready, do_empty, turn, DK, DV, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items,
                   half_alpha, dk_scale, dv_scale, sched, WG: gl.constexpr, HAS_TGT: gl.constexpr,
                   PINGPONG: gl.constexpr, DYNAMIC: gl.constexpr):
    KM: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = k_smem.shape[2]
    BQ: gl.constexpr = q_smem.shape[1]
    CTA_M: gl.constexpr = 2 * KM
    n_blocks = N_BLOCKS
    c = 0
    i = 0
    j = 0
    tph = 1 - WG
    if DYNAMIC:
        w = _get_item(sched, j)
    else:
        w = gl.program_id(0)
    while w < n_items:
        j += 1
        start, n, M, r0, n_tiles, col = _kv_item(w, n_blocks, H, SEQ_OFFSETS, NUM_TARGETS, ROWS, MAX_N, CTA_M, D,
                                                 HAS_TGT)
        if r0 < n:
            rb = i % 2
            k0 = r0 + WG * KM
            mbarrier.wait(res_ready.index(rb), (i // 2) & 1)
            kt = k_smem.index(2 * rb + WG)
            vt = v_smem.index(2 * rb + WG)
            dk, dv, tph = _dkdv_tiles(kt, vt, q_smem, do_smem, q_ready, q_empty, do_ready, do_empty, turn.index(WG),
                                      turn.index(1 - WG), c, tph, r0, k0, n, M, n_tiles, half_alpha, BQ, HAS_TGT,
                                      PINGPONG)
            c += n_tiles
            i += 1
            # the warpgroup's K and V tiles (no wgmma reads them any more) stage dK and dV
            gl.thread_barrier()
            _store_rows((dk * dk_scale).to(k_smem.dtype), kt, dk_desc, DK, stride_om, col, start, k0, n, KM, D)
            _store_rows((dv * dv_scale).to(k_smem.dtype), vt, dv_desc, DV, stride_om, col, start, k0, n, KM, D)
            _release_res(res_empty, rb)
        if DYNAMIC:
            w = _get_item(sched, j)
        else:
            w += gl.num_programs(0)


@gluon.jit
def _dkdv_consumer_default(dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, res_ready, res_empty, q_ready, q_empty,
                           do_ready, do_empty, turn, DK, DV, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N,
                           N_BLOCKS, n_items, half_alpha, dk_scale, dv_scale, sched, HAS_TGT: gl.constexpr,
                           PINGPONG: gl.constexpr, DYNAMIC: gl.constexpr):
    _dkdv_consumer(dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, res_ready, res_empty, q_ready, q_empty,
                   do_ready, do_empty, turn, DK, DV, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items,
                   half_alpha, dk_scale, dv_scale, sched, 0, HAS_TGT, PINGPONG, DYNAMIC)


@gluon.jit
def _dkdv_consumer_worker(dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, res_ready, res_empty, q_ready, q_empty,
                          do_ready, do_empty, turn, DK, DV, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N,
                          N_BLOCKS, n_items, half_alpha, dk_scale, dv_scale, sched, HAS_TGT: gl.constexpr,
                          PINGPONG: gl.constexpr, DYNAMIC: gl.constexpr):
    _dkdv_consumer(dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, res_ready, res_empty, q_ready, q_empty,
                   do_ready, do_empty, turn, DK, DV, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items,
                   half_alpha, dk_scale, dv_scale, sched, 1, HAS_TGT, PINGPONG, DYNAMIC)


@gluon.jit
def _hstu_bwd_dkdv_ws_kernel(k_desc, v_desc, q_desc, do_desc, dk_desc, dv_desc, DK, DV, SEQ_OFFSETS, NUM_TARGETS,
                             COUNTER, stride_om, H, ROWS, MAX_N, N_BLOCKS, n_items, half_alpha, dk_scale, dv_scale,
                             HAS_TGT: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                             DYNAMIC: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             PRODUCER_REGS: gl.constexpr):
    KM: gl.constexpr = k_desc.block_type.shape[0]
    BQ: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    # resident: [buffer, warpgroup] K and V; stream: Q and dO rings
    k_smem = gl.allocate_shared_memory(dtype, [4, KM, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [4, KM, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BQ, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BQ, D], do_desc.layout)
    res_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    res_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(res_ready.index(i), count=1)
        mbarrier.init(res_empty.index(i), count=2)
        mbarrier.init(turn.index(i), count=1)
        mbarrier.init(item_ready.index(i), count=1)
        mbarrier.init(item_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_dkdv_consumer_default, (dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, res_ready, res_empty, q_ready,
                                  q_empty, do_ready, do_empty, turn, DK, DV, stride_om, SEQ_OFFSETS, NUM_TARGETS, H,
                                  ROWS, MAX_N, N_BLOCKS, n_items, half_alpha, dk_scale, dv_scale,
                                  (COUNTER, item_smem, item_ready, item_empty), HAS_TGT, PINGPONG, DYNAMIC)),
        (_dkdv_consumer_worker, (dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, res_ready, res_empty, q_ready,
                                 q_empty, do_ready, do_empty, turn, DK, DV, stride_om, SEQ_OFFSETS, NUM_TARGETS, H,
                                 ROWS, MAX_N, N_BLOCKS, n_items, half_alpha, dk_scale, dv_scale,
                                 (COUNTER, item_smem, item_ready, item_empty), HAS_TGT, PINGPONG, DYNAMIC)),
        (_bwd_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, res_ready, res_empty,
                         q_ready, q_empty, do_ready, do_empty, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, N_BLOCKS, n_items,
                         (COUNTER, item_smem, item_ready, item_empty), BQ, HAS_TGT, DYNAMIC, True)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def _operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the 2-D TMA view can address it (unit stride on D, heads adjacent, 16-byte aligned), else a copy."""
    es = t.element_size()
    ok = (t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0)
    return t if ok else t.contiguous()


def gluon_backward(grad, q, k, v, seq_offsets, max_seq_len: int, alpha: float, num_targets=None, *, config=None,
                   attn_scale=None, max_attn_len=0, contextual_seq_len=0, min_full_attn_seq_len=0, causal=True,
                   rab=None, intervals=None, checked=False):
    """(dq, dk, dv) of the HSTU attention forward ``[L, H, 128]`` (causal, optional targets, scale 1/max_seq_len);
    the Triton backward's (``attention.hstu_attention_bwd``) results. Outside that scope: NotImplementedError.
    ``checked``: the caller (``ops/_gluon.route_bwd``) has already proven the call in scope."""
    if not checked:
        _check(q, k, v, seq_offsets, num_targets,
               dict(attn_scale=attn_scale, max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
                    min_full_attn_seq_len=min_full_attn_seq_len, rab=rab, intervals=intervals))
    if not causal:
        raise NotImplementedError("gluon_backward: causal=False")
    cfg = {**GLUON_BWD_CONFIG, **(config or {})}
    L, H, D = q.shape
    if grad.shape != (L, H, D):
        raise ValueError(f"gluon_backward: grad must be {(L, H, D)}, got {tuple(grad.shape)}")
    if grad.dtype != q.dtype:
        grad = grad.to(q.dtype)
    grad = _operand(grad)
    B = seq_offsets.shape[0] - 1
    dq = new_tensor((L, H, D), q.dtype, q.device)
    dk = new_tensor((L, H, D), q.dtype, q.device)
    dv = new_tensor((L, H, D), q.dtype, q.device)
    if L == 0 or B <= 0 or max_seq_len <= 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    BM, BN = BLOCK_M, cfg["BLOCK_N"]
    m_layout, n_layout = _smem_layout(BM, D, q.dtype), _smem_layout(BN, D, q.dtype)
    n_blocks = -(-max_seq_len // (2 * BM))  # triton.cdiv is a constexpr_function: ~1.5 us a host call
    n_items = B * H * n_blocks
    grid, dynamic = _scheduling(cfg, n_items, q.device)
    tgt = num_targets if num_targets is not None else seq_offsets
    counters = torch.zeros(2, dtype=torch.int32, device=q.device) if dynamic else seq_offsets[:2]
    half_alpha = 0.5 * float(alpha)
    scale = 1.0 / max_seq_len
    common = dict(HAS_TGT=num_targets is not None, PINGPONG=cfg["PINGPONG"], DYNAMIC=dynamic,
                  CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"], num_warps=4,
                  maxnreg=cfg["MAXNREG"])
    run = cfg["RUN"]
    q_d, g_d = _desc_2d(q, BM, m_layout), _desc_2d(grad, BM, m_layout)  # the same in both kernels
    if run in ("both", "dkdv"):
        launch(_hstu_bwd_dkdv_ws_kernel, grid,
               (_desc_2d(k, BM, m_layout), _desc_2d(v, BM, m_layout), q_d, g_d, _desc_2d(dk, BM, m_layout),
                _desc_2d(dv, BM, m_layout), dk, dv, seq_offsets, tgt, counters[0:1], dk.stride(0), H, L, max_seq_len,
                n_blocks, n_items, half_alpha, float(alpha) * scale, scale), dict(STAGES=cfg["KV_STAGES"], **common))
    if run in ("both", "dq"):
        launch(_hstu_bwd_dq_ws_kernel, grid,
               (q_d, g_d, _desc_2d(k, BN, n_layout), _desc_2d(v, BN, n_layout), _desc_2d(dq, BM, m_layout), dq,
                seq_offsets, tgt, counters[1:2], dq.stride(0), H, L, max_seq_len, n_blocks, n_items, half_alpha,
                float(alpha) * scale),
               dict(BLOCK_N=BN, KSTAGES=cfg["DQ_KSTAGES"], VSTAGES=cfg["DQ_VSTAGES"], OVERLAP=cfg["OVERLAP"],
                    REGS=cfg["DQ_REGS"], **common))
    return dq, dk, dv
