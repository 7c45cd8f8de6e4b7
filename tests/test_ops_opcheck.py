"""``torch.ops.hstu.*``: opcheck, equality with the eager reference, input validation, fake shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hstu_inductor  # noqa: F401  (registers torch.ops.hstu.*)
from _helpers import random_jagged, rel_err
from hstu_inductor import reference as ref
from hstu_inductor.ops import preprocess_views

ops = torch.ops.hstu
LENGTHS = [3, 0, 5, 1]
N = 6


def _inputs(dtype=torch.float64, seed=0, lengths=LENGTHS, H=2, Dq=3, Dv=4, grad=True):
    return random_jagged(lengths, H, Dq, Dv, dtype=dtype, seed=seed, requires_grad=grad)


def _targets(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([int(torch.randint(0, n + 1, (1,), generator=g)) for n in lengths])


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------
ATTN_CASES = {
    "plain": dict(),
    "targets": dict(num_targets=True),
    "scale_scalar": dict(scale="scalar"),
    "scale_row": dict(scale="row", num_targets=True),
    "window_contextual": dict(w=2, c=1, num_targets=True),
    "window_full": dict(w=1, f=1),
    "non_causal": dict(causal=False),
}


def _attn_args(case, dtype=torch.float64, seed=0, grad=True):
    q, k, v, off = _inputs(dtype, seed, grad=grad)
    nt = _targets(seed=seed) if case.get("num_targets") else None
    scale = None
    if case.get("scale") == "scalar":
        scale = torch.tensor(0.3, dtype=dtype)
    elif case.get("scale") == "row":
        scale = torch.rand(q.shape[0], dtype=dtype, generator=torch.Generator().manual_seed(seed)) + 0.2
    if scale is not None and grad:
        scale.requires_grad_()
    return (q, k, v, off, N, 0.7, nt, scale, case.get("w", 0), case.get("c", 0), case.get("f", 0),
            case.get("causal", True))


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_opcheck_attention(name):
    torch.library.opcheck(ops.attention, _attn_args(ATTN_CASES[name]))


@pytest.mark.parametrize("name", ["plain", "scale_row", "scale_scalar", "window_contextual"])
@pytest.mark.parametrize("need_scale_grad", [False, True])
def test_opcheck_attention_bwd(name, need_scale_grad):
    args = _attn_args(ATTN_CASES[name], grad=False)
    if need_scale_grad and args[7] is None:
        pytest.skip("no attn_scale to differentiate")
    grad = torch.randn(args[0].shape[0], 2, 4, dtype=torch.float64)
    torch.library.opcheck(ops.attention_bwd, (grad, *args, need_scale_grad))


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_attention_op_equals_reference(name):
    case = ATTN_CASES[name]
    args = _attn_args(case, seed=3)
    q, k, v, off, Nn, alpha, nt, scale, w, c, f, causal = args
    out = ops.attention(*args)
    expected = ref.hstu_mha(Nn, alpha, q, k, v, off, causal=causal, num_targets=nt, attn_scale=scale,
                            max_attn_len=w, contextual_seq_len=c, min_full_attn_seq_len=f)
    assert rel_err(out, expected) < 1e-12
    g = torch.randn_like(out)
    wrt = [q, k, v] + ([scale] if scale is not None else [])
    got_grads = torch.autograd.grad(out, wrt, g)
    ref_grads = torch.autograd.grad(expected, wrt, g)
    for a, b in zip(got_grads, ref_grads):
        assert a.shape == b.shape
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("name", ["plain", "scale_row", "window_contextual"])
def test_attention_bwd_op_equals_autograd(name):
    args = _attn_args(ATTN_CASES[name], seed=12)
    q, k, v, scale = args[0], args[1], args[2], args[7]
    out = ref.hstu_mha(args[4], args[5], q, k, v, args[3], num_targets=args[6], attn_scale=scale,
                       max_attn_len=args[8], contextual_seq_len=args[9], min_full_attn_seq_len=args[10])
    g = torch.randn_like(out)
    wrt = [q, k, v] + ([scale] if scale is not None else [])
    expected = torch.autograd.grad(out, wrt, g)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    got = ops.attention_bwd(g, *detached, scale is not None)
    assert got[3].numel() == (0 if scale is None else scale.numel())
    for a, b in zip(got, expected):
        assert rel_err(a, b) < 1e-12


def test_attention_empty_batch():
    e = [torch.randn(0, 2, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    for off in (torch.tensor([0, 0, 0]), torch.tensor([0])):
        out = ops.attention(*e, off, 4, 0.5)
        assert out.shape == (0, 2, 3)
        torch.library.opcheck(ops.attention, (*e, off, 4, 0.5))


def test_attention_op_gradcheck():
    args = list(_attn_args(ATTN_CASES["scale_row"], seed=4))
    q, k, v, scale = args[0], args[1], args[2], args[7]

    def fn(q_, k_, v_, s_):
        a = list(args)
        a[0], a[1], a[2], a[7] = q_, k_, v_, s_
        return ops.attention(*a)

    assert torch.autograd.gradcheck(fn, (q, k, v, scale), eps=1e-6, atol=1e-7)


def test_attention_op_float32():
    args = _attn_args(ATTN_CASES["targets"], dtype=torch.float32, seed=5)
    out = ops.attention(*args)
    assert out.dtype == torch.float32 and out.shape == (9, 2, 4)
    q, k, v, off, Nn, alpha, nt = args[:7]
    assert rel_err(out, ref.hstu_mha(Nn, alpha, q, k, v, off, num_targets=nt)) < 1e-6


def test_attention_scale_grad_only_when_requested():
    args = list(_attn_args(ATTN_CASES["scale_row"], seed=6))
    args[7] = args[7].detach()
    out = ops.attention(*args)
    out.sum().backward()
    assert args[7].grad is None and args[0].grad is not None


# ------------------------------------------------------------------------------------------------
# Delta attention
# ------------------------------------------------------------------------------------------------
def _delta_args(D=2, scale=None, grad=True, seed=0, dtype=torch.float64):
    lengths = [3, 5, 2]
    q, k, v, off = random_jagged(lengths, 2, 3, 4, dtype=dtype, seed=seed, requires_grad=grad)
    B = len(lengths)
    dq = torch.randn(B * D, 2, 3, dtype=dtype, generator=torch.Generator().manual_seed(seed + 1))
    if grad:
        dq.requires_grad_()
    s = None
    if scale == "scalar":
        s = torch.tensor(0.25, dtype=dtype)
    elif scale == "row":
        s = torch.rand(B * D, dtype=dtype) + 0.2
    return (dq, k, v, off, 5, 0.6, torch.tensor([1, 2, 0]), s, 1, 1)


# delta_attention is inference-only (no registered autograd), so it is opchecked without grads.
@pytest.mark.parametrize("scale", [None, "scalar", "row"])
def test_opcheck_delta_attention(scale):
    torch.library.opcheck(ops.delta_attention, _delta_args(scale=scale, grad=False))


def test_opcheck_delta_attention_no_targets():
    args = list(_delta_args(D=1, grad=False))
    args[6], args[8], args[9] = None, 0, 0
    torch.library.opcheck(ops.delta_attention, tuple(args))


@pytest.mark.parametrize("scale", [None, "row"])
def test_delta_attention_equals_reference(scale):
    args = _delta_args(scale=scale, seed=7, grad=False)
    dq, k, v, off, Nn, alpha, nt, s, w, c = args
    out = ops.delta_attention(*args)
    expected = ref.delta_hstu_mha(Nn, alpha, dq, k, v, off, nt, s, w, c)
    assert out.shape == (6, 2, 4)
    assert rel_err(out, expected) < 1e-12


def test_delta_attention_backward_is_a_clear_error():
    # Inference-only op: differentiating through it must fail loudly, never return wrong grads.
    args = _delta_args(seed=8, grad=True)
    out = ops.delta_attention(*args)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


# ------------------------------------------------------------------------------------------------
# STU preprocess / output
# ------------------------------------------------------------------------------------------------
E, H, DV, DQ = 8, 2, 3, 4
UD, QD = H * DV, H * DQ


def _pre_args(affine=True, bias=True, silu_all=False, dtype=torch.float32, grad=True, seed=0, L=7, E=E, UD=UD,
              QD=QD):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, E, dtype=dtype, generator=g)
    lw = torch.rand(E, dtype=dtype, generator=g) + 0.5 if affine else None
    lb = torch.randn(E, dtype=dtype, generator=g) * 0.1 if affine else None
    w = torch.randn(2 * (UD + QD), E, dtype=dtype, generator=g) * 0.3
    b = torch.randn(2 * (UD + QD), dtype=dtype, generator=g) * 0.1 if bias else None
    if grad:
        for t in (x, lw, lb, w, b):
            if t is not None:
                t.requires_grad_()
    return (x, lw, lb, 1e-5, w, b, UD, QD, silu_all)


PRE_CASES = {
    "affine_bias": dict(),
    "no_affine": dict(affine=False),
    "no_bias": dict(bias=False),
    "no_affine_no_bias": dict(affine=False, bias=False),
    "silu_all": dict(silu_all=True),
}


@pytest.mark.parametrize("op", [ops.stu_preprocess, ops.stu_preprocess_save], ids=["recompute", "save"])
@pytest.mark.parametrize("name", list(PRE_CASES))
def test_opcheck_stu_preprocess(name, op):
    torch.library.opcheck(op, _pre_args(**PRE_CASES[name]))


def _pre_grads(silu_all, seed, L=7, which=(True, True)):
    """``(d_act, d_uvqk)`` for ``stu_preprocess_bwd``; a False in ``which`` leaves that one None."""
    g = torch.Generator().manual_seed(seed)
    D = 2 * (UD + QD)
    return tuple(torch.randn(L, d, generator=g) if on else None
                 for d, on in zip((D if silu_all else UD, D), which))


@pytest.mark.parametrize("which", [(True, True), (True, False), (False, True)], ids=["both", "act", "uvqk"])
@pytest.mark.parametrize("saved", [False, True], ids=["recompute", "save"])
@pytest.mark.parametrize("name", list(PRE_CASES))
def test_opcheck_stu_preprocess_bwd(name, saved, which):
    args = _pre_args(**PRE_CASES[name], grad=False)
    extra = tuple(ops.stu_preprocess_save(*args)[1:]) if saved else ()
    torch.library.opcheck(ops.stu_preprocess_bwd, (*_pre_grads(args[-1], 1, which=which), *args, *extra))


def test_stu_preprocess_save_intermediates():
    """The extra outputs are what the backward would recompute and carry no gradient; no output
    aliases another (custom-op rule), not even for one row."""
    args = _pre_args(seed=9)
    x, lw, lb, eps, w, b = args[:6]
    act, uvqk, normed, mean, rstd = ops.stu_preprocess_save(*args)
    assert rel_err(normed, F.layer_norm(x, (x.shape[1],), lw, lb, eps)) < 1e-6
    assert rel_err(uvqk, F.linear(normed, w, b)) < 1e-6
    assert rel_err(act, F.silu(uvqk[:, :UD])) < 1e-6
    assert rel_err(mean.squeeze(1), x.mean(1)) < 1e-6
    assert rel_err(rstd.squeeze(1), (x.var(1, unbiased=False) + eps).rsqrt()) < 1e-6
    assert act.requires_grad and uvqk.requires_grad
    assert not any(t.requires_grad for t in (normed, mean, rstd))
    for silu_all, L in ((False, 7), (True, 7), (False, 1)):
        outs = ops.stu_preprocess_save(*_pre_args(seed=10, L=L, silu_all=silu_all))
        assert len({t.untyped_storage().data_ptr() for t in outs}) == len(outs)


def test_stu_preprocess_bwd_reads_saved_intermediates():
    """With the intermediates given, the backward uses them (a scaled ``normed`` scales ``d_weight``)
    and agrees with the recomputing backward when they are the forward's own."""
    args = _pre_args(grad=False, seed=11)
    grads = _pre_grads(False, 12)
    uvqk, normed, mean, rstd = ops.stu_preprocess_save(*args)[1:]
    recomputed = ops.stu_preprocess_bwd(*grads, *args)
    saved = ops.stu_preprocess_bwd(*grads, *args, uvqk, normed, mean, rstd)
    for a, b in zip(saved, recomputed):
        assert rel_err(a, b) < 1e-6
    scaled = ops.stu_preprocess_bwd(*grads, *args, uvqk, normed * 2, mean, rstd)
    assert rel_err(scaled[3], 2 * recomputed[3]) < 1e-6  # d_weight = d_p^T @ normed


