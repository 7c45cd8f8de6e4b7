"""Fused STU block kernels (norms, output block, preprocess, dropout RNG) against fp64 references.

Without CUDA the kernels run under the Triton interpreter (conftest.py) on small, odd shapes
(C not a power of two, L not a multiple of the row block, more row blocks than backward programs);
fp32 and fp16 only (bf16 is wrong in the interpreter). Outputs are NaN-poisoned so unwritten
elements fail. ``@pytest.mark.gpu`` cases use real shapes in bf16 and fp32.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import hstu_inductor  # noqa: F401  (registers torch.ops.hstu.*)
from hstu_inductor.kernels import common, norms, rng
from hstu_inductor.kernels import stu_blocks as K
from hstu_inductor.ops import stu as stu_ops
from hstu_inductor.ops.stu import preprocess_views
from hstu_inductor.reference.stu import split_activate, uvqk_grad
from hstu_inductor.reference.dropout import dropout_hash, dropout_keep_mask, keep_threshold

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16]
# relative-norm error bounds (measured on CPU: ~2e-7 fp32, ~5e-4 fp16)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
# gradients that go through a matmul / a reduction over rows lose a bit more
GTOL = {torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
ops = torch.ops.hstu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)


@pytest.fixture
def kernels_on_cpu():
    """Route the hstu STU ops to the Triton path for CPU tensors (interpreter)."""
    old = stu_ops._KERNELS_ON_CPU
    stu_ops._KERNELS_ON_CPU = True
    try:
        yield
    finally:
        stu_ops._KERNELS_ON_CPU = old


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert torch.isfinite(x).all(), "non-finite values (unwritten output?)"
    den = ref.norm().item()
    assert den > 0, "all-zero reference proves nothing"
    return (x - ref).norm().item() / den


def rand(shape, dtype, g, scale=1.0, shift=0.0, device=DEV):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype=dtype, device=device)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def seed_tensor(s, device=DEV):
    return torch.tensor(s, dtype=torch.int64, device=device)


def ref_norm(x64, w64, b64, G, eps):
    """fp64 group norm over G groups of contiguous channels (G=1: layer norm)."""
    L, C = x64.shape
    xg = x64.view(L, G, C // G)
    mean = xg.mean(-1, keepdim=True)
    var = ((xg - mean) ** 2).mean(-1, keepdim=True)
    out = ((xg - mean) / torch.sqrt(var + eps)).view(L, C)
    if w64 is not None:
        out = out * w64
    if b64 is not None:
        out = out + b64
    return out, mean.view(L, G), (var + eps).rsqrt().view(L, G)


def leaf64(*ts):
    return [t.detach().double().cpu().requires_grad_() if t is not None else None for t in ts]


# ------------------------------------------------------------------------------------------
# row normalisation kernels
# ------------------------------------------------------------------------------------------

NORM_CASES = [  # (L, C, G, affine)
    (13, 30, 1, True),
    (77, 30, 1, False),   # more row blocks than backward programs: exercises the strided loop
    (21, 36, 3, True),    # group norm, D = 12
    (9, 20, 4, "weight_only"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,C,G,affine", NORM_CASES)
def test_norm_fwd_bwd(dtype, L, C, G, affine):
    g = gen(L * C + G)
    x = rand((L, C), dtype, g, scale=2.0, shift=0.5)
    w = rand((C,), torch.float32, g, 0.5, 1.0) if affine else None
    b = rand((C,), torch.float32, g, 0.3) if affine is True else None
    y, mean, rstd = norms.norm_fwd(x, w, b, 1e-5, G)
    x64, w64, b64 = leaf64(x, w, b)
    ref, rmean, rrstd = ref_norm(x64, w64, b64, G, 1e-5)
    assert y.dtype == dtype and mean.dtype == rstd.dtype == torch.float32
    assert rel_err(y, ref) < TOL[dtype]
    assert rel_err(mean, rmean) < 1e-6 and rel_err(rstd, rrstd) < 1e-5
    dy = rand((L, C), dtype, g)
    dx, dw, db = norms.norm_bwd(dy, x, w, mean, rstd, G, need_db=b is not None)
    ref.backward(dy.double().cpu())
    assert dx.dtype == dtype and rel_err(dx, x64.grad) < GTOL[dtype]
    assert (dw is None) == (w is None) and (db is None) == (b is None)
    if w is not None:
        assert rel_err(dw, w64.grad) < GTOL[dtype]
    if b is not None:
        assert rel_err(db, b64.grad) < GTOL[dtype]


def test_norm_bwd_deterministic():
    g = gen(5)
    x, dy = rand((77, 30), torch.float32, g), rand((77, 30), torch.float32, g)
    w, b = rand((30,), torch.float32, g, 0.5, 1.0), rand((30,), torch.float32, g)
    _, mean, rstd = norms.norm_fwd(x, w, b, 1e-6)
    first = norms.norm_bwd(dy, x, w, mean, rstd)
    second = norms.norm_bwd(dy, x, w, mean, rstd)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


# ------------------------------------------------------------------------------------------
# dropout RNG: torch <-> Triton bit identity, statistics, seeds
# ------------------------------------------------------------------------------------------


@triton.jit
def _hash_kernel(SEED, OUT, base, n, BLOCK: tl.constexpr):
    idx = base + (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    k1, k2 = rng.seed_keys(SEED)
    m = idx < base + n
    tl.store(OUT + (idx - base), rng.hash32(idx, k1, k2).to(tl.int64), mask=m)


SEEDS = [0, 1, 12345, -7, 2**40 + 3, -(2**62) + 11]


@pytest.mark.parametrize("base", [0, 2**32 - 100, 3 * 2**32 + 5])
def test_hash_triton_equals_torch(base):
    n = 300
    for s in SEEDS:
        seed = seed_tensor(s)
        out = torch.full((n,), -1, dtype=torch.int64, device=DEV)
        _hash_kernel[(triton.cdiv(n, 128),)](seed, out, base, n, BLOCK=128)
        expected = dropout_hash(seed, torch.arange(base, base + n, dtype=torch.int64, device=DEV))
        assert torch.equal(out, expected), s
        assert int(expected.min()) >= 0 and int(expected.max()) < 2**32


def _binomial_ok(kept: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(kept / n - (1 - p)) <= sigmas * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_torch_mask_statistics(p):
    n = 1 << 18
    for s in (0, 99, -3):
        keep = dropout_keep_mask(seed_tensor(s, "cpu"), (n,), p)
        assert _binomial_ok(int(keep.sum()), n, p)
        # no structure between neighbours: pairs kept together at rate (1-p)^2
        both = int((keep[:-1] & keep[1:]).sum())
        assert abs(both / (n - 1) - (1 - p) ** 2) < 5 * math.sqrt((1 - p) ** 2 / n) + 1e-3


def test_seed_sensitivity_and_reproducibility():
    n, p = 1 << 16, 0.3
    base = dropout_keep_mask(seed_tensor(7, "cpu"), (n,), p)
    assert torch.equal(base, dropout_keep_mask(seed_tensor(7, "cpu"), (n,), p))
    for other in (8, 7 + 2**32, -7, 2**63 - 1):
        m = dropout_keep_mask(seed_tensor(other, "cpu"), (n,), p)
        differ = (m != base).float().mean().item()
        assert abs(differ - 2 * p * (1 - p)) < 0.02, (other, differ)
    assert keep_threshold(0.0) == 0 and keep_threshold(0.5) == 2**31
    with pytest.raises(ValueError):
        keep_threshold(1.0)


def _out_inputs(L, C, G, dtype, affine, seed, device=DEV):
    g = gen(seed)
    attn = rand((L, C), dtype, g, 1.5, 0.2, device=device)
    u = rand((L, C), dtype, g, device=device)
    nw = rand((C,), dtype, g, 0.5, 1.0, device=device) if affine else None
    nb = rand((C,), dtype, g, 0.3, device=device) if affine else None
    return attn, u, nw, nb


@pytest.mark.parametrize("concat,p", [(False, 0.3), (True, 0.3), (True, 0.7)])  # 0.7: threshold >= 2**31
def test_kernel_mask_equals_torch_mask(concat, p):
    L, C = 37, 24
    attn, u, _, _ = _out_inputs(L, C, 2, torch.float32, False, 3)
    for s in (5, -11, 2**35 + 1):
        y, _, _ = K.output_y(attn, u, None, None, 1e-5, 2, concat, p, seed_tensor(s))
        y_again, _, _ = K.output_y(attn, u, None, None, 1e-5, 2, concat, p, seed_tensor(s))
        assert torch.equal(y, y_again)  # reproducible under a seed
        keep = dropout_keep_mask(seed_tensor(s, "cpu"), y.shape, p)
        assert torch.equal((y != 0).cpu(), keep)  # random inputs are never exactly 0
        assert _binomial_ok(int(keep.sum()), keep.numel(), p)
    y1, _, _ = K.output_y(attn, u, None, None, 1e-5, 2, concat, p, seed_tensor(1))
    y2, _, _ = K.output_y(attn, u, None, None, 1e-5, 2, concat, p, seed_tensor(2))
    assert not torch.equal(y1 != 0, y2 != 0)


# ------------------------------------------------------------------------------------------
# output block: projection input kernel and its backward
# ------------------------------------------------------------------------------------------


def ref_output_y(attn64, u64, nw64, nb64, G, eps, concat, p, seed):
    normed, _, _ = ref_norm(attn64, nw64, nb64, G, eps)
    y = u64 * normed
    if concat:
        y = torch.cat([u64, attn64, y], 1)
    if p > 0:
        y = y * dropout_keep_mask(seed.cpu(), y.shape, p).double() / (1 - p)
    return y


OUT_Y_CASES = [  # (L, C, groups, concat, affine, p)
    (19, 24, 0, False, True, 0.0),
    (19, 24, 0, True, False, 0.3),
    (23, 30, 3, False, False, 0.0),
    (23, 30, 3, True, True, 0.3),
    (67, 12, 2, False, True, 0.3),   # many row blocks: strided backward loop, partial sums
    (11, 20, 0, True, True, 0.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,C,groups,concat,affine,p", OUT_Y_CASES)
def test_output_y_fwd_bwd(dtype, L, C, groups, concat, affine, p):
    G = max(groups, 1)
    attn, u, nw, nb = _out_inputs(L, C, G, dtype, affine, L + C + groups)
    seed = seed_tensor(1234 + L)
    y, mean, rstd = K.output_y(attn, u, nw, nb, 1e-5, groups, concat, p, seed)
    a64, u64, nw64, nb64 = leaf64(attn, u, nw, nb)
    ref = ref_output_y(a64, u64, nw64, nb64, G, 1e-5, concat, p, seed)
    assert y.shape == (L, 3 * C if concat else C) and y.dtype == dtype
    assert rel_err(y, ref) < TOL[dtype]
    dy = rand(y.shape, dtype, gen(7))
    d_attn, d_u, d_nw, d_nb = K.output_y_bwd(dy, attn, u, nw, nb, mean, rstd, groups, concat, p, seed)
    ref.backward(dy.double().cpu())
    assert rel_err(d_attn, a64.grad) < GTOL[dtype]
    assert rel_err(d_u, u64.grad) < GTOL[dtype]
    if affine:
        assert rel_err(d_nw, nw64.grad) < GTOL[dtype]
        assert rel_err(d_nb, nb64.grad) < GTOL[dtype]
    else:
        assert d_nw is None and d_nb is None


# ------------------------------------------------------------------------------------------
# whole blocks through torch.ops.hstu.* (Triton path forced for CPU tensors)
# ------------------------------------------------------------------------------------------


def ref_stu_output(attn, u, x, nw, nb, eps, groups, w, b, concat, p, seed):
    y = ref_output_y(attn, u, nw, nb, max(groups, 1), eps, concat, p, seed)
    return x + y @ w.t() + (b if b is not None else 0)


OUT_OP_CASES = [  # (groups, concat, bias, affine, p)
    (0, False, True, True, 0.0),
    (0, True, False, True, 0.3),
    (3, False, True, False, 0.3),
    (3, True, True, True, 0.0),
]


OUT_OPS = {"recompute": lambda *a: ops.stu_output(*a), "save": lambda *a: ops.stu_output_save(*a)[0]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,concat,bias,affine,p", OUT_OP_CASES)
@pytest.mark.parametrize("mode", list(OUT_OPS))
def test_stu_output_op_kernels(kernels_on_cpu, dtype, groups, concat, bias, affine, p, mode):
    L, C, E = 29, 24, 20
    attn, u, nw, nb = _out_inputs(L, C, max(groups, 1), dtype, affine, 40 + groups)
    g = gen(41)
    x = rand((L, E), dtype, g)
    w = rand((E, C * (3 if concat else 1)), dtype, g, 0.2)
    b = rand((E,), dtype, g, 0.1) if bias else None
    seed = seed_tensor(99) if p > 0 else None
    leaves = [t.requires_grad_() if t is not None else None for t in (attn, u, x, nw, nb, w, b)]
    out = OUT_OPS[mode](attn, u, x, nw, nb, 1e-5, groups, w, b, concat, p, seed)
    a64, u64, x64, nw64, nb64, w64, b64 = leaf64(*leaves)
    ref = ref_stu_output(a64, u64, x64, nw64, nb64, 1e-5, groups, w64, b64, concat, p, seed)
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype] * 2
    grad = rand(out.shape, dtype, gen(42))
    live = [t for t in leaves if t is not None]
    got = torch.autograd.grad(out, live, grad)
    ref.backward(grad.double().cpu())
    for name, a, r in zip("attn u x nw nb w b".split(), got, [t for t in (a64, u64, x64, nw64, nb64, w64, b64)
                                                            if t is not None]):
        assert rel_err(a, r.grad) < GTOL[dtype], name


SILU_U_CASES = [  # (mode, groups, concat, p)
    ("recompute", 0, False, 0.0),
    ("save", 0, True, 0.3),
    ("recompute", 3, True, 0.0),
    ("save", 3, False, 0.3),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,groups,concat,p", SILU_U_CASES)
def test_stu_output_op_kernels_silu_u(kernels_on_cpu, dtype, mode, groups, concat, p):
    """``silu_u=True`` on pre-activations (silu in the kernels) equals the op on ``silu(u)``: the output and
    every gradient, u's w.r.t. the pre-activation (fp64 autograd through the silu; and the op with
    ``silu_u=False`` behind torch's silu)."""
    L, C, E = 29, 24, 20
    attn, u_pre, nw, nb = _out_inputs(L, C, max(groups, 1), dtype, True, 140 + groups)
    g = gen(141)
    x = rand((L, E), dtype, g)
    w = rand((E, C * (3 if concat else 1)), dtype, g, 0.2)
    b = rand((E,), dtype, g, 0.1)
    seed = seed_tensor(77) if p > 0 else None
    leaves = [t.requires_grad_() for t in (attn, u_pre, x, nw, nb, w, b)]
    out = OUT_OPS[mode](attn, u_pre, x, nw, nb, 1e-5, groups, w, b, concat, p, seed, True)
    unfused = OUT_OPS[mode](attn, F.silu(u_pre), x, nw, nb, 1e-5, groups, w, b, concat, p, seed)
    a64, u64, x64, nw64, nb64, w64, b64 = leaf64(*leaves)
    ref = ref_stu_output(a64, F.silu(u64), x64, nw64, nb64, 1e-5, groups, w64, b64, concat, p, seed)
    assert rel_err(out, ref) < TOL[dtype] * 2 and rel_err(out, unfused) < TOL[dtype] * 2
    grad = rand(out.shape, dtype, gen(142))
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(unfused, leaves, grad)
    ref.backward(grad.double().cpu())
    for name, a, c, r in zip("attn u x nw nb w b".split(), got, want, (a64, u64, x64, nw64, nb64, w64, b64)):
        assert rel_err(a, r.grad) < GTOL[dtype] and rel_err(a, c) < GTOL[dtype], name


