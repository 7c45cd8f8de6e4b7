"""The one place that touches private torch APIs (torch 2.11 .. 2.13 differences live here)."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _get_current_dispatch_mode  # plain_eager: ~0.4 us a call as a local import

__all__ = ["graph_fake_mode", "trace_aten", "compile_fx", "aot_eager", "mode_options", "guarded", "plain_eager",
           "njt_view_target", "is_njt", "size_hint", "shape_env_hints", "specialize_ints", "install_ddp_pre_split",
           "ddp_pre_split_status", "carry_dynamo_placeholder_meta", "synthetic_source", "unwrap_backend", "promoted_float_inputs",
           "compile_reason", "capture_graph_break_logs", "install_frame_config", "install_exact_int_rounding",
           "no_fake_mode", "dynamo_control_flow"]


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
        return make_fx(fn, tracing_mode="real", decomposition_table=_RETRACE_DECOMPS)(*args)


def trace_aten_functional(fn, args) -> torch.fx.GraphModule:
    """:func:`trace_aten` with in-place ops replaced by their out-of-place twins (``torch.func.functionalize``,
    views kept): a tensor read after an in-place op on it (``s.masked_fill_(m, 0)`` whose result is
    discarded) is then a read of that op's result, so the rewriters see data flow as it is."""
    gm = trace_aten(torch.func.functionalize(fn, remove="mutations"), args)
    _differentiable_copies(gm)
    return gm


def _differentiable_copies(gm: torch.fx.GraphModule) -> None:
    """``aten.copy(dst, src)`` (what a write into a view becomes) has no derivative formula: spelled as
    ``src`` broadcast to ``dst``'s shape and cast to its dtype (its value: ``dst``'s values are not read)."""
    aten = torch.ops.aten
    for n in list(gm.graph.find_nodes(op="call_function", target=aten.copy.default)):
        dst, src = n.args[:2]
        dval = dst.meta.get("val")
        if dval is None:
            continue
        with gm.graph.inserting_before(n):
            x = gm.graph.call_function(aten.expand.default, (src, list(dval.shape)))
            x = gm.graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
            if src.meta.get("val") is not None and src.meta["val"].dtype != dval.dtype:
                x = gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": dval.dtype})
        x.meta["val"] = n.meta.get("val")
        n.replace_all_uses_with(x)
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def mutates(gm: torch.fx.GraphModule) -> bool:
    """Whether a node of ``gm`` writes one of its arguments in place (its schema says so)."""
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return True
    return False


def _baddbmm_without_input(inp, b1, b2, *, beta=1, alpha=1):
    """``baddbmm`` with ``beta == 0`` ignores its input (NaNs included): it is ``alpha * bmm`` exactly,
    the spelling the finders know (scores as ``baddbmm(empty, q, k^T, beta=0, alpha=scale)``).
    Anything else keeps the op (NotImplemented: make_fx records it as it is)."""
    if isinstance(beta, (int, float)) and beta == 0:
        out = torch.ops.aten.bmm.default(b1, b2)
        return out if alpha == 1 else torch.ops.aten.mul.Tensor(out, alpha)
    return NotImplemented


_RETRACE_DECOMPS = {torch.ops.aten.baddbmm.default: _baddbmm_without_input}


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


def aot_eager(gm, example_inputs):
    """Dynamo's ``aot_eager`` backend on ``gm``: AOTAutograd (functionalisation, joint graph,
    partition) with the graphs run op by op, no Inductor. The ``triton_op`` s stay single nodes
    that run their own bodies (as under ``torch.export``), instead of being traced into the graph
    for Inductor: cheaper to compile, and each hstu op runs exactly what its eager call runs."""
    import contextlib

    from torch._dynamo.backends.registry import lookup_backend

    functorch_config = torch._functorch.config
    keep_whole = (functorch_config.patch(decompose_custom_triton_ops=False)
                  if hasattr(functorch_config, "decompose_custom_triton_ops")
                  else contextlib.nullcontext())  # older torch (2.11): the bodies are traced in
    with keep_whole:
        return lookup_backend("aot_eager")(gm, example_inputs)


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
    if cond is True or cond is False:  # plain sizes: no import (it costs ~0.5 us a call, ~20 calls per op)
        return cond
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return bool(cond) if isinstance(cond, bool) else bool(guard_or_false(cond))


