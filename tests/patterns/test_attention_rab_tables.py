"""Relative attention bias from two learned tables, recognised and computed by the op (path b).

A bias proven to be ``pos_w[c + j - i] + ts_w[bucket(ts(next(i)) - ts(j))]`` (docs/semantics.md; any
spelling: the original HSTU's pad-and-repeat position bias and fp32-log bucket of int64 timestamps,
an embedding over ``j - i``, ``index_select`` over bucketised float timestamps, a longer position table
read at an offset, ``torch.bucketize``; detached buckets or not) goes to
``hstu.attention(..., timestamps, pos_w, ts_w, ts_bounds)``: no dense ``rab``, nothing ``N x N`` in the
op's arguments, gradients reach both tables through the op. Outputs and gradients (q, k, v, both
tables) equal eager under ``torch.compile`` (static and ``dynamic=True``) and in exported programs.
The gap may also be ``ts(i) - ts(j)`` (the op's ``ts_next=False``). Near misses (a table read at ``i + j``, a
bucket ``% 7``, ``ts(i - 1) - ts(j)``, a position index that wraps
around) stay dense ``rab`` terms (path a), equal to eager too. Timestamps may also be a ``[B, N]`` input padded
by the caller (the original HSTU's ``all_timestamps``): its padding is data the bias reads at ``next(i)``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hstu_inductor.ops.attention  # noqa: F401  (registers torch.ops.hstu)
from hstu_inductor.patterns import attn_tables
from hstu_inductor.reference.rab import time_bucket_bounds, time_buckets
from hstu_inductor.report import collecting

from _helpers import REWRITE_BACKEND, offsets_from_lengths
from test_attention_rab import hstu_mask, pad, unpad

pytestmark = pytest.mark.skipif(not attn_tables.op_has_tables(), reason="hstu::attention takes no ts_bounds yet")

N, H, D, NB = 16, 2, 8, 12
ALPHA = 0.25
LENGTHS = [16, 0, 1, 9]
LENGTHS2 = [5, 16, 7, 2]
ATTN = torch.ops.hstu.attention.default


def _dt_next(tsp, n=N):
    """``ts(next(i)) - ts(j)`` as ``[B, N, N]`` (next(i) = min(i + 1, N - 1))."""
    nxt = torch.clamp(torch.arange(n, device=tsp.device) + 1, max=n - 1)
    return tsp[:, nxt].unsqueeze(-1) - tsp.unsqueeze(1)


class TableBias(torch.nn.Module):
    """``forward(q, k, v, offsets, ts)``: attention with a bias spelled ``spelling``."""

    def __init__(self, spelling, seed=0, pos_len=2 * N - 1, nb=NB):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.spelling, self.nb = spelling, nb
        self.pos_w = torch.nn.Parameter(torch.randn(pos_len, generator=g))
        self.ts_w = torch.nn.Parameter(torch.randn(nb + 1, generator=g))
        if spelling == "embedding":
            self.pos_emb = torch.nn.Embedding(2 * N - 1, 1)
            self.ts_emb = torch.nn.Embedding(NB + 1, 1)
        if spelling in ("per_head", "near_head_shift"):  # a column per head: nn.Embedding(V, H)
            self.pos_emb = torch.nn.Embedding(2 * N - 1, H)
            self.ts_emb = torch.nn.Embedding(NB + 1, H)
        if spelling == "per_head_time":
            self.ts_heads = torch.nn.Parameter(torch.randn(NB + 1, H, generator=g))
        if spelling == "with_head_bias":
            self.head_bias = torch.nn.Parameter(torch.randn(1, H, N, N, generator=g))
        if spelling == "float_bounds":  # float thresholds in a buffer (not a table), embedding modules
            self.register_buffer("fbounds", torch.logspace(0, 7, NB, dtype=torch.float64).round())
            self.pos_emb = torch.nn.Embedding(2 * N - 1, 1)
            self.ts_emb = torch.nn.Embedding(NB + 1, 1)
        if spelling.startswith("padded_input"):  # thresholds in seconds, kept as module state
            self.register_buffer("bounds", torch.tensor([1, 5, 30, 120, 600, 3600, 4 * 3600, 86400, 7 * 86400,
                                                         30 * 86400, 180 * 86400, 10 ** 9])[:NB])

    def bias(self, ts, offsets):
        sp = self.spelling
        i = torch.arange(N, device=ts.device)
        if sp in ("original", "with_head_bias", "near_mod7", "own_row", "near_prev_row", "inside_alpha",
                  "subtracted"):
            # the original HSTU's relative bias (our code): pad-and-repeat positions, int64 timestamps
            # extended by their last column, fp32 log buckets, detached, index_select
            tsp = pad(ts, offsets)
            B = tsp.size(0)
            t = F.pad(self.pos_w[: 2 * N - 1], [0, N]).repeat(N)
            t = t[..., :-N].reshape(1, N, 3 * N - 2)
            r = (2 * N - 1) // 2
            pos = t[:, :, r:-r]
            ext = torch.cat([tsp, tsp[:, N - 1:N]], dim=1)
            if sp == "own_row":  # ts(i) - ts(j): the op's ts_next=False
                dt = ext[:, :-1].unsqueeze(2) - ext[:, :-1].unsqueeze(1)
            elif sp == "near_prev_row":  # ts(i - 1) - ts(j): neither gap the op takes
                prev = (i - 1).clamp(min=0)
                dt = tsp[:, prev].unsqueeze(2) - tsp.unsqueeze(1)
            else:
                dt = ext[:, 1:].unsqueeze(2) - ext[:, :-1].unsqueeze(1)
            bucketed = (torch.log(torch.abs(dt).clamp(min=1)) / 0.301).long()
            if sp == "near_mod7":
                bucketed = bucketed % 7
            bucketed = torch.clamp(bucketed, min=0, max=self.nb).detach()
            tb = torch.index_select(self.ts_w, dim=0, index=bucketed.view(-1)).view(B, N, N)
            return (pos + tb).unsqueeze(1)
        if sp == "gr":  # float timestamps, cat'ed zeros for the pad-and-repeat, ts_w[bucket]
            tsp = pad(ts, offsets)
            t = torch.cat([self.pos_w, self.pos_w.new_zeros(N)]).repeat(N)[:-N]
            pos = t.view(1, N, 3 * N - 2)[:, :, N - 1: 2 * N - 1]
            ext = torch.cat([tsp, tsp[:, -1:]], dim=1)
            dt = ext[:, 1:, None] - ext[:, None, :-1]
            b = torch.clamp(torch.log(dt.abs().clamp(min=1.0)) / 0.301, 0, NB).long().detach()
            return (pos + self.ts_w[b]).unsqueeze(1)
        if sp == "embedding":  # nn.Embedding over j - i + N - 1 and over log2 buckets (float64 ts)
            pos = self.pos_emb(i[None, :] - i[:, None] + N - 1).squeeze(-1)
            dt = _dt_next(pad(ts.to(torch.float64), offsets))
            b = torch.floor(torch.log2(dt.abs() + 1.0) * 1.5).clamp(0, NB).to(torch.int64)
            return (pos[None] + self.ts_emb(b).squeeze(-1))[:, None]
        if sp == "index_select":  # float32 ts, buckets not detached; a longer position table at an offset
            tsp = pad(ts, offsets)
            dt = _dt_next(tsp).abs().clamp(min=1.0)
            b = (dt.log() / 0.301).floor().clamp(0, NB).to(torch.int64)
            tb = self.ts_w.index_select(0, b.reshape(-1)).view(b.shape)
            pos = self.pos_w[N + 1 + i[None, :] - i[:, None]]
            return pos + tb[:, None]
        if sp == "position_only":  # advanced indexing into a longer table, [N, N]
            return self.pos_w[N + 1 + i[None, :] - i[:, None]]
        if sp == "time_only":  # torch.bucketize of |dt| against constant boundaries (int32 ts)
            bounds = torch.tensor([2, 10, 60, 300, 1800, 3600, 7200, 20000, 86400, 200000, 10 ** 6, 10 ** 7],
                                  dtype=torch.int32, device=ts.device)
            dt = _dt_next(pad(ts.to(torch.int32), offsets))
            b = torch.bucketize(dt.abs(), bounds, right=True)
            return self.ts_w[b].unsqueeze(1)
        if sp == "searchsorted":  # torch.searchsorted of |dt| in constant boundaries (int64 ts, ms), detached
            bounds = torch.tensor([1, 10, 60, 300, 1800, 3600, 7200, 20000, 86400, 200000, 10 ** 6, 10 ** 7],
                                  device=ts.device) * 1000
            dt = _dt_next(pad(ts, offsets))
            b = torch.searchsorted(bounds, dt.abs().contiguous(), right=False).detach()
            return (self.pos_w[N - 1 + i[None, :] - i[:, None]] + self.ts_w[b])[:, None]
        if sp.startswith("padded_input"):  # the caller's padded [B, N] timestamps: next(i) by gather
            nxt = (i + 1).clamp(max=N - 1).expand(ts.shape[0], N)
            later = ts if sp == "padded_input_own_row" else ts.gather(1, nxt)
            b = torch.bucketize((later[:, :, None] - ts[:, None, :]).abs(), self.bounds, right=True)
            return (self.pos_w[N - 1 + i[None, :] - i[:, None]] + self.ts_w[b])[:, None]
        if sp == "float_bounds":  # next(i) by a left shift repeating the last column; bucketize in a buffer
            tsp = pad(ts, offsets)
            nxt = torch.cat([tsp[:, 1:], tsp[:, -1:]], dim=1)
            b = torch.bucketize((nxt.unsqueeze(2) - tsp.unsqueeze(1)).abs(), self.fbounds)
            pos = self.pos_emb(i.unsqueeze(0) - i.unsqueeze(1) + (N - 1)).squeeze(-1)
            return (self.ts_emb(b).squeeze(-1) + pos).unsqueeze(1)
        if sp in ("per_head", "near_head_shift"):
            # [B, N, N, H] gathers moved to the head axis; the near miss reads the next head's column
            tsp = pad(ts, offsets)
            b = torch.bucketize(_dt_next(tsp).abs(), self.fbounds_for(ts))
            rel = self.pos_emb(i[None, :] - i[:, None] + N - 1)  # [N, N, H]
            tim = self.ts_emb(b)  # [B, N, N, H]
            if sp == "near_head_shift":
                tim = tim.roll(1, dims=-1)
            return (rel[None] + tim).permute(0, 3, 1, 2)
        if sp == "per_head_time":  # a per-head time table by advanced indexing, a shared position table
            dt = _dt_next(pad(ts, offsets)).abs().clamp(min=1)
            b = (torch.log(dt.to(torch.float32)) / 0.301).long().clamp(0, NB)
            return self.ts_heads[b].permute(0, 3, 1, 2) + self.pos_w[N - 1 + i[None, :] - i[:, None]]
        if sp == "near_square":  # (|dt| - 300)^2 as x * x: not monotone in |dt|
            x = _dt_next(pad(ts, offsets)).abs().to(torch.float32) - 300.0
            b = (torch.log((x * x).clamp(min=1.0)) / 1.5).floor().clamp(0, NB).long()
            return self.ts_w[b].unsqueeze(1)
        if sp == "near_i_plus_j":
            return self.pos_w[i[None, :] + i[:, None]]
        if sp == "near_wraps":  # N - 2 + j - i: -1 at j - i = 1 - N reads the table's last row
            return self.pos_w[N - 2 + i[None, :] - i[:, None]]
        raise ValueError(sp)

    @staticmethod
    def fbounds_for(ts):
        return torch.tensor([1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 10 ** 6, 10 ** 7],
                            device=ts.device)[:NB]

    def forward(self, q, k, v, offsets, ts):
        L = q.shape[0]
        qp, kp, vp = (pad(t, offsets) for t in (q, k, v))
        if self.spelling == "inside_alpha":  # silu((qk + bias) * alpha): the op's tables times alpha
            s = (torch.einsum("bnhd,bmhd->bhnm", qp, kp) + self.bias(ts, offsets)) * ALPHA
        elif self.spelling == "subtracted":  # qk * alpha - bias: the tables negated
            s = torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA - self.bias(ts, offsets)
        else:
            s = torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA + self.bias(ts, offsets)
        if self.spelling == "with_head_bias":
            s = s + self.head_bias
        s = F.silu(s) / N * hstu_mask(offsets)[:, None]
        return unpad(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


TS_DTYPE = {"gr": torch.float32, "index_select": torch.float32, "embedding": torch.float64,
            "time_only": torch.int32}


def make_args(lengths, seed, spelling, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(lengths)
    L = int(offsets[-1])
    q, k, v = (torch.randn(L, H, D, generator=g).requires_grad_(requires_grad) for _ in range(3))
    # seconds with log-spread gaps (every bucket), some sequences out of order
    gaps = torch.exp(torch.rand(L, generator=g, dtype=torch.float64) * 16).floor()
    gaps = torch.where(torch.rand(L, generator=g) < 0.2, -gaps, gaps)
    ts = (1_700_000_000 + torch.cumsum(gaps, 0)).to(torch.int64)
    if spelling == "time_only":
        ts = ts - 1_700_000_000
    if spelling.startswith("padded_input"):  # [B, N], padded by the caller with other data (read at next(i))
        ts = torch.cat([ts, 1_700_000_000 + torch.randint(0, 10 ** 7, (len(lengths) * N,), generator=g)])
        ts = _padded(ts, offsets, L)
    return q, k, v, offsets, ts.to(TS_DTYPE.get(spelling, torch.int64))


def _padded(ts, offsets, L):
    """``[B, N]``: each sequence's timestamps, then the padding values that follow ``ts[:L]``."""
    rows, fill = [], L
    for b in range(offsets.numel() - 1):
        n = int(offsets[b + 1] - offsets[b])
        rows.append(torch.cat([ts[int(offsets[b]):int(offsets[b + 1])], ts[fill:fill + N - n]]))
        fill += N - n
    return torch.stack(rows)


