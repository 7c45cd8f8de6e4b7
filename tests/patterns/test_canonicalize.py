"""The Dynamo-graph canonicalisation (patterns/canonicalize.py): nested-tensor pads with an
output_size (or a static traced width) become ``reference.jagged_to_padded``, exactly (values and gradients); anything else
that touches a nested tensor is left as the user wrote it."""
from __future__ import annotations

import pytest
import torch

import hstu_inductor
from hstu_inductor.testing import spellings_attention as sp
from hstu_inductor.patterns.canonicalize import canonicalize
from hstu_inductor.reference.jagged import jagged_to_padded
from hstu_inductor.report import collecting

from test_attention_helpers import grad_leaves, make_inputs
from _helpers import REWRITE_BACKEND


def _offsets(lengths, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)


def _njt_pad(values, offsets, n, padding):
    nt = torch.nested.nested_tensor_from_jagged(values, offsets)
    return nt.to_padded_tensor(padding, output_size=(offsets.numel() - 1, n, *values.shape[1:]))


# (lengths, extra rows after offsets[-1], N, padding, feature shape, offsets dtype, dtype)
IN_CONTRACT = [
    ([5, 0, 8, 1, 3], 0, 8, 0.0, (2, 4), torch.int64, torch.float32),     # empty, length == N
    ([5, 0, 8, 1, 3], 0, 9, -2.5, (3,), torch.int64, torch.float64),      # non-zero padding
    ([0, 0], 0, 4, 1.0, (), torch.int64, torch.float64),                  # all empty, 1-D values
    ([3, 7, 2], 0, 7, 3.0, (), torch.int32, torch.float32),               # int32 offsets
    ([4, 4], 0, 4, 7.0, (2, 3, 2), torch.int64, torch.float16),
]
# Outside the jagged contract eager NJT's backward raises; the forward must still agree.
OUT_OF_CONTRACT = [
    ([5, 0, 9, 1, 3], 0, 8, 0.0, (2, 4), torch.int64, torch.float32),     # length > N: truncated
    ([5, 0, 8, 1, 3], 4, 8, 0.5, (3,), torch.int64, torch.float32),       # rows past offsets[-1]
    ([2, 3], 0, 0, 1.0, (2,), torch.int64, torch.float32),                # N = 0
]


@pytest.mark.parametrize("case", IN_CONTRACT + OUT_OF_CONTRACT)
@pytest.mark.parametrize("seed", [0, 1])
def test_jagged_to_padded_is_njt_to_padded_tensor(case, seed):
    lengths, extra, n, padding, feat, odt, dtype = case
    g = torch.Generator().manual_seed(seed)
    offsets = _offsets(lengths, odt)
    values = torch.randn(int(offsets[-1]) + extra, *feat, generator=g, dtype=dtype)
    v_njt = values.clone().requires_grad_(True)
    v_ref = values.clone().requires_grad_(True)
    want = _njt_pad(v_njt, offsets, n, padding)
    got = jagged_to_padded(v_ref, offsets, n, padding)
    assert got.dtype == want.dtype and torch.equal(got, want)
    if case in IN_CONTRACT:
        grad = torch.randn(want.shape, generator=g, dtype=dtype)
        (gw,) = torch.autograd.grad(want, v_njt, grad)
        (gg,) = torch.autograd.grad(got, v_ref, grad)
        assert torch.equal(gg, gw)