def shape_env_hints(shape_env) -> dict:
    """Symbol -> int value of every backed symbol of ``shape_env`` (nested ints have none)."""
    table = getattr(shape_env, "backed_var_to_val", None)  # torch >= 2.13
    if table is None:
        table = shape_env.var_to_val
    return {k: int(v) for k, v in table.items() if getattr(v, "is_Integer", True)}


def known_equal(shape_env, a, b) -> bool:
    """Whether the sizes ``a == b`` (sympy expressions) follow from what ``shape_env`` knows (its
    replacements and runtime asserts, e.g. an unbacked size asserted equal to a backed one), without
    adding a guard. Private API, same signature in torch 2.11 and 2.13."""
    import sympy

    if shape_env is None:
        return False
    try:
        r = shape_env._maybe_evaluate_static(sympy.Eq(a, b))
    except Exception:  # a failure to simplify means "not known"
        return False
    return r is not None and bool(r == sympy.true)


def dynamo_control_flow() -> tuple:
    """Exceptions Dynamo raises through a backend to steer the compile, not failures: a restart of
    the frame's analysis (e.g. ``TensorifyScalarRestartAnalysis`` from AOTAutograd's float pass) and
    a request to skip the frame. A backend's fallback must let them through."""
    from torch._dynamo import exc

    return tuple(t for t in (getattr(exc, "RestartAnalysis", None), getattr(exc, "SkipFrame", None)) if t is not None)


def no_fake_mode():
    """A context in which ops run on real tensors even inside an active fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def fake_as_static_input(t, name: str) -> bool:
    """Inside a Dynamo compile: have later fakifications of the real tensor ``t`` (AOTAutograd's of its
    example inputs) give it static sizes, as Dynamo records a module buffer (its tracing context maps the
    tensor to a symbolic context). False outside a compile."""
    from torch._dynamo.source import ConstantSource
    from torch._guards import TracingContext
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatefulSymbolicContext

    ctx = TracingContext.try_get()
    if ctx is None:
        return False
    ctx.tensor_to_context[t] = StatefulSymbolicContext(
        dynamic_sizes=[DimDynamic.STATIC] * t.dim(), constraint_sizes=[None] * t.dim(),
        tensor_source=ConstantSource(name), shape_env_to_source_to_symbol_cache={})
    return True


def is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t)


def fake_tensor_types() -> tuple:
    """``(FakeTensor, FakeTensorMode, DynamicOutputShapeException)`` (the test corpora trace under fake modes)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode

    return FakeTensor, FakeTensorMode, DynamicOutputShapeException


def custom_graph_pass_base():
    """Inductor's ``CustomGraphPass`` (the base of passes that carry their own cache key)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def user_triton_kernel(kernel_idx: int):
    """The Triton kernel a ``triton_kernel_wrapper_*`` node launches (its ``kernel_idx``)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return kernel_side_table.get_kernel(kernel_idx)


def aot_or_cpp_wrapper() -> bool:
    """True while Inductor compiles for AOTInductor or its C++ wrapper (no Python at run time)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V

    return bool(inductor_config.cpp_wrapper) or bool(V.aot_compilation)


def register_dynamo_backend(fn, name: str) -> None:
    """Register ``fn`` as Dynamo backend ``name`` unless a backend of that name exists."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if name not in _BACKENDS:
        register_backend(fn, name=name)


def buffer_grapharg(name: str, fake):
    """What Dynamo records on a registered buffer's placeholder: a ``GraphArg`` whose source is
    ``L['self']._buffers[name]`` (a backend tells module state from user inputs by it)."""
    from torch._dynamo import source as S
    from torch._dynamo.variables.builder import GraphArg

    src = S.DictGetItemSource(S.UnspecializedParamBufferSource(S.UnspecializedNNModuleSource(
        S.LocalSource("self", is_input=True)), "_buffers"), name)
    return GraphArg(src, None, pass_arg_as_tensor=False, fake_tensor=fake, is_tensor=True)