def _tables_call(report):
    return [d for kind, d in report.details if kind == "attention"]


def _check(model, dynamic=False, train=True, expect_tables=True):
    compiled = torch.compile(model, backend=REWRITE_BACKEND, dynamic=dynamic)
    with collecting() as report:
        for seed, lens in ((1, LENGTHS), (2, LENGTHS2)):
            args = make_args(lens, seed, model.spelling, requires_grad=train)
            eargs = make_args(lens, seed, model.spelling, requires_grad=train)
            with torch.set_grad_enabled(train):
                got, ref = compiled(*args), model(*eargs)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
            if train:
                g = torch.randn_like(ref)
                params = [p for p in model.parameters()]
                gots = torch.autograd.grad(got, [*args[:3], *params], g, allow_unused=True)
                refs = torch.autograd.grad(ref, [*eargs[:3], *params], g, allow_unused=True)
                for a, b in zip(gots, refs):
                    if b is None:
                        assert a is None or not a.abs().any()
                        continue
                    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert report.graphs >= 1 and report.counts["attention"] == report.graphs, report
    details = _tables_call(report)
    for d in details:
        assert ("tables:" in d) == expect_tables, d
    return details


RECOGNISED = {  # spelling -> (tables expected in the report, a dense rab term expected too)
    "original": ("pos_w=", "ts_w="),
    "gr": ("pos_w=", "ts_w="),
    "embedding": ("pos_w=", "ts_w="),
    "index_select": ("pos_w=", "ts_w="),
    "position_only": ("pos_w=",),
    "time_only": ("ts_w=",),
    "inside_alpha": ("pos_w=", "ts_w="),
    "subtracted": ("pos_w=", "ts_w="),
    "searchsorted": ("pos_w=", "ts_w="),
    "padded_input": ("pos_w=", "ts_w="),
    "float_bounds": ("pos_w=", "ts_w="),
    "own_row": ("pos_w=", "ts_w="),
    "padded_input_own_row": ("pos_w=", "ts_w="),
    "per_head": ("pos_w=", "ts_w=", "per head"),
    "per_head_time": ("pos_w=", "ts_w=", "per head"),
}


