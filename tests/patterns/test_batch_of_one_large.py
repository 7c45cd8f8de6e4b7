"""One sequence at production size (B=1, N=4096, static).

Serving at batch size 1 exports (or compiles) a static graph with offsets of 2 rows; with a full
sequence (L == N) the sizes B * N and L coincide. The value-level proof reads the one sequence at
symbolic positions (``b = 0``), so neither matters. Exported under ``FakeTensorMode``: nothing of
N x N is allocated.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hstu_inductor.reference import STULayer
from hstu_inductor.testing import spellings_attention as sp
from _rewrite import FnModule as _Fn, rewrite_exported

N, H, D = 4096, 4, 128


def _export(module, args_fn):
    with FakeTensorMode():
        return torch.export.export(module, args_fn())


def _attention_ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.hstu.attention.default]


def _spelling(fn, L, monkeypatch, need_nt=False):
    monkeypatch.setattr(sp, "N", N)

    def args():
        q, k, v = (torch.empty(L, H, D) for _ in range(3))
        nt = (torch.empty(1, dtype=torch.int64),) if need_nt else ()
        return (q, k, v, torch.empty(2, dtype=torch.int64), *nt)

    return rewrite_exported(_export(_Fn(fn), args))


@pytest.mark.parametrize("name,L", [("einsum_index_put_tril", 3001), ("einsum_index_put_tril", N),
                                    ("matmul_index_copy_where", N)])
def test_spellings_one_sequence_rewritten(name, L, monkeypatch):
    fn, need_nt, *_ = sp.SPELLINGS[name]
    report, gm, _ = _spelling(fn, L, monkeypatch, need_nt)
    assert report.counts["attention"] == 1, report.near_misses
    (op,) = _attention_ops(gm)
    assert op.args[4] == N


def test_stu_layer_full_sequence_window(monkeypatch):
    """The reference STU layer with a window of 1024, one sequence of exactly N rows."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = STULayer(512, H, D, D, max_attn_len=1024)

        def forward(self, x, off, nt):
            return self.layer(x, off, N, nt)

    with FakeTensorMode():
        m = M()
    ep = _export(m, lambda: (torch.empty(N, 512), torch.empty(2, dtype=torch.int64), torch.empty(1, dtype=torch.int64)))
    report, gm, _ = rewrite_exported(ep)
    assert report.counts["attention"] == 1, report.near_misses
    (op,) = _attention_ops(gm)
    assert op.args[4] == N and op.args[8] == 1024


def test_near_miss_one_full_sequence_untouched(monkeypatch):
    """A leaky causal mask stays a near miss with one sequence of N rows."""
    fn, reason = sp.NEAR_MISSES["leaky_causal"]
    report, gm, _ = _spelling(fn, N, monkeypatch)
    assert report.counts["attention"] == 0
    assert report.near_misses and reason in report.near_misses[0][1], report.near_misses
    assert not _attention_ops(gm)


def test_length_scale_is_one_over_n_for_the_only_admitted_input(monkeypatch):
    """A static graph of one sequence admits one length, ``n_0 = L`` (``offsets = [0, L]``): a scale of
    1/n_b is then the constant 1/L, and that program is HSTU with that scale (1/N when L = N).
    Under dynamic shapes the same model stays a near miss (test_attention_near_miss)."""
    fn, _ = sp.NEAR_MISSES["length_normalised"]
    for L, scale in ((N, "scale=1/N"), (3001, f"scale={1 / 3001:g}")):
        report, gm, _ = _spelling(fn, L, monkeypatch)
        assert report.counts["attention"] == 1, report.near_misses
        assert scale in report.details[0][1], report.details
