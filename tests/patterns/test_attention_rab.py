"""Relative attention bias (dense rab) and interval masks (SLA) in plain PyTorch -> hstu.attention.

1. A bias added to the scores before the silu (``silu(alpha * q k^T + bias)``, any shape that
   broadcasts as ``[B|1, H|1, N, N]``, computed by any ops: the original HSTU's position + bucketed
   time bias, a learned per-head dense bias, an embedding over ``i - j``) is rewritten to
   ``hstu.attention(..., rab=<the user's bias>)``, with every HSTU mask option; gradients reach the
   bias's producers (the tables).
2. A mask decoded from a per-row interval tensor ``[0, x0) ∪ [x1, x2)`` (TorchEasyRec's NFUNC
   ``attn_func [H, 3, L]``, SLA) is rewritten to ``hstu.attention(..., intervals=...)``, whether the
   tensor is a graph input or computed in the graph (our own SLA builder, written from
   TorchEasyRec's documented semantics: docs/semantics.md).
3. Near misses stay with stock Inductor: a bias after the silu, a bias inside a softmax, a bias
   read from v, a per-element data mask, an interval decode with ``>`` for ``>=``.

Every rewrite test checks the count and the numerics against eager on fresh random inputs (and a
second input set after compiling); the poisoned-op tests show that the op's rab / intervals
argument is what makes the result right.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import hstu_inductor
import hstu_inductor.ops.attention  # noqa: F401
from hstu_inductor import reference
from hstu_inductor.report import collecting
from _rewrite import rewrite_exported

from _helpers import REWRITE_BACKEND, offsets_from_lengths

try:  # registers torch.ops.fbgemm.* (TorchEasyRec pads and decodes with fbgemm)
    import fbgemm_gpu  # noqa: F401
    HAVE_FBGEMM = hasattr(torch.ops.fbgemm, "jagged_to_padded_dense")
except Exception:  # pragma: no cover
    HAVE_FBGEMM = False

op_module = sys.modules["hstu_inductor.ops.attention"]  # the module (the package exports the op by that name)
N, H, D = 16, 2, 8
ALPHA = 0.25
NUM_BUCKETS = 12
LENGTHS = [16, 0, 1, 9]   # B=4: lengths 0, 1 and N
LENGTHS2 = [5, 16, 7, 2]  # fresh inputs after compiling (same B, other L)
ATTN = torch.ops.hstu.attention.default


# ---------------------------------------------------------------------------------------------
# Our plain-PyTorch pieces: pads, unpad, masks, biases
# ---------------------------------------------------------------------------------------------
def _row_ids(offsets, L):
    rows = torch.arange(L, device=offsets.device)
    seq = torch.searchsorted(offsets, rows, right=True) - 1
    return seq, rows - offsets[seq]


def pad(x, offsets, n=N):
    seq, pos = _row_ids(offsets, x.shape[0])
    return torch.index_put(x.new_zeros(offsets.numel() - 1, n, *x.shape[1:]), (seq, pos), x)


def unpad(dense, offsets, L):
    seq, pos = _row_ids(offsets, L)
    return dense[seq, pos]


def lengths_of(offsets):
    return offsets[1:] - offsets[:-1]


def hstu_mask(offsets, nt=None, w=0, c=0, n=N):
    """[B, N, N] bool, HSTU_SEMANTICS.md's valid(i, j) from ids (our spelling)."""
    ar = torch.arange(n, device=offsets.device)
    lens = lengths_of(offsets)[:, None]
    ids = ar[None, :].expand(lens.shape[0], n)
    end = lens
    if c > 0:
        ids = (ids - c + 1).clamp(min=0)
        end = end - c + 1
    if nt is not None:
        end = end - nt[:, None]
        ids = torch.minimum(ids, end)
    d = ids[:, :, None] - ids[:, None, :]
    valid = (ar[:, None] == ar[None, :])[None] | (d > 0)
    if w > 0:
        valid = valid & (d <= w)
    if c > 0:
        valid = valid | ((ids[:, :, None] == 0) & (ids[:, None, :] < end[:, :, None]))
    inseq = ar[None, :] < lens
    return valid & inseq[:, :, None] & inseq[:, None, :]


def hstu_rel_bias(ts, offsets, pos_w, ts_w, n=N):
    """The original HSTU's bias, ``[B, 1, N, N]``: ``pos_w[N-1+j-i] + ts_w[bucket(ts(next(i)) - ts(j))]``
    (pos gathered by advanced indexing, buckets detached, as generative-recommenders' research code)."""
    tsp = pad(ts, offsets, n)
    i = torch.arange(n, device=ts.device)
    nxt = torch.clamp(i + 1, max=n - 1)
    dt = tsp[:, nxt].unsqueeze(-1) - tsp.unsqueeze(1)
    bucket = torch.floor(torch.log(torch.clamp(dt.abs(), min=1.0)) / 0.301)
    bucket = torch.clamp(bucket, 0, ts_w.shape[0] - 1).long().detach()
    pos = pos_w[n - 1 + i[None, :] - i[:, None]]
    return (pos[None] + ts_w[bucket]).unsqueeze(1)


def pos_bias_embedding(pos_w, n=N):
    """``[N, N]`` position bias as an embedding over ``i - j`` (pad-free spelling)."""
    i = torch.arange(n, device=pos_w.device)
    return F.embedding((i[None, :] - i[:, None]) + n - 1, pos_w[:, None]).squeeze(-1)


