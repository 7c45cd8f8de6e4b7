"""The HSTU attention mask, spelled out on ids exactly as in HSTU_SEMANTICS.md."""
from __future__ import annotations

import sympy
import torch

from ..spec import AttentionSpec
from .jagged import gather_padded, lengths_from_offsets, padded_rows, row_to_sequence

__all__ = ["position_ids", "hstu_valid", "hstu_mask", "interval_mask", "sla_intervals", "TORCH", "SYMPY"]


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
    t = None if num_targets is None else num_targets.to(lengths.dtype).unsqueeze(-1)
    ids, end = _ids(positions, lengths.unsqueeze(-1), t, contextual_seq_len, TORCH)
    if contextual_seq_len <= 0 and ids.dim() == 1:
        ids = ids.expand(lengths.shape[0], ids.shape[-1])
    return ids, end


class _TorchOps:
    """Tensor spelling of the operations :func:`hstu_valid` uses."""
    maximum = staticmethod(lambda a, b: a.clamp(min=b) if isinstance(b, int) else torch.maximum(a, b))
    minimum = staticmethod(torch.minimum)
    eq = staticmethod(lambda a, b: a == b)
    where = staticmethod(torch.where)
    true = True


class _SympyOps:
    """Symbolic spelling (the prover's): mask options are concrete there, so ``where`` is never needed."""
    maximum = staticmethod(sympy.Max)
    minimum = staticmethod(sympy.Min)
    eq = staticmethod(sympy.Eq)
    where = None
    true = sympy.true


TORCH, SYMPY = _TorchOps, _SympyOps


def _sel(cond, then, other, ops):
    """``then if cond else other``; element-wise when the option is a tensor (one candidate per row)."""
    if isinstance(cond, bool):
        return then if cond else other
    return ops.where(cond, then, other)


def _ids(p, n, t, c, ops):
    """``(pi(p), end)``: raw positions ``p`` to ids (the contextual prefix ``[0, c)`` collapses to id 0, targets
    share the id ``end``) of a sequence of length ``n`` with ``t`` targets (None: none)."""
    has_c = c > 0
    pi = _sel(has_c, ops.maximum(p - c + 1, 0), p, ops)
    end = _sel(has_c, n - c + 1, n, ops)
    if t is not None:
        end = end - t
        pi = ops.minimum(pi, end)
    return pi, end


def hstu_valid(i, j, n, t, spec: AttentionSpec, ops=TORCH):
    """``valid(i, j)`` of HSTU_SEMANTICS.md for raw positions ``i`` (query) and ``j`` (key) of one sequence of
    length ``n`` with ``t`` targets (None: no targets); ``0 <= i, j < n`` is the caller's (see :func:`hstu_mask`).

    The one definition of the mask in Python: the reference (:func:`hstu_mask`, tensors), the prover's
    numeric filters (index tensors; options may be ``[K, 1]`` tensors, one candidate per row) and its symbolic
    meaning (``ops=SYMPY``, sympy symbols) all evaluate it. A new mask option is defined here once."""
    causal, w, c, f = spec.causal, spec.max_attn_len, spec.contextual_seq_len, spec.min_full_attn_seq_len
    if causal is False:
        return ops.true
    has_c = c > 0
    pi_i, end = _ids(i, n, t, c, ops)
    pi_j, _ = _ids(j, n, t, c, ops)
    d = pi_i - pi_j
    valid = ops.eq(i, j) | (d > 0)
    has_w = w > 0
    if has_w is not False:
        win = d <= w
        has_f = f > 0
        if has_f is not False:
            win = win | _sel(has_f, pi_i >= end - f, False, ops)
        valid = _sel(has_w, valid & win, valid, ops)
    if has_c is not False:
        valid = _sel(has_c, valid | (ops.eq(pi_i, 0) & (pi_j < end)), valid, ops)
    if causal is True:
        return valid
    return _sel(causal, valid, True, ops)


