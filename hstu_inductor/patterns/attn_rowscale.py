"""Attention: row scales on the output, ``(P @ V) * attn_scale`` per query row (find and check).

Models often scale the attention output instead of the scores: ``(P @ V) * pad(attn_scale)[..., None]``
before the unpad, or ``unpadded * attn_scale[:, None]`` after it. :func:`output_chain` follows the
value product forward through layout ops, scalar multiplies and such row scales to the dense tensor
the unpad reads; :func:`after_unpad` collects the row scales applied to the unpadded output. A row
scale is a multiply (divide) by a factor made only of one scale input, the jagged descriptor and
constants; that the factor really is ``c * s_row ** power`` is proven per probe by
:func:`check_row_scale` (called by ``attn_prove``). Row scales after the unpad are optional: one that
fails its check is simply left to the user's code.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import attn_layout as lay
from .attn_find import meta_val, size_hint, walk_forward
from .prover import Decline, closure, concrete, evaluate, reference_pad, scalar_scale

aten = torch.ops.aten


@dataclasses.dataclass
class RowScale:
    """``node = main * factor`` (or ``main / factor``) where ``factor`` depends only on a scale
    input, the jagged descriptor and constants. Proven numerically to be ``c * s_row ** power``."""
    node: torch.fx.Node
    main: torch.fx.Node
    factor: torch.fx.Node
    div: bool
    leaf: Optional[torch.fx.Node]  # the float input the factor reads (None: a constant factor)
    power: int = 0
    layout: tuple = None            # layout of ``main`` (dense, before the unpad); None after it
    c: Optional[float] = None


def _scale_like(leaf, plan) -> bool:
    val = meta_val(leaf)
    return isinstance(val, torch.Tensor) and val.is_floating_point() and leaf.op == "placeholder" and (
        val.numel() == 1 or (val.dim() == 1 and size_hint(val.shape[0]) == size_hint(meta_val(plan.q.src).shape[0])))


def row_scale(cur, plan) -> Optional[RowScale]:
    """``cur``'s single user when it multiplies (divides) ``cur`` elementwise, without broadcasting
    it, by a factor made only of one scale input (scalar or ``[L]``), the jagged descriptor and
    constants; else None."""
    if len(cur.users) != 1:
        return None
    u = next(iter(cur.users))
    if u.op != "call_function" or u.target not in (aten.mul.Tensor, aten.div.Tensor) or len(u.args) != 2:
        return None
    a0, a1 = u.args
    if a0 is cur and isinstance(a1, torch.fx.Node):
        factor = a1
    elif u.target is aten.mul.Tensor and a1 is cur and isinstance(a0, torch.fx.Node):
        factor = a0
    else:
        return None
    cv, uv, fv = meta_val(cur), meta_val(u), meta_val(factor)
    if not all(isinstance(t, torch.Tensor) for t in (cv, uv, fv)) or not fv.is_floating_point() or \
            uv.dim() != cv.dim() or fv.dim() > cv.dim() or not all(lay.eq(a, b) for a, b in zip(uv.shape, cv.shape)):
        return None
    order, leaves = closure([factor], set())
    if any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in order):
        return None
    floats = []
    for leaf in leaves:
        val = meta_val(leaf)
        if leaf is plan.offsets or leaf.op == "get_attr" or isinstance(val, torch.SymInt):
            continue
        if not _scale_like(leaf, plan):
            return None
        floats.append(leaf)
    if len(floats) > 1:
        return None
    return RowScale(u, cur, factor, u.target is aten.div.Tensor, floats[0] if floats else None,
                    power=1 if floats else 0)


def output_chain(pv, plan):
    """Follow the value product forward through layout ops, scalar multiplies and row scales
    (``dict`` node -> RowScale) to the dense tensor read by the unpad."""
    ops, factor, cur, scales = [], 1.0, pv, {}
    while True:
        cur, step, f = walk_forward(cur, sym=not isinstance(plan.N, int))
        ops += step
        factor *= f
        m = row_scale(cur, plan)
        if m is None:
            return cur, ops, factor, scales
        scales[m.node] = m
        ops.append(m.node)
        cur = m.node


def after_unpad(out, plan):
    """Row scales applied directly to the unpadded output (in order)."""
    scales, cur = {}, out
    while (m := row_scale(cur, plan)) is not None:
        scales[m.node] = m
        cur = m.node
    return scales


def unify_scales(leaf, used, scales):
    """The one scale input of the candidate; a second input or a second use declines."""
    for m in scales.values():
        if m.leaf is None:
            continue
        if leaf is not None and m.leaf is not leaf:
            raise Decline(f"attention output scaled by {m.leaf.name} and scores by {leaf.name}: two scale inputs")
        if used:
            raise Decline(f"{leaf.name if leaf is not None else m.leaf.name} scales the attention twice")
        leaf, used = m.leaf, True
    return leaf


def unify_side(leaf, used, scales):
    """Row scales after the unpad are optional (leaving them to the user is exact): keep the
    prefix that uses at most one scale input once."""
    kept = {}
    for n, m in scales.items():
        if m.leaf is not None and ((leaf is not None and m.leaf is not leaf) or used):
            break
        if m.leaf is not None:
            leaf, used = m.leaf, True
        kept[n] = m
    return kept


# ---------------------------------------------------------------------------------------------
# Numeric check (one probe)


def check_row_scale(gm, m, order, env0, binding, scale_probe, off, lens, N, p, dense=False):
    """One probe of a row scale: ``m``'s effective factor (broadcast to its main operand) must be
    ``m.c * s_row ** m.power`` on the rows the unpad reads (fits ``m.c`` on the first probe); with
    no unpad (``dense``) it must also be finite on padding rows (they stay zero)."""
    env = evaluate(gm, order, env0)
    shape = [concrete(s, binding) for s in meta_val(m.main).shape]
    try:
        fac = torch.broadcast_to(env[m.factor].to(torch.float64), shape)
    except RuntimeError as e:
        raise Decline(f"scale {m.factor.name} does not broadcast to the attention output") from e
    eff = 1.0 / fac if m.div else fac
    if dense and not bool(torch.isfinite(eff).all()):
        raise Decline(f"{m.node.name} is not finite on padding rows of the dense attention output")
    if m.layout is not None:  # dense: rows (b, i) from the layout algebra
        crd = lay.coords(lay.concretize(m.layout, binding), shape)
        b, i = crd["b"], crd["i"]
        rows = (i < lens[b]).expand(shape)
        srow = None if scale_probe is None or not m.power else scalar_scale(scale_probe)
        if m.power and srow is None:
            srow = reference_pad(scale_probe, off, N)[b, i].expand(shape)
    else:  # after the unpad: row r is jagged row r
        rows = torch.ones(shape, dtype=torch.bool)
        srow = None if not m.power else scalar_scale(scale_probe)
        if m.power and srow is None:
            srow = scale_probe.reshape([-1] + [1] * (len(shape) - 1)).expand(shape)
    if srow is None:
        srow = torch.ones((), dtype=torch.float64)
    if not bool(rows.any()):
        return
    ratio = (eff / srow.expand(shape))[rows]
    if m.c is None:
        m.c = float(ratio[0])
    if m.c == 0 or not bool(torch.allclose(ratio, torch.full_like(ratio, m.c), rtol=1e-9, atol=0)):
        raise Decline(f"{m.node.name} does not scale each query row by "
                      f"{'its attn_scale' if m.power else 'one constant'} (probe {p})")
