"""The value-level prover (``patterns/attn_meaning.py``, ``patterns/core/``): decisions by meaning.

Spellings that equal HSTU by meaning but that no list of op sequences anticipates: a re-associated row
index, a mask kept as a module buffer, a loop over heads with in-place ops, attention over packed rows.
Each is rewritten and equal to eager (fresh random inputs, fp32 relative-norm bounds, gradients too);
each has a near miss that must stay one. Plus the core on its own: a scatter whose index map is not
injective, a sequence search that depends on empty sequences, ranges that make ``(b*N + p) // N`` be ``b``.
"""
from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F

import hstu_inductor
from hstu_inductor.patterns.core import decide
from hstu_inductor.patterns.core.domain import Domain, off
from _helpers import REWRITE_BACKEND

E, H, D, N = 16, 2, 8, 16
LENGTHS = [16, 0, 1, 9]


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


class _Layer(torch.nn.Module):
    def __init__(self, variant="hstu"):
        super().__init__()
        self.variant = variant
        self.ln = torch.nn.LayerNorm(E)
        self.proj = torch.nn.Linear(E, 4 * H * D)
        self.ln_out = torch.nn.LayerNorm(H * D)
        self.out = torch.nn.Linear(H * D, E)

    def rows(self, offsets, L):
        seg = torch.searchsorted(offsets, torch.arange(L), right=True) - 1
        return seg, torch.arange(L) - offsets[seg]

    def forward(self, x, offsets):
        u, v, q, k = self.proj(self.ln(x)).split(H * D, dim=-1)
        return x + self.out(F.silu(u) * self.ln_out(self.attend(q, k, v, offsets)))


class Reassociated(_Layer):
    """``index_copy`` pad at ``seg * N + arange(L) - offsets[seg]`` (no parentheses around the position)."""

    def attend(self, q, k, v, offsets):
        L, B = q.shape[0], offsets.numel() - 1
        seg, _ = self.rows(offsets, L)
        row = seg * N + torch.arange(L) - offsets[seg]
        shift = 1 if self.variant == "off_by_one" else 0

        def pad(t):
            return torch.zeros(B * N, H * D).index_copy(0, (row + shift).clamp(max=B * N - 1), t).view(B, N, H, D)
        s = torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k))
        p = F.silu(s / D ** 0.5) * torch.ones(N, N).tril() / N
        return torch.einsum("bhnm,bmhd->bnhd", p, pad(v)).reshape(B * N, H * D)[row]


class BufferMask(_Layer):
    """The original HSTU's mask: a ``triu(ones(N, N), 1)`` buffer, ``1 - mask`` multiplied in."""

    def __init__(self, variant="hstu"):
        super().__init__(variant)
        self.register_buffer("attn_mask", torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=1))

    def attend(self, q, k, v, offsets):
        L, B = q.shape[0], offsets.numel() - 1
        seg, pos = self.rows(offsets, L)

        def pad(t):
            return torch.zeros(B, N, H * D).index_put((seg, pos), t).view(B, N, H, D)
        keep = 1.0 - self.attn_mask.float()
        p = F.silu(torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k)) / D ** 0.5) / N * keep
        return torch.einsum("bhnm,bmhd->bnhd", p, pad(v))[seg, pos].reshape(L, H * D)


class HeadLoop(_Layer):
    """A Python loop over heads on slices of one padded tensor; ``masked_fill_`` whose result is discarded."""

    def attend(self, q, k, v, offsets):
        L, B = q.shape[0], offsets.numel() - 1
        seg, pos = self.rows(offsets, L)

        def pad(t):
            return torch.zeros(B, N, H * D).index_put((seg, pos), t)
        qp, kp, vp = pad(q), pad(k), pad(v)
        keep = torch.ones(N, N, dtype=torch.bool).tril(1 if self.variant == "off_by_one" else 0)
        heads = []
        for h in range(H):
            cols = slice(h * D, (h + 1) * D)
            s = F.silu(torch.bmm(qp[:, :, cols], kp[:, :, cols].transpose(1, 2)) / D ** 0.5, inplace=True)
            s.masked_fill_(~keep, 0.0)  # in place: the product below reads the masked scores
            heads.append(torch.bmm(s, vp[:, :, cols]) / N)
        return torch.cat(heads, -1)[seg, pos]


