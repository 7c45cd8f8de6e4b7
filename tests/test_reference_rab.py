"""Dense rab and interval masks in the eager reference, against the naive loops of ``_helpers``
(written from HSTU_SEMANTICS.md / docs/semantics.md), in float64 with fresh random inputs."""
from __future__ import annotations

import math

import pytest
import torch

from _helpers import loop_attention, offsets_from_lengths, random_jagged, rel_err, spec_sla_visible
from hstu_inductor.reference import (hstu_mha, hstu_mha_backward, interval_mask, relative_bias,
                                     relative_bias_backward, sla_intervals, time_buckets)

LENGTHS = [0, 1, 6, 4]  # includes 0, 1 and N
N, H = 6, 2
RAB_SHAPES = {"BH": (4, H), "1H": (1, H), "B1": (4, 1), "11": (1, 1)}


def _rab(shape, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, N, N, generator=g, dtype=torch.float64).requires_grad_(requires_grad)


def _random_intervals(lengths, heads, seed, dtype=torch.int64):
    """Random ``x0 <= x1 <= x2`` per head and row, drawn from [0, n_b + 2] (past n_b on purpose)."""
    g = torch.Generator().manual_seed(seed)
    rows = [n for n in lengths for _ in range(n)]
    x = torch.stack([torch.randint(0, n + 3, (heads, 3), generator=g) for n in rows], dim=1) if rows else \
        torch.zeros(heads, 0, 3, dtype=torch.int64)
    return x.sort(dim=-1).values.to(dtype)


@pytest.mark.parametrize("shape", list(RAB_SHAPES))
def test_rab_forward_matches_loop(shape):
    q, k, v, off = random_jagged(LENGTHS, H=H, Dq=3, Dv=4, seed=21 + len(shape))
    rab = _rab(RAB_SHAPES[shape], seed=5)
    for kw in (dict(), dict(num_targets=torch.tensor([0, 1, 2, 1]), max_attn_len=2, contextual_seq_len=1)):
        got = hstu_mha(N, 0.7, q, k, v, off, rab=rab, **kw)
        want = loop_attention(q, k, v, off, N, 0.7, kw.get("num_targets"), None, kw.get("max_attn_len", 0),
                              kw.get("contextual_seq_len", 0), rab=rab)
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("heads", [1, H])
def test_intervals_forward_matches_loop(heads):
    q, k, v, off = random_jagged(LENGTHS, H=H, Dq=3, Dv=4, seed=30 + heads)
    iv = _random_intervals(LENGTHS, heads, seed=heads)
    for rab in (None, _rab((1, H), seed=9)):
        got = hstu_mha(N, 0.6, q, k, v, off, intervals=iv, rab=rab)
        want = loop_attention(q, k, v, off, N, 0.6, intervals=iv, rab=rab)
        assert rel_err(got, want) < 1e-12


def test_interval_mask_by_hand():
    # one sequence of 4 rows: row 0 sees {0}, row 1 [0,1) u [2,4) -> {0,2,3}, row 2 nothing, row 3 [0,9) -> all
    iv = torch.tensor([[[1, 1, 1], [1, 2, 4], [0, 0, 0], [9, 9, 9]]])
    m = interval_mask(iv, torch.tensor([0, 4]), 5)[0, 0].to(torch.int64)
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0], [0] * 5]


@pytest.mark.parametrize("k1,k2,c", [(2, 1, 0), (1, 0, 0), (3, 2, 3), (0, 2, 0), (9, 0, 0)])
def test_sla_intervals_match_spec(k1, k2, c):
    lengths, nts = [7, 0, 1, 5], [2, 0, 1, 0]
    off = offsets_from_lengths(lengths)
    nt = torch.tensor(nts)
    iv = sla_intervals(off, nt, k1, k2, c)
    assert iv.shape == (1, sum(lengths), 3)
    assert bool((iv[..., 0] <= iv[..., 1]).all() and (iv[..., 1] <= iv[..., 2]).all())
    m = interval_mask(iv, off, 7)
    for b, (n, t) in enumerate(zip(lengths, nts)):
        for i in range(7):
            for j in range(7):
                assert bool(m[b, 0, i, j]) == spec_sla_visible(i, j, n, t, k1, k2, c), (b, i, j)
    # num_targets=None means no targets
    assert torch.equal(sla_intervals(off, None, k1, k2, c), sla_intervals(off, torch.zeros(4, dtype=torch.int64),
                                                                       k1, k2, c))


