"""Issue 22 (host overhead of a direct ``hstu::attention`` call): the shortcuts of plain eager calls
never let an input through that the full validators reject, and step aside wherever they must."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hstu_inductor.reference import validate_attention_inputs
from hstu_inductor.spec import AttentionSpec

from _helpers import offsets_from_lengths

ops_attention = importlib.import_module("hstu_inductor.ops.attention")  # the module, not the op it exports
_checks = importlib.import_module("hstu_inductor.ops._checks")

H, D, N = 2, 8, 4
LENGTHS = [0, 3, 4, 1]
L = sum(LENGTHS)


def _args(**change):
    q = torch.randn(L, H, D)
    args = dict(q=q, k=q.clone(), v=torch.randn(L, H, 6), seq_offsets=offsets_from_lengths(LENGTHS), max_seq_len=N,
                num_targets=torch.tensor([0, 1, 0, 1]), attn_scale=None, w=0, c=0, f=0, causal=True)
    args.update(change)
    return args


def _validators_accept(a) -> bool:
    try:
        validate_attention_inputs(a["q"], a["k"], a["v"], a["seq_offsets"], a["max_seq_len"], a["num_targets"],
                                  a["attn_scale"], a["w"], a["c"], a["f"], causal=a["causal"], check_values=False)
    except (RuntimeError, ValueError):
        return False
    return True


CASES = {
    "valid": {}, "no_targets": dict(num_targets=None), "scalar_scale": dict(attn_scale=torch.tensor(0.5)),
    "row_scale": dict(attn_scale=torch.rand(L)), "window": dict(w=2, c=1, f=1), "full": dict(causal=False, num_targets=None),
    "q_2d": dict(q=torch.randn(L, H * D)), "k_rows": dict(k=torch.randn(L + 1, H, D)),
    "v_heads": dict(v=torch.randn(L, H + 1, D)), "dtypes": dict(k=torch.randn(L, H, D, dtype=torch.float64)),
    "int_q": dict(q=torch.ones(L, H, D, dtype=torch.int64), k=torch.ones(L, H, D, dtype=torch.int64),
                  v=torch.ones(L, H, 6, dtype=torch.int64)),
    "n_zero": dict(max_seq_len=0), "negative_window": dict(w=-1), "noncausal_targets": dict(causal=False),
    "float_offsets": dict(seq_offsets=offsets_from_lengths(LENGTHS).float()),
    "offsets_2d": dict(seq_offsets=offsets_from_lengths(LENGTHS).view(1, -1)),
    "targets_len": dict(num_targets=torch.tensor([0, 1, 0])), "float_targets": dict(num_targets=torch.zeros(4)),
    "scale_len": dict(attn_scale=torch.rand(L + 1)), "meta_offsets": dict(seq_offsets=torch.zeros(5, dtype=torch.int64,
                                                                                                    device="meta")),
}


def _plain_inputs_ok(a) -> bool:
    *tensors_and_n, w, c, f, causal = a.values()
    return ops_attention._plain_inputs_ok(*tensors_and_n, AttentionSpec(causal, w, c, f))


@pytest.mark.parametrize("name", CASES)
def test_plain_inputs_ok_agrees_with_the_validators(name):
    a = _args(**CASES[name])
    assert _plain_inputs_ok(a) == _validators_accept(a)


def test_plain_inputs_ok_steps_aside_under_fake_tensors():
    with FakeTensorMode():
        a = _args()
    assert not _plain_inputs_ok(a)


def test_fused_check_only_for_plain_unit_stride_metadata():
    off, nt = offsets_from_lengths(LENGTHS), torch.tensor([0, 1, 0, 1])
    assert _checks._fused_ok(off, nt) and _checks._fused_ok(off, None)
    assert not _checks._fused_ok(torch.arange(10)[::2], None)
    assert not _checks._fused_ok(off, torch.arange(8)[::2])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert not _checks._fused_ok(mode.from_tensor(off), None)
