"""The HSTU attention mask, spelled out on ids exactly as in HSTU_SEMANTICS.md."""
from __future__ import annotations

import torch

__all__ = ["position_ids", "hstu_mask"]


def position_ids(
    positions: torch.Tensor,
    lengths: torch.Tensor,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map raw positions ``p`` to ids ``pi(p)`` and return ``(pi, M)``.

    ``positions`` broadcasts against ``lengths[:, None]``. The contextual prefix collapses to id 0,
    and all targets share the id ``M`` (the end of history ids).
    """
    c = contextual_seq_len
    n = lengths.unsqueeze(-1)
    if c > 0:
        ids = torch.clamp(positions - c + 1, min=0)
        end = n - c + 1
    else:
        ids = positions.expand(lengths.shape[0], positions.shape[-1]) if positions.dim() == 1 else positions
        end = n
    if num_targets is not None:
        end = end - num_targets.to(lengths.dtype).unsqueeze(-1)
        ids = torch.minimum(ids, end)
    return ids, end


def hstu_mask(
    lengths: torch.Tensor,
    max_seq_len: int,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    causal: bool = True,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean ``valid(i, j)`` of shape ``[B, Q, N]`` (``Q = N`` unless ``query_positions`` given).

    ``query_positions: [B, Q]`` selects which raw query rows to build (delta attention).
    Pairs involving positions ``>= n_b`` are False. ``causal=False`` makes every in-sequence
    pair valid.
    """
    lengths = lengths.to(torch.int64)
    dev = lengths.device
    N = max_seq_len
    j = torch.arange(N, device=dev, dtype=torch.int64).unsqueeze(0)  # [1, N]
    i = j if query_positions is None else query_positions.to(torch.int64)  # [1|B, Q]
    in_seq = (i.unsqueeze(-1) < lengths.view(-1, 1, 1)) & (j.unsqueeze(1) < lengths.view(-1, 1, 1))
    in_seq = in_seq & (i.unsqueeze(-1) >= 0)
    if not causal:
        return in_seq

    w, c, f = max_attn_len, contextual_seq_len, min_full_attn_seq_len
    pi_i, end = position_ids(i, lengths, num_targets, c)  # [B, Q], [B, 1]
    pi_j, _ = position_ids(j, lengths, num_targets, c)  # [B, N]
    pi_i, pi_j, end = pi_i.unsqueeze(-1), pi_j.unsqueeze(1), end.unsqueeze(-1)
    d = pi_i - pi_j
    same = i.unsqueeze(-1) == j.unsqueeze(1)

    valid = same | (d > 0)
    if w > 0:
        in_window = d <= w
        if f > 0:
            in_window = in_window | (pi_i >= end - f)
        valid = valid & in_window
    if c > 0:
        valid = valid | ((pi_i == 0) & (pi_j < end))
    return valid & in_seq
