"""Attention, interval masks: the mask decoded from a per-row interval tensor (NFUNC, SLA).

Row ``r`` of head ``h`` sees the key columns ``[0, x0) ∪ [x1, x2)`` of its own sequence
(docs/semantics.md, "Interval masks"), ``(x0, x1, x2)`` read from an integer tensor with one jagged
row per query row and a dim of 3 fields (TorchEasyRec's ``attn_func [H, 3, L]``; ``[L, 3]``,
``[H|1, L, 3]``, ...), a graph input or computed in the graph (``build_sla_func_tensor``-like code
from the offsets and num_targets).

Found structurally (:func:`find_intervals`: the integer tensor of such a shape nearest to the mask
on the score chain), cut out of the chain and bound to fresh random triples (ordered or not, in
``[-1, N + 2]``, per head when it has heads); the scores must then equal
``interval_mask * c * s * silu(...)`` on every probe (:func:`mask_at`). Whatever computed the real
tensor, the user's decoding of it is what is proven, so an interval tensor computed for SLA, for
NVIDIA's arbitrary mask or by hand is rewritten alike. The op takes the user's tensor as
``[H|1, L, 3]`` (:func:`emit_intervals`), so the intervals themselves are still computed by the graph.
"""
from __future__ import annotations

import dataclasses

import torch

from ..reference import interval_mask
from . import attn_layout as lay
from .attn_find import is_int_tensor, meta_val, size_hint
from .prover import concrete, is_static

aten = torch.ops.aten

FIELDS = 3  # (x0, x1, x2): one interval [0, x0) and one [x1, x2)


@dataclasses.dataclass
class Intervals:
    node: torch.fx.Node
    row_dim: int
    field_dim: int
    head_dim: int | None     # None: no head dim (one triple per row for every head)
    heads: int               # size of the head dim (1 or the number of heads)
    probe: torch.Tensor = None  # canonical [heads, L, 3] of the current probe


def find_intervals(s_order, s_leaves, sderived, plan) -> Intervals | None:
    """The interval tensor read by the mask, or None. Candidates: integer tensors off the score chain
    with one dim of the jagged row count and one of size 3 (and at most one more, of size 1 or H);
    the one latest in graph order (nearest the mask) is taken: the proof checks what it means."""
    rows = meta_val(plan.q.src).shape[0]
    H = lay.head_count(plan.head_modes)
    index = {n: i for i, n in enumerate(plan.S.graph.nodes)}
    best = None
    for n in [*s_order, *s_leaves]:
        if n in sderived or not is_int_tensor(n) or meta_val(n).dtype == torch.bool:
            continue
        cand = _dims(meta_val(n).shape, rows, H)
        if cand is not None and (best is None or index[n] > index[best[0]]):
            best = (n, cand)
    if best is None:
        return None
    n, (row, field, head) = best
    heads = 1 if head is None else int(meta_val(n).shape[head])
    return Intervals(n, row, field, head, heads)


def _dims(shape, rows, H):
    """``(row dim, field dim, head dim or None)`` of an interval tensor of ``shape``, else None."""
    if len(shape) not in (2, 3):
        return None
    row = [d for d, s in enumerate(shape) if _same_rows(s, rows)]
    if len(row) != 1:
        return None
    rest = [d for d in range(len(shape)) if d != row[0]]
    fields = [d for d in rest if lay.eq(shape[d], FIELDS)]
    if not fields:
        return None
    field = fields[-1]  # [H, 3, L] with H == 3 heads: the fields are the inner dim (the proof checks)
    others = [d for d in rest if d != field]
    if not others:
        return row[0], field, None
    (head,) = others
    if not (lay.eq(shape[head], 1) or lay.eq(shape[head], H)):
        return None
    return row[0], field, head


def _same_rows(s, rows) -> bool:
    """``s`` is the jagged row count: the same size, or (an input marked dynamic on its own) another
    symbol with the same hint (the proof binds it to the probe's rows)."""
    if lay.eq(s, rows):
        return True
    return not is_static(s) and not is_static(rows) and size_hint(s) == size_hint(rows)


def binding_pairs(iv: Intervals | None, Lp: int) -> list:
    """Probe size bindings: the interval tensor's rows are the probe's jagged rows."""
    if iv is None:
        return []
    return [(meta_val(iv.node).shape[iv.row_dim], Lp)]


def bind(iv: Intervals | None, env: dict, binding: dict, gen, Np: int) -> None:
    """Fresh random triples in ``[-1, N + 2]`` (ordered or not), in the interval tensor's layout."""
    if iv is None:
        return
    shape = [concrete(s, binding) for s in meta_val(iv.node).shape]
    Lp = shape[iv.row_dim]
    # the op's set formula holds for any ints: probe a little outside [0, N] too (a decode that
    # clamps or reorders the triples is not the op's)
    canon = torch.randint(-1, Np + 3, (iv.heads, Lp, FIELDS), generator=gen, dtype=torch.int64)
    iv.probe = canon
    # canonical dims (heads, rows, fields) -> the tensor's own order
    order = [iv.head_dim, iv.row_dim, iv.field_dim]
    val = canon if iv.head_dim is not None else canon[0]
    src_dims = [d for d in order if d is not None]
    perm = [src_dims.index(d) for d in range(len(shape))]
    env[iv.node] = val.permute(perm).contiguous().to(meta_val(iv.node).dtype)


def mask_at(iv: Intervals, off, Np, crd, head_modes, shape):
    """The interval mask (``reference.interval_mask``) at the score positions ``crd``."""
    m = interval_mask(iv.probe, off, Np)  # [B, heads, N, N]
    h = lay.head_index(head_modes, crd) if iv.heads > 1 else 0
    return m[crd["b"], h, crd["i"], crd["j"]].expand(shape)


def emit_intervals(call, plan):
    """The op's ``intervals``: the user's tensor permuted to ``[H|1, L, 3]``."""
    iv = plan.intervals
    if iv is None:
        return None
    x = iv.node
    if iv.head_dim is None:
        x = call(aten.unsqueeze.default, [x, 0])
        perm = [0, 1 + iv.row_dim, 1 + iv.field_dim]
    else:
        perm = [iv.head_dim, iv.row_dim, iv.field_dim]
    if perm != [0, 1, 2]:
        x = call(aten.permute.default, [x, perm])
    if meta_val(iv.node).dtype not in (torch.int32, torch.int64):
        x = call(aten._to_copy.default, [x], {"dtype": torch.int64})
    return x


def describe(plan) -> str:
    iv = plan.intervals
    return "" if iv is None else f"intervals={iv.node.name} ({'per head' if iv.heads > 1 else 'every head'})"
