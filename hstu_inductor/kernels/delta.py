"""Cached (delta) attention for up to ~128 new rows per sequence: row blocks, the key range split across programs.

With few new rows per sequence, the work of one (sequence, head) is one narrow row block that
streams the whole K/V cache: B * H programs, each reading ~n * (Dq + Dv) * 2 bytes. When these row
blocks leave program slots of the GPU empty, each is split into ``S`` programs over disjoint key ranges
(:func:`choose_split`: as many as one wave holds, so a split never adds a wave). HSTU has no softmax: the
output is a plain sum over keys, so the partial outputs add exactly, without a rescaling pass. Each
program writes its scaled fp32 partial ``[S, rows, H, Dv]``; the last of the ``S`` programs to finish (an
atomic counter per row block) sums them in the fixed order s = 0, 1, ... and writes the output. One
launch, and bitwise repeatable: the order does not depend on which program finishes last. ``S = 1``
stores straight into the output. Row block, key tile, pipeline and load path are a plan's
(``delta_plans.PLANS``, one table by rows; where it names none, the full forward's row blocks run).

Why one launch and one wave (H100, N=1024, B=128, H=4, 1 row, bf16; benchmarks/RESULTS.md, 2026-11-24). Split 2
with config (64, 3, 8) and the partials summed by a second launch (``fold=False``) ran as long as GR's kernel in ncu
(92.4 us, 84 % of DRAM bandwidth), but do_bench gave 0.107 against 0.101 ms: the difference was the second launch
and its buffer.
* The fold in the last program removes that launch. Its counters must be zero at launch: see
  :func:`_counters` for why a plain eager launch reuses a buffer (no memset) and a traced or captured one
  gets a fresh zeroed buffer (one small memset, no hidden state in a graph).
* No split when the row blocks fill the GPU. The default config (32, 3, 4) compiles to 96 registers and
  37 KB of shared memory (sm90, ``scripts/delta_occupancy.py``): an SM holds 5 programs, so 512 row blocks
  are one wave on 132 SMs and need no partials at all (GR's shape: 512 programs in one wave). (64, 3, 8)
  holds 3 (2 with the fold's code: ptxas then takes 98 registers instead of 80), so 512 programs are
  1.3 waves, which only a split fixes.
* Not taken: fp32 atomics into the output (the sum's order, hence its bits, would vary, and the output
  would need zeroing); thread-block clusters summing in distributed shared memory (one launch without
  counters, but not expressible in Triton 3.6).

Measured there: at 1 and 16 rows one wave of 512 programs without a split takes 0.1006 / 0.1010 ms (GR 0.1008 /
0.1014; (64, 3, 8) split 2: 0.107 / 0.112 in two launches, 0.104 / 0.110 folded). K+V is 254 MB, so 0.1006 ms is
2.5 TB/s, 75 % of 3.35 TB/s in do_bench time; the kernel's own DRAM throughput in ncu is 84-86 %.

17-128 rows (the full forward's row blocks ran at 0.89-0.97x GR at 64 and 128 rows, same source). At 128 rows one
(sequence, head) needs ~2 MFLOP of wgmma and 4096 MUFU tanh per 16 KB K/V tile, about the time the tile takes to
arrive at an SM's share of HBM bandwidth: the kernel is not bound by bytes alone, and overlapping one program's
silu with another's wgmma (several programs per SM) decides. Two switches cut registers so more fit:
``Q_SMEM`` (rows before a sequence's start masked in the load, not by ``tl.where``: q then feeds wgmma from
shared memory; 162 -> 148 registers at 64 rows) and ``TMA`` (K/V by device-side descriptors: no per-thread
addresses; 120 registers). Candidates and their occupancy: ``delta_plans.CANDIDATES``.

The key ranges, the element-wise mask and the silu are the full forward's own jit helpers, so every
mask option of cached attention means the same here.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import attention as A
from . import delta_plans as P
# jit helpers by name: Inductor re-emits a user kernel's source with the functions it names, not module aliases
# ("NameError: A is not defined" when a compiled graph launched this kernel on the H100)
from .attention_fwd import _fwd_inner
from .attention_jit import _bias_operands, _fwd_key_range, _id_end, _ids, _load_rows, _rows, _seq_bounds
from .. import _compat
from ..spec import AttentionSpec
from .. import config as options  # `config` is the tile argument of the functions here
from .common import address_source, interpret, launcher, new_tensor

__all__ = ["delta_attention_fwd", "delta_forward", "max_delta_rows", "choose_split"]

# (BLOCK_N, num_stages, num_warps). sm90 at 1-16 rows, split 1 / the fold (scripts/delta_occupancy.py):
# registers, shared KB, programs per SM: (32, 4, 8) 72-80, 53, 3; (64, 3, 8) 76-80 / 98, 70, 3 / 2;
# (64, 2, 8) 72-80, 38, 3; (32, 3, 4) 80-85 / 96, 37, 5; (128, 2, 8) 75 / 128, 72, 3 / 2. With two launches
# and split 2, (64, 3, 8) was the fastest on the H100 at 1 and 16 rows (0.107 / 0.111 ms against 0.110 / 0.116).
_CONFIGS = [(32, 4, 8), (64, 3, 8), (64, 2, 8), (32, 3, 4), (128, 2, 8)]


def max_delta_rows() -> int:
    """Delta rows per sequence up to which this kernel is used (beyond: the full forward's row blocks)."""
    return P.max_rows()


@triton.jit
def _hstu_delta_kernel(
    Q, K, V, O, P, CNT, SEQ_OFFSETS, NUM_TARGETS, ATTN_SCALE,
    stride_qm, stride_qh, stride_qd, stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
    stride_om, stride_oh, stride_od, stride_sm,
    alpha, scale_const,
    H, DQ, DV, ROWS, MAX_N, DELTA_ROWS, ML0, ML1, ML2, ML3, SPLIT, PLANE,
    MASK: tl.constexpr,
    SCALE_MODE: tl.constexpr, PARTIAL: tl.constexpr, FOLD: tl.constexpr, FAST: tl.constexpr, PREC: tl.constexpr,
    EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, Q_SMEM: tl.constexpr,
):
    alpha, scale_const = tl.cast(alpha, tl.float32), tl.cast(scale_const, tl.float32)  # fp64 under Inductor
    ml = (ML0, ML1, ML2, ML3)  # the mask lengths (attention_jit reads them)
    # program order: split fastest, then row block, then (sequence, head)
    pid = tl.program_id(0)
    s = pid % SPLIT
    rest = pid // SPLIT
    n_blocks = (DELTA_ROWS + BLOCK_M - 1) // BLOCK_M
    m_blk = rest % n_blocks
    bh = rest // n_blocks
    b = bh // H
    h = bh % H
    start, n = _seq_bounds(SEQ_OFFSETS, b, ROWS, MAX_N)
    pos0 = n - DELTA_ROWS
    q_row0 = b.to(tl.int64) * DELTA_ROWS
    r0 = m_blk * BLOCK_M
    M = _id_end(n, b, NUM_TARGETS, ml, MASK)
    offs_r = r0 + tl.arange(0, BLOCK_M)
    pos_m = pos0 + offs_r
    pi_m = _ids(pos_m, M, ml, MASK)

    q_base = Q + q_row0 * stride_qm + h * stride_qh
    if Q_SMEM:
        # rows before a short sequence's start masked in the load itself: q then feeds S = Q K^T from shared
        # memory (a computed q is a register operand: 32 more registers per thread per 64 rows)
        offs_dq = tl.arange(0, BLOCK_DQ)
        q = tl.load(q_base + offs_r[:, None].to(tl.int64) * stride_qm + offs_dq[None, :] * stride_qd,
                    mask=((offs_r < DELTA_ROWS) & (pos_m >= 0))[:, None] & (offs_dq < DQ)[None, :], other=0.0)
    else:
        q = _load_rows(q_base, r0, DELTA_ROWS, DQ, stride_qm, stride_qd, True, EVEN_DQ, False, BLOCK_M, BLOCK_DQ)
        q = tl.where((pos_m >= 0)[:, None], q, tl.zeros_like(q))  # rows before a short sequence's start
    # TMA: descriptors ending at row n (zero-filled past it), as in the full forward
    K_src = _rows(K + start * stride_km + h * stride_kh, n, DQ, stride_km, BLOCK_N, BLOCK_DQ, TMA)
    V_src = _rows(V + start * stride_vm + h * stride_vh, n, DV, stride_vm, BLOCK_N, BLOCK_DV, TMA)
    RB = _bias_operands(None, None, None, None, 0, MAX_N, b, h, start, 0, 0, 0, 0, 0, None, None, False, False, False, 0)

    m_first = tl.maximum(pos0 + r0, 0)
    m_last = tl.minimum(pos0 + r0 + BLOCK_M, n) - 1
    a, fs, fe, e = _fwd_key_range(m_first, m_last, n, M, ml, BLOCK_N, MASK)
    # this program's share of the visible key tiles [a, e): whole tiles, the first splits one tile longer
    tiles = (e - a) // BLOCK_N
    per = tiles // SPLIT
    extra = tiles % SPLIT
    lo = a + (s * per + tl.minimum(s, extra)) * BLOCK_N
    hi = lo + (per + (s < extra).to(tl.int32)) * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # the full forward's three segments (masked, full, masked), each cut to [lo, hi)
    acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd,
                       tl.maximum(a, lo), tl.minimum(fs, hi), pos_m, 0, pi_m, n, M, ml, alpha, DQ, DV, RB,
                       pos_m, pos_m, pos_m, True, MASK, TMA, FAST, PREC,
                       EVEN_DQ, EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, False, False, False, False, 0)
    acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd,
                       tl.maximum(fs, lo), tl.minimum(fe, hi), pos_m, 0, pi_m, n, M, ml, alpha, DQ, DV, RB,
                       pos_m, pos_m, pos_m, False, MASK, TMA, FAST, PREC,
                       EVEN_DQ, EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, False, False, False, False, 0)
    acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd,
                       tl.maximum(fe, lo), tl.minimum(e, hi), pos_m, 0, pi_m, n, M, ml, alpha, DQ, DV, RB,
                       pos_m, pos_m, pos_m, True, MASK, TMA, FAST, PREC,
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
    o_ptr = O + rows * stride_om + h * stride_oh + offs_d[None, :] * stride_od
    if PARTIAL:  # contiguous [SPLIT, B * DELTA_ROWS, H, DV] fp32, PLANE elements per split
        p0 = P + (rows * H + h) * DV + offs_d[None, :]
        tl.store(p0 + s.to(tl.int64) * PLANE, acc, mask=ok)
        if FOLD:
            # The last of the SPLIT programs of this row block to arrive sums the partials. Triton performs a
            # scalar atomic on one thread and broadcasts its result through shared memory (PTX: a predicated
            # atom.global.gpu.acq_rel.add; scripts/delta_occupancy.py --ptx). Release: the barrier orders all
            # threads' partial stores before that thread's atomic, whose gpu-scope release makes them visible
            # with it (cumulativity). Acquire: the increments are read-modify-writes, so they form one release
            # sequence; the last program's atomic reads its end and synchronizes with every earlier release, and
            # the barrier after it passes that on to all its threads, which then load the partials from L2 (.cg).
            # CUTLASS's split-K semaphore relies on the same. Summed in the fixed order s = 0, 1, ... whichever
            # program comes last: bitwise repeatable. (The interpreter runs programs one by one: only the GPU
            # tests exercise this under concurrency.)
            tl.debug_barrier()
            arrived = tl.atomic_add(CNT + rest, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                tl.debug_barrier()
                tl.store(o_ptr, _sum_partials(p0, PLANE, ok, SPLIT).to(O.dtype.element_ty), mask=ok)
                tl.store(CNT + rest, 0)  # zero again for the next launch (stream order makes it visible)
    else:
        tl.store(o_ptr, acc.to(O.dtype.element_ty), mask=ok)


@triton.jit
def _sum_partials(ptr, plane, mask, SPLIT):
    """The fp32 partials at ``ptr + s * plane`` summed in the order s = 0, 1, ..., SPLIT - 1 (deterministic).
    Loaded from L2 (.cg): other SMs wrote them."""
    acc = tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
    for _ in range(1, SPLIT):
        ptr += plane
        acc += tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _split_sum_kernel(P, O, numel, SPLIT, BLOCK: tl.constexpr):
    """The two-launch fold (``delta_forward(fold=False)``): O (contiguous) = the sum of the partials P[s]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    tl.store(O + offs, _sum_partials(P + offs, numel, ok, SPLIT).to(O.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=16)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_split(programs: int, key_tiles: int, slots: int) -> int:
    """Key splits per row block: as many as the ``slots`` (programs the GPU holds at once) take in one wave,
    so that a split never adds a wave, each split keeping >= 4 key tiles so a program still pipelines its
    loads, at most 16. Enough row blocks for the slots: no split, and no partials to fold."""
    return max(1, min(slots // max(programs, 1), key_tiles // 4, 16))


# (device, stream) -> int32 fold counters, zero between launches (the last program of a row block resets its
# counter). Only plain eager launches use them: see _counters.
_COUNTERS: dict = {}
CACHE_COUNTERS = True  # False: a zeroed buffer per call, as traced launches get (tests, benchmarks)


def _counters(n: int, device, *tensors) -> torch.Tensor:
    """``n`` zero int32 fold counters. A plain eager launch (``launcher`` calls the kernel directly) reuses a
    buffer per (device, stream), without a memset: launches on one stream run in order and each leaves its
    counters zero; another stream has its own buffer, so concurrent launches never share counters. A fresh
    zeroed buffer (one small memset) otherwise:
    * traced (torch.compile, export, AOTI): a cached tensor cannot enter a fake-tensor trace, and as a graph
      constant that the kernel mutates it would be shared by every graph and stream (and packaged by AOTI);
      the fresh buffer is an ordinary graph buffer, which CUDA-graph trees may reuse for other tensors
      between replays, so it could not be assumed zero either;
    * captured into a CUDA graph: replays may run beside eager launches of the capturing stream, and the
      cache may later replace (free) the buffer that the graph still addresses."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not CACHE_COUNTERS or capturing or not _compat.plain_eager(*tensors):
        return torch.zeros(n, dtype=torch.int32, device=device)
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        # a replaced buffer is freed in stream order, after the launches that used it
        buf = _COUNTERS[key] = torch.zeros(A._pow2(n), dtype=torch.int32, device=device)
    return buf


def delta_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                        max_attn_len=0, contextual_seq_len=0, *, tma=None, spec=None) -> torch.Tensor:
    """Cached attention (``attention.delta_hstu_attention_fwd``'s contract): this kernel with the plan that
    ``delta_plans.PLANS`` gives the rows per sequence, the full forward's row blocks where it gives none.
    ``spec``: the mask options at once (an ``AttentionSpec``), in place of the loose ones."""
    B = seq_offsets.shape[0] - 1
    D = delta_q.shape[0] // B if B > 0 else 0
    if B > 0 and 0 < D and D * B == delta_q.shape[0]:
        plan = P.default_plan(D, delta_q.dtype == torch.float32, max_seq_len)
        if plan is not None:
            return delta_forward(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                                 max_attn_len, contextual_seq_len, plan=plan, tma=tma, spec=spec)
    return A.delta_hstu_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                                      max_attn_len, contextual_seq_len, tma=tma, spec=spec)