# every spelling static and under dynamic=True; `make test` runs each in one of the two (alternating),
# `-m slow` the other
PATH_B = [pytest.param(sp, dyn, id=f"{sp}-{'dynamic' if dyn else 'static'}",
                       marks=[pytest.mark.slow] if (k + dyn) % 2 else [])
          for k, sp in enumerate(RECOGNISED) for dyn in (False, True)]


@pytest.mark.parametrize("spelling,dynamic", PATH_B)
def test_tables_to_path_b_training(spelling, dynamic, fresh_dynamo):
    """Rewritten with the tables (no dense rab); outputs and gradients of q, k, v and both tables equal eager."""
    details = _check(TableBias(spelling, pos_len=2 * N + 3 if spelling in ("index_select", "position_only")
                               else 2 * N - 1), dynamic=dynamic)
    for d in details:
        assert "rab=" not in d and all(w in d for w in RECOGNISED[spelling]), d
        assert ("ts_w=" in d) == ("ts_w=" in RECOGNISED[spelling]), d
        assert ("ts(i) - ts(j)" in d) == spelling.endswith("own_row"), d


def test_boundary_buffer_changed_after_compile(fresh_dynamo):
    """The thresholds were read from a module buffer: changed in place, the original graph runs instead
    (never the stale thresholds)."""
    model = TableBias("padded_input")
    compiled = torch.compile(model, backend=REWRITE_BACKEND)
    args = make_args(LENGTHS, 1, "padded_input")
    with collecting() as report, torch.no_grad():
        torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-4, atol=1e-5)
        model.bounds.mul_(3)
        torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-4, atol=1e-5)
    assert "tables:" in _tables_call(report)[0], report


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_rab_tables_auto(train, fresh_dynamo):
    """``config.rab_tables = "auto"`` (the default): the tables in training, where the dense path's bias
    build and its scatter into the tables dominate; the dense bias without gradients. Both eager-equal."""
    import hstu_inductor

    with hstu_inductor.config.patch(rab_tables="auto"):
        _check(TableBias("float_bounds"), train=train, expect_tables=train)


