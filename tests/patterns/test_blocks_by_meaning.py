"""The STU blocks by meaning (issue 31, item 2): plain-PyTorch STU layers whose blocks are spelled in
ways no table lists, each compiled with ``backend="hstu_eager"`` and checked against eager on fresh random
inputs (output and every gradient, fp32, relative norm error <= 1e-5), with a near-miss twin per rule.

1. Writes whose *source* is q, k or v (``zeros.index_add_(0, dst, v)``, ``z[dst] = v``,
   ``buf.index_copy_(0, i, v)``, ``buf.copy_(v)``) do not modify them; a write *into* v, q, k, u, the
   projection output or a view of any of them does, and declines.
2. u, v, q, k are the views holding the column blocks ``[0, hv)``, ``[hv, 2hv)``, ``[2hv, 2hv+hq)``,
   ``[2hv+hq, D)`` of the projection output, however it was cut (``view(L, 4, H, d).unbind(1)``,
   ``select``, ``narrow``, ``unflatten``, nested splits, ...); pieces that interleave columns are not.
3. silu(u) anywhere before u is used (on a view of u, per head, on the whole projection output, as
   ``u * sigmoid(u)``), and the output block's ``Norm(attn) * silu(u)`` in either order, with views
   in between.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hstu_inductor
from hstu_inductor.report import collecting
from _helpers import rel_err
from test_blocks_common import jagged_rows

E, H, D, N = 16, 2, 8, 16
C = H * D
LENGTHS = [16, 0, 1, 7]  # B = 4 sequences, one empty, one of a single row, one full (N)
TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# the layer: LayerNorm -> projection -> cut -> silu(u) -> mix(q, k, v) -> output
# ---------------------------------------------------------------------------------------------
def std_cut(p, L):
    return p.split(C, dim=1)


def gate_mix(q, k, v, offsets, L):
    """A cheap stand-in for the attention (the blocks do not depend on it): a per-head gate."""
    q3, k3, v3 = (t.reshape(L, H, D) for t in (q, k, v))
    return (torch.sigmoid((q3 * k3).sum(-1, keepdim=True)) * v3).reshape(L, C)


def _ids(offsets, L):
    seg = torch.searchsorted(offsets, torch.arange(L), right=True) - 1
    return seg, torch.arange(L) - offsets[seg]


def jagged_mix(pad):
    """HSTU attention (causal, silu(q k^T / sqrt(d)) / N) on q, k, v padded to [B, N, H, d] by ``pad``."""
    def mix(q, k, v, offsets, L):
        B = offsets.shape[0] - 1
        seg, pos = _ids(offsets, L)
        dst = seg * N + pos
        qp, kp, vp = (pad(t.reshape(L, C), dst, B).view(B, N, H, D) for t in (q, k, v))
        s = torch.einsum("bihd,bjhd->bhij", qp, kp)
        i = torch.arange(N)
        a = torch.where(i[:, None] >= i[None, :], F.silu(s / D ** 0.5), 0) / N
        return torch.einsum("bhij,bjhd->bihd", a, vp).reshape(B * N, C)[dst]
    return mix


PADS = {  # t [L, C] -> [B*N, C], written *from* t into a fresh zero buffer
    "index_add_": lambda t, dst, B: torch.zeros(B * N, C).index_add_(0, dst, t),
    "setitem": lambda t, dst, B: _setitem(torch.zeros(B * N, C), dst, t),
    "index_copy_": lambda t, dst, B: torch.zeros(B * N, C).index_copy_(0, dst, t),
    "copy_": lambda t, dst, B: _copy_rows(torch.zeros(B * N, C), dst, t),
}


def _setitem(z, dst, t):
    z = z.view(-1, N, C)
    z[dst // N, dst % N] = t  # z[seg, pos] = t
    return z.view(-1, C)


def _copy_rows(z, dst, t):
    buf = torch.zeros(t.shape[0], 2 * C)
    buf[:, C:].copy_(t)  # copied into a slice of a second buffer, then scattered
    return z.index_put_((dst,), buf[:, C:])


def std_out(m, a, o, x, L):
    return x + m.o(a.reshape(L, C) * m.ln_o(o))


class STU(nn.Module):
    def __init__(self, cut=std_cut, act=lambda u, L: F.silu(u), mix=gate_mix, out=std_out, seed=0):
        super().__init__()
        self.cut, self.act, self.mix, self.out = cut, act, mix, out
        self.ln = nn.LayerNorm(E)
        self.uvqk = nn.Linear(E, 4 * C)
        self.ln_o = nn.LayerNorm(C)
        self.o = nn.Linear(C, E)
        self.gn_w, self.gn_b = nn.Parameter(torch.empty(H)), nn.Parameter(torch.empty(H))
        torch.manual_seed(seed)
        with torch.no_grad():  # no parameter at its ones/zeros initialisation: every role shows
            for p in self.parameters():
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p is not self.uvqk.bias else 0.0))

    def forward(self, x, offsets):
        L = x.shape[0]
        u, v, q, k = self.cut(self.uvqk(self.ln(x)), L)
        return self.out(self, self.act(u, L), self.mix(q, k, v, offsets, L), x, L)


class Stack(nn.Module):
    """Several layers, one spelling each: one compile checks them all (the report lists them in order)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, offsets):
        for layer in self.layers:
            x = layer(x, offsets)
        return x


