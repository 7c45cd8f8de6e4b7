"""Cached launches of the Gluon kernels (kernels/fastlaunch.py) on an sm90 GPU: outputs and gradients bitwise equal
to the uncached path (``kernel[grid]``, ``config.fastlaunch = "off"``), on the first cached call, on a repeat, on other
tensors of the same shape, and on calls whose layout or alignment differs from the warm entry's. The cached calls run
in ``"verify"`` mode: each one is also checked against the kernel Triton's own binder and cache would pick.
Outputs are poisoned with NaN (an unwritten element fails ``torch.equal``). The CPU half: test_fastlaunch.py.
"""
from __future__ import annotations

import pytest
import torch

import hstu_inductor
from hstu_inductor.kernels import common
from test_gluon_attention import _sm90, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _sm90(), reason="needs an sm90 (Hopper) GPU")]

H, ALPHA = 4, 0.2


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)


def _both(fn):
    """``fn()`` uncached, then cached twice (the first cached call may fill the entry, the second hits it)."""
    with hstu_inductor.config.patch(fastlaunch="off"):
        ref = fn()
    with hstu_inductor.config.patch(fastlaunch="verify"):
        got = [fn(), fn()]
    torch.cuda.synchronize()
    return ref, got


def _equal(ref, got, what):
    ref = ref if isinstance(ref, tuple) else (ref, )
    for i, g in enumerate(got):
        g = g if isinstance(g, tuple) else (g, )
        for r, x, name in zip(ref, g, ("out/dq", "dk", "dv")):
            assert torch.equal(r, x), f"{what}: cached call {i} differs from the uncached one in {name} " \
                                      f"(max abs diff {(r.float() - x.float()).abs().max().item()})"


def _variants(B, N, targets, seed):
    """(name, q, k, v, offsets, targets): the warm-up case, other tensors of its shape, the same lengths as
    contiguous tensors (row stride 512 instead of the fused views' 2048), offsets and targets off 16-byte
    alignment. Other shapes: the other parameters' cases, which find the cache warm (it is not cleared)."""
    q, k, v, off, nt = make_case(B, N, H, 128, torch.bfloat16, seed, layout="fused", targets=targets)
    lengths = (off[1:] - off[:-1]).cpu()
    out = [("warm", q, k, v, off, nt)]
    q2, k2, v2, off2, nt2 = make_case(B, N, H, 128, torch.bfloat16, seed + 1, layout="fused", targets=targets,
                                      lengths=lengths)
    out.append(("same_shape", q2, k2, v2, off2, nt2))
    q3, k3, v3, _, _ = make_case(B, N, H, 128, torch.bfloat16, seed + 2, layout="contig", targets=targets,
                                 lengths=lengths)
    out.append(("row_stride", q3, k3, v3, off, nt))
    odd_off = torch.cat([off[:1], off])[1:]  # 8 bytes off 16-byte alignment
    odd_nt = None if nt is None else torch.cat([nt[:1], nt])[1:]
    out.append(("odd_meta", q, k, v, odd_off, odd_nt))
    return out


@pytest.mark.parametrize("targets", [True, False], ids=["targets", "causal"])
@pytest.mark.parametrize("N", [256, 1024])
@pytest.mark.parametrize("B", [1, 8, 128])
def test_cached_equals_uncached(B, N, targets):
    from hstu_inductor.kernels import fastlaunch as fl
    from hstu_inductor.kernels.gluon_attention import gluon_forward
    from hstu_inductor.kernels.gluon_backward import gluon_backward

    verified = fl.VERIFIED
    for name, q, k, v, off, nt in _variants(B, N, targets, seed=B * 7919 + N * 2 + targets):
        what = f"B={B} N={N} targets={targets} {name}"
        ref, got = _both(lambda: gluon_forward(q, k, v, off, N, ALPHA, nt))
        _equal(ref, got, "forward " + what)
        grad = torch.randn_like(ref)
        ref, got = _both(lambda: gluon_backward(grad, q, k, v, off, N, ALPHA, nt))
        _equal(ref, got, "backward " + what)
    # every variant had at least its second cached forward and backward (2 kernels) launched from the cache
    assert fl.VERIFIED - verified >= 4 * 3