def test_tables_and_dense_term(fresh_dynamo):
    """Tables plus a learned dense ``[1, H, N, N]`` term: the tables to (b), the dense term to ``rab``."""
    details = _check(TableBias("with_head_bias"))
    assert all("tables: pos_w=" in d and "rab=" in d for d in details), details


def _graph(model, args):
    from test_attention_helpers import rewritten_graph

    gm, report = rewritten_graph(model, *args)
    (op,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ATTN]
    return gm, op, report


def test_op_arguments_original(fresh_dynamo):
    """The original spelling: rab None, the user's tables (pos_w a view when it is exactly [2N-1]), and the
    time buckets' map from ``hstu::time_bucket_map`` of the int64 timestamps and the fp32-log thresholds as a
    constant buffer (128 buckets: not the fp64 definition's); with ``bucket_map_mb = 0``, those straight to the
    op."""
    model = TableBias("original", nb=128)
    args = make_args(LENGTHS, 1, "original")
    gm, op, _ = _graph(model, args)
    rab, bmap, pos_w, ts_w = op.args[12], op.args[14], op.args[15], op.args[16]
    assert bmap.target is torch.ops.hstu.time_bucket_map.default and op.args[17:18] in ((), (None,))
    stamps, bounds = bmap.args[0], bmap.args[5]
    assert bmap.args[2:5] == (sum(LENGTHS), N, 128) and bmap.args[6:] == (True, True)  # ts(next(i)); causal
    with hstu_inductor.config.patch(bucket_map_mb=0):
        torch._dynamo.reset()
        _, op0, _ = _graph(model, args)
    assert op0.args[14].op == "placeholder" and op0.args[17].target is torch.ops.aten.lift_fresh_copy.default
    assert rab is None and stamps.op == "placeholder" and stamps.meta["val"].dtype == torch.int64
    assert pos_w.op == "placeholder" and ts_w.op == "placeholder"
    assert bounds.target is torch.ops.aten.lift_fresh_copy.default and bounds.args[0].op == "get_attr"
    got = getattr(gm, bounds.args[0].target)
    fp32 = time_bucket_bounds(128, torch.int64, lambda dt: torch.clamp(
        (torch.log(dt.abs().clamp(min=1)) / 0.301).long(), 0, 128))
    assert torch.equal(got, fp32), (got, fp32)
    assert not torch.equal(got, time_bucket_bounds(128, torch.int64, lambda dt: time_buckets(dt, 128)))
    # nothing N x N is computed for the op: every input of the call is a graph input, a view or a constant
    assert all(a is None or not isinstance(a, torch.fx.Node) or a.meta["val"].numel() < N * N
               or a.op == "placeholder" or a.target is torch.ops.aten.view.default for a in op.args[:12])


