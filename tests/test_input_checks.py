"""Bad jagged inputs give a clear error on every path, never a silent wrong answer (CPU).

The ops' value checks (``hstu_inductor/ops/_checks.py``, ``config.check_inputs``) are part of the
op bodies, so they must survive tracing (graphs keep ``_assert_async`` nodes), Inductor (the
rewritten ``backend="hstu"`` graph raises our message, not "index out of bounds" from generated
C++) and export. GPU variants: tests/test_gpu_inputs.py; AOTI: tests/test_export.py.
"""
from __future__ import annotations

import pytest
import torch

import hstu_inductor
import hstu_inductor.report
from hstu_inductor.reference import hstu_mha

from _helpers import offsets_from_lengths, rel_err

N, H, D, ALPHA = 4, 2, 8, 0.5
LENGTHS = [0, 3, 4, 0, 1]  # empty sequences mixed in, one of length N, one of length 1
L = sum(LENGTHS)

# name: (offsets, num_targets, message); every case keeps L and B, so a compiled graph is reused
BAD = {
    "first_not_0": ([1, 1, 4, 8, 8, 8], [0, 0, 0, 0, 0], r"seq_offsets\[0\] must be 0"),
    "decreasing": ([0, 3, 2, 7, 7, 8], [0, 0, 0, 0, 0], "non-decreasing"),
    "last_not_L": ([0, 0, 3, 7, 7, 7], [0, 0, 0, 0, 0], r"seq_offsets\[-1\] must equal"),
    "longer_than_max_seq_len": ([0, 5, 5, 7, 7, 8], [0, 0, 0, 0, 0], "<= max_seq_len"),
    "num_targets_above_length": ([0, 0, 3, 7, 7, 8], [0, 4, 0, 0, 0], "num_targets"),
    "negative_num_targets": ([0, 0, 3, 7, 7, 8], [0, -1, 0, 0, 0], "num_targets"),
}


def _qkv(seed=0, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(L, H, D, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def _op(q, k, v, off, nt):
    return torch.ops.hstu.attention(q, k, v, off, N, ALPHA, nt, None, 0, 0, 0, True)


def _user_attention(q, k, v, off, nt):  # what a user writes; backend="hstu" rewrites it to the op
    return hstu_mha(N, ALPHA, q, k, v, off, num_targets=nt)


def _traced(fn):
    """``fn`` compiled through AOTAutograd (which traces into the op bodies, as Inductor and AOTI do)
    with the forward graph run as plain ATen: cheap, and the graph's nodes can be inspected."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    return torch.compile(fn, backend=aot_autograd(fw_compiler=keep), fullgraph=True), graphs


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["auto", "always", "off"])
def test_traced_op_keeps_value_checks(mode, fresh_dynamo):
    """Traced with fake tensors (what torch.compile and export do), the op body keeps its checks as
    graph nodes that raise named errors on real inputs; "off" leaves none."""
    good = (*_qkv(), offsets_from_lengths(LENGTHS), torch.tensor([0, 1, 4, 0, 1]))
    with hstu_inductor.config.patch(check_inputs=mode):
        fn, graphs = _traced(_op)
        out = fn(*good)
    assert rel_err(out, _op(*good)) < 1e-6
    (gm,) = graphs
    asserts = [n for n in gm.graph.nodes if "assert_async" in str(n.target)]
    if mode == "off":
        assert not asserts
        return
    assert len(asserts) == 6  # one named assert per condition (CPU)
    for name, (off, nt, msg) in BAD.items():
        with pytest.raises(RuntimeError, match=msg):
            fn(*good[:3], torch.tensor(off), torch.tensor(nt))


def test_eager_messages_carry_the_values():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="length 5 > max_seq_len=4"):
        _op(q, k, v, torch.tensor(BAD["longer_than_max_seq_len"][0]), None)
    with hstu_inductor.config.patch(check_inputs="always"):
        with pytest.raises(RuntimeError, match=r"seq_offsets\[-1\]=7 must equal the number of jagged rows L=8"):
            _op(q, k, v, torch.tensor(BAD["last_not_L"][0]), None)


def test_delta_attention_checks_survive_tracing(fresh_dynamo):
    off = offsets_from_lengths([3, 4, 1])
    q, k, v = _qkv()
    dq = torch.randn(3, H, D)

    def delta(dq, k, v, off):
        return torch.ops.hstu.delta_attention(dq, k, v, off, N, ALPHA, None, None, 0, 0)

    gm, graphs = _traced(delta)
    assert rel_err(gm(dq, k, v, off), delta(dq, k, v, off)) < 1e-6
    assert any("assert_async" in str(n.target) for n in graphs[0].graph.nodes)
    with pytest.raises(RuntimeError, match="at least D rows"):
        gm(dq, k, v, offsets_from_lengths([4, 4, 0]))
    with pytest.raises(RuntimeError, match="non-decreasing"):
        gm(dq, k, v, torch.tensor([0, 5, 4, 8]))


def test_backend_rewritten_graph_raises_named_errors(fresh_dynamo):
    """The measured failure: the rewritten graph used to end in "index out of bounds" from
    Inductor's C++ (or, for num_targets > length, in a silently different answer). One inference
    compile (training with edge batches: test_fuzz_backend.py); edge lengths (0, 1, N) and
    num_targets 0 and = length must match eager."""
    compiled = torch.compile(_user_attention, backend="hstu")
    q, k, v = _qkv(seed=1)
    off, nt = offsets_from_lengths(LENGTHS), torch.tensor([0, 3, 4, 0, 1])  # nt = 0 and = length
    with torch.no_grad():
        with hstu_inductor.report.collecting() as report:
            out = compiled(q, k, v, off, nt)
        assert report.counts["attention"] == 1, str(report)
        assert rel_err(out, _user_attention(q, k, v, off, nt)) < 1e-6
        for name, (bad_off, bad_nt, msg) in BAD.items():
            with pytest.raises(RuntimeError, match=msg):
                compiled(q, k, v, torch.tensor(bad_off), torch.tensor(bad_nt))


def test_fbgemm_truncation_is_not_kept(fresh_dynamo):
    """fbgemm's pads truncate a sequence longer than N (its rows past N come out 0); the rewrite does
    not reproduce that: the rewritten graph raises (docs/inputs.md)."""
    pytest.importorskip("fbgemm_gpu")
    from hstu_inductor.testing import spellings_attention as sp

    lengths = [3, sp.N + 2, 1]
    off = offsets_from_lengths(lengths)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(lengths), 2, 4, generator=g) for _ in range(3))
    eager = sp.fbgemm_dense(q, k, v, off)  # truncates, no error
    assert eager[3 + sp.N:3 + sp.N + 2].abs().sum() == 0 and eager[:3 + sp.N].abs().sum() > 0
    compiled = torch.compile(sp.fbgemm_dense, backend="hstu")
    with hstu_inductor.report.collecting() as report:
        with pytest.raises(RuntimeError, match="<= max_seq_len"):
            compiled(q, k, v, off)
    assert report.counts["attention"] == 1, str(report)
