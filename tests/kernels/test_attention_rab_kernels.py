"""Triton kernels with a dense rab and interval masks (docs/semantics.md) against the fp64 reference.

CPU: the Triton interpreter at small sizes (fresh random inputs, lengths 0, 1 and N, NaN-poisoned
outputs); ``@pytest.mark.gpu``: bf16/fp16 at realistic sizes.
"""
from __future__ import annotations

import pytest
import torch

from hstu_inductor.kernels import attention as K
from hstu_inductor.kernels import common
from hstu_inductor.reference import hstu_mha, sla_intervals

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
SMALL = pytest.mark.skipif(HAS_CUDA, reason="interpreter-sized cases; the gpu-marked tests cover CUDA")
TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
LENGTHS = [13, 0, 1, 32]  # includes 0, 1 and N
N = 32


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite values (unwritten output?)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)


def _batch(lengths, H, D, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(lengths).cumsum(0)
    L = sum(lengths)
    q, k, v, dout = (torch.randn(L, H, D, generator=g).to(dtype=dtype, device=device) for _ in range(4))
    return q, k, v, dout, off.to(device)


def _rab(shape, n, H, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, n, n, generator=g).to(dtype=dtype, device=device)


def _random_intervals(lengths, heads, seed, device=DEV):
    """Sorted random triples per head and row, values in [0, n_b + 2] (past n_b on purpose)."""
    g = torch.Generator().manual_seed(seed)
    cols = [torch.randint(0, n + 3, (heads, n, 3), generator=g) for n in lengths]
    return torch.cat(cols, dim=1).sort(dim=-1).values.to(device)


def _check(q, k, v, dout, off, n, alpha, *, rab=None, intervals=None, tma=False, deterministic=True,
           tol=None, ref_inputs=None, **kw):
    """Kernel fwd + bwd (incl. d rab) against autograd through the fp64 reference."""
    tol = tol or TOL[q.dtype]
    out = K.hstu_attention_fwd(q, k, v, off, n, alpha, tma=tma, rab=rab, intervals=intervals, **kw)
    got = K.hstu_attention_bwd(dout, q, k, v, off, n, alpha, tma=tma, deterministic=deterministic, rab=rab,
                               intervals=intervals, rab_grad=rab is not None, **kw)
    rq, rk, rv, rdo = ref_inputs or (q, k, v, dout)
    leaves = [t.detach().double().requires_grad_() for t in (rq, rk, rv)]
    rab64 = None if rab is None else rab.detach().double().requires_grad_()
    ref = hstu_mha(n, alpha, *leaves, off, rab=rab64, intervals=intervals, training=False, **kw)
    ref.backward(rdo.double())
    want = [t.grad for t in leaves] + ([rab64.grad] if rab is not None else [])
    assert out.dtype == q.dtype and rel_err(out, ref) < tol, f"fwd {rel_err(out, ref):.2e}"
    assert len(got) == len(want)
    for name, x, r in zip(("dq", "dk", "dv", "drab"), got, want):
        assert x.shape == r.shape and x.dtype == (rab.dtype if name == "drab" else q.dtype), name
        e = rel_err(x, r)
        assert e < tol, f"{name} rel err {e:.2e}"


# ------------------------------------------------------------------------------------------
# CPU (interpreter)
# ------------------------------------------------------------------------------------------

RAB_CASES = {  # rab broadcast shape, mask options, tma, backward algorithm
    "BH_ctx_targets": ((4, 2), dict(contextual_seq_len=3, num_targets=[2, 0, 1, 3]), True, "split"),
    "1H_window_minfull": ((1, 2), dict(max_attn_len=5, min_full_attn_seq_len=4), False, "atomic"),
    "B1_noncausal_scale": ((4, 1), dict(causal=False, attn_scale="scalar"), False, "split"),
    "11_causal_rowscale": ((1, 1), dict(attn_scale="rows", num_targets=[1, 0, 0, 2]), True, "atomic"),
}


@SMALL
@pytest.mark.parametrize("case", list(RAB_CASES))
def test_rab_fwd_bwd(case, poison, monkeypatch):
    shape, opts, tma, algo = RAB_CASES[case]
    monkeypatch.setenv("HSTU_INDUCTOR_BWD_ALGO", algo)
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=hash(case) % 997)
    kw = dict(opts)
    if "num_targets" in kw:
        kw["num_targets"] = torch.tensor(kw["num_targets"], device=DEV)
    if kw.get("attn_scale") == "scalar":
        kw["attn_scale"] = torch.tensor(0.21, device=DEV)
    elif kw.get("attn_scale") == "rows":
        kw["attn_scale"] = torch.rand(q.shape[0], device=DEV) + 0.2
    rab = _rab(shape, N, 2, torch.float32, seed=len(case))
    _check(q, k, v, dout, off, N, 0.25, rab=rab, tma=tma, deterministic=algo == "split", **kw)


