"""Probe values must never be exactly zero: a zero score hides the mask at that position
(silu(0) = 0), and the mask fit then declined real HSTU attention at N >= 512."""
import torch

from hstu_inductor.patterns.prover import probe_values


def test_probe_values_have_no_exact_zeros():
    # seed 1 makes CPU float32 randn produce exact zeros in this many draws (checked below)
    plain = torch.randn(4_000_000, generator=torch.Generator().manual_seed(1))
    assert (plain == 0).any(), "precondition: the plain generator yields zeros for this seed"
    vals = probe_values((4_000_000,), torch.Generator().manual_seed(1))
    assert vals.dtype == torch.float64 and not (vals == 0).any()
    assert torch.equal(vals.float().double(), vals)  # still exact in float32
    assert abs(float(vals.mean())) < 5e-3 and abs(float(vals.std()) - 1) < 5e-3


def test_probes_hold_a_static_total_length_with_symbolic_batch():
    """An inference graph can have a static L and a dynamic B: the probes must still hold L rows
    (this used to decline with 'L=91 > B*N=64')."""
    from hstu_inductor.patterns.prover import make_probes

    for N, L in ((32, 91), (16, 200), (1024, 60000)):
        for lengths in make_probes(N, None, L, count=6):
            assert sum(lengths) == L and all(0 <= n <= N for n in lengths)