class Packed(_Layer):
    """Scores over the packed rows ``[H, L, L]``, a same-sequence causal mask (FlexAttention's document
    mask); variants: a window of 3 on positions, and the near miss without the same-sequence term."""

    def attend(self, q, k, v, offsets):
        L = q.shape[0]
        seg, pos = self.rows(offsets, L)
        qh, kh, vh = (t.view(L, H, D).transpose(0, 1) for t in (q, k, v))
        s = qh @ kh.transpose(1, 2) / D ** 0.5
        r = torch.arange(L)
        m = r[:, None] >= r[None, :]
        if self.variant != "cross_sequence":
            m = m & (seg[:, None] == seg[None, :])
        if self.variant == "window":
            m = m & (pos[:, None] - pos[None, :] <= 3)
        return ((F.silu(s) * m / N) @ vh).transpose(0, 1).reshape(L, H * D)


class BufferPositions(_Layer):
    """Positions kept as a module buffer and read by the pad (a gather at ``offsets[b] + pos[n]``, zeroed
    past each length) and by the causal mask. Near miss: the buffer ``arange(N).clamp(min=1)`` (slot 0
    reads a sequence's second row)."""

    def __init__(self, variant="hstu"):
        super().__init__(variant)
        pos = torch.arange(N)
        self.register_buffer("pos", pos.clamp(min=1) if variant == "clamped" else pos)

    def attend(self, q, k, v, offsets):
        L = q.shape[0]
        seg, at = self.rows(offsets, L)
        valid = (self.pos[None, :] < (offsets[1:] - offsets[:-1])[:, None])[..., None]

        def pad(t):
            return (t[(offsets[:-1, None] + self.pos[None, :]).clamp(max=L - 1)] * valid).view(-1, N, H, D)
        p = F.silu(torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k)) / D ** 0.5) / N
        p = p * (self.pos[None, :] <= self.pos[:, None])
        return torch.einsum("bhnm,bmhd->bnhd", p, pad(v))[seg, at].reshape(L, H * D)


class MaskAssigned(_Layer):
    """Padded by boolean-mask assignment ``dense[valid] = t`` and unpadded by a flat mask over the
    ``[B * N]`` rows (``dense.reshape(B * N, -1)[valid.flatten()]``). Near miss: the unpad's mask built from
    the lengths rolled by one sequence (as many rows, the wrong ones)."""

    def attend(self, q, k, v, offsets):
        B = offsets.numel() - 1
        lengths = offsets[1:] - offsets[:-1]
        valid = torch.arange(N)[None, :] < lengths[:, None]
        keep = valid if self.variant != "shifted" else torch.arange(N)[None, :] < lengths.roll(1)[:, None]

        def pad(t):
            dense = t.new_zeros(B, N, H * D)
            dense[valid] = t
            return dense.view(B, N, H, D)
        p = F.silu(torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k)) / D ** 0.5) * torch.ones(N, N).tril() / N
        out = torch.einsum("bhnm,bmhd->bnhd", p, pad(v)).reshape(B * N, H * D)
        return out[keep.flatten()]


class CumsumMask(_Layer):
    """Causal mask from running counts of a ``[N, N]`` ones matrix, ``cumsum(1) <= cumsum(0)`` (``j + 1 <= i + 1``).
    Near miss: ``<`` (a row never sees itself)."""

    def attend(self, q, k, v, offsets):
        L, B = q.shape[0], offsets.numel() - 1
        seg, pos = self.rows(offsets, L)
        ones = torch.ones(N, N)
        mask = ones.cumsum(1) < ones.cumsum(0) if self.variant == "strict" else ones.cumsum(1) <= ones.cumsum(0)

        def pad(t):
            return torch.zeros(B, N, H * D).index_put((seg, pos), t).view(B, N, H, D)
        p = F.silu(torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k)) / D ** 0.5) * mask / N
        return torch.einsum("bhnm,bmhd->bnhd", p, pad(v))[seg, pos].reshape(L, H * D)