def test_stu_preprocess_bwd_partial_saved_raises():
    args = _pre_args(grad=False)
    uvqk = ops.stu_preprocess_save(*args)[1]
    with pytest.raises(RuntimeError, match="all of uvqk, normed, mean, rstd or none"):
        ops.stu_preprocess_bwd(*_pre_grads(False, 0), *args, uvqk)


def _pre_reference(x, lw, lb, eps, w, b, u_dim, qk_dim, silu_all):
    """The preprocess block of HSTU_SEMANTICS.md, spelled out."""
    n = F.layer_norm(x, (x.shape[1],), lw, lb, eps)
    uvqk = n @ w.t() + (b if b is not None else 0)
    if silu_all:
        uvqk = F.silu(uvqk)
    u, v, q, k = torch.split(uvqk, [u_dim, u_dim, qk_dim, qk_dim], dim=1)
    return (u if silu_all else F.silu(u)), v, q, k


def _pre_views(op, args):
    """The STU's ``(u, v, q, k)``: views of the op's ``(act, uvqk)``."""
    return preprocess_views(*op(*args)[:2], *args[6:9])


@pytest.mark.parametrize("op", [ops.stu_preprocess, ops.stu_preprocess_save], ids=["recompute", "save"])
@pytest.mark.parametrize("name", list(PRE_CASES))
def test_stu_preprocess_equals_reference(name, op):
    """fp64 reference; gradients of all four views, then of subsets (the others get None)."""
    args = _pre_args(**PRE_CASES[name], dtype=torch.float64, seed=2)
    outs = _pre_views(op, args)
    expected = _pre_reference(*args)
    assert [o.shape for o in outs] == [(7, UD), (7, UD), (7, QD), (7, QD)]
    for a, b in zip(outs, expected):
        assert rel_err(a, b) < 1e-12
    tensors = [t for t in (args[0], args[1], args[2], args[4], args[5]) if t is not None]
    for used in ((0, 1, 2, 3), (0,), (1, 3), (2,)):
        gs = [torch.randn_like(outs[i]) for i in used]
        got = torch.autograd.grad([outs[i] for i in used], tensors, gs, retain_graph=True)
        want = torch.autograd.grad([expected[i] for i in used], tensors, gs, retain_graph=True)
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-12, used


