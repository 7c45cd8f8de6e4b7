"""The stages both blocks share: the normalisation (``NORM_SPELLINGS``) and the projection
(``PROJECTION_SPELLINGS``). Each spelling returns None ("not this spelling"), its match, or raises
``Decline`` ("recognisably this stage, but not provably the op's semantics")."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch.fx import Node

from .common import (_VIEW_TARGETS, Decline, _cast_of, _eq, _getitem_of, _is, _name, _shape_is, _static,
                     _strip_fp32_cast, _tval, _val)

aten = torch.ops.aten


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


def _norm_layer_norm(n: Node, rowmajor: bool = False) -> Optional[tuple]:
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


def _norm_group_norm(n: Node, rowmajor: bool = False) -> Optional[tuple]:
    """``F.group_norm(a, G, w, b, eps)`` on ``a: [L, C]`` (G groups of C/G contiguous channels), or
    on a view ``a.view(L, C, S)`` of a 2-D ``a: [L, C*S]`` viewed back to ``[L, C*S]`` (generative-
    recommenders' per-head norm ``group_norm(a.view(-1, H, Dv), H, w[H], b[H])``): the same groups
    of contiguous elements of each row, with every parameter repeated over its ``S`` elements.
    ``rowmajor``: the caller reads ``n`` in row-major order only (it multiplies it elementwise with a
    tensor of its shape and views the product back to ``[L, C*S]``), so the ``[L, C, S]`` result itself
    is accepted too, without the view back."""
    back = None  # the group norm output, when ``n`` views it back to 2-D
    if _is(n, *_VIEW_TARGETS) and _tval(n) is not None and _tval(n).dim() == 2 and _tval(n.args[0]) is not None:
        back = n.args[0]
    elif rowmajor and _tval(n) is not None and _tval(n).dim() == 3:
        back = n  # [L, C, S] read in row-major order: the same values as its view back to [L, C*S]
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
                or not (_shape_is(_tval(n), *sv.shape) or (back is n and _shape_is(_tval(n), *iv.shape)))
                or not G or C_ % G):
            raise Decline(f"{_name(core)}: group norm on a view is not [L, C, S] of a 2-D [L, C*S] tensor "
                          "viewed back to [L, C*S]")
        return core, src, w, b, float(eps), G, HxW_, inp
    if (iv is None or iv.dim() != 2 or HxW_ != 1 or C_ is None or not _eq(C_, iv.shape[1])
            or not _eq(_val(N), iv.shape[0]) or not G or C_ % G):
        raise Decline(f"{_name(core)}: group norm is not over [L, C] channels of a 2-D tensor")
    return core, inp, w, b, float(eps), G, 1, first


def _vector(t) -> bool:
    return isinstance(t, Node) and _tval(t) is not None and _tval(t).dim() == 1


def _last_dim_mean(m: Node) -> Optional[Node]:
    """``x`` when ``m`` is ``x.mean(-1, keepdim=True)`` of a 2-D ``x``."""
    if not _is(m, aten.mean.dim) or len(m.args) < 3 or m.args[2] is not True:
        return None
    x, dims = m.args[0], m.args[1]
    xv = _tval(x)
    if xv is None or xv.dim() != 2 or len(dims) != 1 or not _last_dim(dims[0], xv):
        return None
    return x


def _standardised(c: Node) -> Optional[tuple]:
    """``(x, eps, mean)`` when ``c`` is ``(x - mean) / sqrt(var + eps)`` or ``(x - mean) * rsqrt(var + eps)``
    with ``mean = x.mean(-1, keepdim=True)`` (``var`` as the user wrote it: the probe checks the values)."""
    if _is(c, aten.div.Tensor) and len(c.args) == 2:
        pairs, root = [tuple(c.args)], aten.sqrt.default
    elif _is(c, aten.mul.Tensor) and len(c.args) == 2:
        pairs, root = [tuple(c.args), tuple(c.args[::-1])], aten.rsqrt.default
    else:
        return None
    for d, r in pairs:
        if not (isinstance(d, Node) and _is(d, aten.sub.Tensor) and isinstance(r, Node) and _is(r, root)):
            continue
        x, mean = d.args[0], d.args[1]
        if not (isinstance(mean, Node) and _last_dim_mean(mean) is x):
            continue
        shifted = r.args[0]
        if not (_is(shifted, aten.add.Tensor, aten.add.Scalar) and isinstance(shifted.args[1], (int, float))):
            continue
        return x, float(shifted.args[1]), mean
    return None


def _norm_hand_written(n: Node, rowmajor: bool = False) -> Optional[tuple]:
    """A layer norm spelled out over the last dim of a 2-D tensor: ``(x - mean) / sqrt(var + eps) [* w] [+ b]``
    (or ``* rsqrt(var + eps)``), either operand order. Matched by its shape; the block's probe then checks it
    computes the op's layer norm (a biased variance, eps inside the root)."""
    w = b = None
    core = n
    if _is(core, aten.add.Tensor) and len(core.args) == 2:
        for inner, bias in (core.args, core.args[::-1]):
            if _vector(bias) and isinstance(inner, Node) and not _vector(inner):
                core, b = inner, bias
                break
    if _is(core, aten.mul.Tensor) and len(core.args) == 2:
        for inner, weight in (core.args, core.args[::-1]):
            if _vector(weight) and isinstance(inner, Node) and _standardised(inner) is not None:
                core, w = inner, weight
                break
    found = _standardised(core)
    if found is None:
        return None
    x, eps, mean = found
    return core, x, w, b, eps, 0, 1, mean


NORM_SPELLINGS: dict[str, Callable] = {
    "layer_norm": _norm_layer_norm,
    "group_norm": _norm_group_norm,
    "layer_norm(hand-written)": _norm_hand_written,
}


def _match_norm(n: Node, fp32_region: bool = False, rowmajor: bool = False) -> Optional[NormMatch]:
    """A normalisation of a 2-D tensor with fp32-or-native statistics, output in the input dtype
    (``rowmajor``: or its values in another shape, read in row-major order; see ``_norm_group_norm``).

    Accepted casts: ``Norm(a.float(), w.float(), b.float()).to(a.dtype)`` (the op's own
    semantics), or no casts at all. An upcast without the downcast is declined (the result
    would stay fp32 while the op returns the input dtype), unless ``fp32_region``: the caller
    proved that everything computed from the fp32 result is cast down once later."""
    out = n
    downcast = _cast_of(n)
    core_out = downcast if downcast is not None else n
    for spelling, fn in NORM_SPELLINGS.items():
        m = fn(core_out, rowmajor=rowmajor)
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


def _last_dim(dim, t: torch.Tensor) -> bool:
    return isinstance(dim, int) and dim in (t.dim() - 1, -1)

