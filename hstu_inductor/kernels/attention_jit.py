"""Shared ``@triton.jit`` helpers of the jagged HSTU attention kernels: ids and the element-wise mask,
the dense and table bias (with the time bucket), the silu variants, program order, the conservative
block-skipping bounds, and row tiles. One module for the forward and backward kernels (attention_fwd,
attention_bwd) and cached attention (delta.py), so that every mask and bias option means the same in all.

Two memory paths, chosen by ``TMA``:
  * pointer loads (any strides, any GPU, the Triton interpreter);
  * device-side tensor descriptors (``tl.make_tensor_descriptor``, TMA on sm90+), one descriptor
    per (sequence, head) whose shape ends at the sequence's last row: loads past it are zero-filled
    by the hardware and stores past it are dropped, so no row masks are needed.
Both go through one code path, :func:`_rows` / :func:`_load_rows` / :func:`_store_rows`: the
kernels never branch on ``TMA`` themselves.

Program order: the row blocks of one (sequence, head) are adjacent programs of a 1-D grid
(:func:`_tile`), so the CTAs resident at once share their K/V (or Q/dO) tiles in L2.

Callers import each helper by name: Triton (and Inductor, re-emitting a user kernel's source) resolve a
jit function's callees among the globals of the caller's module.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from ..spec import KernelMask

# The kernels' mask arguments (AttentionSpec.kernel_flags / kernel_lengths): one constexpr switch set ``MASK``,
# tested as ``_BIT & MASK`` (a constexpr, so every branch below is resolved at compile time), and the run-time
# lengths ``ml = (ML0, ML1, ML2, ML3)``, a tuple the kernels build from their scalar arguments. The helpers of
# this module are the only readers of either: a new mask option changes them, not the kernels.
_CAUSAL: tl.constexpr = tl.constexpr(KernelMask.CAUSAL)
_TARGETS: tl.constexpr = tl.constexpr(KernelMask.TARGETS)
_CONTEXT: tl.constexpr = tl.constexpr(KernelMask.CONTEXT)
_WINDOW: tl.constexpr = tl.constexpr(KernelMask.WINDOW)
_MINFULL: tl.constexpr = tl.constexpr(KernelMask.MINFULL)
# inline PTX does not run in the Triton interpreter (CPU tests): its helpers take the plain tl op there
_INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# HAS_TS value of kernels given the call's time-bucket map in place of timestamps (kernels/bucket_map.py)
MAP_HAS_TS = 5
_MAP_TS: tl.constexpr = tl.constexpr(MAP_HAS_TS)


# --------------------------------------------------------------------------------------------
# Element-wise helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _ids(p, M, ml, MASK: tl.constexpr):
    """pi(p): contextual prefix -> id 0, targets -> id M (M already holds the target shift)."""
    if _CONTEXT & MASK:
        x = tl.maximum(p - ml[0] + 1, 0)
    else:
        x = p
    if _TARGETS & MASK:
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
def _id_end(n, b, NUM_TARGETS, ml, MASK: tl.constexpr):
    """M, the end of ids of a sequence of length n; its target count is clamped to [0, n]."""
    if _CONTEXT & MASK:
        M = n - ml[0] + 1
    else:
        M = n
    if _TARGETS & MASK:
        M = M - tl.minimum(tl.maximum(tl.load(NUM_TARGETS + b).to(tl.int32), 0), n)
    return M


@triton.jit
def _valid(i, j, pi_i, pi_j, n, M, ml, MASK: tl.constexpr):
    """valid(i, j) for raw positions i (queries) and j (keys) of one sequence of length n (the kernels' spelling
    of reference.mask.hstu_valid)."""
    ok = (i < n) & (j < n) & (i >= 0)
    if _CAUSAL & MASK:
        d = pi_i - pi_j
        v = (i == j) | (d > 0)
        if _WINDOW & MASK:
            win = d <= ml[1]
            if _MINFULL & MASK:
                win = win | (pi_i >= M - ml[2])
            v = v & win
        if _CONTEXT & MASK:
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
def _bias_operands(RAB, TS, POSW, TSW, NB, MAX_N, b, h, start, n, stride_rb, stride_rh, stride_ri, stride_rj, TSB, TSP,
                   HAS_RAB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, TAB_HEADS: tl.constexpr):
    """The bias operands of sequence b, head h as one tuple for :func:`_bias`; 0 stands for an absent
    (None) pointer (a tuple cannot hold None). ``HAS_TS``: 1 for jagged ``[L]`` timestamps, 2 for dense
    ``[B, N]``, each + 2 for the gap ``ts(i) - ts(j)`` instead of ``ts(next(i)) - ts(j)``; 5: ``TS`` is the
    call's ``[B, N, N]`` bucket map instead (kernels/bucket_map.py). ``TSP``: the
    time-bucket guess (slope, offset, usable) fitted to the thresholds ``TSB``, then the thresholds in fp32
    (:func:`_ts_plan`, :func:`_time_bucket`). ``TAB_HEADS``: bit 1, the position table has a row per head
    (``[H, 2N-1]``); bit 2, the time table (``[H, NB+1]``)."""
    RAB_b = 0
    TS_b = 0
    POS_t = 0
    TSW_t = 0
    TSB_t = 0
    TSP_t = 0
    slope = 0.0
    off = 0.0
    fits = 0.0
    seq = (0, False, 0, False)
    if HAS_RAB:
        RAB_b = RAB + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh
    if HAS_POS:
        POS_t = POSW
        if TAB_HEADS % 2 == 1:
            POS_t = POSW + h.to(tl.int64) * (2 * MAX_N - 1)
    if HAS_TS:
        if HAS_TS == _MAP_TS:  # the bucket map [B, N, N] (kernels/bucket_map.py)
            TS_b = TS + b.to(tl.int64) * MAX_N * MAX_N
        elif HAS_TS % 2 == 0:  # dense [B, N] timestamps (a padded input): row b starts at b * N
            TS_b = TS + b.to(tl.int64) * MAX_N
        else:  # jagged [L]
            TS_b = TS + start
        TSW_t = TSW
        if TAB_HEADS >= 2:
            TSW_t = TSW + h.to(tl.int64) * (NB + 1)
        TSB_t = TSB
        TSP_t = TSP
        slope = tl.load(TSP).to(tl.float32, bitcast=True)
        off = tl.load(TSP + 1).to(tl.float32, bitcast=True)
        fits = tl.load(TSP + 2).to(tl.float32, bitcast=True)
        if TS.dtype.element_ty == tl.int64 or TS.dtype.element_ty == tl.float64:
            seq = _seq_plan(TS_b, n, MAX_N, HAS_TS)
    return (RAB_b, stride_ri, stride_rj, TS_b, POS_t, TSW_t, NB, MAX_N, TSB_t, TSP_t, slope, off, fits, seq)


@triton.jit
def _seq_plan(TS_b, n, MAX_N, HAS_TS: tl.constexpr):
    """(base, ok, pad, pad_far) of one sequence's int64 / fp64 timestamps, once per program: ``ok`` when every
    one is integral and within 2**29 of the first (``base``), so that every gap of the sequence is exact in
    int32 from ``t - base`` (:func:`_time_bucket`'s fast path, with no per-tile check). ``pad``: the timestamp
    next(n - 1) reads past the sequence's end (0 jagged, the user's padding when dense), ``pad_far`` when it is
    not itself within 2**29 of base (then the tile holding that row buckets it on its own)."""
    base = tl.load(TS_b, mask=n > 0, other=0)
    bad = n * 0
    for c0 in range(0, n, 256):
        idx = c0 + tl.arange(0, 256)
        d = tl.load(TS_b + idx, mask=idx < n, other=0) - base
        far = (d < -536870912) | (d > 536870912)
        if d.dtype == tl.float64:
            far = far | (d != tl.floor(d))
        bad = tl.maximum(bad, tl.max(tl.where(idx < n, far, False).to(tl.int32)))
    if HAS_TS % 2 == 0:  # dense [B, N]: next(n - 1) reads ts[b, n]
        pad = tl.load(TS_b + tl.minimum(n, MAX_N - 1))
    else:
        pad = (n * 0).to(TS_b.dtype.element_ty)
    dp = pad - base
    pad_far = (dp < -536870912) | (dp > 536870912)
    if dp.dtype == tl.float64:
        pad_far = pad_far | (dp != tl.floor(dp))
    return base, bad == 0, pad, pad_far


@triton.jit
def _table_load(ptrs):
    """Gather from a small read-only table (bias tables, thresholds, timestamps), every address in bounds: a plain
    read-only load per element on a GPU. A ``tl.load`` here is taken by Triton's software pipeliner as a
    4-byte ``cp.async`` per element through shared memory, slower than an L1 hit."""
    if _INTERPRET:
        return tl.load(ptrs)
    else:
        ty: tl.constexpr = ptrs.dtype.element_ty
        addr = ptrs.to(tl.int64, bitcast=True)
        if ty == tl.float32:
            return tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=f,l", [addr], dtype=tl.float32,
                                             is_pure=True, pack=1)
        elif ty == tl.int32:
            return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [addr], dtype=tl.int32,
                                             is_pure=True, pack=1)
        elif ty == tl.int64 or ty == tl.float64:  # timestamps
            return tl.inline_asm_elementwise("ld.global.nc.b64 $0, [$1];", "=l,l", [addr], dtype=tl.int64,
                                             is_pure=True, pack=1).to(ty, bitcast=True)
        else:  # fp16 / bf16 tables: 16 bits, then their type
            return tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [addr], dtype=tl.int16,
                                             is_pure=True, pack=1).to(ty, bitcast=True)


def _search_ptx(ty: str) -> str:
    """The binary search of :func:`_bucket_search` as one PTX block per element: ``$0`` the bucket, ``$1`` the gap
    (``ty``: s64 / f64 / f32), ``$2`` the thresholds' address, ``$3`` the first step (a power of two), ``$4`` NB."""
    return ("{ .reg .pred ok, ge; .reg .s32 bk, cand, step, idx; .reg .s64 addr; .reg .%s thr; "
            "mov.s32 bk, 0; mov.s32 step, $3; "
            "SEARCH_STEP: add.s32 cand, bk, step; setp.le.s32 ok, cand, $4; min.s32 idx, cand, $4; "
            "sub.s32 idx, idx, 1; mad.wide.s32 addr, idx, %d, $2; ld.global.nc.%s thr, [addr]; "
            "setp.ge.and.%s ge, $1, thr, ok; selp.s32 bk, cand, bk, ge; shr.s32 step, step, 1; "
            "setp.ne.s32 ok, step, 0; @ok bra SEARCH_STEP; mov.s32 $0, bk; }"
            % (ty, int(ty[1:]) // 8, ty.replace("s", "b"), ty))


_SEARCH_S64: tl.constexpr = tl.constexpr(_search_ptx("s64"))
_SEARCH_F64: tl.constexpr = tl.constexpr(_search_ptx("f64"))
_SEARCH_F32: tl.constexpr = tl.constexpr(_search_ptx("f32"))


@triton.jit
def _bucket_search(x, TSB, NB, TS_STEPS: tl.constexpr):
    """#{k : x >= TSB[k]} by binary search over the sorted thresholds, in their dtype (int64 / fp64 / fp32):
    TS_STEPS gathers. On a GPU one inline PTX loop per element: Triton's layout pass prices an unrolled search
    on a tile above a shared-memory conversion and would then keep the whole bias in a layout of its own."""
    if _INTERPRET:
        bk = tl.zeros(x.shape, dtype=tl.int32)
        for s in tl.static_range(TS_STEPS):
            cand = bk + (1 << (TS_STEPS - 1 - s))
            ok = cand <= NB
            thr = tl.load(TSB + (tl.minimum(cand, NB) - 1))
            bk = tl.where(ok & (x >= thr), cand, bk)
        return bk
    else:
        ty: tl.constexpr = TSB.dtype.element_ty
        addr = TSB.to(tl.int64, bitcast=True)
        top = 1 << (TS_STEPS - 1)
        if ty == tl.float32:
            return tl.inline_asm_elementwise(_SEARCH_F32, "=r,f,l,r,r", [x.to(tl.float32), addr, top, NB],
                                             dtype=tl.int32, is_pure=True, pack=1)
        elif ty == tl.float64:
            return tl.inline_asm_elementwise(_SEARCH_F64, "=r,d,l,r,r", [x.to(tl.float64), addr, top, NB],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_SEARCH_S64, "=r,l,l,r,r", [x.to(tl.int64), addr, top, NB],
                                             dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _log2_guess(x, FTZ: tl.constexpr = False):
    """log2 of fp32 ``x`` for the bucket guess: one MUFU op on a GPU (error ~1e-7, inside _ts_plan's margin).
    ``FTZ`` where ``x`` is never subnormal (integer gaps): without it ptxas rescales every input around the op."""
    if _INTERPRET:
        return tl.log2(x)
    elif FTZ:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _gap32(tsn, tsj, base, rv, cv, far_ok):
    """(ok, a, b): the gaps of the tile in 32 bits, ``|a[i] - b[j]|`` (int32), where that is exact enough for
    the bucket: every gap equals ``|tsn[i] - tsj[j]|`` (the timestamps' own arithmetic), or both exceed every
    threshold. ``tsn``/``tsj``: the row and column vectors; ``base`` is one timestamp of the tile; ``rv``/``cv``
    the valid rows/columns; ``far_ok``: every threshold is below 2**29.

    Int64 or integral fp64 timestamps within 2**29 of ``base`` (the "core") are exact in int32, and so are
    their differences. A value outside the core is clamped to +-2**30: its gap to a core value stays above
    2**29, as the true gap, so both are in the last bucket when ``far_ok``. A pair with both ends outside the
    core is what this cannot answer: ``ok`` needs every valid row and column in the core, or (with
    ``far_ok``) all rows or all columns; for floats also integral values (a fraction would be lost)."""
    a = tsn - base
    b = tsj - base
    core_a = (a >= -536870912) & (a <= 536870912)
    core_b = (b >= -536870912) & (b <= 536870912)
    rows_in = tl.min(tl.where(rv, core_a, True).to(tl.int32)) > 0
    cols_in = tl.min(tl.where(cv, core_b, True).to(tl.int32)) > 0
    ok = (rows_in & cols_in) | (far_ok & (rows_in | cols_in))
    if tsn.dtype == tl.float64:
        whole = tl.min(tl.where(rv, a == tl.floor(a), True).to(tl.int32)) > 0
        whole = whole & (tl.min(tl.where(cv, b == tl.floor(b), True).to(tl.int32)) > 0)
        ok = ok & whole
    a = tl.minimum(tl.maximum(a, -1073741824), 1073741824).to(tl.int32)
    b = tl.minimum(tl.maximum(b, -1073741824), 1073741824).to(tl.int32)
    return ok, a, b


@triton.jit
def _bucket_native(tn, tj, TSP, NB, slope, off):
    """(bucket, exact) for 32-bit timestamps (:func:`_time_bucket`): the gap in their dtype, rounded to fp32 once
    (xf) and compared with the fp32 threshold. Rounding is monotone, so ``xf != fp32(t)`` decides ``x >= t``; an
    fp32 gap, or an integer one below 2**24, is exact, so only an integer tie above it is ambiguous (``exact``
    false: the tile redoes its buckets by a binary search)."""
    xf = tl.abs(tn - tj).to(tl.float32)
    u = _log2_guess(xf) * slope + off
    u = tl.where(u > 0.0, u, 0.0)  # also NaN (a negative int gap, |INT_MIN|) and -inf (x = 0)
    c = tl.minimum(u, NB.to(tl.float32)).to(tl.int32)
    t = _table_load(TSP + 3 + c).to(tl.float32, bitcast=True)  # TSP[3 + NB] is NaN: never reached
    exact = True
    if tn.dtype == tl.int32:  # below 2**24 integers are exact in fp32: a tie is equality
        tie = (xf == t) & (xf >= 16777216.0)
        exact = tl.max(tl.max(tie.to(tl.int32), axis=1), axis=0) == 0
    return c + (xf >= t).to(tl.int32), exact


@triton.jit
def _bucket32(a, b, TSP, NB, slope, off):
    """The bucket of the int32 gap ``|a - b|`` against the integer thresholds: the guess, then one threshold."""
    x = tl.abs(a - b)
    u = _log2_guess(x.to(tl.float32), True) * slope + off
    u = tl.where(u > 0.0, u, 0.0)  # also -inf (x = 0) and NaN (|INT_MIN| of a row outside the sequence)
    c = tl.minimum(u, NB.to(tl.float32)).to(tl.int32)
    t = _table_load(TSP + NB + 4 + c)  # the integer thresholds; [NB] is INT32_MAX: never reached
    return c + (x >= t).to(tl.int32)


@triton.jit
def _grid(r, c, T: tl.constexpr):
    """The tile's broadcast views of a query-indexed vector ``r`` and a key-indexed vector ``c``: queries along
    axis 0 (forward, dQ), or along axis 1 with ``T`` (dK/dV's transposed tile)."""
    if T:
        return r[None, :], c[:, None]
    else:
        return r[:, None], c[None, :]


@triton.jit
def _ts_vectors(TS_b, rows, cols, n, MAX_N, HAS_TS: tl.constexpr):
    """(tsn, tsj): the timestamps of the query rows' ``next(i)`` (``min(i + 1, N - 1)`` on padded positions,
    HAS_TS 1 and 2; ``i`` itself, 3 and 4) and of the keys, as vectors. Padding reads 0 (the last row of a
    shorter jagged sequence is compared with 0, as in reference.relative_bias); dense ``[B, N]`` timestamps
    (HAS_TS 2, 4) read the user's own padding. Addresses are clamped into the sequence (or row), values outside
    zeroed: every read is in bounds, through the read-only path (a tl.load here would be pipelined as one
    cp.async per element, its predicates carried across iterations)."""
    if HAS_TS >= 3:
        nx = rows
    else:
        nx = tl.minimum(rows + 1, MAX_N - 1)
    if HAS_TS % 2 == 0:
        last = MAX_N - 1
        has_n = nx >= 0
    else:
        last = tl.maximum(n - 1, 0)
        has_n = (nx >= 0) & (nx < n)
    tsn = tl.where(has_n, _table_load(TS_b + tl.minimum(tl.maximum(nx, 0), last)), 0)
    tsj = tl.where(cols < n, _table_load(TS_b + tl.minimum(cols, last)), 0)
    return tsn, tsj


@triton.jit
def _map_load(ptrs):
    """One element of a bucket map (uint8 or int16) as int32, through the read-only path (see _table_load)."""
    if _INTERPRET:
        return tl.load(ptrs).to(tl.int32)
    else:
        asm: tl.constexpr = "ld.global.nc.u8 $0, [$1];" if ptrs.dtype.element_ty == tl.uint8 else \
            "ld.global.nc.s16 $0, [$1];"
        return tl.inline_asm_elementwise(asm, "=r,l", [ptrs.to(tl.int64, bitcast=True)], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _time_bucket(rows, cols, i0, j0, n, seq, TS_b, MAX_N, TSB, TSP, NB, slope, off, fits,
                 HAS_TS: tl.constexpr, TS_STEPS: tl.constexpr, T: tl.constexpr):
    """The time bucket on a tile (see :func:`_time_bucket_ts`); with ``HAS_TS`` 5 read from the call's bucket
    map (kernels/bucket_map.py: ``TS_b`` is sequence b's ``[N, N]``), clamped into ``[0, NB]``: what the map
    leaves unwritten (masked elements) stays a valid table index."""
    if HAS_TS == _MAP_TS:
        r, c = _grid(tl.minimum(rows, MAX_N - 1), tl.minimum(cols, MAX_N - 1), T)
        bk = tl.minimum(tl.maximum(_map_load(TS_b + (r * MAX_N + c)), 0), NB)
    else:
        bk = _time_bucket_ts(rows, cols, i0, j0, n, seq, TS_b, MAX_N, TSB, TSP, NB, slope, off, fits, HAS_TS,
                             TS_STEPS, T)
    return bk


@triton.jit
def _time_bucket_ts(rows, cols, i0, j0, n, seq, TS_b, MAX_N, TSB, TSP, NB, slope, off, fits,
                    HAS_TS: tl.constexpr, TS_STEPS: tl.constexpr, T: tl.constexpr):
    """#{k : |tsn - tsj| >= TSB[k]} exactly on the tile of query positions ``rows`` against keys ``cols``
    (vectors, laid out by :func:`_grid` and ``T``; timestamps by :func:`_ts_vectors`), the gap taken in the
    timestamps' dtype (int32/int64/fp32/fp64). ``TSB``: sorted thresholds, int64 for integer gaps, else the
    gaps' dtype; ``TSP``: _ts_plan's guess, the thresholds in fp32 and as integers; all tiny and L1-resident.
    ``i0``/``j0``: the tile's first row / a valid key.

    The guess ``c = clamp(floor(slope * log2(fp32(x)) + off), 0, NB)`` (monotone) is the bucket or the one
    below it (_ts_plan checked both ends of every bucket), and one gather of the next threshold decides which.
    Per score element only 32-bit values: 64-bit ones spill (sm90). Int64 and integral fp64 timestamps take
    the gap in int32 against the integer thresholds, exactly: a sequence within 2**29 of its first timestamp
    (:func:`_seq_plan`, checked once per program) with no per-tile work; otherwise per tile (:func:`_gap32`,
    reductions); int32 and fp32 timestamps: :func:`_bucket_native`. What none of these answers (rare), or
    thresholds off the guess, takes a binary search in the native dtype, with few live registers.

    Structure: the fast path is computed on every tile and a fallback overwrites it under a scalar branch,
    from vectors read again. A branch whose arms each build the tile, or a fallback sharing the fast path's
    values, makes Triton keep the whole bias in a layout of its own, converted through shared memory to the
    scores' every tile."""
    tsn, tsj = _ts_vectors(TS_b, rows, cols, n, MAX_N, HAS_TS)
    if tsn.dtype == tl.int64 or tsn.dtype == tl.float64:
        base, seq_ok, pad, pad_far = seq
        ok32 = tl.load(TSP + 2 * NB + 5)  # 0: the guess does not fit; 2: every threshold below 2**29
        fast = seq_ok & (ok32 != 0)
        if fast:
            a = (tsn - base).to(tl.int32)
            b = (tsj - base).to(tl.int32)
            exact = fast
        else:
            exact, a, b = _gap32(tsn, tsj, tl.load(TS_b + j0), rows < n, cols < n, ok32 == 2)
            exact = exact & (ok32 != 0)
        ga, gb = _grid(a, b, T)
        bk = _bucket32(ga, gb, TSP, NB, slope, off)
        if HAS_TS < 3:  # the row whose next(i) is past the end reads ``pad``
            if fast & pad_far & (i0 <= n - 1) & (n - 1 < i0 + rows.numel) & (n < MAX_N):
                r, tj = _grid(rows, tsj, T)
                bk = tl.where(r == n - 1, _bucket_search(tl.abs(pad - tj), TSB, NB, TS_STEPS), bk)
    else:
        tn, tj = _grid(tsn, tsj, T)
        bk, exact = _bucket_native(tn, tj, TSP, NB, slope, off)
        exact = exact & (fits != 0.0)
    if not exact:
        tsn2, tsj2 = _ts_vectors(TS_b, rows, cols, n, MAX_N, HAS_TS)
        tn, tj = _grid(tsn2, tsj2, T)
        bk = _bucket_search(tl.abs(tn - tj), TSB, NB, TS_STEPS)
    return bk


@triton.jit
def _bias(RB, rows, cols, i0, j0, n, HAS_RAB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr,
          TS_STEPS: tl.constexpr, T: tl.constexpr):
    """(bias, bucket) on a tile, fp32, zero outside the sequence: the dense rab plus the table bias
    ``pos_w[N-1+j-i] + ts_w[bucket(ts(next(i)) - ts(j))]`` (docs/semantics.md). ``rows`` (i) and ``cols``
    (j) are the position vectors (the tile laid out by :func:`_grid` and ``T``), ``i0`` the tile's first row,
    ``j0`` a valid key. The bucket tile (int32, 0 without HAS_TS) feeds d ts_w."""
    RAB_b, stride_ri, stride_rj, TS_b, POSW, TSW, NB, MAXN, TSB, TSP, slope, off, fits, seq = RB
    r, c = _grid(rows, cols, T)
    inside = (r < n) & (c < n)
    bk = 0
    if HAS_RAB:
        x = _rab_tile(RAB_b, r, c, n, stride_ri, stride_rj)
    else:
        x = tl.where(inside, 0.0, 0.0)
    if HAS_POS:
        pi = tl.minimum(tl.maximum(MAXN - 1 + c - r, 0), 2 * MAXN - 2)  # in bounds off the sequence too
        x += tl.where(inside, _table_load(POSW + pi).to(tl.float32), 0.0)
    if HAS_TS:
        # the bucket of ts(next(i)) - ts(j) (or ts(i) - ts(j)), the difference in the timestamps' dtype
        bk = _time_bucket(rows, cols, i0, j0, n, seq, TS_b, MAXN, TSB, TSP, NB, slope, off, fits, HAS_TS, TS_STEPS, T)
        x += tl.where(inside, _table_load(TSW + bk).to(tl.float32), 0.0)  # bk in [0, NB] everywhere
    return x, bk


@triton.jit
def _pre_silu(s, alpha, RB, rows, cols, i0, j0, n, HAS_RAB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr,
              TS_STEPS: tl.constexpr, T: tl.constexpr):
    """(x, a, bucket) with silu(a * x) the score: (s, alpha, 0) without a bias (the bias-free arithmetic),
    else (alpha * s + bias, 1, bucket). ``rows``/``cols``: query and key positions (vectors), ``T``: queries
    along the tile's axis 1 (:func:`_grid`)."""
    if HAS_RAB or HAS_POS or HAS_TS:
        x, bk = _bias(RB, rows, cols, i0, j0, n, HAS_RAB, HAS_POS, HAS_TS, TS_STEPS, T)
        return s * alpha + x, 1.0, bk
    else:
        return s, alpha, 0


@triton.jit
def _bias_grad(ds, bk, GB, offs_m, offs_n, start_m, n, RAB_GRAD: tl.constexpr, TAB_GRAD: tl.constexpr,
               HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bias gradients from one transposed dS tile ``ds[j, i]`` (keys ``offs_n`` x queries ``offs_m``, zero
    where invalid). RAB_GRAD 1: store d rab (each element has one writer); 2: fp32 atomics into a buffer
    of rab's broadcast shape (strides 0 on broadcast dims). TAB_GRAD: into this program's copy of each table
    gradient, d pos_w by diagonal sums, d ts_w by per-row sums per bucket: never an atomic per score element.

    Mutation analysis (torch's triton_kernel_wrap, what AOTAutograd functionalizes by): a write address is traced
    back through every op but a load, and through a helper call to every pointer the helper received. So N comes
    in GB (a kernel argument), not RB (:func:`_bias_operands`' result), and the d ts_w slot, derived from the
    bucket (:func:`_pre_silu` reads pos_w / ts_w / timestamps), is read back as a load that never touches memory
    (mask off, the value from ``other``), here and not in a helper; else those inputs count as written and
    compiled training fails on leaves mutated in place."""
    DRAB_b, stride_gi, stride_gj, DPOS, DTS, gsc, MAXN = GB
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
            # per key row, its buckets relative to the row's lowest: a row spans few (the gap grows along it
            # when timestamps increase; the diagonal's rows span more). Each row sum stays inside the warp
            # that holds the row (no tile-wide reduction but the span), then one atomic per row and bucket.
            nz = g != 0.0
            b0 = tl.min(tl.where(nz, bk, 1 << 30), axis=1)
            span = tl.max(tl.max(tl.where(nz, bk - b0[:, None], 0), axis=1), axis=0)
            # b0 through a load that never reads (b0 >= 0): the atomics' address vector then gets its layout
            # once per tile, not a shared-memory conversion per bucket offset (8 -> 4 barriers per offset, sm90)
            slot0 = tl.load(DTS.to(tl.pointer_type(tl.int32), bitcast=True) + b0 * 0, mask=b0 < 0, other=b0)
            for d in range(0, span + 1):
                rs = tl.sum(tl.where(bk == (b0 + d)[:, None], g, 0.0), axis=1)
                tl.atomic_add(DTS + (slot0 + d), rs, mask=rs != 0.0, sem="relaxed")


@triton.jit
def _iv_valid(i, j, x0, x1, x2, n):
    """Interval mask (it replaces the HSTU mask): key j visible to row i iff j in [0, x0) | [x1, x2), j < n."""
    return (i < n) & (j < n) & ((j < x0) | ((j >= x1) & (j < x2)))


@triton.jit
def _row_tile_mask(pos_m, offs_n, pi_m, x0, x1, x2, n, M, ml, MASK: tl.constexpr, HAS_IV: tl.constexpr):
    """Visibility of a [BLOCK_M, BLOCK_N] tile with query rows ``pos_m`` (ids ``pi_m``) and keys ``offs_n``: the
    interval mask with intervals, else the HSTU mask (the forward's and dQ's loops; dK/dV's tile is transposed)."""
    if HAS_IV:
        return _iv_valid(pos_m[:, None], offs_n[None, :], x0[:, None], x1[:, None], x2[:, None], n)
    pi_n = _ids(offs_n, M, ml, MASK)
    return _valid(pos_m[:, None], offs_n[None, :], pi_m[:, None], pi_n[None, :], n, M, ml, MASK)


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
def _fwd_key_range(m_first, m_last, n, M, ml, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """Key ranges for the query rows [m_first, m_last] (raw positions).

    Returns (a, fs, fe, e), multiples of BLOCK_N: keys in [a, fs) and [fe, e) need the mask, keys in
    [fs, fe) are valid for every query row of the block, keys outside [a, e) are invalid for all.
    """
    w = ml[1]
    f = ml[2]
    if _CAUSAL & MASK:
        if _CONTEXT & MASK:
            c1 = ml[0] - 1
        else:
            c1 = 0
        P = _ids(m_first, M, ml, MASK)
        Pmax = _ids(m_last, M, ml, MASK)
        hi = m_last + 1  # causal: j <= i
        lo = m_last * 0
        full_lo = m_last * 0
        if _WINDOW & MASK:
            # valid j needs pi(j) >= pi(i) - w >= P - w, and pi(j) <= max(j - c1, 0)
            lo = tl.where(P - w > 0, P - w + c1, 0)
            qw = Pmax - w
            full_lo = tl.where(qw > 0, qw + c1, 0)
            if _MINFULL & MASK:  # rows with pi >= M - f ignore the window
                lo = tl.where(Pmax >= M - f, 0, lo)
                full_lo = tl.where(P >= M - f, 0, full_lo)
        # every j with pi(j) < P is strictly before every row of the block (d > 0)
        full_hi = tl.where(P > 0, P + c1, 0)
        if _CONTEXT & MASK:  # contextual rows (pi == 0) see the whole non-target history
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
def _bwd_query_range(n0, n, M, ml, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """Query ranges that can see the key rows [n0, n0 + BLOCK_N) (raw positions).

    Returns (cb, qa, qf, qe, qz), multiples of BLOCK_M: rows [0, cb) (contextual prefix) and
    [qa, qf), [qe, qz) need the mask; rows [qf, qe) see every key of the block.
    """
    c = ml[0]
    w = ml[1]
    if _CAUSAL & MASK:
        if _CONTEXT & MASK:
            c1 = c - 1
            cb = (c + BLOCK_M - 1) // BLOCK_M
        else:
            c1 = 0
            cb = n * 0
        j_last = tl.minimum(n0 + BLOCK_N, n) - 1
        qhi = n
        if _WINDOW & MASK:
            if not (_MINFULL & MASK):
                x = _ids(j_last, M, ml, MASK) + w  # rows need pi(i) <= pi(j_last) + w
                qhi = tl.minimum(n, x + c1 + 1)
                if _TARGETS & MASK:
                    qhi = tl.where(x >= M, n, qhi)
        qa = tl.maximum(n0 // BLOCK_M, cb)
        qz = (qhi + BLOCK_M - 1) // BLOCK_M
        # full rows: pi(i) >= max(n0 + BLOCK_N - c1, 1) (keys strictly earlier), rows complete
        qf = (tl.maximum(n0 + BLOCK_N, c1 + 1) + BLOCK_M - 1) // BLOCK_M
        qe = n // BLOCK_M
        if _TARGETS & MASK:
            qe = tl.where(n0 + BLOCK_N - c1 > M, qf, qe)
        if _WINDOW & MASK:
            if _MINFULL & MASK:
                qe = qf
            else:
                y = _ids(n0, M, ml, MASK) + w  # whole block in window: pi(last row) <= y
                qe_w = (y + c1 + 1) // BLOCK_M
                if _TARGETS & MASK:
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