def test_fp32_norm_params_with_fp16_activations(kernels_on_cpu):
    """Mixed precision: fp32 norm weights with fp16 activations take the kernel path; their grads
    come back in fp32."""
    dtype, L, C, E = torch.float16, 21, 24, 20
    g = gen(45)
    attn, u, x = rand((L, C), dtype, g), rand((L, C), dtype, g), rand((L, E), dtype, g)
    nw, nb = rand((C,), torch.float32, g, 0.5, 1.0), rand((C,), torch.float32, g, 0.3)
    w, b = rand((E, C), dtype, g, 0.2), rand((E,), dtype, g, 0.1)
    lw, lb = rand((E,), torch.float32, g, 0.5, 1.0), rand((E,), torch.float32, g, 0.3)
    wp = rand((4 * C, E), dtype, g, 0.3)
    leaves = [t.requires_grad_() for t in (attn, u, x, nw, nb, w, b, lw, lb, wp)]
    out = ops.stu_output(attn, u, x, nw, nb, 1e-5, 3, w, b, False, 0.3, seed_tensor(8))
    pre = PRE_OPS["recompute"](x, lw, lb, 1e-5, wp, None, C, C, False)
    a64, u64, x64, nw64, nb64, w64, b64, lw64, lb64, wp64 = leaf64(*leaves)
    ref = ref_stu_output(a64, u64, x64, nw64, nb64, 1e-5, 3, w64, b64, False, 0.3, seed_tensor(8))
    pref = ref_stu_preprocess(x64, lw64, lb64, 1e-5, wp64, None, C, C, False)
    assert rel_err(out, ref) < 2 * TOL[dtype]
    for o, r in zip(pre, pref):
        assert rel_err(o, r) < 2 * TOL[dtype]
    go = rand(out.shape, dtype, gen(46))
    gp = [rand(o.shape, dtype, gen(47 + i)) for i, o in enumerate(pre)]
    got = torch.autograd.grad([out, *pre], leaves, [go, *gp])
    torch.autograd.backward([ref, *pref], [go.double(), *[t.double() for t in gp]])
    for a, r, t in zip(got, (a64, u64, x64, nw64, nb64, w64, b64, lw64, lb64, wp64), leaves):
        assert a.dtype == t.dtype and rel_err(a, r.grad) < GTOL[dtype]


