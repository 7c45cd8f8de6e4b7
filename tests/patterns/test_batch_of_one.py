"""One sequence (B = 1): serving at batch size 1 compiles a graph in which the batch dim has size 1.

Dynamo specialises a size-1 dim even under ``dynamic=True``, and the layout algebra drops size-1
modes, so the sequence axis disappears from the score product's batch. Until issue 22's sweep this
declined the attention ("score product batch is not (sequence, head)") and the user silently got
stock Inductor. Numerics against eager (outputs and gradients) and the rewrite counts.
"""
import pytest
import torch

from hstu_inductor.reference import STULayer, hstu_mha
from hstu_inductor.report import collecting


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _one(n, N, E, seed):
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0, n])
    x = torch.randn(n, E, generator=g)
    return x, off, torch.tensor([min(3, n)])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("n", [32, 19], ids=["full", "short"])
def test_stu_layer_batch_of_one(fresh_dynamo, dynamic, n):
    N, E = 32, 16
    torch.manual_seed(0)
    layer = STULayer(E, 2, 8, 8, max_attn_len=7)
    x, off, nt = _one(n, N, E, seed=n)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = layer(xe, off, N, nt)
    with collecting() as report:
        got = torch.compile(layer, backend="hstu_eager", dynamic=dynamic)(xc, off, N, nt)
    assert report.counts.get("attention", 0) == 1, report
    assert _rel(got, want) < 1e-5
    dout = torch.randn_like(want)
    params = list(layer.parameters())
    g_want = torch.autograd.grad(want, [xe, *params], dout)
    g_got = torch.autograd.grad(got, [xc, *params], dout)
    for a, b in zip(g_got, g_want):
        assert _rel(a, b) < 1e-4


def test_plain_attention_batch_of_one(fresh_dynamo):
    """The reference attention with targets and a window, one sequence shorter than N."""
    N, H, D = 24, 2, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(17, H, D, generator=g) for _ in range(3))
    off, nt = torch.tensor([0, 17]), torch.tensor([4])

    def attn(q, k, v, off, nt):
        return hstu_mha(N, 0.25, q, k, v, off, num_targets=nt, max_attn_len=5)

    want = attn(q, k, v, off, nt)
    with collecting() as report:
        got = torch.compile(attn, backend="hstu_eager")(q, k, v, off, nt)
    assert report.counts.get("attention", 0) == 1, report
    assert _rel(got, want) < 1e-5
