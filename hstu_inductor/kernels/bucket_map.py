"""The time buckets of the table bias, once per call: a ``[B, N, N]`` map of ``bucket(ts(next(i)) - ts(j))``.

The bucket depends on the timestamps only, not on the head, yet the attention kernels would evaluate it per
head and per kernel (forward and dK/dV: ``2 H`` times per element). Within ``config.bucket_map_mb`` the host
computes the map with :func:`_bucket_map_kernel` (the same :func:`attention_jit._time_bucket`, one program per
(row block, sequence)) and hands it to the attention kernels in place of the timestamps, with ``HAS_TS = 5``:
they then read one byte per element (docs/kernels.md, "Table bias").

Only elements the attention can read are written (rows and keys inside the sequence; below the diagonal
when every mask option keeps keys at or before the query). The readers clamp what they read to the last
bucket, so the unwritten rest (masked elements) stays harmless.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import config
from ..reference.rab import map_dtype, map_fits
from . import common
from .attention_jit import MAP_HAS_TS, _bias_operands, _seq_bounds, _time_bucket
from .common import launcher

_BLOCK = 64


@triton.jit
def _bucket_map_kernel(MAP, SEQ_OFFSETS, TS, TSB, TSP, NB, ROWS, MAX_N, HAS_TS: tl.constexpr,
                       TS_STEPS: tl.constexpr, LOWER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m_blk = tl.program_id(0)
    b = tl.program_id(1)
    start, n = _seq_bounds(SEQ_OFFSETS, b, ROWS, MAX_N)
    r0 = m_blk * BLOCK_M
    if r0 >= n:
        return
    RB = _bias_operands(0, TS, 0, 0, NB, MAX_N, b, 0, start, n, 0, 0, 0, 0, TSB, TSP, False, False, HAS_TS, 0)
    # NB from the tuple, not the argument: returned through a helper it is a tensor (torch 2.11's mutation
    # analysis builds the TTIR with integer arguments as Python ints, and the bucket calls NB.to(...))
    TS_b, NB_t, TSB_t, TSP_t, slope, off, fits, seq = RB[3], RB[6], RB[8], RB[9], RB[10], RB[11], RB[12], RB[13]
    rows = r0 + tl.arange(0, BLOCK_M)
    hi = n
    if LOWER:
        hi = tl.minimum(r0 + BLOCK_M, n)
    map_b = MAP + b.to(tl.int64) * MAX_N * MAX_N
    for c0 in range(0, hi, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        bk = _time_bucket(rows, cols, r0, c0, n, seq, TS_b, MAX_N, TSB_t, TSP_t, NB_t, slope, off, fits, HAS_TS,
                          TS_STEPS, False)
        # keys masked by MAX_N, not n: the row's own padding (never read) is written too, and the mask stays
        # constant along runs of keys, so the stores vectorise (Triton then lays the tile out in row chunks)
        tl.store(map_b + rows[:, None] * MAX_N + cols[None, :], bk.to(MAP.dtype.element_ty),
                 mask=(rows[:, None] < n) & (cols[None, :] < MAX_N))


def with_bucket_map(tab_args: tuple, tab_bnd: tuple, tab_flags: dict, seq_offsets, rows: int, batch: int,
                    max_seq_len, spec, intervals) -> tuple:
    """(tab_args, tab_flags) with the timestamps replaced by their bucket map (``HAS_TS = 5``) when the table
    bias has a time table and the map fits ``config.bucket_map_mb``; else the arguments unchanged.
    ``rows``: the attention's L (the offsets are clamped to it, as the attention kernels do); ``spec`` and
    ``intervals``: the call's mask (:meth:`AttentionSpec.keys_up_to_query`: whether the map's upper triangle
    is read)."""
    ts, pos_w, ts_w, nb = tab_args
    has_ts = tab_flags.get("HAS_TS", 0)
    if ts_w is None or not has_ts or has_ts == MAP_HAS_TS or \
            not map_fits(nb, batch, max_seq_len, config.get("bucket_map_mb")):
        return tab_args, tab_flags
    bmap = make_bucket_map(ts, seq_offsets, rows, batch, max_seq_len, nb, tab_bnd, has_ts, tab_flags["TS_STEPS"],
                           spec.keys_up_to_query(intervals is not None))
    return (bmap, pos_w, ts_w, nb), dict(tab_flags, HAS_TS=MAP_HAS_TS)


def make_bucket_map(ts, seq_offsets, rows, batch, max_seq_len, num_buckets, tab_bnd, has_ts, ts_steps,
                    lower: bool) -> torch.Tensor:
    """The ``[B, N, N]`` map (uint8; int16 above 255 buckets) of ``ts``' buckets by :func:`_bucket_map_kernel`
    (``tab_bnd``, ``has_ts``, ``ts_steps``: attention_bias_args._tab_args' thresholds, plan and switches);
    ``lower``: only ``j <= i`` is written."""
    dtype = map_dtype(num_buckets)
    if common.POISON_OUTPUTS:  # tests: what the map kernel leaves unwritten must not matter
        bmap = torch.full((batch, max_seq_len, max_seq_len), torch.iinfo(dtype).max, dtype=dtype, device=ts.device)
    else:
        bmap = torch.empty((batch, max_seq_len, max_seq_len), dtype=dtype, device=ts.device)
    tsb, tsp = tab_bnd
    args = (bmap, seq_offsets, ts, tsb, tsp, num_buckets, rows, max_seq_len)
    grid = (-(-max_seq_len // _BLOCK), batch)  # plain arithmetic: SymInts too; callers return early for B, N = 0
    launcher(_bucket_map_kernel, args)[grid](*args, HAS_TS=has_ts, TS_STEPS=ts_steps, LOWER=lower, BLOCK_M=_BLOCK,
                                             BLOCK_N=_BLOCK)
    return bmap