def test_stu_output_cpu_body_and_kernels_agree_on_dropout(kernels_on_cpu):
    """The ATen (CPU) body and the Triton path draw the same mask for the same seed."""
    L, C, E, p = 31, 24, 16, 0.3
    attn, u, nw, nb = _out_inputs(L, C, 1, torch.float32, True, 50, device="cpu")
    g = gen(51)
    x = rand((L, E), torch.float32, g, device="cpu")
    w, b = rand((E, 3 * C), torch.float32, g, 0.2, device="cpu"), None
    seed = seed_tensor(2024, "cpu")
    args = (attn, u, x, nw, nb, 1e-5, 0, w, b, True, p, seed)
    via_kernels = ops.stu_output(*args)
    stu_ops._KERNELS_ON_CPU = False
    via_aten = ops.stu_output(*args)
    other_seed = ops.stu_output(*args[:-1], seed_tensor(2025, "cpu"))
    assert rel_err(via_kernels, via_aten) < 1e-5
    assert rel_err(other_seed, via_aten) > 1e-2
    grad = rand((L, E), torch.float32, g, device="cpu")
    d_aten = ops.stu_output_bwd(grad, *args)
    stu_ops._KERNELS_ON_CPU = True
    d_kern = ops.stu_output_bwd(grad, *args)
    for a, r in zip(d_kern, d_aten):
        assert rel_err(a, r) < 1e-4