@SMALL
@pytest.mark.parametrize("heads,with_rab,tma", [(1, False, False), (2, True, True)], ids=["1head", "Hheads_rab"])
def test_intervals_random(heads, with_rab, tma, poison):
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=20 + heads)
    iv = _random_intervals(LENGTHS, heads, seed=heads)
    rab = _rab((1, 2), N, 2, torch.float32, seed=3) if with_rab else None
    _check(q, k, v, dout, off, N, 0.3, rab=rab, intervals=iv.to(torch.int32 if heads == 1 else torch.int64),
           tma=tma)


@SMALL
def test_sla_intervals_atomic_and_rab(poison, monkeypatch):
    monkeypatch.setenv("HSTU_INDUCTOR_BWD_ALGO", "atomic")
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=31)
    iv = sla_intervals(off, torch.tensor([3, 0, 1, 4]), k1=4, k2=2, contextual_seq_len=3)
    _check(q, k, v, dout, off, N, 0.3, intervals=iv, deterministic=False)
    _check(q, k, v, dout, off, N, 0.3, intervals=iv, rab=_rab((4, 1), N, 2, torch.float32, seed=4), tma=True)


@SMALL
@pytest.mark.parametrize("algo", ["split", "atomic"])
def test_interval_tile_skipping(algo, poison, monkeypatch):
    """A 16-row band that no row sees and whose rows see nothing: its q/k/v/dO rows hold NaN, which any
    visit of its tiles would spread (v, dO enter dots with zero weights), so finite results that match
    the reference on zeroed rows prove that whole key tiles (fwd, dQ) and query tiles (dK/dV) are
    skipped. The other rows' intervals span both sides of the band (the gap between x0 and x1)."""
    monkeypatch.setenv("HSTU_INDUCTOR_BWD_ALGO", algo)
    lengths, n = [48, 5, 40], 48
    q, k, v, dout, off = _batch(lengths, 2, 16, torch.float32, seed=41)
    g = torch.Generator().manual_seed(42)
    iv = _random_intervals(lengths, 2, seed=43)
    x0 = torch.randint(0, 17, (2, 16), generator=g)
    x1 = torch.randint(32, 49, (2, 16), generator=g)
    x2 = torch.maximum(x1, torch.randint(32, 51, (2, 16), generator=g))
    iv[:, :16] = iv[:, :16].clamp(max=16)
    iv[:, 16:32] = 0
    iv[:, 32:48] = torch.stack([x0, x1, x2], dim=-1)
    band = slice(16, 32)
    clean = [t.clone() for t in (q, k, v, dout)]
    for t, c in zip((q, k, v, dout), clean):
        t[band] = float("nan")
        c[band] = 0.0
    rab = _rab((1, 2), n, 2, torch.float32, seed=44)
    with K.force_configs(fwd=(16, 16, 4, 1), dkdv=(16, 16, 4, 1), dq=(16, 16, 4, 1)):
        _check(q, k, v, dout, off, n, 0.3, rab=rab, intervals=iv, deterministic=algo == "split",
               ref_inputs=clean)


