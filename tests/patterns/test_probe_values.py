"""Probe values must never be exactly zero: a zero score hides the mask at that position
(silu(0) = 0), and the mask fit then declined real HSTU attention at N >= 512."""
import torch

from hstu_inductor.patterns.attention import _rand


def test_probe_values_have_no_exact_zeros():
    # seed 1 makes CPU float32 randn produce exact zeros in this many draws (checked below)
    plain = torch.randn(4_000_000, generator=torch.Generator().manual_seed(1))
    assert (plain == 0).any(), "precondition: the plain generator yields zeros for this seed"
    vals = _rand((4_000_000,), torch.Generator().manual_seed(1))
    assert vals.dtype == torch.float64 and not (vals == 0).any()
    assert torch.equal(vals.float().double(), vals)  # still exact in float32
    assert abs(float(vals.mean())) < 5e-3 and abs(float(vals.std()) - 1) < 5e-3
