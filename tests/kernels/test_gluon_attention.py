"""The warp-specialised Gluon forward (hstu_inductor/kernels/gluon_attention.py) against the fp64 reference and
the Triton kernel (``torch.ops.hstu.attention``). Needs an sm90 GPU (skipped otherwise).

Inputs are fresh random draws on every run (the seed is printed in failure messages): lengths not multiples of
the tiles, an empty sequence, a length-1 sequence, a full-length one, targets, q/k/v as views of one fused
projection and as contiguous tensors. Outputs are poisoned with NaN before the kernel runs, so an unwritten
row fails.
"""
from __future__ import annotations

import os

import pytest
import torch

import hstu_inductor  # noqa: F401  (registers torch.ops.hstu.*)
from hstu_inductor.kernels import common
from hstu_inductor.reference import hstu_mha

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
TOL = 2.4e-3  # bf16/fp16 rel-norm error against fp64


def _sm90():
    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _sm90(), reason="needs an sm90 (Hopper) GPU")]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite values (unwritten output?)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _seed():
    return int.from_bytes(os.urandom(4), "little")


def make_case(B, N, H, D, dtype, seed, *, layout="fused", targets=True, special=True, device=DEV, lengths=None):
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(1, N + 1, (B,), generator=g)
        if special and B >= 4:
            lengths[0], lengths[1], lengths[2] = N, 1, 0
            lengths[3] = max(1, N - 1)
    off = torch.zeros(B + 1, dtype=torch.int64)
    off[1:] = lengths.cumsum(0)
    L = int(off[-1])
    if layout == "fused":  # views of one fused projection, like uvqk[:, a:b].view(L, H, D)
        fused = torch.randn(L, 4 * H * D, generator=g).to(dtype=dtype, device=device)
        v = fused[:, H * D:2 * H * D].view(L, H, D)
        q = fused[:, 2 * H * D:3 * H * D].view(L, H, D)
        k = fused[:, 3 * H * D:].view(L, H, D)
    else:
        q, k, v = (torch.randn(L, H, D, generator=g).to(dtype=dtype, device=device) for _ in range(3))
    nt = None
    if targets:
        nt = torch.minimum(torch.randint(0, 21, (B,), generator=g), lengths).to(device)
    return q, k, v, off.to(device), nt


def _check(B, N, H, dtype, layout, targets, alpha, seed, config=None):
    from hstu_inductor.kernels.gluon_attention import gluon_forward

    D = 128
    q, k, v, off, nt = make_case(B, N, H, D, dtype, seed, layout=layout, targets=targets)
    out = gluon_forward(q, k, v, off, N, alpha, nt, config=config)
    torch.cuda.synchronize()
    ref = hstu_mha(N, alpha, q.double(), k.double(), v.double(), off, dropout_pr=0.0, training=False,
                   num_targets=nt)
    e_ref = rel_err(out, ref)
    with hstu_inductor.config.patch(gluon="off"):  # the op would run the Gluon kernel itself
        tri = torch.ops.hstu.attention(q, k, v, off, N, alpha, nt, None, 0, 0, 0, True)
    e_tri = rel_err(out, tri)
    e_tri_ref = rel_err(tri, ref)
    msg = f"seed={seed} B={B} N={N} {dtype} {layout} targets={targets}: gluon-vs-fp64 {e_ref:.2e}, " \
          f"gluon-vs-triton {e_tri:.2e}, triton-vs-fp64 {e_tri_ref:.2e}"
    print(msg)
    assert e_ref < TOL, msg
    assert e_tri < TOL, msg
    return out