class NonzeroRows(_Layer):
    """Rows from ``nonzero`` of the padding mask: ``b, t = nonzero(valid, as_tuple=True)``, pad ``dense[b, t] = x``
    and unpad ``out[b, t]``; variant ``flat``: pad ``dense[valid] = x``, unpad through ``nonzero`` of the flattened
    mask. Near miss: the unpad's mask from the lengths rolled by one sequence. (A nonzero's row count is an
    unbacked size: its rows are jagged rows where Dynamo's shape environment knows it equals ``L``, e.g. once
    the unpad's rows meet the residual.)"""

    def attend(self, q, k, v, offsets):
        B = offsets.numel() - 1
        lengths = offsets[1:] - offsets[:-1]
        valid = torch.arange(N)[None, :] < lengths[:, None]
        b, t = torch.nonzero(valid, as_tuple=True)

        def pad(x):
            dense = x.new_zeros(B, N, H * D)
            if self.variant == "flat":
                dense[valid] = x
            else:
                dense[b, t] = x
            return dense.view(B, N, H, D)
        p = F.silu(torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k)) / D ** 0.5) * torch.ones(N, N).tril() / N
        out = torch.einsum("bhnm,bmhd->bnhd", p, pad(v)).reshape(B, N, H * D)
        if self.variant == "flat":
            return out.reshape(B * N, H * D)[torch.nonzero(valid.flatten()).squeeze(1)]
        if self.variant == "shifted":
            b, t = torch.nonzero(torch.arange(N)[None, :] < lengths.roll(1)[:, None], as_tuple=True)
        return out[b, t]


class IndicesMask(_Layer):
    """Causal mask set through ``m[tuple(torch.tril_indices(N, N))] = True``. Near miss: ``triu_indices`` with
    offset 1 (a row sees only later keys)."""

    def attend(self, q, k, v, offsets):
        L, B = q.shape[0], offsets.numel() - 1
        seg, pos = self.rows(offsets, L)
        mask = torch.zeros(N, N, dtype=torch.bool)
        pairs = torch.triu_indices(N, N, 1) if self.variant == "upper" else torch.tril_indices(N, N)
        mask[tuple(pairs)] = True

        def pad(t):
            return torch.zeros(B, N, H * D).index_put((seg, pos), t).view(B, N, H, D)
        p = torch.where(mask, F.silu(torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k)) / D ** 0.5), 0.0) / N
        return torch.einsum("bhnm,bmhd->bnhd", p, pad(v))[seg, pos].reshape(L, H * D)


def _inputs(seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    x = torch.randn(int(offsets[-1]), E, generator=g).requires_grad_(requires_grad)
    return x, offsets


def _check(model, dynamic, attention):
    torch.manual_seed(0)
    x, offsets = _inputs()
    report = hstu_inductor.explain(model, x, offsets, dynamic=dynamic, backend=REWRITE_BACKEND)
    assert report.counts["attention"] == attention, report
    xe = x.detach().clone().requires_grad_()
    want = model(xe, offsets)
    assert _rel(report.output, want) < 1e-5
    g = torch.randn_like(want)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(report.output, [x, *params], g), torch.autograd.grad(want, [xe, *params], g)):
        assert _rel(a, b) < 1e-4
    return report


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("cls,heads", [(Reassociated, 1), (BufferMask, 1), (HeadLoop, H), (Packed, 1),
                                       (BufferPositions, 1), (MaskAssigned, 1), (CumsumMask, 1), (NonzeroRows, 1),
                                       (IndicesMask, 1)])
def test_rewritten_by_meaning(cls, heads, dynamic):
    _check(cls(), dynamic, heads)