def test_op_arguments_offset_table(fresh_dynamo):
    """A table of 2N+3 rows read at ``N + 1 + j - i``: the op gets the window ``pos_w[2:2N+1]``."""
    model = TableBias("position_only", pos_len=2 * N + 3)
    _, op, report = _graph(model, make_args(LENGTHS, 1, "position_only"))
    pos_w = op.args[15]
    assert pos_w.target is torch.ops.aten.slice.Tensor and pos_w.args[2:] == (2, 2 + 2 * N - 1), pos_w.format_node()
    assert "pos_w=" in report.details[0][1] and "[2:2+2N-1]" in report.details[0][1]


NEAR = {
    "near_i_plus_j": "not read at c + j - i",
    "near_wraps": "table",
    "near_mod7": "not a monotone op",
    "near_prev_row": "bucket(ts(next(i)) - ts(j)) or bucket(ts(i) - ts(j))",
    "near_square": "reads the gap 2 times",
    "near_head_shift": "other than its head's",
}


@pytest.mark.parametrize("spelling", list(NEAR))
def test_near_misses_stay_dense(spelling, fresh_dynamo):
    """Not the table bias: rewritten with a dense rab (path a), the reason in the report; eager-equal."""
    details = _check(TableBias(spelling), train=True, expect_tables=False)
    assert all("rab=" in d and NEAR[spelling] in d for d in details), details


