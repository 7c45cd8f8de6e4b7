"""The attention kernels never touch memory outside their tensors, whatever the jagged metadata
holds (decreasing / negative / past-L offsets, lengths past max_seq_len, targets outside [0, n]).

Every tensor a kernel reads or writes is a view into a larger buffer: inputs are guarded by NaN rows
(a read of one makes the output non-finite), outputs by sentinel rows (a write changes them).
Results for such inputs are unspecified; only memory safety is checked. Valid inputs must still
give the reference result (a clamp that changed valid numerics fails the last test).
``tests/kernels/sanitize_attention.py --garbage`` runs the same cases under compute-sanitizer.
"""
from __future__ import annotations

import pytest
import torch

from hstu_inductor.kernels import attention as K
from hstu_inductor.kernels import delta as Kd

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAD = 64  # guard rows on each side; every garbage offset below stays within PAD of [0, L]
SENTINEL = 1234.5
L, H, D, N = 40, 2, 16, 24

# (name, offsets, num_targets)
GARBAGE = {
    "decreasing": ([0, 30, 5, L], None),
    "negative_start": ([-20, 10, L], None),
    "past_L": ([0, 12, L + 30], None),
    "first_not_0_last_short": ([9, 20, L - 7], None),
    "longer_than_max_seq_len": ([0, L], None),
    "targets_out_of_range": ([0, 20, L], [-5, 50]),
}


class Guarded:
    """Allocates views into padded buffers and checks the padding afterwards."""

    def __init__(self):
        self.buffers = []

    def view(self, rows, *rest, fill, dtype=torch.float32, data=None):
        buf = torch.full((rows + 2 * PAD, *rest), fill, dtype=dtype, device=DEV)
        v = buf[PAD:PAD + rows]
        if data is not None:
            v.copy_(data)
        self.buffers.append((buf, rows, fill))
        return v

    def new(self, shape, dtype, device):  # stands in for the kernels' output allocator
        return self.view(shape[0], *shape[1:], fill=SENTINEL, dtype=dtype, data=torch.zeros(shape))

    def assert_padding_untouched(self):
        for buf, rows, fill in self.buffers:
            for pad in (buf[:PAD], buf[PAD + rows:]):
                same = torch.isnan(pad).all() if fill != fill else (pad == fill).all()
                assert same, "a kernel wrote outside its tensor"


def _inputs(g: Guarded, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (g.view(L, H, D, fill=float("nan"), data=torch.randn(L, H, D, generator=gen)) for _ in range(4))
    return q, k, v, dout


@pytest.fixture
def guarded(monkeypatch):
    g = Guarded()
    monkeypatch.setattr(K, "_new", g.new)
    monkeypatch.setattr(Kd, "new_tensor", g.new)  # kernels/delta.py's output and split partials
    return g


def _finite(*ts):
    for t in ts:
        assert torch.isfinite(t).all(), "a kernel read outside its tensor (NaN guard rows leaked in)"


@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_metadata_stays_in_bounds(name, tma, guarded):
    offsets, targets = GARBAGE[name]
    q, k, v, dout = _inputs(guarded)
    off = torch.tensor(offsets, device=DEV)
    kw = dict(contextual_seq_len=3, max_attn_len=6)
    if targets is not None:
        kw["num_targets"] = torch.tensor(targets, device=DEV)
    scale = guarded.view(L, fill=float("nan"), data=torch.rand(L) + 0.1)
    out = K.hstu_attention_fwd(q, k, v, off, N, 0.3, attn_scale=scale, tma=tma, **kw)
    grads = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.3, attn_scale=scale, tma=tma, deterministic=True, **kw)
    grads_atomic = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.3, tma=tma, **kw)
    off_d = off[:3] if len(offsets) > 3 else off
    delta = [K.delta_hstu_attention_fwd(q[:4], k, v, off_d, N, 0.3, tma=tma)]
    if not tma:  # kernels/delta.py: split 3, folded in one launch and summed by a second
        delta += [Kd.delta_forward(q[:4], k, v, off_d, N, 0.3, split=3, fold=fold) for fold in (True, False)]
    _finite(out, *grads, *grads_atomic, *delta)
    guarded.assert_padding_untouched()


def test_side_inputs_of_the_wrong_length_are_refused():
    """What the kernels index by row or sequence must be long enough: checked on the host."""
    q, k, v, _ = _inputs(Guarded())
    off = torch.tensor([0, 10, L], device=DEV)
    with pytest.raises(ValueError, match="attn_scale"):
        K.hstu_attention_fwd(q, k, v, off, N, 0.3, attn_scale=torch.rand(L - 1, device=DEV))
    with pytest.raises(ValueError, match="attn_scale"):
        K.hstu_attention_bwd(torch.randn_like(v), q, k, v, off, N, 0.3, attn_scale=torch.rand(L + 1, device=DEV))
    with pytest.raises(ValueError, match="num_targets"):
        K.hstu_attention_fwd(q, k, v, off, N, 0.3, num_targets=torch.tensor([1], device=DEV))


def test_valid_inputs_in_guarded_buffers_match_reference(guarded):
    """The clamps are the identity for valid inputs: same result as the fp64 reference."""
    from hstu_inductor.reference import hstu_mha

    q, k, v, dout = _inputs(guarded, seed=3)
    off = torch.tensor([0, L - N, L - N, L], device=DEV)  # lengths 16, 0, N
    nt = torch.tensor([2, 0, 3], device=DEV)
    out = K.hstu_attention_fwd(q, k, v, off, N, 0.3, num_targets=nt, contextual_seq_len=2)
    ref = hstu_mha(N, 0.3, q.double(), k.double(), v.double(), off, num_targets=nt, contextual_seq_len=2)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-4
    guarded.assert_padding_untouched()
