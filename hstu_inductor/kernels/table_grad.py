"""Table-bias gradients from the call's dense bias gradient: ``d pos_w`` by diagonal sums, ``d ts_w`` by bucket.

Reduced inside the dK/dV kernel (``TAB_GRAD``), every head's program evaluates the per-diagonal and per-bucket
sums of each score tile between its matrix products, and that work is serial with them. For tables shared by
the heads, within ``config.table_grad_mb``, the dK/dV kernel instead adds the bias gradient into one fp32
``G[b, i, j]`` (the ``RAB_GRAD = 2`` atomics of a ``[B, 1, N, N]`` rab, the heads summed), and
:func:`_table_grad_kernel` reduces it in one pass over ``G`` and the bucket map (docs/kernels.md, "Table bias").

The pass walks ``G`` along its diagonals: a tile holds rows ``i`` x diagonals ``d = i - j``, so the position
sums are column sums of the tile, while its loads stay contiguous (``j`` grows along the tile's fast axis).
The time sums loop over the buckets present in the tile into a register vector of per-bucket sums, added once
per program. Near the diagonal a tile holds tens of buckets (a gap of a few time steps is as spread as one
step); there each element is added on its own into a row of d ts_w that belongs to the program, so the adds
never contend (a per-element atomic into one shared table would serialise on its few addresses).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _compat, config
from .attention_jit import _seq_bounds
from .common import interpret, launcher

# 32 diagonals x 64 rows, a tile with 8 or more buckets added element by element: H200, B=128, N=1024, 0.38 ms
# against 0.42-0.60 for the other tiles and thresholds tried (benchmarks/RESULTS.md, 2026-11-29, fourth session)
_BLOCK_D = 32
_BLOCK_I = 64
_WARPS = 4
_SPAN = 8  # buckets in a tile from which each element is added on its own (its program's row of d ts_w)


@triton.jit
def _table_grad_kernel(G, MAP, SEQ_OFFSETS, DPOS, DTS, ROWS, MAX_N, NB, COPIES, stride_pc, stride_tc,
                       HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, LOWER: tl.constexpr, NBP: tl.constexpr,
                       SPAN: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr):
    d_blk = tl.program_id(0)
    b = tl.program_id(1)
    start, n = _seq_bounds(SEQ_OFFSETS, b, ROWS, MAX_N)
    # the tile's diagonals d = i - j, the largest first: j = i - d grows along the tile's axis 1
    d_lo = d_blk * BLOCK_D
    if not LOWER:
        d_lo -= MAX_N - 1
    d_hi = d_lo + BLOCK_D - 1
    if (d_lo >= n) | (d_hi <= -n):
        return
    d = d_hi - tl.arange(0, BLOCK_D)
    g_b = G + b.to(tl.int64) * MAX_N * MAX_N
    map_b = MAP + b.to(tl.int64) * MAX_N * MAX_N
    slot = (d_blk + b) % COPIES  # copies of the table gradients spread the atomics (summed on the host)
    if NBP > 0:  # d ts_w: a row of its own per program ([programs, NB + 1], summed on the host)
        DTS_s = DTS + (b * tl.num_programs(0) + d_blk).to(tl.int64) * (NB + 1)
    else:
        DTS_s = DTS + slot * stride_tc
    pos_acc = tl.zeros([BLOCK_I, BLOCK_D], dtype=tl.float32)
    buckets = tl.arange(0, NBP if NBP > 0 else 1)
    ts_acc = tl.zeros([NBP if NBP > 0 else 1], dtype=tl.float32)
    for i0 in range(tl.maximum(d_lo, 0), tl.minimum(n, n + d_hi), BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        j = i[:, None] - d[None, :]
        ok = (i[:, None] < n) & (j >= 0) & (j < n)
        off = i[:, None] * MAX_N + j  # 32-bit within one sequence's plane: N^2 < 2^31 (the caller checks)
        x = tl.load(g_b + off, mask=ok, other=0.0)
        if HAS_POS:
            pos_acc += x
        if HAS_TS:
            # the map holds buckets 0..NB where the attention reads; elsewhere x is 0 and the bucket unused
            bk = tl.minimum(tl.load(map_b + off, mask=ok, other=0).to(tl.int32), NB)
            nz = x != 0.0
            k0 = tl.min(tl.where(nz, bk, 1 << 30))
            k1 = tl.max(tl.where(nz, bk, -1))
            if (NBP > 0) & (k1 - k0 >= SPAN):
                # many buckets (near the diagonal they follow single time steps): each element added into the
                # program's own row, which no other program touches
                tl.atomic_add(DTS_s + bk, x, mask=nz, sem="relaxed")
            else:
                for k in range(k0, k1 + 1):
                    s = tl.sum(tl.where(bk == k, x, 0.0))
                    if NBP > 0:  # summed in registers: added once per program, not per tile and bucket
                        ts_acc += tl.where(buckets == k, s, 0.0)
                    else:
                        tl.atomic_add(DTS_s + k, s, mask=s != 0.0, sem="relaxed")
    if NBP > 0:
        tl.atomic_add(DTS_s + buckets, ts_acc, mask=(buckets <= NB) & (ts_acc != 0.0), sem="relaxed")
    if HAS_POS:
        DPOS_s = DPOS + slot * stride_pc
        part = tl.sum(pos_acc, axis=0)
        # d pos_w[N - 1 + j - i]; diagonals outside the sequence summed nothing
        tl.atomic_add(DPOS_s + (MAX_N - 1 - d), part, mask=(d < n) & (d > -n), sem="relaxed")


def _acc_size(num_buckets) -> int:
    """Register slots for the per-bucket sums (a power of two > num_buckets), 0 past 256 buckets: then one
    atomic per tile and bucket instead."""
    if isinstance(num_buckets, int) and num_buckets < 256:
        return 1 << num_buckets.bit_length()
    return 0


def use_dense_grad(tab_flags: dict, map_ts: int, batch: int, max_seq_len) -> bool:
    """Whether the table gradients go through the dense buffer: tables shared by the heads (a per-head table
    would need a plane per head: H-fold memory for a step that measured no faster), a time table only with
    its bucket map (``HAS_TS == map_ts``, kernels/bucket_map.py), and the buffer within
    ``config.table_grad_mb``."""
    if not tab_flags or tab_flags.get("TAB_HEADS", 0) or tab_flags.get("HAS_TS", 0) not in (0, map_ts):
        return False
    budget = config.get("table_grad_mb") * 2 ** 20
    if budget <= 0 or not _compat.guarded(max_seq_len <= 46340):  # 32-bit offsets in both kernels
        return False
    return _compat.guarded(batch * max_seq_len * max_seq_len * 4 <= budget)


def reduce_table_grads(g: torch.Tensor, bmap, seq_offsets, rows: int, max_seq_len, lower: bool, dpos, dts,
                       num_buckets) -> None:
    """Adds the table gradients of the dense bias gradient ``g`` (fp32 ``[B, 1, N, N]``, contiguous) into
    ``dpos`` / ``dts`` (``[copies, table]`` fp32; None for an absent table). ``bmap``: the call's ``[B, N, N]``
    bucket map (None without a time table); ``lower``: only ``j <= i`` can be nonzero
    (AttentionSpec.keys_up_to_query)."""
    block_d, block_i = (16, 16) if interpret() else (_BLOCK_D, _BLOCK_I)  # small tiles: the interpreter's time
    diagonals = max_seq_len if lower else 2 * max_seq_len - 1
    grid = (-(-diagonals // block_d), g.shape[0])  # plain arithmetic: SymInts too
    nbp = _acc_size(num_buckets) if dts is not None else 0
    ts_rows = dts
    if nbp:  # one d ts_w row per program (a few MiB): no two programs add into one address
        ts_rows = torch.zeros((grid[0] * grid[1], num_buckets + 1), device=g.device, dtype=torch.float32)
    spare = dpos if dpos is not None else ts_rows
    args = (g, bmap if bmap is not None else g, seq_offsets, dpos if dpos is not None else spare,
            ts_rows if ts_rows is not None else spare, rows, max_seq_len, num_buckets,
            dpos.shape[0] if dpos is not None else 1, dpos.stride(0) if dpos is not None else 0,
            dts.stride(0) if dts is not None else 0)
    launcher(_table_grad_kernel, args)[grid](
        *args, HAS_POS=dpos is not None, HAS_TS=dts is not None, LOWER=lower, NBP=nbp, SPAN=_SPAN,
        BLOCK_D=block_d, BLOCK_I=block_i, num_warps=_WARPS)
    if nbp:
        dts[0] += ts_rows.sum(0).view(dts.shape[1:])