def test_export_tables(tmp_path):
    """``torch.export`` (``Dim.AUTO``): the rewritten program calls the op with the tables and the time buckets'
    map, made by ``hstu::time_bucket_map`` from the timestamps and the thresholds (a buffer of the program), and
    equals eager on other lengths."""
    import hstu_inductor.export as hx
    from torch.export import Dim

    model = TableBias("original").eval()
    args = make_args(LENGTHS, 1, "original")
    ep = torch.export.export(model, args, dynamic_shapes=tuple({0: Dim.AUTO} for _ in args))
    new_ep, report = hx.rewrite_exported_program(ep)
    assert report.counts["attention"] == 1 and "tables:" in report.details[0][1], report
    (op,) = [n for n in new_ep.graph.nodes if n.op == "call_function" and n.target is ATTN]
    assert op.args[12] is None and op.args[14].target is torch.ops.hstu.time_bucket_map.default
    assert op.args[14].args[5] is not None and len(op.args) <= 17 or op.args[17] is None
    for seed, lens in ((3, LENGTHS2), (4, [3, 16, 11])):
        a = make_args(lens, seed, "original")
        with torch.no_grad():
            torch.testing.assert_close(new_ep.module()(*a), model(*a), rtol=1e-4, atol=1e-5)


@pytest.mark.heavy
def test_aoti_package_tables(tmp_path):
    """AOTInductor (CPU): the package with the table bias loads and equals eager."""
    import hstu_inductor.export as hx
    from torch.export import Dim

    model = TableBias("original").eval()
    args = make_args(LENGTHS, 1, "original")
    result = hx.export_and_package(model, args, dynamic_shapes=tuple({0: Dim.AUTO} for _ in args),
                                   package_path=str(tmp_path / "tables.pt2"))
    assert "tables:" in result.report.details[0][1], result.report
    runner = torch._inductor.aoti_load_package(result.package_path)
    for seed, lens in ((3, LENGTHS2), (4, [3, 16, 11])):
        a = make_args(lens, seed, "original")
        with torch.no_grad():
            torch.testing.assert_close(runner(*a), model(*a), rtol=1e-4, atol=1e-5)


def test_bucket_check_rejects_non_monotone():
    """``check_bounds`` is what makes thresholds a proof: a bucket ``% 7`` has thresholds (bisection
    returns something) but they do not describe it."""
    from hstu_inductor.patterns.prover import Decline

    fn = lambda dt: (torch.log(dt.abs().clamp(min=1)) / 0.301).long() % 7  # noqa: E731
    b = time_bucket_bounds(NB, torch.int64, fn)
    with pytest.raises(Decline, match="monotone"):
        attn_tables.check_bounds(fn, b, NB, torch.int64)
    ok = lambda dt: torch.clamp((torch.log(dt.abs().clamp(min=1)) / 0.301).long(), 0, NB)  # noqa: E731
    attn_tables.check_bounds(ok, time_bucket_bounds(NB, torch.int64, ok), NB, torch.int64)