def test_stu_preprocess_views_share_the_projection():
    """v, q, k (and u with silu_all) are column views of one tensor: what the attention reads in place."""
    for silu_all in (False, True):
        act, uvqk = ops.stu_preprocess(*_pre_args(grad=False, silu_all=silu_all))
        u, v, q, k = preprocess_views(act, uvqk, UD, QD, silu_all)
        packed = act if silu_all else uvqk
        for t, start in ((v, UD), (q, 2 * UD), (k, 2 * UD + QD)):
            assert t._base is packed and t.storage_offset() == start and t.stride() == (2 * (UD + QD), 1)
        assert (u._base is act) if silu_all else (u is act)


def test_stu_preprocess_equals_reference_module_spelling():
    # hstu_inductor.reference.stu_preprocess uses addmm with W [E, out]; the op uses F.linear [out, E].
    x, lw, lb, eps, w, b, ud, qd, _ = _pre_args(seed=3)
    u, v, q, k = preprocess_views(*ops.stu_preprocess(x, lw, lb, eps, w, b, ud, qd), ud, qd)
    ru, rv, rq, rk = ref.stu_preprocess(x, lw, lb, w.t(), b, H, DQ, DV, eps)
    for a, b_ in zip((u, v, q, k), (ru, rv.reshape(7, -1), rq.reshape(7, -1), rk.reshape(7, -1))):
        assert rel_err(a, b_) < 1e-6


