"""The original HSTU's relative attention bias from two learned tables (HSTU_SEMANTICS.md), as a dense rab.

``relative_bias`` materialises ``rab_b(i, j) = pos_w[N-1+j-i] + ts_w[bucket(ts_b(next(i)) - ts_b(j))]`` as a
``[B, 1, N, N]`` tensor for the ``rab`` argument of ``hstu_mha`` / the kernels / ``hstu::attention``.
It is differentiable: autograd scatters the dense ``d_rab`` into ``pos_w`` and ``ts_w`` (summed over
heads by the broadcast); ``relative_bias_backward`` is the same scatter in closed form. The kernels
compute this bias in-kernel from the tables (``hstu::attention(..., timestamps, pos_w, ts_w)``).
"""
from __future__ import annotations

import torch

from .jagged import jagged_to_padded

__all__ = ["time_buckets", "relative_bias", "relative_bias_backward"]


def time_buckets(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``clamp(floor(log(max(|dt|, 1)) / 0.301), 0, num_buckets)`` (natural log, computed in fp64), int64."""
    x = torch.log(dt.abs().to(torch.float64).clamp(min=1.0)) / 0.301
    return torch.floor(x).clamp(0, num_buckets).to(torch.int64)


def _indices(timestamps, seq_offsets, N, num_buckets, device):
    """(pos index [N, N] = N-1+j-i, bucket index [B, N, N] or None without timestamps)."""
    i = torch.arange(N, device=device)
    pos = N - 1 + i.unsqueeze(0) - i.unsqueeze(1)
    if timestamps is None:
        return pos, None
    ts = jagged_to_padded(timestamps, seq_offsets, N)  # [B, N]
    nxt = (i + 1).clamp(max=N - 1)
    return pos, time_buckets(ts[:, nxt].unsqueeze(-1) - ts.unsqueeze(1), num_buckets)


def relative_bias(timestamps: torch.Tensor | None, seq_offsets: torch.Tensor, max_seq_len: int,
                  pos_w: torch.Tensor | None, ts_w: torch.Tensor | None) -> torch.Tensor:
    """Dense ``[B, 1, N, N]`` rab of the original HSTU. ``timestamps: [L]`` (jagged, padded with 0),
    ``pos_w: [2N - 1]``, ``ts_w: [num_buckets + 1]``; ``next(i) = min(i + 1, N - 1)`` on padded positions.
    Either table may be None (its term is left out; ``timestamps`` is only needed with ``ts_w``)."""
    N = max_seq_len
    if pos_w is None and ts_w is None:
        raise ValueError("relative_bias needs pos_w and/or ts_w")
    if pos_w is not None and (pos_w.dim() != 1 or pos_w.shape[0] != 2 * N - 1):
        raise ValueError(f"pos_w must be [2N - 1] = [{2 * N - 1}], got {tuple(pos_w.shape)}")
    if ts_w is not None and (ts_w.dim() != 1 or ts_w.shape[0] < 1):
        raise ValueError(f"ts_w must be [num_buckets + 1], got {tuple(ts_w.shape)}")
    if ts_w is not None and timestamps is None:
        raise ValueError("ts_w needs timestamps")
    B = seq_offsets.shape[0] - 1
    dev = (pos_w if pos_w is not None else ts_w).device
    pos, bucket = _indices(timestamps if ts_w is not None else None, seq_offsets, N,
                           ts_w.shape[0] - 1 if ts_w is not None else 0, dev)
    if ts_w is None:
        return pos_w[pos].expand(B, N, N).unsqueeze(1)
    bias = ts_w[bucket]  # [B, N, N]
    if pos_w is not None:
        bias = pos_w[pos].unsqueeze(0) + bias
    return bias.unsqueeze(1)


def relative_bias_backward(d_bias: torch.Tensor, timestamps: torch.Tensor | None, seq_offsets: torch.Tensor,
                           max_seq_len: int, num_buckets: int | None):
    """Closed-form gradients of :func:`relative_bias`: ``d_bias: [B, H|1, N, N]`` (summed over heads) ->
    ``(d_pos_w [2N-1], d_ts_w [num_buckets+1] or None when num_buckets is None)``, in d_bias's dtype."""
    N = max_seq_len
    g = d_bias.sum(dim=1)  # [B, N, N]
    pos, bucket = _indices(timestamps if num_buckets is not None else None, seq_offsets, N, num_buckets or 0,
                           d_bias.device)
    d_pos = g.new_zeros(2 * N - 1).index_add_(0, pos.reshape(-1), g.sum(0).reshape(-1))
    d_ts = None
    if num_buckets is not None:
        d_ts = g.new_zeros(num_buckets + 1).index_add_(0, bucket.reshape(-1), g.reshape(-1))
    return d_pos, d_ts
