"""The cost rule: keep stock Inductor's code for graphs that it runs faster than the rewrites.

Without CUDA graphs, a small step is bound by host time. Each hstu op costs more host time per call
than the code Inductor generates for the same ops (benchmarks/RESULTS.md, 2026-11-24, H100). So below some
size the rewritten graph loses, although its kernels are faster. The rule decides by the work of the
attention, the part of the layer that grows fastest with size:

    work = B * H * N**2, per attention op (the score elements Inductor's attention computes per call;
    B sequences, H heads, N = max_seq_len)

A graph is rewritten when ``work >= config.cost_rule_min_work[phase]``. ``phase`` is ``"train"``
when the graph is compiled with grad enabled and an input requires grad, else ``"infer"``.

The rule applies only on CUDA, only without CUDA graphs (``mode="reduce-overhead"`` hides the host
time; there the rewrites were faster at every measured size), and only to graphs with an attention
rewrite. The work is read from the rewritten graph's symbolic sizes:

- all sizes static: one decision at compile time;
- symbolic sizes (``dynamic=True``): both graphs are compiled and each call runs the one its sizes
  select. A symbol the call's arguments do not carry (or a work expression that cannot be
  evaluated) keeps the rewrite, and ``explain()`` says so.

``explain()`` reports each decision (``RewriteReport.cost_rule``). ``config.cost_rule = "off"``
turns the rule off.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch

from . import config

log = logging.getLogger("hstu_inductor")

__all__ = ["Decision", "decide", "SizeDispatch"]

@dataclasses.dataclass
class Decision:
    """What the rule chose for one graph: ``"hstu"``, ``"inductor"``, or ``"runtime"`` (per call)."""

    choice: str
    phase: str
    threshold: float
    work: object  # int, or a sympy expression in the graph's size symbols
    per_call: Optional[Callable] = None  # args -> work, for "runtime"
    bound: float = 0.0  # a symbolic work's least value (shape ranges)

    def describe(self) -> str:
        rule = f"B*H*N^2 {'<' if self.choice == 'inductor' else '>='} {self.threshold:.3g}"
        where = f"{self.phase}, no CUDA graphs"
        work = f"{int(self.work):,}" if isinstance(self.work, int) else f"{self.work}, at least {self.bound:,.0f}"
        if self.choice == "runtime":
            return (f"per call: B*H*N^2 = {self.work} score elements per attention; calls below "
                    f"{self.threshold:.3g} run stock Inductor's code, the others the rewrites ({where})")
        if self.choice == "inductor":
            return (f"kept stock Inductor's code: {rule} (work {work}; {where}), where the host time "
                    "of the hstu ops exceeds what their kernels save; hstu_inductor.config.cost_rule='off' "
                    "rewrites anyway")
        return f"rewritten: {rule} (work {work}; {where})"


def decide(rewritten: torch.fx.GraphModule, example_inputs, cudagraphs: bool) -> Optional[Decision]:
    """The rule's decision for ``rewritten``, or None where it does not apply (see the module doc)."""
    if config.cost_rule == "off" or cudagraphs or not _on_cuda(example_inputs):
        return None
    # hstu.attention only: delta attention (a few new rows per sequence) is not covered
    works = [_attention_work(n) for n in rewritten.graph.find_nodes(op="call_function",
                                                                       target=torch.ops.hstu.attention.default)]
    if not works:
        return None
    phase = "train" if torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs) else "infer"
    threshold = float(config.cost_rule_min_work[phase])
    if any(w is None for w in works):
        log.info("hstu_inductor: cost rule: an attention's sizes are unknown; rewritten")
        return None
    work = works[0] if len(set(map(str, works))) == 1 else sum(works) / len(works)
    if work.is_number:
        return Decision("hstu" if int(work) >= threshold else "inductor", phase, threshold, int(work))
    env = _shape_env(example_inputs)
    lower = _lower_bound(work, env)
    if lower is not None and lower >= threshold:
        return Decision("hstu", phase, threshold, work, bound=lower)
    per_call = _evaluator(work, example_inputs, env)
    if per_call is None:
        log.info("hstu_inductor: cost rule: work %s not computable from the call's arguments; rewritten", work)
        return None
    return Decision("runtime", phase, threshold, work, per_call)


class SizeDispatch:
    """Runs ``small`` (stock Inductor's compiled graph) for calls whose work is below the threshold,
    ``large`` (the rewritten graph) for the others."""

    def __init__(self, decision: Decision, small, large):
        self.decision, self.small, self.large = decision, small, large

    def __call__(self, *args):
        try:
            small = self.decision.per_call(args) < self.decision.threshold
        except Exception:  # noqa: BLE001  (an argument not as compiled: the rewrite, which checks its inputs)
            small = False
        return (self.small if small else self.large)(*args)


def _on_cuda(example_inputs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)


def _val(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _attention_work(node):
    """``B * H * max_seq_len**2`` of one attention op node (q, k, v, seq_offsets, max_seq_len, ...)."""
    from .patterns.prover import sym_expr  # here: the backend imports the patterns only once it compiles

    q, offsets, n = (_val(node.args[i]) if i < len(node.args) else None for i in (0, 3, 4))
    if not isinstance(q, torch.Tensor) or not isinstance(offsets, torch.Tensor) or q.dim() != 3 or \
            not isinstance(n, (int, torch.SymInt)):
        return None
    b, h, n = (sym_expr(v) for v in (offsets.shape[0], q.shape[1], n))
    return (b - 1) * h * n * n


def _shape_env(example_inputs):
    fake = torch._guards.detect_fake_mode(list(example_inputs))
    return getattr(fake, "shape_env", None)


def _lower_bound(work, env) -> Optional[float]:
    """The least value ``work`` can take under the shape environment's ranges (e.g. ``mark_dynamic(min=...)``)."""
    try:
        low = env.bound_sympy(work).lower
        return float(low) if low.is_finite else None
    except Exception:  # noqa: BLE001  (no ranges known: no bound)
        return None


def _evaluator(work, example_inputs, env):
    """``args -> work`` for the compiled graph's call arguments: each free symbol of ``work`` is read
    from the first argument that carries it (a SymInt argument, or a tensor dimension)."""
    import sympy

    if env is not None:
        work = env.simplify(work)
    sources = {}
    for i, x in enumerate(example_inputs):
        dims = [(None, x)] if isinstance(x, torch.SymInt) else (
            list(enumerate(x.shape)) if isinstance(x, torch.Tensor) and not x.is_nested else [])
        for d, s in dims:
            try:
                e = s.node.expr if isinstance(s, torch.SymInt) else None
            except Exception:  # noqa: BLE001  (a nested int has no plain expression)
                e = None
            if e is not None and e.is_Symbol:
                sources.setdefault(e, (i, d))
    symbols = sorted(work.free_symbols, key=str)
    if not symbols or any(s not in sources for s in symbols):
        return None
    fn = sympy.lambdify(symbols, work, "math")
    where = [sources[s] for s in symbols]

    def per_call(args):
        return fn(*[int(args[i]) if d is None else args[i].shape[d] for i, d in where])

    return per_call