def _out_args(groups=0, concat=False, bias=True, affine=True, dtype=torch.float32, grad=True, seed=0, L=7, E=E,
              UD=UD):
    g = torch.Generator().manual_seed(seed)
    attn = torch.randn(L, UD, dtype=dtype, generator=g)
    u = torch.randn(L, UD, dtype=dtype, generator=g)
    x = torch.randn(L, E, dtype=dtype, generator=g)
    nw = torch.rand(UD, dtype=dtype, generator=g) + 0.5 if affine else None
    nb = torch.randn(UD, dtype=dtype, generator=g) * 0.1 if affine else None
    w = torch.randn(E, UD * (3 if concat else 1), dtype=dtype, generator=g) * 0.3
    b = torch.randn(E, dtype=dtype, generator=g) * 0.1 if bias else None
    if grad:
        for t in (attn, u, x, nw, nb, w, b):
            if t is not None:
                t.requires_grad_()
    return (attn, u, x, nw, nb, 1e-5, groups, w, b, concat)


OUT_CASES = {
    "layer_norm": dict(),
    "group_norm": dict(groups=H),
    "concat_ua": dict(concat=True),
    "group_norm_concat_no_bias": dict(groups=H, concat=True, bias=False),
    "no_bias": dict(bias=False),
    "no_affine": dict(affine=False),
}


@pytest.mark.parametrize("op", [ops.stu_output, ops.stu_output_save], ids=["recompute", "save"])
@pytest.mark.parametrize("name", list(OUT_CASES))
def test_opcheck_stu_output(name, op):
    torch.library.opcheck(op, _out_args(**OUT_CASES[name]))


@pytest.mark.parametrize("saved", [False, True], ids=["recompute", "save"])
@pytest.mark.parametrize("name", list(OUT_CASES))
def test_opcheck_stu_output_bwd(name, saved):
    args = _out_args(**OUT_CASES[name], grad=False)
    grad = torch.randn(7, E, generator=torch.Generator().manual_seed(1))
    extra = (0.0, None, *ops.stu_output_save(*args)[1:]) if saved else ()
    torch.library.opcheck(ops.stu_output_bwd, (grad, *args, *extra))


@pytest.mark.parametrize("name", ["layer_norm", "group_norm_concat_no_bias", "no_affine"])
def test_stu_output_bwd_reads_saved_intermediates(name):
    """The saved ``y, mean, rstd`` are the forward's own (same gradients as recomputing) and are
    really read (a scaled ``y`` scales ``d_weight``)."""
    args = _out_args(**OUT_CASES[name], grad=False, seed=13)
    out, y, mean, rstd = ops.stu_output_save(*args)
    assert torch.equal(out, ops.stu_output(*args))
    assert not any(t.requires_grad for t in (y, mean, rstd))
    grad = torch.randn(7, E, generator=torch.Generator().manual_seed(14))
    recomputed = ops.stu_output_bwd(grad, *args)
    saved = ops.stu_output_bwd(grad, *args, 0.0, None, y, mean, rstd)
    for a, b in zip(saved, recomputed):
        assert rel_err(a, b) < 1e-6
    d_w = 5 if args[3] is not None else 3  # packed gradients: attn, u, x, [nw, nb], w, [b]
    scaled = ops.stu_output_bwd(grad, *args, 0.0, None, y * 2, mean, rstd)
    assert rel_err(scaled[d_w], 2 * recomputed[d_w]) < 1e-6
    with pytest.raises(RuntimeError, match="all of y, mean, rstd or none"):
        ops.stu_output_bwd(grad, *args, 0.0, None, y)


