"""Rewriters for the two dense STU blocks around attention: ``preprocess`` and ``output``.

    preprocess:  LayerNorm(x) -> projection -> split into u, v, q, k -> silu(u)
                 => torch.ops.hstu.stu_preprocess[_save](x, ln_w, ln_b, eps, W, b, hv, hq, silu_all)
                    (u, v, q, k: column views of its (act, uvqk) outputs)
    output:      x + projection( [cat(u, a,] u * Norm(a) [)] )
                 => torch.ops.hstu.stu_output[_save](a, u, x, n_w, n_b, eps, groups, W, b, concat_ua)
(the ``_save`` variants, emitted with ``config.block_backward="save"``, compute the same outputs
and also return the intermediates their backward reads)
    after both:  act used only as the output op's u
                 => u = uvqk[:, :u_dim] with silu_u=True: the silu moves into the output kernels
                    (``fuse_u_silu``)

The matcher is hand-written over the ATen graph produced by ``_compat.trace_aten``. A candidate
is split into *stages*; every stage has a small table of spellings (one function per spelling,
see ``NORM_SPELLINGS``, ``PROJECTION_SPELLINGS``, ``SPLIT_SPELLINGS``, ``ACTIVATION_SPELLINGS``,
``Y_WRAPPER_SPELLINGS``) and a candidate is rewritten only when every stage matched. Spellings
return ``None`` ("not this spelling") or raise ``Decline`` ("recognisably this block, but not
provably the op's semantics"), which becomes a ``report.near_misses`` entry.

Proof, two layers (docs/patterns.md, "Preprocess and output blocks"):

1. structure: every constant the op takes (eps, split sizes, split dim, norm shape, groups,
   which operand is which, dtypes, casts) is read from the matched nodes and checked exactly;
   nodes whose intermediate results are needed elsewhere are either kept alive (exact, cheap
   normalisations) or the candidate is declined (raw projection outputs: would duplicate a GEMM);
   no mutating op may sit inside the matched region.
2. numeric probe: the matched subgraph is copied out, run eagerly on fresh random inputs of the
   matched shapes/dtypes (a few rows; rows are independent) and compared with the hstu op itself.
   Any disagreement declines the rewrite.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Callable, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from .. import config
from ..reference.stu import preprocess_views
from ..report import RewriteReport
from .registry import register

aten = torch.ops.aten

__all__ = [
    "Decline", "rewrite_preprocess", "rewrite_output", "fuse_u_silu", "NORM_SPELLINGS", "PROJECTION_SPELLINGS",
    "SPLIT_SPELLINGS", "ACTIVATION_SPELLINGS", "Y_WRAPPER_SPELLINGS",
]


class Decline(Exception):
    """A recognisable candidate whose semantics could not be proven; the message is the reason."""


# ---------------------------------------------------------------------------------------------
# FX helpers
# ---------------------------------------------------------------------------------------------
def _is(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else n


def _tval(n) -> Optional[torch.Tensor]:
    v = _val(n)
    return v if isinstance(v, torch.Tensor) else None


def _name(n) -> str:
    if isinstance(n, Node):
        return f"{n.name} ({_target_name(n)})" if n.op == "call_function" else n.name
    return repr(n)


def _target_name(n: Node) -> str:
    t = n.target
    if t is operator.getitem:
        return "getitem"
    return str(getattr(t, "__name__", t)) if not isinstance(t, torch._ops.OpOverload) else str(t).replace(".default", "")


def _getitem_of(n, idx: int) -> Optional[Node]:
    """``src`` if ``n`` is ``src[idx]``."""
    if _is(n, operator.getitem) and n.args[1] == idx:
        return n.args[0]
    return None


def _eq(a, b) -> bool:
    """Sizes equal without adding guards (ints or SymInts)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _static(v) -> Optional[int]:
    """A concrete int for an int or a SymInt that is a known constant, else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        try:
            expr = v.node.expr
            if expr.is_number:
                return int(expr)
        except Exception:
            return None
    return None


def _shape_is(t: torch.Tensor, *dims) -> bool:
    return t is not None and t.dim() == len(dims) and all(_eq(a, b) for a, b in zip(t.shape, dims))


_VIEW_TARGETS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _same_tensor(a, b) -> bool:
    """``a`` and ``b`` are the same value: the same node, or identical views of the same node."""
    if a is b:
        return True
    if _is(a, *_VIEW_TARGETS) and _is(b, *_VIEW_TARGETS):
        return _same_tensor(a.args[0], b.args[0]) and list(a.args[1]) == list(b.args[1])
    return False


def _is_mutating(n: Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _check_no_mutation(graph: Graph, first: Node, last: Node, what: str) -> None:
    """No in-place op between ``first`` and ``last`` (inclusive) in graph order: the fused op reads
    its inputs at ``last`` instead of where the user's code read them."""
    seen = False
    for n in graph.nodes:
        if n is first:
            seen = True
        if seen and n.op == "call_function" and _is_mutating(n):
            raise Decline(f"{what}: in-place op {_name(n)} inside the matched region")
        if n is last:
            return