def _plan_for(D, dtype, plan, config, max_seq_len=0):
    """``plan`` (default: ``PLANS``' (or ``LONG``'s) for D rows, or its last plan beyond them), with ``config`` ((BLOCK_N, stages,
    warps), or the ``config.delta_config`` (``HSTU_INDUCTOR_DELTA_CONFIG``) index into ``_CONFIGS``) replacing its
    tile and pipeline."""
    fp32 = dtype == torch.float32
    if plan is None:
        plan = P.default_plan(D, fp32, max_seq_len) or P.default_plan(P.max_rows(), fp32)
    elif fp32:  # fp32 tiles are twice as wide: the fp32 pipeline, whatever the plan
        plan = plan._replace(block_m=min(plan.block_m, P.FP32_MAX_BLOCK_M), **P.FP32)
    pick = options.get("delta_config")
    if config is None and pick is not None:
        config = _CONFIGS[pick]
    if config is not None:
        plan = plan._replace(block_n=config[0], stages=config[1], warps=config[2])
    return plan


def _use_tma(tma, plan, device, k, v) -> bool:
    """K/V descriptors: ``tma`` True / False forces them on / off (the op's ``config.tma``), None leaves it to
    the plan, where the device and the layout allow."""
    if tma is None and not plan.tma:
        return False
    return A._use_tma(tma, device, (k, v))