def _out_reference(attn, u, x, nw, nb, eps, groups, w, b, concat):
    if groups:
        Dv = attn.shape[1] // groups
        normed = torch.cat([F.layer_norm(attn[:, h * Dv:(h + 1) * Dv], (Dv,), eps=eps) for h in range(groups)], 1)
        if nw is not None:
            normed = normed * nw + nb
    else:
        normed = F.layer_norm(attn, (attn.shape[1],), nw, nb, eps)
    y = u * normed
    if concat:
        y = torch.cat([u, attn, y], 1)
    return x + y @ w.t() + (b if b is not None else 0)


@pytest.mark.parametrize("name", list(OUT_CASES))
def test_stu_output_equals_reference(name):
    args = _out_args(**OUT_CASES[name], seed=4)
    out = ops.stu_output(*args)
    expected = _out_reference(*args)
    assert out.shape == (7, E)
    assert rel_err(out, expected) < 1e-5
    tensors = [t for t in (args[0], args[1], args[2], args[3], args[4], args[7], args[8]) if t is not None]
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, tensors, g), torch.autograd.grad(expected, tensors, g)):
        assert rel_err(a, b) < 1e-4


def test_stu_output_equals_module_reference():
    attn, u, x, nw, nb, eps, _, w, b, _ = _out_args(seed=5, concat=True)
    got = ops.stu_output(attn, u, x, nw, nb, eps, H, w, b, True)
    expected = ref.stu_output(attn, u, x, nw, nb, w, b, H, eps, concat_ua=True, group_norm=True)
    assert rel_err(got, expected) < 1e-6


# dropout (trailing dropout_p, seed arguments): the mask is a function of (seed, flat index)
DROPOUT_CASES = {
    "layer_norm_p03": (dict(), 0.3),
    "group_norm_concat_p05": (dict(groups=H, concat=True), 0.5),
    "no_affine_no_bias_p01": (dict(affine=False, bias=False), 0.1),
}


def _drop_args(name, grad=True, dtype=torch.float32, seed_value=123, **kw):
    case, p = DROPOUT_CASES[name]
    return (*_out_args(**case, grad=grad, dtype=dtype, **kw), p, torch.tensor(seed_value, dtype=torch.int64))


@pytest.mark.parametrize("name", list(DROPOUT_CASES))
def test_opcheck_stu_output_dropout(name):
    torch.library.opcheck(ops.stu_output, _drop_args(name))


@pytest.mark.parametrize("name", list(DROPOUT_CASES))
def test_opcheck_stu_output_bwd_dropout(name):
    grad = torch.randn(7, E, generator=torch.Generator().manual_seed(1))
    torch.library.opcheck(ops.stu_output_bwd, (grad, *_drop_args(name, grad=False)))


@pytest.mark.parametrize("name", list(DROPOUT_CASES))
def test_stu_output_dropout_equals_reference(name):
    from hstu_inductor.reference.dropout import dropout_keep_mask

    args = _drop_args(name, seed_value=-77)
    attn, u, x, nw, nb, eps, groups, w, b, concat, p, seed = args
    out = ops.stu_output(*args)
    assert torch.equal(out, ops.stu_output(*args))  # reproducible under the seed
    assert rel_err(ops.stu_output(*args[:-1], torch.tensor(-76)), out) > 1e-3  # seed sensitive
    # reference: the projection input times the mask of its flat index, scaled by 1/(1-p)
    w_eye = torch.eye(w.shape[1])
    y = _out_reference(attn, u, torch.zeros(7, w.shape[1]), nw, nb, eps, groups, w_eye, None, concat)
    keep = dropout_keep_mask(seed, y.shape, p)
    expected = x + (y * keep / (1 - p)) @ w.t() + (b if b is not None else 0)
    assert rel_err(out, expected) < 1e-5
    tensors = [t for t in (attn, u, x, nw, nb, w, b) if t is not None]
    g = torch.randn_like(out)
    for a, e in zip(torch.autograd.grad(out, tensors, g), torch.autograd.grad(expected, tensors, g)):
        assert rel_err(a, e) < 1e-4


# silu_u (trailing argument): u is the pre-activation, the block uses silu(u) (patterns.blocks.fuse_u_silu)
SILU_U_CASES = {"layer_norm": (dict(), 0.0),
                "group_norm_concat_no_bias": (dict(groups=H, concat=True, bias=False), 0.0),
                "group_norm_concat_p05": (dict(groups=H, concat=True), 0.5)}


def _silu_u_args(name, **kw):
    """``(attn, u_pre, ..., concat, p, seed)`` for ``SILU_U_CASES[name]`` (append ``silu_u``)."""
    case, p = SILU_U_CASES[name]
    return (*_out_args(**case, **kw), p, torch.tensor(5, dtype=torch.int64) if p else None)


