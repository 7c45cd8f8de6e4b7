"""Cached attention with the key range split across programs (kernels/delta.py) against fp64.

The partial outputs of the splits add exactly (HSTU has no softmax), so every split count must give
the reference's answer, for every mask option of cached attention; the split count and the sum
kernel are checked on the interpreter, the real sizes on the GPU.
"""
from __future__ import annotations

import pytest
import torch

from hstu_inductor.kernels import attention as K
from hstu_inductor.kernels import common, delta
from hstu_inductor.reference import delta_hstu_mha

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite values (unwritten output?)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _batch(lengths, H, Dq, Dv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(lengths).cumsum(0)
    L = sum(lengths)
    k, v = torch.randn(L, H, Dq, generator=g), torch.randn(L, H, Dv, generator=g)
    dq = torch.randn(len(lengths) * D, H, Dq, generator=g)
    return (t.to(DEV, dtype) for t in (dq, k, v)), off.to(DEV)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter-sized cases; the gpu-marked test covers CUDA")
@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_split_equals_reference(split, monkeypatch):
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)
    lengths = [70, 9, 33, 3, 64]
    N, H, Dq, Dv, D = 72, 2, 32, 16, 3
    B = len(lengths)
    (dq, k, v), off = _batch(lengths, H, Dq, Dv, D, torch.float32, seed=split)
    g = torch.Generator().manual_seed(100 + split)
    cases = [
        {},
        dict(num_targets=torch.tensor([2, 1, 0, 0, 3], device=DEV), contextual_seq_len=3),
        dict(max_attn_len=6, num_targets=torch.tensor([1, 4, 2, 0, 0], device=DEV)),
        dict(attn_scale=(torch.rand(B * D, generator=g) + 0.5).to(DEV)),
        dict(attn_scale=torch.tensor([0.25], device=DEV)),
    ]
    for kw in cases:
        out = delta.delta_forward(dq, k, v, off, N, 0.3, split=split, config=(16, 2, 4), **kw)
        kw64 = {a: (b.double() if a == "attn_scale" else b) for a, b in kw.items()}
        ref = delta_hstu_mha(N, 0.3, dq.double(), k.double(), v.double(), off, **kw64)
        assert out.shape == (B * D, H, Dv)
        assert rel_err(out, ref) < 2e-4, (split, kw)


def test_choose_split():
    # few programs: split up to ~4 per SM, but keep >= 4 key tiles per split, and at most 16
    assert delta.choose_split(512, 64, 132) == 2
    assert delta.choose_split(64, 64, 132) == 9
    assert delta.choose_split(64, 8, 132) == 2
    assert delta.choose_split(8, 4096, 132) == 16
    assert delta.choose_split(4096, 64, 132) == 1
    assert delta.choose_split(512, 3, 132) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [1, 16, 64])
def test_gpu_split_equals_full_forward(D, dtype):
    """Real sizes: the split kernel against fp64 and against the full forward's delta path."""
    B, N, H, Dm = 32, 1024, 4, 128
    g = torch.Generator().manual_seed(D)
    lengths = torch.randint(D, N + 1, (B,), generator=g).tolist()
    (dq, k, v), off = _batch(lengths, H, Dm, Dm, D, dtype, seed=D)
    nt = torch.randint(0, 21, (B,), generator=g).clamp(max=torch.tensor(lengths)).to(DEV)
    for kw in ({}, dict(num_targets=nt), dict(num_targets=nt, max_attn_len=200, contextual_seq_len=5)):
        ref = delta_hstu_mha(N, 1 / Dm, dq.double(), k.double(), v.double(), off, **kw)
        for split in (None, 1, 3):
            out = delta.delta_forward(dq, k, v, off, N, 1 / Dm, split=split, **kw)
            assert rel_err(out, ref) < (2e-2 if dtype == torch.bfloat16 else 2e-4), (split, kw)
        full = K._fwd(dq, k, v, off, N, 1 / Dm, kw.get("num_targets"), None, kw.get("max_attn_len", 0),
                      kw.get("contextual_seq_len", 0), 0, True, D, None)
        assert rel_err(full, ref) < (2e-2 if dtype == torch.bfloat16 else 2e-4)
