"""Python floats that ``torch.compile(dynamic=True)`` turned into graph inputs.

With ``dynamic=True`` Dynamo does not specialise floats (``specialize_float=False``): a module
constant such as ``ALPHA = 0.5`` or a ``padding_value=0.0`` default reaches the graph as a 0-d
float64 CPU tensor input read with ``.item()``. To the provers that is "data we do not model",
so no HSTU subgraph reading one could be proven. Here each such input is replaced by the value
it had when the graph was compiled (Dynamo's ``GraphArg.example``), and the graph asserts at
run time that the input still holds that value (a CPU compare, no device sync): if the float
ever changes, the call raises an error naming it instead of computing with the old value.
This runs only on our rewritten copy: when nothing is rewritten the user's graph is compiled
unchanged, float inputs included.
"""
from __future__ import annotations


import torch

from .. import _compat

aten = torch.ops.aten

__all__ = ["specialise_float_inputs"]


def _substitute(node, old, value):
    def sub(a):
        return value if a is old else a

    node.args = torch.fx.node.map_aggregate(node.args, sub)
    node.kwargs = torch.fx.node.map_aggregate(node.kwargs, sub)


def specialise_float_inputs(dynamo_gm, aten_gm) -> list:
    """Replace the float inputs of ``aten_gm`` (read only through ``.item()``) by their compile-time
    values, with a run-time equality assert each. Returns the source names specialised."""
    values = _compat.promoted_float_inputs(dynamo_gm)
    if not values:
        return []
    phs = list(aten_gm.graph.find_nodes(op="placeholder"))
    done = []
    for i, (value, name) in values.items():
        ph = phs[i] if i < len(phs) else None
        if ph is None or not ph.users or any(u.target is not aten._local_scalar_dense.default for u in ph.users):
            continue
        for item in list(ph.users):
            pending = [item]
            while pending:  # the value, then SymFloat arithmetic on constants folded away
                node = pending.pop()
                const = value if node is item else node.target(*node.args, **node.kwargs)
                for u in list(node.users):
                    _substitute(u, node, const)
                    if u.op == "call_function" and getattr(u.target, "__module__", None) in ("_operator", "math") \
                            and not u.all_input_nodes:
                        pending.append(u)
                aten_gm.graph.erase_node(node)
        with aten_gm.graph.inserting_after(phs[-1]):
            msg = (f"hstu_inductor specialised the float {name} = {value!r} (torch.compile(dynamic=True) passes "
                   f"floats as inputs) and it changed; call torch._dynamo.reset() or set "
                   f"torch._dynamo.config.specialize_float = True")[:250]
            eq = aten_gm.graph.call_function(aten.eq.Scalar, (ph, value))
            eq.meta["val"] = aten.eq.Scalar(ph.meta["val"], value)
            with aten_gm.graph.inserting_after(eq):
                aten_gm.graph.call_function(aten._assert_async.msg, (eq, msg))
        done.append(name)
    if done:
        aten_gm.graph.lint()
        aten_gm.recompile()
    return done