def _order(graph: Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _fake_call(target, args, kwargs=None):
    """meta['val'] for a new node: run ``target`` on the fake values of ``args`` (nodes or values)."""
    vals = torch.fx.node.map_arg(tuple(args), _val)  # nested too: view sizes may hold SymInt nodes
    modes = [v.fake_mode for v in vals if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode")]
    if not modes:
        return None
    # the graph's meta values may belong to a different fake mode than the one active around us
    with modes[0]:
        return target(*vals, **torch.fx.node.map_arg(dict(kwargs or {}), _val))


def _call(graph: Graph, target, args, kwargs=None) -> Node:
    node = graph.call_function(target, tuple(args), kwargs or {})
    val = _fake_call(target, args, kwargs)
    if val is not None:
        node.meta["val"] = val
    return node


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dim() == b.dim() and all(_eq(x, y) for x, y in zip(a.stride(), b.stride()))
            and _eq(a.storage_offset(), b.storage_offset()))


def _strides_free(node: Node, val) -> bool:
    """Whether ``node``'s users compute the same when ``node`` holds ``val``: its values, maybe with
    other strides. Only view ops can tell, by failing (``view`` of incompatible strides) or by reading
    strides (``as_strided``): they are re-run on fake values and their own users checked likewise; a
    graph output would show the caller other strides than eager's."""
    old = _tval(node)
    if old is not None and _same_layout(old, val):
        return True
    for user in node.users:
        t = user.target
        if user.op == "output" or t is aten.as_strided.default:
            return False
        if t is operator.getitem:  # a piece of a multi-output view (split)
            out = val[user.args[1]]
        elif getattr(t, "is_view", False) or t is aten._unsafe_view.default:
            try:
                out = _fake_call(t, [val if a is node else a for a in user.args], user.kwargs)
            except Exception:  # e.g. view: "view size is not compatible with input tensor's size and stride"
                return False
        else:
            continue
        if not _strides_free(user, out):
            return False
    return True


def _replace_by_view(graph: Graph, old: Node, new: Node) -> None:
    """``old.replace_all_uses_with(new)`` for a ``new`` view holding ``old``'s values: a contiguous copy
    of it where ``old``'s users depend on strides the view does not have (``_strides_free``)."""
    if not _strides_free(old, _val(new)):
        with graph.inserting_after(new):
            new = _call(graph, aten.clone.default, [new], {"memory_format": torch.contiguous_format})
    old.replace_all_uses_with(new)


def _getitem(graph: Graph, src: Node, i: int) -> Node:
    node = graph.call_function(operator.getitem, (src, i))
    if "val" in src.meta:
        node.meta["val"] = src.meta["val"][i]
    return node


# ---------------------------------------------------------------------------------------------
# Stage: casts (x.float() / .to(dtype) / .type_as)
# ---------------------------------------------------------------------------------------------
def _cast_of(n) -> Optional[Node]:
    """``src`` if ``n`` is a pure dtype conversion ``_to_copy(src, dtype=...)`` (nothing else)."""
    if not _is(n, aten._to_copy.default) or len(n.args) != 1:
        return None
    extra = set(n.kwargs) - {"dtype", "layout", "device", "memory_format"}
    if extra or n.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return None
    src, sv, nv = n.args[0], _tval(n.args[0]), _tval(n)
    if sv is None or nv is None or sv.device != nv.device or not sv.dtype.is_floating_point:
        return None
    return src


def _strip_fp32_cast(n):
    """Parameter upcast ``w.float()``: the op upcasts norm parameters itself."""
    src = _cast_of(n)
    if src is not None and _tval(n).dtype == torch.float32:
        return src
    return n


# ---------------------------------------------------------------------------------------------
# Stage: normalisation. fn(core_out_node) -> NormMatch | None   (core_out = getitem(norm, 0))
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class NormMatch:
    spelling: str
    src: Node            # the user's tensor, before any upcast
    weight: Optional[Node]
    bias: Optional[Node]
    eps: float
    groups: int          # 0 = layer norm
    first: Node          # earliest matched node (for the mutation check)
    out: Node            # the normalised tensor as consumed (after any downcast)
    repeat: int = 1      # parameters hold one value per ``repeat`` consecutive channels of src


def _norm_layer_norm(n: Node) -> Optional[tuple]:
    """``F.layer_norm`` / ``nn.LayerNorm`` over the last dim of a 2-D tensor (affine or not)."""
    core = _getitem_of(n, 0)
    if not _is(core, aten.native_layer_norm.default):
        return None
    inp, shape, w, b, eps = core.args
    iv = _tval(inp)
    if iv is None or iv.dim() != 2 or len(shape) != 1 or not _eq(shape[0], iv.shape[-1]):
        raise Decline(f"{_name(core)}: layer norm not over the last dim of a 2-D tensor "
                      f"(shape {list(shape)}, input {tuple(iv.shape) if iv is not None else '?'})")
    return core, inp, w, b, float(eps), 0, 1, core


def _viewed_2d(n) -> Optional[Node]:
    """``src`` if ``n`` is a view/reshape of the 2-D tensor ``src`` keeping its rows (dim 0)."""
    if not _is(n, *_VIEW_TARGETS):
        return None
    src, sv, nv = n.args[0], _tval(n.args[0]), _tval(n)
    if sv is None or nv is None or sv.dim() != 2 or nv.dim() < 1 or not _eq(sv.shape[0], nv.shape[0]):
        return None
    return src


def _norm_group_norm(n: Node) -> Optional[tuple]:
    """``F.group_norm(a, G, w, b, eps)`` on ``a: [L, C]`` (G groups of C/G contiguous channels), or
    on a view ``a.view(L, C, S)`` of a 2-D ``a: [L, C*S]`` viewed back to ``[L, C*S]`` (generative-
    recommenders' per-head norm ``group_norm(a.view(-1, H, Dv), H, w[H], b[H])``): the same groups
    of contiguous elements of each row, with every parameter repeated over its ``S`` elements."""
    back = None  # the group norm output, when ``n`` views it back to 2-D
    if _is(n, *_VIEW_TARGETS) and _tval(n) is not None and _tval(n).dim() == 2 and _tval(n.args[0]) is not None:
        back = n.args[0]
    core = _getitem_of(back if back is not None else n, 0)
    if not _is(core, aten.native_group_norm.default):
        return None
    inp, w, b, N, C, HxW, G, eps = core.args
    iv = _tval(inp)
    G, C_, HxW_ = _static(_val(G)), _static(_val(C)), _static(_val(HxW))
    first, src = core, inp
    if back is not None:  # [L, C*S] -> [L, C, S] -> group norm -> [L, C*S]
        src = _viewed_2d(inp)
        sv = _tval(src)
        if (src is None or iv.dim() != 3 or HxW_ is None or C_ is None or not _eq(iv.shape[1], C_)
                or not _eq(iv.shape[2], HxW_) or not _eq(sv.shape[1], C_ * HxW_) or not _eq(_val(N), sv.shape[0])
                or not _shape_is(_tval(n), *sv.shape) or not G or C_ % G):
            raise Decline(f"{_name(core)}: group norm on a view is not [L, C, S] of a 2-D [L, C*S] tensor "
                          "viewed back to [L, C*S]")
        return core, src, w, b, float(eps), G, HxW_, inp
    if (iv is None or iv.dim() != 2 or HxW_ != 1 or C_ is None or not _eq(C_, iv.shape[1])
            or not _eq(_val(N), iv.shape[0]) or not G or C_ % G):
        raise Decline(f"{_name(core)}: group norm is not over [L, C] channels of a 2-D tensor")
    return core, inp, w, b, float(eps), G, 1, first


NORM_SPELLINGS: dict[str, Callable] = {
    "layer_norm": _norm_layer_norm,
    "group_norm": _norm_group_norm,
}


def _match_norm(n: Node, fp32_region: bool = False) -> Optional[NormMatch]:
    """A normalisation of a 2-D tensor with fp32-or-native statistics, output in the input dtype.

    Accepted casts: ``Norm(a.float(), w.float(), b.float()).to(a.dtype)`` (the op's own
    semantics), or no casts at all. An upcast without the downcast is declined (the result
    would stay fp32 while the op returns the input dtype), unless ``fp32_region``: the caller
    proved that everything computed from the fp32 result is cast down once later."""
    out = n
    downcast = _cast_of(n)
    core_out = downcast if downcast is not None else n
    for spelling, fn in NORM_SPELLINGS.items():
        m = fn(core_out)
        if m is None:
            continue
        core, inp, w, b, eps, groups, repeat, first = m
        src = _cast_of(inp)
        upcast = src is not None
        if not upcast:
            src = inp
        if upcast and _tval(inp).dtype != torch.float32:
            raise Decline(f"{_name(core)}: input cast to {_tval(inp).dtype}, not float32")
        if _tval(out).dtype != _tval(src).dtype and not (fp32_region and upcast and downcast is None):
            raise Decline(f"{_name(core)}: normalised output is {_tval(out).dtype} but its input is "
                          f"{_tval(src).dtype} (missing or different downcast)")
        w, b = (_strip_fp32_cast(p) if p is not None else None for p in (w, b))
        for p in (w, b):
            if p is not None:
                pv = _tval(p)
                C = _tval(src).shape[-1] // repeat
                if pv is None or not pv.dtype.is_floating_point or not _shape_is(pv, C):
                    raise Decline(f"{_name(core)}: norm parameter {_name(p)} is not a [{C}] float tensor")
        name = spelling + (f"(view, params x{repeat})" if repeat > 1 else "") + ("(fp32)" if upcast else "")
        return NormMatch(name, src, w, b, eps, groups, inp if upcast else first, out, repeat)
    return None


# ---------------------------------------------------------------------------------------------
# Stage: projection. fn(out_node) -> ProjMatch | None
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ProjMatch:
    spelling: str
    inp: Node
    weight: Node         # the user's weight node
    linear_layout: bool  # True: weight is [out, in] (F.linear); False: [in, out] (needs .t())
    bias: Optional[Node]
    nodes: list          # matched nodes (output first)


def _weight_of(w2: Node) -> tuple:
    """The mm right operand ``[in, out]``: ``W.t()`` of an F.linear weight, or a plain matrix."""
    if _is(w2, aten.t.default) or (_is(w2, aten.permute.default) and list(w2.args[1]) == [1, 0]) \
            or (_is(w2, aten.transpose.int) and sorted(a % 2 for a in w2.args[1:3]) == [0, 1]):
        return w2.args[0], True
    return w2, False


def _check_bias(bias: Node, out: Node) -> None:
    bv, ov = _tval(bias), _tval(out)
    if bv is None or not _shape_is(bv, ov.shape[-1]):
        raise Decline(f"{_name(out)}: added term {_name(bias)} with shape "
                      f"{tuple(bv.shape) if bv is not None else '?'} is not a bias of shape [{ov.shape[-1]}]")


def _proj_addmm(n: Node) -> Optional[ProjMatch]:
    """``torch.addmm(b, x, W)`` and ``F.linear(x, W, b)`` / ``nn.Linear`` (2-D input)."""
    if not _is(n, aten.addmm.default):
        return None
    if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1 or len(n.args) > 3:
        raise Decline(f"{_name(n)}: addmm with beta/alpha != 1")
    bias, inp, w2 = n.args
    _check_bias(bias, n)
    w, lin = _weight_of(w2)
    return ProjMatch("linear+bias" if lin else "addmm", inp, w, lin, bias, [n])


def _proj_mm(n: Node) -> Optional[ProjMatch]:
    """``x @ W`` / ``torch.matmul`` / ``F.linear(x, W)`` without bias (2-D input)."""
    if not _is(n, aten.mm.default):
        return None
    inp, w2 = n.args
    w, lin = _weight_of(w2)
    return ProjMatch("linear" if lin else "matmul", inp, w, lin, None, [n])


def _proj_mm_add(n: Node) -> Optional[ProjMatch]:
    """``x @ W + b`` / ``b + x @ W`` (bias added separately, either order)."""
    if not _is(n, aten.add.Tensor) or n.kwargs.get("alpha", 1) != 1 or len(n.args) != 2:
        return None
    for mm, bias in (n.args, n.args[::-1]):
        if _is(mm, aten.mm.default) and isinstance(bias, Node) and _tval(bias) is not None \
                and _tval(bias).dim() == 1:
            if len(mm.users) != 1:
                raise Decline(f"{_name(mm)}: projection result has other users")
            _check_bias(bias, n)
            inp, w2 = mm.args
            w, lin = _weight_of(w2)
            return ProjMatch(("linear" if lin else "matmul") + " + bias", inp, w, lin, bias, [n, mm])
    return None


PROJECTION_SPELLINGS: dict[str, Callable] = {
    "addmm": _proj_addmm,
    "mm": _proj_mm,
    "mm+add": _proj_mm_add,
}


def _match_projection(n: Node) -> Optional[ProjMatch]:
    for fn in PROJECTION_SPELLINGS.values():
        m = fn(n)
        if m is not None:
            iv, wv, ov = _tval(m.inp), _tval(m.weight), _tval(n)
            if iv is None or wv is None or ov is None or iv.dim() != 2 or wv.dim() != 2:
                return None
            if not (iv.dtype == wv.dtype == ov.dtype) or (m.bias is not None and _tval(m.bias).dtype != ov.dtype):
                raise Decline(f"{_name(n)}: projection operands have different dtypes")
            return m
    return None


# ---------------------------------------------------------------------------------------------
# Stage: split into u, v, q, k. fn(uvqk_node) -> SplitMatch | None
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SplitMatch:
    spelling: str
    pieces: list         # 4 lists of nodes: the user's u, v, q, k tensors (before activation)
    sizes: list          # 4 ints
    first: Node          # earliest split node
    nodes: list = dataclasses.field(default_factory=list)  # the split node(s) using the uvqk tensor


def _last_dim(dim, t: torch.Tensor) -> bool:
    return isinstance(dim, int) and dim in (t.dim() - 1, -1)


def _getitem_pieces(split: Node, count: int) -> list:
    pieces = [[] for _ in range(count)]
    for u in split.users:
        if not _is(u, operator.getitem):
            raise Decline(f"{_name(split)}: split result used whole by {_name(u)}")
        pieces[u.args[1]].append(u)
    return pieces


def _split_with_sizes(n: Node) -> Optional[SplitMatch]:
    """``torch.split(t, [a, a, b, b], dim=-1)``."""
    splits = [u for u in n.users if _is(u, aten.split_with_sizes.default)]
    if len(splits) != 1:
        return None
    split = splits[0]
    sizes = [_static(s) for s in split.args[1]]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if len(sizes) != 4 or not _last_dim(dim, _tval(n)):
        return None
    if None in sizes:
        raise Decline(f"{_name(split)}: symbolic split sizes")
    return SplitMatch("split", _getitem_pieces(split, 4), sizes, split, [split])


def _split_equal(n: Node) -> Optional[SplitMatch]:
    """``t.chunk(4, dim=-1)`` / ``torch.split(t, s, dim=-1)`` with four equal parts."""
    splits = [u for u in n.users if _is(u, aten.split.Tensor)]
    if len(splits) != 1:
        return None
    split = splits[0]
    s = _static(split.args[1])
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    D = _static(_tval(n).shape[-1])
    if s is None or D is None or not _last_dim(dim, _tval(n)) or D != 4 * s:
        return None
    return SplitMatch("chunk", _getitem_pieces(split, 4), [s] * 4, split, [split])


def _split_slices(n: Node) -> Optional[SplitMatch]:
    """``t[:, :a], t[:, a:2a], t[:, 2a:2a+b], t[:, 2a+b:]`` (any node order, step 1)."""
    users = [u for u in n.users if _is(u, aten.slice.Tensor)]
    t = _tval(n)
    D = _static(t.shape[-1])
    if len(users) < 4 or D is None:
        return None
    ranges: dict = {}
    for u in users:
        dim = u.args[1] if len(u.args) > 1 else 0
        start = u.args[2] if len(u.args) > 2 else None
        end = u.args[3] if len(u.args) > 3 else None
        step = u.args[4] if len(u.args) > 4 else 1
        if not _last_dim(dim, t) or step != 1 or u.kwargs:
            return None
        start, end = _static(0 if start is None else start), _static(D if end is None else end)
        if start is None or end is None:
            return None
        start, end = (min(max(v + D if v < 0 else v, 0), D) for v in (start, end))
        ranges.setdefault((start, end), []).append(u)
    keys = sorted(ranges)
    if len(keys) != 4 or keys[0][0] != 0 or keys[-1][1] != D or any(a[1] != b[0] for a, b in zip(keys, keys[1:])):
        return None
    order = _order(n.graph)
    first = min(users, key=order.__getitem__)
    return SplitMatch("slices", [ranges[k] for k in keys], [e - s for s, e in keys], first, users)


SPLIT_SPELLINGS: dict[str, Callable] = {
    "split_with_sizes": _split_with_sizes,
    "split(chunk)": _split_equal,
    "slices": _split_slices,
}


def _match_split(n: Node) -> Optional[SplitMatch]:
    t = _tval(n)
    if t is None or t.dim() != 2:
        return None
    for fn in SPLIT_SPELLINGS.values():
        m = fn(n)
        if m is not None:
            return m
    return None


# ---------------------------------------------------------------------------------------------
# Stage: activation. fn(user_node, src) -> act_output_node | None  ("silu(src)" spelled by user)
# ---------------------------------------------------------------------------------------------
def _act_silu(n: Node, src: Node) -> Optional[Node]:
    """``F.silu(t)`` / ``nn.SiLU()``."""
    return n if _is(n, aten.silu.default) and n.args[0] is src else None


def _act_mul_sigmoid(n: Node, src: Node) -> Optional[Node]:
    """``t * torch.sigmoid(t)`` (either operand order); ``n`` is the sigmoid or the mul."""
    if _is(n, aten.sigmoid.default) and n.args[0] is src:
        users = list(n.users)
        if len(users) == 1:
            return _act_mul_sigmoid(users[0], src)
        return None
    if _is(n, aten.mul.Tensor) and len(n.args) == 2:
        a, b = n.args
        for x, s in ((a, b), (b, a)):
            if x is src and _is(s, aten.sigmoid.default) and s.args[0] is src and len(s.users) == 1:
                return n
    return None


ACTIVATION_SPELLINGS: dict[str, Callable] = {
    "silu": _act_silu,
    "x*sigmoid(x)": _act_mul_sigmoid,
}


def _activation_users(src: Node) -> Optional[list]:
    """If every use of ``src`` is a silu spelling, possibly after views/reshapes of ``src`` (silu is
    elementwise, so it commutes with them), return ``[(act_node, [view nodes src -> act input])]``;
    otherwise None."""
    found: list = []
    for user in list(src.users):
        if _is(user, *_VIEW_TARGETS):
            inner = _activation_users(user)
            if inner is None:
                return None
            found += [(act, [user, *chain]) for act, chain in inner]
            continue
        act = None
        for fn in ACTIVATION_SPELLINGS.values():
            act = fn(user, src)
            if act is not None:
                break
        if act is None:
            return None
        if all(a is not act for a, _ in found):  # x*sigmoid(x): sigmoid and mul both use src
            found.append((act, []))
    return found or None


def _silu_source(n: Node) -> Optional[Node]:
    """``t`` if ``n`` is ``silu(t)`` or ``t * sigmoid(t)`` (the sigmoid used only there)."""
    if _is(n, aten.silu.default):
        return n.args[0]
    if _is(n, aten.mul.Tensor) and len(n.args) == 2:
        for t in n.args:
            if isinstance(t, Node) and _act_mul_sigmoid(n, t) is n:
                return t
    return None


def _act_spelling(act: Node) -> str:
    return "silu" if _is(act, aten.silu.default) else "x*sigmoid(x)"


# ---------------------------------------------------------------------------------------------
# Numeric probe: run the matched subgraph on fresh random inputs and compare with the hstu op.
# ---------------------------------------------------------------------------------------------
_PROBE_ROWS = 6
_PROBE_TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 3e-2, torch.bfloat16: 5e-2}


