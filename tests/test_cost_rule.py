"""The cost rule (``hstu_inductor/cost_rule.py``): stock Inductor's code for graphs below the work threshold.

The rule applies on CUDA only. Here it is made to apply on CPU (``_on_cuda`` patched), and the compile
step is Dynamo's ``aot_eager`` instead of Inductor, so the tests check the decisions, the per-call
dispatch and the report, not code generation (tests/test_gpu_cost_rule.py compiles with Inductor on CUDA).
"""
from __future__ import annotations

import pytest
import torch

import hstu_inductor
from hstu_inductor import _compat, cost_rule
from hstu_inductor.reference import STULayer
from hstu_inductor.report import collecting
from _helpers import offsets_from_lengths, rel_err

E, H, D = 16, 2, 8


@pytest.fixture
def cpu_rule(monkeypatch, dispatch_choices):
    """The rule on (conftest turns it off for the other tests), applying to CPU graphs, and a cheap compile."""
    monkeypatch.setattr(cost_rule, "_on_cuda", lambda example_inputs: True)
    monkeypatch.setattr(_compat, "compile_fx", lambda gm, example_inputs, patches=None: _compat.aot_eager(
        gm, example_inputs))
    torch._dynamo.reset()
    with hstu_inductor.config.patch(cost_rule="auto"):
        yield dispatch_choices
    torch._dynamo.reset()


def _batch(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    off = offsets_from_lengths(lengths)
    x = torch.randn(int(off[-1]), E, generator=g)
    nt = torch.tensor([min(2, n) for n in lengths])
    return x, off, nt


def _layer():
    torch.manual_seed(0)
    return STULayer(E, H, D, D).eval()


def _work(lengths, n):
    return len(lengths) * H * n * n


def _run(model, layer, lengths, n, seed, grad=False):
    x, off, nt = _batch(lengths, seed)
    if not grad:
        with torch.no_grad(), collecting() as report:
            out = model(x, off, n, nt)
        with torch.no_grad():
            ref = layer(x, off, n, nt)
        assert rel_err(out, ref) < 1e-5
        return report
    xx = x.clone().requires_grad_()
    with collecting() as report:
        out = model(xx, off, n, nt)
    (dx,) = torch.autograd.grad(out, xx, out.detach())
    xr = x.clone().requires_grad_()
    ref = layer(xr, off, n, nt)
    (dref,) = torch.autograd.grad(ref, xr, ref.detach())
    assert rel_err(out, ref) < 1e-5 and rel_err(dx, dref) < 1e-5
    return report


@pytest.mark.parametrize("above", [False, True])
def test_static_graph_decided_at_compile(cpu_rule, above):
    lengths, n = [5, 0, 7, 3], 7
    layer = _layer()
    work = _work(lengths, n)
    with hstu_inductor.config.patch(cost_rule_min_work={"infer": work if above else work + 1}):
        report = _run(torch.compile(layer, backend="hstu", dynamic=False), layer, lengths, n, seed=1)
    assert len(report.cost_rule) == 1, str(report)
    if above:
        assert report.counts["attention"] == 1 and report.cost_rule[0].startswith("rewritten"), str(report)
    else:
        assert report.counts == {"attention": 0, "preprocess": 0, "output": 0}, str(report)
        line = report.cost_rule[0]
        assert line.startswith("kept stock Inductor's code") and f"work {work:,}" in line and "attention 1" in line
    assert "cost rule: " in str(report)
    assert cpu_rule == []  # static: no per-call dispatch


def test_dynamic_graph_dispatches_per_call(cpu_rule):
    layer = _layer()
    model = torch.compile(layer, backend="hstu", dynamic=True)
    sizes = [([5, 0, 7, 3], 7), ([6, 6, 2, 6, 1, 4], 6), ([9, 8, 9], 9), ([3, 3], 3), ([12, 11, 4, 12, 9], 12)]
    threshold = _work(*sizes[2])  # the third size exactly at the threshold: rewritten
    with hstu_inductor.config.patch(cost_rule_min_work={"infer": threshold}):
        reports = [_run(model, layer, lengths, n, seed=i) for i, (lengths, n) in enumerate(sizes)]
    compiled = [r for r in reports if r.cost_rule]
    assert compiled and all("per call" in r.cost_rule[0] for r in compiled), [str(r) for r in reports]
    assert compiled[0].counts["attention"] == 1
    expect = [_work(lengths, n) < threshold for lengths, n in sizes]
    assert cpu_rule[-len(sizes) + 1:] == expect[1:], (cpu_rule, expect)  # the first call may be the static compile
    assert True in cpu_rule and False in cpu_rule


def test_training_graph_uses_the_train_threshold(cpu_rule):
    lengths, n = [5, 0, 7, 3], 7
    layer = _layer().train()
    with hstu_inductor.config.patch(cost_rule_min_work={"infer": 0, "train": 10 ** 9}):
        report = _run(torch.compile(layer, backend="hstu", dynamic=False), layer, lengths, n, seed=2, grad=True)
    assert report.counts["attention"] == 0 and "train" in report.cost_rule[0], str(report)


def test_rule_off(cpu_rule):
    lengths, n = [5, 0, 7, 3], 7
    layer = _layer()
    with hstu_inductor.config.patch(cost_rule="off", cost_rule_min_work={"infer": 10 ** 9}):
        report = _run(torch.compile(layer, backend="hstu", dynamic=False), layer, lengths, n, seed=3)
    assert report.counts["attention"] == 1 and report.cost_rule == []


def test_rule_needs_cuda_and_no_cudagraphs():
    x = torch.zeros(2)
    assert not cost_rule._on_cuda([x, 3])
    g = torch.fx.symbolic_trace(torch.nn.Identity())
    assert cost_rule.decide(g, [x], cudagraphs=False) is None  # CPU inputs
    assert cost_rule.decide(g, [x], cudagraphs=True) is None


def test_config_validates_thresholds():
    with pytest.raises(ValueError, match="cost_rule_min_work"):
        with hstu_inductor.config.patch(cost_rule_min_work={"infer": -1}):
            pass
    with pytest.raises(ValueError, match="cost_rule"):
        with hstu_inductor.config.patch(cost_rule="sometimes"):
            pass


def test_symbolic_work_bounded_above_threshold_compiles_once(cpu_rule):
    # Dynamo assumes dynamic sizes >= 2: with N fixed, B*H*N^2 >= 2*H*N^2, so a threshold at that bound needs no
    # per-call choice (this path once formatted the symbolic work as an int and failed the compile)
    lengths, n = [5, 0, 7, 3], 7
    layer = _layer()
    x, off, nt = _batch(lengths, seed=4)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(off, 0)
    torch._dynamo.mark_dynamic(nt, 0)
    with hstu_inductor.config.patch(cost_rule_min_work={"infer": 2 * H * n * n}), torch.no_grad(), \
            collecting() as report:
        out = torch.compile(layer, backend="hstu")(x, off, n, nt)
    assert rel_err(out, layer(x, off, n, nt)) < 1e-5
    assert report.counts["attention"] == 1 and len(report.cost_rule) == 1, str(report)
    assert report.cost_rule[0].startswith("rewritten") and f"at least {2 * H * n * n:,}" in report.cost_rule[0]
    assert cpu_rule == []