def specialize_ints(sizes) -> None:
    """Fix symbolic sizes to their current values, with a guard each (``guard_int``): the
    compiled graph then recompiles if one of them changes."""
    from torch.fx.experimental.symbolic_shapes import guard_int

    for s in sizes:
        if not isinstance(s, torch.SymInt):
            continue
        env = s.node.shape_env
        hints = shape_env_hints(env)
        for sym in sorted(s.node.expr.free_symbols, key=str):  # each symbol, so products fold too
            guard_int(env.create_symintnode(sym, hint=hints[sym]))


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
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(type(t) is torch.Tensor for t in tensors if isinstance(t, torch.Tensor))


# --------------------------------------------------------------------------------------------
# DistributedDataParallel: Dynamo's DDPOptimizer splits each graph at gradient-bucket boundaries
# and calls the backend once per piece, so a block straddling a boundary is never seen whole.
# The hook below lets our backend rewrite the *unsplit* graph first (docs/distributed.md).
# --------------------------------------------------------------------------------------------

_DDP_HOOK = {"installed": False, "reason": "not attempted"}


def install_ddp_pre_split(pre_split) -> str | None:
    """Wrap ``DDPOptimizer.compile_fn`` so that ``pre_split(split, backend, gm)`` runs on the whole
    Dynamo graph before the bucket split; ``split(g)`` runs the original split-and-compile on ``g``
    and ``backend`` is the compiler the DDPOptimizer was given. Returns None when installed (or
    already installed), else why not; :func:`ddp_pre_split_status` keeps that reason.

    Private API (torch 2.11 .. 2.13: ``DDPOptimizer.compile_fn(self, gm, example_inputs, **kw)``
    and ``self.backend_compile_fn``), so every assumption is checked and failure is reported,
    never raised: without the hook DDP training still works, only the split blocks stay unfused.
    """
    import functools
    import inspect

    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except Exception as e:  # torch built without distributed support, or the module moved
        return _ddp_hook_failed(f"torch._dynamo.backends.distributed.DDPOptimizer unavailable ({e})")
    orig = DDPOptimizer.__dict__.get("compile_fn")
    if getattr(orig, "_hstu_pre_split", False):
        return None
    if orig is None or list(inspect.signature(orig).parameters)[:3] != ["self", "gm", "example_inputs"]:
        return _ddp_hook_failed(f"DDPOptimizer.compile_fn has an unexpected signature in torch {torch.__version__}")
    try:  # the wrapped compiler must be readable off an instance, as compile_fn below reads it
        probe = DDPOptimizer(bucket_bytes_cap=2**30, backend_compile_fn=_ddp_hook_failed)
    except Exception as e:
        return _ddp_hook_failed(f"DDPOptimizer(bucket_bytes_cap=, backend_compile_fn=) failed in torch "
                                f"{torch.__version__} ({type(e).__name__}: {e})")
    if getattr(probe, "backend_compile_fn", None) is not _ddp_hook_failed:
        return _ddp_hook_failed(f"DDPOptimizer has no backend_compile_fn in torch {torch.__version__}")

    @functools.wraps(orig)
    def compile_fn(self, gm, example_inputs, **kwargs):
        return pre_split(lambda g: orig(self, g, example_inputs, **kwargs), self.backend_compile_fn, gm)

    compile_fn._hstu_pre_split = True
    DDPOptimizer.compile_fn = compile_fn
    _DDP_HOOK.update(installed=True, reason=None)
    return None


def _ddp_hook_failed(reason: str) -> str:
    _DDP_HOOK.update(installed=False, reason=reason)
    return reason


def ddp_pre_split_status() -> str | None:
    """None when the DDP pre-split hook is installed, else why it is not."""
    return None if _DDP_HOOK["installed"] else _DDP_HOOK["reason"]


def unwrap_backend(backend):
    """``(fn, kwargs)``: the compiler function under Dynamo's wrappers (``WrapBackendDebug``,
    ``torch.compile``'s ``_TorchCompileWrapper`` with its mode/options kwargs, ``functools.wraps``
    chains), and the keyword arguments those wrappers pass to it."""
    kwargs, seen = {}, set()
    while id(backend) not in seen:
        seen.add(id(backend))
        if callable(getattr(backend, "compiler_fn", None)) and isinstance(getattr(backend, "kwargs", None), dict):
            kwargs = {**backend.kwargs, **kwargs}
            backend = backend.compiler_fn
        elif getattr(backend, "_torchdynamo_orig_backend", None) is not None:
            backend = backend._torchdynamo_orig_backend
        elif getattr(backend, "__wrapped__", None) is not None:
            backend = backend.__wrapped__
    return backend, kwargs