def _probe(inputs: list, row_inputs: set, outputs: list, op_fn: Callable, rows,
           passthrough: Optional[dict] = None) -> Optional[str]:
    """None when the subgraph ``inputs -> outputs`` equals ``op_fn(*probe_inputs)`` (a list of
    tensors, reshaped to the outputs' shapes) on random data; otherwise the reason.
    ``passthrough`` maps nodes to evaluate as their given source (a dropout taken as identity).

    ``rows`` is the row count L (int or SymInt). Static L: the probe uses ``min(L, 6)`` rows and
    substitutes the row count in the few row-carrying args of the copied nodes (group norm N,
    view shapes' leading dim). Symbolic L: its symbol is set to 6.
    """
    import sympy
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    L_static = _static(rows)
    Lp = min(L_static, _PROBE_ROWS) if L_static is not None else _PROBE_ROWS
    if L_static == 0:
        return "no rows to probe"
    subs: dict = {}
    if L_static is None:
        expr = rows.node.expr
        if not isinstance(expr, sympy.Symbol):
            return f"row count {expr} is not a plain symbol"
        subs[expr] = sympy.Integer(Lp)

    def concrete(v):
        if isinstance(v, torch.SymInt):
            e = v.node.expr.xreplace(subs)
            if not e.is_number:
                raise Decline(f"symbolic size {v.node.expr}")
            return int(e)
        return v

    def fix_rows(v):
        return Lp if (L_static is not None and isinstance(v, int) and v == L_static) else v

    passthrough = passthrough or {}
    input_set = {id(n): i for i, n in enumerate(inputs)}
    order = _order(outputs[0].graph)
    closure, stack = {}, list(outputs)
    while stack:
        n = stack.pop()
        if id(n) in input_set or n in closure:
            continue
        if n in passthrough:
            stack.append(passthrough[n])
            continue
        if isinstance(_val(n), torch.SymInt):
            continue
        if n.op != "call_function":
            return f"subgraph depends on {n.name} outside the match"
        closure[n] = True
        for a in (*n.args, *n.kwargs.values()):
            for x in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(x, Node):
                    stack.append(x)
    g = Graph()
    env: dict = {}
    for i, n in enumerate(inputs):
        if n is not None:
            env[n] = g.placeholder(f"in{i}")

    def arg(x):
        if isinstance(x, Node):
            x = passthrough.get(x, x)
            if x in env:
                return env[x]
            return concrete(_val(x))
        return x

    try:
        for n in sorted(closure, key=order.__getitem__):
            args = torch.fx.node.map_aggregate(n.args, arg)
            kwargs = torch.fx.node.map_aggregate(n.kwargs, arg)
            if n.target is aten.native_group_norm.default:
                args = (*args[:3], fix_rows(args[3]), *args[4:])
            elif n.target is aten._to_copy.default:  # the probe runs on CPU: keep the dtype only
                kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout")}
            elif n.target in _VIEW_TARGETS:
                shape = list(args[1])
                args = (args[0], [fix_rows(shape[0]), *shape[1:]], *args[2:])
            env[n] = g.call_function(n.target, tuple(args), dict(kwargs))
        g.output(tuple(env[o] for o in outputs))
        gen = torch.Generator().manual_seed(20240917)
        with unset_fake_temporarily(), torch.no_grad():
            real = []
            for n in inputs:
                if n is None:
                    real.append(None)
                    continue
                v = _tval(n)
                shape = [concrete(s) for s in v.shape]
                if n in row_inputs and L_static is not None:
                    shape[0] = Lp
                if not v.dtype.is_floating_point:
                    return f"probe input {n.name} is not floating point"
                real.append(torch.randn(shape, generator=gen, dtype=torch.float32).to(v.dtype))
            got = GraphModule(torch.nn.Module(), g)(*[r for r in real if r is not None])
            want = op_fn(*real)
            for o, a, b in zip(outputs, got, want):
                b = b.reshape(a.shape)
                tol = _PROBE_TOL.get(a.dtype, 1e-4)
                err = (a.double() - b.double()).abs().max().item() / (b.double().abs().max().item() + 1e-12)
                if not err <= tol:
                    return f"output {o.name} differs from the hstu op by {err:.2e} (relative)"
    except Decline as e:
        return str(e)
    except Exception as e:  # a probe that cannot run proves nothing
        return f"probe failed: {type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------------