def ts_bias_index_select(ts, offsets, ts_w, n=N):
    """``[B, N, N]`` time bias by ``index_select`` over bucketised gaps (buckets not detached)."""
    tsp = pad(ts, offsets, n)
    nxt = torch.cat([tsp[:, 1:], tsp[:, -1:]], dim=1)
    dt = (nxt[:, :, None] - tsp[:, None, :]).abs().clamp(min=1.0)
    bucket = (dt.log() / 0.301).floor().clamp(0, ts_w.shape[0] - 1).to(torch.int64)
    return ts_w.index_select(0, bucket.reshape(-1)).view(bucket.shape)


def pos_bias_pad_repeat(pos_w, n=N):
    """``[1, N, N]`` position bias by the pad-and-repeat trick: rows of length ``3N - 2`` laid end to
    end shift the table by one per row, a window of ``N`` columns reads ``pos_w[N-1+j-i]``."""
    t = torch.cat([pos_w[: 2 * n - 1], pos_w.new_zeros(n)]).repeat(n)[:-n]
    return t.view(1, n, 3 * n - 2)[:, :, n - 1: 2 * n - 1]


def ts_bias_ext_cat(ts, offsets, ts_w, n=N):
    """``[B, N, N]`` time bias: timestamps extended by their last column (``next(N-1) = N-1``),
    log buckets clamped and detached, gathered by ``index_select`` on the flattened buckets."""
    tsp = pad(ts, offsets, n)
    ext = torch.cat([tsp, tsp[:, n - 1:n]], dim=1)
    dt = ext[:, 1:].unsqueeze(2) - ext[:, :-1].unsqueeze(1)
    bucket = torch.clamp((torch.log(dt.abs().clamp(min=1)) / 0.301).long(), min=0, max=ts_w.shape[0] - 1).detach()
    return torch.index_select(ts_w, 0, bucket.view(-1)).view(-1, n, n)


# ---------------------------------------------------------------------------------------------
# Attention with a bias: spellings x mask options
# ---------------------------------------------------------------------------------------------
MASKS = {
    "causal": lambda o, nt: hstu_mask(o),
    "targets_window": lambda o, nt: hstu_mask(o, nt, w=4),
    "contextual_targets": lambda o, nt: hstu_mask(o, nt, c=3),
    "none": lambda o, nt: None,  # non-causal: only the padding (zero rows of v) bounds it
    # the reference's own mask builder: window 4 with min_full_attn_seq_len 3 and targets
    "window_min_full": lambda o, nt: reference.hstu_mask(lengths_of(o), N, nt, 4, 0, 3),
}


def _core(q, k, v, offsets, nt, bias_fn, mask, where="alpha_first", heads_first=False):
    """Pads, scores, ``silu(... + bias)``, mask, ``P @ V``, unpad. ``where`` places the bias."""
    L = q.shape[0]
    qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
    s = torch.einsum("bnhd,bmhd->bhnm", qp, kp)
    bias = bias_fn()
    if where == "alpha_first":
        s = F.silu(ALPHA * s + bias)
    elif where == "alpha_after":
        s = F.silu(s * ALPHA + bias)
    elif where == "inside_alpha":
        s = F.silu((s + bias) * ALPHA)
    elif where == "sigmoid":
        a = ALPHA * s + bias
        s = a * torch.sigmoid(a)
    s = s / N
    if mask is not None and mask != "none":
        s = s * MASKS[mask](offsets, nt)[:, None].to(s.dtype)
    return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


def _bmm_flat(q, k, v, offsets, nt, bias_fn, mask):
    """Heads-first ``bmm`` on ``[B*H, N, D]``; the bias ``[B, H, N, N]`` flattened the same way."""
    L = q.shape[0]
    qp, kp, vp = (pad(t, offsets).permute(0, 2, 1, 3).reshape(-1, N, D) for t in (q, k, v))
    s = torch.bmm(qp, kp.transpose(1, 2)) * ALPHA
    s = s + bias_fn().expand(-1, H, N, N).reshape(-1, N, N)
    s = F.silu(s) / N * torch.tril(torch.ones(N, N))
    o = torch.bmm(s, vp).view(-1, H, N, D).permute(0, 2, 1, 3)
    return unpad(o, offsets, L)


