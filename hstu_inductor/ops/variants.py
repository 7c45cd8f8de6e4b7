"""The registry of attention implementations ("variants") and the choice among them.

Each variant declares, for one direction (``"fwd"`` or ``"bwd"``):

* ``scope(call)``: whether it can compute this call, from the :class:`AttentionCall` (the
  :class:`~hstu_inductor.spec.AttentionSpec`, dtypes, head dims, layout, device, bias inputs). It returns
  None when out of scope, else a value handed to ``run`` (how to launch it);
* ``priority``: among the variants in scope, the highest runs;
* ``run(how, call)``: the computation.

``hstu::attention`` and its backward ops ask :func:`pick`; every variant computes the eager reference's
values (docs/semantics.md), so the choice only moves time. The registrations live beside the code they
launch (ops/attention.py: the Triton kernels and the reference; ops/_gluon.py: the warp-specialised
kernels). Adding a variant: docs/extending.md.

:func:`chosen` names the variant of the last call per direction, and :func:`traced` counts the choices
made while a graph was traced (what a compiled graph runs): ``explain()`` and the benchmarks report them.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Optional

from torch import Tensor

from .._compat import plain_eager
from ..spec import AttentionSpec

__all__ = ["AttentionCall", "Variant", "register", "pick", "run", "chosen", "traced", "reset_traced", "names"]


@dataclasses.dataclass
class AttentionCall:
    """One call of the attention forward or backward: what a scope predicate may read and ``run`` computes."""

    q: Tensor
    k: Tensor
    v: Tensor
    seq_offsets: Tensor
    max_seq_len: Any
    alpha: float
    num_targets: Optional[Tensor]
    attn_scale: Optional[Tensor]
    spec: AttentionSpec
    rab: Optional[Tensor] = None
    intervals: Optional[Tensor] = None
    timestamps: Optional[Tensor] = None
    pos_w: Optional[Tensor] = None
    ts_w: Optional[Tensor] = None
    ts_bounds: Optional[Tensor] = None
    # backward only
    grad: Optional[Tensor] = None
    need_scale_grad: bool = False
    need_rab_grad: bool = False
    need_table_grad: bool = False

    @property
    def has_tables(self) -> bool:
        return self.pos_w is not None or self.ts_w is not None

    @property
    def rab_grad_wanted(self) -> bool:
        return self.need_rab_grad and self.rab is not None

    @property
    def table_grad_wanted(self) -> bool:
        return self.need_table_grad and self.has_tables

    @property
    def has_bias(self) -> bool:
        """Any bias or mask input beyond the spec: rab, intervals or table bias."""
        return self.rab is not None or self.intervals is not None or self.has_tables or self.ts_bounds is not None


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    direction: str  # "fwd" | "bwd"
    priority: int
    scope: Callable[[AttentionCall], Any]
    run: Callable[[Any, AttentionCall], Any]


_VARIANTS: dict[str, list[Variant]] = {"fwd": [], "bwd": []}
_CHOSEN: dict[str, str] = {}
_TRACED: collections.Counter = collections.Counter()


def register(variant: Variant) -> Variant:
    """Add (or replace, by name and direction) a variant."""
    if variant.direction not in _VARIANTS:
        raise ValueError(f"variant direction must be 'fwd' or 'bwd', got {variant.direction!r}")
    rows = [v for v in _VARIANTS[variant.direction] if v.name != variant.name] + [variant]
    _VARIANTS[variant.direction] = sorted(rows, key=lambda v: -v.priority)
    return variant


def names(direction: str) -> list[str]:
    """The registered variants of a direction, highest priority first."""
    return [v.name for v in _VARIANTS[direction]]


def pick(direction: str, call: AttentionCall) -> tuple[Variant, Any]:
    """The highest-priority variant in scope for ``call``, with its scope's answer (how to run it)."""
    for variant in _VARIANTS[direction]:
        how = variant.scope(call)
        if how is not None:
            _CHOSEN[direction] = variant.name
            if not plain_eager(call.q):
                _TRACED[f"{direction}:{variant.name}"] += 1
            return variant, how
    raise RuntimeError(f"hstu attention: no {direction} variant in scope (registered: {names(direction)})")


def run(direction: str, call: AttentionCall):
    variant, how = pick(direction, call)
    return variant.run(how, call)


def chosen(direction: str) -> Optional[str]:
    """The variant the last ``direction`` call ran (None before any call)."""
    return _CHOSEN.get(direction)


def traced() -> dict:
    """``{"fwd:<variant>": count, ...}``: choices made while graphs were traced since :func:`reset_traced`."""
    return dict(_TRACED)


def reset_traced() -> None:
    _TRACED.clear()