@SMALL
def test_fp16_rab_and_intervals(poison):
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float16, seed=51)
    iv = _random_intervals(LENGTHS, 2, seed=52)
    _check(q, k, v, dout, off, N, 0.3, rab=_rab((4, 2), N, 2, torch.float16, seed=53), intervals=iv)


def test_rab_interval_argument_errors():
    q, k, v, dout, off = _batch([3, 2], 2, 16, torch.float32, seed=0, device="cpu")
    with pytest.raises(ValueError, match="rab must be"):
        K.hstu_attention_fwd(q, k, v, off, 4, 0.1, rab=torch.zeros(2, 2, 4, 5))
    with pytest.raises(ValueError, match="rab must be"):
        K.hstu_attention_bwd(dout, q, k, v, off, 4, 0.1, rab=torch.zeros(3, 1, 4, 4), rab_grad=True)
    with pytest.raises(ValueError, match="intervals must be"):
        K.hstu_attention_fwd(q, k, v, off, 4, 0.1, intervals=torch.zeros(1, 5, 3))
    with pytest.raises(ValueError, match="intervals replace"):
        K.hstu_attention_fwd(q, k, v, off, 4, 0.1, intervals=torch.zeros(1, 5, 3, dtype=torch.int64),
                             max_attn_len=2)


# ------------------------------------------------------------------------------------------
# GPU: realistic sizes, 16-bit
# ------------------------------------------------------------------------------------------


def _gpu_batch(tma, B, n, H, D, dtype, seed):
    """(q, k, v, dout, offsets, num_targets on the CPU) with lengths in [n/2, n], one of n and one of 1."""
    if tma and not K.tma_supported(torch.device("cuda")):
        pytest.skip("no TMA on this GPU")
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(n // 2, n + 1, (B,), generator=g).tolist()
    lengths[0], lengths[1] = n, 1
    nt = torch.randint(0, 20, (B,), generator=g).clamp(max=torch.tensor(lengths))
    return (*_batch(lengths, H, D, dtype, seed=seed + 1), nt)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(8, 2), (1, 2), (8, 1), (1, 1)], ids=["BH", "1H", "B1", "11"])
def test_gpu_rab(shape, dtype, tma, poison, monkeypatch):
    n, H, D = 512, 2, 128
    q, k, v, dout, off, nt = _gpu_batch(tma, 8, n, H, D, dtype, seed=1)
    rab = _rab(shape, n, H, dtype, seed=4)
    for algo in ("split", "atomic"):
        monkeypatch.setenv("HSTU_INDUCTOR_BWD_ALGO", algo)
        _check(q, k, v, dout, off, n, 1.0 / D, rab=rab, tma=tma, deterministic=algo == "split",
               num_targets=nt.to(DEV), max_attn_len=100, contextual_seq_len=5)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_intervals(dtype, tma, poison, monkeypatch):
    n, H, D = 1024, 2, 128
    q, k, v, dout, off, nt = _gpu_batch(tma, 8, n, H, D, dtype, seed=5)
    sla = sla_intervals(off.cpu(), nt, k1=128, k2=64, contextual_seq_len=8).to(DEV)
    rnd = _random_intervals((off[1:] - off[:-1]).tolist(), H, seed=8)
    rab = _rab((1, H), n, H, dtype, seed=9)
    for algo in ("split", "atomic"):
        monkeypatch.setenv("HSTU_INDUCTOR_BWD_ALGO", algo)
        _check(q, k, v, dout, off, n, 1.0 / D, intervals=sla, tma=tma, deterministic=algo == "split")
        _check(q, k, v, dout, off, n, 1.0 / D, intervals=rnd, rab=rab, tma=tma, deterministic=algo == "split")
