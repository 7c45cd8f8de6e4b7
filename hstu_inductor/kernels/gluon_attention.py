"""Warp-specialised Hopper (sm90) forward of jagged HSTU attention, written in Gluon.

Math (HSTU_SEMANTICS.md): ``out_i = (1/N) * sum_j valid(i, j) * silu(alpha * <q_i, k_j>) * v_j`` per head,
causal, optionally with targets (a target row sees every history row and itself). The same function as
``attention._hstu_fwd_kernel`` with CAUSAL=True, HAS_TGT=num_targets is not None, no window/contextual/rab/
intervals, SCALE_MODE=0 (scale 1/max_seq_len), D = Dq = Dv = 128, 16-bit inputs.

Design (FA3's, as in NVIDIA's CUTLASS HSTU kernel): one CTA per (sequence, head, 128 query rows), three
partitions of ``gl.warp_specialize``:

* producer (1 warp): TMA loads of the CTA's two 64-row Q tiles, then of the K and V tiles of every visible key
  block into a ring of ``STAGES`` shared-memory slots (separate K and V rings, each slot guarded by a
  ``ready`` and an ``empty`` mbarrier);
* two consumer warpgroups (the default partition and a 4-warp worker), each owning 64 query rows:
  ``S = Q K^T`` by wgmma (Q and K from shared memory), ``P = silu(alpha S)`` in fp32 (tanh.approx form, the
  Triton kernel's ``_silu(FAST=1)``), the causal/target mask only on the tiles that need it, then
  ``O += P V`` by wgmma with P in registers. Within a warpgroup the P V product of tile t-1 stays in
  flight while the silu of tile t runs (issue S_t, then PV_{t-1}, wait for S_t only); across warpgroups a
  pair of "turn" mbarriers orders the GEMM issue (ping-pong), so one warpgroup's silu overlaps the
  other's tensor-core work.

Memory: descriptors on the ``[L, H*D]`` 2-D views of q/k/v (block ``[rows, 128]`` at column ``h*D``), so
loads past a sequence's end read the next sequence's rows (or zeros past L): those key columns are masked
(``j < n``) and those query rows are never stored. The output is written with a row-masked store
(through the Q tile's shared memory, reused for the epilogue).

Block skipping is ``attention._fwd_key_range`` for this mask: key tiles [0, fe) are visible to every row of a
warpgroup (no mask), tiles [fe, e) are masked, tiles past e are skipped (e = ceil((last row + 1) / BLOCK_N),
fe = floor(min(first row, M) / BLOCK_N), M = n - targets).
"""
from __future__ import annotations

import functools

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
from .fastlaunch import Desc, launch

__all__ = ["gluon_forward", "gluon_supported", "GLUON_CONFIG"]

# Tunables (tests and benchmarks override them through gluon_forward(config=...)).
GLUON_CONFIG = dict(
    BLOCK_M=64,        # query rows per consumer warpgroup (the CTA covers 2 * BLOCK_M)
    BLOCK_N=128,       # keys per tile
    STAGES=2,          # depth of the K and V rings
    PINGPONG=True,     # order the two warpgroups' GEMM issue with the turn barriers
    CONSUMER_REGS=240,  # setmaxnreg of the worker consumer warpgroup (the default one gets the rest)
    PRODUCER_REGS=24,
    MAXNREG=168,       # per-thread register cap of the launch: 65536 / (12 warps * 32) rounded down to 8
    PERSISTENT=True,   # one CTA per SM walking the work items (double-buffered Q, separate O staging tile)
    DYNAMIC=True,      # persistent: items from a global atomic counter (False: strided over the CTAs)
    PACKED=0,          # 1: silu on packed bf16x2/f16x2 (half the MUFU ops; measured 3.6e-3 from the fp32-silu
                       # result, over the 2.4e-3 bound, and no faster on H100); 2: no silu (timing probe only)
    SYNC=True,         # warpgroup bar.sync before each K/V release (False: one thread's wgmma wait, as CUTLASS)
)


@gluon.jit
def _tanh_approx(x):
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _silu_half(s, half_alpha):
    """silu(alpha s) = hx + hx tanh(hx), hx = alpha s / 2 (one MUFU op per element)."""
    hx = s * half_alpha
    return hx + hx * _tanh_approx(hx)


