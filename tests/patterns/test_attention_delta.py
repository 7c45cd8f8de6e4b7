"""Cached (delta) attention: spellings rewritten to ``hstu.delta_attention`` (inference only),
near misses left alone with reasons, and the ``torch.export`` path."""
from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import hstu_inductor
import hstu_inductor.export as hx
from hstu_inductor.testing import spellings_attention as sp
from hstu_inductor.reference import hstu_mha

from test_attention_helpers import rewritten_graph, summarize
from _helpers import REWRITE_BACKEND

H, DQ, DV, D = 2, 4, 3, 2
LENGTHS = [5, 2, 8, 3]  # every n_b >= D


def delta_inputs(lengths, need_targets=False, scale=None, seed=0, requires_grad=False):
    """``(full q, last-row index, (delta_q, k, v, offsets, num_targets, attn_scale))``."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    L, B = int(offsets[-1]), len(lengths)
    q = torch.randn(L, H, DQ, generator=g)
    k = torch.randn(L, H, DQ, generator=g).requires_grad_(requires_grad)
    v = torch.randn(L, H, DV, generator=g).requires_grad_(requires_grad)
    last = torch.cat([torch.arange(int(e) - D, int(e)) for e in offsets[1:]])
    nt = None
    if need_targets:
        nt = torch.tensor([int(torch.randint(0, n + 1, (), generator=g)) for n in lengths], dtype=torch.int64)
    s = None
    if scale == "scalar":
        s = torch.rand((), generator=g) + 0.5
    elif scale == "row":
        s = torch.rand(B * D, generator=g) + 0.5
    delta_q = q[last].clone().requires_grad_(requires_grad)
    return q, last, (delta_q, k, v, offsets, nt, s)


def _full_rows(q, last, args, scale, w, c):
    """Rows ``n_b-D..n_b-1`` of the full reference attention (the delta semantics)."""
    _, k, v, offsets, nt, s = args
    if scale == "row":
        full_s = torch.ones(q.shape[0])
        full_s[last] = s
        s = full_s
    return hstu_mha(sp.N, sp.ALPHA, q, k, v, offsets, num_targets=nt, attn_scale=s, max_attn_len=w,
                    contextual_seq_len=c)[last]


@pytest.mark.parametrize("name", list(sp.DELTA_SPELLINGS))
def test_delta_spelling_rewritten(name, fresh_dynamo):
    fn, need_nt, scale, w, c = sp.DELTA_SPELLINGS[name]
    q, last, args = delta_inputs(LENGTHS, need_nt, scale, seed=hash(name) % 1000)
    with torch.no_grad():
        report = hstu_inductor.explain(fn, *args, backend=REWRITE_BACKEND)
        expected = fn(*args)
    assert report.counts["attention"] == 1, report
    assert "delta (cached) silu attention" in report.details[0][1]
    torch.testing.assert_close(report.output, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(expected, _full_rows(q, last, args, scale, w, c), rtol=1e-4, atol=1e-5)
    gm, _ = rewritten_graph(fn, *args)
    code = summarize(gm)
    assert "hstu.delta_attention.default" in code, code
    assert "aten.bmm" not in code and "aten.index_put" not in code, code


def test_delta_graph_reference(fresh_dynamo):
    """The rewritten graph of the reference spelling: one op on the inputs, nothing else left."""
    _, _, args = delta_inputs(LENGTHS, seed=7)
    gm, _ = rewritten_graph(sp.delta_reference, *args[:4])
    assert summarize(gm) == (
        "delta_attention_default = hstu.delta_attention.default(arg1_1, arg2_1, arg3_1, arg0_1, 8, 0.5, None, None, 0, 0)"
    ), summarize(gm)


@pytest.mark.parametrize("name", list(sp.DELTA_NEAR_MISSES))
def test_delta_near_miss(name, fresh_dynamo):
    fn, reason = sp.DELTA_NEAR_MISSES[name]
    _, _, args = delta_inputs(LENGTHS, seed=11)
    with torch.no_grad():
        report = hstu_inductor.explain(fn, *args, backend=REWRITE_BACKEND)
        expected = fn(*args)
    assert report.counts["attention"] == 0, report
    misses = [r for kind, r in report.near_misses if kind == "attention"]
    assert any(reason in r for r in misses), report
    torch.testing.assert_close(report.output, expected, rtol=1e-4, atol=1e-5)


def test_delta_training_left_alone(fresh_dynamo):
    """Grad mode on, inputs requiring grad: the op has no autograd, so nothing is rewritten and
    gradients stay those of eager."""
    _, _, args = delta_inputs(LENGTHS, seed=12, requires_grad=True)
    _, _, args_e = delta_inputs(LENGTHS, seed=12, requires_grad=True)
    report = hstu_inductor.explain(sp.delta_reference, *args, backend=REWRITE_BACKEND)
    assert report.counts["attention"] == 0, report
    assert any("delta attention op is inference-only" in r for _, r in report.near_misses), report
    ref = sp.delta_reference(*args_e)
    torch.testing.assert_close(report.output, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(report.output, args[:3], g)
    want = torch.autograd.grad(ref, args_e[:3], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


class _Cached(torch.nn.Module):
    def forward(self, delta_q, k, v, offsets):
        return sp.delta_reference(delta_q, k, v, offsets)


class _CachedBmm(torch.nn.Module):
    def forward(self, delta_q, k, v, offsets, num_targets, attn_scale):
        return sp.delta_bmm_targets_scale(delta_q, k, v, offsets, num_targets, attn_scale)


@pytest.mark.parametrize("mod,need_nt,scale", [(_Cached, False, None), (_CachedBmm, True, "row")])
def test_delta_export(mod, need_nt, scale):
    """``torch.export`` with dynamic rows/batch: the program is rewritten to one
    ``hstu.delta_attention`` and stays correct at another batch shape."""
    _, _, args = delta_inputs(LENGTHS, need_nt, scale, seed=21)
    args = tuple(a for a in args if a is not None)
    dyn = tuple({0: Dim.AUTO} for _ in args)
    ep = torch.export.export(mod(), args, dynamic_shapes=dyn)
    new_ep, report = hx.rewrite_exported_program(ep)
    assert report.counts["attention"] == 1, report
    targets = [str(n.target) for n in new_ep.graph.nodes if n.op == "call_function"]
    assert "hstu.delta_attention.default" in targets, new_ep.graph
    assert not any("bmm" in t or "einsum" in t for t in targets), targets
    _, _, args2 = delta_inputs([3, 8, 2], need_nt, scale, seed=22)
    args2 = tuple(a for a in args2 if a is not None)
    with torch.no_grad():
        torch.testing.assert_close(new_ep.module()(*args2), mod()(*args2), rtol=1e-4, atol=1e-5)
