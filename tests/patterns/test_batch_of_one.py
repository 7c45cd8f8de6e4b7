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


def _length_scaled(q, k, v, offsets, how):
    """Attention scaled by ``1/n_b`` (``per_seq``) or ``1/max(n_b)`` (``max``): at a batch of one with a
    fixed length both are the constant ``1/L``, i.e. HSTU's values; otherwise a near miss."""
    lengths = offsets[1:] - offsets[:-1]
    B, N = lengths.numel(), 16
    seg = torch.repeat_interleave(torch.arange(B), lengths, output_size=q.shape[0])
    pos = torch.arange(q.shape[0]) - offsets[seg]

    def pad(t):
        return t.new_zeros(B, N, *t.shape[1:]).index_put((seg, pos), t)
    s = torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k))
    scale = 1.0 / lengths.max() if how == "max" else 1.0 / lengths[:, None, None, None]
    p = torch.nn.functional.silu(s) * torch.ones(N, N).tril() * scale
    return torch.einsum("bhnm,bmhd->bnhd", p, pad(v))[seg, pos]


@pytest.mark.parametrize("how", ["per_seq", "max"])
def test_length_scale_is_hstu_only_at_a_static_batch_of_one(fresh_dynamo, how):
    """Static B = 1: rewritten (``max`` over the batch of one is its one element) and eager-equal; the same
    spelling with two sequences stays a near miss."""
    g = torch.Generator().manual_seed(7)
    for lengths, want in (([11], 1), ([11, 5], 0)):
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        q, k, v = (torch.randn(int(offsets[-1]), 2, 8, generator=g) for _ in range(3))
        torch._dynamo.reset()
        with collecting() as report, torch.no_grad():
            got = torch.compile(lambda *a: _length_scaled(*a, how), backend="hstu_eager", dynamic=False)(
                q, k, v, offsets)
        assert report.counts.get("attention", 0) == want, report
        assert _rel(got, _length_scaled(q, k, v, offsets, how)) < 1e-5