@gluon.jit
def _silu_packed(hx):
    """silu(2 hx) = hx + hx tanh(hx) on packed 16-bit pairs: one MUFU op and one FMA per 2 elements (the Triton
    kernel's HSTU_INDUCTOR_SILU=packed)."""
    if hx.dtype == gl.bfloat16:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; tanh.approx.bf16x2 t, $1; fma.rn.bf16x2 $0, $1, t, $1; }",
            "=r,r", [hx], dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; tanh.approx.f16x2 t, $1; fma.rn.f16x2 $0, $1, t, $1; }",
            "=r,r", [hx], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _scores_to_p(s_acc, half_alpha, dtype: gl.constexpr, PACKED: gl.constexpr):
    """silu(alpha S) in the operand dtype: fp32 math (PACKED=0), packed 16-bit pairs (1), or no silu at all
    (2: a timing probe for the tensor-core bound, wrong results)."""
    if PACKED == 2:
        return (s_acc * half_alpha).to(dtype)
    elif PACKED == 1:
        return _silu_packed((s_acc * half_alpha).to(dtype))
    else:
        return _silu_half(s_acc, half_alpha).to(dtype)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
              start, r0, col, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    # the two warpgroups' Q tiles on one barrier
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [start + r0, col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [start + r0 + BLOCK_M, col], q_bar, q_smem.index(1))
    for t in range(n_tiles):
        s = t % STAGES
        ph = (t // STAGES) & 1
        row = start + t * BLOCK_N
        # empty barriers start "phase 1 complete": the first pass through the ring does not wait
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _mask_tile(p, t, rows, pi_rows, cols0, n, M, BLOCK_N: gl.constexpr, HAS_TGT: gl.constexpr):
    """valid(i, j) on one [rows, BLOCK_N] tile of key block t: j < n and (i == j or pi(i) > pi(j))."""
    cols = t * BLOCK_N + cols0
    if HAS_TGT:
        pi_cols = gl.minimum(cols, M)
    else:
        pi_cols = cols
    ok = ((rows[:, None] == cols[None, :]) | (pi_rows[:, None] > pi_cols[None, :])) & (cols[None, :] < n)
    return gl.where(ok, p, gl.zeros_like(p))


@gluon.jit
def _attend(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn_me, turn_other, q_release,
            c0, tph, m0, n, M, n_tiles, half_alpha,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
            HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr, RELEASE_Q: gl.constexpr,
            PACKED: gl.constexpr, SYNC: gl.constexpr):
    """One warpgroup's query rows [m0, m0 + BLOCK_M) against key tiles 0 .. n_tiles - 1 (n_tiles >= 1), which
    occupy ring slots c0, c0 + 1, ... Returns the unscaled fp32 accumulator and the turn-barrier parity."""
    dtype: gl.constexpr = q.dtype
    KS: gl.constexpr = k_smem.shape[0]  # K ring depth (may exceed the V ring's)
    VS: gl.constexpr = v_smem.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if HAS_TGT:
        pi_rows = gl.minimum(rows, M)
        P0 = gl.minimum(m0, M)
    else:
        pi_rows = rows
        P0 = m0
    # tiles [0, fe) are visible to every row of this warpgroup (keys with id < its first row's id); tiles from
    # n_wg on hold only keys past its last row (possible when BLOCK_N < 2 * BLOCK_M): passed on, not computed
    SKIP: gl.constexpr = BLOCK_N < 2 * BLOCK_M
    n_all = n_tiles
    if SKIP:
        n_tiles = gl.minimum(n_all, (m0 + BLOCK_M - 1) // BLOCK_N + 1)
    fe = gl.minimum(P0 // BLOCK_N, n_tiles)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)

    # ---- prologue: S_0, P_0
    s = c0 % KS
    mbarrier.wait(k_ready.index(s), (c0 // KS) & 1)
    if PINGPONG:
        mbarrier.wait(turn_me, tph)
    s_tok = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_other, count=1)
        tph ^= 1
    s_acc = warpgroup_mma_wait(0, deps=(s_tok, ))
    if SYNC:  # CUTLASS releases without it (one thread's wait covers the warpgroup's wgmma)
        gl.thread_barrier()
    mbarrier.arrive(k_empty.index(s), count=1)
    p = _scores_to_p(s_acc, half_alpha, dtype, PACKED)
    if fe <= 0:
        p = _mask_tile(p, 0, rows, pi_rows, cols0, n, M, BLOCK_N, HAS_TGT)
    p16 = gl.convert_layout(p, p_layout)

    # ---- steady state: issue S_t and PV_{t-1}, wait for S_t, silu(S_t) under PV_{t-1}
    for t in range(1, n_tiles):
        c = c0 + t
        s = c % KS
        sp = (c - 1) % VS
        mbarrier.wait(k_ready.index(s), (c // KS) & 1)
        mbarrier.wait(v_ready.index(sp), ((c - 1) // VS) & 1)
        if PINGPONG:
            mbarrier.wait(turn_me, tph)
        # use_acc=False: the previous S (dead by now) only lends its registers
        s_tok = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), s_acc, use_acc=False, is_async=True)
        acc = warpgroup_mma(p16, v_smem.index(sp), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_other, count=1)
            tph ^= 1
        # wgmma groups retire in order: one outstanding = S_t done, PV_{t-1} still running
        s_acc = warpgroup_mma_wait(1, deps=(s_tok, ))
        if SYNC:  # CUTLASS releases without it (one thread's wait covers the warpgroup's wgmma)
            gl.thread_barrier()
        mbarrier.arrive(k_empty.index(s), count=1)
        p = _scores_to_p(s_acc, half_alpha, dtype, PACKED)
        if t >= fe:
            p = _mask_tile(p, t, rows, pi_rows, cols0, n, M, BLOCK_N, HAS_TGT)
        p_next = gl.convert_layout(p, p_layout)
        acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
        if SYNC:  # CUTLASS releases without it (one thread's wait covers the warpgroup's wgmma)
            gl.thread_barrier()
        mbarrier.arrive(v_empty.index(sp), count=1)
        p16 = p_next
    if RELEASE_Q:  # every S of this item is complete (and the warps synchronised after it): Q can be refilled
        mbarrier.arrive(q_release, count=1)

    # ---- last P V
    c = c0 + n_tiles - 1
    sl = c % VS
    mbarrier.wait(v_ready.index(sl), (c // VS) & 1)
    acc = warpgroup_mma(p16, v_smem.index(sl), acc, is_async=True)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    gl.thread_barrier()
    mbarrier.arrive(v_empty.index(sl), count=1)
    # ---- tiles invisible to this warpgroup: wait until each is loaded (its slot's previous phase is complete, so
    # this arrival counts for the right one), release it, and keep the turn order
    if SKIP:
        tph = _pass_tiles(k_ready, k_empty, v_ready, v_empty, turn_me, turn_other, c0, n_tiles, n_all, tph,
                          KS, VS, PINGPONG)
    return acc, tph


@gluon.jit
def _pass_tiles(k_ready, k_empty, v_ready, v_empty, turn_me, turn_other, c0, t0, t1, tph,
                KS: gl.constexpr, VS: gl.constexpr, PINGPONG: gl.constexpr):
    for t in range(t0, t1):
        c = c0 + t
        mbarrier.wait(k_ready.index(c % KS), (c // KS) & 1)
        mbarrier.arrive(k_empty.index(c % KS), count=1)
        mbarrier.wait(v_ready.index(c % VS), (c // VS) & 1)
        mbarrier.arrive(v_empty.index(c % VS), count=1)
        if PINGPONG:
            mbarrier.wait(turn_me, tph)
            mbarrier.arrive(turn_other, count=1)
            tph ^= 1
    return tph


@gluon.jit
def _store_rows(out, buf, o_desc, O, stride_om, col, start, m0, n, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """Rows [m0, min(m0 + BLOCK_M, n)) of ``out`` to the output through ``buf`` (shared memory, free on entry:
    every warp of the warpgroup is past its last read): a TMA store for a whole tile (left in flight: wait with
    ``tma.store_wait`` before reusing ``buf``), else 16-byte row-masked stores."""
    buf.store(out)
    if m0 + BLOCK_M <= n:
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [start + m0, col], buf)
    else:
        gl.thread_barrier()
        st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        vals = buf.load(st_layout)
        r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, st_layout))
        # out is our own contiguous [L, H, D]: row offsets are multiples of H * D, col = h * D
        row_off = gl.multiple_of((start + r).to(gl.int64) * stride_om + col, 16)
        gl.store(O + (row_off[:, None] + c[None, :]), vals, mask=(r < n)[:, None])


@gluon.jit
def _consumer(o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
              O, stride_om, col, start, r0, n, M, n_tiles, half_alpha, scale,
              WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              STAGES: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr,
              PACKED: gl.constexpr, SYNC: gl.constexpr):
    q = q_smem.index(WG)
    m0 = r0 + WG * BLOCK_M  # first query row (position in the sequence) of this warpgroup
    mbarrier.wait(q_bar, 0)
    # warpgroup 0 issues first: its turn barrier counts as complete at the start (parity 1)
    acc, tph = _attend(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn.index(WG), turn.index(1 - WG),
                       q_bar, 0, 1 - WG, m0, n, M, n_tiles, half_alpha,
                       BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, False, PACKED, SYNC)
    # the Q tile (every warp's wgmma reads are complete: thread barrier at the end of _attend) holds the output
    _store_rows((acc * scale).to(q.dtype), q, o_desc, O, stride_om, col, start, m0, n, BLOCK_M, D)
    tma.store_wait(0)


@gluon.jit
def _consumer_worker(o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                     O, stride_om, col, start, r0, n, M, n_tiles, half_alpha, scale,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                     STAGES: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr,
                     PACKED: gl.constexpr, SYNC: gl.constexpr):
    _consumer(o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
              O, stride_om, col, start, r0, n, M, n_tiles, half_alpha, scale,
              1, BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, PACKED, SYNC)


@gluon.jit
def _consumer_default(o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                      O, stride_om, col, start, r0, n, M, n_tiles, half_alpha, scale,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                      STAGES: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr,
                      PACKED: gl.constexpr, SYNC: gl.constexpr):
    _consumer(o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
              O, stride_om, col, start, r0, n, M, n_tiles, half_alpha, scale,
              0, BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, PACKED, SYNC)


@gluon.jit
def _hstu_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, O, SEQ_OFFSETS, NUM_TARGETS,
                        stride_om, H, ROWS, MAX_N, half_alpha, scale,
                        HAS_TGT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, PINGPONG: gl.constexpr, PACKED: gl.constexpr, SYNC: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    CTA_M: gl.constexpr = 2 * BLOCK_M

    # (sequence, head, row block), the row blocks of one (sequence, head) adjacent (they share K/V in L2),
    # the last (heaviest under the causal mask) first
    pid = gl.program_id(0)
    n_blocks = (MAX_N + CTA_M - 1) // CTA_M
    bh = pid // n_blocks
    blk = n_blocks - 1 - pid % n_blocks
    b = bh // H
    h = bh % H
    start = gl.load(SEQ_OFFSETS + b).to(gl.int32)
    end = gl.load(SEQ_OFFSETS + b + 1).to(gl.int32)
    start = gl.minimum(gl.maximum(start, 0), ROWS)
    end = gl.minimum(gl.maximum(end, start), ROWS)
    n = gl.minimum(end - start, MAX_N)
    r0 = blk * CTA_M
    if r0 < n:
        if HAS_TGT:
            M = n - gl.minimum(gl.maximum(gl.load(NUM_TARGETS + b).to(gl.int32), 0), n)
        else:
            M = n
        m_last = gl.minimum(r0 + CTA_M, n) - 1
        n_tiles = (m_last + BLOCK_N) // BLOCK_N  # causal: keys j <= m_last
        col = h * D

        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(i), count=2)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        fence_async_shared()

        # (tuples inline: a tuple assigned to a variable turns its constexprs into tensors)
        gl.warp_specialize([
            (_consumer_default, (o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                                 O, stride_om, col, start, r0, n, M, n_tiles, half_alpha, scale,
                                 BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, PACKED, SYNC)),
            (_consumer_worker, (o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                                O, stride_om, col, start, r0, n, M, n_tiles, half_alpha, scale,
                                BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, PACKED, SYNC)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                         start, r0, col, n_tiles, BLOCK_M, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# Persistent variant: one CTA per SM walks work items (sequence, head, 128-row block); the producer runs
# ahead across items (double-buffered Q, the K/V ring continues), so the next item's loads overlap the
# current item's last P V and epilogue.
# --------------------------------------------------------------------------------------------


@gluon.jit
def _item(w, n_blocks, H, SEQ_OFFSETS, NUM_TARGETS, ROWS, MAX_N, CTA_M: gl.constexpr, BLOCK_N: gl.constexpr,
          D: gl.constexpr, HAS_TGT: gl.constexpr):
    """Work item w: the row blocks of one (sequence, head) adjacent, the heaviest first. Returns
    (start, n, M, r0, n_tiles, col); the item is empty when r0 >= n."""
    bh = w // n_blocks
    blk = n_blocks - 1 - w % n_blocks
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
    n_tiles = (gl.minimum(r0 + CTA_M, n) - 1 + BLOCK_N) // BLOCK_N
    return start, n, M, r0, n_tiles, h * D


@gluon.jit
def _post_item(sched, j, w):
    """Producer: publish work item w in slot j % 2 of the item ring (dynamic scheduling)."""
    COUNTER, item_smem, item_ready, item_empty = sched
    slot = j % 2
    mbarrier.wait(item_empty.index(slot), ((j // 2) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    item_smem.index(slot).store(gl.full([1], w, gl.int32, layout))
    gl.thread_barrier()
    mbarrier.arrive(item_ready.index(slot), count=1)


@gluon.jit
def _get_item(sched, j):
    """Consumer: the work item in slot j % 2 of the item ring."""
    COUNTER, item_smem, item_ready, item_empty = sched
    slot = j % 2
    mbarrier.wait(item_ready.index(slot), (j // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    w = gl.max(item_smem.index(slot).load(layout), axis=0)
    gl.thread_barrier()
    mbarrier.arrive(item_empty.index(slot), count=1)
    return w


@gluon.jit
def _load_k(k_desc, k_smem, k_ready, k_empty, c, row, col, BLOCK_N: gl.constexpr):
    KS: gl.constexpr = k_smem.shape[0]
    s = c % KS
    mbarrier.wait(k_empty.index(s), ((c // KS) & 1) ^ 1)  # "phase 1 complete" at the start: no wait
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(s), k_smem.index(s))


@gluon.jit
def _load_v(v_desc, v_smem, v_ready, v_empty, c, row, col):
    VS: gl.constexpr = v_smem.shape[0]
    s = c % VS
    mbarrier.wait(v_empty.index(s), ((c // VS) & 1) ^ 1)
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _p_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                v_empty, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, n_items, sched,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                HAS_TGT: gl.constexpr, DYNAMIC: gl.constexpr):
    CTA_M: gl.constexpr = 2 * BLOCK_M
    n_blocks = (MAX_N + CTA_M - 1) // CTA_M
    c = 0
    i = 0
    j = 0
    if DYNAMIC:  # items in queue order (the heaviest block of each (sequence, head) first) to whichever CTA asks
        w = gl.atomic_add(sched[0], 1)
    else:
        w = gl.program_id(0)
    while w < n_items:
        if DYNAMIC:
            _post_item(sched, j, w)
        j += 1
        start, n, M, r0, n_tiles, col = _item(w, n_blocks, H, SEQ_OFFSETS, NUM_TARGETS, ROWS, MAX_N, CTA_M,
                                              BLOCK_N, D, HAS_TGT)
        if r0 < n:
            qb = i % 2
            mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [start + r0, col], q_ready.index(qb), q_smem.index(2 * qb))
            tma.async_copy_global_to_shared(q_desc, [start + r0 + BLOCK_M, col], q_ready.index(qb),
                                            q_smem.index(2 * qb + 1))
            for t in range(n_tiles):
                _load_k(k_desc, k_smem, k_ready, k_empty, c, start + t * BLOCK_N, col, BLOCK_N)
                _load_v(v_desc, v_smem, v_ready, v_empty, c, start + t * BLOCK_N, col)
                c += 1
            i += 1
        if DYNAMIC:
            w = gl.atomic_add(sched[0], 1)
        else:
            w += gl.num_programs(0)
    if DYNAMIC:  # the end marker (w >= n_items) for the consumers
        _post_item(sched, j, w)


@gluon.jit
def _p_consumer(o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, n_items, half_alpha, scale, sched,
                WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                STAGES: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr,
                PACKED: gl.constexpr, SYNC: gl.constexpr, DYNAMIC: gl.constexpr):
    CTA_M: gl.constexpr = 2 * BLOCK_M
    n_blocks = (MAX_N + CTA_M - 1) // CTA_M
    buf = o_smem.index(WG)
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
            qb = i % 2
            m0 = r0 + WG * BLOCK_M
            mbarrier.wait(q_ready.index(qb), (i // 2) & 1)
            acc, tph = _attend(q_smem.index(2 * qb + WG), k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                               turn.index(WG), turn.index(1 - WG), q_empty.index(qb), c, tph, m0, n, M, n_tiles,
                               half_alpha, BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, True, PACKED, SYNC)
            c += n_tiles
            i += 1
            out = (acc * scale).to(q_smem.dtype)
            tma.store_wait(0)  # the previous item's TMA store has read buf
            gl.thread_barrier()
            _store_rows(out, buf, o_desc, O, stride_om, col, start, m0, n, BLOCK_M, D)
        if DYNAMIC:
            w = _get_item(sched, j)
        else:
            w += gl.num_programs(0)
    tma.store_wait(0)


@gluon.jit
def _p_consumer_default(o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                        v_empty, turn, O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, n_items, half_alpha,
                        scale, sched, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                        STAGES: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr,
                        PACKED: gl.constexpr, SYNC: gl.constexpr, DYNAMIC: gl.constexpr):
    _p_consumer(o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, n_items, half_alpha, scale, sched,
                0, BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, PACKED, SYNC, DYNAMIC)


@gluon.jit
def _p_consumer_worker(o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                       v_empty, turn, O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, n_items, half_alpha,
                       scale, sched, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                       STAGES: gl.constexpr, HAS_TGT: gl.constexpr, PINGPONG: gl.constexpr,
                       PACKED: gl.constexpr, SYNC: gl.constexpr, DYNAMIC: gl.constexpr):
    _p_consumer(o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, n_items, half_alpha, scale, sched,
                1, BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, PACKED, SYNC, DYNAMIC)


@gluon.jit
def _hstu_fwd_ws_persistent_kernel(q_desc, k_desc, v_desc, o_desc, O, SEQ_OFFSETS, NUM_TARGETS, COUNTER,
                                   stride_om, H, ROWS, MAX_N, n_items, half_alpha, scale,
                                   HAS_TGT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                   STAGES: gl.constexpr, PINGPONG: gl.constexpr, PACKED: gl.constexpr,
                                   SYNC: gl.constexpr, DYNAMIC: gl.constexpr,
                                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    # Q: [buffer, warpgroup] double-buffered across items; O: one staging tile per warpgroup
    q_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_M, D], q_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, D], o_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # dynamic scheduling: the producer takes items from a global counter and passes them on through a 2-slot ring
    item_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(turn.index(i), count=1)
        mbarrier.init(item_ready.index(i), count=1)
        mbarrier.init(item_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_p_consumer_default, (o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                               v_empty, turn, O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, n_items,
                               half_alpha, scale, (COUNTER, item_smem, item_ready, item_empty),
                               BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, PACKED, SYNC, DYNAMIC)),
        (_p_consumer_worker, (o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                              v_empty, turn, O, stride_om, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, n_items,
                              half_alpha, scale, (COUNTER, item_smem, item_ready, item_empty),
                              BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, PINGPONG, PACKED, SYNC, DYNAMIC)),
        (_p_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                       v_empty, SEQ_OFFSETS, NUM_TARGETS, H, ROWS, MAX_N, n_items,
                       (COUNTER, item_smem, item_ready, item_empty), BLOCK_M, BLOCK_N, D, STAGES, HAS_TGT, DYNAMIC)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def gluon_supported(device=None) -> bool:
    """An sm90 (Hopper) CUDA device: the kernel uses wgmma, TMA and setmaxnreg."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0)


_SMS: dict = {}


def _num_sms(device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, d: int, dtype: torch.dtype):
    """The NVMMA shared layout of a [rows, d] tile (cached: building it costs several microseconds a call)."""
    return gl.NVMMASharedLayout.get_default_for([rows, d], _GL_DTYPES[dtype])


def _scheduling(cfg: dict, n_items: int, device) -> tuple:
    """(grid, dynamic) of a persistent launch: one CTA per SM at most; items from the global counter only when
    there are more items than CTAs (otherwise each CTA takes its own item, the same assignment, and the
    counter's allocation and memset, host time of every small call, are saved)."""
    grid = min(n_items, _num_sms(device))
    return (grid, ), bool(cfg["DYNAMIC"]) and n_items > grid


def _desc_2d(t: torch.Tensor, block_rows: int, layout) -> Desc:
    """TMA descriptor on the [L, H*D] 2-D view of a [L, H, D] tensor with unit stride on D and heads adjacent
    (a :class:`fastlaunch.Desc`: the gluon ``TensorDescriptor`` is built from it only on uncached launches)."""
    L, H, D = t.shape
    return Desc(t, [max(L, 1), H * D], [t.stride(0), 1], [block_rows, D], layout)


def _check(q, k, v, seq_offsets, num_targets, kwargs):
    unsupported = {k_: v_ for k_, v_ in kwargs.items() if v_ not in (None, 0, True)}
    if unsupported:
        raise NotImplementedError(f"gluon_forward: unsupported options {sorted(unsupported)}")
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise NotImplementedError("gluon_forward: q, k, v must be [L, H, D] of one shape (Dq = Dv)")
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(f"gluon_forward: bf16/fp16 only, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] != 128:
        raise NotImplementedError(f"gluon_forward: D = 128 only, got {q.shape[2]}")
    if seq_offsets.dim() != 1 or seq_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError("gluon_forward: seq_offsets must be a 1-D int32/int64 tensor")
    es = q.element_size()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise NotImplementedError(f"gluon_forward: {name} needs unit stride on D and heads adjacent "
                                      f"(stride(1) == D); got strides {tuple(t.stride())}")
        if t.data_ptr() % 16 or (t.stride(0) * es) % 16:
            raise NotImplementedError(f"gluon_forward: {name} needs a 16-byte aligned base and row stride (TMA)")
    if num_targets is not None and num_targets.shape[0] != seq_offsets.shape[0] - 1:
        raise ValueError("gluon_forward: num_targets must have one entry per sequence")


def gluon_forward(q, k, v, seq_offsets, max_seq_len: int, alpha: float, num_targets=None, *, config=None,
                  attn_scale=None, max_attn_len=0, contextual_seq_len=0, min_full_attn_seq_len=0, causal=True,
                  rab=None, intervals=None, checked=False):
    """HSTU attention forward ``[L, H, 128] -> [L, H, 128]`` (causal, optional targets, scale 1/max_seq_len).
    ``checked``: the caller (``ops/_gluon.route``) has already proven the call in scope; skip the checks."""
    if not checked:
        _check(q, k, v, seq_offsets, num_targets,
               dict(attn_scale=attn_scale, max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
                    min_full_attn_seq_len=min_full_attn_seq_len, rab=rab, intervals=intervals))
    if not causal:
        raise NotImplementedError("gluon_forward: causal=False")
    cfg = {**GLUON_CONFIG, **(config or {})}
    L, H, D = q.shape
    B = seq_offsets.shape[0] - 1
    out = new_tensor((L, H, D), q.dtype, q.device)
    if L == 0 or B <= 0 or max_seq_len <= 0:
        return out.zero_()
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    q_layout, kv_layout = _smem_layout(BM, D, q.dtype), _smem_layout(BN, D, q.dtype)
    q_desc = _desc_2d(q, BM, q_layout)
    k_desc = _desc_2d(k, BN, kv_layout)
    v_desc = _desc_2d(v, BN, kv_layout)
    n_blocks = -(-max_seq_len // (2 * BM))  # triton.cdiv is a constexpr_function: ~1.5 us a host call
    n_items = B * H * n_blocks
    tgt = num_targets if num_targets is not None else seq_offsets
    o_desc = _desc_2d(out, BM, q_layout)
    meta = dict(HAS_TGT=num_targets is not None, BLOCK_M=BM, BLOCK_N=BN, STAGES=cfg["STAGES"],
                PINGPONG=cfg["PINGPONG"], PACKED=cfg["PACKED"], SYNC=cfg["SYNC"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
                PRODUCER_REGS=cfg["PRODUCER_REGS"],
                num_warps=4, maxnreg=cfg["MAXNREG"])
    if cfg["PERSISTENT"]:
        grid, dynamic = _scheduling(cfg, n_items, q.device)
        counter = torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else seq_offsets
        meta["DYNAMIC"] = dynamic
        launch(_hstu_fwd_ws_persistent_kernel, grid,
               (q_desc, k_desc, v_desc, o_desc, out, seq_offsets, tgt, counter,
                out.stride(0), H, L, max_seq_len, n_items, 0.5 * float(alpha), 1.0 / max_seq_len), meta)
    else:
        launch(_hstu_fwd_ws_kernel, (n_items, ),
               (q_desc, k_desc, v_desc, o_desc, out, seq_offsets, tgt,
                out.stride(0), H, L, max_seq_len, 0.5 * float(alpha), 1.0 / max_seq_len), meta)
    return out
