"""Degenerate but valid jagged batches on the op's paths (CPU): eager, traced by AOTAutograd (the
body torch.compile/AOTI run, checks included) and torch.export; forward and backward, against the
fp64 eager reference. The rewritten-backend path: test_input_checks.py; GPU: test_gpu_inputs.py."""
from __future__ import annotations

import pytest
import torch

from hstu_inductor.reference import delta_hstu_mha, hstu_mha

from _helpers import offsets_from_lengths, rel_err

H, D, ALPHA = 2, 3, 0.7

# name: (lengths, max_seq_len, num_targets)
EDGES = {
    "all_empty": ([0, 0, 0], 4, [0, 0, 0]),
    "no_sequence": ([], 4, []),
    "one_sequence": ([3], 4, [1]),
    "N_is_1": ([1, 0, 1], 1, [0, 0, 1]),
    "one_sequence_of_length_N": ([5], 5, [0]),
    "zeros_mixed_in": ([0, 3, 0, 4, 1], 4, [0, 3, 0, 1, 1]),  # num_targets 0 and = length
}


def _op(q, k, v, off, nt, N):
    return torch.ops.hstu.attention(q, k, v, off, N, ALPHA, nt, None, 0, 0, 0, True)


def _inputs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    return [torch.randn(L, H, D, generator=g, requires_grad=True) for _ in range(3)]


def _check_against_reference(fn, lengths, N, targets):
    q, k, v = _inputs(lengths, seed=len(lengths) + N)
    off, nt = offsets_from_lengths(lengths), torch.tensor(targets, dtype=torch.int64)
    out = fn(q, k, v, off, nt)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = hstu_mha(N, ALPHA, *r, off, num_targets=nt)
    assert out.shape == ref.shape == (sum(lengths), H, D)
    if not ref.numel():
        return
    assert rel_err(out, ref) < 1e-5
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, r, g.double())):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("name", list(EDGES))
def test_op_eager(name):
    lengths, N, targets = EDGES[name]
    _check_against_reference(lambda *a: _op(*a, N), lengths, N, targets)


@pytest.mark.parametrize("name", list(EDGES))
def test_op_traced(name):
    lengths, N, targets = EDGES[name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, off, nt: _op(q, k, v, off, nt, N), backend="aot_eager", fullgraph=True)
    _check_against_reference(compiled, lengths, N, targets)
    torch._dynamo.reset()


class _Attention(torch.nn.Module):
    def __init__(self, N):
        super().__init__()
        self.N = N

    def forward(self, q, k, v, off, nt):
        return _op(q, k, v, off, nt, self.N)


@pytest.mark.parametrize("name", ["all_empty", "N_is_1", "zeros_mixed_in"])
def test_op_exported(name):
    lengths, N, targets = EDGES[name]
    q, k, v = (t.detach() for t in _inputs(lengths))
    off, nt = offsets_from_lengths(lengths), torch.tensor(targets)
    ep = torch.export.export(_Attention(N), (q, k, v, off, nt))
    out = ep.module()(q, k, v, off, nt)
    ref = hstu_mha(N, ALPHA, q.double(), k.double(), v.double(), off, num_targets=nt)
    assert out.shape == ref.shape
    if ref.numel():
        assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("lengths,N", [([4], 4), ([1, 4, 2], 4), ([1, 1], 1)], ids=["B1_full", "mixed", "N_is_1"])
def test_delta_attention_edges(lengths, N):
    Dq = 1
    _, k, v = (t.detach() for t in _inputs(lengths, seed=3))
    off = offsets_from_lengths(lengths)
    dq = torch.randn(len(lengths) * Dq, H, D)
    out = torch.ops.hstu.delta_attention(dq, k, v, off, N, ALPHA, None, None, 0, 0)
    ref = delta_hstu_mha(N, ALPHA, dq.double(), k.double(), v.double(), off)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("lengths", [[0, 0, 0], []], ids=["all_empty", "no_sequence"])
def test_cuda_branch_empty_batch_with_targets(lengths, monkeypatch):
    """Issue 22 (an empty batch with num_targets crashed on CUDA): the ops' CUDA branch (the Triton
    kernels' Python side and the tensor flags of the device-side check), here on the CPU under the
    Triton interpreter. Empty output and empty gradients; GPU twin: test_gpu_inputs.py."""
    import importlib

    from hstu_inductor.kernels import attention as K
    from hstu_inductor.ops._checks import _flags

    ops_attention = importlib.import_module("hstu_inductor.ops.attention")  # the module, not the op it exports
    # the CUDA branch, on CPU tensors
    monkeypatch.setattr(importlib.import_module("hstu_inductor.ops._kernels"), "kernels_for", lambda t: K)
    from hstu_inductor.kernels import delta as Kd
    monkeypatch.setattr(ops_attention, "_delta_kernels_for", lambda t: Kd)
    off, nt = offsets_from_lengths(lengths), torch.zeros(len(lengths), dtype=torch.int64)
    assert bool(_flags(off, 0, 4, nt, 0).all())  # what CUDA's 'auto' mode asserts on the device
    if lengths:
        assert not bool(_flags(off, 0, 4, nt + 1, 0)[4])  # and it does refuse targets > length 0
    q, k, v = _inputs(lengths)
    out = _op(q, k, v, off, nt, 4)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert out.shape == (0, H, D) and all(g.shape == (0, H, D) for g in grads)
    dq = q.detach()[:0]
    assert torch.ops.hstu.delta_attention(dq, k.detach(), v.detach(), off, 4, ALPHA, nt, None, 0, 0).shape == (0, H, D)
    dq_, dk, dv = K.hstu_attention_bwd(out.detach(), q.detach(), k.detach(), v.detach(), off, 4, ALPHA, nt)
    assert dq_.shape == dk.shape == dv.shape == (0, H, D)