@pytest.mark.parametrize("op", [ops.stu_output, ops.stu_output_save], ids=["recompute", "save"])
def test_opcheck_stu_output_silu_u(op):
    torch.library.opcheck(op, (*_silu_u_args("group_norm_concat_p05"), True))


@pytest.mark.parametrize("saved,name", [(False, "group_norm_concat_p05"), (True, "layer_norm")])
def test_opcheck_stu_output_bwd_silu_u(name, saved):
    args = _silu_u_args(name, grad=False)
    grad = torch.randn(7, E, generator=torch.Generator().manual_seed(15))
    extra = tuple(ops.stu_output_save(*args, True)[1:]) if saved else (None, None, None)
    torch.library.opcheck(ops.stu_output_bwd, (grad, *args, *extra, True))


@pytest.mark.parametrize("op", [ops.stu_output, lambda *a: ops.stu_output_save(*a)[0]], ids=["recompute", "save"])
@pytest.mark.parametrize("name", list(SILU_U_CASES))
def test_stu_output_silu_u_equals_op_on_silu(name, op):
    """fp64: the op on pre-activations with ``silu_u`` equals it on ``silu(u)`` (exactly: the ATen body applies
    the same silu), and every gradient; u's, w.r.t. the pre-activation, also against autograd of the
    reference block (no dropout)."""
    args = _silu_u_args(name, dtype=torch.float64, seed=16)
    attn, u_pre, rest = args[0], args[1], args[2:]
    out = op(*args, True)
    unfused = op(attn, F.silu(u_pre), *rest)
    assert rel_err(out, unfused) < 1e-13
    tensors = [t for t in (attn, u_pre, args[2], args[3], args[4], args[7], args[8]) if t is not None]
    g = torch.randn_like(out)
    outs = [out, unfused]
    if not args[10]:
        outs.append(_out_reference(attn, F.silu(u_pre), *rest[:-2]))
        assert rel_err(out, outs[-1]) < 1e-12
    got, *wants = (torch.autograd.grad(o, tensors, g) for o in outs)
    for want in wants:
        for a, e in zip(got, want):
            assert rel_err(a, e) < 1e-12


@pytest.mark.parametrize("op", [ops.stu_output, lambda *a: ops.stu_output_save(*a)[0]], ids=["recompute", "save"])
def test_stu_output_dropout_gradcheck_float64(op):
    args = list(_drop_args("group_norm_concat_p05", dtype=torch.float64, seed=7, L=3, E=3, UD=4))
    slots = [i for i in (0, 1, 2, 3, 4, 7, 8) if args[i] is not None]

    def fn(*ts):
        a = list(args)
        for i, t in zip(slots, ts):
            a[i] = t
        return op(*a)

    assert torch.autograd.gradcheck(fn, tuple(args[i] for i in slots), eps=1e-6, atol=1e-7)


def test_stu_output_dropout_validation():
    args = _out_args(grad=False)
    with pytest.raises(RuntimeError, match="needs a seed"):
        ops.stu_output(*args, 0.2, None)
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\)"):
        ops.stu_output(*args, 1.0, torch.tensor(1))
    with pytest.raises(RuntimeError, match="one-element int64"):
        ops.stu_output(*args, 0.2, torch.tensor(1.0))
    # p = 0 ignores the seed: identical to the 10-argument call
    assert torch.equal(ops.stu_output(*args, 0.0, torch.tensor(3)), ops.stu_output(*args))


@pytest.mark.parametrize("op", [ops.stu_preprocess, lambda *a: ops.stu_preprocess_save(*a)[:2],
                                lambda *a: preprocess_views(*ops.stu_preprocess_save(*a)[:2], *a[6:9])],
                         ids=["recompute", "save", "save_views"])
