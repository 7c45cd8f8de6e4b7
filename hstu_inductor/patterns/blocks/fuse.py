"""After both block rewrites: silu(u) moves from the preprocess op into the output op (``fuse_u_silu``)."""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ...report import RewriteReport
from .common import _call, _getitem, _getitem_of, _is, _order

aten = torch.ops.aten


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

