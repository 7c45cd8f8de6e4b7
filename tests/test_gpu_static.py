"""GPU: static production shapes are rewritten on their first compile and match the reference."""
from __future__ import annotations

import pytest
import torch

from hstu_inductor.reference import hstu_mha
from hstu_inductor.report import collecting

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("N", [1024, 4096])
def test_static_b128_rewritten_and_correct(N):
    B, H, D = 128, 4, 128
    g = torch.Generator().manual_seed(N)
    lengths = torch.randint(int(0.9 * N), N + 1, (B,), generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
    nt = torch.randint(0, 21, (B,), generator=g).cuda()
    L = int(off[-1])
    q, k, v = (torch.randn(L, H, D, generator=g).cuda().bfloat16() for _ in range(3))

    def fn(q, k, v, off, nt):
        return hstu_mha(N, 1.0 / D, q, k, v, off, causal=True, num_targets=nt)

    torch._dynamo.reset()
    with collecting() as report:
        out = torch.compile(fn, backend="hstu", dynamic=False)(q, k, v, off, nt)
    assert report.counts["attention"] == 1, report.near_misses
    # reference in fp32, a few sequences at a time (the padded scores of the batch need 32 GB)
    errs_num, errs_den = 0.0, 0.0
    per = max(1, 2 ** 16 // N)
    for b0 in range(0, B, per):
        b1 = min(B, b0 + per)
        r0, r1 = int(off[b0]), int(off[b1])
        ref = hstu_mha(N, 1.0 / D, *(t[r0:r1].float() for t in (q, k, v)), off[b0:b1 + 1] - r0, causal=True,
                       num_targets=nt[b0:b1])
        errs_num += float((out[r0:r1].float() - ref).norm() ** 2)
        errs_den += float(ref.norm() ** 2)
    assert (errs_num / errs_den) ** 0.5 < 1e-2
