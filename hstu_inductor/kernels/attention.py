"""Triton kernels for jagged HSTU attention (forward, backward, cached/delta forward).

Math (HSTU_SEMANTICS.md): ``out_i = s_i * sum_j valid(i, j) * silu(alpha * <q_i, k_j>) * v_j`` per head,
with no softmax. ``valid`` is built on ids ``pi(p)`` (contextual prefix collapsed to id 0, all targets
sharing id ``M``); see :func:`_valid` for the element-wise mask and :func:`_fwd_key_range` /
:func:`_bwd_query_range` for the conservative block-skipping bounds derived from it.

Layout: ``q, k: [L, H, Dq]``, ``v: [L, H, Dv]`` jagged by ``seq_offsets: [B+1]`` and addressed with
their real strides (they are often views of a fused projection). Every program handles one
``(sequence, head, row block)``.

Two memory paths, chosen by ``tma``:
  * pointer loads (any strides, any GPU, the Triton interpreter);
  * device-side tensor descriptors (``tl.make_tensor_descriptor``, TMA on sm90+), one descriptor
    per (sequence, head) whose shape ends at the sequence's last row: loads past it are zero-filled
    by the hardware and stores past it are dropped, so no row masks are needed.
Both go through one code path, :func:`_rows` / :func:`_load_rows` / :func:`_store_rows`: the
kernels never branch on ``TMA`` themselves.

Backward: one program per key block keeps dK/dV in registers and walks the query blocks that can
see it. dQ is either
  * "atomic": accumulated with fp32 atomics (pointer atomics by default; TMA reduce-add and
    vectorized ``red.v2`` via HSTU_INDUCTOR_DQ_MODE=2/3) into an fp32 buffer, scaled and cast once, or
  * "split" (the default): computed by a second kernel that walks key blocks per query block (no
    atomics, bitwise repeatable); it measured as fast or faster at every N on H100
    (HSTU_INDUCTOR_BWD_ALGO=atomic overrides unless ``deterministic=True``).

Optional, behind constexpr switches (off: the compiled kernels are unchanged, scripts/ptx_unchanged.py):
a dense relative attention bias added before the silu (``HAS_RAB``; its gradient ``RAB_GRAD`` written
by the dK/dV kernel) and interval masks replacing the HSTU mask (``HAS_IV``, with per-block tile
skipping). See docs/semantics.md and docs/kernels.md.

Program order: the row blocks of one (sequence, head) are adjacent programs of a 1-D grid
(:func:`_tile`), so the CTAs resident at once share their K/V (or Q/dO) tiles in L2.

Tuning knobs (``hstu_inductor.config``, each with its environment variable; docs/options.md): ``autotune``
(HSTU_INDUCTOR_AUTOTUNE=0: one default config, no autotuning), ``silu`` (HSTU_INDUCTOR_SILU=exact|tanh|packed),
``dq_mode`` (HSTU_INDUCTOR_DQ_MODE=1|2|3), ``bwd_algo`` (HSTU_INDUCTOR_BWD_ALGO=atomic|split), ``tile_order``
(HSTU_INDUCTOR_TILE_ORDER=seq|block). See docs/kernels.md.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _compat, config
from .common import interpret as _interpret
from .common import address_source
from .common import launcher as _launcher
from .common import new_tensor
from ..reference.rab import default_time_bucket_bounds

log = logging.getLogger("hstu_inductor")

__all__ = [
    "hstu_attention_fwd",
    "hstu_attention_bwd",
    "delta_hstu_attention_fwd",
    "tma_supported",
]


# --------------------------------------------------------------------------------------------
# Element-wise helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _ids(p, c, M, HAS_CTX: tl.constexpr, HAS_TGT: tl.constexpr):
    """pi(p): contextual prefix -> id 0, targets -> id M (M already holds the target shift)."""
    if HAS_CTX:
        x = tl.maximum(p - c + 1, 0)
    else:
        x = p
    if HAS_TGT:
        x = tl.minimum(x, M)
    return x


@triton.jit
def _seq_bounds(SEQ_OFFSETS, b, rows, max_n):
    """(start, n) of sequence b, clamped to 0 <= start <= rows and 0 <= n <= min(rows - start, max_n):
    any offsets (decreasing, negative, past L) or lengths past max_seq_len then address only rows of
    the tensors. The identity for valid inputs (the ops check those; config.check_inputs)."""
    start = tl.load(SEQ_OFFSETS + b).to(tl.int64)
    end = tl.load(SEQ_OFFSETS + b + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), rows)
    end = tl.minimum(tl.maximum(end, start), rows)
    return start, tl.minimum(end - start, max_n).to(tl.int32)


@triton.jit
def _id_end(n, b, NUM_TARGETS, CTX, HAS_CTX: tl.constexpr, HAS_TGT: tl.constexpr):
    """M, the end of ids of a sequence of length n; its target count is clamped to [0, n]."""
    if HAS_CTX:
        M = n - CTX + 1
    else:
        M = n
    if HAS_TGT:
        M = M - tl.minimum(tl.maximum(tl.load(NUM_TARGETS + b).to(tl.int32), 0), n)
    return M


@triton.jit
def _valid(i, j, pi_i, pi_j, n, M, w, f, CAUSAL: tl.constexpr, HAS_CTX: tl.constexpr,
           HAS_WINDOW: tl.constexpr, HAS_MINFULL: tl.constexpr):
    """valid(i, j) for raw positions i (queries) and j (keys) of one sequence of length n."""
    ok = (i < n) & (j < n) & (i >= 0)
    if CAUSAL:
        d = pi_i - pi_j
        v = (i == j) | (d > 0)
        if HAS_WINDOW:
            win = d <= w
            if HAS_MINFULL:
                win = win | (pi_i >= M - f)
            v = v & win
        if HAS_CTX:
            v = v | ((pi_i == 0) & (pi_j < M))
        ok = ok & v
    return ok


@triton.jit
def _rab_tile(RAB_b, rows, cols, n, stride_ri, stride_rj):
    """rab[i, j] of one (sequence, head) for the position vectors ``rows`` (i, [:, None]-shaped) and
    ``cols`` (j), zero outside the sequence, in fp32. Strides are 0 along broadcast dims."""
    return tl.load(RAB_b + rows.to(tl.int64) * stride_ri + cols.to(tl.int64) * stride_rj,
                   mask=(rows < n) & (cols < n), other=0.0).to(tl.float32)


@triton.jit
def _bias_operands(RAB, TS, POSW, TSW, NB, MAX_N, b, h, start, stride_rb, stride_rh, stride_ri, stride_rj, TSB, TSP,
                   HAS_RAB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr):
    """The bias operands of sequence b, head h as one tuple for :func:`_bias`; 0 stands for an absent
    (None) pointer (a tuple cannot hold None). ``HAS_TS``: 1 for jagged ``[L]`` timestamps, 2 for dense ``[B, N]``. ``TSP``: the time-bucket guess (slope, offset, usable) fitted to
    the thresholds ``TSB``, then the thresholds in fp32 (:func:`_ts_plan`, :func:`_time_bucket`)."""
    RAB_b = 0
    TS_b = 0
    POS_t = 0
    TSW_t = 0
    TSB_t = 0
    TSP_t = 0
    slope = 0.0
    off = 0.0
    fits = 0.0
    if HAS_RAB:
        RAB_b = RAB + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh
    if HAS_POS:
        POS_t = POSW
    if HAS_TS:
        if HAS_TS == 2:  # dense [B, N] timestamps (a padded input): row b starts at b * N
            TS_b = TS + b.to(tl.int64) * MAX_N
        else:  # jagged [L]
            TS_b = TS + start
        TSW_t = TSW
        TSB_t = TSB
        TSP_t = TSP
        slope = tl.load(TSP)
        off = tl.load(TSP + 1)
        fits = tl.load(TSP + 2)
    return (RAB_b, stride_ri, stride_rj, TS_b, POS_t, TSW_t, NB, MAX_N, TSB_t, TSP_t, slope, off, fits)


@triton.jit
def _bucket_search(x, TSB, NB, TS_STEPS: tl.constexpr):
    """#{k : x >= TSB[k]} by binary search over the sorted thresholds, in x's dtype: TS_STEPS gathers."""
    bk = tl.zeros(x.shape, dtype=tl.int32)
    for s in tl.static_range(TS_STEPS):
        cand = bk + (1 << (TS_STEPS - 1 - s))
        ok = cand <= NB
        thr = tl.load(TSB + (cand - 1), mask=ok, other=0)
        bk = tl.where(ok & (x >= thr), cand, bk)
    return bk


@triton.jit
def _time_bucket(tsn, tsj, TSB, TSP, NB, slope, off, fits, TS_STEPS: tl.constexpr):
    """#{k : |tsn - tsj| >= TSB[k]} exactly, the gap taken in the timestamps' dtype (int32/int64/fp32/fp64), on
    the tile broadcast from the row and column vectors ``tsn``, ``tsj`` (``TSB``: sorted thresholds, int64 for
    integer gaps, else the gaps' dtype; ``TSP[3:]`` the same in fp32 and a NaN; both tiny and L1-resident).

    Per element the fast path keeps only 32-bit values (64-bit values per score element spill, sm90): the gap
    is rounded to fp32 once (xf); the guess ``c = clamp(floor(slope * log2(xf) + off), 0, NB)`` (monotone) is
    the bucket or the one below it (:func:`_ts_plan` checked both ends of every bucket), and one gather of
    the next fp32 threshold decides which. Rounding is monotone, so ``xf != fp32(t)`` decides ``x >= t``; an
    fp32 gap, or an integer one below 2**24, is exact, so only a tie above it (or an fp64 gap) is
    ambiguous: a tile with one (rare) redoes its buckets by a binary search in the native dtype, as do all
    tiles when the thresholds do not follow the log-linear guess (``fits == 0``, one flag per call)."""
    if fits != 0.0:
        xf = tl.abs(tsn - tsj).to(tl.float32)
        u = tl.log2(xf) * slope + off
        u = tl.where(u > 0.0, u, 0.0)  # also NaN (a negative int gap, |INT_MIN|) and -inf (x = 0)
        c = tl.minimum(u, NB.to(tl.float32)).to(tl.int32)
        t = tl.load(TSP + 3 + c)  # TSP[3 + NB] is NaN: never reached
        bk = c + (xf >= t).to(tl.int32)
        if tsn.dtype != tl.float32:
            tie = xf == t
            if tsn.dtype != tl.float64:
                tie = tie & (xf >= 16777216.0)  # below 2**24 integers are exact in fp32: a tie is equality
            if tl.max(tl.max(tie.to(tl.int32), axis=1), axis=0) > 0:
                bk = _bucket_search(tl.abs(tsj - tsn), TSB, NB, TS_STEPS)  # (tsj - tsn: not CSE'd with xf's)
    else:
        bk = _bucket_search(tl.abs(tsn - tsj), TSB, NB, TS_STEPS)
    return bk


