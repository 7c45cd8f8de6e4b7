"""Shared helpers for the preprocess/output block pattern tests (no tests here).

Imported by the other ``test_blocks_*.py`` files (pytest puts this directory on ``sys.path``).
"""
from __future__ import annotations

import copy
import operator

import torch

import hstu_inductor
from hstu_inductor.patterns import rewrite_dynamo_graph
from hstu_inductor.report import collecting
from _helpers import REWRITE_BACKEND

__all__ = ["rewritten", "summary", "check_compiled", "explain", "assert_near_miss"]


def rewritten(fn, *args):
    """The ATen graphs the hstu pipeline produced for ``fn(*args)`` (None where nothing was
    rewritten), plus the merged report. Runs the graphs eagerly (no Inductor): fast."""
    graphs = []

    def backend(gm, example_inputs, **_):
        graphs.append(rewrite_dynamo_graph(gm))
        return gm.forward

    torch._dynamo.reset()
    with collecting() as report:
        torch.compile(fn, backend=backend)(*args)
    return graphs, report


def _fmt(a):
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in a) + "]"
    if isinstance(a, float):
        return f"{a:g}"
    return repr(a)


def summary(gm: torch.fx.GraphModule) -> str:
    """One line per call_function node, ``name = op(args)``: stable and readable."""
    lines = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is operator.getitem:
            t = "getitem"
        else:
            t = str(n.target).replace("aten.", "").replace(".default", "")
        args = ", ".join([_fmt(a) for a in n.args] + [f"{k}={_fmt(v)}" for k, v in n.kwargs.items()])
        lines.append(f"{n.name} = {t}({args})")
    return "\n".join(lines)


def explain(fn, *args):
    return hstu_inductor.explain(fn, *args, backend=REWRITE_BACKEND)


def _grads(out, params_and_inputs, seed):
    g = torch.Generator().manual_seed(seed)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
               for o in outs if o.requires_grad)
    return torch.autograd.grad(loss, params_and_inputs, allow_unused=True)


def check_compiled(module: torch.nn.Module, *inputs, train=True, rtol=1e-4, grad_rtol=1e-3, counts=None,
                   backend=REWRITE_BACKEND):
    """``torch.compile(m, backend=backend)`` equals eager for outputs (and, with ``train``, for the
    gradients of every parameter and floating input); the rewrite counts are ``counts``."""
    ref = copy.deepcopy(module)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)
    def is_float(i):
        return isinstance(i, torch.Tensor) and i.is_floating_point()

    with collecting() as report:
        if train:
            ins = [i.detach().clone().requires_grad_() if is_float(i) else i for i in inputs]
            ref_ins = [i.detach().clone().requires_grad_() if is_float(i) else i for i in inputs]
        else:
            ins = ref_ins = list(inputs)
        with torch.set_grad_enabled(train):
            got = compiled(*ins)
            want = ref(*ref_ins)
    gots = got if isinstance(got, (tuple, list)) else (got,)
    wants = want if isinstance(want, (tuple, list)) else (want,)
    for a, b in zip(gots, wants):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)
    if train:
        xs = [i for i in ins if isinstance(i, torch.Tensor) and i.requires_grad]
        rxs = [i for i in ref_ins if isinstance(i, torch.Tensor) and i.requires_grad]
        ga = _grads(got, list(module.parameters()) + xs, 7)
        gb = _grads(want, list(ref.parameters()) + rxs, 7)
        for a, b in zip(ga, gb):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=grad_rtol, atol=grad_rtol)
    if counts is not None:
        got_counts = {k: report.counts[k] for k in counts}
        assert got_counts == counts, (got_counts, report)
    return report


def assert_near_miss(module, *inputs, kind, contains, train=False):
    """No rewrite of ``kind``, a near miss whose reason contains ``contains``, eager-equal output."""
    report = check_compiled(module, *inputs, train=train, counts={kind: 0})
    reasons = [r for k, r in report.near_misses if k == kind]
    assert any(contains in r for r in reasons), (contains, report.near_misses)
    return reasons


def small_stu_layer(cls, *dims, **kw):
    """``cls(*dims, **kw)`` (an STU layer class) seeded, its parameters moved away from their ones/zeros
    initialisation, so that every parameter's role shows in the outputs and gradients."""
    torch.manual_seed(0)
    m = cls(*dims, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def jagged_rows(lengths, E, seed=0):
    """``(x [sum(lengths), E], offsets)``: random rows of a jagged batch and their int64 offsets."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lengths), E, generator=g), torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