# preprocess
# ---------------------------------------------------------------------------------------------
def _rewrite_preprocess_at(gm: GraphModule, node: Node, report: RewriteReport, seen=None) -> bool:
    """Try ``node`` as the uvqk tensor that is split 4 ways. Returns True when rewritten.
    ``seen`` collects the projections examined (for ``_report_unexamined``)."""
    graph = gm.graph
    split = _match_split(node)
    if split is None:
        return False
    # silu_all spelled before the split: the split tensor is silu(projection)
    src = _silu_source(node)
    silu_all_pre = node if src is not None else None
    proj_node = src if src is not None else node
    proj = _match_projection(proj_node)
    if proj is None:
        return False  # a 4-way split of something that is not a projection: not a candidate
    if seen is not None:
        seen.add(proj_node)
    where = f"{_name(split.first)}"
    if silu_all_pre is not None:
        acts = _activation_users(proj_node)
        if not acts or len(acts) != 1 or acts[0][0] is not silu_all_pre:
            raise Decline(f"{where}: projection output has users besides the activation")
    if set(node.users) != set(split.nodes):
        raise Decline(f"{where}: projection output has other users")
    norm = _match_norm(proj.inp) if isinstance(proj.inp, Node) else None
    if norm is None:
        raise Decline(f"{where}: projection input {_name(proj.inp)} is not a LayerNorm of x")
    if norm.groups:
        raise Decline(f"{where}: input normalisation is a group norm, not a LayerNorm")
    xv, wv = _tval(norm.src), _tval(proj.weight)
    E = _static(xv.shape[1])
    hv, hv2, hq, hq2 = split.sizes
    D = sum(split.sizes)
    if hv != hv2 or hq != hq2 or hv <= 0 or hq <= 0:
        raise Decline(f"{where}: split sizes {split.sizes} are not [hv, hv, hq, hq]")
    w_shape = (D, E) if proj.linear_layout else (E, D)
    if E is None or not _shape_is(wv, *w_shape):
        raise Decline(f"{where}: projection weight {tuple(wv.shape)} is not {w_shape}")
    if not (xv.dtype == wv.dtype):
        raise Decline(f"{where}: x is {xv.dtype} but the projection weight is {wv.dtype}")

    # activations: u must be consumed only through silu; silu_all when v, q, k are too
    piece_acts = []
    if silu_all_pre is None:
        for role, nodes in zip("uvqk", split.pieces):
            acts = []
            for p in nodes:
                a = _activation_users(p)
                acts.append(a)
            piece_acts.append(acts if all(a is not None for a in acts) and nodes else None)
        if piece_acts[0] is None:
            other = [r for r, a in zip("uvqk", piece_acts) if a is not None]
            if other:
                raise Decline(f"{where}: silu is applied to chunk {'uvqk'.index(other[0])} ({other[0]}), "
                              "not (only) to chunk 0 (u)")
            raise Decline(f"{where}: u (chunk 0) is not consumed only by silu(u)")
        silu_all = all(a is not None for a in piece_acts)
    else:
        silu_all = True
    for role, nodes in zip("uvqk", split.pieces):
        for p in nodes:
            for user in p.users:
                if _is_mutating(user):
                    raise Decline(f"{where}: {role} is modified in place by {_name(user)}")
    _check_no_mutation(graph, norm.first, split.first, where)

    # numeric probe against the op
    w_lin_fn = (lambda w: w) if proj.linear_layout else (lambda w: w.t())
    probe_inputs = [norm.src, norm.weight, norm.bias, proj.weight, proj.bias]
    if silu_all_pre is not None:
        outs = [nodes[0] for nodes in split.pieces]
    else:
        outs = [piece_acts[i][0][0][0] if (i == 0 or silu_all) else split.pieces[i][0] for i in range(4)]

    def op_fn(x, lw, lb, w, b):
        return preprocess_views(*torch.ops.hstu.stu_preprocess(x, lw, lb, norm.eps, w_lin_fn(w), b, hv, hq, silu_all),
                                hv, hq, silu_all)

    reason = _probe(probe_inputs, {norm.src}, outs, op_fn, xv.shape[0])
    if reason is not None:
        raise Decline(f"{where}: numeric probe: {reason}")

    # rewrite
    with graph.inserting_before(split.first if silu_all_pre is None else silu_all_pre):
        w = proj.weight if proj.linear_layout else _call(graph, aten.t.default, [proj.weight])
        # same forward either way; the save variant also returns what its backward reads
        target = torch.ops.hstu.stu_preprocess_save.default if config.block_backward == "save" \
            else torch.ops.hstu.stu_preprocess.default
        op = _call(graph, target, [norm.src, norm.weight, norm.bias, norm.eps, w, proj.bias, hv, hq, silu_all])
        op_act, op_uvqk = _getitem(graph, op, 0), _getitem(graph, op, 1)
        # u, v, q, k as column views of the op's (act, uvqk), as preprocess_views takes them: separate op
        # outputs would be copies (custom-op outputs may not alias), views in the graph cost nothing
        packed = op_act if silu_all else op_uvqk
        ends = list(itertools.accumulate(split.sizes, initial=0))
        new = [op_act if i == 0 and not silu_all else _call(graph, aten.slice.Tensor, [packed, 1, ends[i], ends[i + 1]])
               for i in range(4)]
    for i, nodes in enumerate(split.pieces):
        fused_act = silu_all_pre is None and (i == 0 or silu_all)
        if not fused_act:  # already activated (silu before the split) or left to the user's code
            for p in nodes:
                _replace_by_view(graph, p, new[i])
            continue
        for per_piece in piece_acts[i]:
            for act, chain in per_piece:
                cur = new[i]
                with graph.inserting_before(act):
                    for v in chain:
                        cur = graph.node_copy(v, lambda a, v=v, cur=cur: cur if a is v.args[0] else a)
                        cur.meta["val"] = _fake_call(cur.target, cur.args, cur.kwargs)  # new input strides
                _replace_by_view(graph, act, cur)
    if silu_all_pre is None:
        fused = piece_acts if silu_all else piece_acts[:1]
        act_names = sorted({_act_spelling(a) for per in fused for pp in per for a, _ in pp})
    else:
        act_names = [_act_spelling(silu_all_pre) + " before split"]
    spelling = (f"{norm.spelling} -> {proj.spelling} -> {split.spelling} -> "
                f"{'/'.join(act_names)}({'all' if silu_all else 'u'})")
    report.counts["preprocess"] += 1
    report.details.append(("preprocess", spelling))
    return True