def hstu_mask(
    lengths: torch.Tensor,
    max_seq_len: int,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    causal: bool = True,
    query_positions: torch.Tensor | None = None,
    *,
    spec: AttentionSpec | None = None,
) -> torch.Tensor:
    """Boolean ``valid(i, j)`` of shape ``[B, Q, N]`` (``Q = N`` unless ``query_positions`` given).

    ``query_positions: [B, Q]`` selects which raw query rows to build (delta attention).
    Pairs involving positions ``>= n_b`` are False. ``causal=False`` makes every in-sequence
    pair valid. ``spec``: all mask options at once, in place of the loose ones.
    """
    spec = spec or AttentionSpec(causal, max_attn_len, contextual_seq_len, min_full_attn_seq_len)
    lengths = lengths.to(torch.int64)
    dev = lengths.device
    N = max_seq_len
    j = torch.arange(N, device=dev, dtype=torch.int64).view(1, 1, N)
    i = j.view(1, N, 1) if query_positions is None else query_positions.to(torch.int64).unsqueeze(-1)  # [1|B, Q, 1]
    n = lengths.view(-1, 1, 1)
    in_seq = (i < n) & (j < n) & (i >= 0)
    t = None if num_targets is None else num_targets.to(torch.int64).view(-1, 1, 1)
    return hstu_valid(i, j, n, t, spec) & in_seq


def interval_mask(intervals: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Boolean ``valid`` of shape ``[B, H|1, N, N]`` from an interval tensor ``[H|1, L, 3]``.

    Jagged row ``r`` (position ``i`` of sequence ``b``) of head ``h`` sees the key columns
    ``{j : 0 <= j < x0} | {j : x1 <= j < x2}`` of its own sequence, ``(x0, x1, x2) = intervals[h, r]``,
    intersected with ``j < n_b``. The set formula is used as written, so any ints are well defined
    (``x0 <= x1 <= x2`` is the documented form). It replaces the causal/targets/window mask.
    """
    N = max_seq_len
    rows = padded_rows(seq_offsets, N, intervals.shape[1])  # [B, N]; padding rows read (0, 0, 0)
    x = gather_padded(intervals.transpose(0, 1).to(torch.int64), rows)  # [B, N, H|1, 3]
    x = x.permute(0, 2, 1, 3).unsqueeze(-2)  # [B, H|1, N, 1, 3]
    j = torch.arange(N, device=intervals.device, dtype=torch.int64)
    n = lengths_from_offsets(seq_offsets).to(torch.int64).view(-1, 1, 1, 1)
    vis = (j < x[..., 0]) | ((j >= x[..., 1]) & (j < x[..., 2]))
    return vis & (j < n)  # padding query rows already see nothing


def sla_intervals(
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    k1: int,
    k2: int,
    contextual_seq_len: int = 0,
) -> torch.Tensor:
    """Semi-local attention (TorchEasyRec) as an interval tensor ``[1, L, 3]`` (int64, every head).

    With ``K2 = max(k2, contextual_seq_len)``, a history row at position ``p < n_b - t_b`` sees
    ``[0, min(K2, p+1)) | [max(K2, p-k1+1), p+1)``; a target row sees ``[0, n_b - t_b)``. ``x1`` is
    clamped to ``x2`` so every row satisfies ``x0 <= x1 <= x2`` (same column set).
    """
    if k1 < 0 or k2 < 0 or contextual_seq_len < 0:
        raise ValueError(f"sla_intervals: k1, k2, contextual_seq_len must be >= 0, got {k1}, {k2}, "
                         f"{contextual_seq_len}")
    L = int(seq_offsets[-1]) if seq_offsets.numel() else 0
    seq, p = row_to_sequence(seq_offsets, L)
    p = p.to(torch.int64)
    n = lengths_from_offsets(seq_offsets).to(torch.int64)[seq]
    hist = n if num_targets is None else n - num_targets.to(torch.int64)[seq]
    K2 = max(k2, contextual_seq_len)
    x0 = torch.clamp(p + 1, max=K2)
    x2 = p + 1
    x1 = torch.minimum(torch.clamp(p - k1 + 1, min=K2), x2)
    is_tgt = p >= hist
    x0 = torch.where(is_tgt, hist, x0)
    x1 = torch.where(is_tgt, hist, x1)
    x2 = torch.where(is_tgt, hist, x2)
    return torch.stack([x0, x1, x2], dim=-1).unsqueeze(0)