def _dynamo_graph(fn, *args, dynamic=None):
    """Dynamo's torch-level graph of ``fn`` (single frame) and its example inputs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def _nested_pads(q, offsets):
    B = offsets.numel() - 1
    nt = torch.nested.nested_tensor_from_jagged(q, offsets)
    a = nt.to_padded_tensor(0.0, output_size=(B, sp.N, *q.shape[1:]))
    b = torch.nested.to_padded_tensor(nt, -1.5, (B, sp.N + 2, *q.shape[1:]))
    return a.sin() + b[:, : sp.N].cos()


def test_pads_replaced_exactly_with_grads():
    q = torch.randn(17, 2, 4, requires_grad=True)
    offsets = _offsets([5, 0, 8, 1, 3])
    gm, inputs = _dynamo_graph(_nested_pads, q, offsets)
    canon = canonicalize(gm)
    assert canon is not gm
    assert _targets(canon).count(jagged_to_padded) == 2
    assert "to_padded_tensor" not in _targets(canon) and torch.nested.to_padded_tensor not in _targets(canon)
    assert not any("nested_view" in str(t) for t in _targets(canon)), canon.graph  # NJT node dead: removed
    assert "to_padded_tensor" in _targets(gm)  # the original graph is untouched
    # fresh random inputs, not the compile-time ones
    q2 = torch.randn(17, 2, 4, requires_grad=True)
    q3 = q2.detach().clone().requires_grad_(True)
    args = [q2 if a is q else a for a in inputs]
    (got,) = canon(*args)
    want = _nested_pads(q3, offsets)
    assert torch.equal(got, want)
    grad = torch.randn_like(want)
    assert torch.equal(torch.autograd.grad(got, q2, grad)[0], torch.autograd.grad(want, q3, grad)[0])


def test_symbolic_batch_replaced():
    """Dynamic B/L: output_size[0] is a SymInt expression, proven equal to offsets.numel() - 1."""
    q = torch.randn(17, 2, 4)
    offsets = _offsets([5, 0, 8, 1, 3])
    torch._dynamo.mark_dynamic(q, 0)
    torch._dynamo.mark_dynamic(offsets, 0)
    gm, _ = _dynamo_graph(sp.nested_padded, q, q.clone(), q.clone(), offsets)
    assert _targets(canonicalize(gm)).count(jagged_to_padded) == 3


def _cached_max_seqlen(q, offsets):
    """No output_size: NJT pads to the max seqlen given at construction (8), the traced output's width."""
    return torch.nested.nested_tensor_from_jagged(q, offsets, max_seqlen=8).to_padded_tensor(0.0)


def test_pad_to_cached_max_seqlen_replaced_exactly_with_grads():
    q = torch.randn(17, 2, 4, requires_grad=True)
    offsets = _offsets([5, 0, 8, 1, 3])
    gm, inputs = _dynamo_graph(_cached_max_seqlen, q, offsets)
    canon = canonicalize(gm)
    assert _targets(canon).count(jagged_to_padded) == 1, canon.graph
    q2 = torch.randn(17, 2, 4, requires_grad=True)
    q3 = q2.detach().clone().requires_grad_(True)
    (got,) = canon(*[q2 if a is q else a for a in inputs])
    want = _cached_max_seqlen(q3, offsets)
    assert got.shape == (5, 8, 2, 4) and torch.equal(got, want)
    grad = torch.randn_like(want)
    assert torch.equal(torch.autograd.grad(got, q2, grad)[0], torch.autograd.grad(want, q3, grad)[0])


def _wrong_batch(q, offsets):
    return torch.nested.nested_tensor_from_jagged(q, offsets).to_padded_tensor(0.0, output_size=(9, 8, 2, 4))


def _wrong_features(q, offsets):
    # NJT reads only output_size[1]; the others must still be B and the feature sizes.
    return torch.nested.nested_tensor_from_jagged(q, offsets).to_padded_tensor(0.0, output_size=(5, 8, 8))


def _ragged_dim_2(q, offsets):
    nt = torch.nested.nested_tensor_from_jagged(q.transpose(0, 1), offsets, jagged_dim=2)
    return nt.to_padded_tensor(0.0, output_size=(5, 2, 8, 4))


def _integer_values(q, offsets):
    nt = torch.nested.nested_tensor_from_jagged((q * 10).long(), offsets)
    return nt.to_padded_tensor(0, output_size=(5, 8, 2, 4))


