"""AttentionSpec (hstu_inductor/spec.py) and the attention variant registry (hstu_inductor/ops/variants.py)."""
import dataclasses
import inspect

import pytest
import torch

import hstu_inductor
from hstu_inductor import ops
from hstu_inductor.ops import variants
from hstu_inductor.reference import hstu_mha
from hstu_inductor.spec import KERNEL_LENGTHS, AttentionSpec, KernelMask
from tests._helpers import offsets_from_lengths


def _inputs(lengths=(5, 0, 3), H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    q, k, v = (torch.randn(L, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    return q, k, v, offsets_from_lengths(list(lengths))


@pytest.mark.parametrize("bad, msg", [
    (dict(max_attn_len=-1), "max_attn_len must be >= 0"),
    (dict(min_full_attn_seq_len=-3), "min_full_attn_seq_len must be >= 0"),
    (dict(causal=False, contextual_seq_len=2), "causal=False means full attention"),
])
def test_spec_validation_messages(bad, msg):
    with pytest.raises(ValueError, match=msg):
        AttentionSpec(**bad).validate()


def test_spec_rules_that_depend_on_inputs():
    with pytest.raises(ValueError, match="causal=False"):
        AttentionSpec(causal=False).validate(has_targets=True)
    with pytest.raises(ValueError, match="intervals replace"):
        AttentionSpec(max_attn_len=4).validate(has_intervals=True)
    AttentionSpec(causal=False).validate(has_intervals=True)  # nothing to reset


def test_spec_kernel_flags_and_variant_scope():
    spec = AttentionSpec(True, 8, 2, 3)
    assert spec.kernel_flags(has_targets=True) == dict(MASK=31)  # every KernelMask bit
    assert spec.kernel_lengths() == (2, 8, 3, 0)
    assert len(spec.kernel_lengths()) == KERNEL_LENGTHS
    assert AttentionSpec(causal=False).kernel_flags(has_targets=False) == dict(MASK=0)
    assert AttentionSpec().kernel_flags(has_targets=False, has_intervals=True) == dict(MASK=0, HAS_IV=True)
    # a full-attention tail without a window has no effect, so no switch
    assert AttentionSpec(min_full_attn_seq_len=3).kernel_flags(has_targets=False) == dict(MASK=KernelMask.CAUSAL)
    assert AttentionSpec(max_attn_len=4).kernel_mask(True) == KernelMask.CAUSAL | KernelMask.TARGETS | KernelMask.WINDOW
    assert AttentionSpec().plain_causal and not spec.plain_causal and not AttentionSpec(causal=False).plain_causal
    assert AttentionSpec.from_op_args(*spec.op_args()) == spec


def test_spec_is_what_the_op_schema_flattens():
    schema = torch.ops.hstu.attention.default._schema
    names = [a.name for a in schema.arguments]
    assert names[8:12] == list(AttentionSpec.OP_FIELDS) and names[-1] == "ts_next"
    assert AttentionSpec.added_fields() == []  # every option today is positional


def test_added_option_reaches_op_schema_and_body():
    """An option added to the spec becomes a keyword-only argument of every op decorated with
    ``AttentionSpec.op_params``, and arrives in the body's ``**added`` (here on a scratch op)."""

    @dataclasses.dataclass(frozen=True)
    class Extended(AttentionSpec):
        sink_rows: int = 0

    seen = []

    @torch.library.custom_op("hstu_test::spec_added", mutates_args=())
    @Extended.op_params
    def scratch(x: torch.Tensor, max_attn_len: int = 0, contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0,
                causal: bool = True, **added) -> torch.Tensor:
        seen.append(Extended.from_op_args(max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal, **added))
        return x.clone()

    params = inspect.signature(scratch._init_fn).parameters
    assert params["sink_rows"].kind is inspect.Parameter.KEYWORD_ONLY
    schema = torch.ops.hstu_test.spec_added.default._schema
    assert next(a for a in schema.arguments if a.name == "sink_rows").kwarg_only
    assert "*, SymInt sink_rows=0)" in str(schema), str(schema)
    torch.ops.hstu_test.spec_added(torch.randn(2), 3, sink_rows=4)
    assert seen[-1] == Extended(max_attn_len=3, sink_rows=4)


def test_registry_picks_highest_priority_in_scope(monkeypatch):
    monkeypatch.setattr(variants, "_VARIANTS", {d: list(v) for d, v in variants._VARIANTS.items()})
    q, k, v, off = _inputs()
    ops.attention(q, k, v, off, 5, 0.3)
    assert variants.chosen("fwd") == "reference"  # CPU: the only variant in scope
    assert variants.names("fwd")[-1] == "reference" and "triton" in variants.names("fwd")

    calls = []

    def run(how, c):
        calls.append(how)
        return hstu_mha(c.max_seq_len, c.alpha, c.q, c.k, c.v, c.seq_offsets, training=False, spec=c.spec)

    # in scope only for windowed masks: the others still run the reference
    variants.register(variants.Variant("windowed", "fwd", 99,
                                       lambda c: "w" if c.spec.max_attn_len else None, run))
    ops.attention(q, k, v, off, 5, 0.3)
    assert variants.chosen("fwd") == "reference" and calls == []
    out = ops.attention(q, k, v, off, 5, 0.3, None, None, 2)
    assert variants.chosen("fwd") == "windowed" and calls == ["w"]
    ref = hstu_mha(5, 0.3, q, k, v, off, training=False, max_attn_len=2)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="direction"):
        variants.register(variants.Variant("x", "sideways", 1, lambda c: None, run))


def test_explain_names_the_variants_compiled_graphs_run():
    q, k, v, off = _inputs()

    def f(q, k, v, off):
        return ops.attention(q, k, v, off, 5, 0.3) * 2

    q.requires_grad_()
    report = hstu_inductor.explain(lambda *a: f(*a).sum().backward() or q.grad, q, k, v, off)
    assert report.variants.get("fwd:reference", 0) >= 1, report.variants
    assert "attention kernels chosen" in str(report) and "variants" in report.as_dict()