def test_nonzero_of_the_flattened_mask():
    _check(NonzeroRows("flat"), True, 1)


def test_packed_window():
    report = _check(Packed("window"), False, 1)
    assert "max_attn_len=3" in report.details[0][1], report.details


@pytest.mark.parametrize("cls,variant", [(Reassociated, "off_by_one"), (HeadLoop, "off_by_one"),
                                         (Packed, "cross_sequence"), (BufferPositions, "clamped"),
                                         (MaskAssigned, "shifted"), (CumsumMask, "strict"),
                                         (NonzeroRows, "shifted"), (IndicesMask, "upper")])
def test_near_misses_by_meaning(cls, variant):
    """Declined (the pad reads the next row; the mask lets a row see the next one; rows see other
    sequences), and still equal to eager."""
    report = _check(cls(variant), False, 0)
    assert report.near_misses, report


def test_buffer_changed_after_compile_runs_the_original_graph():
    """The rewrite rests on the buffer's value: changed in place, the original graph runs instead."""
    torch.manual_seed(0)
    model = BufferMask()
    x, offsets = _inputs(requires_grad=False)
    compiled = torch.compile(model, backend=REWRITE_BACKEND)
    assert _rel(compiled(x, offsets), model(x, offsets)) < 1e-5
    with torch.no_grad():
        model.attn_mask.copy_(torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=2))  # now not causal
    assert _rel(compiled(x, offsets), model(x, offsets)) < 1e-5


def test_reassociated_pad_at_production_size():
    """B=128, N=4096 static under fake tensors: the row index ``seg * N + arange(L) - offsets[seg]`` is
    ``b*N + p`` whatever the sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hstu_inductor.report import collecting
    global N
    old, N = N, 4096
    try:
        with FakeTensorMode() as mode:
            model = Reassociated()
            L = 128 * 4096 - 3000
            x, offsets = torch.empty(L, E), torch.empty(129, dtype=torch.int64)
        torch._dynamo.reset()
        with collecting() as report, mode, torch.no_grad():
            try:
                torch.compile(model, backend=REWRITE_BACKEND, dynamic=False)(x, offsets)
            except Exception:  # running on fake inputs of a mode without a shape env: compiled by then
                pass
    finally:
        N = old
    assert report.counts["attention"] == 1, report
    assert report.proofs and report.proofs[0][2] < 10.0


# -- the core on its own ----------------------------------------------------------------------


def test_ranges_make_row_index_arithmetic_exact():
    n = sympy.Symbol("n", positive=True, integer=True)
    dom = Domain(8, n, 100)
    b = dom.sequence()
    p = dom.coord("p", n)
    assert dom.floordiv(b * n + p, n) == b and dom.mod(b * n + p, n) == p
    # (3n - 2) i mod (3n - 1) is -i: the balanced remainder of a coefficient
    i, j = dom.coord("i", n), dom.coord("j", n)
    assert sympy.expand(dom.mod(3 * i * n - 2 * i + j + n - 1, 3 * n - 1) - (j - i + n - 1)) == 0


def test_decide_refutes_with_a_counterexample():
    dom = Domain(4, 16, 40)
    b, p, r = dom.row()
    ok, _ = decide.valid(dom, sympy.Lt(p, dom.length(b)))
    assert ok
    ok, cex = decide.valid(dom, sympy.Lt(p + 1, dom.length(b)))
    assert ok is False and isinstance(cex, dict)
    # offsets are non-decreasing: off(b) <= off(b + 1) for every b
    ok, _ = decide.valid(dom, sympy.Le(off(b), dom.canon(off(b + 1))))
    assert ok


def test_a_coordinate_over_an_empty_dim_proves_nothing_else():
    """A coordinate over an empty dim (``offsets[1:-1]`` of a batch of one) has no value; its range must not
    enter the facts of formulas that do not read it, where it would make every formula valid."""
    dom = Domain(4, 16, 40)
    b, p, r = dom.row()
    dom.coord("z", 0)
    ok, cex = decide.valid(dom, sympy.Lt(p + 1, dom.length(b)))
    assert ok is False and isinstance(cex, dict)
    assert decide.Equivalence(dom, sympy.Lt(p, dom.length(b))).check(sympy.Lt(p + 1, dom.length(b))) is False


class _TwoWrites(torch.nn.Module):
    """A pad that writes row ``p // 2``: two jagged rows land in one slot (not injective)."""

    def forward(self, q, k, v, offsets):
        L, B = q.shape[0], offsets.numel() - 1
        seg = torch.searchsorted(offsets, torch.arange(L), right=True) - 1
        pos = (torch.arange(L) - offsets[seg]) // 2

        def pad(t):
            return torch.zeros(B, N, H, D).index_put((seg, pos), t)
        s = torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k))
        p = F.silu(s) * torch.ones(N, N).tril() / N
        return torch.einsum("bhnm,bmhd->bnhd", p, pad(v))[seg, pos]