def ref_stu_preprocess(x, lw, lb, eps, w, b, ud, qd, silu_all):
    n, _, _ = ref_norm(x, lw, lb, 1, eps)
    uvqk = n @ w.t() + (b if b is not None else 0)
    if silu_all:
        uvqk = F.silu(uvqk)
    u, v, q, k = torch.split(uvqk, [ud, ud, qd, qd], 1)
    return (u if silu_all else F.silu(u)), v, q, k


PRE_CASES = [  # (affine, bias, silu_all)
    (True, True, False),
    (False, True, True),
    (True, False, True),
    (False, False, False),
]


# stu_preprocess: the backward recomputes; stu_preprocess_save: it reads the forward's intermediates.
# Each returns (act, uvqk) (PRE_RAW); PRE_OPS takes the STU's (u, v, q, k) views of them.
PRE_RAW = {"recompute": ops.stu_preprocess, "save": lambda *a: ops.stu_preprocess_save(*a)[:2]}
PRE_OPS = {m: (lambda *a, op=op: preprocess_views(*op(*a), *a[6:9])) for m, op in PRE_RAW.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine,bias,silu_all", PRE_CASES)
@pytest.mark.parametrize("mode", list(PRE_OPS))
def test_stu_preprocess_op_kernels(kernels_on_cpu, dtype, affine, bias, silu_all, mode):
    L, E, UD, QD = 27, 20, 12, 10  # width 44: not a power of two, several column tiles
    g = gen(60 + 2 * affine + bias)
    x = rand((L, E), dtype, g, 1.5, 0.3)
    lw = rand((E,), dtype, g, 0.5, 1.0) if affine else None
    lb = rand((E,), dtype, g, 0.2) if affine else None
    w = rand((2 * (UD + QD), E), dtype, g, 0.3)
    b = rand((2 * (UD + QD),), dtype, g, 0.3) if bias else None
    leaves = [t.requires_grad_() if t is not None else None for t in (x, lw, lb, w, b)]
    raw = PRE_RAW[mode](x, lw, lb, 1e-5, w, b, UD, QD, silu_all)
    assert all(o.dtype == dtype and o.is_contiguous() for o in raw)
    outs = preprocess_views(*raw, UD, QD, silu_all)
    x64, lw64, lb64, w64, b64 = leaf64(*leaves)
    refs = ref_stu_preprocess(x64, lw64, lb64, 1e-5, w64, b64, UD, QD, silu_all)
    for o, r in zip(outs, refs):
        assert rel_err(o, r) < TOL[dtype] * 2
    live = [t for t in leaves if t is not None]
    live64 = [t for t in (x64, lw64, lb64, w64, b64) if t is not None]
    # the views' gradients (what the STU uses), then some outputs without any: their grads are None
    for used in ((0, 1, 2, 3), (1, 2)):
        grads = [rand(outs[i].shape, dtype, gen(61 + i)) for i in used]
        got = torch.autograd.grad([outs[i] for i in used], live, grads, retain_graph=True)
        want = torch.autograd.grad([refs[i] for i in used], live64, [t.double().cpu() for t in grads],
                                   retain_graph=True)
        for a, r in zip(got, want):
            assert rel_err(a, r) < GTOL[dtype]


@pytest.mark.parametrize("silu_all", [False, True])
@pytest.mark.parametrize("mode", list(PRE_RAW))
def test_stu_preprocess_op_kernels_raw_outputs(kernels_on_cpu, silu_all, mode):
    """Gradients of both raw outputs at once: d_uvqk also covers the activated columns (overlapping d_act)."""
    dtype, L, E, UD, QD = torch.float32, 19, 12, 6, 10
    g = gen(66 + silu_all)
    leaves = [rand(s, dtype, g, sc, sh).requires_grad_()
              for s, sc, sh in (((L, E), 1.5, 0.3), ((E,), 0.5, 1.0), ((E,), 0.2, 0.0),
                                ((2 * (UD + QD), E), 0.3, 0.0), ((2 * (UD + QD),), 0.3, 0.0))]
    x, lw, lb, w, b = leaves
    act, uvqk = PRE_RAW[mode](x, lw, lb, 1e-5, w, b, UD, QD, silu_all)
    x64, lw64, lb64, w64, b64 = leaf64(*leaves)
    p64 = ref_norm(x64, lw64, lb64, 1, 1e-5)[0] @ w64.t() + b64
    act64 = F.silu(p64 if silu_all else p64[:, :UD])
    assert rel_err(act, act64) < TOL[dtype] and rel_err(uvqk, p64) < TOL[dtype]
    grads = [rand(t.shape, dtype, gen(67 + i)) for i, t in enumerate((act, uvqk))]
    got = torch.autograd.grad((act, uvqk), leaves, grads)
    want = torch.autograd.grad((act64, p64), (x64, lw64, lb64, w64, b64), [t.double().cpu() for t in grads])
    for a, r in zip(got, want):
        assert rel_err(a, r) < GTOL[dtype]


@pytest.mark.parametrize("bias", [True, False])
def test_saved_projection_inputs_carry_a_ones_column(kernels_on_cpu, bias):
    """With a bias, the kernel path stores both projection inputs (normed x, the output block's y) with a ones
    column after them, zeros up to ``ones_column_width`` (their backwards take the bias gradient from the
    weight-gradient GEMM); without one, the plain ``[L, C]``. Odd widths: the padding is not a power of two."""
    from hstu_inductor.kernels.norms import ones_column_width
    L, E, C = 13, 20, 12
    g = gen(70)
    x, attn, u = rand((L, E), torch.float32, g), rand((L, C), torch.float32, g), rand((L, C), torch.float32, g)
    wp, wo = rand((4 * C, E), torch.float32, g, 0.3), rand((E, 3 * C), torch.float32, g, 0.2)
    bp, bo = (rand((4 * C,), torch.float32, g), rand((E,), torch.float32, g)) if bias else (None, None)
    normed = ops.stu_preprocess_save(x, None, None, 1e-5, wp, bp, C, C, False)[2]
    y = ops.stu_output_save(attn, u, x, None, None, 1e-5, 0, wo, bo, True)[1]
    for t, cols in ((normed, E), (y, 3 * C)):
        assert t.shape == (L, ones_column_width(cols) if bias else cols)
        if bias:
            assert torch.equal(t[:, cols], torch.ones(L)) and not t[:, cols + 1:].any()
    assert rel_err(normed[:, :E], F.layer_norm(x.double(), (E,), eps=1e-5)) < 1e-5


def test_split_activate_and_uvqk_grad_direct():
    L, UD, QD = 9, 5, 3
    g = gen(70)
    p = rand((L, 2 * (UD + QD)), torch.float32, g)
    for silu_all in (False, True):
        u, v, q, k = split_activate(p, UD, QD, silu_all)
        act = F.silu(p) if silu_all else p
        assert torch.allclose(u, F.silu(p[:, :UD]), atol=1e-6)
        for t, lo, hi in ((v, UD, 2 * UD), (q, 2 * UD, 2 * UD + QD), (k, 2 * UD + QD, 2 * (UD + QD))):
            assert torch.allclose(t, act[:, lo:hi], atol=1e-6)
        d_act = rand((L, 2 * (UD + QD) if silu_all else UD), torch.float32, g)
        d_uvqk = rand(p.shape, torch.float32, g)
        pre = p if silu_all else p[:, :UD]  # the recompute path has only the activated columns
        p64 = p.double().requires_grad_()
        act64 = F.silu(p64 if silu_all else p64[:, :UD])
        for da, du in ((d_act, d_uvqk), (d_act, None), (None, d_uvqk)):
            dp = uvqk_grad(da, du, pre, p.shape[1])
            outs, gs = zip(*[(o, t.double()) for o, t in ((act64, da), (p64, du)) if t is not None])
            (want,) = torch.autograd.grad(outs, p64, gs, retain_graph=True)
            assert rel_err(dp, want) < 1e-6
        assert torch.equal(uvqk_grad(None, None, pre, p.shape[1]), torch.zeros_like(p))


def test_cuda_routing_rules():
    """Which calls take the Triton path (without running it)."""
    cpu = torch.randn(4, 8)
    assert stu_ops._kernels_for(cpu, channels=8) is None
    old = stu_ops._KERNELS_ON_CPU
    stu_ops._KERNELS_ON_CPU = True
    try:
        assert stu_ops._kernels_for(cpu, channels=8) is not None
        assert stu_ops._kernels_for(cpu.double(), channels=8) is None       # fp64 stays on ATen
        assert stu_ops._kernels_for(cpu, cpu.half(), channels=8) is None    # mixed dtypes
        assert stu_ops._kernels_for(cpu, channels=1 << 15) is None          # row wider than a tile
        assert stu_ops._kernels_for(cpu.half(), norm_params=(cpu, None), channels=8) is not None
        assert stu_ops._kernels_for(cpu, norm_params=(cpu.double(),), channels=8) is None
        with hstu_inductor.config.patch(kernels="off"):
            assert stu_ops._kernels_for(cpu, channels=8) is None
    finally:
        stu_ops._KERNELS_ON_CPU = old


# ------------------------------------------------------------------------------------------
# GPU: real shapes (L ~ 8000, E = 512, H = 4, D = 128), bf16 and fp32
# ------------------------------------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float32]
L_GPU, E_GPU, H_GPU, D_GPU = 8011, 512, 4, 128


def _fp32_exact_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("groups,concat,p", [(0, False, 0.0), (H_GPU, False, 0.3), (0, True, 0.3),
                                             (H_GPU, True, 0.0)])
@pytest.mark.parametrize("mode", list(OUT_OPS))
def test_gpu_stu_output(dtype, groups, concat, p, mode):
    _fp32_exact_matmuls()
    L, C, E = L_GPU, H_GPU * D_GPU, E_GPU
    attn, u, nw, nb = _out_inputs(L, C, max(groups, 1), dtype, True, 80)
    g = gen(81)
    x = rand((L, E), dtype, g)
    w = rand((E, C * (3 if concat else 1)), dtype, g, 1 / math.sqrt(C))
    b = rand((E,), dtype, g, 0.1)
    seed = seed_tensor(31337) if p > 0 else None
    leaves = [t.requires_grad_() for t in (attn, u, x, nw, nb, w, b)]
    out = OUT_OPS[mode](attn, u, x, nw, nb, 1e-5, groups, w, b, concat, p, seed)
    a64, u64, x64, nw64, nb64, w64, b64 = leaf64(*leaves)
    ref = ref_stu_output(a64, u64, x64, nw64, nb64, 1e-5, groups, w64, b64, concat, p, seed)
    assert rel_err(out, ref) < TOL[dtype] * 2
    grad = rand(out.shape, dtype, gen(82))
    got = torch.autograd.grad(out, leaves, grad)
    ref.backward(grad.double().cpu())
    for name, a, r in zip("attn u x nw nb w b".split(), got, (a64, u64, x64, nw64, nb64, w64, b64)):
        assert rel_err(a, r.grad) < GTOL[dtype], name
    if p > 0:  # the GPU mask is the CPU torch mask, bit for bit
        y, _, _ = K.output_y(attn.detach(), u.detach(), None, None, 1e-5, groups, concat, p, seed)
        y0, _, _ = K.output_y(attn.detach(), u.detach(), None, None, 1e-5, groups, concat)
        keep = dropout_keep_mask(seed.cpu(), y.shape, p)
        # compare where the undropped value is nonzero: randn yields a few exact zeros at this size
        nz = (y0 != 0).cpu()
        assert nz.float().mean() > 0.999
        assert torch.equal((y != 0).cpu()[nz], keep[nz])
        assert _binomial_ok(int(keep.sum()), keep.numel(), p)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("silu_all", [False, True])
@pytest.mark.parametrize("mode", list(PRE_OPS))
def test_gpu_stu_preprocess(dtype, silu_all, mode):
    _fp32_exact_matmuls()
    L, E, UD, QD = L_GPU, E_GPU, H_GPU * D_GPU, H_GPU * D_GPU
    g = gen(90)
    x = rand((L, E), dtype, g)
    lw, lb = rand((E,), dtype, g, 0.5, 1.0), rand((E,), dtype, g, 0.2)
    w = rand((2 * (UD + QD), E), dtype, g, 1 / math.sqrt(E))
    b = rand((2 * (UD + QD),), dtype, g, 0.1)
    leaves = [t.requires_grad_() for t in (x, lw, lb, w, b)]
    outs = PRE_OPS[mode](x, lw, lb, 1e-6, w, b, UD, QD, silu_all)
    x64, lw64, lb64, w64, b64 = leaf64(*leaves)
    refs = ref_stu_preprocess(x64, lw64, lb64, 1e-6, w64, b64, UD, QD, silu_all)
    for o, r in zip(outs, refs):
        assert rel_err(o, r) < TOL[dtype] * 2
    grads = [rand(o.shape, dtype, gen(91 + i)) for i, o in enumerate(outs)]
    got = torch.autograd.grad(outs, leaves, grads)
    torch.autograd.backward(refs, [t.double().cpu() for t in grads])
    for name, a, r in zip("x lw lb w b".split(), got, (x64, lw64, lb64, w64, b64)):
        assert rel_err(a, r.grad) < GTOL[dtype], name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_norm_kernels(dtype):
    L, C = L_GPU, E_GPU
    for G in (1, H_GPU):
        g = gen(100 + G)
        x = rand((L, C), dtype, g, 2.0, 0.5)
        w, b = rand((C,), torch.float32, g, 0.5, 1.0), rand((C,), torch.float32, g, 0.3)
        y, mean, rstd = norms.norm_fwd(x, w, b, 1e-5, G)
        x64, w64, b64 = leaf64(x, w, b)
        ref, _, _ = ref_norm(x64, w64, b64, G, 1e-5)
        assert rel_err(y, ref) < TOL[dtype]
        dy = rand((L, C), dtype, g)
        dx, dw, db = norms.norm_bwd(dy, x, w, mean, rstd, G)
        ref.backward(dy.double().cpu())
        assert rel_err(dx, x64.grad) < GTOL[dtype]
        assert rel_err(dw, w64.grad) < GTOL[dtype] and rel_err(db, b64.grad) < GTOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("concat,p", [(False, 0.3), (True, 0.0)])
def test_gpu_stu_ops_under_torch_compile(concat, p):
    """Inductor embeds the wrap_triton launches (user-defined Triton kernels); results match eager."""
    torch._dynamo.reset()
    _fp32_exact_matmuls()
    dtype, L, E, H, D = torch.bfloat16, 1000, 256, 2, 64
    C = H * D
    g = gen(110)
    x = rand((L, E), dtype, g)
    lw, lb = rand((E,), dtype, g, 0.5, 1.0), rand((E,), dtype, g, 0.2)
    wp, bp = rand((4 * C, E), dtype, g, 1 / math.sqrt(E)), rand((4 * C,), dtype, g, 0.1)
    nw, nb = rand((C,), dtype, g, 0.5, 1.0), rand((C,), dtype, g, 0.2)
    wo, bo = rand((E, C * (3 if concat else 1)), dtype, g, 1 / math.sqrt(C)), rand((E,), dtype, g, 0.1)
    seed = seed_tensor(5)
    params = [t.requires_grad_() for t in (x, lw, lb, wp, bp, nw, nb, wo, bo)]

    def block(x, lw, lb, wp, bp, nw, nb, wo, bo):
        u, v, q, k = preprocess_views(*ops.stu_preprocess(x, lw, lb, 1e-6, wp, bp, C, C, False), C, C)
        attn = v * torch.sigmoid(q + k)  # stand-in for attention
        return ops.stu_output(attn, u, x, nw, nb, 1e-6, H, wo, bo, concat, p, seed)

    eager = block(*params)
    compiled = torch.compile(block, fullgraph=True)(*params)
    assert rel_err(compiled, eager) < 1e-2
    ge = torch.autograd.grad(eager.float().sum(), params)
    gc = torch.autograd.grad(compiled.float().sum(), params)
    for a, r in zip(gc, ge):
        assert rel_err(a, r) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("concat_ua", [False, True])
def test_gpu_stu_layer_silu_u_in_output_kernels(concat_ua):
    """A bf16 STU layer compiled with backend="hstu": silu(u) runs inside the output block's kernels
    (``fuse_u_silu``), so no Inductor-generated kernel computes a silu, forward or backward (the
    separate silu(u) kernel and the silu backward in the d_uvqk assembly are gone); with the pass off
    they are found (the check can fail). Eager-equal outputs and gradients either way."""
    import re

    from torch._inductor.utils import run_and_get_code

    from hstu_inductor.reference import STULayer
    from hstu_inductor.report import collecting
    from _helpers import cuda_stu_batch
    from _helpers import rel_err as rel

    _fp32_exact_matmuls()
    E, H, D, N = 256, 2, 64, 256
    x, off, nt = cuda_stu_batch(8, N, E, seed=6)
    torch.manual_seed(0)
    layer = STULayer(E, H, D, D, concat_ua=concat_ua).to("cuda", torch.bfloat16)
    with torch.no_grad():  # parameters away from their ones/zeros initialisation
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    leaves = [x.requires_grad_(), *layer.parameters()]
    cot = torch.randn(x.shape, generator=gen(120)).to("cuda", torch.bfloat16)
    eager = layer(x, off, N, nt)
    want = torch.autograd.grad(eager, leaves, cot)

    def silu_kernels(fuse):
        torch._dynamo.reset()
        with hstu_inductor.config.patch(fuse_u_silu=fuse), collecting() as report:
            compiled = torch.compile(layer, backend="hstu")

            def step():
                out = compiled(x, off, N, nt)
                return out, torch.autograd.grad(out, leaves, cot)

            (out, grads), codes = run_and_get_code(step)
        assert ("silu(u)" in [k for k, _ in report.details]) == fuse, str(report)
        assert rel(out, eager) < 2e-2
        for name, g, w in zip(["x", *(n for n, _ in layer.named_parameters())], grads, want):
            assert rel(g, w) < 5e-2, name
        code = "\n".join(codes)
        assert "_out_fwd_kernel" in code and "_out_bwd_kernel" in code
        kernels = re.findall(r"async_compile\.triton\('(\w+)',\s*'''(.*?)'''", code, re.S)
        # Inductor names its kernels after the fused ATen ops (triton_poi_fused_silu_slice_0, ..._silu_backward_...);
        # its silu is x / (1 + exp(-x)) on 2.11, tl.sigmoid elsewhere
        return [name for name, src in kernels if name.startswith("triton_") and ("silu" in name or "sigmoid" in src)]

    assert silu_kernels(True) == []
    assert silu_kernels(False)