def _preprocess_candidates(graph: Graph) -> list:
    """Nodes split four ways along the last dim (split_with_sizes / split / >= 4 slices)."""
    out = []
    for n in graph.nodes:
        users = list(n.users)
        if any(_is(u, aten.split_with_sizes.default, aten.split.Tensor) for u in users) \
                or sum(_is(u, aten.slice.Tensor) for u in users) >= 4:
            out.append(n)
    return out


@register("preprocess")
def rewrite_preprocess(gm: GraphModule, report: RewriteReport) -> None:
    """LayerNorm -> projection -> split(u, v, q, k) -> silu(u)  =>  hstu.stu_preprocess."""
    gm.graph.eliminate_dead_code()
    seen: set = set()
    _rewrite_each(gm, report, "preprocess", _preprocess_candidates(gm.graph),
                  lambda g, n, r: _rewrite_preprocess_at(g, n, r, seen), lambda n: bool(n.users))
    _report_unsplit_projections(gm, report, seen)


def _quiet(fn, *args):
    """``fn(*args)``, or None where it declines (used to look for candidates, not to prove them)."""
    try:
        return fn(*args)
    except Decline:
        return None


def _report_unsplit_projections(gm: GraphModule, report: RewriteReport, seen: set) -> None:
    """``explain`` is never silent about a LayerNorm feeding a projection: one that is not a
    preprocess candidate (its output is not split four ways) is reported as a near miss."""
    done = set()
    for n in gm.graph.nodes:
        if n in seen or not n.users:
            continue
        proj = _quiet(_match_projection, n)
        norm = _quiet(_match_norm, proj.inp) if proj is not None and isinstance(proj.inp, Node) else None
        if norm is None or norm.groups or norm.out in done:
            continue
        done.add(norm.out)
        report.near_misses.append(("preprocess", f"{_name(n)}: projection of LayerNorm({norm.src.name}) is not "
                                                 "split into four chunks u, v, q, k along the last dim"))


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
        try:
            proj = _match_projection(p)
        except Decline:
            proj = None
        if proj is None or not isinstance(proj.inp, Node):
            continue
        if _rewrite_output_with(graph, add, x, p, proj, report, seen):
            return True
    return False