@pytest.mark.parametrize("name", ["affine_bias", "no_affine", "silu_all"])
def test_stu_preprocess_gradcheck_float64(name, op):
    args = list(_pre_args(**PRE_CASES[name], dtype=torch.float64, seed=6, L=3, E=4, UD=2, QD=2))
    slots = [i for i in (0, 1, 2, 4, 5) if args[i] is not None]

    def fn(*ts):
        a = list(args)
        for i, t in zip(slots, ts):
            a[i] = t
        return op(*a)

    assert torch.autograd.gradcheck(fn, tuple(args[i] for i in slots), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("op", [ops.stu_output, lambda *a: ops.stu_output_save(*a)[0]], ids=["recompute", "save"])
@pytest.mark.parametrize("name", ["layer_norm", "group_norm_concat_no_bias", "no_affine"])
def test_stu_output_gradcheck_float64(name, op):
    args = list(_out_args(**OUT_CASES[name], dtype=torch.float64, seed=7, L=3, E=3, UD=4))
    slots = [i for i in (0, 1, 2, 3, 4, 7, 8) if args[i] is not None]

    def fn(*ts):
        a = list(args)
        for i, t in zip(slots, ts):
            a[i] = t
        return op(*a)

    assert torch.autograd.gradcheck(fn, tuple(args[i] for i in slots), eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# Input validation: clear errors
# ------------------------------------------------------------------------------------------------
def _good(L=8):
    g = torch.Generator().manual_seed(8)
    q = torch.randn(L, 2, 3, generator=g)
    k = torch.randn(L, 2, 3, generator=g)
    v = torch.randn(L, 2, 4, generator=g)
    return q, k, v, torch.tensor([0, 3, 8])


BAD = {
    "offsets_not_starting_at_0": (lambda q, k, v, o: (q, k, v, torch.tensor([1, 3, 8]), 6, None),
                                  r"seq_offsets\[0\] must be 0"),
    "decreasing_offsets": (lambda q, k, v, o: (q, k, v, torch.tensor([0, 5, 3, 8]), 6, None), "non-decreasing"),
    "offsets_end_not_L": (lambda q, k, v, o: (q, k, v, torch.tensor([0, 3, 7]), 6, None),
                          r"seq_offsets\[-1\]=7 must equal the number of jagged rows L=8"),
    "length_gt_max_seq_len": (lambda q, k, v, o: (q, k, v, o, 4, None), "length 5 > max_seq_len=4"),
    "num_targets_gt_length": (lambda q, k, v, o: (q, k, v, o, 6, torch.tensor([4, 1])), "num_targets"),
    "negative_num_targets": (lambda q, k, v, o: (q, k, v, o, 6, torch.tensor([-1, 1])), "num_targets"),
    "num_targets_wrong_shape": (lambda q, k, v, o: (q, k, v, o, 6, torch.tensor([1, 1, 1])), "num_targets"),
    "float_num_targets": (lambda q, k, v, o: (q, k, v, o, 6, torch.tensor([1.0, 1.0])), "num_targets"),
    "qk_head_mismatch": (lambda q, k, v, o: (q, k[:, :1].contiguous(), v, o, 6, None), "must agree"),
    "qk_dim_mismatch": (lambda q, k, v, o: (q, torch.randn(8, 2, 5), v, o, 6, None), "must agree"),
    "kv_rows_mismatch": (lambda q, k, v, o: (q, k, v[:7], o, 6, None), "must agree"),
    "qk_rows_mismatch": (lambda q, k, v, o: (q[:7], k, v, o, 6, None), "same number of rows"),
    "dtype_mismatch": (lambda q, k, v, o: (q, k.double(), v, o, 6, None), "dtypes differ"),
    "integer_qkv": (lambda q, k, v, o: (q.long(), k.long(), v.long(), o, 6, None), "floating point"),
    "offsets_2d": (lambda q, k, v, o: (q, k, v, o.view(1, 3), 6, None), "must be 1-D"),
    "float_offsets": (lambda q, k, v, o: (q, k, v, o.float(), 6, None), "int32 or int64"),
    "not_3d": (lambda q, k, v, o: (q.view(8, 6), k.view(8, 6), v.view(8, 8), o, 6, None), r"\[L, H, D\]"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_attention_input_validation(name):
    make, msg = BAD[name]
    q, k, v, off, Nn, nt = make(*_good())
    with pytest.raises((RuntimeError, ValueError), match=msg):
        ops.attention(q, k, v, off, Nn, 0.5, nt)
    with pytest.raises((RuntimeError, ValueError), match=msg):
        ref.hstu_mha(Nn, 0.5, q, k, v, off, num_targets=nt)


def test_attention_validation_of_options():
    q, k, v, off = _good()
    with pytest.raises(RuntimeError, match="attn_scale must be a scalar or have shape"):
        ops.attention(q, k, v, off, 6, 0.5, None, torch.ones(3))
    with pytest.raises(ValueError, match="max_attn_len must be >= 0"):
        ops.attention(q, k, v, off, 6, 0.5, None, None, -1)
    with pytest.raises(ValueError, match="contextual_seq_len must be >= 0"):
        ops.attention(q, k, v, off, 6, 0.5, None, None, 0, -2)


def test_delta_attention_validation():
    q, k, v, off = _good()
    dq = torch.randn(4, 2, 3)
    with pytest.raises(RuntimeError, match=r"seq_offsets\[0\] must be 0"):
        ops.delta_attention(dq, k, v, torch.tensor([1, 3, 8]), 6, 0.5)
    with pytest.raises(RuntimeError, match="not a multiple of B"):
        ops.delta_attention(torch.randn(3, 2, 3), k, v, off, 6, 0.5)
    with pytest.raises(RuntimeError, match="must agree"):
        ops.delta_attention(torch.randn(4, 2, 5), k, v, off, 6, 0.5)
    with pytest.raises(RuntimeError, match="at least D=4"):
        ops.delta_attention(torch.randn(8, 2, 3), k, v, off, 6, 0.5)


def test_stu_op_validation():
    x, lw, lb, eps, w, b, ud, qd, s = _pre_args(grad=False)
    with pytest.raises(RuntimeError, match="expected 2\\*\\(u_dim\\+qk_dim\\)"):
        ops.stu_preprocess(x, lw, lb, eps, w, b, ud + 1, qd, s)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.stu_preprocess(x, lw, lb, eps, w.t().contiguous(), b, ud, qd, s)
    attn, u, x, nw, nb, eps, groups, w, b, concat = _out_args(grad=False)
    with pytest.raises(RuntimeError, match="must both be"):
        ops.stu_output(attn, u[:, :-1], x, nw, nb, eps, groups, w, b, concat)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.stu_output(attn, u, x, nw, nb, eps, groups, w, b, True)


# ------------------------------------------------------------------------------------------------
# Fake tensors / symbolic L
# ------------------------------------------------------------------------------------------------
def _attn_fn(q, k, v, off, nt, scale):
    return ops.attention(q, k, v, off, 6, 0.5, nt, scale, 2, 1, 0, True) * 2.0


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()


def test_attention_symbolic_L_aot_eager(fresh_dynamo):
    compiled = torch.compile(_attn_fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for seed, lengths in ((0, [3, 5, 2]), (1, [6, 4, 1])):
        q, k, v, off = random_jagged(lengths, 2, 3, 4, dtype=torch.float32, seed=seed, requires_grad=True)
        nt = torch.tensor([1, 0, 1])
        scale = torch.rand(q.shape[0]) + 0.1
        out = compiled(q, k, v, off, nt, scale)
        assert out.shape == (sum(lengths), 2, 4)
        expected = _attn_fn(q, k, v, off, nt, scale)
        assert rel_err(out, expected) < 1e-6
        g = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
            assert rel_err(a, b) < 1e-5
        if seed == 0:  # the second L must reuse the symbolic graph
            torch.compiler.set_stance("fail_on_recompile")


def test_attention_symbolic_L_changes_B(fresh_dynamo):
    compiled = torch.compile(_attn_fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for seed, lengths in ((2, [3, 5]), (3, [2, 6, 4, 3])):
        q, k, v, off = random_jagged(lengths, 2, 3, 4, dtype=torch.float32, seed=seed)
        nt = torch.ones(len(lengths), dtype=torch.int64)
        out = compiled(q, k, v, off, nt, None)
        assert out.shape == (sum(lengths), 2, 4)
        assert rel_err(out, _attn_fn(q, k, v, off, nt, None)) < 1e-6


def test_delta_attention_symbolic_L(fresh_dynamo):
    def fn(dq, k, v, off):
        return ops.delta_attention(dq, k, v, off, 8, 0.5, None, None, 0, 0)

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for seed, lengths in ((4, [3, 5, 2]), (5, [7, 4, 6])):
        _, k, v, off = random_jagged(lengths, 2, 3, 4, dtype=torch.float32, seed=seed)
        dq = torch.randn(6, 2, 3)
        out = compiled(dq, k, v, off)
        assert out.shape == (6, 2, 4)
        assert rel_err(out, fn(dq, k, v, off)) < 1e-6


def test_stu_ops_symbolic_L(fresh_dynamo):
    _, lw, lb, eps, w, b, ud, qd, s = _pre_args(grad=False)
    _, _, _, nw, nb, _, groups, wo, bo, concat = _out_args(grad=False, groups=H)

    def fn(x):
        u, v, q, k = preprocess_views(*ops.stu_preprocess(x, lw, lb, eps, w, b, ud, qd, s), ud, qd, s)
        attn = v * q[:, :ud].sigmoid()  # stand-in for attention, shapes only
        return ops.stu_output(attn, u, x, nw, nb, eps, groups, wo, bo, concat)

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for L in (5, 9):
        x = torch.randn(L, E, requires_grad=True)
        out = compiled(x)
        assert out.shape == (L, E)
        expected = fn(x)
        assert rel_err(out, expected) < 1e-5
        (gx,) = torch.autograd.grad(out.sum(), x)
        (ex,) = torch.autograd.grad(expected.sum(), x)
        assert gx.shape == (L, E) and rel_err(gx, ex) < 1e-5


def test_fake_impl_shapes_under_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    q, k, v, off = random_jagged([3, 5], 2, 3, 4, dtype=torch.float32, seed=9)
    fq, fk, fv, foff = (mode.from_tensor(t) for t in (q, k, v, off))
    with mode:
        out = ops.attention(fq, fk, fv, foff, 6, 0.5)
        assert out.shape == (8, 2, 4) and out.dtype == torch.float32
        dq, dk, dv, ds = ops.attention_bwd(out, fq, fk, fv, foff, 6, 0.5, None, None, 0, 0, 0, True, False)
        assert (dq.shape, dk.shape, dv.shape, ds.numel()) == ((8, 2, 3), (8, 2, 3), (8, 2, 4), 0)