def promoted_float_inputs(dynamo_gm: torch.fx.GraphModule) -> dict:
    """Placeholder index -> (value, source name) of the Python floats Dynamo passed as 0-d CPU
    tensor inputs (``dynamic=True``: ``GraphArg.pass_arg_as_tensor``), with their values at
    compile time (``GraphArg.example``)."""
    out = {}
    for i, p in enumerate(dynamo_gm.graph.find_nodes(op="placeholder")):
        ga, ev = p.meta.get("grapharg"), p.meta.get("example_value")
        if ga is None or not getattr(ga, "pass_arg_as_tensor", False):
            continue
        ex = getattr(ga, "example", None)
        if not (isinstance(ev, torch.Tensor) and ev.dim() == 0 and ev.is_floating_point()
                and ev.device.type == "cpu" and isinstance(ex, torch.Tensor) and ex.numel() == 1):
            continue
        source = getattr(ga, "source", None)
        out[i] = (float(ex), source.name() if callable(getattr(source, "name", None)) else p.name)
    return out


def synthetic_source(name: str):
    """A Dynamo source for a tensor a rewrite added to a graph (it has no origin in user code), so that
    AOTAutograd reads the graph's own buffers like the module's: lifted, static inputs."""
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)


def carry_dynamo_placeholder_meta(src: torch.fx.GraphModule, dst: torch.fx.GraphModule) -> bool:
    """Give ``dst`` (an ATen retrace of the Dynamo graph ``src``, same inputs in the same order)
    what the DDPOptimizer reads off a Dynamo graph: each placeholder's Dynamo metadata (its
    ``example_value`` tells parameters apart, which places the bucket splits) and source, and the
    graph-level ``meta`` / ``_param_name_to_source``. False (nothing changed) if the inputs differ."""
    src_ph, dst_ph = list(src.graph.find_nodes(op="placeholder")), list(dst.graph.find_nodes(op="placeholder"))
    if len(src_ph) != len(dst_ph):
        return False
    for s, d in zip(src_ph, dst_ph):
        for key, value in s.meta.items():
            d.meta.setdefault(key, value)
        d._dynamo_source = getattr(s, "_dynamo_source", None)
    dst.meta = {**getattr(src, "meta", {}), **dst.meta}
    if hasattr(src, "_param_name_to_source"):
        dst._param_name_to_source = src._param_name_to_source
    return True


# --------------------------------------------------------------------------------------------
# Graph breaks (explain's report, the backend's warning). Two sources, both read defensively:
# the reason Dynamo attaches to every graph it hands a backend (``gm.compile_subgraph_reason``,
# a ``GraphCompileReason(reason, user_stack, graph_break)`` since torch 2.0), and Dynamo's
# ``graph_breaks`` logging artifact, which also names breaks that end an empty graph or make
# Dynamo skip a whole frame ("Graph break [...] in user code at FILE:LINE\nGraph Break Reason: ..."
# since torch 2.2, unchanged through 2.13).
# --------------------------------------------------------------------------------------------

def compile_reason(gm) -> tuple[bool, str, list]:
    """``(ended_by_graph_break, reason, [(file, line, function), ...] outermost first)`` of a Dynamo
    graph handed to a backend; ``(False, "", [])`` when Dynamo attached nothing (e.g. export)."""
    r = getattr(gm, "compile_subgraph_reason", None)
    if r is None:
        return False, "", []
    stack = []
    for fs in getattr(r, "user_stack", None) or []:
        try:
            stack.append((str(fs.filename), int(fs.lineno), str(fs.name)))
        except (AttributeError, TypeError, ValueError):
            continue
    return bool(getattr(r, "graph_break", False)), str(getattr(r, "reason", "")), stack