def _rewrite_output_with(graph, add, x, p, proj, report, seen=None) -> bool:
    where = _name(add)
    if seen is not None:
        seen.add(add)
    y = proj.inp
    wrappers = []
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
            if len(parts) != 3 or not _last_dim(dim, _tval(y)):
                raise Decline(f"{where}: concat is not [u, attn, u*Norm(attn)] along the last dim")
            concat, y = y, parts[2]
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
                norm = _match_norm(b, fp32_region=fp32 is not None)
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
                              "tensor (RMSNorm or a hand-written norm is not fused)")
            return False
    except Decline:
        if not candidate:
            return False
        raise
    a = norm.src
    u_used = u  # the multiply's factor (fp32 region: u.float())
    if fp32 is not None:
        u = _cast_of(u_used)
        if u is None or _tval(mul).dtype != torch.float32:
            raise Decline(f"{where}: y is cast to {_tval(fp32).dtype} before the projection but u is not "
                          "an upcast of a tensor of that dtype")
    av, uv, xv, pv, wv = _tval(a), _tval(u), _tval(x), _tval(p), _tval(proj.weight)
    mul_dtype = torch.float32 if fp32 is not None else av.dtype
    if uv is None or not _shape_is(uv, *av.shape) or uv.dtype != av.dtype or _tval(mul).dtype != mul_dtype \
            or (fp32 is not None and _tval(fp32).dtype != av.dtype):
        raise Decline(f"{where}: u {tuple(uv.shape) if uv is not None else '?'} does not match attn "
                      f"{tuple(av.shape)} in shape and dtype (no broadcasting)")
    if xv is None or not _shape_is(xv, *pv.shape) or xv.dtype != pv.dtype:
        raise Decline(f"{where}: residual {_name(x)} is not a [L, E] tensor like the projection output")
    if not _eq(av.shape[0], xv.shape[0]):
        raise Decline(f"{where}: attn and residual have different row counts")
    if concat is not None:
        parts = concat.args[0]
        a_used = _cast_of(parts[1]) if fp32 is not None else parts[1]
        if not (_same_tensor(parts[0], u_used) and _same_tensor(a_used, a)):
            raise Decline(f"{where}: concat is not [u, attn, u*Norm(attn)] (order or operands differ)")
    C = _static(av.shape[1])
    E = _static(xv.shape[1])
    K = C * (3 if concat is not None else 1) if C is not None else None
    w_shape = (E, K) if proj.linear_layout else (K, E)
    if C is None or E is None or not _shape_is(wv, *w_shape):
        raise Decline(f"{where}: projection weight {tuple(wv.shape)} is not {w_shape}")
    if p is not add and len(p.users) != 1:
        raise Decline(f"{where}: projection output has other users")
    order = _order(graph)
    first = min([norm.first, mul] + ([concat] if concat is not None else []), key=order.__getitem__)
    _check_no_mutation(graph, first, add, where)

    w_lin_fn = (lambda w: w) if proj.linear_layout else (lambda w: w.t())
    is_concat = concat is not None
    r = norm.repeat

    def op_fn(a_, u_, x_, nw, nb, w, b):
        nw, nb = (t.repeat_interleave(r) if t is not None and r > 1 else t for t in (nw, nb))
        return [torch.ops.hstu.stu_output(a_, u_, x_, nw, nb, norm.eps, norm.groups, w_lin_fn(w), b, is_concat)]

    probe_inputs = [a, u, x, norm.weight, norm.bias, proj.weight, proj.bias]
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
        args = [a, u, x, nw, nb, norm.eps, norm.groups, w, proj.bias, is_concat, *extra]
        if config.block_backward == "save":  # same output; the backward reads y and the statistics
            op = _getitem(graph, _call(graph, torch.ops.hstu.stu_output_save.default, args), 0)
        else:
            op = _call(graph, torch.ops.hstu.stu_output.default, args)
    add.replace_all_uses_with(op)
    spelling = f"u*{norm.spelling}(attn)" if mul.args[0] is u_used else f"{norm.spelling}(attn)*u"
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


