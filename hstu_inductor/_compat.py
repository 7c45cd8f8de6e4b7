"""The one place that touches private torch APIs (torch 2.11 .. 2.13 differences live here)."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["graph_fake_mode", "trace_aten", "compile_fx", "mode_options", "guarded", "plain_eager",
           "njt_view_target", "is_njt", "size_hint", "specialize_ints"]


def graph_fake_mode(gm: torch.fx.GraphModule):
    """The fake mode that produced a Dynamo graph's placeholder example values (None if none)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    return None


def placeholder_values(gm: torch.fx.GraphModule) -> list:
    """Fake tensors / SymInts recorded on the placeholders (Dynamo: example_value, export: val)."""
    return [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]


def trace_aten(fn, args, **_ignored) -> torch.fx.GraphModule:
    """Trace ``fn(*args)`` to an ATen-level FX graph below autograd (CompositeImplicit ops
    decomposed, no further decompositions). Used for user graphs and search patterns alike, so
    both are spelled the same way. ``args`` may be fake tensors/SymInts of an existing fake mode.
    Accepts and ignores extra keywords (2.13's ``get_decomp_fn``) so it can serve as a pattern
    matcher ``trace_fn``.
    """
    from torch._dispatch.python import enable_python_dispatcher

    with enable_python_dispatcher():
        return make_fx(fn, tracing_mode="real")(*args)


def njt_view_target():
    """The function Dynamo records for ``nested_tensor_from_jagged(values, offsets, ...)`` (private;
    None when this torch has no such symbol, and the canonicalisation then does nothing)."""
    try:
        from torch.nested._internal.nested_tensor import nested_view_from_values_offsets_lengths
    except ImportError:
        return None
    return nested_view_from_values_offsets_lengths


def is_njt(val) -> bool:
    """True for a jagged-layout nested tensor (real or fake), e.g. a Dynamo node's example value."""
    return isinstance(val, torch.Tensor) and val.is_nested and val.layout == torch.jagged


def compile_fx(gm, example_inputs, config_patches=None):
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    return _compile_fx(gm, example_inputs, config_patches=config_patches or {})


def mode_options(mode: str | None) -> dict:
    """Inductor config patches for a ``torch.compile(mode=...)`` string."""
    if mode in (None, "default"):
        return {}
    return dict(torch._inductor.list_mode_options(mode))


def guarded(cond) -> bool:
    """``cond`` (a bool or SymBool) on the current sizes. A symbolic condition is decided on its hint
    and guarded, so the compiled graph specialises on it and a call that violates it recompiles,
    like Triton's divisibility specialisation of direct launches. (A guard-free
    ``statically_known_true`` is False for a symbolic row stride, which kept strided q/k/v views
    off the TMA path under torch.compile: 0.65x the direct kernel on H100.)"""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return bool(cond) if isinstance(cond, bool) else bool(guard_or_false(cond))


def specialize_ints(sizes) -> None:
    """Fix symbolic sizes to their current values, with a guard each (``guard_int``): the
    compiled graph then recompiles if one of them changes."""
    from torch.fx.experimental.symbolic_shapes import guard_int

    for s in sizes:
        if not isinstance(s, torch.SymInt):
            continue
        env = s.node.shape_env
        hints = getattr(env, "backed_var_to_val", None) or env.var_to_val  # 2.13 / 2.11 spelling
        for sym in sorted(s.node.expr.free_symbols, key=str):  # each symbol, so products fold too
            guard_int(env.create_symintnode(sym, hint=int(hints[sym])))


def size_hint(x) -> int:
    """An int, or a SymInt's current value *without* adding a guard (for choices that only affect
    speed, such as an autotuning key: guarding on them would specialise the compiled graph)."""
    from torch.fx.experimental import symbolic_shapes as ss

    if isinstance(x, int):
        return x
    hint = getattr(ss, "optimization_hint", None) or ss.hint_int  # 2.13 / 2.11 spelling
    return int(hint(x))


def plain_eager(*tensors) -> bool:
    """True when a kernel launch is a plain eager call: not compiling, no tracing/dispatch mode active
    and only ordinary tensors. ``wrap_triton`` is then pure overhead (a higher-order-op dispatch
    and side-table registration per launch) and the kernel can be launched directly."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(type(t) is torch.Tensor for t in tensors if isinstance(t, torch.Tensor))