def _graph_break_loggers() -> list:
    import logging

    names = {"torch._dynamo.symbolic_convert.__graph_breaks"}
    try:
        from torch._logging._internal import log_registry

        names |= {n for n in getattr(log_registry, "artifact_log_qnames", ()) if n.endswith(".__graph_breaks")}
    except Exception:  # registry moved: the one logger Dynamo has always used
        pass
    return [logging.getLogger(n) for n in sorted(names)]


def capture_graph_break_logs(sink):
    """Context manager: ``sink(file, line, reason)`` for every graph break Dynamo logs inside it,
    without printing anything the user did not ask for (the artifact logger is raised to DEBUG
    and kept from propagating unless ``TORCH_LOGS`` already enabled it; restored on exit)."""
    import contextlib
    import logging
    import re

    pattern = re.compile(r"in user code at (.+?):(\d+)\nGraph Break Reason: (.*?)(?:\n\n(?:Stack variable source "
                         r"attribution|User code traceback):|\Z)", re.S)

    class _Sink(logging.Handler):
        def emit(self, record):
            try:
                m = pattern.search(record.getMessage())
                if m:
                    sink(m.group(1), int(m.group(2)), m.group(3).strip())
            except Exception:  # a report aid: never break the user's compile
                pass

    @contextlib.contextmanager
    def _ctx():
        handler, saved = _Sink(level=logging.DEBUG), []
        for lg in _graph_break_loggers():
            enabled = lg.isEnabledFor(logging.DEBUG)
            saved.append((lg, lg.level, lg.propagate))
            if not enabled:
                lg.setLevel(logging.DEBUG)
                lg.propagate = False
            lg.addHandler(handler)
        try:
            yield
        finally:
            for lg, level, propagate in saved:
                lg.removeHandler(handler)
                lg.setLevel(level)
                lg.propagate = propagate

    return _ctx()


# --------------------------------------------------------------------------------------------
# Dynamo config for the frames our backend compiles. A backend is called after tracing, so it
# cannot set an option that decides how a frame is traced (``capture_dynamic_output_shape_ops``:
# without it a data-dependent-shape op such as ``repeat_interleave`` without ``output_size`` breaks
# the graph, and inside a generator or loop Dynamo even runs the whole frame eagerly). Dynamo's
# compile callbacks (``torch._dynamo.callback_handler``, torch >= 2.4) run around each outermost
# frame compile; the start callback finds the compile's backend in the caller frame of
# ``convert_frame._compile`` (its ``compiler_fn`` argument, unchanged through 2.13) and patches the
# config for that compile only. Any missing piece: nothing is patched (Dynamo's default stays).
#
# ``torch._dynamo.reset()`` empties the callback lists (``callback_handler.clear()``, 2.4 .. 2.14),
# so the handler's ``clear`` is wrapped to register ours again right after: the first frame traced
# after a reset gets our config too.
#
# A frame whose trace fails under our config is traced again with Dynamo's defaults: Dynamo's own
# retry loop (``compile_frame``, 2.11 .. 2.14) traces a frame again when ``trace_frame`` raises
# ``RestartAnalysis``; a wrapper of ``trace_frame`` turns the failure into that, after putting the
# config back. Without ``trace_frame`` (older torch) the failure reaches the user as before.
# --------------------------------------------------------------------------------------------

# hooks: (wants, patches_for, may_retrace, retraced) of install_frame_config; active: one entry per
# outermost frame compile under way ({"saved": values before our patches, "patches": ours, "failure"})
_FRAMES = {"hooks": None, "active": []}


def _compiling_backend():
    import sys

    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_compile" and f.f_globals.get("__name__") == "torch._dynamo.convert_frame":
            return f.f_locals.get("compiler_fn")
        f = f.f_back
    return None


def install_frame_config(wants, patches_for, may_retrace=None, retraced=None) -> str | None:
    """Around every outermost Dynamo frame compile whose backend ``b`` (unwrapped) has ``wants(b)``,
    set ``torch._dynamo.config`` to ``patches_for()`` (a dict, read per compile) and restore it
    afterwards, also after ``torch._dynamo.reset()``. When tracing such a frame raises ``e`` and
    ``may_retrace(e)``, the frame is traced again with the config it had before our patches, and
    ``retraced(e)`` is called once that trace succeeded. Idempotent; a later call replaces the
    functions. Returns None, or why the config or the re-trace is not installed."""
    from torch._dynamo import callback_handler

    if not hasattr(callback_handler, "register_start_callback"):
        return "this torch has no Dynamo compile callbacks"
    _FRAMES["hooks"] = (wants, patches_for, may_retrace, retraced)
    _register_frame_callbacks(callback_handler)
    _keep_across_reset(callback_handler)
    return None if may_retrace is None else _install_retrace()


