"""Jagged <-> padded conversions in plain, differentiable PyTorch.

Written with gather/index ops only (no ``.item()``, no data-dependent shapes) so the same code
runs eagerly, under fake tensors with symbolic ``L``/``B``, and under autograd.
``aten._jagged_to_padded_dense_forward`` has no autograd formula, so it is not used here.
"""
from __future__ import annotations

import torch

__all__ = [
    "lengths_from_offsets",
    "jagged_to_padded",
    "padded_rows",
    "gather_padded",
    "padded_to_jagged",
    "row_to_sequence",
    "validate_jagged",
]


def lengths_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """``n_b = offsets[b+1] - offsets[b]`` for every sequence ``b``."""
    return offsets[1:] - offsets[:-1]


def jagged_to_padded(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float = 0.0
) -> torch.Tensor:
    """``values: [L, *rest]`` -> ``[B, max_len, *rest]``; rows past ``n_b`` hold ``padding_value``.

    Rows of a sequence longer than ``max_len`` are truncated (callers validate lengths first).
    """
    return gather_padded(values, padded_rows(offsets, max_len, values.shape[0]), padding_value)


def padded_rows(offsets: torch.Tensor, max_len: int, total_len: int) -> torch.Tensor:
    """``[B, max_len]``: the jagged row each padded slot reads, ``total_len`` (one padding row
    appended by :func:`gather_padded`, so ``L == 0`` works too) past ``n_b``. Computed once and
    shared by every tensor padded with the same offsets (each op costs milliseconds when traced
    with symbolic sizes)."""
    pos = torch.arange(max_len, device=offsets.device, dtype=offsets.dtype)
    valid = pos.unsqueeze(0) < lengths_from_offsets(offsets).unsqueeze(1)  # [B, N]
    return torch.where(valid, offsets[:-1].unsqueeze(1) + pos.unsqueeze(0), total_len)


def gather_padded(values: torch.Tensor, rows: torch.Tensor, padding_value: float = 0.0) -> torch.Tensor:
    """``values: [L, *rest]`` -> ``[*rows.shape, *rest]`` read at :func:`padded_rows` ``rows``."""
    pad_row = values.new_full((1, *values.shape[1:]), padding_value)
    table = torch.cat([values, pad_row], dim=0)
    return table[rows]


def row_to_sequence(offsets: torch.Tensor, total_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every jagged row ``r < total_len``: its sequence ``b`` and position ``p`` within it."""
    rows = torch.arange(total_len, device=offsets.device, dtype=offsets.dtype)
    seq = torch.searchsorted(offsets, rows, right=True) - 1
    pos = rows - offsets[seq]
    return seq, pos


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total_len: int) -> torch.Tensor:
    """``[B, N, *rest]`` -> ``[total_len, *rest]``: the first ``n_b`` rows of every sequence."""
    seq, pos = row_to_sequence(offsets, total_len)
    return padded[seq, pos]


def require(cond, message) -> None:
    """``torch._check`` with a readable message; under Dynamo the message closure is dropped
    (it may only close over constants there), the check itself stays."""
    if torch.compiler.is_compiling():
        torch._check(cond)
    else:
        torch._check(cond, message)


def _is_concrete(t: torch.Tensor) -> bool:
    """True when ``t`` holds real data we may inspect (not fake/meta, not being traced)."""
    from .._compat import is_fake

    if torch.compiler.is_compiling() or is_fake(t) or t.device.type == "meta":
        return False
    return not isinstance(t, torch.fx.Proxy)


def validate_jagged(
    offsets: torch.Tensor,
    total_len: int,
    max_seq_len: int,
    num_targets: torch.Tensor | None = None,
    name: str = "seq_offsets",
    values: bool = True,
) -> None:
    """Check the jagged-layout contract of HSTU_SEMANTICS.md with readable messages.

    Shape/dtype checks always run; value checks run only when ``values`` and on concrete tensors
    (under fake tensors the values are unknown and checking them would add guards; the ops check
    values in a traceable way instead, ``hstu_inductor/ops/_checks.py``).
    """
    require(offsets.dim() == 1, lambda: f"{name} must be 1-D, got shape {tuple(offsets.shape)}")
    require(
        offsets.dtype in (torch.int32, torch.int64),
        lambda: f"{name} must be int32 or int64, got {offsets.dtype}",
    )
    require(offsets.shape[0] >= 1, lambda: f"{name} must have at least one element (B+1)")
    if num_targets is not None:
        require(
            num_targets.dim() == 1 and num_targets.shape[0] == offsets.shape[0] - 1,
            lambda: f"num_targets must have shape [B]={offsets.shape[0] - 1}, got {tuple(num_targets.shape)}",
        )
        require(
            not num_targets.is_floating_point(), lambda: f"num_targets must be integer, got {num_targets.dtype}"
        )
    if not values or not _is_concrete(offsets):
        return
    require(int(offsets[0]) == 0, lambda: f"{name}[0] must be 0, got {int(offsets[0])}")
    lengths = lengths_from_offsets(offsets)
    require(bool((lengths >= 0).all()), lambda: f"{name} must be non-decreasing")
    require(
        int(offsets[-1]) == int(total_len),
        lambda: f"{name}[-1]={int(offsets[-1])} must equal the number of jagged rows L={int(total_len)}",
    )
    if lengths.numel():
        require(
            int(lengths.max()) <= int(max_seq_len),
            lambda: f"a sequence has length {int(lengths.max())} > max_seq_len={int(max_seq_len)}",
        )
    if num_targets is not None and _is_concrete(num_targets):
        require(bool((num_targets >= 0).all()), lambda: "num_targets must be >= 0")
        require(
            bool((num_targets.to(lengths.device) <= lengths).all()),
            lambda: "num_targets[b] must be <= the length of sequence b",
        )