def delta_forward(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                  max_attn_len=0, contextual_seq_len=0, *, split=None, config=None, fold=True, plan=None,
                  tma=None, spec=None) -> torch.Tensor:
    """Cached attention (:func:`hstu_inductor.kernels.attention.delta_hstu_attention_fwd`'s contract) with this
    kernel. ``plan`` (a ``delta_plans.Plan``), ``split`` and ``config`` ((BLOCK_N, stages, warps)) override the
    automatic choices (tests, benchmarks); ``fold=False`` sums the partials in a second launch (for
    side-by-side benchmarks)."""
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
    spec = spec or AttentionSpec(True, max_attn_len, contextual_seq_len)
    flags = spec.kernel_flags(has_targets=num_targets is not None)
    bdq, bdv = A._block_d(Dq), A._block_d(Dv)
    plan = _plan_for(D, delta_q.dtype, plan, config, max_seq_len)
    use_tma = _use_tma(tma, plan, delta_q.device, k, v)
    n_blocks = -(-D // plan.block_m)
    programs = B * H * n_blocks
    if split is None:
        sms = 132 if delta_q.device.type != "cuda" else _num_sms(delta_q.device.index or 0)
        split = choose_split(_compat.size_hint(programs), -(-_compat.size_hint(max_seq_len) // plan.block_n),
                             sms * plan.per_sm)
    partial = split > 1
    fold = fold and partial
    # every split writes its whole partial (an empty key range writes zeros), so new_tensor's test poison
    # shows a missing write
    part = new_tensor((split, rq, H, Dv), torch.float32, delta_q.device) if partial else None
    plane = rq * H * Dv
    with A._device_ctx(delta_q.device):
        if use_tma:
            A._ensure_allocator()
        cnt = _counters(programs, delta_q.device, delta_q, k, v) if fold else None
        args = (delta_q, k, v, out, part, cnt, seq_offsets, num_targets, scale_t,
                *delta_q.stride(), *k.stride(), *v.stride(), *out.stride(), stride_s,
                float(alpha), float(scale_const), H, Dq, Dv, k.shape[0], max_seq_len, D,
                *spec.kernel_lengths(), split, plane)
        kwargs = dict(flags, SCALE_MODE=scale_mode, PARTIAL=partial, FOLD=fold,
                      FAST=A._fast_silu(delta_q.dtype, delta_q.device), PREC=A._prec(delta_q.dtype), EVEN_DQ=bdq == Dq,
                      EVEN_DV=bdv == Dv, BLOCK_DQ=bdq, BLOCK_DV=bdv, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                      TMA=use_tma, Q_SMEM=plan.qsmem)
        kern = launcher(_hstu_delta_kernel, args)
        if plan.maxnreg and kern is _hstu_delta_kernel and not interpret():
            # a direct launch only: wrap_triton takes no maxnreg, and Inductor's user-kernel configs drop it
            # (torch 2.13 config_to_dict), so a traced launch runs uncapped (same result, fewer programs per SM)
            kwargs["maxnreg"] = plan.maxnreg
        kern[(programs * split,)](*args, **kwargs, num_warps=plan.warps, num_stages=plan.stages)
        if partial and not fold:
            block = 1024 if interpret() else 2048
            sargs = (part, out, plane, split)
            launcher(_split_sum_kernel, sargs)[(triton.cdiv(plane, block),)](*sargs, BLOCK=block)
    return out
