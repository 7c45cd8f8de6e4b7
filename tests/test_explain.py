"""``hstu_inductor.explain``: per-call counts, readable report, near misses."""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

import hstu_inductor
from _helpers import offsets_from_lengths, rel_err, small_hstu_batch, small_hstu_model

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


def test_explain_dynamic_true_counts_each_rewrite_once():
    # dynamic=True: Dynamo passes Python floats as inputs; once the rewrite specialises one, AOTAutograd
    # makes Dynamo restart the frame's analysis and call the backend a second time. Only the compile
    # that is kept may be counted (it used to report 2 graphs and every rewrite twice).
    model, ids, off, nt = _model_and_batch()
    report = hstu_inductor.explain(model, ids, off, nt, dynamic=True, backend="hstu_eager")
    assert report.counts == {"attention": 1, "preprocess": 1, "output": 1}, report
    assert report.graphs == 1  # and each rewrite listed once (silu(u): fuse_u_silu joined the two blocks)
    assert [kind for kind, _ in report.details] == ["attention", "preprocess", "output", "silu(u)"], report
    assert report.graph_breaks == [] and "graph breaks: none" in str(report)
    assert rel_err(report.output, model(ids, off, nt)) < 1e-4


# A one-layer STU model in plain torch (silu(u) applied late, after the attention, as some public code
# does) whose attention helper hits two graph breaks: a print() on entry, which splits the preprocess
# block (the uvqk split is before it, silu(u) after it), and a call to a torch.compiler.disable'd
# function between the scores silu(q k^T) and their product with v, which splits the attention.
@torch.compiler.disable
def _host_side(s):
    return s


def _padded(t, offsets, N):
    rows = torch.arange(N)
    valid = rows[None, :] < (offsets[1:] - offsets[:-1])[:, None]
    table = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
    return table[torch.where(valid, offsets[:-1, None] + rows[None, :], t.shape[0])]


def _broken_attention(q, k, v, offsets, N, alpha):
    L = q.shape[0]
    print("attention rows:", L)  # BREAK: print
    qp, kp, vp = (_padded(t, offsets, N).transpose(1, 2) for t in (q, k, v))
    s = F.silu(torch.einsum("bhnd,bhmd->bhnm", qp, kp) * alpha) / N
    lengths, pos = offsets[1:] - offsets[:-1], torch.arange(N)
    valid = (pos[:, None] >= pos[None, :]) & (pos[None, None, :] < lengths[:, None, None])
    s = _host_side(s * valid[:, None])  # BREAK: disabled
    out = torch.einsum("bhnm,bhmv->bnhv", s, vp)
    seq = torch.searchsorted(offsets, torch.arange(L), right=True) - 1
    return out[seq, torch.arange(L) - offsets[seq]]


class _BrokenSTULayer(torch.nn.Module):
    def __init__(self, E=16, H=2, D=8):
        super().__init__()
        self.H, self.D = H, D
        self.ln, self.uvqk = torch.nn.LayerNorm(E), torch.nn.Linear(E, 4 * H * D)
        self.norm, self.proj = torch.nn.LayerNorm(H * D), torch.nn.Linear(H * D, E)

    def forward(self, x, offsets, N):
        L, H, D = x.shape[0], self.H, self.D
        u, v, q, k = self.uvqk(self.ln(x)).split(H * D, dim=-1)
        a = _broken_attention(q.view(L, H, D), k.view(L, H, D), v.view(L, H, D), offsets, N, 1 / math.sqrt(D))
        return x + self.proj(F.silu(u) * self.norm(a.reshape(L, H * D)))


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(marker))


def test_explain_reports_graph_breaks_with_location_reason_and_split(caplog, capsys):
    from hstu_inductor import graph_breaks

    graph_breaks.reset_warnings()
    g = torch.Generator().manual_seed(4)
    model = _BrokenSTULayer()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3, generator=g)
    off = offsets_from_lengths([3, 0, 8, 1, 5])
    x = torch.randn(17, 16, generator=g)
    with caplog.at_level(logging.WARNING, logger="hstu_inductor"):
        report = hstu_inductor.explain(model, x, off, 8, backend="hstu_eager")
    assert rel_err(report.output, model(x, off, 8)) < 1e-5
    # the breaks split the preprocess and the attention; the output block after them is still rewritten
    assert report.counts == {"attention": 0, "preprocess": 0, "output": 1}, report
    where = {b.where: b for b in report.graph_breaks}
    printed, disabled = f"{__file__}:{_line_of('# BREAK: print')}", f"{__file__}:{_line_of('# BREAK: disabled')}"
    assert list(where) == [printed, disabled], report
    assert "print" in where[printed].reason and "print" in where[printed].hint
    assert where[printed].splits_candidate and "preprocess" in where[printed].effect
    assert "disable" in where[disabled].reason and "torch.compiler.disable" in where[disabled].hint
    assert where[disabled].splits_candidate and "silu(q k^T)" in where[disabled].effect
    text = str(report)
    assert "graph breaks (2):" in text and f"! {disabled}: " in text and "splits an attention candidate" in text
    # the backend's own warning (also under plain torch.compile): once per break that splits a candidate
    warned = [r.getMessage() for r in caplog.records if r.name == "hstu_inductor" and r.levelno == logging.WARNING]
    assert len(warned) == 2, warned
    assert f"at {printed} splits an STU preprocess" in warned[0] and f"at {disabled} splits an attention" in warned[1]
    # Dynamo's own graph-break log stays quiet unless the user turned it on
    assert "Graph break in user code" not in capsys.readouterr().err