@triton.jit
def _bias(RB, rows, cols, n, HAS_RAB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr,
          TS_STEPS: tl.constexpr):
    """(bias, bucket) on a tile, fp32, zero outside the sequence: the dense rab plus the table bias
    ``pos_w[N-1+j-i] + ts_w[bucket(ts(next(i)) - ts(j))]`` (docs/semantics.md). ``rows`` (i) and ``cols``
    (j) are broadcastable position vectors. The bucket tile (int32, 0 without HAS_TS) feeds d ts_w."""
    RAB_b, stride_ri, stride_rj, TS_b, POSW, TSW, NB, MAXN, TSB, TSP, slope, off, fits = RB
    inside = (rows < n) & (cols < n)
    bk = 0
    if HAS_RAB:
        x = _rab_tile(RAB_b, rows, cols, n, stride_ri, stride_rj)
    else:
        x = tl.where(inside, 0.0, 0.0)
    if HAS_POS:
        x += tl.load(POSW + (MAXN - 1 + cols - rows), mask=inside, other=0.0).to(tl.float32)
    if HAS_TS:
        # next(i) = min(i + 1, N - 1) on padded positions; padding has timestamp 0 (so the last row of a
        # shorter sequence is compared with 0, as in reference.relative_bias)
        nx = tl.minimum(rows + 1, MAXN - 1)
        if HAS_TS == 2:  # dense timestamps: next(i) reads the user's own padding (any value)
            tsn = tl.load(TS_b + nx, mask=nx >= 0, other=0)
        else:
            tsn = tl.load(TS_b + nx, mask=nx < n, other=0)
        tsj = tl.load(TS_b + cols, mask=cols < n, other=0)
        # the difference in the timestamps' dtype (as the reference), bucketed by thresholds
        bk = _time_bucket(tsn, tsj, TSB, TSP, NB, slope, off, fits, TS_STEPS)
        x += tl.load(TSW + bk, mask=inside, other=0.0).to(tl.float32)
    return x, bk


@triton.jit
def _pre_silu(s, alpha, RB, rows, cols, n, HAS_RAB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr,
              TS_STEPS: tl.constexpr):
    """(x, a, bucket) with silu(a * x) the score: (s, alpha, 0) without a bias (the bias-free arithmetic),
    else (alpha * s + bias, 1, bucket)."""
    if HAS_RAB or HAS_POS or HAS_TS:
        x, bk = _bias(RB, rows, cols, n, HAS_RAB, HAS_POS, HAS_TS, TS_STEPS)
        return s * alpha + x, 1.0, bk
    else:
        return s, alpha, 0