class _LeftSearch(torch.nn.Module):
    """The sequence of a row by ``searchsorted(offsets, r)`` (right=False): wrong at sequence starts after
    empty sequences, so not the row's sequence."""

    def forward(self, q, k, v, offsets):
        L, B = q.shape[0], offsets.numel() - 1
        seg = torch.searchsorted(offsets, torch.arange(L)).clamp(min=1) - 1
        pos = torch.arange(L) - offsets[seg]

        def pad(t):
            return torch.zeros(B, N, H, D).index_put((seg, pos.clamp(min=0, max=N - 1)), t)
        s = torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k))
        p = F.silu(s) * torch.ones(N, N).tril() / N
        return torch.einsum("bhnm,bmhd->bnhd", p, pad(v))[seg, pos.clamp(min=0, max=N - 1)]


@pytest.mark.parametrize("model", [_TwoWrites(), _LeftSearch()], ids=["not_injective", "left_search"])
def test_index_maps_that_are_not_the_pad(model):
    g = torch.Generator().manual_seed(1)
    offsets = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    q, k, v = (torch.randn(int(offsets[-1]), H, D, generator=g) for _ in range(3))
    with torch.no_grad():
        report = hstu_inductor.explain(model, q, k, v, offsets, backend=REWRITE_BACKEND)
        assert report.counts["attention"] == 0 and report.near_misses, report
        assert _rel(report.output, model(q, k, v, offsets)) < 1e-6


def test_constant_tables_read_in_closed_form():
    """An ``arange`` with unit dims is affine, a causal buffer is a band (also as ``[1, 1, N, N]``), a
    small table otherwise one case per distinct value; each equals the tensor at every position."""
    from hstu_inductor.patterns.core.tables import table_element

    i, j = sympy.symbols("i j", integer=True)
    g = torch.Generator().manual_seed(3)
    pos = (torch.arange(16) * 3 + 5)[None]
    ids = (torch.arange(16) - 2).clamp(min=0).clamp(max=11)  # a contextual prefix, a window: three pieces
    causal = torch.triu(torch.ones(12, 12), 1)
    small = torch.randint(-4, 5, (3, 5), generator=g)
    assert table_element(pos, (0, i), "pos") == 3 * i + 5
    assert table_element(causal[None, None], (0, 0, i, j), "causal4d") == table_element(causal, (i, j), "causal")
    e = table_element(ids, (i,), "ids")
    assert len(e.atoms(sympy.Piecewise)) <= 2 and not e.atoms(sympy.Eq)  # ranges, not a case per element
    assert [int(e.subs(i, a)) for a in range(16)] == ids.tolist()
    for t, name in ((causal, "causal"), (small, "small")):
        e = table_element(t, (i, j), name)
        assert not e.has(sympy.Piecewise) or len(e.atoms(sympy.Piecewise)) == 1  # one flat case split
        for a in range(t.shape[0]):
            for b in range(t.shape[1]):
                assert float(e.subs({i: a, j: b})) == t[a, b].item(), (name, a, b)