@pytest.mark.parametrize("shape", list(RAB_SHAPES))
def test_rab_gradcheck(shape):
    q, k, v, off = random_jagged([3, 0, 4], H=H, Dq=2, Dv=2, seed=40, requires_grad=True)
    g = torch.Generator().manual_seed(1)
    rab = torch.randn(*(d if d == 1 else 3 for d in RAB_SHAPES[shape][:1]), RAB_SHAPES[shape][1], 4, 4,
                      generator=g, dtype=torch.float64, requires_grad=True)
    iv = _random_intervals([3, 0, 4], 1, seed=2)
    for kw in (dict(num_targets=torch.tensor([1, 0, 2])), dict(intervals=iv)):
        assert torch.autograd.gradcheck(lambda q_, k_, v_, r_: hstu_mha(4, 0.8, q_, k_, v_, off, rab=r_, **kw),
                                        (q, k, v, rab))


@pytest.mark.parametrize("shape", list(RAB_SHAPES))
def test_closed_form_backward_with_rab_and_intervals(shape):
    q, k, v, off = random_jagged(LENGTHS, H=H, Dq=3, Dv=4, seed=50, requires_grad=True)
    rab = _rab(RAB_SHAPES[shape], seed=51, requires_grad=True)
    s = torch.rand(q.shape[0], dtype=torch.float64, requires_grad=True)
    for iv in (None, _random_intervals(LENGTHS, H, seed=52)):
        out = hstu_mha(N, 0.7, q, k, v, off, attn_scale=s, rab=rab, intervals=iv)
        gout = torch.randn_like(out)
        want = torch.autograd.grad(out, [q, k, v, s, rab], gout)
        got = hstu_mha_backward(gout, N, 0.7, q.detach(), k.detach(), v.detach(), off, attn_scale=s.detach(),
                                need_scale_grad=True, rab=rab.detach(), intervals=iv, need_rab_grad=True)
        assert got[4].shape == rab.shape
        for w, gt in zip(want, got):
            assert rel_err(gt, w) < 1e-12


