"""Attention over packed rows: scores ``[heads, L, L]`` over the jagged rows themselves, no pad.

The FlexAttention "document mask" way of writing jagged attention: ``q`` viewed ``[H, L, D]``, scores
``q @ k^T`` over every pair of rows, a mask that keeps pairs of the same sequence (``seg[r] == seg[r']``)
with the causal HSTU rule inside, the product with ``v``, heads folded back: the output has one row per
jagged row already. It is HSTU attention when the mask is, for rows ``r = off(b) + i`` and
``r' = off(b') + j``, exactly ``b == b' and valid(i, j)``: decided by ``attn_meaning`` with two jagged rows
as the score coordinates (:class:`PackedChain`).

Structure (``attn_structure``'s layout algebra with the source itself as the "pad": rows on axis ``r``):
the score product pairs q rows with k rows and contracts the same features within a head; its batch is
the heads only; the value product contracts the key rows; the output is laid out ``[L, heads, value
features]``. The op gets ``max_seq_len = L`` (every length is at most ``L``) and the proven scale
explicitly (there is no ``N`` in such a model).
"""
from __future__ import annotations

import sympy
import torch

from . import attn_layout as lay
from . import attn_meaning
from .attn_find import BMM, SOFTMAX, Operand, is_float, is_int_tensor, meta_val, size_hint, walk_forward, walk_sliced
from .attn_structure import (
    Plan, Subgraphs, check_tiles, dim_key, feature_axes, mode_key, operand_layout, score_subgraph, side_inputs,
    value_heads, value_modes,
)
from .core.domain import Domain
from .core.values import size_expr
from .prover import Decline, closure, sym_expr

aten = torch.ops.aten


def is_candidate(S) -> bool:
    """Square scores whose query rows are the rows of the tensor the q operand is read from."""
    shape = meta_val(S).shape
    if len(shape) != 3 or not lay.eq(shape[1], shape[2]):
        return False
    D, _, _ = walk_sliced(S.args[0])
    val = meta_val(D)
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and lay.eq(val.shape[0], shape[1])


def prove_packed(gm, S, pv) -> Plan:
    """Structure and meaning of a packed-rows candidate; raises Decline."""
    plan, sub = _structure(S, pv)
    with attn_meaning._compat_scope():
        consts, _ = attn_meaning.prove_chain(gm, plan, sub, PackedChain(plan, sub))
    if any(abs(c - consts[0][1]) > 1e-9 * abs(consts[0][1]) for _, c, _ in consts):
        raise Decline("packed-rows attention: the scale changes with the number of rows (not a constant)")
    scale = consts[0][1] * plan.v.factor * sub.fo
    plan.scale = float(scale)  # explicit: the op's default 1/max_seq_len would be 1/L here
    return plan


def _operand(node, prefix) -> Operand:
    D, ops, factor = walk_sliced(node)
    return Operand(node, D, ops, factor, D, prefix)


def _descriptor(leaves, num_rows):
    """``(offsets, num_targets)`` among the score chain's 1-D integer inputs: the offsets have one more
    entry than num_targets (or are the only one)."""
    ints = [n for n in leaves if n.op == "placeholder" and is_int_tensor(n) and meta_val(n).dim() == 1]
    if len(ints) == 1:
        return ints[0], None
    if len(ints) == 2:
        a, b = ints
        if lay.eq(meta_val(a).shape[0], meta_val(b).shape[0] + 1):
            return a, b
        if lay.eq(meta_val(b).shape[0], meta_val(a).shape[0] + 1):
            return b, a
    raise Decline("packed-rows attention: the mask does not read exactly the offsets (and num_targets)")