# ---------------------------------------------------------------------------------------------
# after both block rewrites: silu(u) moves into the output block
# ---------------------------------------------------------------------------------------------
def _arg_index(n: Node, name: str) -> int:
    return next(i for i, a in enumerate(n.target._schema.arguments) if a.name == name)


def _op_arg(n: Node, name: str):
    """Argument ``name`` of the op call ``n``: positional, keyword or the schema's default."""
    i = _arg_index(n, name)
    return n.args[i] if i < len(n.args) else n.kwargs.get(name, n.target._schema.arguments[i].default_value)


def _set_op_arg(n: Node, name: str, value) -> None:
    i = _arg_index(n, name)
    if i < len(n.args):
        n.update_arg(i, value)
    else:
        n.update_kwarg(name, value)


def _takes_act_as_u_only(n: Node, acts: list) -> bool:
    """``n`` is an output op reading ``act`` once, as its (activated) ``u``."""
    if not _is(n, torch.ops.hstu.stu_output.default, torch.ops.hstu.stu_output_save.default):
        return False
    reads = [a for a in (*n.args, *n.kwargs.values()) if any(a is act for act in acts)]
    return len(reads) == 1 and reads[0] is _op_arg(n, "u") and _op_arg(n, "silu_u") is False


def fuse_u_silu(gm: GraphModule, report: RewriteReport) -> int:
    """``act = silu(uvqk[:, :u_dim])`` (a preprocess op's output 0) used only as the ``u`` of output ops
    => they take the view ``uvqk[:, :u_dim]`` with ``silu_u=True`` and apply the silu in their kernels.

    ``act`` dies, so Inductor drops the pointwise kernel that wrote it (an ATen silu inside the op's
    body), and the preprocess backward gets ``d_act=None``: the u columns' gradient (already w.r.t. the
    pre-activation) joins v, q, k's in the one kernel assembling ``d_uvqk``. Exact by the two ops'
    definitions (no probe needed). Left alone: silu on all four, ``act`` used by anything else (or
    returned, or passed twice), an output op already given a pre-activation. Returns how many
    preprocess ops it changed."""
    hstu = torch.ops.hstu
    graph = gm.graph
    fused = 0
    for pre in list(graph.nodes):
        if not _is(pre, hstu.stu_preprocess.default, hstu.stu_preprocess_save.default) \
                or _op_arg(pre, "silu_all") is not False:
            continue
        acts = [n for n in pre.users if _getitem_of(n, 0) is pre]
        users = [u for a in acts for u in a.users]
        if not users or not all(_takes_act_as_u_only(u, acts) for u in users):
            continue
        order = _order(graph)
        first = min(acts, key=order.__getitem__)
        uvqk = next((n for n in pre.users if _getitem_of(n, 1) is pre), None)
        with graph.inserting_before(first):
            if uvqk is None:
                uvqk = _getitem(graph, pre, 1)
            elif order[uvqk] > order[first]:
                first.prepend(uvqk)  # a getitem of pre: may move anywhere after pre
            u_pre = _call(graph, aten.slice.Tensor, [uvqk, 1, 0, _op_arg(pre, "u_dim")])
        for u in users:
            _set_op_arg(u, "u", u_pre)
            _set_op_arg(u, "silu_u", True)
        for a in acts:
            graph.erase_node(a)
        report.details.append(("silu(u)", f"applied by {len(users)} output op(s) (silu_u=True): the preprocess "
                                          "writes no silu(u) tensor"))
        fused += 1
    return fused


def _rewrite_each(gm, report, kind, candidates, rewrite_at, wanted) -> None:
    """Try ``rewrite_at`` on every candidate still in the graph; a Decline becomes a near miss."""
    changed = False
    for n in candidates:
        if n.graph is not gm.graph or not wanted(n):
            continue
        try:
            changed |= rewrite_at(gm, n, report)
        except Decline as e:
            report.near_misses.append((kind, str(e)))
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
