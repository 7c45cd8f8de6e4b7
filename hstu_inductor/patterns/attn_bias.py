"""Attention, a dense relative attention bias (rab) added to the scores before the activation.

``silu(alpha * q k^T + rab)`` (docs/semantics.md, "Dense rab"): the bias is any float tensor that is
not computed from the scores and is added to them (``add`` / ``sub``) on the score chain. It is
found structurally (:func:`find_bias`), cut out of the score chain (the proof binds it to fresh
random probes, as it does the scores: whatever the user's ops compute it from, the identity
``X == mask * c * s * silu(a * S + b * R)`` proven for random ``R`` holds for the real one), and the
op receives the user's own bias tensor re-laid-out as ``[B|1, H|1, N, N]`` (:func:`emit_rab`), so
the bias computation stays in the graph and autograd reaches its producers through ``d_rab``.

Where the add sits decides nothing here: ``(S + R) * a`` and ``S * a + R`` differ only in the
coefficient ``b`` (``a`` or 1), fitted numerically (:func:`fit_ratio`) among the graph's constants.
Whether the bias is *before* the activation is what the numeric proof checks: a bias added after
the silu, or a bias inside a softmax (declined by the score chain), does not fit.

A bias read from q, k or v (or their pads) is declined: it is no relative bias, and the op would
take a second path to the same data that the proof binds independently.
"""
from __future__ import annotations

import dataclasses
import math

import sympy
import torch

from . import attn_layout as lay
from .attn_find import is_float, meta_val, op_name
from .prover import Decline, closure, probe_values

aten = torch.ops.aten

_ADDS = {aten.add.Tensor: 1.0, aten.sub.Tensor: -1.0}


@dataclasses.dataclass
class BiasTerm:
    """One tensor ``R`` added to the scores (``sign * R``) at ``at`` (an add/sub on the score chain)."""
    node: torch.fx.Node
    at: torch.fx.Node
    sign: float
    layout: tuple = None  # R's dims, each the modes of the scores' dim it aligns with, () when broadcast


@dataclasses.dataclass
class Bias:
    terms: list
    ratio: float = None   # b / a of ``silu(a * S + b * R)``, fitted on the first probe
    coeff: float = 1.0    # b: the op's rab is ``b * sum(sign * R)``
    tables: object = None  # attn_tables.Tables: the terms proven to be the table bias (path b)
    table_reasons: list = dataclasses.field(default_factory=list)  # why other table terms stay dense

    def dense_terms(self) -> list:
        moved = self.tables.terms if self.tables is not None else ()
        return [t for t in self.terms if all(t is not m for m in moved)]


def find_bias(s_order, sderived, layouts, plan) -> Bias | None:
    """The float tensors added to the score chain that are not computed from the scores. Raises
    Decline when such a tensor reads q, k or v (or cannot be laid out against the scores)."""
    terms = []
    for n in s_order:
        if n not in sderived or n.op != "call_function" or n.target not in _ADDS or n.kwargs:
            continue
        if len(n.args) != 2:
            continue
        a0, a1 = n.args
        for pos, (mine, other) in enumerate(((a0, a1), (a1, a0))):
            if mine in sderived and isinstance(other, torch.fx.Node) and other not in sderived and is_float(other):
                sign = _ADDS[n.target] if pos == 0 else 1.0  # scores - R: sign -1
                if n.target is aten.sub.Tensor and pos == 1:  # R - scores: the scores are negated, no bias form
                    raise Decline(f"{op_name(n)} subtracts the scores from {other.name}: not scores + bias")
                terms.append(BiasTerm(other, n, sign, _align(other, layouts[n])))
    if not terms:
        return None
    sources = {x.src for x in (plan.q, plan.k, plan.v)} | {x.D for x in (plan.q, plan.k, plan.v)}
    for t in terms:
        _, leaves = closure([t.node], sources)
        if leaves & sources or t.node in sources:
            raise Decline(f"bias {t.node.name} added to the scores is computed from q, k or v "
                          f"(not a relative attention bias)")
    return Bias(terms)


