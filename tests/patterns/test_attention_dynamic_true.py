"""``torch.compile(dynamic=True)``: every dim symbolic (H and D included), floats passed as inputs.

Feature dims are taken as constants with a guard (``config.specialize_features``); floats that
Dynamo promoted to inputs are specialised with a run-time assert (``patterns/float_inputs.py``).
"""
from __future__ import annotations

import pytest
import torch

from hstu_inductor.testing import spellings_attention as sp
from hstu_inductor.report import collecting

from test_attention_helpers import grad_leaves, spelling_inputs

import importlib.util
from _helpers import REWRITE_BACKEND

HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
if HAS_FBGEMM:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm, which the fbgemm spellings call)
# Every spelling of the table; `make test` runs every other one (each is also compiled statically in
# test_attention_spellings.py, and the grammar's fixed sample and the metamorphic tests compile others
# under dynamic=True), `-m slow` the rest.
REWRITTEN = [pytest.param(name, marks=pytest.mark.slow) if k % 2 else name for k, name in enumerate(sp.SPELLINGS)]


@pytest.mark.parametrize("name", REWRITTEN)
def test_dynamic_true_rewritten_and_equal(name):
    _, _, _, needs_fbgemm, differentiable, _ = sp.SPELLINGS[name]
    if needs_fbgemm and not HAS_FBGEMM:
        pytest.skip("fbgemm_gpu not importable")
    fn, args = spelling_inputs(name, requires_grad=differentiable)
    torch._dynamo.reset()
    with collecting() as report:
        out = torch.compile(fn, backend=REWRITE_BACKEND, dynamic=True)(*args)
    assert report.counts["attention"] >= 1, report.near_misses
    assert not [r for k, r in report.near_misses if k == "attention"], report.near_misses
    ref = fn(*args)
    assert ((out - ref).norm() / ref.norm()) < 1e-5
    if not differentiable:
        return
    leaves = grad_leaves(args)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, leaves, g)
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()) < 1e-4


def test_changed_float_global_never_silently_stale(monkeypatch):
    """A float Dynamo passes as an input was specialised: after it changes, a call either raises
    naming it or computes with the new value (a recompile), never with the old one."""
    fn, args = spelling_inputs("einsum_index_put_tril")
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=REWRITE_BACKEND, dynamic=True)
    with collecting() as report:
        compiled(*args)
    assert report.counts["attention"] >= 1
    monkeypatch.setattr(sp, "ALPHA", 0.25)
    try:
        out = compiled(*args)
    except Exception as e:  # the run-time assert
        assert "ALPHA" in str(e) or "specialised" in str(e), e
    else:
        ref = fn(*args)
        assert ((out - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("name", ["anti_causal", "leaky_causal", "length_normalised"])
def test_dynamic_true_near_misses_untouched(name):
    fn = sp.NEAR_MISSES[name][0]
    _, args = spelling_inputs("einsum_index_put_tril")
    torch._dynamo.reset()
    with collecting() as report:
        out = torch.compile(fn, backend=REWRITE_BACKEND, dynamic=True)(*args)
    assert report.counts["attention"] == 0 and report.near_misses
    ref = fn(*args)
    assert ((out - ref).norm() / ref.norm()) < 1e-5
