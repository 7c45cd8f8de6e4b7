"""Triton HSTU attention kernels against the fp64 eager reference.

Without CUDA the kernels run under the Triton interpreter (see conftest.py) on small shapes;
``@pytest.mark.gpu`` cases use real shapes in bf16/fp32 with TMA on and off.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch
from triton.runtime.errors import OutOfResources

from hstu_inductor import config
from hstu_inductor.kernels import attention as K
from hstu_inductor.kernels import common
from hstu_inductor.reference import delta_hstu_mha, hstu_mha

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite values (unwritten output?)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_offsets(lengths, dtype=torch.int64, device=DEV):
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return off.to(dtype=dtype, device=device)


def make_batch(lengths, H, Dq, Dv, dtype, N, *, strided=False, seed=0, targets=None, device=DEV):
    g = torch.Generator().manual_seed(seed)
    off = make_offsets(lengths, device=device)
    L = sum(lengths)
    if strided:  # q, k, v as views of one fused projection, like uvqk[:, a:b].view(L, H, D)
        fused = torch.randn(L, H * (2 * Dq + 2 * Dv) + 8, generator=g).to(dtype=dtype, device=device)
        u_end = H * Dv
        v = fused[:, u_end:u_end + H * Dv].view(L, H, Dv)
        q = fused[:, u_end + H * Dv:u_end + H * Dv + H * Dq].view(L, H, Dq)
        k = fused[:, u_end + H * Dv + H * Dq:u_end + H * (Dv + 2 * Dq)].view(L, H, Dq)
    else:
        q = torch.randn(L, H, Dq, generator=g).to(dtype=dtype, device=device)
        k = torch.randn(L, H, Dq, generator=g).to(dtype=dtype, device=device)
        v = torch.randn(L, H, Dv, generator=g).to(dtype=dtype, device=device)
    nt = None
    if targets is not None:
        nt = torch.tensor([min(t, n) for t, n in zip(targets, lengths)], dtype=torch.int64, device=device)
    return q, k, v, off, nt


def ref_fwd_bwd(q, k, v, off, N, alpha, dout=None, **kw):
    q64, k64, v64 = (t.detach().double().requires_grad_(dout is not None) for t in (q, k, v))
    kw64 = dict(kw)
    if kw64.get("attn_scale") is not None:
        kw64["attn_scale"] = kw64["attn_scale"].double()
    out = hstu_mha(N, alpha, q64, k64, v64, off, dropout_pr=0.0, training=False, **kw64)
    if dout is None:
        return out.detach(), None
    out.backward(dout.double())
    return out.detach(), (q64.grad, k64.grad, v64.grad)


# (name, kwargs builder(lengths, N, L) -> kwargs for both kernel and reference)
FEATURES = {
    "causal": lambda ls, N, L: {},
    "targets": lambda ls, N, L: {"num_targets": _tgts(ls, 3)},
    "ctx_targets": lambda ls, N, L: {"contextual_seq_len": 5, "num_targets": _tgts(ls, 2)},
    "window": lambda ls, N, L: {"max_attn_len": 7},
    "window_minfull_targets": lambda ls, N, L: {"max_attn_len": 6, "min_full_attn_seq_len": 9,
                                                 "num_targets": _tgts(ls, 4)},
    "ctx_window_minfull_targets": lambda ls, N, L: {"max_attn_len": 5, "contextual_seq_len": 3,
                                                     "min_full_attn_seq_len": 4, "num_targets": _tgts(ls, 3)},
    "ctx_window": lambda ls, N, L: {"max_attn_len": 9, "contextual_seq_len": 20},
    "scale_scalar": lambda ls, N, L: {"attn_scale": torch.tensor(0.37, device=DEV)},
    "scale_rows_targets": lambda ls, N, L: {"attn_scale": torch.rand(L, device=DEV) + 0.1,
                                            "num_targets": _tgts(ls, 2)},
    "noncausal": lambda ls, N, L: {"causal": False},
}


def _tgts(lengths, t):
    g = torch.Generator().manual_seed(len(lengths) * 7 + t)
    return torch.tensor([min(int(torch.randint(0, t + 1, (1,), generator=g)), n) for n in lengths],
                        dtype=torch.int64, device=DEV)


LENGTHS = [37, 0, 1, 48, 20]  # includes 0, 1 and N
N_MAX = 48


def _run_fwd_case(feature, dtype, tma, lengths=LENGTHS, N=N_MAX, H=2, Dq=32, Dv=32, strided=False,
                  offsets_dtype=torch.int64):
    seed = zlib.crc32(feature.encode()) % 1000
    q, k, v, off, _ = make_batch(lengths, H, Dq, Dv, dtype, N, strided=strided, seed=seed)
    kw = FEATURES[feature](lengths, N, sum(lengths))
    alpha = 1.0 / math.sqrt(Dq)
    out = K.hstu_attention_fwd(q, k, v, off.to(offsets_dtype), N, alpha, tma=tma, **kw)
    ref, _ = ref_fwd_bwd(q, k, v, off, N, alpha, **kw)
    assert out.shape == ref.shape and out.dtype == dtype
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{feature} fwd rel err {err:.2e}"


def _run_bwd_case(feature, dtype, tma, deterministic, lengths=LENGTHS, N=N_MAX, H=2, Dq=32, Dv=32,
                  strided=False):
    seed = zlib.crc32(feature.encode()) % 1000 + 1
    q, k, v, off, _ = make_batch(lengths, H, Dq, Dv, dtype, N, strided=strided, seed=seed)
    kw = FEATURES[feature](lengths, N, sum(lengths))
    alpha = 1.0 / math.sqrt(Dq)
    dout = torch.randn(q.shape[0], H, Dv, generator=torch.Generator().manual_seed(5)).to(dtype=dtype, device=DEV)
    dq, dk, dv = K.hstu_attention_bwd(dout, q, k, v, off, N, alpha, tma=tma, deterministic=deterministic, **kw)
    _, (rq, rk, rv) = ref_fwd_bwd(q, k, v, off, N, alpha, dout=dout, **kw)
    for name, x, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert x.shape == r.shape and x.dtype == dtype, name
        err = rel_err(x, r)
        assert err < TOL[dtype], f"{feature} {name} rel err {err:.2e} (tma={tma}, det={deterministic})"


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)


# ------------------------------------------------------------------------------------------
# CPU (interpreter) / any device: small shapes
# ------------------------------------------------------------------------------------------

SMALL = pytest.mark.skipif(HAS_CUDA, reason="interpreter-sized cases; the gpu-marked tests cover CUDA")


@SMALL
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_fwd_features_fp32(feature, tma, poison):
    _run_fwd_case(feature, torch.float32, tma)


@SMALL
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("feature", ["targets", "ctx_window_minfull_targets", "scale_rows_targets", "noncausal"])
def test_fwd_fp16(feature, tma, poison):
    _run_fwd_case(feature, torch.float16, tma)


@SMALL
@pytest.mark.parametrize("det", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("feature", ["causal", "targets", "ctx_window_minfull_targets", "scale_rows_targets",
                                     "scale_scalar", "noncausal", "window", "ctx_window"])
def test_bwd_features_fp32(feature, det, poison):
    _run_bwd_case(feature, torch.float32, tma=(feature in ("targets", "noncausal", "ctx_window")),
                  deterministic=det)


@SMALL
@pytest.mark.slow
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("det", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_bwd_features_all(feature, det, tma, poison):
    _run_bwd_case(feature, torch.float32, tma, det)


@SMALL
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_bwd_fp16(tma, poison):
    _run_bwd_case("ctx_targets", torch.float16, tma, deterministic=False)
    _run_bwd_case("window_minfull_targets", torch.float16, tma, deterministic=True)


@SMALL
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_strided_views_and_int32_offsets(tma, poison):
    """q/k/v as non-contiguous views of a fused projection; int32 offsets; Dq != Dv (Dv not pow2)."""
    for dtype in (torch.float32, torch.float16):
        _run_fwd_case("targets", dtype, tma, strided=True, offsets_dtype=torch.int32, Dq=32, Dv=48)
    _run_bwd_case("ctx_window_minfull_targets", torch.float32, tma, deterministic=False, strided=True,
                  Dq=32, Dv=48)
    _run_bwd_case("targets", torch.float32, tma, deterministic=True, strided=True, Dq=48, Dv=32)


@SMALL
@pytest.mark.parametrize("cfg", [
    dict(fwd=(16, 16, 4, 1), dkdv=(16, 16, 4, 1), dq=(16, 16, 4, 1)),
    dict(fwd=(16, 32, 4, 1), dkdv=(32, 16, 4, 1), dq=(16, 32, 4, 1)),
    dict(fwd=(64, 16, 4, 1), dkdv=(16, 64, 4, 1), dq=(64, 16, 4, 1)),
], ids=["16x16", "16x32", "64x16"])
@pytest.mark.parametrize("feature", ["window_minfull_targets", "ctx_window", "ctx_window_minfull_targets",
                                     "targets"])
def test_block_shapes_and_skipping_bounds(cfg, feature, poison):
    """Block skipping bounds must hold for every block shape (BLOCK_M <, =, > BLOCK_N)."""
    lengths = [45, 3, 64, 31]
    with K.force_configs(**cfg):
        _run_fwd_case(feature, torch.float32, tma=True, lengths=lengths, N=64)
        _run_bwd_case(feature, torch.float32, tma=False, deterministic=False, lengths=lengths, N=64)
        _run_bwd_case(feature, torch.float32, tma=True, deterministic=True, lengths=lengths, N=64)


@SMALL
def test_large_window_and_contextual_edge_cases(poison):
    """Window wider than the sequence, contextual prefix longer than a sequence, all-target rows."""
    lengths = [30, 6, 2, 16]
    N = 32
    cases = [
        dict(max_attn_len=100, num_targets=torch.tensor([5, 6, 2, 0], device=DEV)),
        dict(contextual_seq_len=10, num_targets=torch.tensor([4, 6, 2, 16], device=DEV)),
        dict(contextual_seq_len=4, max_attn_len=2, min_full_attn_seq_len=30),
        dict(max_attn_len=1),
    ]
    with K.force_configs(fwd=(16, 16, 4, 1), dkdv=(16, 16, 4, 1), dq=(16, 16, 4, 1)):
        for i, kw in enumerate(cases):
            q, k, v, off, _ = make_batch(lengths, 1, 16, 32, torch.float32, N, seed=40 + i)
            dout = torch.randn(q.shape[0], 1, 32, generator=torch.Generator().manual_seed(i)).to(DEV)
            out = K.hstu_attention_fwd(q, k, v, off, N, 0.2, tma=bool(i % 2), **kw)
            ref, grads = ref_fwd_bwd(q, k, v, off, N, 0.2, dout=dout, **kw)
            assert rel_err(out, ref) < 2e-4, kw
            got = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.2, tma=not bool(i % 2), **kw)
            for x, r in zip(got, grads):
                assert rel_err(x, r) < 2e-4, kw


@SMALL
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_delta_fwd(tma, poison):
    lengths = [40, 9, 33, 16]
    N, H, Dq, Dv, D = 48, 2, 32, 32, 4
    B = len(lengths)
    _, k, v, off, _ = make_batch(lengths, H, Dq, Dv, torch.float32, N, seed=3)
    dq_ = torch.randn(B * D, H, Dq, generator=torch.Generator().manual_seed(9)).to(DEV)
    cases = [
        {},
        dict(num_targets=torch.tensor([2, 1, 0, 3], device=DEV), contextual_seq_len=3),
        dict(max_attn_len=6, num_targets=torch.tensor([1, 4, 2, 0], device=DEV)),
        dict(attn_scale=torch.rand(B * D, device=DEV) + 0.5),
        dict(attn_scale=torch.tensor([0.25], device=DEV)),
    ]
    for kw in cases:
        out = K.delta_hstu_attention_fwd(dq_, k, v, off, N, 0.3, tma=tma, **kw)
        kw64 = {a: (b.double() if a == "attn_scale" else b) for a, b in kw.items()}
        ref = delta_hstu_mha(N, 0.3, dq_.double(), k.double(), v.double(), off, **kw64)
        assert out.shape == (B * D, H, Dv)
        assert rel_err(out, ref) < 2e-4, kw


@SMALL
def test_deterministic_bitwise_and_atomic_close(monkeypatch):
    monkeypatch.setattr(config, "bwd_algo", "atomic")  # for the non-deterministic call only
    lengths = [48, 13, 30]
    q, k, v, off, _ = make_batch(lengths, 2, 32, 32, torch.float32, 48, seed=11)
    dout = torch.randn_like(v)
    kw = dict(num_targets=torch.tensor([2, 0, 5], device=DEV), max_attn_len=10)
    a = K.hstu_attention_bwd(dout, q, k, v, off, 48, 0.2, deterministic=True, **kw)
    b = K.hstu_attention_bwd(dout, q, k, v, off, 48, 0.2, deterministic=True, **kw)
    c = K.hstu_attention_bwd(dout, q, k, v, off, 48, 0.2, deterministic=False, **kw)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y)
        assert rel_err(z, x) < 1e-5


@SMALL
def test_empty_and_zero_length():
    q, k, v, off, _ = make_batch([0, 0], 2, 32, 32, torch.float32, 8)
    out = K.hstu_attention_fwd(q, k, v, off, 8, 0.1)
    assert out.shape == (0, 2, 32)
    dq, dk, dv = K.hstu_attention_bwd(torch.zeros(0, 2, 32), q, k, v, off, 8, 0.1)
    assert dq.shape == dk.shape == (0, 2, 32) and dv.shape == (0, 2, 32)


def test_noncausal_rejects_masks():
    q, k, v, off, _ = make_batch([5, 3], 1, 16, 16, torch.float32, 8)
    for kw in (dict(num_targets=torch.tensor([1, 1], device=DEV)), dict(max_attn_len=2), dict(contextual_seq_len=1)):
        with pytest.raises(ValueError, match="causal=False"):
            K.hstu_attention_fwd(q, k, v, off, 8, 0.1, causal=False, **kw)
        with pytest.raises(ValueError, match="causal=False"):
            K.hstu_attention_bwd(torch.randn_like(v), q, k, v, off, 8, 0.1, causal=False, **kw)


def test_tma_errors(monkeypatch):
    q = torch.randn(10, 2, 32)
    # last dim not contiguous -> forced TMA is refused with a clear error, auto falls back
    bad = torch.randn(10, 2, 64)[:, :, ::2]
    if K.tma_supported(q.device):
        with pytest.raises(ValueError, match="tma=True"):
            K._use_tma(True, q.device, (bad, q, q))
        assert K._use_tma(None, q.device, (bad, q, q)) is False
    monkeypatch.setattr(K, "_interpret", lambda: False)
    assert K.tma_supported("cpu") is False
    with pytest.raises(RuntimeError, match="not supported"):
        K._use_tma(True, torch.device("cpu"), (q, q, q))
    assert K._use_tma(None, torch.device("cpu"), (q, q, q)) is False


# ------------------------------------------------------------------------------------------
# GPU: real shapes
# ------------------------------------------------------------------------------------------


def _gpu_batch(B, N, H, D, dtype, seed=0, tmin=1, tmax=20):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.5 * N), N + 1, (B,), generator=g).tolist()
    lengths[0], lengths[1] = N, 1
    q, k, v, off, _ = make_batch(lengths, H, D, D, dtype, N, seed=seed, strided=True)
    nt = torch.randint(tmin, tmax + 1, (B,), generator=g).clamp(max=torch.tensor(lengths)).to(DEV)
    return q, k, v, off, nt


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_fwd_bwd(dtype, tma, poison):
    if tma and not K.tma_supported(torch.device("cuda")):
        pytest.skip("no TMA on this GPU")
    B, N, H, D = 16, 512, 2, 128
    q, k, v, off, nt = _gpu_batch(B, N, H, D, dtype)
    alpha = 1.0 / D
    kw = dict(num_targets=nt)
    out = K.hstu_attention_fwd(q, k, v, off, N, alpha, tma=tma, **kw)
    dout = torch.randn_like(out)
    ref, grads = ref_fwd_bwd(q, k, v, off, N, alpha, dout=dout, **kw)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    assert rel_err(out, ref) < tol
    for det in (False, True):
        got = K.hstu_attention_bwd(dout, q, k, v, off, N, alpha, tma=tma, deterministic=det, **kw)
        for name, x, r in zip("qkv", got, grads):
            e = rel_err(x, r)
            assert e < tol, f"d{name} {e:.2e} det={det}"


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_gpu_all_features_bf16(tma, poison):
    if tma and not K.tma_supported(torch.device("cuda")):
        pytest.skip("no TMA on this GPU")
    B, N, H, D = 8, 384, 2, 64
    q, k, v, off, nt = _gpu_batch(B, N, H, D, torch.bfloat16, seed=1)
    L = q.shape[0]
    kw = dict(num_targets=nt, max_attn_len=50, contextual_seq_len=7, min_full_attn_seq_len=30,
              attn_scale=torch.rand(L, device=DEV) + 0.5)
    out = K.hstu_attention_fwd(q, k, v, off, N, 0.1, tma=tma, **kw)
    dout = torch.randn_like(out)
    ref, grads = ref_fwd_bwd(q, k, v, off, N, 0.1, dout=dout, **kw)
    assert rel_err(out, ref) < 2e-2
    got = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.1, tma=tma, **kw)
    for x, r in zip(got, grads):
        assert rel_err(x, r) < 2e-2
    a = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.1, tma=tma, deterministic=True, **kw)
    b = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.1, tma=tma, deterministic=True, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # cached (delta) attention on the same batch
    D_ = 3
    lengths = (off[1:] - off[:-1]).tolist()
    rows = torch.cat([torch.arange(int(off[i + 1]) - D_, int(off[i + 1])) for i in range(B) if lengths[i] >= D_])
    if all(n >= D_ for n in lengths):
        dq_ = q[rows.to(DEV)]
        kwd = dict(num_targets=nt, max_attn_len=50, contextual_seq_len=7)
        o = K.delta_hstu_attention_fwd(dq_, k, v, off, N, 0.1, tma=tma, **kwd)
        r = delta_hstu_mha(N, 0.1, dq_.double(), k.double(), v.double(), off, **kwd)
        assert rel_err(o, r) < 2e-2


@pytest.mark.gpu
def test_gpu_head_dims():
    for Dq, Dv in ((32, 32), (64, 128), (256, 256), (96, 160)):
        q, k, v, off, nt = _gpu_batch(4, 256, 2, Dq, torch.bfloat16, seed=Dq)
        v = torch.randn(q.shape[0], 2, Dv, device=DEV, dtype=torch.bfloat16)
        out = K.hstu_attention_fwd(q, k, v, off, 256, 0.05, num_targets=nt)
        dout = torch.randn_like(out)
        ref, grads = ref_fwd_bwd(q, k, v, off, 256, 0.05, dout=dout, num_targets=nt)
        assert rel_err(out, ref) < 2e-2, (Dq, Dv)
        got = K.hstu_attention_bwd(dout, q, k, v, off, 256, 0.05, num_targets=nt)
        for x, r in zip(got, grads):
            assert rel_err(x, r) < 2e-2, (Dq, Dv)


@SMALL
@pytest.mark.parametrize("part", [0, 1])
def test_window_sweep_fwd_bwd(part):
    """Every window size against 16-wide blocks hits each alignment of the skipping bounds (the sizes alternate
    between the two parts)."""
    lengths = [64, 23, 50]
    N = 64
    q, k, v, off, _ = make_batch(lengths, 1, 16, 16, torch.float32, N, seed=77)
    dout = torch.randn_like(v)
    with K.force_configs(fwd=(16, 16, 4, 1), dkdv=(16, 16, 4, 1), dq=(16, 16, 4, 1)):
        for w in (list(range(1, 19)) + [29, 30, 31, 32, 33])[part::2]:
            kw = dict(max_attn_len=w, contextual_seq_len=(w % 3) * 2,
                      num_targets=torch.tensor([w % 4, 2, 0], device=DEV) if w % 2 else None)
            out = K.hstu_attention_fwd(q, k, v, off, N, 0.3, tma=bool(w % 2), **kw)
            ref, grads = ref_fwd_bwd(q, k, v, off, N, 0.3, dout=dout, **kw)
            assert rel_err(out, ref) < 2e-4, kw
            if w % 4 == 2:  # the backward shares the forward's key-range bounds: every other alignment
                continue
            got = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.3, tma=bool(w % 2), deterministic=bool(w % 3 == 0),
                                       **kw)
            for x, r in zip(got, grads):
                assert rel_err(x, r) < 2e-4, kw


@SMALL
@pytest.mark.parametrize("part", [0, 1])
def test_target_sweep_fwd_bwd(part):
    """Target counts at every offset against 16-wide blocks (targets share one id; the offsets alternate between
    the two parts)."""
    lengths = [40, 33, 48, 16]
    N = 48
    q, k, v, off, _ = make_batch(lengths, 1, 16, 16, torch.float32, N, seed=78)
    dout = torch.randn_like(v)
    with K.force_configs(fwd=(16, 16, 4, 1), dkdv=(16, 16, 4, 1), dq=(16, 16, 4, 1)):
        for t in range(part, 17, 2):
            nt = torch.tensor([t, t + 1, (t + 2) % 20, t % 5], device=DEV).clamp(max=torch.tensor(lengths, device=DEV))
            kw = dict(num_targets=nt, contextual_seq_len=(t % 3) * 3,
                      max_attn_len=0 if t % 4 else 20, min_full_attn_seq_len=0 if t % 8 else 10)
            out = K.hstu_attention_fwd(q, k, v, off, N, 0.3, tma=bool(t % 2), **kw)
            ref, grads = ref_fwd_bwd(q, k, v, off, N, 0.3, dout=dout, **kw)
            assert rel_err(out, ref) < 2e-4, kw
            if t % 4 == 2:  # the backward at the other offsets: sequence 2's count t + 1 covers these
                continue
            got = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.3, tma=not bool(t % 2),
                                       deterministic=bool(t % 3 == 0), **kw)
            for x, r in zip(got, grads):
                assert rel_err(x, r) < 2e-4, kw


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["1", "2", "3"], ids=["ptr_atomic", "tma_reduce", "red_v2"])
def test_gpu_dq_accumulation_modes(mode, monkeypatch):
    """Every dQ accumulation path (pointer atomics, TMA reduce-add, vectorized red) agrees with the reference."""
    monkeypatch.setattr(config, "dq_mode", int(mode))
    monkeypatch.setattr(config, "bwd_algo", "atomic")
    B, N, H, D = 8, 512, 2, 128
    q, k, v, off, nt = _gpu_batch(B, N, H, D, torch.bfloat16, seed=3)
    kw = dict(num_targets=nt, contextual_seq_len=4)
    dout = torch.randn(q.shape[0], H, D, device=DEV, dtype=torch.bfloat16)
    _, grads = ref_fwd_bwd(q, k, v, off, N, 1.0 / D, dout=dout, **kw)
    got = K.hstu_attention_bwd(dout, q, k, v, off, N, 1.0 / D, tma=True if mode == "2" else None, **kw)
    for name, x, r in zip("qkv", got, grads):
        assert rel_err(x, r) < 2e-2, f"d{name}"


def _gpu_configs(kind):
    return sorted({c for (k, size), cfgs in K._GPU_CONFIGS.items() if k == kind and size != "fp32" for c in cfgs},
                  key=repr)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _gpu_configs("fwd"), ids=repr)
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_gpu_every_fwd_config(cfg, tma, poison):
    """The autotuner may pick any listed config: each one must be right at a real shape, not only the
    one a small test happens to select."""
    if tma and not K.tma_supported(torch.device("cuda")):
        pytest.skip("no TMA on this GPU")
    D = 128 if cfg in K._GPU_CONFIGS[("fwd", "small")] else 256
    B, N, H = 6, 1024, 2
    q, k, v, off, nt = _gpu_batch(B, N, H, D, torch.bfloat16, seed=11)
    with K.force_configs(fwd=cfg):
        out = K.hstu_attention_fwd(q, k, v, off, N, 1.0 / D, num_targets=nt, tma=tma)
    ref, _ = ref_fwd_bwd(q, k, v, off, N, 1.0 / D, num_targets=nt)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("algo,kind", [("split", "dkdv"), ("atomic", "dkdv"), ("split", "dq")])
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_gpu_every_bwd_config(algo, kind, tma, poison, monkeypatch):
    if tma and not K.tma_supported(torch.device("cuda")):
        pytest.skip("no TMA on this GPU")
    monkeypatch.setattr(config, "bwd_algo", algo)  # the dK/dV kernel with and without dQ atomics
    B, N, H = 4, 1024, 2
    ran = 0
    for cfg in _gpu_configs(kind):
        D = 128 if cfg in K._GPU_CONFIGS[(kind, "small")] else 256
        q, k, v, off, nt = _gpu_batch(B, N, H, D, torch.bfloat16, seed=12)
        dout = torch.randn_like(v)
        _, grads = ref_fwd_bwd(q, k, v, off, N, 1.0 / D, dout=dout, num_targets=nt)
        try:
            with K.force_configs(**{kind: cfg}):
                got = K.hstu_attention_bwd(dout, q, k, v, off, N, 1.0 / D, num_targets=nt, tma=tma)
        except OutOfResources:  # the autotuner drops configs this GPU cannot hold, so may we
            continue
        ran += 1
        for name, x, r in zip("qkv", got, grads):
            assert rel_err(x, r) < 2e-2, f"d{name} {kind} {cfg}"
    assert ran > 0