def _align(R, out_layout) -> tuple:
    """R's layout: its dims aligned from the right with the scores' (``out_layout``); a size-1 dim
    of R against a larger one is broadcast (no modes)."""
    shape = meta_val(R).shape
    if len(shape) > len(out_layout):
        raise Decline(f"bias {R.name} has more dims than the scores")
    lead = len(out_layout) - len(shape)
    out = []
    for d, s in enumerate(shape):
        dim = out_layout[lead + d]
        if lay.eq(s, 1) and not lay.eq(lay.dim_size(dim), 1):
            out.append(())
        elif lay.eq(s, lay.dim_size(dim)):
            out.append(tuple(dim))
        else:
            raise Decline(f"bias {R.name} of shape {tuple(shape)} does not broadcast against the scores")
    for dim in out:
        for m in lay.normalize_dim(dim):
            if m[1] is None:
                raise Decline(f"bias {R.name} is laid out against a broadcast dim of the scores")
    return tuple(out)


def cut_nodes(bias: Bias | None) -> set:
    return {t.node for t in bias.terms} if bias is not None else set()


# ---------------------------------------------------------------------------------------------
# Probes


def bind(bias: Bias | None, env: dict, binding: dict, gen) -> None:
    """Fresh random values for every bias term (its shape from its layout at the probe sizes)."""
    if bias is None:
        return
    for t in bias.terms:
        lc = lay.concretize(t.layout, binding)
        shape = [math.prod(m[0] for m in dim) if dim else 1 for dim in lc]
        env[t.node] = probe_values(shape, gen)


def at(bias: Bias, env: dict, binding: dict, crd: dict, shape):
    """``sum(sign * R)`` read at the coordinates ``crd`` of the probe's score positions."""
    total = 0
    for t in bias.terms:
        lc = lay.concretize(t.layout, binding)
        val = env[t.node].to(torch.float64)
        total = total + t.sign * lay.gather(val, lc, crd).expand(shape)
    return total


def fit_ratio(bias: Bias, fit, X, S_at, R_at, s_at, sel, alphas, floats) -> None:
    """Fit ``b / a`` of ``silu(a * S + b * R)`` (``fit(X, S_eff, s_at, sel, [a])`` is
    ``attn_prove.fit_alpha``): ``b`` is 1, ``a`` or a constant of the score chain (or its inverse)."""
    consts = [c for c in floats if c != 0]
    for a in alphas:
        for b in dict.fromkeys([1.0, a, -1.0, *consts, *(1.0 / c for c in consts)]):
            try:
                fit(X, S_at + (b / a) * R_at, s_at, sel, [a])
            except Decline:
                continue
            bias.ratio, bias.coeff = b / a, b
            return
    raise Decline("scores with a bias are not scale * silu(alpha * qk + b * bias) for any alpha, b among the "
                  "graph's constants (bias added after the activation?)")


# ---------------------------------------------------------------------------------------------
# Emit


def emit_rab(call, plan, N_arg):
    """The op's ``rab``: each term re-laid-out as ``[B|1, H|1, N, N]`` (a view when its dims are in
    that order), summed, times the fitted coefficient. ``call(target, args, kwargs=None)`` emits a node."""
    bias = plan.rab
    if bias is None:
        return None
    out = None
    for t in bias.dense_terms():
        x = _as_rab(call, t, plan, N_arg)
        if t.sign != 1.0:
            x = call(aten.neg.default, [x])
        out = x if out is None else call(aten.add.Tensor, [out, x])
    if out is not None and bias.coeff != 1.0:
        out = call(aten.mul.Tensor, [out, bias.coeff])
    return out