def check(m, counts, seed=0, attention=False, dynamic=None, train=True):
    """Compiled (``hstu_eager``, training) equals eager: the output and the gradients of x and every
    parameter, relative norm error <= 1e-5, on fresh random rows; returns the report. ``train=False``:
    the output only, under ``torch.no_grad()``."""
    x, offsets = jagged_rows(LENGTHS, E, seed)
    ref = copy.deepcopy(m)
    torch._dynamo.reset()
    xc, xr = x.clone().requires_grad_(train), x.clone().requires_grad_(train)
    with collecting() as report, hstu_inductor.config.patch(patterns={"attention": attention}), \
            torch.set_grad_enabled(train):
        got = torch.compile(m, backend="hstu_eager", dynamic=dynamic)(xc, offsets)
        want = ref(xr, offsets)
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    if not train:
        assert {k: report.counts[k] for k in counts} == counts, str(report)
        return report
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(got, [xc, *m.parameters()], g, allow_unused=True)
    ref_grads = torch.autograd.grad(want, [xr, *ref.parameters()], g, allow_unused=True)
    for (name, _), a, b in zip([("x", None), *m.named_parameters()], grads, ref_grads):
        assert (a is None) == (b is None), name
        if b is not None and b.abs().max() == 0:
            assert a.abs().max() == 0, name
        elif b is not None:
            assert rel_err(a, b) <= TOL, (name, rel_err(a, b))
    assert {k: report.counts[k] for k in counts} == counts, str(report)
    return report


def near_miss(m, contains, kind="preprocess", **kw):
    """Not rewritten, with a reason containing ``contains``; still eager-equal."""
    report = check(m, {kind: 0}, **kw)
    reasons = [r for k, r in report.near_misses if k == kind]
    assert any(contains in r for r in reasons), (contains, report.near_misses)
    return reasons


def details(report, kind):
    return [d for k, d in report.details if k == kind]


