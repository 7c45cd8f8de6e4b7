"""hstu_inductor.testing.fbgemm_shim: fbgemm's jagged ops in plain PyTorch, for a machine without fbgemm_gpu
(registered here under a namespace of its own): values against a per-sequence loop (fp64, random, rows past N
dropped), gradients by gradcheck, a Dynamo-traced call (the fake kernels), and the schemas against fbgemm's
where it is installed."""
from __future__ import annotations

import importlib

import pytest
import torch

from hstu_inductor.testing import fbgemm_shim

NS = "hstu_fbgemm_shim_test"
_LIB = fbgemm_shim.register(NS)
NAMES = ["jagged_to_padded_dense", "dense_to_jagged", "jagged_to_padded_dense_forward", "dense_to_jagged_forward",
         "jagged_to_padded_dense_backward"]


def test_shim_values_gradients_trace_and_schemas():
    fb = getattr(torch.ops, NS)
    g = torch.Generator().manual_seed(7)
    lengths = [3, 0, 6, 1]  # the 6 exceeds N=4: its last rows are dropped (to dense) / zero (to jagged)
    off = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    N, L = 4, sum(lengths)
    v = torch.randn(L, 5, generator=g, dtype=torch.float64, requires_grad=True)
    d = torch.randn(4, N, 5, generator=g, dtype=torch.float64, requires_grad=True)
    want, want_j = torch.full((4, N, 5), -1.5, dtype=torch.float64), torch.zeros(L, 5, dtype=torch.float64)
    for b in range(4):
        m = min(lengths[b], N)
        want[b, :m] = v[off[b]:off[b] + m]
        want_j[off[b]:off[b] + m] = d[b, :m]
    assert torch.equal(fb.jagged_to_padded_dense(v, [off], [N], padding_value=-1.5), want)
    jag, offs = fb.dense_to_jagged(d, [off])
    assert torch.equal(jag, want_j) and offs[0] is off
    torch.autograd.gradcheck(lambda x: fb.jagged_to_padded_dense(x, [off], [N]), (v,))
    torch.autograd.gradcheck(lambda x: fb.dense_to_jagged(x, [off], L)[0], (d,))

    def f(x):
        return fb.dense_to_jagged(fb.jagged_to_padded_dense(x, [off], [N]).sin(), [off], L)[0]
    assert torch.allclose(torch.compile(f, backend="eager", fullgraph=True)(v), f(v))
    try:
        importlib.import_module("fbgemm_gpu")
    except ImportError:
        pytest.skip("fbgemm_gpu not installed: values checked, schemas not compared")
    for name in NAMES:
        ours = str(getattr(fb, name).default._schema).replace(NS + "::", "fbgemm::")
        assert ours == str(getattr(torch.ops.fbgemm, name).default._schema), name


def test_shim_kernels_never_become_compiled_frames():
    """fbgemm's kernels are C++: where Dynamo calls an op eagerly (here after the graph break of
    dense_to_jagged's data-dependent length), the shim's Python kernel must run as it is, not be compiled as a
    frame of its own (the likely cause of stock Inductor's wrong results on a GPU: benchmarks/RESULTS.md)."""
    fb = getattr(torch.ops, NS)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    def f(d, off):
        return fb.dense_to_jagged(d.sin(), [off])[0] * 2

    g = torch.Generator().manual_seed(3)
    off, d = torch.tensor([0, 3, 3, 7]), torch.randn(3, 4, 5, generator=g)
    torch._dynamo.reset()
    out = torch.compile(f, backend=backend)(d, off)
    assert torch.equal(out, f(d, off))
    assert graphs and not any("searchsorted" in t for ts in graphs for t in ts), graphs