@pytest.mark.parametrize("layout", ["fused", "contig"])
@pytest.mark.parametrize("targets", [True, False], ids=["targets", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_small(dtype, targets, layout):
    _check(12, 300, 2, dtype, layout, targets, 1.0 / 128, _seed())


@pytest.mark.parametrize("N", [128, 129, 1000, 2048])
def test_lengths(N):
    _check(8, N, 3, torch.bfloat16, "fused", True, 0.2, _seed())


@pytest.mark.parametrize("N", [129, 1000, 2048])
def test_lengths_persistent(N):
    """More work items than SMs: each CTA walks several items (Q double buffer and ring wrap-around)."""
    _check(24, N, 4, torch.bfloat16, "fused", True, 0.2, _seed(), config=dict(PERSISTENT=True))


CONFIGS = {
    "pers": dict(PERSISTENT=True),  # the default
    "pers_nopp": dict(PERSISTENT=True, PINGPONG=False),
    "pers_nosync": dict(PERSISTENT=True, SYNC=False),
    "pers_static": dict(PERSISTENT=True, DYNAMIC=False),
    "pers_bn64": dict(PERSISTENT=True, BLOCK_N=64, STAGES=4),
    "nonpers_bn64": dict(PERSISTENT=False, BLOCK_N=64, STAGES=3),
    "nonpers_s2": dict(PERSISTENT=False, STAGES=2),
    "nonpers_s3": dict(PERSISTENT=False, STAGES=3),
    "nonpers_nopp": dict(PERSISTENT=False, PINGPONG=False),
    "nonpers_nosync": dict(PERSISTENT=False, SYNC=False),
}


@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_configs(cfg):
    _check(6, 777, 2, torch.bfloat16, "fused", True, 1.0 / 128, _seed(), config=cfg)


# The case that failed in GPU batch 1 (01:35 UTC): it ran config PACKED=True, whose bf16x2 silu is 3.6e-3 away
# from the fp32-silu result (Triton's default), over the 2.4e-3 bound; every fp32-silu config was bitwise equal
# to the Triton op on it. Fixed seed, every config, and PACKED with its own (looser, measured) bound.
_B1_CASE = dict(B=6, N=777, H=2, dtype=torch.bfloat16, layout="fused", targets=True, alpha=1.0 / 128, seed=2526020011)


@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_batch1_case_fixed_seed(cfg):
    c = _B1_CASE
    _check(c["B"], c["N"], c["H"], c["dtype"], c["layout"], c["targets"], c["alpha"], c["seed"], config=cfg)


def test_packed_accuracy():
    """PACKED=1 (bf16x2 tanh + fma) trades accuracy: within 5e-3 of fp64, not within 2.4e-3."""
    from hstu_inductor.kernels.gluon_attention import gluon_forward

    c = _B1_CASE
    q, k, v, off, nt = make_case(c["B"], c["N"], c["H"], 128, c["dtype"], c["seed"], layout=c["layout"],
                                 targets=True)
    out = gluon_forward(q, k, v, off, c["N"], c["alpha"], nt, config=dict(PACKED=1))
    ref = hstu_mha(c["N"], c["alpha"], q.double(), k.double(), v.double(), off, dropout_pr=0.0, training=False,
                   num_targets=nt)
    e = rel_err(out, ref)
    print(f"packed gluon-vs-fp64 {e:.2e}")
    assert e < 5e-3


@pytest.mark.parametrize("cfg", [dict(PERSISTENT=True), dict(PERSISTENT=False),
                                 dict(PERSISTENT=True, BLOCK_N=64, STAGES=4)],
                         ids=["pers", "nonpers", "pers_bn64"])
def test_repeat_bitwise(cfg):
    """20 runs on the same inputs are bitwise equal (a race or a stale stage would show as a difference)."""
    from hstu_inductor.kernels.gluon_attention import gluon_forward

    seed = _seed()
    q, k, v, off, nt = make_case(64, 1100, 4, 128, torch.bfloat16, seed, targets=True)
    first = gluon_forward(q, k, v, off, 1100, 0.1, nt, config=cfg)
    for i in range(20):
        again = gluon_forward(q, k, v, off, 1100, 0.1, nt, config=cfg)
        assert torch.equal(first, again), f"run {i} differs, seed={seed}"


def test_large_targets_only_history():
    """Many targets (up to the whole sequence): target rows see history and themselves only."""
    from hstu_inductor.kernels.gluon_attention import gluon_forward

    seed = _seed()
    B, N, H, D = 6, 400, 2, 128
    q, k, v, off, _ = make_case(B, N, H, D, torch.bfloat16, seed, layout="contig", targets=False)
    lengths = (off[1:] - off[:-1]).cpu()
    g = torch.Generator().manual_seed(seed)
    nt = (torch.rand(B, generator=g) * (lengths.double() + 1)).long().clamp(max=lengths).to(DEV)
    out = gluon_forward(q, k, v, off, N, 0.1, nt)
    ref = hstu_mha(N, 0.1, q.double(), k.double(), v.double(), off, dropout_pr=0.0, training=False, num_targets=nt)
    assert rel_err(out, ref) < TOL, f"seed={seed}"


def test_all_empty_and_repeatable():
    from hstu_inductor.kernels.gluon_attention import gluon_forward

    q = torch.randn(0, 2, 128, device=DEV, dtype=torch.bfloat16)
    off = torch.zeros(5, dtype=torch.int64, device=DEV)
    assert gluon_forward(q, q, q, off, 64, 0.1).shape == (0, 2, 128)
    seed = _seed()
    q, k, v, off, nt = make_case(8, 640, 2, 128, torch.bfloat16, seed, targets=True)
    a = gluon_forward(q, k, v, off, 640, 0.1, nt)
    b = gluon_forward(q, k, v, off, 640, 0.1, nt)
    assert torch.equal(a, b), f"not repeatable (race?) seed={seed}"


def test_unsupported_raise():
    from hstu_inductor.kernels.gluon_attention import gluon_forward

    q, k, v, off, nt = make_case(4, 64, 2, 128, torch.bfloat16, 0)
    with pytest.raises(NotImplementedError):
        gluon_forward(q, k, v, off, 64, 0.1, nt, max_attn_len=4)
    with pytest.raises(NotImplementedError):
        gluon_forward(q, k, v, off, 64, 0.1, nt, contextual_seq_len=2)
    with pytest.raises(NotImplementedError):
        gluon_forward(q.float(), k.float(), v.float(), off, 64, 0.1, nt)
    with pytest.raises(NotImplementedError):
        gluon_forward(q[..., :64], k[..., :64], v[..., :64], off, 64, 0.1, nt)
