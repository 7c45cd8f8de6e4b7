"""``hstu_inductor.explain``: per-call counts, readable report, near misses."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hstu_inductor
from _helpers import rel_err, small_hstu_batch, small_hstu_model

ALL_OFF = {"attention": False, "preprocess": False, "output": False}
KINDS = ("attention", "preprocess", "output")


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model_and_batch():
    ids, off, nt, _ = small_hstu_batch()
    return small_hstu_model(), ids, off, nt


@pytest.fixture(scope="module")
def off_report():
    """One explain() of HSTUModel with every pattern off (shared: compiling is the slow part)."""
    model, ids, off, nt = _model_and_batch()
    torch._dynamo.reset()
    with hstu_inductor.config.patch(patterns=ALL_OFF):
        report = hstu_inductor.explain(model, ids, off, nt)
    return report, model(ids, off, nt)


def test_explain_patterns_off_counts_zero_and_output_matches(off_report):
    report, eager = off_report
    assert isinstance(report, hstu_inductor.RewriteReport)
    assert report.counts == {k: 0 for k in KINDS}
    assert report.details == []
    assert report.graphs >= 1
    assert rel_err(report.output, eager) < 1e-4


def test_explain_counts_are_per_call():
    # backend="hstu_eager": the same rewrites and report without generating code (the default
    # backend's explain is exercised by the other tests here)
    model, ids, off, nt = _model_and_batch()
    first = hstu_inductor.explain(model, ids, off, nt, backend="hstu_eager")
    second = hstu_inductor.explain(model, ids, off, nt, backend="hstu_eager")
    assert first is not second
    assert first.counts == second.counts
    assert first.graphs == second.graphs
    assert len(first.near_misses) == len(second.near_misses)
    assert len(first.details) == len(second.details)
    assert set(first.counts) == set(KINDS)
    assert all(isinstance(v, int) and v >= 0 for v in first.counts.values())
    # whatever was rewritten, the compiled result is still the model's
    assert rel_err(second.output, model(ids, off, nt)) < 1e-4
    # A third call on a different callable starts from scratch as well.
    third = hstu_inductor.explain(lambda x: x.sin() * 2, torch.randn(5))
    assert third.counts == {k: 0 for k in KINDS} and third.graphs == 1 and third.near_misses == []


def test_explain_str_is_readable(off_report):
    report, _ = off_report
    text = str(report)
    assert isinstance(text, str) and text.count("\n") >= 3
    assert "hstu_inductor" in text and "graph" in text
    for kind in KINDS:
        assert kind in text
    assert "near misses" in text
    assert "<" not in text.splitlines()[0]  # not a bare object repr


def test_explain_plain_function_and_kwargs():
    def fn(x, w, *, bias):
        return F.silu(x @ w + bias)

    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(4, 6, generator=g), torch.randn(6, 3, generator=g), torch.randn(3, generator=g)
    report = hstu_inductor.explain(fn, x, w, bias=b)
    assert report.counts == {k: 0 for k in KINDS}
    assert report.graphs == 1
    assert rel_err(report.output, fn(x, w, bias=b)) < 1e-5


def test_explain_grad_mode_toggle_is_a_near_miss_and_matches_eager():
    def fn(x, w):
        y = x @ w
        with torch.no_grad():
            s = y.abs().mean()
        return y.sin() / (1 + s)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, generator=g)
    w = torch.randn(8, 3, generator=g, requires_grad=True)
    report = hstu_inductor.explain(fn, x, w)
    assert report.counts == {k: 0 for k in KINDS}
    assert len(report.near_misses) >= 1
    kind, reason = report.near_misses[0]
    assert "grad" in reason
    assert "near misses (" in str(report) and reason in str(report)
    expected = fn(x, w)
    assert rel_err(report.output, expected) < 1e-5
    (g_compiled,) = torch.autograd.grad(report.output.sum(), w)
    (g_eager,) = torch.autograd.grad(expected.sum(), w)
    assert rel_err(g_compiled, g_eager) < 1e-5


def test_explain_does_not_leak_into_later_compiles():
    # After explain returns, compiling with the backend does not keep adding to the old report.
    report = hstu_inductor.explain(lambda x: x.cos() + 1, torch.randn(3))
    snapshot = (dict(report.counts), report.graphs, list(report.near_misses))
    torch._dynamo.reset()
    torch.compile(lambda x: x.tan() - 1, backend="hstu")(torch.randn(3))
    assert (report.counts, report.graphs, report.near_misses) == snapshot