@pytest.mark.parametrize("fn", [_wrong_batch, _wrong_features, _ragged_dim_2, _integer_values])
def test_other_nested_uses_left_alone(fn):
    q = torch.randn(17, 2, 4)
    offsets = _offsets([5, 0, 8, 1, 3])
    try:
        fn(q, offsets)
    except Exception as e:  # e.g. a spelling this torch's NJT does not support in eager
        pytest.skip(f"eager NJT rejects it: {e}")
    gm, _ = _dynamo_graph(fn, q, offsets)
    assert canonicalize(gm) is gm


def _nt_other_user(q, offsets):
    nt = torch.nested.nested_tensor_from_jagged(q, offsets)
    padded = nt.to_padded_tensor(0.0, output_size=(5, 8, 2, 4))
    return padded.sum() + (nt * 2.0).values().sum(), padded


def test_nested_tensor_with_other_users_kept():
    """The pad is replaced; the NJT stays for its other user."""
    q = torch.randn(17, 2, 4)
    offsets = _offsets([5, 0, 8, 1, 3])
    gm, inputs = _dynamo_graph(_nt_other_user, q, offsets)
    canon = canonicalize(gm)
    targets = _targets(canon)
    assert targets.count(jagged_to_padded) == 1 and "to_padded_tensor" not in targets
    assert any("nested_view" in str(t) for t in targets)
    q2 = torch.randn(17, 2, 4)
    args = [q2 if a is q else a for a in inputs]
    for got, want in zip(canon(*args), _nt_other_user(q2, offsets)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _attention_and_nested(q, k, v, offsets, nt=None, s=None):
    """A rewritable attention plus an unrelated nested-tensor use of q in one graph."""
    out = sp.einsum_index_put_tril(q, k, v, offsets)
    return out + (torch.nested.nested_tensor_from_jagged(q, offsets) * 2.0).values()


def test_training_graph_with_grad_nested_tensor_not_retraced(fresh_dynamo):
    """The retrace would detach the nested tensor's values, so rewriting anything in that graph
    (here the attention) would drop q's gradient through the nested path: the graph is left to
    stock Inductor and gradients equal eager's."""
    args = make_inputs([5, 0, 8, 1, 3], requires_grad=True, seed=7)
    args_e = make_inputs([5, 0, 8, 1, 3], requires_grad=True, seed=7)
    with collecting() as report:
        out = torch.compile(_attention_and_nested, backend=REWRITE_BACKEND)(*args)
    assert report.counts["attention"] == 0, report
    assert any(kind == "graph" and "detach" in r for kind, r in report.near_misses), report
    ref = _attention_and_nested(*args_e)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, grad_leaves(args), g), torch.autograd.grad(ref, grad_leaves(args_e), g)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    # in inference the same graph is retraced and the attention rewritten
    with torch.no_grad():
        report = hstu_inductor.explain(_attention_and_nested, *args, backend=REWRITE_BACKEND)
        want = _attention_and_nested(*args)
    assert report.counts["attention"] == 1, report
    torch.testing.assert_close(report.output, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["nested_padded", "nested_padded_filled"])
def test_training_nested_spellings_match_eager(name, fresh_dynamo):
    """``nested_padded`` is rewritten in training; its filled twin (padding 1.0, no mask) is not
    HSTU and is not rewritten; both give eager's outputs and gradients."""
    fn = sp.SPELLINGS[name][0] if name in sp.SPELLINGS else sp.NEAR_MISSES[name][0]
    args = make_inputs([5, 0, 8, 1, 3], requires_grad=True, seed=8)
    args_e = make_inputs([5, 0, 8, 1, 3], requires_grad=True, seed=8)
    with collecting() as report:
        out = torch.compile(fn, backend=REWRITE_BACKEND)(*args)
    assert report.counts["attention"] == (1 if name == "nested_padded" else 0), report
    ref = fn(*args_e)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, grad_leaves(args), g), torch.autograd.grad(ref, grad_leaves(args_e), g)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
