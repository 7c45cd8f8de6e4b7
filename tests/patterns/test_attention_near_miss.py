"""Look-alikes of HSTU attention are left to stock Inductor, reported as near misses, and give
eager results."""
from __future__ import annotations

import pytest
import torch

import hstu_inductor
from hstu_inductor.testing import spellings_attention as sp
from hstu_inductor.report import collecting

from test_attention_helpers import make_inputs
from _helpers import REWRITE_BACKEND

LENGTHS = [5, 0, 8, 1, 3]


@pytest.mark.parametrize("name", list(sp.NEAR_MISSES))
def test_near_miss_not_rewritten(name, fresh_dynamo):
    fn, reason = sp.NEAR_MISSES[name]
    extra = None
    if name == "data_mask":
        g = torch.Generator().manual_seed(3)
        extra = (torch.rand(len(LENGTHS), sp.N, sp.N, generator=g) > 0.3,)
    scale, inputs = sp.NEAR_MISS_INPUTS.get(name, (None, "qkv"))
    args = make_inputs(LENGTHS, seed=2, extra=extra, scale=scale, inputs=inputs)
    if name == "dropout":  # same random stream as eager, so results can be compared
        ctx = torch._inductor.config.patch(fallback_random=True)
    else:
        ctx = torch._inductor.config.patch({})
    with ctx, torch.no_grad():
        torch.manual_seed(0)
        report = hstu_inductor.explain(fn, *args, backend=REWRITE_BACKEND)
        torch.manual_seed(0)
        expected = fn(*args)
    assert report.counts["attention"] == 0, report
    misses = [r for kind, r in report.near_misses if kind == "attention"]
    assert misses and any(reason in r for r in misses), report
    got = report.output
    if isinstance(expected, tuple):
        expected, got = expected[0], got[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def _nested_no_output_size(q, k, v, offsets, nt=None, s=None):
    """``nested_padded`` with ``to_padded_tensor(0.0)``: no output_size, so NJT pads to its own length (L
    here, no max seqlen cached). A static L is the traced width, and the pad is canonicalised like one with
    that output_size; a symbolic one (``dynamic=True``) has no node to read, and the pads are left alone."""
    pads = [torch.nested.nested_tensor_from_jagged(t, offsets).to_padded_tensor(0.0) for t in (q, k, v)]
    n = pads[0].shape[1]
    p = torch.tril(torch.nn.functional.silu(sp.ALPHA * torch.einsum("bnhd,bmhd->bhnm", pads[0], pads[1]))) / n
    return sp._unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, pads[2]), offsets, q.shape[0])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_width", "symbolic_width"])
def test_nested_training_without_output_size(dynamic, fresh_dynamo):
    """A nested tensor that stays in the graph (its pad width symbolic) loses autograd in the ATen
    retrace (a detach appears): in training the graph is not retraced. With a static width the pad is
    canonicalised and the attention rewritten. Gradients are eager's either way."""
    args = make_inputs(LENGTHS, requires_grad=True, seed=4)
    args_e = make_inputs(LENGTHS, requires_grad=True, seed=4)
    compiled = torch.compile(_nested_no_output_size, backend=REWRITE_BACKEND, dynamic=dynamic)
    with collecting() as report:
        out = compiled(*args)
    if dynamic:
        assert report.counts["attention"] == 0
        assert any(kind == "graph" and "detach" in r for kind, r in report.near_misses), report
    else:
        assert report.counts["attention"] == 1, report
    ref = _nested_no_output_size(*args_e)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, args[:3], g), torch.autograd.grad(ref, args_e[:3], g)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_mask_of_wrong_length_constant(fresh_dynamo):
    """A causal mask built for a different N than the padding is still proven on in-sequence
    positions (padding rows are zero), while a window constant changes the meaning."""
    def fn(q, k, v, offsets, nt=None, s=None):
        qp, kp, vp = (sp._pad_index_put(t, offsets) for t in (q, k, v))
        i = torch.arange(sp.N)
        win = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] <= 2)
        p = torch.nn.functional.silu(sp.ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) * win / sp.N
        return sp._unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])

    args = make_inputs(LENGTHS, seed=5)
    with torch.no_grad():
        report = hstu_inductor.explain(fn, *args, backend=REWRITE_BACKEND)
        expected = fn(*args)
    # raw-position window of 2 == HSTU max_attn_len=2 without targets/contextual: rewritten
    assert report.counts["attention"] == 1, report
    assert "max_attn_len=2" in report.details[0][1]
    torch.testing.assert_close(report.output, expected, rtol=1e-4, atol=1e-5)


def test_row_scale_after_unpad_not_per_row_stays_outside(fresh_dynamo):
    """A scale after the unpad that is not the op's per-row scale (rows reversed) is not absorbed:
    the attention is still rewritten (scale 1/N) and the user's multiply runs on its output."""
    def fn(q, k, v, offsets, nt=None, s=None):
        qp, kp, vp = (sp._pad_index_put(t, offsets) for t in (q, k, v))
        p = torch.tril(torch.nn.functional.silu(sp.ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp))) / sp.N
        out = sp._unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])
        return out * s.flip(0)[:, None, None]

    args = make_inputs(LENGTHS, scale="row", seed=6)
    with torch.no_grad():
        report = hstu_inductor.explain(fn, *args, backend=REWRITE_BACKEND)
        expected = fn(*args)
    assert report.counts["attention"] == 1, report
    assert "scale=1/N" in report.details[0][1], report
    torch.testing.assert_close(report.output, expected, rtol=1e-4, atol=1e-5)