# Callbacks run inside compiles that Dynamo's frame hook may still watch (the compiled-autograd
# backward): traced, they would compile a frame within a compile and deadlock on Dynamo's lock.
@torch.compiler.disable
def _frame_start(_args) -> None:
    wants, patches_for = _FRAMES["hooks"][:2]
    backend = _compiling_backend()
    patches = dict(patches_for()) if backend is not None and wants(unwrap_backend(backend)[0]) else {}
    cfg = torch._dynamo.config
    patches = {k: v for k, v in patches.items() if getattr(cfg, k) != v}  # only what changes the trace
    _FRAMES["active"].append({"saved": {k: getattr(cfg, k) for k in patches}, "patches": patches, "failure": None})
    for k, v in patches.items():
        setattr(cfg, k, v)


@torch.compiler.disable
def _frame_end(_args) -> None:
    entry = _FRAMES["active"].pop() if _FRAMES["active"] else None
    _restore(entry)


def _restore(entry) -> None:
    for k, v in (entry["saved"] if entry else {}).items():
        setattr(torch._dynamo.config, k, v)


def _register_frame_callbacks(handler) -> None:
    if _frame_start not in handler.start_callbacks:
        handler.register_start_callback(_frame_start)
        handler.register_end_callback(_frame_end)


def _keep_across_reset(handler) -> None:
    """Wrap ``handler.clear`` (what ``torch._dynamo.reset()`` calls) to put our callbacks back."""
    clear = handler.clear
    if getattr(clear, "_hstu_keeps_frame_config", False):
        return

    def clear_keeping_frame_config(*args, **kwargs):
        try:
            return clear(*args, **kwargs)
        finally:
            _register_frame_callbacks(handler)

    clear_keeping_frame_config._hstu_keeps_frame_config = True
    handler.clear = clear_keeping_frame_config


def _install_retrace() -> str | None:
    import functools

    from torch._dynamo import convert_frame, exc

    orig = getattr(convert_frame, "trace_frame", None)
    if orig is None or not hasattr(convert_frame, "compile_frame"):
        return (f"a frame failing under it is not traced again "
                f"(no convert_frame.trace_frame in torch {torch.__version__})")
    if getattr(orig, "_hstu_retrace", False):
        return None

    @functools.wraps(orig)
    def trace_frame(*args, **kwargs):
        entry = _FRAMES["active"][-1] if _FRAMES["active"] else None
        try:
            out = orig(*args, **kwargs)
        except (exc.RestartAnalysis, exc.SkipFrame):
            raise
        except Exception as e:
            if not _retrace_wanted(entry, e):
                raise
            raise _restart_with_defaults(entry, e, exc) from e
        if entry is not None and entry["failure"] is not None:
            failure, entry["failure"] = entry["failure"], None
            _FRAMES["hooks"][3](failure)
        return out

    trace_frame._hstu_retrace = True
    convert_frame.trace_frame = trace_frame
    return None


def _retrace_wanted(entry, e) -> bool:
    """Our patches were applied to this compile, not yet undone, and the backend agrees."""
    may_retrace = _FRAMES["hooks"][2]
    return bool(entry and entry["patches"] and entry["failure"] is None and may_retrace and may_retrace(e))


def _restart_with_defaults(entry, e, exc):
    """Put the config back for the rest of this compile and ask Dynamo to trace the frame again."""
    _restore(entry)
    names = sorted(entry["patches"])
    entry["patches"], entry["failure"] = {}, e
    restart = exc.RestartAnalysis()
    restart.restart_reason = (f"hstu_inductor: tracing with {names} failed ({type(e).__name__}); "
                              "again with Dynamo's defaults")
    # what Dynamo's retry loop cleans up after a failed attempt
    restart._torch_dynamo_tracer_output = getattr(e, "_torch_dynamo_tracer_output", None)
    return restart