def _structure(S, pv):
    q, k, v = _operand(S.args[0], "q"), _operand(S.args[1], "q"), _operand(pv.args[1], "v")
    L = sym_expr(meta_val(S).shape[-1])
    for x in (q, k, v):
        if not lay.eq(meta_val(x.D).shape[0], L):
            raise Decline("packed-rows attention: an operand is not read from the jagged rows")
    fq, axq = feature_axes(q.src, "q")
    fk, _ = feature_axes(k.src, "q")
    fv, axv = feature_axes(v.src, "v")
    if fq != fk:
        raise Decline(f"packed-rows attention: q {fq} and k {fk} feature shapes differ")
    # the jagged descriptor: read off the score chain (there is no pad to read it from)
    _, leaves = closure([pv.args[0]], {S})
    offsets, nt = _descriptor(leaves, L)
    plan = Plan(pv=pv, S=S, out=None, q=q, k=k, v=v, offsets=offsets, num_targets=None, N=0)
    plan.B = sym_expr(meta_val(offsets).shape[0]) - 1
    plan.N = int(L) if L.is_Integer else L
    if not isinstance(plan.N, int):  # the op's max_seq_len is L: read from a graph input with L rows
        plan.N_node = next(((p, 0) for p in S.graph.find_nodes(op="placeholder")
                            if isinstance(meta_val(p), torch.Tensor) and meta_val(p).dim() >= 1
                            and lay.eq(meta_val(p).shape[0], L)), (q.src, 0))
    for x, f, axes in ((q, fq, axq), (k, fk, axq), (v, fv, axv)):
        operand_layout(x, plan.B, L, f, axes, packed=True)
    A, K = q.layout, k.layout
    rkey = ((str(sympy.expand(L)), "r", "1"),)
    if len(A) != 3 or len(K) != 3 or dim_key(A[1]) != rkey or dim_key(K[2]) != rkey:
        raise Decline("packed-rows attention: the score product does not pair q rows with k rows")
    if dim_key(A[2]) != dim_key(K[1]) or dim_key(A[0]) != dim_key(K[0]):
        raise Decline("packed-rows attention: q and k are not contracted over the same features and heads")
    Z = lay.normalize_dim(A[0])
    if any(m[1] is None or not str(m[1]).startswith("q") for m in Z):
        raise Decline("packed-rows attention: the score product's batch is not the heads")
    c_modes = list(lay.normalize_dim(A[2]))
    check_tiles(list(Z) + c_modes, q.feat, axq, "score product")
    plan.Z, plan.head_modes, plan.c_modes = tuple(Z), list(Z), c_modes
    plan.Y = v.layout
    plan.e_modes = value_modes(v.layout, rkey)
    # the chain S -> X: score positions (heads, i, j) with i, j the query and key rows
    s_order, s_leaves, sderived, layouts, S_layout = score_subgraph(plan, pv.args[0])
    XL = layouts[pv.args[0]]
    jkey = ((str(sympy.expand(L)), "j", "1"),)
    if len(XL) != 3 or dim_key(XL[2]) != jkey:
        raise Decline("packed-rows attention: the value product does not contract the key rows")
    plan.v_head_modes = value_heads(plan, XL)
    check_tiles(plan.v_head_modes + plan.e_modes, v.feat, axv, "value product")
    for n in s_order:
        if n.target in SOFTMAX or n.target is BMM:
            raise Decline("packed-rows attention: the scores are normalised or multiplied again")
    found_nt, scale_leaf = side_inputs(s_leaves - {offsets}, plan, size_hint(meta_val(offsets).shape[0]) - 1,
                                       size_hint(meta_val(q.src).shape[0]))
    plan.num_targets = nt if nt is not None else found_nt
    if scale_leaf is not None:
        raise Decline("packed-rows attention with an attn_scale input (not modelled)")
    # output: [heads, L, Dv] -> layout ops -> [L, heads * Dv], the jagged output itself
    out, o_ops, fo = walk_forward(pv)
    OL = (XL[0], ((L, "i", sympy.Integer(1)),), plan.Y[2])
    for op in o_ops:
        if lay.is_layout_node(op):
            OL = lay.apply(op, OL)
    ikey = (mode_key((L, "i", sympy.Integer(1))),)
    first = lay.normalize_dim(OL[0]) if OL else ()
    if tuple(map(mode_key, first)) != ikey:
        raise Decline("packed-rows attention: the output is not laid out [L, heads, value features]")
    out_rest = [m for d in OL[1:] for m in lay.normalize_dim(d)]
    want = sorted(mode_key(m) for m in plan.head_modes + plan.e_modes)
    if sorted(map(mode_key, out_rest)) != want:
        raise Decline("packed-rows attention: the output features are not exactly (head, value feature)")
    plan.out, plan.out_rest = out, out_rest
    plan.rest_shape = [int(s) for s in meta_val(out).shape[1:]]
    region = set(sderived) | {pv, *o_ops}
    for n in region - {out}:
        for u in n.users:
            if u not in region and u is not out:
                raise Decline(f"intermediate {n.name} has a user outside the attention ({u.name})")
    sub = Subgraphs(s_order, layouts, S_layout, None, out, [], set(), plan.rest_shape, fo, False, {}, {})
    _ = is_float
    return plan, sub


class PackedChain(attn_meaning.Chain):
    """Score positions ``(heads, r, r')`` over two jagged rows ``r = off(b) + i``, ``r' = off(b') + j``."""

    sampled = False

    def __init__(self, plan, sub):  # noqa: D107 - coordinates of their own, the rest as Chain's
        L = size_expr(meta_val(plan.q.src).shape[0])
        self.plan, self.sub = plan, sub
        dom = Domain(plan.B, L, L, attn_meaning._domain(plan, plan.q.src).shape_env)
        dom.row_sizes = [size_expr(meta_val(x.src).shape[0]) for x in (plan.q, plan.k, plan.v)]
        self.dom = dom
        self.b, self.i, r = dom.row("q")
        self.b2, self.j, r2 = dom.row("k")
        self.axes = {"i": r, "j": r2}
        self.digits = {}
        for size, axis, stride in plan.Z:
            h = dom.coord("h", size)
            self.axes[axis] = self.axes.get(axis, sympy.Integer(0)) + h * stride
        self._leaves(plan, sub)

    def in_seq(self):
        return []  # both coordinates are jagged rows: every position is a pair of in-sequence rows

    def mask_args(self):
        return (sympy.Eq(self.b, self.b2), self.i, self.j, *attn_meaning._mask_symbols(self))

    def valid(self, params):
        same, i, j, n, t = self.mask_args()
        return sympy.And(same, attn_meaning.hstu_valid(i, j, n, t, params))