def _as_rab(call, t: BiasTerm, plan, N_arg):
    Ns = lay.to_expr(plan.N)
    slots = {"b": [], "h": [], "i": [], "j": []}
    heads = list(plan.head_modes)
    head_keys = [_key(m) for m in heads]
    flat = []  # (mode, slot) in R's memory order
    for dim in t.layout:
        for m in lay.normalize_dim(dim):
            if m[1] == "b" and lay.eq(m[2], 1) and lay.eq(m[0], plan.B):
                slot = "b"
            elif m[1] in ("i", "j") and lay.eq(m[2], 1) and lay.eq(m[0], Ns):
                slot = m[1]
            elif _key(m) in head_keys:
                slot = "h"
            else:
                raise Decline(f"bias {t.node.name}: dim mode {m} is not a batch, head, query or key index")
            flat.append((m, slot))
            slots[slot].append(m)
    if any(len(slots[s]) > 1 for s in "bij"):
        raise Decline(f"bias {t.node.name} reads the batch or a position twice")
    sizes = [_size(m[0]) for m, _ in flat]
    x = call(aten.reshape.default, [t.node, [_size_arg(s, plan, N_arg) for s in sizes] or [1]])
    # target order: b, the head modes in the op's head order, i, j (absent ones as size-1 dims)
    order = [("b", None)] + [("h", k) for k in head_keys] + [("i", None), ("j", None)]
    perm, shape, full = [], [], []
    for slot, k in order:
        idx = next((p for p, (m, s) in enumerate(flat) if s == slot and (k is None or _key(m) == k)), None)
        perm.append(idx)
        full_size = _size(plan.B) if slot == "b" else _size(Ns) if slot in "ij" else \
            _size(heads[head_keys.index(k)][0])
        full.append(full_size)
        shape.append(sizes[idx] if idx is not None else 1)
    present = [p for p in perm if p is not None]
    if present != sorted(present):
        x = call(aten.permute.default, [x, present + [p for p in range(len(flat)) if p not in present]])
    x = call(aten.reshape.default, [x, [_size_arg(s, plan, N_arg) for s in shape]])
    nh = len(head_keys)
    hp = [perm[1 + k] for k in range(nh)]
    if any(p is not None for p in hp) and any(p is None for p in hp):  # some head digits only: expand them
        shape = [shape[0]] + [full[1 + k] for k in range(nh)] + shape[1 + nh:]
        x = call(aten.expand.default, [x, [_size_arg(s, plan, N_arg) for s in shape]])
    H = math.prod(int(m[0]) for m in heads) if any(p is not None for p in hp) else 1
    x = call(aten.reshape.default, [x, [_size_arg(shape[0], plan, N_arg), H,
                                        _size_arg(shape[-2], plan, N_arg), _size_arg(shape[-1], plan, N_arg)]])
    if perm[-2] is None or perm[-1] is None:  # a bias broadcast over queries or keys: a view, not a copy
        x = call(aten.expand.default, [x, [-1, -1, N_arg, N_arg]])
    return x


def _key(m):
    return (str(sympy.expand(lay.to_expr(m[0]))), m[1], str(sympy.expand(lay.to_expr(m[2]))))


def _size(e):
    e = lay.to_expr(e)
    return int(e) if e.is_Integer else e


def _size_arg(s, plan, N_arg):
    """A size for an emitted reshape: an int, the op's N node, or the batch read off the offsets."""
    if isinstance(s, int):
        return s
    if lay.eq(s, plan.N):
        return N_arg
    if lay.eq(s, plan.B):
        return -1  # the batch is the only dim left free (heads and positions are given)
    raise Decline(f"bias size {s} is neither the batch, a head count nor N")


def describe(plan) -> str:
    bias = plan.rab
    if bias is None or not bias.dense_terms():
        return ""
    names = "+".join(("-" if t.sign < 0 else "") + t.node.name for t in bias.dense_terms())
    return f"rab={names}" + (f"*{bias.coeff:g}" if bias.coeff != 1.0 else "")