class RabModel(torch.nn.Module):
    """``forward(q, k, v, offsets, num_targets, timestamps)``; learned tables / dense biases."""

    def __init__(self, spelling, mask="causal", seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.spelling, self.mask = spelling, mask
        self.pos_w = torch.nn.Parameter(torch.randn(2 * N - 1, generator=g))
        self.ts_w = torch.nn.Parameter(torch.randn(NUM_BUCKETS + 1, generator=g))
        self.head_bias = torch.nn.Parameter(torch.randn(1, H, N, N, generator=g))

    def forward(self, q, k, v, offsets, nt, ts):
        sp, mask = self.spelling, self.mask
        rel = lambda: hstu_rel_bias(ts, offsets, self.pos_w, self.ts_w)  # noqa: E731
        if sp == "hstu_rel":  # [B, 1, N, N], silu(alpha * qk + rab)
            return _core(q, k, v, offsets, nt, rel, mask)
        if sp == "hstu_rel_alpha_after":  # silu(qk * alpha + rab)
            return _core(q, k, v, offsets, nt, rel, mask, where="alpha_after")
        if sp == "head_bias_inside_alpha":  # [1, H, N, N], silu((qk + rab) * alpha)
            return _core(q, k, v, offsets, nt, lambda: self.head_bias, mask, where="inside_alpha")
        if sp == "pos_embedding_nn":  # [N, N]
            return _core(q, k, v, offsets, nt, lambda: pos_bias_embedding(self.pos_w), mask)
        if sp == "pos_plus_ts_sigmoid":  # [N, N] + [B, 1, N, N]; x * sigmoid(x)
            def both():
                return pos_bias_embedding(self.pos_w) + ts_bias_index_select(ts, offsets, self.ts_w)[:, None]
            return _core(q, k, v, offsets, nt, both, mask, where="sigmoid")
        if sp == "bmm_flat":
            return _bmm_flat(q, k, v, offsets, nt, rel, mask)
        if sp == "gr_pad_repeat":  # pos [1, N, N] + ts [B, N, N], unsqueezed over heads
            def gr():
                return (pos_bias_pad_repeat(self.pos_w) + ts_bias_ext_cat(ts, offsets, self.ts_w)).unsqueeze(1)
            return _core(q, k, v, offsets, nt, gr, mask, where="alpha_after")
        if sp == "key_recency_b11n":  # [B, 1, 1, N]: a per-key bias broadcast over the queries
            def recency():
                tsp = pad(ts, offsets)
                age = (tsp.amax(dim=1, keepdim=True) - tsp) / 3600.0
                return self.ts_w[0] * torch.log1p(age)[:, None, None, :]
            return _core(q, k, v, offsets, nt, recency, mask)
        raise ValueError(sp)


def make_args(lengths, seed=0, requires_grad=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(lengths)
    L = int(offsets[-1])
    q, k, v = (torch.randn(L, H, D, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3))
    nt = torch.tensor([int(torch.randint(0, n + 1, (), generator=g)) for n in lengths])
    ts = torch.cumsum(torch.randint(0, 3000, (L,), generator=g), 0).to(dtype)  # seconds, ~all buckets
    return q, k, v, offsets, nt, ts


def _ops(report_or_gm):
    return [n for n in report_or_gm.graph.nodes if n.op == "call_function" and n.target is ATTN]


def _misses(report):
    return [r for kind, r in report.near_misses if kind == "attention"]


def _compile_check(model, lengths=LENGTHS, dynamic=False, train=False, expect=1, atol=1e-5):
    """Compile ``model`` with the rewrite backend; check the count and eager-equality on the compile
    inputs and on fresh ones (outputs, and with ``train`` every gradient). Returns the report."""
    compiled = torch.compile(model, backend=REWRITE_BACKEND, dynamic=dynamic)
    with collecting() as report:
        for seed, lens in ((1, lengths), (2, LENGTHS2)):
            args = make_args(lens, seed=seed, requires_grad=train)
            eargs = make_args(lens, seed=seed, requires_grad=train)
            with torch.set_grad_enabled(train):
                got, ref = compiled(*args), model(*eargs)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=atol)
            if train:
                g = torch.randn_like(ref)
                leaves = [*args[:3], *model.parameters()]
                eleaves = [*eargs[:3], *model.parameters()]
                gots = torch.autograd.grad(got, leaves, g, allow_unused=True)
                refs = torch.autograd.grad(ref, eleaves, g, allow_unused=True)
                for a, b in zip(gots, refs):
                    if b is None:
                        assert a is None or not a.abs().any()
                        continue
                    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    # the second batch has another L: one recompile (automatic dynamic), rewritten again
    assert report.graphs >= 1 and report.counts["attention"] == expect * report.graphs, report
    assert not _misses(report), report
    return report


# ---------------------------------------------------------------------------------------------
# 1. Bias before the silu -> rab
# ---------------------------------------------------------------------------------------------
RAB_CASES = [  # (spelling, mask): every spelling once, every mask option at least once
    ("hstu_rel", "causal"),
    ("hstu_rel", "targets_window"),
    ("hstu_rel_alpha_after", "contextual_targets"),
    ("head_bias_inside_alpha", "none"),
    ("head_bias_inside_alpha", "targets_window"),
    ("pos_embedding_nn", "causal"),
    ("pos_plus_ts_sigmoid", "contextual_targets"),
    ("bmm_flat", None),
    ("hstu_rel_alpha_after", "window_min_full"),
    ("key_recency_b11n", "causal"),
    ("gr_pad_repeat", "targets_window"),
]


# biases proven to be the position / bucketed-time tables go to the op's tables (path b,
# test_attention_rab_tables.py); the others are dense rab terms (path a)
TABLE_SPELLINGS = {"hstu_rel", "hstu_rel_alpha_after", "pos_embedding_nn", "pos_plus_ts_sigmoid", "bmm_flat",
                   "gr_pad_repeat"}


def _route(spelling):
    return "tables:" if spelling in TABLE_SPELLINGS else "rab="


@pytest.mark.parametrize("spelling,mask", RAB_CASES, ids=[f"{s}-{m}" for s, m in RAB_CASES])
def test_rab_rewritten_equal_to_eager(spelling, mask, fresh_dynamo):
    report = _compile_check(RabModel(spelling, mask))
    assert _route(spelling) in report.details[0][1], report.details
    assert ("rab=" in report.details[0][1]) == (spelling not in TABLE_SPELLINGS), report.details


@pytest.mark.parametrize("spelling,mask", [c for c in RAB_CASES if c[0] in TABLE_SPELLINGS][:3])
def test_rab_tables_off_dense_equal_to_eager(spelling, mask, fresh_dynamo):
    """``config.rab_tables = False``: the same biases as dense rab terms (path a), still eager-equal."""
    with hstu_inductor.config.patch(rab_tables=False):
        report = _compile_check(RabModel(spelling, mask), train=True)
    assert "rab=" in report.details[0][1] and "tables:" not in report.details[0][1], report.details


@pytest.mark.parametrize("spelling", ["hstu_rel", "pos_plus_ts_sigmoid", "head_bias_inside_alpha",
                                      "key_recency_b11n"])
def test_rab_training_gradients_reach_tables(spelling, fresh_dynamo):
    """Outputs and gradients of q, k, v, pos_w, ts_w and the dense head bias equal eager's."""
    _compile_check(RabModel(spelling, "targets_window"), train=True)


def test_rab_dynamic_true(fresh_dynamo):
    """``dynamic=True``: B, L symbolic; one rewrite, eager-equal on two batches of different L."""
    report = _compile_check(RabModel("hstu_rel", "contextual_targets"), dynamic=True)
    assert report.graphs == 1 and "tables:" in report.details[0][1]


GRAPH_CASES = [  # (spelling, rab shape the op gets, whether that is an expand of the user's bias)
    ("head_bias_inside_alpha", (1, H, N, N), False),
    ("key_recency_b11n", (len(LENGTHS), 1, N, N), True),
    ("pos_embedding_nn", (1, 1, N, N), False),
    ("bmm_flat", (len(LENGTHS), H, N, N), False),
]


@pytest.mark.parametrize("spelling,shape,expanded", GRAPH_CASES, ids=[c[0] for c in GRAPH_CASES])
def test_rab_graph_arguments(spelling, shape, expanded):
    """The op receives the user's bias as ``[B|1, H|1, N, N]`` (broadcast over queries or keys by an
    ``expand``, never copied) and alpha from the graph."""
    from test_attention_helpers import rewritten_graph

    model = RabModel(spelling, "causal")
    with hstu_inductor.config.patch(rab_tables=False):  # the dense layouts (table biases go to path b)
        gm, report = rewritten_graph(model, *make_args(LENGTHS))
    (op,) = _ops(gm)
    rab = op.args[12]
    assert tuple(rab.meta["val"].shape) == shape, rab.meta["val"].shape
    assert (rab.target is torch.ops.aten.expand.default) == expanded, rab.format_node()
    assert op.args[5] == pytest.approx(ALPHA) and op.args[13] is None


def _drop(arg):
    """The op's eager reference with ``arg`` ("rab" or "intervals") ignored: a poisoned op."""
    real = op_module.hstu_mha

    def poisoned(*a, **kw):
        if kw.get(arg) is not None:
            kw[arg] = None
        return real(*a, **kw)
    return poisoned


def test_rab_poisoned_op_changes_result(monkeypatch, fresh_dynamo):
    """With the op's rab ignored the compiled result is wrong: the rewrite really passes the bias."""
    model = RabModel("hstu_rel", "causal")
    monkeypatch.setattr(op_module, "hstu_mha", _drop("rab"))
    args = make_args(LENGTHS, seed=3)
    with collecting() as report, torch.no_grad():
        got = torch.compile(model, backend=REWRITE_BACKEND)(*args)
        ref = model(*args)
    assert report.counts["attention"] == 1
    assert not torch.allclose(got, ref, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# 2. Interval masks: TorchEasyRec SLA (our own code, mirroring its semantics)
# ---------------------------------------------------------------------------------------------
def sla_func(offsets, L, num_targets, k1, k2, contextual, heads):
    """NFUNC interval tensor ``[heads, 3, L]`` int32 of semi-local attention: history rows see
    ``[0, min(K2, p+1)) ∪ [max(K2, p-k1+1), p+1)``, target rows ``[0, history)``."""
    o = offsets.to(torch.int32)
    r = torch.arange(L, dtype=torch.int32, device=offsets.device)
    b = torch.searchsorted(o[1:], r, right=True)
    p = r - o[b]
    n = (o[1:] - o[:-1])[b]
    t = num_targets.to(torch.int32)[b] if num_targets is not None else torch.zeros_like(p)
    hist = torch.clamp(n - t, min=0)
    K2 = max(k2, contextual)
    is_hist = p < hist
    x0 = torch.where(is_hist, torch.clamp(p + 1, max=K2), hist)
    x1 = torch.where(is_hist, torch.clamp(p - k1 + 1, min=K2), hist)
    x2 = torch.where(is_hist, p + 1, hist)
    return torch.stack([x0, x1, x2], dim=0).unsqueeze(0).expand(heads, 3, L).contiguous()


def decode_fbgemm(func, offsets, n=N, strict=True):
    """``[B, Hf, N, N]`` bool from ``func [Hf, 3, L]``, padded with fbgemm (TorchEasyRec's route).
    ``strict=False`` writes ``>`` for ``>=`` (a near miss)."""
    Hf, _, L = func.shape
    d = torch.ops.fbgemm.jagged_to_padded_dense(func.permute(2, 0, 1).reshape(L, Hf * 3), [offsets], [n], 0)
    B = d.size(0)
    d = d.view(B, n, Hf, 3).permute(0, 2, 1, 3)
    col = torch.arange(n, dtype=torch.int32, device=func.device).view(1, 1, 1, n)
    lo = (col >= d[..., 1:2]) if strict else (col > d[..., 1:2])
    m = (col < d[..., 0:1]) | (lo & (col < d[..., 2:3]))
    return m & (col < lengths_of(offsets).to(torch.int32).view(B, 1, 1, 1))


def decode_index_put(func, offsets, n=N):
    """The same decode with our own pad (index_put of ``[L, Hf, 3]``), ``where`` on the mask."""
    x = pad(func.permute(2, 0, 1), offsets, n)  # [B, N, Hf, 3]
    col = torch.arange(n, device=func.device)
    x0, x1, x2 = (x[..., f].permute(0, 2, 1)[..., None] for f in range(3))  # [B, Hf, N, 1]
    m = (col < x0) | ((col >= x1) & (col < x2))
    return m & (col < lengths_of(offsets)[:, None, None, None])


def sla_attention(q, k, v, offsets, func, decode="fbgemm"):
    """TorchEasyRec-style ``pytorch_hstu_mha(attn_func=func)``: fbgemm pads heads-first, einsum,
    ``silu(qk * alpha) / N`` times the decoded mask, fbgemm unpad."""
    L, Hq, Dq = q.shape
    if decode == "fbgemm":
        qp, kp, vp = (torch.ops.fbgemm.jagged_to_padded_dense(t.reshape(L, Hq * Dq), [offsets], [N], 0.0)
                      .view(-1, N, Hq, Dq).transpose(1, 2) for t in (q, k, v))
        s = F.silu(torch.einsum("bhxa,bhya->bhxy", qp, kp) * ALPHA) / N
        s = s * decode_fbgemm(func, offsets)
        o = torch.einsum("bhxd,bhdv->bhxv", s, vp)
        return torch.ops.fbgemm.dense_to_jagged(o.transpose(1, 2).flatten(2, 3), [offsets], L)[0].view(L, Hq, Dq)
    qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
    s = F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) / N
    mask = decode_index_put(func, offsets) if decode == "index_put" else decode_fbgemm(func, offsets, strict=False)
    s = torch.where(mask, s, torch.zeros((), dtype=s.dtype))
    return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


class SLAModel(torch.nn.Module):
    """``forward(q, k, v, offsets, num_targets, ts)``: the interval tensor computed in the graph."""

    def __init__(self, k1, k2, contextual=0, targets=True, heads=H, decode="fbgemm"):
        super().__init__()
        self.k1, self.k2, self.c, self.targets, self.heads, self.decode = k1, k2, contextual, targets, heads, decode

    def forward(self, q, k, v, offsets, nt, ts):
        func = sla_func(offsets, q.shape[0], nt if self.targets else None, self.k1, self.k2, self.c, self.heads)
        return sla_attention(q, k, v, offsets, func, self.decode)


SLA_CONFIGS = [(k1, k2, c, t) for t in (False, True) for c in (0, 3) for k1, k2 in ((3, 2), (6, 0))]
needs_fbgemm = pytest.mark.skipif(not HAVE_FBGEMM, reason="fbgemm_gpu not importable")


@needs_fbgemm
@pytest.mark.parametrize("k1,k2,c,targets", SLA_CONFIGS,
                         ids=[f"k1={a}-k2={b}-c={c}-{'targets' if t else 'no_targets'}" for a, b, c, t in SLA_CONFIGS])
def test_sla_every_config_rewritten(k1, k2, c, targets, fresh_dynamo):
    """TorchEasyRec's 8 SLA configs (targets x contextual x (k1, k2)): one rewrite each, eager-equal."""
    report = _compile_check(SLAModel(k1, k2, c, targets))
    assert "intervals=" in report.details[0][1], report.details


@pytest.mark.parametrize("heads", [1, H])
def test_sla_index_put_decode(heads, fresh_dynamo):
    """Our own pad of the interval tensor (no fbgemm), ``where`` masking, one head or per head."""
    report = _compile_check(SLAModel(4, 2, 0, True, heads=heads, decode="index_put"))
    assert ("per head" if heads > 1 else "every head") in report.details[0][1], report.details


class IntervalInputModel(torch.nn.Module):
    """The generic per-row interval form: ``func [Hf, 3, L]`` is a graph input (random per head)."""

    def __init__(self, decode="index_put"):
        super().__init__()
        self.decode = decode

    def forward(self, q, k, v, offsets, func):
        return sla_attention(q, k, v, offsets, func, self.decode)


def _random_func(lengths, heads, seed):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    return torch.randint(0, N + 1, (heads, 3, L), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("decode", ["index_put", pytest.param("fbgemm", marks=needs_fbgemm)])
def test_interval_input_per_head_training(decode, fresh_dynamo):
    """Random (unordered too) per-head intervals as an input, training: outputs and q/k/v gradients."""
    model = IntervalInputModel(decode)
    compiled = torch.compile(model, backend=REWRITE_BACKEND)
    with collecting() as report:
        for seed, lens in ((1, LENGTHS), (2, LENGTHS2)):
            q, k, v, offsets, _, _ = make_args(lens, seed=seed, requires_grad=True)
            func = _random_func(lens, H, seed)
            got, ref = compiled(q, k, v, offsets, func), model(q, k, v, offsets, func)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
            g = torch.randn_like(ref)
            for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert report.counts["attention"] == report.graphs, report.near_misses


def test_intervals_poisoned_op_changes_result(monkeypatch, fresh_dynamo):
    model = IntervalInputModel()
    monkeypatch.setattr(op_module, "hstu_mha", _drop("intervals"))
    q, k, v, offsets, _, _ = make_args(LENGTHS, seed=4)
    func = _random_func(LENGTHS, H, 4)
    with collecting() as report, torch.no_grad():
        got = torch.compile(model, backend=REWRITE_BACKEND)(q, k, v, offsets, func)
        ref = model(q, k, v, offsets, func)
    assert report.counts["attention"] == 1
    assert not torch.allclose(got, ref, rtol=1e-3, atol=1e-4)


class RabSLAModel(torch.nn.Module):
    """Both at once: the original HSTU bias and an SLA interval mask."""

    def __init__(self):
        super().__init__()
        self.rab = RabModel("hstu_rel")

    def forward(self, q, k, v, offsets, nt, ts):
        L = q.shape[0]
        func = sla_func(offsets, L, nt, 3, 2, 0, 1)
        qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
        s = torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA
        s = F.silu(s + hstu_rel_bias(ts, offsets, self.rab.pos_w, self.rab.ts_w)) / N
        s = s * decode_index_put(func, offsets).to(s.dtype)
        return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


def test_rab_with_sla_dynamic_true_training(fresh_dynamo):
    report = _compile_check(RabSLAModel(), dynamic=True, train=True)
    assert "tables:" in report.details[0][1] and "intervals=" in report.details[0][1], report.details


# ---------------------------------------------------------------------------------------------
# 3. Near misses
# ---------------------------------------------------------------------------------------------
def _nm_bias_after_silu(q, k, v, offsets, nt, ts, bias):
    L = q.shape[0]
    qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
    s = (F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) + bias) / N
    s = s * hstu_mask(offsets)[:, None]
    return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


def _nm_bias_in_softmax(q, k, v, offsets, nt, ts, bias):
    L = q.shape[0]
    qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
    s = torch.softmax(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp) + bias, dim=-1)
    s = s * hstu_mask(offsets)[:, None]
    return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


