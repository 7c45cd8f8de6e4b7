"""``hstu_mha`` / ``delta_hstu_mha`` / jagged helpers / STU modules of the eager reference.

The oracle is ``_helpers.loop_attention``: a per-sequence, per-row, per-head float64 loop written
from HSTU_SEMANTICS.md (it shares no code with ``hstu_inductor``).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from _helpers import loop_attention, offsets_from_lengths, random_jagged, rel_err
from hstu_inductor.reference import (
    HSTUModel,
    STULayer,
    delta_hstu_mha,
    hstu_mha,
    jagged_to_padded,
    padded_to_jagged,
    stu_layer,
)

TOL64 = 1e-12

CONFIGS = {
    "plain": dict(),
    "targets": dict(num_targets=[0, 1, 2, 1]),
    "contextual": dict(c=2),
    "window": dict(w=2),
    "window_full": dict(w=1, f=2),
    "targets_contextual_window": dict(num_targets=[0, 1, 1, 2], c=1, w=2),
    "everything": dict(num_targets=[0, 1, 1, 2], c=2, w=1, f=1),
    "non_causal": dict(causal=False),
    "scale_scalar": dict(scale="scalar"),
    "scale_per_row": dict(scale="row", num_targets=[0, 1, 2, 1], w=3),
}
LENGTHS = [0, 1, 6, 4]  # includes lengths 0, 1 and N
N = 6


def _scale(kind, L, seed=7):
    g = torch.Generator().manual_seed(seed)
    if kind == "scalar":
        return torch.tensor(0.37, dtype=torch.float64)
    if kind == "row":
        return torch.rand(L, generator=g, dtype=torch.float64) + 0.1
    return None


def _call(q, k, v, off, N, alpha, cfg, scale=None):
    nt = cfg.get("num_targets")
    return hstu_mha(N, alpha, q, k, v, off, causal=cfg.get("causal", True),
                    num_targets=None if nt is None else torch.tensor(nt), attn_scale=scale,
                    max_attn_len=cfg.get("w", 0), contextual_seq_len=cfg.get("c", 0),
                    min_full_attn_seq_len=cfg.get("f", 0))


def _loop(q, k, v, off, N, alpha, cfg, scale=None):
    return loop_attention(q, k, v, off, N, alpha, cfg.get("num_targets"), scale, cfg.get("w", 0),
                          cfg.get("c", 0), cfg.get("f", 0), cfg.get("causal", True))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hstu_mha_matches_loop(name):
    cfg = CONFIGS[name]
    q, k, v, off = random_jagged(LENGTHS, H=2, Dq=3, Dv=4, seed=hash(name) % 1000)
    scale = _scale(cfg.get("scale"), q.shape[0])
    got = _call(q, k, v, off, N, 0.7, cfg, scale)
    expected = _loop(q, k, v, off, N, 0.7, cfg, scale)
    assert got.shape == (sum(LENGTHS), 2, 4) and got.dtype == torch.float64
    assert rel_err(got, expected) < TOL64


def test_hstu_mha_float32_matches_loop():
    q, k, v, off = random_jagged([3, 5, 2], H=2, Dq=4, Dv=3, dtype=torch.float32, seed=11)
    got = _call(q, k, v, off, 5, 0.5, dict(num_targets=[1, 2, 0]))
    assert got.dtype == torch.float32
    assert rel_err(got, _loop(q, k, v, off, 5, 0.5, dict(num_targets=[1, 2, 0]))) < 1e-5


def test_int32_offsets_match_int64():
    q, k, v, off = random_jagged([3, 5, 2], H=1, Dq=2, Dv=2, seed=3)
    a = _call(q, k, v, off, 5, 0.5, dict(num_targets=[1, 2, 0]))
    b = hstu_mha(5, 0.5, q, k, v, off.to(torch.int32), num_targets=torch.tensor([1, 2, 0], dtype=torch.int32))
    assert torch.equal(a, b)


def test_single_row_by_hand():
    # n = 1: out_0 = silu(alpha <q0, k0>) / N * v0, no normalisation over j.
    q = torch.tensor([[[1.0, 2.0]]], dtype=torch.float64)
    k = torch.tensor([[[0.5, 0.5]]], dtype=torch.float64)
    v = torch.tensor([[[3.0, -1.0, 2.0]]], dtype=torch.float64)
    out = hstu_mha(4, 2.0, q, k, v, torch.tensor([0, 1]))
    x = 2.0 * (0.5 + 1.0)
    s = x / (1 + math.exp(-x)) / 4
    assert torch.allclose(out, s * v, rtol=1e-13, atol=0)


def test_two_rows_by_hand():
    # n = 2, H = 1, D = 1: out_1 = (silu(a q1 k0) v0 + silu(a q1 k1) v1) / N ; out_0 = silu(a q0 k0) v0 / N.
    q = torch.tensor([[[0.3]], [[-1.2]]], dtype=torch.float64)
    k = torch.tensor([[[2.0]], [[0.7]]], dtype=torch.float64)
    v = torch.tensor([[[1.5]], [[-2.0]]], dtype=torch.float64)
    a, Nn = 1.3, 3

    def silu(x):
        return x / (1 + math.exp(-x))

    out = hstu_mha(Nn, a, q, k, v, torch.tensor([0, 2]))
    e0 = silu(a * 0.3 * 2.0) * 1.5 / Nn
    e1 = (silu(a * -1.2 * 2.0) * 1.5 + silu(a * -1.2 * 0.7) * -2.0) / Nn
    assert torch.allclose(out.flatten(), torch.tensor([e0, e1], dtype=torch.float64), rtol=1e-13, atol=0)


def test_no_softmax_output_is_linear_in_v():
    q, k, v, off = random_jagged([4, 6, 3], H=2, Dq=3, Dv=4, seed=5)
    v2 = torch.randn_like(v)
    cfg = dict(num_targets=[1, 2, 0], c=1)
    out = _call(q, k, v, off, 6, 0.8, cfg)
    assert rel_err(_call(q, k, 3.0 * v, off, 6, 0.8, cfg), 3.0 * out) < TOL64
    assert rel_err(_call(q, k, v + v2, off, 6, 0.8, cfg), out + _call(q, k, v2, off, 6, 0.8, cfg)) < TOL64
    # A softmax would make the rows' weights sum to 1: with v = 1 the outputs would all be 1.
    ones = torch.ones_like(v)
    weights = _call(q, k, ones, off, 6, 0.8, cfg)
    assert (weights - 1).abs().max() > 0.1


def test_attn_scale_scales_linearly():
    q, k, v, off = random_jagged([4, 6, 3], H=2, Dq=3, Dv=4, seed=6)
    base = _call(q, k, v, off, 6, 0.8, {}, torch.tensor(1.0, dtype=torch.float64))
    # The default scale is 1/N.
    assert rel_err(_call(q, k, v, off, 6, 0.8, {}), base / 6) < TOL64
    row = torch.rand(q.shape[0], dtype=torch.float64) + 0.5
    assert rel_err(_call(q, k, v, off, 6, 0.8, {}, row), base * row.view(-1, 1, 1)) < TOL64


def test_results_do_not_depend_on_other_sequences():
    lengths = [5, 3, 6]
    q, k, v, off = random_jagged(lengths, H=2, Dq=3, Dv=2, seed=8)
    cfg = dict(num_targets=[1, 1, 2], w=2, c=1)
    out = _call(q, k, v, off, 6, 0.6, cfg)
    # Replace sequence 1 by a different sequence (new values and a new length).
    g = torch.Generator().manual_seed(99)
    s0, e0 = 0, 5
    s2, e2 = 8, 14
    new_mid = 4
    q2 = torch.cat([q[s0:e0], torch.randn(new_mid, 2, 3, generator=g, dtype=torch.float64), q[s2:e2]])
    k2 = torch.cat([k[s0:e0], torch.randn(new_mid, 2, 3, generator=g, dtype=torch.float64) * 50, k[s2:e2]])
    v2 = torch.cat([v[s0:e0], torch.randn(new_mid, 2, 2, generator=g, dtype=torch.float64) * 50, v[s2:e2]])
    off2 = offsets_from_lengths([5, new_mid, 6])
    out2 = _call(q2, k2, v2, off2, 6, 0.6, dict(num_targets=[1, 3, 2], w=2, c=1))
    assert torch.equal(out2[s0:e0], out[s0:e0])
    assert torch.equal(out2[5 + new_mid:], out[s2:e2])
    # ... and equals the sequence computed on its own.
    alone = _call(q[s2:e2], k[s2:e2], v[s2:e2], offsets_from_lengths([6]), 6, 0.6,
                  dict(num_targets=[2], w=2, c=1))
    assert rel_err(alone, out[s2:e2]) < TOL64


def test_max_seq_len_is_a_constant():
    # All sequences are shorter than N = 10: the scale is still 1/10, not 1/max(n_b).
    q, k, v, off = random_jagged([3, 2, 3], H=2, Dq=3, Dv=2, seed=9)
    out10 = _call(q, k, v, off, 10, 0.9, {})
    out3 = _call(q, k, v, off, 3, 0.9, {})
    assert rel_err(out10, out3 * 3 / 10) < TOL64
    assert rel_err(out10, _loop(q, k, v, off, 10, 0.9, {})) < TOL64


def test_dropout_inactive_when_not_training():
    q, k, v, off = random_jagged([3, 5], H=2, Dq=3, Dv=2, seed=10)
    a = hstu_mha(5, 0.5, q, k, v, off, dropout_pr=0.5, training=False)
    b = hstu_mha(5, 0.5, q, k, v, off)
    assert torch.equal(a, b)
    torch.manual_seed(0)
    c = hstu_mha(5, 0.5, q, k, v, off, dropout_pr=0.5, training=True)
    assert not torch.equal(c, b)


# ------------------------------------------------------------------------------------------------
# Delta (cached) attention
# ------------------------------------------------------------------------------------------------
def _last_rows(t, lengths, D):
    starts = offsets_from_lengths(lengths)
    return torch.cat([t[int(starts[b + 1]) - D:int(starts[b + 1])] for b in range(len(lengths))])


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(num_targets=[2, 1, 0]),
    dict(c=2),
    dict(w=1),
    dict(num_targets=[2, 1, 1], c=1, w=2),
    dict(num_targets=[1, 2, 1], scale="scalar"),
    dict(num_targets=[1, 2, 1], w=1, scale="row"),
], ids=lambda c: "-".join(f"{k}" for k in c) or "plain")
@pytest.mark.parametrize("D", [1, 2])
def test_delta_equals_last_rows_of_full(cfg, D):
    lengths = [4, 6, 3]
    q, k, v, off = random_jagged(lengths, H=2, Dq=3, Dv=4, seed=20 + D)
    scale = _scale(cfg.get("scale"), q.shape[0])
    full = _call(q, k, v, off, 7, 0.8, cfg, scale)
    nt = cfg.get("num_targets")
    d_scale = scale if scale is None or scale.numel() == 1 else _last_rows(scale, lengths, D)
    delta = delta_hstu_mha(7, 0.8, _last_rows(q, lengths, D), k, v, off,
                           num_targets=None if nt is None else torch.tensor(nt), attn_scale=d_scale,
                           max_attn_len=cfg.get("w", 0), contextual_seq_len=cfg.get("c", 0))
    assert delta.shape == (3 * D, 2, 4)
    assert rel_err(delta, _last_rows(full, lengths, D)) < TOL64
    # and against the independent loop on just those rows
    rows = [range(n - D, n) for n in lengths]
    loop = loop_attention(_last_rows(q, lengths, D), k, v, off, 7, 0.8, nt, d_scale, cfg.get("w", 0),
                          cfg.get("c", 0), 0, True, query_rows=rows)
    assert rel_err(delta, loop) < TOL64


def test_delta_requires_d_rows():
    q, k, v, off = random_jagged([1, 3], H=1, Dq=2, Dv=2, seed=1)
    with pytest.raises(RuntimeError, match="at least D=2"):
        delta_hstu_mha(3, 0.5, torch.randn(4, 1, 2, dtype=torch.float64), k, v, off)


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [
    dict(),
    dict(num_targets=[1, 0, 2], c=1, w=1),
    dict(num_targets=[1, 0, 1], f=1, w=1, scale="row"),
    dict(scale="scalar"),
], ids=["plain", "targets_ctx_window", "full_attn_row_scale", "scalar_scale"])
def test_hstu_mha_gradcheck(cfg):
    q, k, v, off = random_jagged([3, 1, 4], H=2, Dq=2, Dv=2, seed=30, requires_grad=True)
    scale = _scale(cfg.get("scale"), q.shape[0])
    inputs = [q, k, v]
    if scale is not None:
        scale.requires_grad_()
        inputs.append(scale)

    def fn(*ts):
        return _call(ts[0], ts[1], ts[2], off, 4, 0.9, cfg, ts[3] if len(ts) > 3 else None)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-7)


def test_delta_gradcheck():
    lengths = [3, 4]
    q, k, v, off = random_jagged(lengths, H=1, Dq=2, Dv=2, seed=31, requires_grad=True)
    dq = _last_rows(q.detach(), lengths, 2).requires_grad_()
    fn = lambda dq_, k_, v_: delta_hstu_mha(4, 0.7, dq_, k_, v_, off, num_targets=torch.tensor([1, 1]))  # noqa
    assert torch.autograd.gradcheck(fn, (dq, k, v), eps=1e-6, atol=1e-7)


def test_gradient_wrt_v_matches_loop_finite_differences():
    # The output is linear in v, so a finite difference of the loop oracle is exact.
    q, k, v, off = random_jagged([3, 5], H=2, Dq=2, Dv=3, seed=32, requires_grad=True)
    cfg = dict(num_targets=[1, 2], c=1, w=2)
    g = torch.randn(8, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (dv,) = torch.autograd.grad(_call(q, k, v, off, 5, 0.6, cfg), (v,), g)
    loss = lambda vv: (_loop(q.detach(), k.detach(), vv, off, 5, 0.6, cfg) * g).sum()  # noqa: E731
    base = loss(v.detach())
    for idx in [(0, 0, 0), (4, 1, 2), (7, 0, 1), (3, 1, 0)]:
        e = torch.zeros_like(v)
        e[idx] = 1.0
        assert abs(float(loss(v.detach() + e) - base) - float(dv[idx])) < 1e-10


# ------------------------------------------------------------------------------------------------
# Jagged <-> padded
# ------------------------------------------------------------------------------------------------
def test_jagged_padded_roundtrip_by_hand():
    values = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    off = torch.tensor([0, 2, 2, 5])
    padded = jagged_to_padded(values, off, 4)
    expected = torch.tensor([[[1.0], [2.0], [0.0], [0.0]],
                             [[0.0], [0.0], [0.0], [0.0]],
                             [[3.0], [4.0], [5.0], [0.0]]])
    assert torch.equal(padded, expected)
    assert torch.equal(padded_to_jagged(padded, off, 5), values)
    assert torch.equal(jagged_to_padded(values, off, 4, padding_value=-7.0)[1], torch.full((4, 1), -7.0))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_jagged_padded_roundtrip_random(dtype):
    g = torch.Generator().manual_seed(40)
    lengths = [3, 0, 1, 5, 2]
    off = offsets_from_lengths(lengths, dtype)
    values = torch.randn(11, 2, 3, generator=g)
    padded = jagged_to_padded(values, off, 6)
    assert padded.shape == (5, 6, 2, 3)
    for b, n in enumerate(lengths):
        s = int(off[b])
        assert torch.equal(padded[b, :n], values[s:s + n])
        assert not padded[b, n:].any()
    assert torch.equal(padded_to_jagged(padded, off, 11), values)


def test_jagged_padded_empty():
    off = torch.tensor([0, 0, 0])
    values = torch.randn(0, 3)
    padded = jagged_to_padded(values, off, 4)
    assert padded.shape == (2, 4, 3) and not padded.any()
    back = padded_to_jagged(padded, off, 0)
    assert back.shape == (0, 3)
    # B = 0 as well
    assert jagged_to_padded(values, torch.tensor([0]), 4).shape == (0, 4, 3)


def test_jagged_padded_gradcheck():
    g = torch.Generator().manual_seed(41)
    off = torch.tensor([0, 2, 2, 5])
    values = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: jagged_to_padded(t, off, 4), (values,))
    padded = torch.randn(3, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: padded_to_jagged(t, off, 5), (padded,))
    # padding slots receive no gradient
    (gp,) = torch.autograd.grad(padded_to_jagged(padded, off, 5).sum(), padded)
    assert torch.equal(gp[0, 2:], torch.zeros(2, 3, dtype=torch.float64)) and not gp[1].any()


def test_jagged_padded_empty_gradients():
    values = torch.randn(0, 3, dtype=torch.float64, requires_grad=True)
    off = torch.tensor([0, 0])
    (gv,) = torch.autograd.grad(jagged_to_padded(values, off, 2).sum(), values)
    assert gv.shape == (0, 3)


# ------------------------------------------------------------------------------------------------
# STU layer / HSTU model
# ------------------------------------------------------------------------------------------------
def _layer_by_spec(x, off, Nn, layer: STULayer, num_targets=None):
    """The STU block of HSTU_SEMANTICS.md, spelled out, with the loop attention."""
    H, Dq, Dv = layer.num_heads, layer.attn_dim, layer.hidden_dim
    L = x.shape[0]
    n = F.layer_norm(x, (x.shape[1],), layer.ln_weight, layer.ln_bias, layer.eps)
    uvqk = n @ layer.w_uvqk + layer.b_uvqk
    u, v, q, k = uvqk[:, :H * Dv], uvqk[:, H * Dv:2 * H * Dv], uvqk[:, 2 * H * Dv:2 * H * Dv + H * Dq], \
        uvqk[:, 2 * H * Dv + H * Dq:]
    u = F.silu(u)
    a = loop_attention(q.reshape(L, H, Dq), k.reshape(L, H, Dq), v.reshape(L, H, Dv), off, Nn, layer.alpha,
                       num_targets, None, layer.max_attn_len, layer.contextual_seq_len).reshape(L, H * Dv)
    if layer.group_norm:
        normed = torch.cat([F.layer_norm(a[:, h * Dv:(h + 1) * Dv], (Dv,)) for h in range(H)], 1)
        normed = normed * layer.norm_weight + layer.norm_bias
    else:
        normed = F.layer_norm(a, (H * Dv,), layer.norm_weight, layer.norm_bias, layer.eps)
    y = u * normed
    if layer.concat_ua:
        y = torch.cat([u, a, y], 1)
    return x + y @ layer.w_o.t() + layer.b_o


def _spec_case(variant, dtype):
    torch.manual_seed(50)
    layer = STULayer(8, 2, 3, 4, eps=1e-5, **variant).to(dtype).eval()
    with torch.no_grad():  # non-trivial norm/bias parameters
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    off = offsets_from_lengths([3, 5, 1])
    x = torch.randn(9, 8, dtype=dtype)
    nt = torch.tensor([1, 2, 0])
    out = layer(x, off, 6, nt)
    assert out.shape == x.shape and out.dtype == dtype
    return rel_err(out, _layer_by_spec(x.double(), off, 6, layer.double(), nt))


VARIANTS = [dict(), dict(concat_ua=True), dict(group_norm=True), dict(max_attn_len=2, contextual_seq_len=1)]
VARIANT_IDS = ["default", "concat_ua", "group_norm", "window_contextual"]


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_stu_layer_matches_spec_float32(variant):
    assert _spec_case(variant, torch.float32) < 1e-5


def test_stu_layer_matches_spec_float64():
    assert _spec_case(dict(), torch.float64) < 1e-10


def test_stu_layer_gradcheck_float64():
    torch.manual_seed(56)
    layer = STULayer(4, 1, 2, 2).double()
    off = offsets_from_lengths([2, 3])
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t, off, 3), (x,), eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("variant", [dict(), dict(concat_ua=True), dict(group_norm=True), dict(dropout_ratio=0.3)],
                         ids=["default", "concat_ua", "group_norm", "dropout"])
def test_stu_layer_forward_backward_shapes(variant):
    torch.manual_seed(51)
    layer = STULayer(8, 2, 4, 3, **variant).train()
    off = offsets_from_lengths([2, 0, 5])
    x = torch.randn(7, 8, requires_grad=True)
    out = layer(x, off, 5)
    assert out.shape == (7, 8) and torch.isfinite(out).all()
    out.square().sum().backward()
    assert x.grad.shape == x.shape and x.grad.abs().sum() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
    assert layer.w_o.shape == (8, 2 * 3 * (3 if variant.get("concat_ua") else 1))


def test_stu_dropout_eval_is_identity():
    torch.manual_seed(52)
    drop = STULayer(8, 2, 4, 3, dropout_ratio=0.5)
    plain = STULayer(8, 2, 4, 3, dropout_ratio=0.0)
    plain.load_state_dict(drop.state_dict())
    off = offsets_from_lengths([3, 4])
    x = torch.randn(7, 8)
    drop.eval(), plain.eval()
    assert torch.equal(drop(x, off, 4), plain(x, off, 4))
    drop.train()
    assert not torch.equal(drop(x, off, 4), plain(x, off, 4))


def test_stu_layer_functional_equals_module():
    torch.manual_seed(53)
    layer = STULayer(8, 2, 4, 3, max_attn_len=1).eval()
    off = offsets_from_lengths([3, 4])
    x = torch.randn(7, 8)
    params = dict(layer.named_parameters())
    f = stu_layer(x, off, 4, params, 2, 4, 3, max_attn_len=1)
    assert torch.equal(f, layer(x, off, 4))


@pytest.mark.parametrize("kw", [dict(), dict(concat_ua=True, group_norm=True, dropout_ratio=0.1)],
                         ids=["default", "variants"])
def test_hstu_model_forward_backward(kw):
    torch.manual_seed(54)
    model = HSTUModel(num_items=20, max_seq_len=6, embedding_dim=8, num_layers=2, num_heads=2, attn_dim=4,
                      hidden_dim=4, **kw)
    off = offsets_from_lengths([4, 1, 0, 6])
    ids = torch.randint(0, 20, (11,))
    logits = model(ids, off, torch.tensor([1, 0, 0, 2]))
    assert logits.shape == (11, 20) and torch.isfinite(logits).all()
    F.cross_entropy(logits, torch.randint(0, 20, (11,))).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
    model.eval()
    with torch.no_grad():
        a = model(ids, off)
        b = model(ids, off)
    assert torch.equal(a, b)  # eval mode is deterministic (dropout off)


def test_hstu_model_batch_independence():
    torch.manual_seed(55)
    model = HSTUModel(num_items=20, max_seq_len=6, embedding_dim=8, num_layers=2, num_heads=2, attn_dim=4,
                      hidden_dim=4).eval()
    ids = torch.randint(0, 20, (10,))
    both = model(ids, offsets_from_lengths([4, 6]))
    alone = model(ids[4:], offsets_from_lengths([6]))
    assert rel_err(both[4:], alone) < 1e-5


def test_closed_form_backward_matches_autograd():
    """reference.hstu_mha_backward equals autograd through hstu_mha, incl. d(attn_scale)."""
    from hstu_inductor.reference import hstu_mha, hstu_mha_backward

    torch.manual_seed(57)
    off = offsets_from_lengths([0, 1, 5, 7])
    L, N = int(off[-1]), 7
    for scale_shape, kw in (((), dict(num_targets=torch.tensor([0, 1, 2, 3]))),
                            ((L,), dict(max_attn_len=2, contextual_seq_len=1)),
                            (None, dict(min_full_attn_seq_len=2, max_attn_len=1))):
        q, k = (torch.randn(L, 2, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
        v = torch.randn(L, 2, 4, dtype=torch.float64, requires_grad=True)
        s = None if scale_shape is None else torch.rand(scale_shape, dtype=torch.float64, requires_grad=True)
        out = hstu_mha(N, 0.7, q, k, v, off, attn_scale=s, **kw)
        g = torch.randn_like(out)
        want = torch.autograd.grad(out, [q, k, v] + ([s] if s is not None else []), g)
        got = hstu_mha_backward(g, N, 0.7, q.detach(), k.detach(), v.detach(), off, attn_scale=s,
                                need_scale_grad=s is not None, **kw)
        for w, gt in zip(want, got):
            assert rel_err(gt, w) < 1e-12


def test_non_causal_rejects_mask_options():
    from hstu_inductor.reference import hstu_mha

    q = torch.randn(3, 1, 2)
    with pytest.raises(ValueError, match="causal=False"):
        hstu_mha(4, 0.5, q, q, q, offsets_from_lengths([3]), causal=False, max_attn_len=1)
