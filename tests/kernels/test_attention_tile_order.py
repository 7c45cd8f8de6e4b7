"""The program order of the attention kernels (``kernels.attention_jit._tile``) changes only which
program runs when, never what it computes: both orders are checked against the fp64 reference, and
the deterministic kernels must agree bitwise between the orders."""
from __future__ import annotations

import math

import pytest
import torch

from hstu_inductor import config
from hstu_inductor.kernels import attention as K
from hstu_inductor.kernels import common

from test_attention_kernels import DEV, HAS_CUDA, make_batch, ref_fwd_bwd, rel_err

TOL = 2e-4  # fp32
LENGTHS = [45, 0, 1, 64, 20, 33]  # several row blocks per sequence, an empty and a one-row sequence
N = 64


def _run(order, monkeypatch, **kw):
    monkeypatch.setattr(config, "tile_order", order)
    q, k, v, off, _ = make_batch(LENGTHS, 2, 32, 32, torch.float32, N, strided=True, seed=11)
    alpha = 1.0 / math.sqrt(32)
    dout = torch.randn(q.shape[0], 2, 32, generator=torch.Generator().manual_seed(3)).to(DEV)
    out = K.hstu_attention_fwd(q, k, v, off, N, alpha, **kw)
    grads = K.hstu_attention_bwd(dout, q, k, v, off, N, alpha, deterministic=True, **kw)
    ref, ref_grads = ref_fwd_bwd(q, k, v, off, N, alpha, dout=dout, **kw)
    assert rel_err(out, ref) < TOL, order
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert rel_err(g, r) < TOL, (order, name)
    return out, grads


@pytest.mark.skipif(HAS_CUDA, reason="interpreter-sized case")
@pytest.mark.parametrize("kw", [{}, {"max_attn_len": 9, "contextual_seq_len": 3}], ids=["causal", "ctx_window"])
def test_orders_agree(kw, monkeypatch):
    # blocks of 16 rows (several per sequence), so the two orders really launch programs differently
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)
    with K.force_configs(fwd=(16, 16, 4, 1), dkdv=(16, 16, 4, 1), dq=(16, 16, 4, 1)):
        out_seq, g_seq = _run("seq", monkeypatch, **kw)
        out_blk, g_blk = _run("block", monkeypatch, **kw)
    assert torch.equal(out_seq, out_blk)
    for a, b in zip(g_seq, g_blk):
        assert torch.equal(a, b)


def test_bad_order_is_named(monkeypatch):
    monkeypatch.setattr(config, "tile_order", "rows")
    with pytest.raises(ValueError, match="HSTU_INDUCTOR_TILE_ORDER"):
        K._seq_major()