# ---------------------------------------------------------------------------------------------
# 1. writes whose source is q, k or v are reads
# ---------------------------------------------------------------------------------------------
class IndexAddPad(nn.Module):
    """The issue's reproduction, as written there: q, k, v padded by ``zeros(B*N, H*d).index_add_(0, dst, t)``."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(E)
        self.uvqk = nn.Linear(E, 4 * C)
        self.ln_o = nn.LayerNorm(C)
        self.o = nn.Linear(C, E)

    def forward(self, x, offsets):
        L = x.shape[0]
        B = offsets.shape[0] - 1
        u, v, q, k = self.uvqk(self.ln(x)).split(H * D, dim=1)
        seg, pos = _ids(offsets, L)
        dst = seg * N + pos

        def pad(t):
            return torch.zeros(B * N, H * D).index_add_(0, dst, t).view(B, N, H, D)

        qp, kp, vp = pad(q), pad(k), pad(v)
        s = torch.einsum("bihd,bjhd->bhij", qp, kp)
        i = torch.arange(N)
        a = torch.where(i[:, None] >= i[None, :], F.silu(s / D ** 0.5), 0) / N
        o = torch.einsum("bhij,bjhd->bihd", a, vp).reshape(B * N, H * D)[dst]
        return x + self.o(F.silu(u) * self.ln_o(o))


def test_issue_reproduction_every_block_rewritten():
    torch.manual_seed(1)
    m = IndexAddPad()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    report = check(m, {"attention": 1, "preprocess": 1, "output": 1}, attention=True)
    assert not [r for k, r in report.near_misses if k == "preprocess"], report.near_misses


def test_write_from_qkv_into_a_buffer_is_a_read():
    """One layer per pad spelling; with the attention left to stock Inductor the pads stay in the graph,
    reading q, k, v as sources of writes into zero buffers."""
    n = len(PADS)
    report = check(Stack([STU(mix=jagged_mix(pad), seed=i) for i, pad in enumerate(PADS.values())]),
                   {"preprocess": n, "output": n})
    assert not [r for k, r in report.near_misses if k == "preprocess"], report.near_misses


def _then(mutate):
    """Slices of the projection output (autograd forbids writes into ``split``'s outputs), then
    ``mutate(u, v, q, k, p)`` (in place) before anything else reads them."""
    def cut(p, L):
        u, v, q, k = (p[:, i * C:(i + 1) * C] for i in range(4))
        mutate(u, v, q, k, p)
        return u, v, q, k
    return cut


_NOT_A_PIECE = "not four consecutive blocks"


@pytest.mark.parametrize("name,mutate,contains", [
    ("view_of_v_mul_", lambda u, v, q, k, p: v.view(-1, H, D).mul_(2), _NOT_A_PIECE),
    ("slice_of_q_zero_", lambda u, v, q, k, p: q[:, :4].zero_(), _NOT_A_PIECE),
    ("k_add_", lambda u, v, q, k, p: k.add_(1.5), _NOT_A_PIECE),
    ("into_v_index_put_", lambda u, v, q, k, p: v.index_put_((torch.tensor([0, 2]),), q[:2] * 3), _NOT_A_PIECE),
    ("into_v_copy_", lambda u, v, q, k, p: v[1:3].copy_(k[:2]), _NOT_A_PIECE),
    ("projection_output", lambda u, v, q, k, p: p.view(-1, 4, C)[:, 1:].mul_(0.5), _NOT_A_PIECE),
])
def test_write_into_a_piece_declines(name, mutate, contains):
    """A graph with in-place ops is read functionalised (the pipeline): the tensor the attention reads
    after a write into a piece is the write's result, no column block of the projection."""
    near_miss(STU(cut=_then(mutate)), contains)


class WritesBetween(STU):
    """Between the LayerNorm and the projection, the normalised rows are written into a side buffer
    (the block's memory is only read) or, in the twin, some normalised columns are shifted in place (the
    projection reads the shifted rows: the op, reading x, would not; eager autograd rejects that write,
    so the twin runs in inference)."""

    def __init__(self, into_norm):
        super().__init__()
        self.into_norm = into_norm

    def forward(self, x, offsets):
        L = x.shape[0]
        n = self.ln(x)
        side = torch.zeros(L, E).index_add_(0, torch.arange(L).flip(0), n)
        if self.into_norm:
            n[:, :4].add_(0.25)  # through a view: the projection still reads the norm's node
        u, v, q, k = self.cut(self.uvqk(n), L)
        return self.out(self, self.act(u, L), self.mix(q, k, v, offsets, L), x, L) + 0.1 * side


def test_write_into_a_side_buffer_inside_the_block():
    check(WritesBetween(into_norm=False), {"preprocess": 1, "output": 1})


def test_write_into_the_norm_inside_the_block_declines():
    near_miss(WritesBetween(into_norm=True), "is not a LayerNorm of x", train=False)


def test_write_into_silu_u_is_a_product():
    def act(u, L):
        a = F.silu(u)
        a.mul_(1.5)
        return a

    # read functionalised: silu(u) * 1.5 is a product of the op's silu(u), which the output block reads
    check(STU(act=act), {"preprocess": 1})


# ---------------------------------------------------------------------------------------------
# 2. u, v, q, k by the columns they hold
# ---------------------------------------------------------------------------------------------
def _nested(p, L):
    u, rest = p.split([C, 3 * C], dim=1)
    return (u, *rest.chunk(3, dim=-1))


CUTS = {
    "view4_unbind": (lambda p, L: p.view(L, 4, H, D).unbind(1), "view+unbind"),
    "view4flat_unbind": (lambda p, L: p.view(L, 4, H * D).unbind(1), "view+unbind"),
    "view4_index": (lambda p, L: [p.view(L, 4, H, D)[:, i] for i in range(4)], "view+select"),
    "view4_minus1_unbind_neg2": (lambda p, L: p.view(L, 4, -1).unbind(-2), "view+unbind"),
    "reshape_select": (lambda p, L: [p.reshape(L, 4, C).select(1, i) for i in range(4)], "view+select"),
    "unflatten": (lambda p, L: p.unflatten(-1, (4, H, D)).unbind(1), "view+unbind"),
    "chunk": (lambda p, L: p.chunk(4, -1), "chunk"),
    "split_sizes": (lambda p, L: p.split([C, C, C, C], dim=-1), "split"),
    "slices": (lambda p, L: [p[:, i * C:(i + 1) * C] for i in range(4)], "slices"),
    "narrow": (lambda p, L: [p.narrow(1, i * C, C) for i in range(4)], "slices"),  # traced as slices
    "nested_splits": (_nested, "split"),
    "transpose_index": (lambda p, L: [p.view(L, 4, H, D).transpose(1, 2)[:, :, i] for i in range(4)],
                        "view+permute+select"),
    "permute_unbind0": (lambda p, L: p.view(L, 4, H, D).permute(1, 0, 2, 3).unbind(0), "view+permute+unbind"),
}


def test_cut_by_columns():
    """One layer per cut (``CUTS``), each rewritten, the report naming its views."""
    n = len(CUTS)
    report = check(Stack([STU(cut=cut, seed=i) for i, (cut, _) in enumerate(CUTS.values())]),
                   {"preprocess": n, "output": n})
    for name, (_, spelling), d in zip(CUTS, CUTS.values(), details(report, "preprocess")):
        assert f"-> {spelling} ->" in d, (name, d)


def test_cut_by_columns_with_the_attention():
    """The issue's second reproduction: ``view(L, 4, H, d).unbind(1)`` before the jagged attention."""
    report = check(STU(cut=CUTS["view4_unbind"][0], mix=jagged_mix(PADS["index_add_"])),
                   {"attention": 1, "preprocess": 1, "output": 1}, attention=True)
    assert any(k == "silu(u)" for k, _ in report.details), report.details  # silu(u) moved into the output op


@pytest.mark.parametrize("name,cut,contains", [
    # heads outermost: piece i holds d columns of every head, not the block [i*C, (i+1)*C)
    ("interleaved_index", lambda p, L: [p.view(L, H, 4, D)[:, :, i] for i in range(4)], "not split into four"),
    ("interleaved_unbind", lambda p, L: p.view(L, H, 4, D).unbind(2), "not split into four"),
    # rows mixed: piece i holds rows [i*L/4, (i+1)*L/4) of every column block
    ("rows_mixed", lambda p, L: p.reshape(4, L, C).unbind(0), "not split into four"),
    ("sizes_not_aabb", lambda p, L: p.split([C, C, C // 2, 3 * C // 2], dim=1), "are not [hv, hv, hq, hq]"),
])
def test_cut_near_misses(name, cut, contains):
    def reshaped(p, L):  # the pieces' values in the [L, C] shape the rest of the layer takes
        return [t.reshape(L, C) if t.numel() == L * C else t for t in cut(p, L)]

    if name == "sizes_not_aabb":
        def mix(q, k, v, offsets, L):  # pieces of different widths
            return v * torch.sigmoid(q.sum(-1, keepdim=True) * k.sum(-1, keepdim=True))

        m = STU(cut=cut, mix=mix)
    else:
        m = STU(cut=reshaped)
    near_miss(m, contains)


def test_silu_on_the_last_piece_declines():
    """The four blocks are cut, but silu is applied to chunk 3 and chunk 0 is used raw."""
    def act(u, L):
        return u

    def cut(p, L):
        u, v, q, k = p.view(L, 4, C).unbind(1)
        return u, v, q, F.silu(k)

    near_miss(STU(cut=cut, act=act), "silu is applied to chunk 3 (k)")


# ---------------------------------------------------------------------------------------------
# 3. silu(u) anywhere before u is used; the output's Norm(attn) * silu(u) in either order, with views
# ---------------------------------------------------------------------------------------------
def _silu_whole(p, L):
    return F.silu(p).view(L, 4, H, D).unbind(1)


def _silu_full_view(p, L):
    return F.silu(p.view(L, 4, H, D)).unbind(1)


def _silu_whole_u_only(p, L):
    a = F.silu(p)
    _, v, q, k = p.chunk(4, dim=-1)
    return a[:, :C], v, q, k


def _silu_whole_u_and_v(p, L):
    a = F.silu(p)
    return a[:, :C], a[:, C:2 * C], p[:, 2 * C:3 * C], p[:, 3 * C:]  # silu(v) too, q and k raw


def _silu_whole_spelled(p, L):
    return (p * torch.sigmoid(p)).chunk(4, dim=1)


def _per_head(u, L):
    return torch.stack([F.silu(h) for h in u.reshape(L, H, D).unbind(1)], dim=1)


def _two_views_sigmoid(u, L):
    return u.view(L, C) * torch.sigmoid(u.view(L, C))


SILU = {  # name: (cut, act, report line's end)
    "whole_projection": (_silu_whole, lambda u, L: u, "silu before split(all)"),
    "full_width_view": (_silu_full_view, lambda u, L: u, "silu before split(all)"),
    "whole_projection_u_only": (_silu_whole_u_only, lambda u, L: u, "silu before split(u)"),
    "whole_projection_u_and_v": (_silu_whole_u_and_v, lambda u, L: u, "silu before split(u)"),
    "whole_projection_spelled": (_silu_whole_spelled, lambda u, L: u, "x*sigmoid(x) before split(all)"),
    "after_reshape": (CUTS["view4flat_unbind"][0], lambda u, L: F.silu(u.reshape(L, H, D)), "silu(u)"),
    "per_head": (CUTS["view4_unbind"][0], _per_head, "silu(u)"),
    "u_times_sigmoid": (CUTS["view4_unbind"][0], lambda u, L: u * torch.sigmoid(u), "x*sigmoid(x)(u)"),
    "sigmoid_times_two_views": (CUTS["view4_index"][0], _two_views_sigmoid, "x*sigmoid(x)(u)"),
}


def test_silu_u_anywhere():
    """One layer per place of silu (``SILU``), each rewritten."""
    n = len(SILU)
    report = check(Stack([STU(cut=cut, act=act, seed=i) for i, (cut, act, _) in enumerate(SILU.values())]),
                   {"preprocess": n, "output": n})
    for name, (_, _, spelling), d in zip(SILU, SILU.values(), details(report, "preprocess")):
        assert d.endswith(spelling), (name, d)


def _raw_u_too(u, L):
    return F.silu(u) + 0.1 * u.reshape(L, C)


def _sigmoid_of_v(p, L):  # u * sigmoid(v): not silu(u)
    u, v, q, k = p.split(C, 1)
    return u * torch.sigmoid(v), v, q, k


def _silu_v(p, L):
    u, v, q, k = p.split(C, 1)
    return u, F.silu(v), q, k


def _silu_then_interleaved(p, L):
    return [t.reshape(L, C) for t in F.silu(p.view(L, H, 4, D)).unbind(2)]


@pytest.mark.parametrize("name,cut,act,contains", [
    ("sigmoid_of_another_piece", _sigmoid_of_v, lambda u, L: u, "u (chunk 0) is not consumed only by silu(u)"),
    ("raw_u_also_used", std_cut, _raw_u_too, "u (chunk 0) is not consumed only by silu(u)"),
    ("silu_on_v_only", _silu_v, lambda u, L: u, "silu is applied to chunk 1 (v)"),
    ("silu_then_interleaved", _silu_then_interleaved, lambda u, L: u, "not split into four"),
])
def test_silu_near_misses(name, cut, act, contains):
    near_miss(STU(cut=cut, act=act), contains)


def _out3(order):
    """The product in [L, H, d], viewed back to [L, C] before the projection."""
    def out(m, a, o, x, L):
        n3, a3 = m.ln_o(o).view(L, H, D), a.reshape(L, H, D)
        y = n3 * a3 if order == "norm_first" else a3 * n3
        return x + m.o(y.reshape(L, C))
    return out


def _out_flatten(m, a, o, x, L):
    return m.o((m.ln_o(o).unflatten(-1, (H, D)) * a).flatten(1)) + x  # a: silu(u) of u [L, H, d]


def _out_group_norm(m, a, o, x, L):
    n3 = F.group_norm(o.view(L, H, D), H, m.gn_w, m.gn_b, 1e-5)
    return x + m.o((a.view(L, H, D) * n3).view(L, C))


OUTPUTS = {  # name: (cut, out, spelling fragment)
    "norm_first_2d": (std_cut, lambda m, a, o, x, L: x + m.o(m.ln_o(o) * a), "layer_norm(attn)*u"),
    "norm_first_3d": (std_cut, _out3("norm_first"), "layer_norm(attn)*u as [2, 8] per row"),
    "u_first_3d": (CUTS["view4_unbind"][0], _out3("u_first"), "u*layer_norm(attn) as [2, 8] per row"),
    "flatten_after": (CUTS["view4_unbind"][0], _out_flatten, "layer_norm(attn)*u as [2, 8] per row"),
    "group_norm_per_head_3d": (std_cut, _out_group_norm, "u*group_norm(view, params x8)(attn) as [2, 8] per row"),
}


def test_output_by_meaning():
    """One layer per output spelling (``OUTPUTS``), each rewritten; the preprocess's silu(u) moves into
    every output op (``fuse_u_silu``: the op's u is the preprocess's act, not a view of it)."""
    n = len(OUTPUTS)
    report = check(Stack([STU(cut=cut, out=out, seed=i) for i, (cut, out, _) in enumerate(OUTPUTS.values())]),
                   {"preprocess": n, "output": n})
    for name, (_, _, spelling), d in zip(OUTPUTS, OUTPUTS.values(), details(report, "output")):
        assert d.startswith(spelling), (name, d)
    assert len([k for k, _ in report.details if k == "silu(u)"]) == n, report.details


def _out_transposed(m, a, o, x, L):  # the norm's columns reordered (d, H) -> (H, d): not Norm(attn) * u
    return x + m.o((m.ln_o(o).view(L, D, H).transpose(1, 2) * a.reshape(L, H, D)).reshape(L, C))


def _out_per_head_ln(m, a, o, x, L):  # a LayerNorm of each head: not the op's norm
    return x + m.o((F.layer_norm(o.view(L, H, D), (D,)) * a.reshape(L, H, D)).reshape(L, C))


def _out_broadcast(m, a, o, x, L):
    return x + m.o((m.ln_o(o).view(L, H, D) * a.reshape(L, H, D)[:, :1]).reshape(L, C))


@pytest.mark.parametrize("name,out,contains", [
    ("norm_transposed", _out_transposed, "neither factor"),
    ("per_head_layer_norm", _out_per_head_ln, "not over the last dim"),
    ("u_broadcast_over_heads", _out_broadcast, "does not match attn"),
])
def test_output_near_misses(name, out, contains):
    near_miss(STU(out=out), contains, kind="output")


def test_symbolic_rows():
    """``dynamic=True``: the pieces' row count is a symbol; their columns are read the same way."""
    m = Stack([STU(cut=CUTS["view4_index"][0], act=_per_head, out=_out3("u_first"), seed=1),
               STU(cut=_silu_full_view, act=lambda u, L: u, out=_out_flatten, seed=2)])
    report = check(m, {"preprocess": 2, "output": 2}, dynamic=True)
    assert [d.rsplit(" -> ", 1)[-1] for d in details(report, "preprocess")] == ["silu(u)", "silu before split(all)"]