def test_rab_padding_has_no_effect_and_no_gradient():
    """rab entries outside a sequence (or masked) change nothing and get zero gradient."""
    q, k, v, off = random_jagged([2, 3], H=1, Dq=2, Dv=2, seed=60)
    rab = torch.randn(2, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    out = hstu_mha(4, 0.5, q, k, v, off, rab=rab)
    rab2 = rab.detach().clone()
    rab2[0, :, 2:, :] = 1e3
    rab2[0, :, :, 2:] = 1e3
    rab2[:, :, 0, 1] = -7.0  # above the causal diagonal: masked
    assert torch.equal(hstu_mha(4, 0.5, q, k, v, off, rab=rab2), out)
    (g,) = torch.autograd.grad(out.sum(), rab)
    assert g[0, :, 2:].abs().sum() == 0 and g[0, :, :, 2:].abs().sum() == 0 and g[:, :, 0, 1].abs().sum() == 0


def test_rab_interval_validation():
    q, k, v, off = random_jagged([2, 3], H=2, Dq=2, Dv=2, seed=61)
    bad = [
        (dict(rab=torch.zeros(2, 2, 4, 5, dtype=torch.float64)), "rab must be"),
        (dict(rab=torch.zeros(3, 2, 4, 4, dtype=torch.float64)), "rab must be"),
        (dict(rab=torch.zeros(2, 2, 4, 4, dtype=torch.int64)), "floating"),
        (dict(intervals=torch.zeros(2, 5, 2, dtype=torch.int64)), "intervals must be"),
        (dict(intervals=torch.zeros(3, 5, 3, dtype=torch.int64)), "intervals must be"),
        (dict(intervals=torch.zeros(1, 5, 3)), "int32 or int64"),
        (dict(intervals=torch.zeros(1, 5, 3, dtype=torch.int64), max_attn_len=2), "replace"),
        (dict(intervals=torch.zeros(1, 5, 3, dtype=torch.int64), num_targets=torch.tensor([0, 1])), "replace"),
    ]
    for kw, msg in bad:
        with pytest.raises((RuntimeError, ValueError), match=msg):  # mask rules: ValueError (AttentionSpec)
            hstu_mha(4, 0.5, q, k, v, off, **kw)


# ---------------------------------------------------------------------------------------------
# The original HSTU's bias from two tables (positions and time buckets), as a dense rab
# ---------------------------------------------------------------------------------------------
def _loop_relative_bias(ts_jagged, lengths, n, pos_w, ts_w):
    """rab_b(i, j) per element, straight from HSTU_SEMANTICS.md (timestamps padded with 0)."""
    nb = ts_w.shape[0] - 1
    out = torch.zeros(len(lengths), 1, n, n, dtype=torch.float64)
    start = 0
    for b, m in enumerate(lengths):
        ts = [float(ts_jagged[start + p]) if p < m else 0.0 for p in range(n)]
        start += m
        for i in range(n):
            nxt = i + 1 if i < n - 1 else n - 1
            for j in range(n):
                dt = ts[nxt] - ts[j]
                bucket = min(max(math.floor(math.log(max(abs(dt), 1.0)) / 0.301), 0), nb)
                out[b, 0, i, j] = float(pos_w.detach()[n - 1 + j - i]) + float(ts_w.detach()[bucket])
    return out


def test_relative_bias_matches_loop_and_flows_to_tables():
    lengths, n = [4, 0, 1, 6], 6
    off = offsets_from_lengths(lengths)
    g = torch.Generator().manual_seed(70)
    ts = torch.randint(0, 3000, (sum(lengths),), generator=g).cumsum(0)
    pos_w = torch.randn(2 * n - 1, generator=g, dtype=torch.float64, requires_grad=True)
    ts_w = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    rab = relative_bias(ts, off, n, pos_w, ts_w)
    assert rab.shape == (4, 1, n, n)
    assert rel_err(rab, _loop_relative_bias(ts, lengths, n, pos_w, ts_w)) < 1e-15
    q, k, v, _ = random_jagged(lengths, H=H, Dq=3, Dv=4, seed=71)
    assert torch.autograd.gradcheck(
        lambda p_, t_: hstu_mha(n, 0.5, q, k, v, off, rab=relative_bias(ts, off, n, p_, t_)), (pos_w, ts_w))
    assert time_buckets(torch.tensor([0, 1, -1, 2, 3, -20, 10 ** 9]), 8).tolist() == [0, 0, 0, 2, 3, 8, 8]


def test_relative_bias_single_tables_and_closed_form_backward():
    """Either table alone (its term only), and ``relative_bias_backward`` (the closed-form scatter used by the
    ops' reference path) against autograd, for a per-head gradient ``[B, H, N, N]``."""
    lengths, n = [4, 0, 1, 6], 6
    off = offsets_from_lengths(lengths)
    g = torch.Generator().manual_seed(72)
    ts = torch.randint(-5000, 5000, (sum(lengths),), generator=g)  # unsorted: negative dt too
    pos_w = torch.randn(2 * n - 1, generator=g, dtype=torch.float64, requires_grad=True)
    ts_w = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    both = relative_bias(ts, off, n, pos_w, ts_w)
    assert rel_err(relative_bias(None, off, n, pos_w, None) + relative_bias(ts, off, n, None, ts_w), both) < 1e-15
    d_bias = torch.randn(4, H, n, n, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(both, (pos_w, ts_w), d_bias.sum(1, keepdim=True))
    got = relative_bias_backward(d_bias, ts, off, n, ts_w.shape[0] - 1)
    assert all(rel_err(a, b) < 1e-13 for a, b in zip(got, want))
    d_pos, d_ts = relative_bias_backward(d_bias, None, off, n, None)
    assert d_ts is None and rel_err(d_pos, want[0]) < 1e-13
    with pytest.raises(ValueError, match="ts_w needs timestamps"):
        relative_bias(None, off, n, None, ts_w)
