"""The one-launch value check of eager CUDA calls (``kernels/checks.py``) decides exactly as the
traceable ATen flags (``ops/_checks.py::_flags``) that compiled graphs keep. Under the interpreter the
kernel's ``device_assert`` is compiled away, so the test reads the per-program result it writes."""
from __future__ import annotations

import pytest
import torch

from hstu_inductor.kernels.checks import check_jagged
from hstu_inductor.ops._checks import _flags


def _fused(off, L, N, nt, min_length=0) -> bool:
    ok = torch.zeros(max(1, -(-(off.shape[0] - 1) // 256)), dtype=torch.int32)
    check_jagged(off, L, N, nt, min_length, ok_out=ok)
    return bool(ok.all())


def _aten(off, L, N, nt, min_length=0) -> bool:
    return bool(_flags(off, L, N, nt, min_length).all())


BAD = {  # tests/test_input_checks.py's cases: L = 8, N = 4
    "first_not_0": ([1, 1, 4, 8, 8, 8], [0, 0, 0, 0, 0]),
    "decreasing": ([0, 3, 2, 7, 7, 8], [0, 0, 0, 0, 0]),
    "last_not_L": ([0, 0, 3, 7, 7, 7], [0, 0, 0, 0, 0]),
    "longer_than_max_seq_len": ([0, 5, 5, 7, 7, 8], [0, 0, 0, 0, 0]),
    "num_targets_above_length": ([0, 0, 3, 7, 7, 8], [0, 4, 0, 0, 0]),
    "negative_num_targets": ([0, 0, 3, 7, 7, 8], [0, -1, 0, 0, 0]),
}


@pytest.mark.parametrize("name", BAD)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_named_bad_cases(name, dtype):
    off, nt = (torch.tensor(x, dtype=dtype) for x in BAD[name])
    assert not _fused(off, 8, 4, nt) and not _aten(off, 8, 4, nt)
    good = torch.tensor([0, 0, 3, 7, 7, 8], dtype=dtype)
    assert _fused(good, 8, 4, torch.tensor([0, 3, 4, 0, 1], dtype=dtype)) and _fused(good, 8, 4, None)


def test_random_offsets_agree_with_the_aten_flags():
    """Valid and slightly broken metadata, one to 600 sequences (several programs), with and without
    targets and a minimum length (delta attention)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        B = int(torch.randint(0, 600 if trial % 6 == 0 else 9, (), generator=g))
        N = int(torch.randint(1, 6, (), generator=g))
        lengths = torch.randint(0, N + 1, (B,), generator=g)
        off = torch.zeros(B + 1, dtype=torch.int64)
        off[1:] = lengths.cumsum(0)
        L = int(off[-1])
        nt = torch.minimum(torch.randint(0, N + 1, (B,), generator=g), lengths) if trial % 2 else None
        min_length = trial % 3 == 0
        if trial % 4 == 3 and B:  # break one thing
            what = trial % 3
            if what == 0:
                off[int(torch.randint(0, B + 1, (), generator=g))] += 1
            elif what == 1:
                L += 1
            elif nt is not None:
                nt[int(torch.randint(0, B, (), generator=g))] = N + 1
        assert _fused(off, L, N, nt, min_length) == _aten(off, L, N, nt, min_length), (trial, off, L, N, nt)


def test_cached_launch_path():
    """Plain eager launches after the first of a key skip the Autotuner (kernels/attention.py::_CHOSEN) and
    compute what the first launch did; another mask option is another key."""
    from hstu_inductor.kernels import attention as K
    from hstu_inductor.reference import hstu_mha

    g = torch.Generator().manual_seed(1)
    off = torch.tensor([0, 3, 7, 8])
    q, k, v = (torch.randn(8, 2, 16, generator=g) for _ in range(3))
    nt = torch.tensor([1, 0, 1])
    K._CHOSEN.clear()
    first = K.hstu_attention_fwd(q, k, v, off, 4, 0.5)
    assert len(K._CHOSEN) == 1
    again = K.hstu_attention_fwd(q, k, v, off, 4, 0.5)
    with_targets = K.hstu_attention_fwd(q, k, v, off, 4, 0.5, nt)
    assert len(K._CHOSEN) == 2
    assert torch.equal(first, again)
    for out, t in ((again, None), (with_targets, nt)):
        ref = hstu_mha(4, 0.5, q.double(), k.double(), v.double(), off, num_targets=t)
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
