"""output: x + projection([cat(u, attn,] Norm(attn) * u [)])  =>  hstu.stu_output.

By meaning: the normalised attention times u (either order; u may be silu(u) computed anywhere),
projected, plus the residual. Elementwise products, casts and dropouts commute with row-major
reshapes, so the product may be computed in another shape (``[L, H, d]``) and viewed back: ``Norm(attn)``
and u are read in row-major order and the op gets ``u`` viewed to ``[L, C]``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from ... import config
from ...report import RewriteReport
from ..registry import register
from .common import (Decline, _call, _cast_of, _check_no_mutation, _closure, _eq, _getitem, _getitem_of, _is,
                     _name, _order, _probe, _quiet, _rewrite_each, _same_tensor, _shape_is, _static, _tval)
from .stages import NormMatch, ProjMatch, _last_dim, _match_norm, _match_projection, _weight_of

aten = torch.ops.aten

#: Reshapes: the result holds the input's elements in the same row-major order (only the shape changes),
#: so they commute with elementwise ops; a chain of them from ``t`` to a tensor of ``t``'s shape is ``t``.
_RESHAPES = tuple(t for t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                              aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
                              getattr(aten.squeeze, "dims", None)) if t is not None)


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
def _y_identity(n: Node) -> Optional[Node]:
    """Inference dropout / ``p=0`` dropout: traced as ``clone`` (or ``aten.dropout(train=False)``)."""
    if _is(n, aten.clone.default) and n.kwargs.get("memory_format") in (None, torch.contiguous_format,
                                                                        torch.preserve_format):
        return n.args[0]
    if _is(n, aten.dropout.default):
        p, train = n.args[1], n.args[2]
        if not train or p == 0:
            return n.args[0]
        raise Decline(f"{_name(n)}: training dropout (p={p}) between u*Norm(attn) and the projection; "
                      "fusing it would change RNG semantics")
    return None


def _y_training_dropout(n: Node) -> Optional[Node]:
    """``F.dropout(y, p, training=True)`` -> ``native_dropout(y, p, True)[0]``: fused into the op's
    own dropout (same distribution: keep with probability 1-p, scale 1/(1-p); its own RNG stream,
    as stock Inductor's dropout has too). The mask output must be unused and p a constant."""
    src = _getitem_of(n, 0)
    if not _is(src, aten.native_dropout.default):
        return None
    p, train = src.args[1], src.args[2] if len(src.args) > 2 else src.kwargs.get("train", True)
    if not isinstance(p, float) or not 0.0 <= p < 1.0:
        raise Decline(f"{_name(src)}: training dropout with a non-constant or invalid p ({p})")
    if any(u is not n for u in src.users) or len(n.users) != 1:
        raise Decline(f"{_name(src)}: the dropout mask or output has other users")
    if train is False:
        raise Decline(f"{_name(src)}: native_dropout(train=False) is not a spelling we model")
    return src.args[0]


Y_WRAPPER_SPELLINGS: dict[str, Callable] = {
    "dropout(eval)/clone": _y_identity,
    "dropout(train)": _y_training_dropout,
}


_NORM_LIKE = tuple(getattr(aten, name).default for name in
                   ("native_layer_norm", "native_group_norm", "rsqrt", "_fused_rms_norm") if hasattr(aten, name))


def _norm_nearby(n: Node, depth: int = 6) -> bool:
    """Is there a normalisation within ``depth`` producers of ``n`` (to tell candidates apart)?"""
    if not isinstance(n, Node) or depth < 0:
        return False
    if _is(n, *_NORM_LIKE):
        return True
    return any(_norm_nearby(a, depth - 1) for a in n.all_input_nodes)


def _residual_addmm(add: Node) -> Optional[ProjMatch]:
    """``torch.addmm(x, y, W)`` whose input ``x`` is a full ``[L, E]`` residual (not a bias): the
    projection and the residual add in one node (generative-recommenders / TorchEasyRec)."""
    if not _is(add, aten.addmm.default) or len(add.args) != 3:
        return None
    x, y, w2 = add.args
    xv, yv, ov = _tval(x), _tval(y), _tval(add)
    if xv is None or yv is None or ov is None or xv.dim() != 2 or not _shape_is(xv, *ov.shape):
        return None  # a bias addmm: matched as the projection of a residual add
    if add.kwargs.get("beta", 1) != 1 or add.kwargs.get("alpha", 1) != 1:
        if _norm_nearby(y):
            raise Decline(f"{_name(add)}: residual addmm with beta/alpha != 1")
        return None
    w, lin = _weight_of(w2)
    wv = _tval(w)
    if wv is None or wv.dim() != 2 or yv.dim() != 2:
        return None
    if not (xv.dtype == yv.dtype == wv.dtype):
        if _norm_nearby(y):
            raise Decline(f"{_name(add)}: residual addmm operands have different dtypes")
        return None
    return ProjMatch("addmm(x, y, W.t())" if lin else "addmm(x, y, W)", y, w, lin, None, [add])


def _unsqueezed0(n) -> Optional[Node]:
    """``t`` if ``n`` is ``t.unsqueeze(0)`` of a 2-D ``t``."""
    if _is(n, aten.unsqueeze.default) and n.args[1] == 0 and _tval(n.args[0]) is not None \
            and _tval(n.args[0]).dim() == 2:
        return n.args[0]
    return None


def _residual_baddbmm(root: Node) -> Optional[tuple]:
    """``torch.baddbmm(x[None], y[None], W[None]).squeeze(0)``: the batched spelling of
    ``addmm(x, y, W)`` with one batch. Returns (residual, ProjMatch)."""
    if not _is(root, aten.squeeze.dim) or root.args[1] != 0 or not _is(root.args[0], aten.baddbmm.default):
        return None
    bmm = root.args[0]
    parts = [_unsqueezed0(a) for a in bmm.args[:3]]
    if len(bmm.args) != 3 or None in parts:
        return None
    x, y, w2 = parts
    if bmm.kwargs.get("beta", 1) != 1 or bmm.kwargs.get("alpha", 1) != 1:
        if _norm_nearby(y):
            raise Decline(f"{_name(bmm)}: residual baddbmm with beta/alpha != 1")
        return None
    xv, yv, ov = _tval(x), _tval(y), _tval(root)
    if ov is None or not _shape_is(xv, *ov.shape) or len(bmm.users) != 1:
        return None
    w, lin = _weight_of(w2)
    if not (xv.dtype == yv.dtype == _tval(w).dtype):
        return None
    return x, ProjMatch("baddbmm(x, y, W.t())" if lin else "baddbmm(x, y, W)", y, w, lin, None, [root, bmm])


def _rewrite_output_at(gm: GraphModule, add: Node, report: RewriteReport, seen=None) -> bool:
    graph = gm.graph
    batched = _residual_baddbmm(add)
    if batched is not None:
        return _rewrite_output_with(graph, add, batched[0], add, batched[1], report, seen)
    proj = _residual_addmm(add)
    if proj is not None:
        return _rewrite_output_with(graph, add, add.args[0], add, proj, report, seen)
    if not _is(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return False
    for x, p in (add.args, add.args[::-1]):
        if not isinstance(p, Node) or not isinstance(x, Node):
            continue
        xv, pv = _tval(x), _tval(p)
        if xv is None or pv is None or pv.dim() != 2 or not _shape_is(xv, *pv.shape):
            continue  # not a residual add of two [L, E] tensors
        inner = _after_projection(p)
        try:
            proj = _match_projection(inner)
        except Decline:
            proj = None
        if proj is None or not isinstance(proj.inp, Node):
            continue
        if _rewrite_output_with(graph, add, x, p, proj, report, seen):
            return True
    return False


def _after_projection(p: Node) -> Node:
    """The projection under identity wrappers of its output (``x + dropout(out(y))`` in eval, or with
    ``p=0``): the residual adds its values unchanged. A training dropout there is not the op's (the op
    drops ``y`` before the projection, an output dropout would need its own mask): declined."""
    while True:
        src = _getitem_of(p, 0)
        if _is(src, aten.native_dropout.default):
            proj = _quiet(_match_projection, src.args[0])
            if proj is not None and isinstance(proj.inp, Node) and _norm_nearby(proj.inp):
                raise Decline(f"{_name(src)}: training dropout after the projection (the op's dropout is on "
                              "u*Norm(attn), before it)")
            return p
        inner = _quiet(_y_identity, p)
        if not isinstance(inner, Node) or len(inner.users) != 1:
            return p
        p = inner


def _norm_factor(f: Node, fp32_region: bool) -> Optional[NormMatch]:
    """``Norm(attn)`` read by the factor ``f`` of ``u * Norm(attn)``: ``f`` itself or a reshape of it (the
    product computed in another shape, e.g. ``u3 * LN(attn).view(L, H, d)``). A decline is raised for
    ``f`` itself only (a reshape of some other norm, e.g. a per-head LN, is just not this block)."""
    m = _match_norm(f, fp32_region=fp32_region, rowmajor=True)
    while m is None and _is(f, *_RESHAPES):
        f = f.args[0]
        m = _quiet(_match_norm, f, fp32_region, True)
    return m


def _row_width(t: Optional[torch.Tensor], rows) -> Optional[int]:
    """Elements per row of ``t`` when its dim 0 has ``rows`` rows and its other dims are static."""
    if t is None or t.dim() < 1 or not _eq(t.shape[0], rows):
        return None
    n = 1
    for s in t.shape[1:]:
        if _static(s) is None:
            return None
        n *= _static(s)
    return n


def _u_source(f: Node, a: Node, fp32: bool) -> tuple:
    """``(u, upcast)``: the user's u that the factor ``f`` reads in row-major order, through reshapes and
    (``fp32``: the fp32 region) one upcast ``u.float()``: the highest tensor on that chain holding ``[L, C]``
    values row by row in ``a``'s dtype, one of shape ``[L, C]`` preferred (``silu(u).view(L, H, d)`` reads
    ``silu(u)``: a tensor and a reshape of it to its own shape hold the same values; a ``[L, H, d]`` u is
    viewed to ``[L, C]`` by the caller). ``f`` itself when there is none (the caller declines)."""
    av = _tval(a)
    node, upcast, best = f, False, None
    while True:
        v = _tval(node)
        if (not fp32 or upcast) and v is not None and v.dtype == av.dtype \
                and _row_width(v, av.shape[0]) == _static(av.shape[1]) \
                and (best is None or _shape_is(v, *av.shape) or not _shape_is(_tval(best), *av.shape)):
            best = node
        src = _cast_of(node) if fp32 and not upcast else None
        if src is not None and v.dtype == torch.float32 and _tval(src).dtype != torch.float32:
            node, upcast = src, True
        elif _is(node, *_RESHAPES):
            node = node.args[0]
        else:
            return (best if best is not None else f), upcast


def _rewrite_output_with(graph, add, x, p, proj, report, seen=None) -> bool:
    where = _name(add)
    if seen is not None:
        seen.add(add)
    y = proj.inp
    wrappers = []
    reshaped = False
    dropout = None  # (getitem node of native_dropout, its input, p)
    # y computed in fp32 from upcast attn and u and cast down once before the projection
    # (generative-recommenders / TorchEasyRec in bf16): the op rounds Norm(attn) to the input dtype
    # before the multiply, one rounding more; equal up to that rounding (probe tolerance by dtype)
    fp32 = None
    candidate = _norm_nearby(y)
    try:
        while True:
            src = _cast_of(y)
            if (fp32 is None and src is not None and _tval(src).dtype == torch.float32
                    and _tval(y).dtype != torch.float32):
                fp32, y = y, src
                wrappers.append(f"to({_tval(fp32).dtype})")
                continue
            if _is(y, *_RESHAPES):  # elementwise ops commute with reshapes: y is the product viewed
                y, reshaped = y.args[0], True
                continue
            for name, fn in Y_WRAPPER_SPELLINGS.items():
                inner = fn(y)
                if inner is not None:
                    if name == "dropout(train)":
                        if dropout is not None:
                            raise Decline(f"{where}: two training dropouts before the projection")
                        dropout = (y, inner, float(y.args[0].args[1]))
                    wrappers.append(name)
                    y = inner
                    break
            else:
                break
        concat = None
        if _is(y, aten.cat.default):
            parts = y.args[0]
            dim = y.args[1] if len(y.args) > 1 else y.kwargs.get("dim", 0)
            if len(parts) != 3 or _tval(y).dim() != 2 or not _last_dim(dim, _tval(y)):
                raise Decline(f"{where}: concat is not [u, attn, u*Norm(attn)] along the last dim")
            concat, y = y, parts[2]
            while _is(y, *_RESHAPES):
                y, reshaped = y.args[0], True
        mul = y
        if seen is not None:
            seen.add(mul)
        if not _is(mul, aten.mul.Tensor) or len(mul.args) != 2 or not all(isinstance(a, Node) for a in mul.args):
            m = _match_norm(mul) if isinstance(mul, Node) else None
            if m is not None:
                raise Decline(f"{where}: projection input is {m.spelling}(attn) without the u multiply")
            if candidate:
                raise Decline(f"{where}: projection input {_name(mul)} is not u * Norm(attn)")
            return False
        norm = u = None
        declined = []
        for a, b in (mul.args, mul.args[::-1]):
            try:
                norm = _norm_factor(b, fp32 is not None)
            except Decline as e:
                declined.append(e)
                continue
            if norm is not None:
                u = a
                break
        if norm is None:
            if declined:
                raise declined[0]
            if candidate:
                raise Decline(f"{where}: neither factor of {_name(mul)} is a LayerNorm/GroupNorm of a 2-D "
                              "tensor (an RMSNorm, or a norm written out other than as a layer norm, is not fused)")
            return False
    except Decline:
        if not candidate:
            return False
        raise
    a = norm.src
    u_used = u  # the multiply's factor (fp32 region: u.float(), maybe viewed)
    u, upcast = _u_source(u_used, a, fp32 is not None)
    if fp32 is not None and (not upcast or _tval(mul).dtype != torch.float32):
        raise Decline(f"{where}: y is cast to {_tval(fp32).dtype} before the projection but u is not "
                      "an upcast of a tensor of that dtype")
    av, uv, xv, pv, wv = _tval(a), _tval(u), _tval(x), _tval(p), _tval(proj.weight)
    mul_dtype = torch.float32 if fp32 is not None else av.dtype
    C = _static(av.shape[1])
    reshaped = reshaped or not _shape_is(_tval(mul), *av.shape)
    # no broadcasting: both factors have the product's shape, and u holds [L, C] values row by row
    if C is None or _row_width(uv, av.shape[0]) != C or uv.dtype != av.dtype or _tval(mul).dtype != mul_dtype \
            or _tval(u_used).shape != _tval(mul).shape or _tval(norm.out).numel() != _tval(mul).numel() \
            or (fp32 is not None and _tval(fp32).dtype != av.dtype):
        raise Decline(f"{where}: u {tuple(_tval(u_used).shape) if _tval(u_used) is not None else '?'} does not "
                      f"match attn {tuple(av.shape)} in shape and dtype (no broadcasting)")
    if xv is None or not _shape_is(xv, *pv.shape) or xv.dtype != pv.dtype:
        raise Decline(f"{where}: residual {_name(x)} is not a [L, E] tensor like the projection output")
    if not _eq(av.shape[0], xv.shape[0]):
        raise Decline(f"{where}: attn and residual have different row counts")
    if concat is not None:
        parts = concat.args[0]
        a_used = _cast_of(parts[1]) if fp32 is not None else parts[1]
        u_cat, up_cat = _u_source(parts[0], a, fp32 is not None)
        if not (_shape_is(_tval(parts[0]), *av.shape) and up_cat == upcast and _same_tensor(u_cat, u)
                and _same_tensor(a_used, a)):
            raise Decline(f"{where}: concat is not [u, attn, u*Norm(attn)] (order or operands differ)")
    E = _static(xv.shape[1])
    K = C * (3 if concat is not None else 1) if C is not None else None
    w_shape = (E, K) if proj.linear_layout else (K, E)
    if C is None or E is None or not _shape_is(wv, *w_shape):
        raise Decline(f"{where}: projection weight {tuple(wv.shape)} is not {w_shape}")
    if p is not add and len(p.users) != 1:
        raise Decline(f"{where}: projection output has other users")
    order = _order(graph)
    first = min([norm.first, mul] + ([concat] if concat is not None else []), key=order.__getitem__)
    probe_inputs = [a, u, x, norm.weight, norm.bias, proj.weight, proj.bias]
    _check_no_mutation(graph, first, add, where, probe_inputs + _closure([add], probe_inputs))

    w_lin_fn = (lambda w: w) if proj.linear_layout else (lambda w: w.t())
    is_concat = concat is not None
    r = norm.repeat

    def op_fn(a_, u_, x_, nw, nb, w, b):
        nw, nb = (t.repeat_interleave(r) if t is not None and r > 1 else t for t in (nw, nb))
        return [torch.ops.hstu.stu_output(a_, u_.reshape(a_.shape), x_, nw, nb, norm.eps, norm.groups, w_lin_fn(w),
                                          b, is_concat)]

    if len({id(n) for n in (a, u, x)}) != 3:
        raise Decline(f"{where}: attn, u and the residual are not three distinct tensors")
    # The probe proves everything but the dropout itself (random by nature): it is taken as the
    # identity here and becomes the op's dropout with the same p below.
    passthrough = {dropout[0]: dropout[1]} if dropout is not None else {}
    reason = _probe(probe_inputs, {a, u, x}, [add], op_fn, av.shape[0], passthrough)
    if reason is not None:
        raise Decline(f"{where}: numeric probe: {reason}")

    with graph.inserting_before(add):
        w = proj.weight if proj.linear_layout else _call(graph, aten.t.default, [proj.weight])
        u_op = u if _shape_is(uv, *av.shape) else _call(graph, aten.reshape.default, [u, [-1, C]])
        extra = []
        if dropout is not None and dropout[2] > 0.0:
            # one seed per call from torch's generator (Inductor's RNG when compiled): reproducible
            # under torch.manual_seed; the backward regenerates the mask from it
            seed = graph.call_function(aten.randint.low, (-2 ** 62, 2 ** 62, []),
                                       {"dtype": torch.int64, "device": av.device})
            if hasattr(av, "fake_mode"):
                with av.fake_mode:
                    seed.meta["val"] = torch.empty((), dtype=torch.int64, device=av.device)
            extra = [dropout[2], seed]
        nw, nb = (_repeat_params(graph, t, r) for t in (norm.weight, norm.bias))
        args = [a, u_op, x, nw, nb, norm.eps, norm.groups, w, proj.bias, is_concat, *extra]
        if config.block_backward == "save":  # same output; the backward reads y and the statistics
            op = _getitem(graph, _call(graph, torch.ops.hstu.stu_output_save.default, args), 0)
        else:
            op = _call(graph, torch.ops.hstu.stu_output.default, args)
    add.replace_all_uses_with(op)
    spelling = f"u*{norm.spelling}(attn)" if mul.args[0] is u_used else f"{norm.spelling}(attn)*u"
    if reshaped:
        spelling += f" as {list(_tval(mul).shape[1:])} per row"
    if is_concat:
        spelling = f"cat[u, attn, {spelling}]"
    for wname in wrappers:
        spelling += f" -> {wname}" if wname != "dropout(train)" else f" -> dropout(train, p={dropout[2]})"
    spelling += f" -> {proj.spelling}" + ("" if p is add else " -> + x")
    report.counts["output"] += 1
    report.details.append(("output", spelling))
    return True


@register("output")
def rewrite_output(gm: GraphModule, report: RewriteReport) -> None:
    """x + projection(u * Norm(attn) [concat u, attn]) (optional eval dropout) => hstu.stu_output."""
    gm.graph.eliminate_dead_code()
    seen: set = set()
    _rewrite_each(gm, report, "output", list(gm.graph.nodes), lambda g, n, r: _rewrite_output_at(g, n, r, seen),
                  lambda n: _is(n, aten.add.Tensor, aten.addmm.default, aten.squeeze.dim))
    _report_unused_products(gm, report, seen)


def _reaches(n: Node, targets: set, depth: int = 6) -> bool:
    if n in targets:
        return True
    return depth > 0 and any(_reaches(u, targets, depth - 1) for u in n.users)


def _report_unused_products(gm: GraphModule, report: RewriteReport, seen: set) -> None:
    """``explain`` is never silent about ``u * Norm(attn)``: a product not examined as the
    projection input of a residual add (nor feeding one already reported) is a near miss."""
    for n in gm.graph.nodes:
        if n in seen or not n.users or not _is(n, aten.mul.Tensor) or len(n.args) != 2 \
                or not all(isinstance(a, Node) for a in n.args):
            continue
        for a, b in (n.args, n.args[::-1]):
            norm = _quiet(_match_norm, b)
            if norm is None or not _shape_is(_tval(a), *_tval(norm.src).shape) or _reaches(n, seen):
                continue
            report.near_misses.append(("output", f"{_name(n)}: {a.name} * {norm.spelling}({norm.src.name}) does not "
                                                 "feed a projection with a residual add"))
            break


def _repeat_params(graph: Graph, t: Optional[Node], r: int) -> Optional[Node]:
    """``t [C]`` -> ``[C*r]`` (each value ``r`` times) as differentiable graph nodes."""
    if t is None or r == 1:
        return t
    C = _tval(t).shape[0]
    e = _call(graph, aten.expand.default, [_call(graph, aten.unsqueeze.default, [t, 1]), [C, r]])
    return _call(graph, aten.view.default, [_call(graph, aten.clone.default, [e]), [C * r]])