@pytest.mark.parametrize("kind", ["hstu_rel", "gr_pad_repeat"])
def test_symbolic_max_len_tables_training(kind, fresh_dynamo):
    """``N`` passed as an int that changes between calls (symbolic after one recompile), the tables
    of ``2N - 1`` rows inputs of their own size: path (b) in both graphs (the op's ``pos_w`` a slice
    up to ``2N - 1`` of the runtime N), outputs and gradients of q, k, v and both tables equal eager."""
    from test_attention_rab import NUM_BUCKETS, _rab_n
    from test_attention_rab import make_args as rab_args

    compiled = torch.compile(_rab_n, backend=REWRITE_BACKEND)
    with collecting() as report:
        for n, lens in ((16, [16, 0, 1, 9]), (20, [20, 3, 7, 1]), (24, [1, 2, 24, 5])):
            q, k, v, offsets, _, ts = rab_args(lens, seed=n, requires_grad=True)
            g = torch.Generator().manual_seed(n)
            pos_w = torch.randn(2 * n - 1, generator=g).requires_grad_()
            ts_w = torch.randn(NUM_BUCKETS + 1, generator=g).requires_grad_()
            args = (q, k, v, offsets, ts, pos_w, ts_w, n, kind)
            got, ref = compiled(*args), _rab_n(*args)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
            gr = torch.randn_like(ref)
            leaves = (q, k, v, pos_w, ts_w)
            for a, b in zip(torch.autograd.grad(got, leaves, gr), torch.autograd.grad(ref, leaves, gr)):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert report.counts["attention"] == report.graphs == 2, report
    assert "(symbolic)" in report.details[1][1] and all("tables:" in d and "rab=" not in d
                                                         for _, d in report.details), report.details


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "dynamic"])
@pytest.mark.parametrize("spelling", ["original", "gr", "time_only", "padded_input"])
def test_gpu_tables_compile_modes(spelling, mode):
    """CUDA, ``backend="hstu"``: the kernels' table bias with the user's thresholds, under the default
    mode, ``reduce-overhead`` (CUDA graphs; the thresholds are a lifted buffer) and ``dynamic=True``;
    training outputs and table gradients equal eager (fp32, kernel tolerances)."""
    torch._dynamo.reset()
    model = TableBias(spelling, nb=128 if spelling == "original" else NB).cuda()
    kw = {"dynamic": True} if mode == "dynamic" else {"mode": mode} if mode != "default" else {}
    compiled = torch.compile(model, backend="hstu", **kw)
    with collecting() as report:
        for step, (seed, lens) in enumerate(((1, LENGTHS), (2, LENGTHS2), (1, LENGTHS), (2, LENGTHS2))):
            args = [a.cuda() for a in make_args(lens, seed, spelling)]
            for a in args[:3]:
                a.requires_grad_()
            got, ref = compiled(*args), model(*args)
            torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-4)
            g = torch.randn_like(ref)
            leaves = [*args[:3], model.pos_w, model.ts_w]
            for a, b in zip(torch.autograd.grad(got, leaves, g, allow_unused=True),
                            torch.autograd.grad(ref, leaves, g, allow_unused=True)):
                if b is not None:
                    torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    assert report.counts["attention"] >= 1 and all("tables:" in d for _, d in report.details), report


def test_subtracted_bias_dense_path(fresh_dynamo):
    """``qk * alpha - bias`` with the tables off: a dense term of sign -1 (``rab=-<bias>``), eager-equal
    (``scores - R`` was once read as ``R - scores`` and declined)."""
    import hstu_inductor

    with hstu_inductor.config.patch(rab_tables=False):
        details = _check(TableBias("subtracted"), expect_tables=False)
    assert all("rab=-" in d for d in details), details