# --------------------------------------------------------------------------------------------
# Exact integer rounding of size bounds. ``FloorToInt`` / ``CeilToInt`` (torch.utils._sympy.functions,
# 2.4 .. 2.14) round a sympy Rational through a float64, which is off past 2**53. When a size
# with the unbacked bound ``sys.maxsize - 1`` (``nonzero``, ``masked_select``, a boolean-mask index)
# is equated with ``K * s`` (``masked_select(...).view(L, K)``), ``ShapeEnv._set_replacement`` solves
# ``s <= (2**63 - 2) / K``, whose float rounds up to ``2**63 / K`` for K = 2, 16, 512, ...; the bound
# it then derives for ``K * s`` (``2**63``) exceeds the size's own and its sanity check fails
# ("tgt_bound=VR[1024, 9223372036854775808] not a subset of src_bound=VR[1024, 9223372036854775806]").
# Stock settings never trace these ops into a graph (they break it); our frame config does.
# --------------------------------------------------------------------------------------------

def install_exact_int_rounding() -> str | None:
    """Make ``FloorToInt`` / ``CeilToInt`` of a Rational exact (integer arithmetic); floats and
    symbolic arguments keep torch's own evaluation. Idempotent. None, or why not installed."""
    import sympy
    from torch.utils._sympy import functions

    patched = False
    for name, rounding in (("FloorToInt", _floor_div), ("CeilToInt", _ceil_div)):
        cls = getattr(functions, name, None)
        if cls is None or not callable(getattr(cls, "eval", None)):
            return f"torch.utils._sympy.functions.{name} missing in torch {torch.__version__}"
        if getattr(cls.eval, "_hstu_exact", False):
            continue
        cls.eval = classmethod(_exact_eval(cls.eval, rounding))
        patched = True
    if patched:  # values computed before, through the float, stay in sympy's cache otherwise
        sympy.core.cache.clear_cache()
    return None


def _floor_div(p: int, q: int) -> int:
    return p // q


def _ceil_div(p: int, q: int) -> int:
    return -(-p // q)


def _exact_eval(orig_eval, rounding):
    import sympy

    def eval(cls, number):
        if isinstance(number, sympy.Rational):  # Integer included; q > 0 in sympy
            return sympy.Integer(rounding(int(number.p), int(number.q)))
        return orig_eval(number)

    eval._hstu_exact = True
    return eval


# --------------------------------------------------------------------------------------------
# torch._logging: our logger under a short name (``set_logs(modules={"hstu": ...})``), and our reports as
# structured-trace artifacts (TORCH_TRACE, read by tlparse).

def register_torch_log(alias: str, qname: str) -> str | None:
    """Make ``alias`` a ``torch._logging`` name for the logger ``qname`` (``set_logs(modules={alias: level})``,
    ``TORCH_LOGS``). Idempotent. None, or why not registered."""
    try:
        from torch._logging._internal import log_registry, register_log
    except ImportError as e:
        return f"torch._logging.register_log missing in torch {torch.__version__} ({e})"
    known = getattr(log_registry, "log_alias_to_log_qnames", {}).get(alias)
    if known is not None:
        # a name torch or another package already owns is left to it
        return None if qname in known else f"{alias!r} already names {known} in torch._logging"
    register_log(alias, qname)
    return None


def trace_json_artifact(name: str, payload_fn) -> None:
    """Emit ``payload_fn()`` as the JSON artifact ``name`` of the structured trace (``TORCH_TRACE``;
    tlparse lists it under the compile id current at the call, i.e. per Dynamo frame). Without a
    trace handler torch returns before calling either function (a check of the trace logger's handlers).
    Indented JSON: the trace file keeps each payload line short."""
    import json

    trace_structured = getattr(torch._logging, "trace_structured", None)
    if trace_structured is None:
        return
    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "json"},
                     payload_fn=lambda: json.dumps(payload_fn(), default=str, indent=1))


def below_autograd():
    """A context that dispatches below the Autograd key (an autograd kernel calling its op's own kernel)."""
    return torch._C._AutoDispatchBelowAutograd()
