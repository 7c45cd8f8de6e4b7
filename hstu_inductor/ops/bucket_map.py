"""``hstu::time_bucket_map``: the table bias's time buckets as one ``[B, N, N]`` map for a whole training step.

``hstu::attention`` takes the map in place of its ``timestamps`` (a uint8 / int16 ``[B, N, N]`` tensor, told
apart from timestamps by dtype and rank): autograd then saves the map itself for the backward, which reads it
instead of computing the buckets again (one map kernel per step instead of one per op call; kernels/bucket_map.py).
The patterns emit it before the attention when the map fits ``config.bucket_map_mb``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from ..reference.rab import bucket_map as reference_bucket_map
from ..reference.rab import map_dtype
from . import _kernels

__all__ = ["time_bucket_map"]


@triton_op("hstu::time_bucket_map", mutates_args=())
def time_bucket_map(timestamps: Tensor, seq_offsets: Tensor, rows: int, max_seq_len: int, num_buckets: int,
                    ts_bounds: Optional[Tensor] = None, ts_next: bool = True, lower: bool = False) -> Tensor:
    """``map[b, i, j] = bucket(ts_b(next(i)) - ts_b(j))`` (``ts_next=False``: ``ts_b(i)``) with the thresholds
    ``ts_bounds`` (None: the default bucket), as ``relative_bias`` buckets them; uint8, int16 above 255 buckets.
    ``timestamps``: ``[L]`` jagged or ``[B, N]`` padded, as for ``hstu::attention``; ``rows``: the attention's L.
    On CUDA only what an attention can read is written: rows and keys inside each sequence, and with ``lower``
    only ``j <= i`` (for masks that keep every key at or before its query: causal, no contextual prefix, no
    intervals); the rest is unspecified."""
    B = seq_offsets.shape[0] - 1
    dtype = map_dtype(num_buckets)
    if dtype is None:
        raise ValueError(f"hstu::time_bucket_map: at most 32767 buckets, got {num_buckets}")
    if _kernels.kernels_for(timestamps) is None:
        return reference_bucket_map(timestamps, seq_offsets, max_seq_len, num_buckets, ts_bounds, ts_next)
    from ..kernels import bucket_map
    from ..kernels.attention import _device_ctx
    from ..kernels.attention_bias_args import ts_switches
    from ..kernels.common import address_source

    if B <= 0 or max_seq_len <= 0:
        return torch.zeros((max(B, 0), max_seq_len, max_seq_len), dtype=dtype, device=timestamps.device)
    bnd, has_ts, steps = ts_switches(timestamps, num_buckets, ts_bounds, ts_next)
    with _device_ctx(timestamps.device):  # the launch goes to the current device
        return bucket_map.make_bucket_map(timestamps.contiguous(), address_source(seq_offsets), rows, B, max_seq_len,
                                          num_buckets, bnd, has_ts, steps, lower)