def test_original_production_size_fake():
    """B=128, N=4096 static under fake tensors (nothing allocated): the original spelling (pad-and-repeat
    positions, fp32-log buckets of int64 timestamps, 128 buckets) is proven at the real sizes and
    goes to the tables; the thresholds are the fp32 ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from _rewrite import rewrite_exported

    n, B, nb = 4096, 128, 128

    class Prod(torch.nn.Module):
        def forward(self, q, k, v, offsets, ts, pos_w, ts_w):
            L = q.shape[0]
            qp, kp, vp = (pad(t, offsets, n) for t in (q, k, v))
            tsp = pad(ts, offsets, n)
            t = F.pad(pos_w[: 2 * n - 1], [0, n]).repeat(n)[..., :-n].reshape(1, n, 3 * n - 2)
            pos = t[:, :, n - 1: 2 * n - 1]
            ext = torch.cat([tsp, tsp[:, n - 1:n]], dim=1)
            bk = torch.clamp((torch.log(torch.abs(ext[:, 1:].unsqueeze(2) - ext[:, :-1].unsqueeze(1)).clamp(min=1))
                              / 0.301).long(), min=0, max=nb).detach()
            bias = (pos + torch.index_select(ts_w, 0, bk.view(-1)).view(-1, n, n)).unsqueeze(1)
            s = F.silu(torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA + bias) / n
            return unpad(torch.einsum("bhnm,bmhd->bnhd", torch.tril(s), vp), offsets, L)

    L = B * n - 3 * n // 2
    with FakeTensorMode():
        args = [torch.empty(L, 4, 128) for _ in range(3)] + [torch.empty(B + 1, dtype=torch.int64),
                                                              torch.empty(L, dtype=torch.int64),
                                                              torch.empty(2 * n - 1), torch.empty(nb + 1)]
        ep = torch.export.export(Prod(), tuple(args))
    report, gm, secs = rewrite_exported(ep)
    assert report.counts["attention"] == 1, report.near_misses
    (op,) = [x for x in gm.graph.nodes if x.op == "call_function" and x.target is ATTN]
    assert op.args[12] is None and "tables:" in report.details[0][1], report.details
    bounds = op.args[17]
    while bounds.op != "get_attr":
        bounds = bounds.args[0]
    fp32 = time_bucket_bounds(nb, torch.int64, lambda dt: torch.clamp(
        (torch.log(dt.abs().clamp(min=1)) / 0.301).long(), 0, nb))
    assert torch.equal(getattr(gm, bounds.target), fp32)
    print(f"\noriginal spelling at B=128, N=4096: {secs:.2f} s; {report.details}")


def test_per_head_production_size_fake():
    """B=128, N=4096, H=4 static under fake tensors: per-head tables (``[2N-1, H]`` position rows by ``j - i``,
    ``[nb+1, H]`` time rows by an fp32-log bucket of the gap ``ts(i) - ts(j)``, gathered to ``[B, N, N, H]`` and
    moved to the head axis)
    are proven at the real sizes by the meaning prover and go to the op as ``[H, ...]`` tables."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from _rewrite import rewrite_exported

    n, B, nb, heads = 4096, 128, 64, 4

    class Prod(torch.nn.Module):
        def forward(self, q, k, v, offsets, ts, pos_w, ts_w):
            L = q.shape[0]
            qp, kp, vp = (pad(t, offsets, n) for t in (q, k, v))
            tsp = pad(ts, offsets, n)
            i = torch.arange(n, device=q.device)
            rel = pos_w[n - 1 + i[None, :] - i[:, None]]  # [n, n, H]
            dt = (tsp[:, :, None] - tsp[:, None, :]).abs().clamp(min=1)
            tim = ts_w[(torch.log(dt.to(torch.float32)) / 0.301).long().clamp(0, nb)]  # [B, n, n, H]
            bias = (rel[None] + tim).permute(0, 3, 1, 2)
            s = F.silu(torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA + bias) / n
            return unpad(torch.einsum("bhnm,bmhd->bnhd", torch.tril(s), vp), offsets, L)

    L = B * n - 3 * n // 2
    with FakeTensorMode():
        args = [torch.empty(L, heads, 128) for _ in range(3)] + [torch.empty(B + 1, dtype=torch.int64),
                                                                  torch.empty(L, dtype=torch.int64),
                                                                  torch.empty(2 * n - 1, heads),
                                                                  torch.empty(nb + 1, heads)]
        ep = torch.export.export(Prod(), tuple(args))
    report, gm, secs = rewrite_exported(ep)
    assert report.counts["attention"] == 1, report.near_misses
    (op,) = [x for x in gm.graph.nodes if x.op == "call_function" and x.target is ATTN]
    detail = report.details[0][1]
    assert op.args[12] is None and "pos_w=" in detail and "ts_w=" in detail, detail
    assert detail.count("per head") == 2 and "ts(i) - ts(j)" in detail, detail
    assert [tuple(op.args[k].meta["val"].shape) for k in (15, 16)] == [(heads, 2 * n - 1), (heads, nb + 1)]
