"""Unit tests of the layout algebra and the prover's building blocks."""
import sympy
import torch

from hstu_inductor.patterns import attn_layout as lay
from hstu_inductor.patterns.prover import make_probes, mask_candidates, valid_at
from hstu_inductor.reference import hstu_mask


def test_layout_view_permute_roundtrip_positions():
    B, N, H, D = 3, 4, 2, 5
    base = lay.source_layout([B, N, H, D], ["b", "n", "h", "d"])
    # [B,N,H,D] -> permute to [B,H,N,D] -> reshape [B*H, N, D] (what einsum/matmul do)
    layout = lay.view(lay.permute(base, [0, 2, 1, 3]), [B * H, N, D])
    assert lay.normalize_dim(layout[0]) == ((sympy.Integer(B), "b", 1), (sympy.Integer(H), "h", 1))
    x = torch.randn(B, N, H, D)
    y = x.permute(0, 2, 1, 3).reshape(B * H, N, D)
    crd = lay.coords(lay.concretize(layout, {}), list(y.shape))
    assert torch.equal(x[crd["b"], crd["n"], crd["h"], crd["d"]], y)


def test_layout_split_merged_features():
    L, H, D = 6, 2, 3
    base = lay.source_layout([L, H * D], ["l", "f"])
    layout = lay.view(base, [L, H, D])
    assert layout[1] == ((2, "f", 3),) and layout[2] == ((3, "f", 1),)
    assert lay.tiles([layout[1][0], layout[2][0]], H * D)


def test_layout_symbolic_batch():
    B = sympy.Symbol("s0", positive=True, integer=True)
    base = lay.source_layout([B, 8, 2, 4], ["b", "n", "h", "d"])
    flat = lay.view(base, [B * 8, 2, 4])
    back = lay.view(flat, [B, 8, 8])
    assert back[2] == ((2, "h", 1), (4, "d", 1)) or lay.normalize_dim(back[2])[0][1] == "h"


def test_valid_at_matches_reference_mask():
    g = torch.Generator().manual_seed(0)
    N = 9
    lengths = torch.randint(0, N + 1, (6,), generator=g)
    targets = (torch.rand(6, generator=g) * (lengths + 1)).long().clamp(max=lengths)
    b, i, j = torch.meshgrid(torch.arange(6), torch.arange(N), torch.arange(N), indexing="ij")
    for spec in mask_candidates({2, 3}, N, True)[:60]:
        ref = hstu_mask(lengths, N, targets, spec=spec)
        assert torch.equal(valid_at(b, i, j, lengths, targets, spec), ref), spec


def test_probes_cover_edges():
    probes = make_probes(8, None, None, 10)
    flat = [n for p in probes for n in p]
    assert 0 in flat and 1 in flat and 8 in flat
    fixed = make_probes(8, 3, 12, 10)
    assert all(sum(p) == 12 and len(p) == 3 and max(p) <= 8 for p in fixed)


def test_layout_narrow_feature_slices():
    """Slices of a padded uvqk are slices of the source when they keep a contiguous feature range."""
    import pytest

    B, N, F = 3, 4, 32  # F = 4 chunks x H=2 x D=4
    base = lay.source_layout([B, N, F], ["b", "n", "f"])
    out, (axis, first, length) = lay.narrow(base, 2, 16, 24, F)  # padded[..., 16:24]
    assert (axis, first, length) == ("f", 16, 8) and lay.dim_size(out[2]) == 8
    chunks = lay.view(base, [B, N, 4, 2, 4])  # select chunk 2 of [B, N, 4, H, D]
    out, (_, first, length) = lay.narrow(chunks, 2, 2, 3, F)
    assert (first, length) == (16, 8)
    with pytest.raises(lay.LayoutError):  # an inner digit (first 2 of every head's D) is not a range
        lay.narrow(chunks, 4, 0, 2, F)