def _nm_bias_from_v(q, k, v, offsets, nt, ts, bias):
    L = q.shape[0]
    qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
    vb = vp.sum(-1).permute(0, 2, 1)[:, :, None, :]  # [B, H, 1, N]: reads v
    s = F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp) + vb) / N
    s = s * hstu_mask(offsets)[:, None]
    return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


def _nm_data_mask(q, k, v, offsets, nt, ts, bias):
    """A per-element data mask (bias > 0 as a bool [B, 1, N, N]): not of interval form."""
    L = q.shape[0]
    qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
    s = F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) / N
    s = s * (bias > 0) * hstu_mask(offsets)[:, None]
    return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


def _nm_interval_gt(q, k, v, offsets, nt, ts, bias):
    """SLA intervals decoded with ``col > x1``: visibility differs from ``[x1, x2)``."""
    return sla_attention(q, k, v, offsets, sla_func(offsets, q.shape[0], nt, 3, 2, 0, 1), decode="gt")


NEAR_MISSES = {
    "bias_after_silu": (_nm_bias_after_silu, "bias"),
    "bias_in_softmax": (_nm_bias_in_softmax, "softmax"),
    "bias_from_v": (_nm_bias_from_v, "computed from q, k or v"),
    "data_mask": (_nm_data_mask, "data we do not model"),
    "interval_gt": (_nm_interval_gt, "interval tensor"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_not_rewritten(name, fresh_dynamo):
    if name == "interval_gt" and not HAVE_FBGEMM:
        pytest.skip("fbgemm_gpu not importable")
    fn, reason = NEAR_MISSES[name]
    args = make_args(LENGTHS, seed=5)
    bias = torch.randn(len(LENGTHS), 1, N, N, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        report = hstu_inductor.explain(fn, *args, bias, backend=REWRITE_BACKEND)
        expected = fn(*args, bias)
    assert report.counts["attention"] == 0, report
    assert any(reason in r for r in _misses(report)), report
    torch.testing.assert_close(report.output, expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 4. Production size under fake tensors (B=128, N=4096 static; nothing allocated)
# ---------------------------------------------------------------------------------------------
class _ProdRab(torch.nn.Module):
    def __init__(self, n, kind):
        super().__init__()
        self.n, self.kind = n, kind

    def forward(self, q, k, v, offsets, ts, pos_w, ts_w):
        n, L = self.n, q.shape[0]
        qp, kp, vp = (pad(t, offsets, n) for t in (q, k, v))
        s = torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA
        if self.kind == "hstu_rel":
            bias = hstu_rel_bias(ts, offsets, pos_w, ts_w, n)
        else:
            bias = (pos_bias_pad_repeat(pos_w, n) + ts_bias_ext_cat(ts, offsets, ts_w, n)).unsqueeze(1)
        s = F.silu(s + bias) / n
        return unpad(torch.einsum("bhnm,bmhd->bnhd", torch.tril(s), vp), offsets, L)


class _ProdSLA(torch.nn.Module):
    def __init__(self, n, k1, k2):
        super().__init__()
        self.n, self.k1, self.k2 = n, k1, k2

    def forward(self, q, k, v, offsets, nt):
        n, L = self.n, q.shape[0]
        func = sla_func(offsets, L, nt, self.k1, self.k2, 0, 1)
        qp, kp, vp = (pad(t, offsets, n) for t in (q, k, v))
        s = F.silu(torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA) / n
        s = s * decode_index_put(func, offsets, n).to(s.dtype)
        return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


def _rewrite_fake(model, extra_shapes, B=128, n=4096, heads=4, d=128):
    L = B * n - 3 * n // 2
    with FakeTensorMode():
        args = [torch.empty(L, heads, d) for _ in range(3)] + [torch.empty(B + 1, dtype=torch.int64)]
        args += [torch.empty(*(L if s == "L" else s for s in shape), dtype=dt) for shape, dt in extra_shapes]
        ep = torch.export.export(model, tuple(args))
    return rewrite_exported(ep)


@pytest.mark.parametrize("kind", ["hstu_rel", "gr_pad_repeat"])
def test_rab_production_size_fake(kind):
    n = 4096
    report, gm, secs = _rewrite_fake(_ProdRab(n, kind), [(("L",), torch.float32), ((2 * n - 1,), torch.float32),
                                                  ((NUM_BUCKETS + 1,), torch.float32)])
    assert report.counts["attention"] == 1, report.near_misses
    (op,) = _ops(gm)
    assert op.args[4] == n
    # the table bias proven at the real sizes (the pad-and-repeat's 2N - 1 / 3N - 2 included): path (b),
    # nothing [128, 1, N, N]
    assert op.args[12] is None and [tuple(a.meta["val"].shape) for a in op.args[14:18]] == \
        [(128 * n - 3 * n // 2,), (2 * n - 1,), (NUM_BUCKETS + 1,), (NUM_BUCKETS,)], op.format_node()
    print(f"\nrab ({kind}) at B=128, N=4096: {secs:.2f} s; {report.details}")


def test_sla_window_1024_production_size_fake():
    n = 4096
    report, gm, secs = _rewrite_fake(_ProdSLA(n, 1024, 16), [((128,), torch.int64)])
    assert report.counts["attention"] == 1, report.near_misses
    (op,) = _ops(gm)
    iv = op.args[13].meta["val"]
    assert op.args[4] == n and tuple(iv.shape) == (1, 128 * n - 3 * n // 2, 3), iv.shape
    print(f"\nSLA k1=1024 at B=128, N=4096: {secs:.2f} s; {report.details}")


@needs_fbgemm
def test_sla_int32_offsets(fresh_dynamo):
    """TorchEasyRec's offsets are int32 (fbgemm's complete cumsum): same rewrite, eager-equal."""
    model = SLAModel(3, 2, 3, True)
    compiled = torch.compile(model, backend=REWRITE_BACKEND)
    with collecting() as report, torch.no_grad():
        for seed, lens in ((1, LENGTHS), (2, LENGTHS2)):
            q, k, v, offsets, nt, ts = make_args(lens, seed=seed)
            args = (q, k, v, offsets.to(torch.int32), nt.to(torch.int32), ts)
            torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-4, atol=1e-5)
    assert report.counts["attention"] == report.graphs and not _misses(report), report


@pytest.mark.parametrize("kind", ["hstu_rel", "gr_pad_repeat", "sla"])
def test_value_level_proof_alone_equal_to_eager(kind, monkeypatch, fresh_dynamo):
    """The production-size route for real: with the probe budget lowered the probes do not run, so
    N=80 static is proven by meaning alone (as at B=128, N=4096); outputs and gradients (q, k, v,
    both tables) equal eager's."""
    from hstu_inductor.patterns import attn_prove

    monkeypatch.setattr(attn_prove, "_MAX_PROBE_ELEMS", 3e5)
    n, lengths = 80, [80, 0, 1, 57]
    model = _ProdSLA(n, 7, 5) if kind == "sla" else _ProdRab(n, kind)
    g = torch.Generator().manual_seed(6)
    q, k, v, offsets, nt, ts = make_args(lengths, seed=6, requires_grad=True)
    pos_w = torch.randn(2 * n - 1, generator=g).requires_grad_()
    ts_w = torch.randn(NUM_BUCKETS + 1, generator=g).requires_grad_()
    args = (q, k, v, offsets, nt) if kind == "sla" else (q, k, v, offsets, ts, pos_w, ts_w)
    with collecting() as report:
        got = torch.compile(model, backend=REWRITE_BACKEND)(*args)
    ref = model(*args)
    assert report.counts["attention"] == 1, report.near_misses
    if kind != "sla":  # the table bias proven by meaning (path b)
        assert "tables:" in report.details[0][1] and "rab=" not in report.details[0][1], report.details
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    leaves = [a for a in args if a.requires_grad]
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def _rab_n(q, k, v, offsets, ts, pos_w, ts_w, n, kind):
    return _ProdRab(n, kind)(q, k, v, offsets, ts, pos_w, ts_w)


def _sla_n(q, k, v, offsets, nt, n):
    return _ProdSLA(n, 3, 2)(q, k, v, offsets, nt)


@pytest.mark.parametrize("kind", ["hstu_rel", "gr_pad_repeat", "sla"])
def test_symbolic_max_len_equal_to_eager(kind, fresh_dynamo):
    """``N`` passed as an int that changes between calls (symbolic after one recompile; the tables
    change size with it): both graphs rewritten, the op gets the runtime N, eager-equal."""
    fn = _sla_n if kind == "sla" else _rab_n
    compiled = torch.compile(fn, backend=REWRITE_BACKEND)
    with collecting() as report, torch.no_grad():
        for n, lens in ((16, [16, 0, 1, 9]), (20, [20, 3, 7, 1]), (24, [1, 2, 24, 5])):
            q, k, v, offsets, nt, ts = make_args(lens, seed=n)
            g = torch.Generator().manual_seed(n)
            pos_w, ts_w = torch.randn(2 * n - 1, generator=g), torch.randn(NUM_BUCKETS + 1, generator=g)
            args = (q, k, v, offsets, nt, n) if kind == "sla" else (q, k, v, offsets, ts, pos_w, ts_w, n, kind)
            torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-4, atol=1e-5)
    assert report.counts["attention"] == report.graphs == 2 and not _misses(report), report
    assert "(symbolic)" in report.details[1][1], report.details


# ---------------------------------------------------------------------------------------------
# 5. Whole STU stacks (public style, tests/patterns/public_style_models.py): every block rewritten
# ---------------------------------------------------------------------------------------------
class _StackWithExtras(torch.nn.Module):
    """Two public-style STU layers whose attention carries an SLA interval mask built once per
    forward and shared by the layers (TorchEasyRec's STUStack) or a per-layer HSTU rab (GR)."""

    def __init__(self, kind, E=16):
        super().__init__()
        from public_style_models import PublicStyleLayer

        self.kind = kind
        self.layers = torch.nn.ModuleList(PublicStyleLayer(E, H, D, D, style="tzrec" if kind == "sla" else "gr")
                                          for _ in range(2))
        g = torch.Generator().manual_seed(7)
        self.pos_w = torch.nn.ParameterList(torch.nn.Parameter(0.3 * torch.randn(2 * N - 1, generator=g))
                                            for _ in range(2))
        self.ts_w = torch.nn.ParameterList(torch.nn.Parameter(0.3 * torch.randn(NUM_BUCKETS + 1, generator=g))
                                           for _ in range(2))

    def forward(self, x, offsets, nt, ts):
        from public_style_models import _fp32_layer_norm, output_block

        func = sla_func(offsets, x.shape[0], nt, 3, 2, 0, H) if self.kind == "sla" else None
        for idx, layer in enumerate(self.layers):
            dt = x.dtype
            normed = _fp32_layer_norm(x, layer.in_w.to(dt), layer.in_b.to(dt), layer.eps)
            uvqk = torch.addmm(layer.uvqk_b.to(dt), normed, layer.uvqk_w.to(dt))
            u, v, q, k = torch.split(uvqk, [H * D, H * D, H * D, H * D], dim=1)
            u = F.silu(u)
            q, k, v = q.view(-1, H, D), k.view(-1, H, D), v.view(-1, H, D)
            if self.kind == "sla":
                attn = sla_attention(q, k, v, offsets, func)
            else:
                qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
                s = torch.einsum("bnhd,bmhd->bhnm", qp, kp) * layer.alpha
                s = F.silu(s + hstu_rel_bias(ts, offsets, self.pos_w[idx], self.ts_w[idx])) / N
                attn = unpad(torch.einsum("bhnm,bmhd->bnhd", s * hstu_mask(offsets, nt)[:, None], vp),
                             offsets, q.shape[0])
            x = output_block(attn.reshape(-1, H * D), u, x, layer.out_nw.to(dt), layer.out_nb.to(dt),
                             layer.out_w.to(dt), layer.eps, 0.0, self.training, layer.concat, False, H, D)
        return x


@pytest.mark.parametrize("kind", [pytest.param("sla", marks=needs_fbgemm), "rab"])
def test_stu_stack_every_block_rewritten_training(kind, fresh_dynamo):
    """Attention (with intervals / rab), preprocess and output rewritten in both layers; training
    outputs and every gradient (parameters, tables, x) equal eager's."""
    model = _StackWithExtras(kind)
    compiled = torch.compile(model, backend=REWRITE_BACKEND)
    g = torch.Generator().manual_seed(8)
    _, _, _, offsets, nt, ts = make_args(LENGTHS, seed=8)
    x = torch.randn(int(offsets[-1]), 16, generator=g, requires_grad=True)
    with collecting() as report:
        got = compiled(x, offsets, nt, ts)
    ref = model(x, offsets, nt, ts)
    assert report.counts == {"attention": 2, "preprocess": 2, "output": 2}, report
    assert all(("intervals=" if kind == "sla" else "tables:") in d for k, d in report.details if k == "attention")
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    leaves = [x, *model.parameters()]
    grad = torch.randn_like(ref)
    gots = torch.autograd.grad(got, leaves, grad, allow_unused=True)
    refs = torch.autograd.grad(ref, leaves, grad, allow_unused=True)
    for a, b in zip(gots, refs):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def _row_info_mask(q, k, v, offsets, nt, ts):
    """A causal HSTU mask read from a per-row ``[L, 3]`` integer tensor (sequence, position,
    position) that is *not* an interval tensor: proven with it cut out (fails), then again with
    it left in the chain (the HSTU mask)."""
    L = q.shape[0]
    seq, pos = _row_ids(offsets, L)
    info = pad(torch.stack([seq, pos, pos], dim=-1), offsets)  # [B, N, 3]
    col = torch.arange(N)
    lens = lengths_of(offsets)[:, None, None]
    mask = (col[None, None, :] <= info[..., 2:3]) & (col[None, None, :] < lens) & (col[None, :, None] < lens)
    qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
    s = F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) / N * mask[:, None]
    return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


def test_row_info_tensor_is_no_interval_tensor(fresh_dynamo):
    report = _compile_check(_row_info_mask)
    assert "intervals=" not in report.details[0][1], report.details
