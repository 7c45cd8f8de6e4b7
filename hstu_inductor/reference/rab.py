"""The original HSTU's relative attention bias from two learned tables (HSTU_SEMANTICS.md), as a dense rab.

``relative_bias`` materialises ``rab_b(i, j) = pos_w[N-1+j-i] + ts_w[bucket(ts_b(next(i)) - ts_b(j))]`` as a
``[B, 1, N, N]`` tensor for the ``rab`` argument of ``hstu_mha`` / the kernels / ``hstu::attention``.
It is differentiable: autograd scatters the dense ``d_rab`` into ``pos_w`` and ``ts_w`` (summed over
heads by the broadcast). Computing the bias inside the kernels (no ``[B, N, N]`` tensor) is not done yet.
"""
from __future__ import annotations

import torch

from .jagged import jagged_to_padded

__all__ = ["time_buckets", "relative_bias"]


def time_buckets(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``clamp(floor(log(max(|dt|, 1)) / 0.301), 0, num_buckets)`` (natural log, computed in fp64), int64."""
    x = torch.log(dt.abs().to(torch.float64).clamp(min=1.0)) / 0.301
    return torch.floor(x).clamp(0, num_buckets).to(torch.int64)


def relative_bias(timestamps: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int, pos_w: torch.Tensor,
                  ts_w: torch.Tensor) -> torch.Tensor:
    """Dense ``[B, 1, N, N]`` rab of the original HSTU. ``timestamps: [L]`` (jagged, padded with 0),
    ``pos_w: [2N - 1]``, ``ts_w: [num_buckets + 1]``; ``next(i) = min(i + 1, N - 1)`` on padded positions."""
    N = max_seq_len
    if pos_w.dim() != 1 or pos_w.shape[0] != 2 * N - 1:
        raise ValueError(f"pos_w must be [2N - 1] = [{2 * N - 1}], got {tuple(pos_w.shape)}")
    if ts_w.dim() != 1 or ts_w.shape[0] < 1:
        raise ValueError(f"ts_w must be [num_buckets + 1], got {tuple(ts_w.shape)}")
    ts = jagged_to_padded(timestamps, seq_offsets, N)  # [B, N]
    i = torch.arange(N, device=ts.device)
    nxt = (i + 1).clamp(max=N - 1)
    bucket = time_buckets(ts[:, nxt].unsqueeze(-1) - ts.unsqueeze(1), ts_w.shape[0] - 1)  # [B, N, N]
    pos = pos_w[N - 1 + i.unsqueeze(0) - i.unsqueeze(1)]  # [N, N]: j - i
    return (pos.unsqueeze(0) + ts_w[bucket]).unsqueeze(1)