def test_tables_compared_at_symbolic_positions_are_declined_not_hung():
    """A non-affine position table read at two positions and compared: sympy would fold every pair
    of cases out of the condition (minutes); the prover declines with a reason instead."""
    from hstu_inductor.patterns.core.tables import table_element
    from hstu_inductor.patterns.core.values import Unsupported, num

    i, j = sympy.symbols("i j", integer=True)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(5))[None]
    cond = sympy.And(sympy.Le(table_element(perm, (0, j), "p"), table_element(perm, (0, i), "p")),
                     sympy.Lt(table_element(perm, (0, i), "p") - table_element(perm, (0, j), "p"), 4))
    with pytest.raises(Unsupported, match="cases"):
        num(cond)


def test_proof_past_its_time_budget_is_declined_and_equal_to_eager():
    """A proof that runs past ``config.proof_budget_s`` declines the candidate with that reason (the
    graph then runs as the user wrote it); a budget of zero seconds is refused as a setting."""
    with hstu_inductor.config.patch(proof_budget_s=1e-9):
        report = _check(Reassociated(), False, 0)
    assert any("time budget" in r for _, r in report.near_misses), report.near_misses
    with pytest.raises(ValueError, match="proof_budget_s"):
        with hstu_inductor.config.patch(proof_budget_s=0):
            pass


def test_valid_at_many_equals_valid_at():
    """The sample filter's vectorised mask (every candidate at once) is ``valid_at`` of each candidate, with
    and without targets, at random in-sequence and out-of-sequence points (int32 as the filter passes them)."""
    from hstu_inductor.patterns.prover import mask_candidates, valid_at, valid_at_many

    g = torch.Generator().manual_seed(3)
    M = 1500
    nn = torch.randint(1, 40, (M,), generator=g, dtype=torch.int32)
    ii = (torch.rand(M, generator=g) * (nn + 3)).to(torch.int32)  # some past the sequence's end
    jj = (torch.rand(M, generator=g) * nn).to(torch.int32)
    tt = (torch.rand(M, generator=g) * (nn + 1)).to(torch.int32).clamp(max=nn)
    b = torch.arange(M)
    for targets in (None, tt):
        cands = mask_candidates({3, 7, 20}, 40, targets is not None)
        many = valid_at_many(b, ii, jj, nn, targets, cands)
        assert many.shape == (len(cands), M) and 0 < int(many.sum()) < many.numel()
        for k, spec in enumerate(cands):
            assert torch.equal(many[k], valid_at(b, ii, jj, nn, targets, spec)), spec


@pytest.mark.parametrize("choice", ["hstu", "inductor"])
def test_constant_guard_only_where_the_rewrite_runs(choice, monkeypatch, caplog):
    """A rewrite that read a buffer by value runs behind a guard; where the cost rule keeps stock Inductor's
    graph (which reads the buffer itself) there is no guard of ours: a changed buffer is just read."""
    import logging

    from hstu_inductor import _compat, cost_rule

    monkeypatch.setattr(cost_rule, "decide", lambda g, example_inputs, cudagraphs: cost_rule.Decision(
        choice, "infer", 1.0, 0))
    monkeypatch.setattr(_compat, "compile_fx", lambda gm, example_inputs, patches=None: _compat.aot_eager(
        gm, example_inputs))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BufferMask()
    x, offsets = _inputs(requires_grad=False)
    compiled = torch.compile(model, backend="hstu")
    with caplog.at_level(logging.WARNING, logger="hstu_inductor"):
        assert _rel(compiled(x, offsets), model(x, offsets)) < 1e-5
        with torch.no_grad():
            model.attn_mask.copy_(torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=2))
        assert _rel(compiled(x, offsets), model(x, offsets)) < 1e-5
    guarded = any("module state read by the rewrite changed" in r.getMessage() for r in caplog.records)
    assert guarded == (choice == "hstu"), caplog.text
    torch._dynamo.reset()