@triton.jit
def _bias_grad(ds, bk, hist, RB, GB, offs_m, offs_n, start_m, n, RAB_GRAD: tl.constexpr, TAB_GRAD: tl.constexpr,
               HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               TS_STEPS: tl.constexpr):
    """Bias gradients from one transposed dS tile ``ds[j, i]`` (keys ``offs_n`` x queries ``offs_m``, zero
    where invalid). RAB_GRAD 1: store d rab (each element has one writer); 2: fp32 atomics into a buffer
    of rab's broadcast shape (strides 0 on broadcast dims). TAB_GRAD: d pos_w by diagonal sums, atomics into
    this program's copy; d ts_w into ``hist``, this program's per-bucket sums in registers (returned; the
    kernel adds it to its copy once, at the end): never an atomic per score element.

    Mutation analysis (torch's triton_kernel_wrap, what AOTAutograd functionalizes by): an address written
    here must not depend on a value returned by a helper that received input pointers (it then counts all of
    them as written: pos_w / ts_w as leaves mutated in place). So the bucket ``bk`` (from :func:`_pre_silu`)
    only indexes registers, and N comes in GB (a kernel argument), not RB (:func:`_bias_operands`' result)."""
    DRAB_b, stride_gi, stride_gj, DPOS, DTS, gsc, MAXN = GB
    NB = RB[6]
    g = ds.to(tl.float32) * gsc
    if RAB_GRAD != 0:
        # 32-bit offsets from the (b, h) base (the buffer is ours, N^2 < 2^31): 64-bit per-element pointers
        # cost ~2 registers per element of the tile (spills measured offline, sm90)
        ptrs = DRAB_b + (offs_m[None, :] * stride_gi + offs_n[:, None] * stride_gj)
        inside = (offs_m[None, :] < n) & (offs_n[:, None] < n)
        if RAB_GRAD == 1:
            tl.store(ptrs, g.to(DRAB_b.dtype.element_ty), mask=inside)
        else:
            tl.atomic_add(ptrs, g, mask=inside, sem="relaxed")
    if TAB_GRAD:
        if HAS_POS:
            # diagonal sums: skew the tile (column i rotated by i) so each row holds one diagonal j - i,
            # then one row-sum per wrap-around: BLOCK_N atomics per wrap instead of one per element
            t = tl.arange(0, BLOCK_N)[:, None] + tl.arange(0, BLOCK_M)[None, :]
            sk = tl.gather(g, t % BLOCK_N, 0)  # sk[r, i] = g[(r + i) % BLOCK_N, i]: j - i = r - BLOCK_N * wrap
            for wv in tl.static_range((BLOCK_M + BLOCK_N - 2) // BLOCK_N + 1):
                part = tl.sum(tl.where(t // BLOCK_N == wv, sk, 0.0), axis=1)
                idx = MAXN - 1 + offs_n - start_m - wv * BLOCK_N
                tl.atomic_add(DPOS + idx, part, mask=(idx >= 0) & (idx < 2 * MAXN - 1), sem="relaxed")
        if HAS_TS:
            # one masked tile sum per bucket present in the tile (few off the diagonal: log buckets)
            nz = g != 0.0
            k_lo = tl.min(tl.where(nz, bk, NB))
            k_hi = tl.max(tl.where(nz, bk, 0))
            slots = tl.arange(0, 1 << TS_STEPS)
            for kk in range(k_lo, k_hi + 1):
                hist += tl.where(slots == kk, tl.sum(tl.where(bk == kk, g, 0.0)), 0.0)
    return hist


@triton.jit
def _iv_valid(i, j, x0, x1, x2, n):
    """Interval mask (it replaces the HSTU mask): key j visible to row i iff j in [0, x0) | [x1, x2), j < n."""
    return (i < n) & (j < n) & ((j < x0) | ((j >= x1) & (j < x2)))


@triton.jit
def _row_tile_mask(pos_m, offs_n, pi_m, x0, x1, x2, n, M, c, w, f, CAUSAL: tl.constexpr, HAS_CTX: tl.constexpr,
                   HAS_TGT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MINFULL: tl.constexpr, HAS_IV: tl.constexpr):
    """Visibility of a [BLOCK_M, BLOCK_N] tile with query rows ``pos_m`` (ids ``pi_m``) and keys ``offs_n``: the
    interval mask with intervals, else the HSTU mask (the forward's and dQ's loops; dK/dV's tile is transposed)."""
    if HAS_IV:
        return _iv_valid(pos_m[:, None], offs_n[None, :], x0[:, None], x1[:, None], x2[:, None], n)
    pi_n = _ids(offs_n, c, M, HAS_CTX, HAS_TGT)
    return _valid(pos_m[:, None], offs_n[None, :], pi_m[:, None], pi_n[None, :], n, M, w, f, CAUSAL, HAS_CTX,
                  HAS_WINDOW, HAS_MINFULL)


@triton.jit
def _iv_rows(IV_h, row0, offs, nrows, stride_ir, stride_ic):
    """(x0, x1, x2) int32 vectors of rows ``row0 + offs`` (zeros, i.e. nothing visible, past ``nrows``)."""
    ptr = IV_h + (row0 + offs).to(tl.int64) * stride_ir
    m = offs < nrows
    x0 = tl.load(ptr, mask=m, other=0).to(tl.int32)
    x1 = tl.load(ptr + stride_ic, mask=m, other=0).to(tl.int32)
    x2 = tl.load(ptr + 2 * stride_ic, mask=m, other=0).to(tl.int32)
    return x0, x1, x2


@triton.jit
def _iv_key_range(x0, x1, x2, n, BLOCK_N: tl.constexpr):
    """Key tiles a query block with row intervals (x0, x1, x2) can see: [0, a) and [b, e), multiples of
    BLOCK_N (b >= a). Tiles in [a, b) are invisible to every row: past every x0 and before every x1."""
    hi0 = tl.minimum(tl.maximum(tl.max(x0, axis=0), 0), n)
    has2 = x2 > x1
    lo1 = tl.minimum(tl.maximum(tl.min(tl.where(has2, x1, n), axis=0), 0), n)
    hi2 = tl.minimum(tl.maximum(tl.max(tl.where(has2, x2, 0), axis=0), 0), n)
    a = (hi0 + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    b = tl.maximum(lo1 // BLOCK_N * BLOCK_N, a)
    e = (hi2 + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return a, b, e


@triton.jit
def _tanh_approx(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _silu(s, alpha, FAST: tl.constexpr):
    """silu(alpha * s). FAST: 0.5x(1 + tanh(0.5x)) with one MUFU op (16-bit inputs on GPU only)."""
    if FAST:
        hx = s * (0.5 * alpha)
        return hx + hx * _tanh_approx(hx)
    else:
        x = s * alpha
        return x / (1.0 + tl.exp2(x * -1.4426950408889634))


@triton.jit
def _silu_packed(hx):
    """silu(2 hx) = hx + hx * tanh(hx) on packed 16-bit pairs (one MUFU op and one FMA per 2 elements)."""
    if hx.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; tanh.approx.bf16x2 t, $1; fma.rn.bf16x2 $0, $1, t, $1; }",
            "=r,r", [hx], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; tanh.approx.f16x2 t, $1; fma.rn.f16x2 $0, $1, t, $1; }",
            "=r,r", [hx], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _silu_bwd_packed(hx, dp):
    """(silu(2 hx), dp * silu'(2 hx)) on packed 16-bit pairs."""
    if hx.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, h, nh, sg, om, g; mov.b32 h, 0x3F003F00; mov.b32 nh, 0xBF00BF00; "
            "tanh.approx.bf16x2 t, $2; fma.rn.bf16x2 $0, $2, t, $2; fma.rn.bf16x2 sg, t, h, h; "
            "fma.rn.bf16x2 om, t, nh, h; fma.rn.bf16x2 g, $0, om, sg; mul.rn.bf16x2 $1, $3, g; }",
            "=r,=r,r,r", [hx, dp], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, h, nh, sg, om, g; mov.b32 h, 0x38003800; mov.b32 nh, 0xB800B800; "
            "tanh.approx.f16x2 t, $2; fma.rn.f16x2 $0, $2, t, $2; fma.rn.f16x2 sg, t, h, h; "
            "fma.rn.f16x2 om, t, nh, h; fma.rn.f16x2 g, $0, om, sg; mul.rn.f16x2 $1, $3, g; }",
            "=r,=r,r,r", [hx, dp], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _silu_and_grad(s, alpha, FAST: tl.constexpr):
    """(silu(x), silu'(x)) for x = alpha * s; silu'(x) = sig(x) * (1 + x * (1 - sig(x)))."""
    if FAST:
        hx = s * (0.5 * alpha)
        t = _tanh_approx(hx)
        sig = 0.5 + 0.5 * t
        y = hx + hx * t
    else:
        x = s * alpha
        sig = 1.0 / (1.0 + tl.exp2(x * -1.4426950408889634))
        y = x * sig
    return y, sig + y * (1.0 - sig)


@triton.jit
def _tile(span, BLOCK: tl.constexpr, LAST_FIRST: tl.constexpr, SEQ_MAJOR: tl.constexpr):
    """(b * H + h, row block) of this program in a 1-D grid of B * H * cdiv(span, BLOCK) programs.

    SEQ_MAJOR: the row blocks of one (sequence, head) are adjacent programs, so the CTAs resident at
    once share K/V (fwd, dQ) or Q/dO (dK/dV) through L2; otherwise one block of every (sequence, head)
    comes before the next block, and each K/V tile is re-read from DRAM by every row block.
    LAST_FIRST: the last row block (the most keys under a causal mask) of a (sequence, head) first.
    """
    pid = tl.program_id(0)
    n_blocks = (span + BLOCK - 1) // BLOCK
    if SEQ_MAJOR:
        bh = pid // n_blocks
        blk = pid % n_blocks
    else:
        n_bh = tl.num_programs(0) // n_blocks
        bh = pid % n_bh
        blk = pid // n_bh
    if LAST_FIRST:
        blk = n_blocks - 1 - blk
    return bh, blk


# --------------------------------------------------------------------------------------------
# Block-skipping bounds (conservative; the element-wise mask is exact inside masked blocks)
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_key_range(m_first, m_last, n, M, c, w, f, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_CTX: tl.constexpr, HAS_TGT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_MINFULL: tl.constexpr):
    """Key ranges for the query rows [m_first, m_last] (raw positions).

    Returns (a, fs, fe, e), multiples of BLOCK_N: keys in [a, fs) and [fe, e) need the mask, keys in
    [fs, fe) are valid for every query row of the block, keys outside [a, e) are invalid for all.
    """
    if CAUSAL:
        if HAS_CTX:
            c1 = c - 1
        else:
            c1 = 0
        P = _ids(m_first, c, M, HAS_CTX, HAS_TGT)
        Pmax = _ids(m_last, c, M, HAS_CTX, HAS_TGT)
        hi = m_last + 1  # causal: j <= i
        lo = m_last * 0
        full_lo = m_last * 0
        if HAS_WINDOW:
            # valid j needs pi(j) >= pi(i) - w >= P - w, and pi(j) <= max(j - c1, 0)
            lo = tl.where(P - w > 0, P - w + c1, 0)
            qw = Pmax - w
            full_lo = tl.where(qw > 0, qw + c1, 0)
            if HAS_MINFULL:  # rows with pi >= M - f ignore the window
                lo = tl.where(Pmax >= M - f, 0, lo)
                full_lo = tl.where(P >= M - f, 0, full_lo)
        # every j with pi(j) < P is strictly before every row of the block (d > 0)
        full_hi = tl.where(P > 0, P + c1, 0)
        if HAS_CTX:  # contextual rows (pi == 0) see the whole non-target history
            is_ctx = P == 0
            lo = tl.where(is_ctx, 0, lo)
            hi = tl.where(is_ctx, n, hi)
    else:
        lo = n * 0
        hi = n
        full_lo = n * 0
        full_hi = n
    a = lo // BLOCK_N
    e = (hi + BLOCK_N - 1) // BLOCK_N
    fs = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N, a), e)
    fe = tl.minimum(tl.maximum(full_hi // BLOCK_N, fs), e)
    return a * BLOCK_N, fs * BLOCK_N, fe * BLOCK_N, e * BLOCK_N


@triton.jit
def _bwd_query_range(n0, n, M, c, w, f, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     HAS_CTX: tl.constexpr, HAS_TGT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     HAS_MINFULL: tl.constexpr):
    """Query ranges that can see the key rows [n0, n0 + BLOCK_N) (raw positions).

    Returns (cb, qa, qf, qe, qz), multiples of BLOCK_M: rows [0, cb) (contextual prefix) and
    [qa, qf), [qe, qz) need the mask; rows [qf, qe) see every key of the block.
    """
    if CAUSAL:
        if HAS_CTX:
            c1 = c - 1
            cb = (c + BLOCK_M - 1) // BLOCK_M
        else:
            c1 = 0
            cb = n * 0
        j_last = tl.minimum(n0 + BLOCK_N, n) - 1
        qhi = n
        if HAS_WINDOW:
            if not HAS_MINFULL:
                x = _ids(j_last, c, M, HAS_CTX, HAS_TGT) + w  # rows need pi(i) <= pi(j_last) + w
                qhi = tl.minimum(n, x + c1 + 1)
                if HAS_TGT:
                    qhi = tl.where(x >= M, n, qhi)
        qa = tl.maximum(n0 // BLOCK_M, cb)
        qz = (qhi + BLOCK_M - 1) // BLOCK_M
        # full rows: pi(i) >= max(n0 + BLOCK_N - c1, 1) (keys strictly earlier), rows complete
        qf = (tl.maximum(n0 + BLOCK_N, c1 + 1) + BLOCK_M - 1) // BLOCK_M
        qe = n // BLOCK_M
        if HAS_TGT:
            qe = tl.where(n0 + BLOCK_N - c1 > M, qf, qe)
        if HAS_WINDOW:
            if HAS_MINFULL:
                qe = qf
            else:
                y = _ids(n0, c, M, HAS_CTX, HAS_TGT) + w  # whole block in window: pi(last row) <= y
                qe_w = (y + c1 + 1) // BLOCK_M
                if HAS_TGT:
                    qe_w = tl.where(y >= M, qe, qe_w)
                qe = tl.minimum(qe, qe_w)
        qe = tl.where(n0 + BLOCK_N > n, qf, qe)
    else:
        cb = n * 0
        qa = n * 0
        qz = (n + BLOCK_M - 1) // BLOCK_M
        qf = n * 0
        qe = tl.where(n0 + BLOCK_N <= n, n // BLOCK_M, 0)
    qf = tl.minimum(tl.maximum(qf, qa), qz)
    qe = tl.minimum(tl.maximum(qe, qf), qz)
    return cb * BLOCK_M, qa * BLOCK_M, qf * BLOCK_M, qe * BLOCK_M, qz * BLOCK_M


# --------------------------------------------------------------------------------------------
# Row tiles of a [n, D] operand: one code path for descriptors (TMA) and pointers
# --------------------------------------------------------------------------------------------


@triton.jit
def _rows(base, n, D, stride_m, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """The [n, D] operand of one (sequence, head) at ``base`` (row stride ``stride_m``): a device-side
    tensor descriptor ending at row n (TMA: zero-filled loads and dropped stores past it), or the
    pointer itself."""
    if TMA:
        src = tl.make_tensor_descriptor(base, shape=[n, D], strides=[stride_m, 1], block_shape=[BLOCK, BLOCK_D])
    else:
        src = base
    return src


@triton.jit
def _load_rows(src, r0, n, D, stride_m, stride_d, MASKED: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr,
               BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [r0, r0 + BLOCK) of ``_rows(...)``, zeros outside [n, D]. Pointer loads mask the rows only
    when MASKED (the full blocks of the key loops lie inside the sequence), the columns unless EVEN_D."""
    if TMA:
        x = src.load([r0, 0])
    else:
        offs = r0 + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = src + offs[:, None].to(tl.int64) * stride_m + offs_d[None, :] * stride_d
        if MASKED:
            x = tl.load(ptrs, mask=(offs[:, None] < n) & (offs_d[None, :] < D), other=0.0)
        elif EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return x


@triton.jit
def _store_rows(dst, r0, x, n, D, stride_m, stride_d, TMA: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Rows [r0, r0 + BLOCK) of ``x`` into ``_rows(...)``; nothing outside [n, D] is written."""
    if TMA:
        dst.store([r0, 0], x)
    else:
        offs = r0 + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(dst + offs[:, None].to(tl.int64) * stride_m + offs_d[None, :] * stride_d, x,
                 mask=(offs[:, None] < n) & (offs_d[None, :] < D))


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, lo, hi, pos_m, pi_m,
               n, M, c, w, f, alpha, DQ, DV, RB, x0, x1, x2,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_CTX: tl.constexpr, HAS_TGT: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_MINFULL: tl.constexpr, TMA: tl.constexpr, FAST: tl.constexpr,
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
        s, a, bk = _pre_silu(s, alpha, RB, pos_m[:, None], offs_n[None, :], n, HAS_RAB, HAS_POS, HAS_TS, TS_STEPS)
        if FAST == 2:
            p = _silu_packed((s * (0.5 * a)).to(v.dtype))
        else:
            p = _silu(s, a, FAST).to(v.dtype)
        if MASKED:
            ok = _row_tile_mask(pos_m, offs_n, pi_m, x0, x1, x2, n, M, c, w, f, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW,
                                HAS_MINFULL, HAS_IV)
            p = tl.where(ok, p, 0.0)
        acc = tl.dot(p, v, acc, input_precision=PREC)
    return acc


@triton.jit
def _hstu_fwd_kernel(
    Q, K, V, O, SEQ_OFFSETS, NUM_TARGETS, ATTN_SCALE,
    stride_qm, stride_qh, stride_qd, stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
    stride_om, stride_oh, stride_od, stride_sm,
    alpha, scale_const, one,
    H, DQ, DV, ROWS, MAX_N, DELTA_ROWS, CTX, WINDOW, MINFULL, N_BUCKET,
    RAB, stride_rb, stride_rh, stride_ri, stride_rj, IV, stride_ih, stride_ir, stride_ic,
    TS, POSW, TSW, NB, TSB, TSP,
    CAUSAL: tl.constexpr, HAS_TGT: tl.constexpr, HAS_CTX: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_MINFULL: tl.constexpr, SCALE_MODE: tl.constexpr, DELTA: tl.constexpr, TMA: tl.constexpr,
    FAST: tl.constexpr, PREC: tl.constexpr, EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEQ_MAJOR: tl.constexpr = True, Q_IN_REGS: tl.constexpr = False,
    HAS_RAB: tl.constexpr = False, HAS_IV: tl.constexpr = False,
    HAS_POS: tl.constexpr = False, HAS_TS: tl.constexpr = False, TS_STEPS: tl.constexpr = 0,
):
    # Inductor passes Python float arguments of user kernels as fp64 (a direct launch passes fp32):
    # cast once so the score math and the fp32-only inline-asm silu see fp32 on both paths.
    alpha, scale_const, one = tl.cast(alpha, tl.float32), tl.cast(scale_const, tl.float32), tl.cast(one, tl.float32)
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

    M = _id_end(n, b, NUM_TARGETS, CTX, HAS_CTX, HAS_TGT)

    offs_r = r0 + tl.arange(0, BLOCK_M)
    pos_m = pos0 + offs_r
    pi_m = _ids(pos_m, CTX, M, HAS_CTX, HAS_TGT)

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

    RB = _bias_operands(RAB, TS, POSW, TSW, NB, MAX_N, b, h, start, stride_rb, stride_rh, stride_ri, stride_rj,
                        TSB, TSP, HAS_RAB, HAS_POS, HAS_TS)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_IV:  # intervals replace the HSTU mask: every visited tile is masked, invisible tiles skipped
        x0, x1, x2 = _iv_rows(IV + h.to(tl.int64) * stride_ih, start + r0, tl.arange(0, BLOCK_M), n - r0,
                              stride_ir, stride_ic)
        a, b2, e = _iv_key_range(x0, x1, x2, n, BLOCK_N)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, 0, a, pos_m, pi_m,
                         n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, x0, x1, x2, True,
                         CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ, EVEN_DV,
                         BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, b2, e, pos_m, pi_m,
                         n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, x0, x1, x2, True,
                         CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ, EVEN_DV,
                         BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
    else:
        m_first = tl.maximum(pos0 + r0, 0)
        m_last = tl.minimum(pos0 + r0 + BLOCK_M, n) - 1
        a, fs, fe, e = _fwd_key_range(m_first, m_last, n, M, CTX, WINDOW, MINFULL, BLOCK_N, CAUSAL, HAS_CTX,
                                      HAS_TGT, HAS_WINDOW, HAS_MINFULL)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, a, fs, pos_m, pi_m,
                         n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, pos_m, pos_m,
                         pos_m, True, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ,
                         EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, fs, fe, pos_m, pi_m,
                         n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, pos_m, pos_m,
                         pos_m, False, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ,
                         EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        acc = _fwd_inner(acc, q, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, fe, e, pos_m, pi_m,
                         n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, pos_m, pos_m,
                         pos_m, True, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ,
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


# --------------------------------------------------------------------------------------------
# Backward: dK, dV (+ dQ through atomics)
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_step(dk, dv, hist, k, v, Q_src, DO_src, DQ_dst, S_base, stride_qm, stride_qd, stride_dom, stride_dod,
                   stride_dqm, stride_sm, start_m, offs_n, pi_n, n, M, c, w, f, alpha, DQ, DV,
                   RB, GB, x0, x1, x2,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_CTX: tl.constexpr, HAS_TGT: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_MINFULL: tl.constexpr, SCALE_MODE: tl.constexpr,
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
    dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
    s_t, a, bk = _pre_silu(s_t, alpha, RB, offs_m[None, :], offs_n[:, None], n, HAS_RAB, HAS_POS, HAS_TS, TS_STEPS)
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
            pi_m = _ids(offs_m, c, M, HAS_CTX, HAS_TGT)
            ok = _valid(offs_m[None, :], offs_n[:, None], pi_m[None, :], pi_n[:, None], n, M, w, f, CAUSAL,
                        HAS_CTX, HAS_WINDOW, HAS_MINFULL)
        p16 = tl.where(ok, p16, 0.0)
        ds16 = tl.where(ok, ds16, 0.0)
    if RAB_GRAD != 0 or TAB_GRAD:
        # bias gradients are dS_pre (per-row scales are already in dO; GB carries a scalar scale)
        hist = _bias_grad(ds16, bk, hist, RB, GB, offs_m, offs_n, start_m, n, RAB_GRAD, TAB_GRAD, HAS_POS, HAS_TS,
                          BLOCK_M, ds16.shape[0], TS_STEPS)
    dv = tl.dot(p16, do, dv, input_precision=PREC)
    dk = tl.dot(ds16, q, dk, input_precision=PREC)
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
    return dk, dv, hist


@triton.jit
def _bwd_dkdv_inner(dk, dv, hist, k, v, Q_src, DO_src, DQ_dst, S_base, stride_qm, stride_qd, stride_dom, stride_dod,
                    stride_dqm, stride_sm, lo, hi, offs_n, pi_n, n, M, c, w, f, alpha, DQ, DV,
                    RB, GB, IV_h, stride_ir, stride_ic,
                    n0, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_CTX: tl.constexpr,
                    HAS_TGT: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_MINFULL: tl.constexpr, SCALE_MODE: tl.constexpr,
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
                dk, dv, hist = _bwd_dkdv_step(dk, dv, hist, k, v, Q_src, DO_src, DQ_dst, S_base, stride_qm, stride_qd,
                                        stride_dom, stride_dod, stride_dqm, stride_sm, start_m, offs_n, pi_n, n, M,
                                        c, w, f, alpha, DQ, DV, RB, GB, x0, x1, x2, MASKED, CAUSAL, HAS_CTX, HAS_TGT,
                                        HAS_WINDOW, HAS_MINFULL, SCALE_MODE, TMA, DQ_MODE, FAST, PREC, EVEN_DQ,
                                        EVEN_DV, BLOCK_M, BLOCK_DQ, BLOCK_DV, HAS_RAB, RAB_GRAD, HAS_IV, HAS_POS,
                                        HAS_TS, TAB_GRAD, TS_STEPS)
        else:
            dk, dv, hist = _bwd_dkdv_step(dk, dv, hist, k, v, Q_src, DO_src, DQ_dst, S_base, stride_qm, stride_qd, stride_dom,
                                    stride_dod, stride_dqm, stride_sm, start_m, offs_n, pi_n, n, M, c, w, f, alpha,
                                    DQ, DV, RB, GB,
                                    offs_m0, offs_m0, offs_m0, MASKED, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW,
                                    HAS_MINFULL, SCALE_MODE, TMA, DQ_MODE, FAST, PREC, EVEN_DQ, EVEN_DV, BLOCK_M,
                                    BLOCK_DQ, BLOCK_DV, HAS_RAB, RAB_GRAD, HAS_IV, HAS_POS, HAS_TS, TAB_GRAD, TS_STEPS)
    return dk, dv, hist


@triton.jit
def _hstu_bwd_dkdv_kernel(
    Q, K, V, DO, DQA, DK, DVo, SEQ_OFFSETS, NUM_TARGETS, ATTN_SCALE,
    stride_qm, stride_qh, stride_qd, stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
    stride_dom, stride_doh, stride_dod, stride_dqm, stride_dqh, stride_dkm, stride_dkh, stride_dvm, stride_dvh,
    stride_sm,
    alpha, scale_const,
    H, DQ, DV, ROWS, MAX_N, CTX, WINDOW, MINFULL, N_BUCKET,
    RAB, stride_rb, stride_rh, stride_ri, stride_rj, IV, stride_ih, stride_ir, stride_ic,
    DRAB, stride_gb, stride_gh, stride_gi, stride_gj,
    TS, POSW, TSW, NB, DPOS, DTS, TAB_COPIES, stride_pc, stride_tc, TSB, TSP,
    CAUSAL: tl.constexpr, HAS_TGT: tl.constexpr, HAS_CTX: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_MINFULL: tl.constexpr, SCALE_MODE: tl.constexpr, TMA: tl.constexpr, DQ_MODE: tl.constexpr,
    FAST: tl.constexpr, PREC: tl.constexpr, EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEQ_MAJOR: tl.constexpr = True,
    HAS_RAB: tl.constexpr = False, RAB_GRAD: tl.constexpr = 0, HAS_IV: tl.constexpr = False,
    HAS_POS: tl.constexpr = False, HAS_TS: tl.constexpr = False, TAB_GRAD: tl.constexpr = False,
    TS_STEPS: tl.constexpr = 0,
):
    alpha, scale_const = tl.cast(alpha, tl.float32), tl.cast(scale_const, tl.float32)  # fp64 under Inductor
    # early key blocks are seen by the most query rows: launched first
    pid_bh, n_blk = _tile(MAX_N, BLOCK_N, False, SEQ_MAJOR)
    b = pid_bh // H
    h = pid_bh % H
    start, n = _seq_bounds(SEQ_OFFSETS, b, ROWS, MAX_N)
    n0 = n_blk * BLOCK_N
    if n0 >= n:
        return
    M = _id_end(n, b, NUM_TARGETS, CTX, HAS_CTX, HAS_TGT)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    pi_n = _ids(offs_n, CTX, M, HAS_CTX, HAS_TGT)

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
        if HAS_TS:
            DTS_s = DTS + slot * stride_tc
    if RAB_GRAD != 0 or TAB_GRAD:  # bias gradients leave the kernel scaled (rab-sized, no host pass)
        if SCALE_MODE == 0:
            gsc = scale_const
        elif SCALE_MODE == 1:
            gsc = tl.load(ATTN_SCALE).to(tl.float32)
    if HAS_IV:
        IV_h = IV + h.to(tl.int64) * stride_ih + start * stride_ir
    RB = _bias_operands(RAB, TS, POSW, TSW, NB, MAX_N, b, h, start, stride_rb, stride_rh, stride_ri, stride_rj,
                        TSB, TSP, HAS_RAB, HAS_POS, HAS_TS)
    GB = (DRAB_b, stride_gi, stride_gj, DPOS_s, DTS_s, gsc, MAX_N)
    dk = tl.zeros([BLOCK_N, BLOCK_DQ], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    if TAB_GRAD and HAS_TS:  # d ts_w of this program, per bucket (_bias_grad)
        hist = tl.zeros([1 << TS_STEPS], dtype=tl.float32)
    else:
        hist = 0.0
    # Query-row segments (_bwd_query_range): [0, cb) contextual rows (masked), [qa, qf) masked, [qf, qe)
    # full, [qe, qz) masked. Intervals: one masked segment over all rows, each block skipped unless one
    # of its rows sees this key block.
    if HAS_IV:
        cb, qa, qf, qe, qz = n * 0, n * 0, n, n, n
    else:
        cb, qa, qf, qe, qz = _bwd_query_range(n0, n, M, CTX, WINDOW, MINFULL, BLOCK_M, BLOCK_N, CAUSAL, HAS_CTX,
                                              HAS_TGT, HAS_WINDOW, HAS_MINFULL)
    for seg in tl.static_range(4):
        if (seg == 0 and HAS_CTX and not HAS_IV) or seg == 1 or (seg >= 2 and not HAS_IV):
            if seg == 0:
                lo, hi = cb * 0, cb
            elif seg == 1:
                lo, hi = qa, qf
            elif seg == 2:
                lo, hi = qf, qe
            else:
                lo, hi = qe, qz
            dk, dv, hist = _bwd_dkdv_inner(dk, dv, hist, k, v, Q_src, DO_src, DQ_dst, s_base, stride_qm, stride_qd, stride_dom,
                                     stride_dod, stride_dqm, stride_sm, lo, hi, offs_n, pi_n, n, M, CTX, WINDOW,
                                     MINFULL, alpha, DQ, DV, RB, GB, IV_h, stride_ir, stride_ic, n0, BLOCK_N,
                                     seg != 2, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, SCALE_MODE, TMA,
                                     DQ_MODE, FAST, PREC, EVEN_DQ, EVEN_DV, BLOCK_M, BLOCK_DQ, BLOCK_DV, HAS_RAB,
                                     RAB_GRAD, HAS_IV, HAS_POS, HAS_TS, TAB_GRAD, TS_STEPS)

    if SCALE_MODE == 0:
        sc = scale_const
    elif SCALE_MODE == 1:
        sc = tl.load(ATTN_SCALE).to(tl.float32)
    else:
        sc = 1.0
    if TAB_GRAD and HAS_TS:  # the program's d ts_w into its copy: NB + 1 atomics per program, not per tile
        slots = tl.arange(0, 1 << TS_STEPS)
        tl.atomic_add(DTS_s + slots, hist, mask=slots <= NB, sem="relaxed")
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
def _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, lo, hi, pos_m, pi_m,
                  n, M, c, w, f, alpha, DQ, DV, RB, x0, x1, x2,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_CTX: tl.constexpr, HAS_TGT: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_MINFULL: tl.constexpr, TMA: tl.constexpr, FAST: tl.constexpr,
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
        s, a, bk = _pre_silu(s, alpha, RB, pos_m[:, None], offs_n[None, :], n, HAS_RAB, HAS_POS, HAS_TS, TS_STEPS)
        if FAST == 2:
            _, ds = _silu_bwd_packed((s * (0.5 * a)).to(k.dtype), dp.to(k.dtype))
        else:
            _, dsilu = _silu_and_grad(s, a, FAST)
            ds = (dp * dsilu).to(k.dtype)
        if MASKED:
            ok = _row_tile_mask(pos_m, offs_n, pi_m, x0, x1, x2, n, M, c, w, f, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW,
                                HAS_MINFULL, HAS_IV)
            ds = tl.where(ok, ds, 0.0)
        dq = tl.dot(ds, k, dq, input_precision=PREC)
    return dq


@triton.jit
def _hstu_bwd_dq_kernel(
    Q, K, V, DO, DQo, SEQ_OFFSETS, NUM_TARGETS, ATTN_SCALE,
    stride_qm, stride_qh, stride_qd, stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
    stride_dom, stride_doh, stride_dod, stride_dqm, stride_dqh, stride_sm,
    alpha, scale_const, one,
    H, DQ, DV, ROWS, MAX_N, CTX, WINDOW, MINFULL, N_BUCKET,
    RAB, stride_rb, stride_rh, stride_ri, stride_rj, IV, stride_ih, stride_ir, stride_ic,
    TS, POSW, TSW, NB, TSB, TSP,
    CAUSAL: tl.constexpr, HAS_TGT: tl.constexpr, HAS_CTX: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_MINFULL: tl.constexpr, SCALE_MODE: tl.constexpr, TMA: tl.constexpr,
    FAST: tl.constexpr, PREC: tl.constexpr, EVEN_DQ: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEQ_MAJOR: tl.constexpr = True, Q_IN_REGS: tl.constexpr = False,
    HAS_RAB: tl.constexpr = False, HAS_IV: tl.constexpr = False,
    HAS_POS: tl.constexpr = False, HAS_TS: tl.constexpr = False, TS_STEPS: tl.constexpr = 0,
):
    # fp64 under Inductor: see the forward kernel
    alpha, scale_const, one = tl.cast(alpha, tl.float32), tl.cast(scale_const, tl.float32), tl.cast(one, tl.float32)
    pid_bh, m_blk = _tile(MAX_N, BLOCK_M, True, SEQ_MAJOR)
    b = pid_bh // H
    h = pid_bh % H
    start, n = _seq_bounds(SEQ_OFFSETS, b, ROWS, MAX_N)
    r0 = m_blk * BLOCK_M
    if r0 >= n:
        return
    M = _id_end(n, b, NUM_TARGETS, CTX, HAS_CTX, HAS_TGT)
    offs_r = r0 + tl.arange(0, BLOCK_M)
    pi_m = _ids(offs_r, CTX, M, HAS_CTX, HAS_TGT)

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

    RB = _bias_operands(RAB, TS, POSW, TSW, NB, MAX_N, b, h, start, stride_rb, stride_rh, stride_ri, stride_rj,
                        TSB, TSP, HAS_RAB, HAS_POS, HAS_TS)
    dq = tl.zeros([BLOCK_M, BLOCK_DQ], dtype=tl.float32)
    if HAS_IV:  # as in the forward kernel
        x0, x1, x2 = _iv_rows(IV + h.to(tl.int64) * stride_ih, start + r0, tl.arange(0, BLOCK_M), n - r0,
                              stride_ir, stride_ic)
        a, b2, e = _iv_key_range(x0, x1, x2, n, BLOCK_N)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, 0, a, offs_r, pi_m,
                           n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, x0, x1, x2, True,
                           CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ, EVEN_DV,
                           BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, b2, e, offs_r, pi_m,
                           n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, x0, x1, x2, True,
                           CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ, EVEN_DV,
                           BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
    else:
        m_last = tl.minimum(r0 + BLOCK_M, n) - 1
        a, fs, fe, e = _fwd_key_range(r0, m_last, n, M, CTX, WINDOW, MINFULL, BLOCK_N, CAUSAL, HAS_CTX,
                                      HAS_TGT, HAS_WINDOW, HAS_MINFULL)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, a, fs, offs_r, pi_m,
                           n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, offs_r, offs_r,
                           offs_r, True, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ,
                           EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, fs, fe, offs_r, pi_m,
                           n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, offs_r, offs_r,
                           offs_r, False, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ,
                           EVEN_DV, BLOCK_N, BLOCK_DQ, BLOCK_DV, HAS_RAB, HAS_IV, HAS_POS, HAS_TS, TS_STEPS)
        dq = _bwd_dq_inner(dq, q, do, K_src, V_src, stride_km, stride_kd, stride_vm, stride_vd, fe, e, offs_r, pi_m,
                           n, M, CTX, WINDOW, MINFULL, alpha, DQ, DV, RB, offs_r, offs_r,
                           offs_r, True, CAUSAL, HAS_CTX, HAS_TGT, HAS_WINDOW, HAS_MINFULL, TMA, FAST, PREC, EVEN_DQ,
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


# --------------------------------------------------------------------------------------------
# Autotuning
# --------------------------------------------------------------------------------------------

# dtypes of all tensor args are appended by triton; the row strides tell a contiguous [L, H, D] tensor
# from a view of a fused projection (a best config measured for one need not suit the other)
_KEY = ["H", "DQ", "DV", "N_BUCKET", "TMA", "stride_qm", "stride_km"]


def _cfg(kind, block_m, block_n, warps, stages, maxnreg=None, qregs=False):
    kw = {"maxnreg": maxnreg} if maxnreg else {}
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    if kind != "dkdv":
        meta["Q_IN_REGS"] = bool(qregs)
    return triton.Config(meta, num_warps=warps, num_stages=stages, **kw)


# (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg[, q_in_regs]]).
# fwd/dq: BLOCK_M query rows per program, BLOCK_N keys per step.
# dkdv: BLOCK_N key rows per program, BLOCK_M query rows per step.
# maxnreg=128 with 8 warps lets two 128-row CTAs share an SM (independent warpgroups overlap better).
# q_in_regs: Q (and dO) become register A operands of wgmma, halving shared-memory reads of S = Q K^T.
# The head-dim <= 128 lists keep the configs that came first or second for some N in 512..4096 and
# some layout in the H100 tuning logs (benchmarks/RESULTS.md, 2026-11-22/23); each extra config costs a
# Triton compile on the first call of every new key.
_R = True
_GPU_CONFIGS = {
    ("fwd", "small"): [(128, 32, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3), (128, 32, 4, 4), (128, 64, 8, 2, 128)],
    ("fwd", "large"): [(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3)],
    ("dkdv", "small"): [(64, 128, 8, 3), (64, 64, 4, 2), (32, 64, 4, 3), (32, 64, 4, 4), (32, 128, 8, 3)],
    ("dkdv", "large"): [(32, 64, 4, 2), (64, 64, 8, 2), (32, 64, 8, 2), (16, 64, 4, 2)],
    ("dq", "small"): [(128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 8, 4, None, _R), (64, 32, 4, 3)],
    ("dq", "large"): [(64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 3)],
    # fp32 inputs (3-pass tf32 dots need much more shared memory and registers): small tiles
    ("fwd", "fp32"): [(32, 32, 4, 1)],
    ("dkdv", "fp32"): [(32, 32, 4, 1)],
    ("dq", "fp32"): [(32, 32, 4, 1)],
}
# One small config under the interpreter (autotuning needs a GPU) and for quick runs.
_INTERPRET_CONFIGS = {"fwd": (32, 16, 4, 1, None, True), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1, None, True)}

_JIT = {"fwd": _hstu_fwd_kernel, "dkdv": _hstu_bwd_dkdv_kernel, "dq": _hstu_bwd_dq_kernel}

# Test hook: {"fwd": (BM, BN, warps, stages), ...} forces a config and bypasses the autotuner.
_FORCED_CONFIGS: dict = {}


@contextlib.contextmanager
def force_configs(**cfgs):
    """Run with fixed (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel ("fwd", "dkdv", "dq")."""
    old = dict(_FORCED_CONFIGS)
    _FORCED_CONFIGS.update(cfgs)
    try:
        yield
    finally:
        _FORCED_CONFIGS.clear()
        _FORCED_CONFIGS.update(old)


def _autotune_enabled() -> bool:
    return not _interpret() and config.get("autotune")


@functools.lru_cache(maxsize=None)
def _tuned(kind: str, size: str, autotune: bool, atomic_dq: bool, zero_extra: tuple = ()):
    if autotune:
        configs = [_cfg(kind, *c) for c in _GPU_CONFIGS[(kind, size)]]
    elif _interpret():
        configs = [_cfg(kind, *_INTERPRET_CONFIGS[kind])]
    else:
        configs = [_cfg(kind, *_GPU_CONFIGS[(kind, size)][0])]
    tuner = triton.autotune(configs=configs, key=_KEY, cache_results=True,
                            reset_to_zero=(["DQA"] if atomic_dq else []) + list(zero_extra) or None)(_JIT[kind])
    _TUNERS[f"{kind}/{size}/tune={autotune}/atomic={atomic_dq}" + "".join(f"/{z}" for z in zero_extra)] = tuner
    return tuner


_TUNERS: dict = {}  # for benchmark reports: name -> triton Autotuner


_OPTIONAL_FLAGS = {"fwd": ("HAS_RAB", "HAS_IV", "HAS_POS", "HAS_TS", "TS_STEPS"),
                   "dq": ("HAS_RAB", "HAS_IV", "HAS_POS", "HAS_TS", "TS_STEPS"),
                   "dkdv": ("HAS_RAB", "RAB_GRAD", "HAS_IV", "HAS_POS", "HAS_TS", "TAB_GRAD", "TS_STEPS")}


def _launch(kind: str, grid_rows: int, grid_x: int, block_d: int, args: tuple, kwargs: dict,
            atomic_dq: bool = False, fp32: bool = False, zero_extra: tuple = ()):
    """Launch kernel ``kind`` over grid_x * cdiv(grid_rows, BLOCK_{M|N}) programs (see :func:`_tile`).
    ``zero_extra``: further accumulated outputs (bias gradients) the autotuner zeroes between trials."""
    # every constexpr passed, the defaulted rab/interval switches too: torch's wrap_triton (Inductor's
    # user-defined-kernel path) maps arguments by position and breaks on a defaulted one left out
    kwargs = {**{k: False for k in _OPTIONAL_FLAGS[kind]}, **kwargs}
    row_block = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"
    forced = _FORCED_CONFIGS.get(kind)
    if forced is not None:
        cfg = _cfg(kind, *forced)
        rb = cfg.kwargs["BLOCK_N"] if kind == "dkdv" else cfg.kwargs["BLOCK_M"]
        extra = {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}
        _JIT[kind][(grid_x * triton.cdiv(grid_rows, rb),)](*args, **kwargs, **cfg.kwargs, num_warps=cfg.num_warps,
                                                        num_stages=cfg.num_stages, **extra)  # test hook: eager only
        return
    size = "fp32" if fp32 else ("small" if block_d <= 128 else "large")
    kern = _tuned(kind, size, _autotune_enabled(), atomic_dq, zero_extra)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("hstu %s launch: configs=%s, constexprs=%s, int args=%s", kind, size,
                  {k: v for k, v in kwargs.items()}, [a for a in args if isinstance(a, (int, float))])
    if not _compat.plain_eager(*args):  # traced: wrap_triton records the launch, Autotuner included
        _launcher(kern, args)[lambda meta: (grid_x * triton.cdiv(grid_rows, meta[row_block]),)](*args, **kwargs)
        return
    key = (kern, *(args[i] for i in _key_positions(kind, len(args))),
           *(a.dtype for a in args if isinstance(a, torch.Tensor)), *kwargs.items())
    cfg = _CHOSEN.get(key)
    if cfg is None:  # first launch of this key: the Autotuner picks (and benchmarks, when tuning)
        kern[lambda meta: (grid_x * triton.cdiv(grid_rows, meta[row_block]),)](*args, **kwargs)
        _CHOSEN[key] = kern.best_config.all_kwargs()
        return
    rb = cfg[row_block]  # (a + b - 1) // b: triton.cdiv costs ~5 us (see _pow2)
    _JIT[kind].run(*args, grid=(grid_x * ((grid_rows + rb - 1) // rb),), warmup=False, **kwargs, **cfg)


# Plain eager launches skip the Autotuner once it has picked a config for their key: its run() rebuilds
# the key from every argument on each call (dicts of ~45 arguments, list lookups, str() of every tensor's
# dtype), tens of microseconds of host time per launch. Our key holds the Autotuner's (the
# _KEY arguments and the tensors' dtypes) and all constexprs, so a hit launches the config it would.
_CHOSEN: dict = {}


@functools.lru_cache(maxsize=None)
def _key_positions(kind: str, nargs: int) -> tuple:
    """Positions in a launch's ``args`` of the _KEY arguments passed positionally (the rest are constexprs,
    part of the key through ``kwargs``)."""
    names = _JIT[kind].arg_names
    return tuple(names.index(k) for k in _KEY if names.index(k) < nargs)


# --------------------------------------------------------------------------------------------
# Host helpers
# --------------------------------------------------------------------------------------------


def tma_supported(device=None) -> bool:
    """True when device-side tensor descriptors (TMA) can be used: sm90+ (or the Triton interpreter)."""
    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    device = torch.device(device) if device is not None else None
    if _interpret():
        return True
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_ok(t: Optional[torch.Tensor]) -> bool:
    """A [rows, H, D] tensor addressable by per-(sequence, head) 2-D descriptors."""
    if t is None:
        return True
    from .._compat import guarded

    es = t.element_size()
    try:
        base_ok = t.data_ptr() % 16 == 0
    except RuntimeError:
        # Fake/functional tensor while torch.compile/AOTI traces the op: allocations are aligned
        # (Inductor copies misaligned graph inputs), so the view's storage offset decides.
        base_ok = guarded((t.storage_offset() * es) % 16 == 0)
    return (base_ok and guarded(t.stride(-1) == 1) and guarded((t.stride(0) * es) % 16 == 0)
            and guarded((t.stride(1) * es) % 16 == 0))


# tma=None takes descriptors only from this N bucket up: below it the per-program descriptor set-up
# costs more than TMA saves (H100, benchmarks/RESULTS.md, 2026-11-22/23: pointer loads 209 vs 173
# TFLOP/s fwd at N=512, 313 vs 302 at N=1024; a tie at 2048; TMA 479 vs 431 at 4096).
_TMA_MIN_N = 2048


def _use_tma(tma, device, tensors, max_seq_len=None) -> bool:
    if tma is False:
        return False
    if tma is None and max_seq_len is not None and _n_bucket(max_seq_len) < _TMA_MIN_N:
        return False
    ok_dev = tma_supported(device)
    if tma is True:
        if not ok_dev:
            raise RuntimeError(f"hstu attention: tma=True but tensor descriptors are not supported on {device} "
                               "(needs an sm90+ GPU and triton with tl.make_tensor_descriptor)")
        if not all(_tma_ok(t) for t in tensors):
            raise ValueError("hstu attention: tma=True needs 16-byte aligned q/k/v base pointers and row/head "
                             "strides, and a contiguous last dimension")
        return True
    return ok_dev and all(_tma_ok(t) for t in tensors)  # layout checks (and their guards) only when usable


def _alloc_fn(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_allocator():
    """Device-side descriptors need a scratch allocator in eager (Inductor/AOTI set their own)."""
    try:
        from triton.runtime import _allocation
        if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            triton.set_allocator(_alloc_fn)
    except Exception:  # pragma: no cover - allocator API moved
        triton.set_allocator(_alloc_fn)


def _device_ctx(device):
    # entering torch.cuda.device costs two device switches per call: skip it when already current
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


_new = new_tensor


def _block_d(d: int) -> int:
    if type(d) is int:
        return max(16, _pow2(d))
    return max(16, triton.next_power_of_2(d))


def _check_inputs(q, k, v, seq_offsets, num_targets=None):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("hstu attention: q, k, v must be [rows, H, D]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"hstu attention: q, k, v must share a dtype in fp16/bf16/fp32, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"hstu attention: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if seq_offsets.dtype not in (torch.int32, torch.int64) or seq_offsets.dim() != 1:
        raise ValueError("hstu attention: seq_offsets must be a 1-D int32/int64 tensor")
    if num_targets is not None and (num_targets.dim() != 1 or num_targets.shape[0] != seq_offsets.shape[0] - 1):
        raise ValueError(f"hstu attention: num_targets must have shape [B]={seq_offsets.shape[0] - 1}, "
                         f"got {tuple(num_targets.shape)}")  # the kernels read num_targets[b] for every b
    if max(q.shape[2], v.shape[2]) > 256:
        raise ValueError("hstu attention: head dims up to 256 are supported")


def _scale_args(attn_scale, max_seq_len, device, rows):
    """(SCALE_MODE, scale_const, tensor or None, stride); a per-row ``attn_scale`` must have ``rows`` rows."""
    if attn_scale is None:
        if isinstance(max_seq_len, int):
            return 0, 1.0 / max(max_seq_len, 1), None, 0
        # symbolic N under torch.compile: 1/N as a 0-d tensor computed at run time (a Python float
        # argument would specialise the compiled graph to one N); callers ensure N >= 1
        return 1, 1.0, torch.full((), 1.0, dtype=torch.float32, device=device) / max_seq_len, 0
    if attn_scale.numel() == 1:
        return 1, 1.0, attn_scale.reshape(()), 0
    if attn_scale.dim() != 1 or attn_scale.shape[0] != rows:
        raise ValueError(f"hstu attention: attn_scale must be a scalar or have shape [{rows}], "
                         f"got {tuple(attn_scale.shape)}")
    return 2, 1.0, attn_scale, attn_scale.stride(0)


def _rab_args(rab, B, H, max_seq_len):
    """(rab, stride_b, stride_h, stride_i, stride_j) for a dense ``[B|1, H|1, N, N]`` rab (stride 0 along
    broadcast dims), or placeholders without one."""
    if rab is None:
        return (None, 0, 0, 0, 0)
    if rab.dim() != 4 or rab.shape[0] not in (1, B) or rab.shape[1] not in (1, H) \
            or rab.shape[2] != max_seq_len or rab.shape[3] != max_seq_len:
        raise ValueError(f"hstu attention: rab must be [B|1, H|1, N, N] = [{B}|1, {H}|1, {max_seq_len}, "
                         f"{max_seq_len}], got {tuple(rab.shape)}")
    if rab.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"hstu attention: rab must be fp16/bf16/fp32, got {rab.dtype}")
    return (rab, rab.stride(0) if rab.shape[0] > 1 else 0, rab.stride(1) if rab.shape[1] > 1 else 0,
            rab.stride(2), rab.stride(3))


def _iv_args(intervals, H, rows):
    """(intervals, stride_h, stride_row, stride_col) for ``[H|1, L, 3]`` int32/int64 intervals."""
    if intervals is None:
        return (None, 0, 0, 0)
    if intervals.dim() != 3 or intervals.shape[0] not in (1, H) or intervals.shape[1] != rows \
            or intervals.shape[2] != 3 or intervals.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"hstu attention: intervals must be an int32/int64 [H|1, L, 3] = [{H}|1, {rows}, 3] "
                         f"tensor, got {tuple(intervals.shape)} {intervals.dtype}")
    return (intervals, intervals.stride(0) if intervals.shape[0] > 1 else 0, intervals.stride(1),
            intervals.stride(2))


def _tab_args(timestamps, pos_w, ts_w, rows, max_seq_len, ts_bounds=None, batch=None):
    """((timestamps, pos_w, ts_w, num_buckets), (thresholds, guess plan), constexpr switches) for the table bias
    (docs/semantics.md), tensors contiguous (tiny or [L]); placeholders without tables."""
    if ts_w is not None and timestamps is None:
        raise ValueError("hstu attention: ts_w needs timestamps")
    if pos_w is not None and (pos_w.dim() != 1 or pos_w.shape[0] != 2 * max_seq_len - 1):
        raise ValueError(f"hstu attention: pos_w must be [2N - 1] = [{2 * max_seq_len - 1}], got {tuple(pos_w.shape)}")
    if ts_w is not None:
        if ts_w.dim() != 1 or ts_w.shape[0] < 1:
            raise ValueError(f"hstu attention: ts_w must be [num_buckets + 1], got {tuple(ts_w.shape)}")
        dense = timestamps.dim() == 2
        shape_ok = tuple(timestamps.shape) == (batch, max_seq_len) if dense else \
            (timestamps.dim() == 1 and timestamps.shape[0] == rows)
        if not shape_ok or timestamps.dtype not in (torch.int32, torch.int64, torch.float32, torch.float64):
            raise ValueError(f"hstu attention: timestamps must be an int32/int64/fp32/fp64 [L] = [{rows}] (jagged) or "
                             f"[B, N] = [{batch}, {max_seq_len}] (padded) tensor, got {tuple(timestamps.shape)} "
                             f"{timestamps.dtype}")
    for t in (pos_w, ts_w):
        if t is not None and t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"hstu attention: pos_w / ts_w must be fp16/bf16/fp32, got {t.dtype}")
    if ts_bounds is not None and ts_w is None:
        raise ValueError("hstu attention: ts_bounds (time-bucket thresholds) are only used with ts_w")
    flags = {}
    if pos_w is not None:
        flags["HAS_POS"] = True
    bnd = (None, None)
    if ts_w is not None:
        flags["HAS_TS"] = 2 if timestamps.dim() == 2 else 1
        nb = ts_w.shape[0] - 1
        bnd = _ts_bounds_and_plan(ts_bounds, nb, timestamps.dtype, timestamps.device)
        # binary-search steps of the fallback (2**steps > num_buckets); a symbolic size takes the most
        flags["TS_STEPS"] = int(nb).bit_length() if type(nb) is int else 31
    cont = lambda t: None if t is None else t.contiguous()  # noqa: E731
    return ((cont(timestamps) if ts_w is not None else None, cont(pos_w), cont(ts_w),
             ts_w.shape[0] - 1 if ts_w is not None else 0), bnd, flags)


# The time bucket of the table bias is #{k : |dt| >= ts_bounds[k]} (reference.buckets_from_bounds). The
# kernels guess it from a line in log2(|dt|) fitted to the thresholds and correct the guess by one bucket
# either way (_time_bucket); _ts_plan fits the line and checks it, all with torch ops on the thresholds'
# device: no host sync, so it traces (torch.compile, AOTI) and captures (CUDA graphs).
_GUESS_MARGIN = 1.0 / 64  # slack (in buckets) for the device's fp32 log2 and fp32 FMA rounding
_DEFAULT_BOUNDS: dict = {}  # (num_buckets, gap dtype, device) -> (thresholds, plan): eager calls only
_USER_PLANS: dict = {}  # id(ts_bounds) -> (ts_bounds, version, plan); the tensor is held so its id stays its own


def _gap_top(dtype):
    """The largest non-negative time gap of the timestamps' dtype (inf for floats)."""
    return float("inf") if dtype.is_floating_point else torch.iinfo(dtype).max


def _ts_plan(bounds: torch.Tensor, nb: int, gap_dtype) -> torch.Tensor:
    """fp32 ``[slope, offset, fits, *fp32(bounds), nan]`` for :func:`_bucket_guess`: the guess ``floor(slope *
    log2(fp32(x)) + offset)`` fitted by least squares to ``(log2 bounds[k-1], k)``, centred, and ``fits = 1``
    when at both ends of every bucket (each threshold and the gap just below it, 0 and the largest gap) it is
    the true bucket or the one below, by a margin; as the guess is monotone in x, it then is everywhere."""
    dev, top = bounds.device, _gap_top(gap_dtype)
    f64 = torch.float64
    k = torch.arange(1, nb + 1, device=dev, dtype=f64)
    lb = torch.log2(bounds.to(torch.float32).to(f64))  # what the kernel sees: log2 of fp32(x)
    use = torch.isfinite(lb) & (lb >= 0) & (bounds < top)
    # slope by least squares on (log2 bounds[k-1], k), weighted towards large thresholds: integer rounding
    # (ceil(e^0.301k) = 2, 2, 3, 4, ...) bends the small ones off the line
    w = use.to(f64) * torch.where(use, lb, 0.0).clamp(max=12.0) ** 2
    cnt = w.sum().clamp(min=1e-300)
    lz = torch.where(use, lb, 0.0)
    ml, mk = (w * lz).sum() / cnt, (w * k).sum() / cnt
    var = (w * (lz - ml) ** 2).sum()
    slope = torch.where(var > 0, (w * (lz - ml) * (k - mk)).sum() / var.clamp(min=1e-300), 0.0)
    slope = slope.to(torch.float32).to(f64)  # the kernel's fp32 operand
    if gap_dtype.is_floating_point:
        below = torch.nextafter(bounds, torch.full_like(bounds, -torch.inf)).clamp(min=0)
    else:
        below = (bounds - 1).clamp(min=0)
    # factory calls, not torch.tensor(list): no constant to lift when traced
    pts = torch.cat([bounds, below, bounds.new_zeros(1), bounds.new_full((1,), top)]).clamp(max=top)
    truth = torch.searchsorted(bounds, pts, right=True)
    # offset: centre u - truth over both ends of the inner buckets in [-1, 1) (guess = truth or truth - 1)
    lp = torch.log2(pts.to(torch.float32).to(f64))
    inner = (truth > 0) & (truth < nb) & torch.isfinite(lp)
    e = torch.where(inner, slope * torch.where(inner, lp, 0.0) - truth, 0.0)
    e_hi = torch.where(inner, e, -torch.inf).amax()
    e_lo = torch.where(inner, e, torch.inf).amin()
    off = torch.where(torch.isfinite(e_hi) & torch.isfinite(e_lo), -(e_hi + e_lo) / 2, 0.0)
    off = off.to(torch.float32).to(f64)

    def guess(u):
        return torch.floor(torch.where(u > 0, u, 0.0).clamp(max=float(nb))).to(torch.int64)

    u = lp * slope + off
    fits = ((guess(u - _GUESS_MARGIN) >= truth - 1) & (guess(u + _GUESS_MARGIN) <= truth)).all() & (slope >= 0)
    return torch.cat([torch.stack([slope, off, fits.to(f64)]).to(torch.float32), bounds.to(torch.float32),
                      torch.full((1,), torch.nan, dtype=torch.float32, device=dev)])


def _ts_bounds_and_plan(ts_bounds, nb, ts_dtype, device):
    """(thresholds, plan) on ``device``: ``ts_bounds`` or the default fp64-log bucket's
    (``reference.default_time_bucket_bounds``), computed once per (num_buckets, dtype, device) in eager code.
    Traced (torch.compile / AOTI) or under CUDA-graph capture both are computed in the graph instead."""
    eager = _compat.plain_eager(ts_bounds) and not (
        device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if ts_bounds is None:
        key = (int(nb), ts_dtype, device) if eager else None
        got = _DEFAULT_BOUNDS.get(key) if eager else None
        if got is None:
            bounds = default_time_bucket_bounds(nb, ts_dtype, device)
            got = (bounds, _ts_plan(bounds, nb, ts_dtype))
            if eager:
                _DEFAULT_BOUNDS[key] = got
        return got
    want = ts_dtype if ts_dtype.is_floating_point else torch.int64
    if ts_bounds.dim() != 1 or ts_bounds.shape[0] != nb or ts_bounds.dtype != want:
        raise ValueError(f"hstu attention: ts_bounds must be a {want} [num_buckets] = [{nb}] tensor for "
                         f"{ts_dtype} timestamps, got {tuple(ts_bounds.shape)} {ts_bounds.dtype}")
    ts_bounds = ts_bounds.contiguous()
    if not eager:
        return ts_bounds, _ts_plan(ts_bounds, nb, ts_dtype)
    hit = _USER_PLANS.get(id(ts_bounds))
    if hit is not None and hit[0] is ts_bounds and hit[1] == ts_bounds._version:
        return ts_bounds, hit[2]
    plan = _ts_plan(ts_bounds, nb, ts_dtype)
    if len(_USER_PLANS) >= 16:
        _USER_PLANS.clear()
    _USER_PLANS[id(ts_bounds)] = (ts_bounds, ts_bounds._version, plan)
    return ts_bounds, plan


def _n_bucket(max_seq_len) -> int:
    """The autotuning key for N (power of two); unused by the kernels' arithmetic, so a symbolic N
    is keyed by its compile-time value without a guard."""
    if type(max_seq_len) is int:  # eager calls: skip size_hint's import (host time per call)
        return _pow2(max_seq_len)
    return triton.next_power_of_2(_compat.size_hint(max_seq_len))


@functools.lru_cache(maxsize=256)
def _pow2(n: int) -> int:
    # memoised: triton.next_power_of_2 / triton.cdiv are constexpr-function wrappers costing ~5 us a call
    return triton.next_power_of_2(n)


def _flags(causal, num_targets, max_attn_len, contextual_seq_len, min_full_attn_seq_len, intervals=None):
    causal = bool(causal)
    if min(max_attn_len, contextual_seq_len, min_full_attn_seq_len) < 0:
        raise ValueError("hstu attention: max_attn_len, contextual_seq_len, min_full_attn_seq_len must be >= 0")
    if intervals is not None:
        if num_targets is not None or max_attn_len or contextual_seq_len or min_full_attn_seq_len:
            raise ValueError("hstu attention: intervals replace the causal/targets/window/contextual mask; "
                             "num_targets, max_attn_len, contextual_seq_len and min_full_attn_seq_len must then "
                             "be unset/0")
        # the interval mask alone decides (causal has no effect); CAUSAL=False keeps the id helpers trivial
        return dict(CAUSAL=False, HAS_TGT=False, HAS_CTX=False, HAS_WINDOW=False, HAS_MINFULL=False, HAS_IV=True)
    if not causal and (num_targets is not None or max_attn_len or contextual_seq_len or min_full_attn_seq_len):
        raise ValueError("hstu attention: causal=False means full attention inside each sequence; num_targets, "
                         "max_attn_len, contextual_seq_len and min_full_attn_seq_len must then be unset/0")
    has_window = causal and max_attn_len > 0
    return dict(
        CAUSAL=causal,
        HAS_TGT=causal and num_targets is not None,
        HAS_CTX=causal and contextual_seq_len > 0,
        HAS_WINDOW=has_window,
        HAS_MINFULL=has_window and min_full_attn_seq_len > 0,
    )


def _seq_major() -> bool:
    """Tile order (:func:`_tile`). ``config.tile_order = "block"`` (``HSTU_INDUCTOR_TILE_ORDER=block``)
    selects the block-major order, for side-by-side benchmarks."""
    return config.get("tile_order") == "seq"


_SILU_MODES = {"exact": 0, "tanh": 1, "packed": 2}


def _fast_silu(dtype, device) -> int:
    """0: exp2-based fp32 silu; 1: fp32 tanh.approx; 2: packed bf16x2/f16x2 tanh + fma (16-bit on NVIDIA).

    ``config.silu`` (``HSTU_INDUCTOR_SILU=exact|tanh|packed``) picks it for 16-bit inputs."""
    if dtype == torch.float32 or device.type != "cuda" or _interpret() or torch.version.hip is not None:
        return 0
    return _SILU_MODES[config.get("silu")]


def _prec(dtype) -> str:
    """fp32 inputs: 3-pass tf32 (fp32-level accuracy on tensor cores) on GPU, IEEE in the interpreter."""
    if dtype != torch.float32:
        return "tf32"  # ignored for 16-bit operands
    return "ieee" if _interpret() else "tf32x3"


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len, contextual_seq_len,
         min_full_attn_seq_len, causal, delta_rows, tma, rab=None, intervals=None, timestamps=None, pos_w=None,
         ts_w=None, ts_bounds=None):
    _check_inputs(q, k, v, seq_offsets, num_targets)
    seq_offsets = address_source(seq_offsets)
    tab_args, tab_bnd, tab_flags = _tab_args(timestamps, pos_w, ts_w, q.shape[0], max_seq_len, ts_bounds,
                                                 seq_offsets.shape[0] - 1)
    rows, H, Dq = q.shape
    Dv = v.shape[2]
    B = seq_offsets.shape[0] - 1
    out = _new((rows, H, Dv), q.dtype, q.device)
    if rows == 0 or B <= 0 or H == 0 or max_seq_len <= 0:
        return out.zero_()
    use_tma = _use_tma(tma, q.device, (q, k, v), max_seq_len)
    scale_mode, scale_const, scale_t, stride_s = _scale_args(attn_scale, max_seq_len, q.device, q.shape[0])
    flags = _flags(causal, num_targets, max_attn_len, contextual_seq_len, min_full_attn_seq_len, intervals)
    bdq, bdv = _block_d(Dq), _block_d(Dv)
    args = (q, k, v, out, seq_offsets, num_targets, scale_t,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), stride_s,  # one call each: all are 3-D
            float(alpha), float(scale_const), 1.0,
            H, Dq, Dv, k.shape[0], max_seq_len, delta_rows, int(contextual_seq_len), int(max_attn_len), int(min_full_attn_seq_len),
            _n_bucket(max_seq_len)) + _rab_args(rab, B, H, max_seq_len) + _iv_args(intervals, H, rows) + tab_args \
        + tab_bnd
    if rab is not None:  # only then: without rab/intervals the launch (and the kernel) is the bias-free one
        flags["HAS_RAB"] = True
    flags.update(tab_flags)
    kwargs = dict(flags, SCALE_MODE=scale_mode, DELTA=delta_rows > 0, TMA=use_tma, SEQ_MAJOR=_seq_major(),
                  FAST=_fast_silu(q.dtype, q.device), PREC=_prec(q.dtype), EVEN_DQ=bdq == Dq, EVEN_DV=bdv == Dv,
                  BLOCK_DQ=bdq, BLOCK_DV=bdv)
    grid_rows = delta_rows if delta_rows > 0 else max_seq_len
    with _device_ctx(q.device):
        if use_tma:
            _ensure_allocator()
        _launch("fwd", grid_rows, B * H, max(bdq, bdv), args, kwargs, fp32=q.dtype == torch.float32)
    return out


def hstu_attention_fwd(q, k, v, seq_offsets, max_seq_len: int, alpha: float, num_targets=None, attn_scale=None,
                       max_attn_len: int = 0, contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0,
                       causal: bool = True, *, tma=None, rab=None, intervals=None, timestamps=None, pos_w=None,
                       ts_w=None, ts_bounds=None) -> torch.Tensor:
    """Jagged HSTU attention forward: ``[L, H, Dv]`` in the dtype of ``q``. ``rab: [B|1, H|1, N, N]`` is added
    inside the silu; ``intervals: [H|1, L, 3]`` replaces the mask; ``pos_w: [2N-1]`` and/or ``ts_w:
    [num_buckets+1]`` with ``timestamps: [L]`` add the table bias computed in the kernel (docs/semantics.md);
    ``ts_bounds: [num_buckets]`` are its time-bucket thresholds (None: the default fp64-log bucket's)."""
    return _fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                contextual_seq_len, min_full_attn_seq_len, causal, 0, tma, rab, intervals, timestamps, pos_w, ts_w,
                ts_bounds)


def delta_hstu_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                             max_attn_len=0, contextual_seq_len=0, *, tma=None) -> torch.Tensor:
    """Cached attention: ``delta_q: [B*D, H, Dq]`` are the last D rows of every sequence -> ``[B*D, H, Dv]``.

    Needs ``n_b >= D`` (rows of a shorter sequence that would precede its start come out as zeros).
    ``attn_scale``: None, a scalar, or one value per delta row ``[B*D]``.
    """
    B = seq_offsets.shape[0] - 1
    if B <= 0:
        return delta_q.new_zeros((delta_q.shape[0], delta_q.shape[1], v.shape[2]))
    D = delta_q.shape[0] // B
    if D * B != delta_q.shape[0]:
        raise ValueError(f"delta_q rows {delta_q.shape[0]} not a multiple of B={B}")
    if D == 0:
        return delta_q.new_zeros((0, delta_q.shape[1], v.shape[2]))
    return _fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                contextual_seq_len, 0, True, D, tma)


def hstu_attention_bwd(dout, q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                       max_attn_len=0, contextual_seq_len=0, min_full_attn_seq_len=0, causal=True, *,
                       deterministic=False, tma=None, rab=None, intervals=None, rab_grad=False, timestamps=None,
                       pos_w=None, ts_w=None, table_grad=False, ts_bounds=None):
    """Gradients (dq, dk, dv) of :func:`hstu_attention_fwd` (not of ``attn_scale``); ``d_rab`` (rab's shape and
    dtype, summed over its broadcast dims) appended when ``rab_grad``, then ``(d_pos_w, d_ts_w)`` (the
    tables' dtypes; None for an absent table) when ``table_grad``."""
    _check_inputs(q, k, v, seq_offsets, num_targets)
    seq_offsets = address_source(seq_offsets)
    L, H, Dq = q.shape
    Dv = v.shape[2]
    B = seq_offsets.shape[0] - 1
    rab_grad = bool(rab_grad) and rab is not None
    rab_args = _rab_args(rab, B, H, max_seq_len)
    iv_args = _iv_args(intervals, H, L)
    tab_args, tab_bnd, tab_flags = _tab_args(timestamps, pos_w, ts_w, L, max_seq_len, ts_bounds, B)
    table_grad = bool(table_grad) and bool(tab_flags)
    if rab_grad or (table_grad and pos_w is not None):
        # d rab / d pos_w addresses follow the query block, whose range comes from num_targets (address_source)
        num_targets = address_source(num_targets)
    dk = _new((L, H, Dq), k.dtype, k.device)
    dv = _new((L, H, Dv), v.dtype, v.device)
    # d rab, scaled in the kernel (docs/kernels.md). No broadcast dim: every (b, h, i, j) has one writer,
    # stored straight into rab's shape and dtype (zeroed: skipped tiles and padding get 0). Broadcast
    # dims: fp32 atomics into rab's shape (no [B, H, N, N] buffer), cast after; with ``deterministic``,
    # the one-writer store into a [B, H, N, N] scratch in the inputs' dtype and a fixed-order sum instead.
    rab_mode, drab, scratch = 0, None, None
    if rab_grad:
        bcast = [d for d, size in ((0, B), (1, H)) if rab.shape[d] == 1 and size > 1]
        if not bcast:
            rab_mode, drab = 1, torch.zeros(rab.shape, device=q.device, dtype=rab.dtype)
        elif not deterministic:
            rab_mode, drab = 2, torch.zeros(rab.shape, device=q.device, dtype=torch.float32)
        else:
            rab_mode = 1
            scratch = drab = torch.zeros((B, H, max_seq_len, max_seq_len), device=q.device, dtype=q.dtype)
        g_strides = (drab.stride(0) if drab.shape[0] > 1 else 0, drab.stride(1) if drab.shape[1] > 1 else 0,
                     drab.stride(2), drab.stride(3))
        if _compat.size_hint(max_seq_len) > 46340:
            raise ValueError("hstu attention: rab gradients need max_seq_len <= 46340 (32-bit offsets)")
    # table gradients: fp32 [copies, table] buffers reduced in the kernel, the copies summed here
    copies = 1 if _interpret() else 32
    dpos = torch.zeros((copies, 2 * max_seq_len - 1), device=q.device, dtype=torch.float32) \
        if table_grad and pos_w is not None else None
    dts = torch.zeros((copies, ts_w.shape[0]), device=q.device, dtype=torch.float32) \
        if table_grad and ts_w is not None else None

    def _ret(dq, dk, dv):
        got = (dq, dk, dv)
        if rab_grad:
            if scratch is not None:
                got += (scratch.to(torch.float32).sum(dim=bcast, keepdim=True).to(rab.dtype),)
            else:
                got += (drab.to(rab.dtype),)
        if table_grad:
            got += (None if dpos is None else dpos.sum(0).to(pos_w.dtype),
                    None if dts is None else dts.sum(0).to(ts_w.dtype))
        return got

    if L == 0 or B <= 0 or H == 0 or max_seq_len <= 0:
        return _ret(torch.zeros_like(q, memory_format=torch.contiguous_format), dk.zero_(), dv.zero_())
    if dout.shape != (L, H, Dv):
        raise ValueError(f"dout must be {(L, H, Dv)}, got {tuple(dout.shape)}")
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    use_tma = _use_tma(tma, q.device, (q, k, v), max_seq_len)
    scale_mode, scale_const, scale_t, stride_s = _scale_args(attn_scale, max_seq_len, q.device, q.shape[0])
    flags = _flags(causal, num_targets, max_attn_len, contextual_seq_len, min_full_attn_seq_len, intervals)
    if rab is not None:  # only then: without rab/intervals the launches (and the kernels) are the bias-free ones
        flags["HAS_RAB"] = True
    flags.update(tab_flags)
    # Algorithm: "split" = dK/dV kernel + separate dQ kernel (no atomics, bitwise repeatable);
    # "atomic" = one kernel, dQ through fp32 atomics. Split is the default: with the sequence-major
    # tile order it measured faster at N <= 1024 and tied at 2048 (H100, benchmarks/RESULTS.md, 2026-11-22/23;
    # atomics win at N <= 1024 only in the block-major order, where every tile re-reads Q/dO from DRAM).
    # config.bwd_algo = "atomic" (HSTU_INDUCTOR_BWD_ALGO=atomic) overrides.
    split = deterministic or config.get("bwd_algo") == "split"
    # With atomics, pointer loads measured faster than TMA loads in the dK/dV kernel: auto mode uses them.
    tma_dkdv = use_tma and (split or tma is True)
    if use_tma and not _tma_ok(dout):
        dout = dout.contiguous()
    bdq, bdv = _block_d(Dq), _block_d(Dv)
    common = dict(flags, SCALE_MODE=scale_mode, TMA=use_tma, SEQ_MAJOR=_seq_major(),
                  FAST=_fast_silu(q.dtype, q.device), PREC=_prec(q.dtype), EVEN_DQ=bdq == Dq, EVEN_DV=bdv == Dv,
                  BLOCK_DQ=bdq, BLOCK_DV=bdv)
    tail = (float(alpha), float(scale_const), H, Dq, Dv, L, max_seq_len, int(contextual_seq_len), int(max_attn_len),
            int(min_full_attn_seq_len), _n_bucket(max_seq_len))
    if split:
        dq = _new((L, H, Dq), q.dtype, q.device)
        dq_acc = None
        dq_mode = 0
        sdq = (0, 0)
    else:
        dq_acc = torch.zeros((L, H, Dq), dtype=torch.float32, device=q.device)
        # dQ accumulation: 1 = fp32 pointer atomics (default: measured faster than TMA bulk reduce-add on
        # H200), 2 = TMA reduce-add, 3 = vectorized red.v2 (sm90, even head dim). config.dq_mode.
        dq_mode = config.get("dq_mode")
        if dq_mode == 2 and not (tma_dkdv and not _interpret() and _tma_ok(dq_acc)):
            dq_mode = 1
        if dq_mode == 3 and (_interpret() or q.device.type != "cuda" or bdq != Dq):
            dq_mode = 1
        sdq = (dq_acc.stride(0), dq_acc.stride(1))
    args = (q, k, v, dout, dq_acc, dk, dv, seq_offsets, num_targets, scale_t,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
            sdq[0], sdq[1], dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), stride_s) + tail + rab_args \
        + iv_args + ((drab,) + g_strides if rab_grad else (None, 0, 0, 0, 0)) + tab_args \
        + (dpos, dts, copies, dpos.stride(0) if dpos is not None else 0, dts.stride(0) if dts is not None else 0) \
        + tab_bnd
    dkdv_kw = dict(common, DQ_MODE=dq_mode, TMA=tma_dkdv)
    if rab_grad:
        dkdv_kw["RAB_GRAD"] = rab_mode
    if table_grad:
        dkdv_kw["TAB_GRAD"] = True
    with _device_ctx(q.device):
        if use_tma:
            _ensure_allocator()
        zero_extra = tuple(name for name, t in (("DRAB", drab if rab_mode == 2 else None), ("DPOS", dpos),
                                                ("DTS", dts)) if t is not None)
        _launch("dkdv", max_seq_len, B * H, max(bdq, bdv), args, dkdv_kw, atomic_dq=not split, zero_extra=zero_extra,
                fp32=q.dtype == torch.float32)
        if split:
            args = (q, k, v, dout, dq, seq_offsets, num_targets, scale_t,
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                    dq.stride(0), dq.stride(1), stride_s, float(alpha), float(scale_const), 1.0) + tail[2:] \
                + rab_args + iv_args + tab_args + tab_bnd
            _launch("dq", max_seq_len, B * H, max(bdq, bdv), args, common, fp32=q.dtype == torch.float32)
        else:
            dq = dq_acc if q.dtype == torch.float32 else _new((L, H, Dq), q.dtype, q.device)
            numel = dq_acc.numel()
            block = 4096 if not _interpret() else 1024
            fin_args = (dq_acc, dq, scale_t, numel, float(alpha) * (scale_const if scale_mode == 0 else 1.0))
            _launcher(_dq_finalize_kernel, fin_args)[(triton.cdiv(numel, block),)](
                *fin_args, SCALE_MODE=1 if scale_mode == 1 else 0, BLOCK=block)
    return _ret(dq, dk, dv)
