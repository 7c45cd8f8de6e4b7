"""Spellings written after the grammar, tried once at B=128, N=4096 (issue 20's closing note) and kept
here at small sizes: scores by ``baddbmm(.., beta=0, alpha=scale)``, ``index_put_(accumulate=True)``
pads, segment ids counted by comparison, ``s / (1 + exp(-s))``, a window as two comparisons of
``i - j``, and a boolean-mask unpad (a data-dependent shape, kept in the graph for our frames).
Numerics against eager and the reference; a ``baddbmm`` with a live input is a bias: left alone."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hstu_inductor.backend as hb
from hstu_inductor.reference import hstu_mha
from hstu_inductor.report import collecting


class Attn(nn.Module):
    def __init__(self, N, H, D, kind):
        super().__init__(); self.N, self.H, self.D, self.kind = N, H, D, kind
        self.alpha = 1.0 / math.sqrt(D)
        self.w = N // 4
        self.bias = nn.Parameter(torch.randn(N, N)) if kind == "baddbmm_bias" else None
    def seg_pos(self, offsets, L):
        rows = torch.arange(L, device=offsets.device)
        if self.kind in ("cmp_count", "baddbmm", "baddbmm_bias", "explicit_sigmoid"):
            seg = (rows[:, None] >= offsets[None, 1:]).sum(1)           # comparison-count segment ids
        elif self.kind == "bool_unpad":
            lengths = offsets[1:] - offsets[:-1]
            seg = torch.arange(lengths.numel(), device=offsets.device).repeat_interleave(lengths)
        else:  # "accumulate", "diff_window"
            seg = torch.bucketize(rows, offsets[1:], right=True)
        return seg, rows - offsets[seg]
    def forward(self, q, k, v, offsets):
        N, H, D = self.N, self.H, self.D
        L, B = q.shape[0], offsets.shape[0] - 1
        seg, pos = self.seg_pos(offsets, L)
        def pad(x):
            buf = x.new_zeros(B, N, H, D)
            if self.kind == "accumulate":
                return buf.index_put_((seg, pos), x, accumulate=True)
            return torch.index_put(buf, (seg, pos), x)
        qp, kp, vp = pad(q), pad(k), pad(v)
        qh, kh, vh = (t.permute(0, 2, 1, 3).reshape(B * H, N, D) for t in (qp, kp, vp))
        if self.kind == "baddbmm":
            s = torch.baddbmm(torch.zeros(B * H, N, N, dtype=q.dtype, device=q.device), qh, kh.transpose(1, 2),
                              beta=0.0, alpha=self.alpha)
        elif self.kind == "baddbmm_bias":  # a live input: silu(bias + alpha q k^T), not HSTU
            s = torch.baddbmm(self.bias.expand(B * H, N, N), qh, kh.transpose(1, 2), beta=1.0, alpha=self.alpha)
        else:
            s = torch.bmm(qh * self.alpha, kh.transpose(1, 2))
        if self.kind == "explicit_sigmoid":
            p = s / (1 + torch.exp(-s))
        else:
            p = F.silu(s)
        i = torch.arange(N, device=q.device)
        d = i.view(N, 1) - i.view(1, N)
        if self.kind == "diff_window":
            m = d.ge(0).logical_and(d.le(self.w))       # causal window as two comparisons of i - j
        else:
            m = d >= 0
        lengths = offsets[1:] - offsets[:-1]
        inside = i.view(1, N) < lengths.view(B, 1)
        m = m.view(1, N, N) & inside.view(B, 1, N) & inside.view(B, N, 1)
        p = p.view(B, H, N, N) * m.view(B, 1, N, N).to(p.dtype) / N
        o = (p.view(B * H, N, N) @ vh).view(B, H, N, D).permute(0, 2, 1, 3)
        if self.kind == "bool_unpad":
            return o.reshape(B * N, H, D)[inside.reshape(-1)]        # boolean-mask unpad
        return o[seg, pos]


def _inputs(lengths, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    off = torch.tensor([0] + lengths).cumsum(0)
    return [torch.randn(L, H, D, generator=g) for _ in range(3)] + [off]


@pytest.mark.parametrize("kind", ["accumulate", "cmp_count", "baddbmm", "explicit_sigmoid", "diff_window",
                                  "bool_unpad"])
def test_new_spelling_rewritten_equal_to_eager(kind, fresh_dynamo):
    N, H, D = 16, 2, 8
    m = Attn(N, H, D, kind)
    ins = _inputs([16, 0, 5, 9], H, D, seed=hash(kind) % 1000)
    eager = m(*ins)
    ref = hstu_mha(N, m.alpha, *ins, causal=True, max_attn_len=m.w if kind == "diff_window" else 0)
    assert (eager - ref).norm() / ref.norm() < 1e-5  # the model is HSTU
    with collecting() as rep:
        got = torch.compile(m, backend="hstu_eager")(*ins)
    assert rep.counts.get("attention", 0) == 1, rep.near_misses
    assert (got - eager).norm() / eager.norm() < 1e-5


def test_baddbmm_with_an_input_is_left_alone(fresh_dynamo):
    N, H, D = 16, 2, 8
    m = Attn(N, H, D, "baddbmm_bias")
    ins = _inputs([16, 3, 5, 9], H, D, seed=7)
    eager = m(*ins)
    with collecting() as rep:
        got = torch.compile(m, backend="hstu_eager")(*ins)
    assert rep.counts.get("attention", 0) == 0
    assert (got - eager).norm() / eager.norm() < 1e-5
