"""Every spelling of the pattern table is rewritten to hstu.attention, with eager-equal results in
inference and training (outputs and all input gradients)."""
from __future__ import annotations

import importlib.util

import expecttest
import pytest
import torch

import hstu_inductor
from hstu_inductor.patterns import spellings_attention as sp
from hstu_inductor.report import collecting

from test_attention_helpers import rewritten_graph, spelling_inputs, summarize

HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None


def _skip(name):
    if sp.SPELLINGS[name][3] and not HAS_FBGEMM:
        pytest.skip("fbgemm_gpu not importable")


def _attention_misses(report):
    return [r for kind, r in report.near_misses if kind == "attention"]


@pytest.mark.parametrize("name", list(sp.SPELLINGS))
def test_inference_matches_eager(name, fresh_dynamo):
    _skip(name)
    fn, args = spelling_inputs(name)
    with torch.no_grad():
        report = hstu_inductor.explain(fn, *args)
        expected = fn(*args)
    assert report.counts["attention"] == 1, report
    assert not _attention_misses(report), report
    torch.testing.assert_close(report.output, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [n for n, s in sp.SPELLINGS.items() if s[4]])
def test_training_matches_eager(name, fresh_dynamo):
    _skip(name)
    fn, args = spelling_inputs(name, requires_grad=True, seed=1)
    fn_eager, args_eager = spelling_inputs(name, requires_grad=True, seed=1)
    if args[5] is not None:  # attn_scale gets a gradient too
        args[5].requires_grad_(True)
        args_eager[5].requires_grad_(True)
    compiled = torch.compile(fn, backend="hstu")
    with collecting() as report:
        out = compiled(*args)
    ref = fn_eager(*args_eager)
    assert report.counts["attention"] == 1, report
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(ref)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    leaves_e = [a for a in args_eager if isinstance(a, torch.Tensor) and a.requires_grad]
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(ref, leaves_e, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


class TestRewrittenGraphs(expecttest.TestCase):
    """The rewritten ATen graph per spelling: the jagged sources are re-laid-out as [L, H, D], one
    hstu.attention call replaces pads, products, mask and unpad (dead nodes removed)."""

    def graph(self, name):
        _skip(name)
        fn, args = spelling_inputs(name)
        gm, report = rewritten_graph(fn, *args)
        self.assertEqual(report.counts["attention"], 1)
        return summarize(gm)

    def test_reference(self):
        self.assertExpectedInline(self.graph("reference"), """attention_default = hstu.attention.default(arg1_1, arg2_1, arg3_1, arg0_1, 8, 0.5, arg4_1, None, 0, 0, 0, True)""")

    def test_einsum_index_put_tril(self):
        self.assertExpectedInline(self.graph("einsum_index_put_tril"), """attention_default = hstu.attention.default(arg1_1, arg2_1, arg3_1, arg0_1, 8, 0.5, None, None, 0, 0, 0, True)""")

    def test_matmul_index_copy_where(self):
        self.assertExpectedInline(self.graph("matmul_index_copy_where"), """\
view = aten.view.default(arg0_1, [16, -1])
mul = aten.mul.Tensor(view, 0.5)
view_1 = aten.view.default(arg2_1, [16, -1])
view_2 = aten.view.default(arg3_1, [16, -1])
reshape_default = aten.reshape.default(mul, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_1, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_2, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 1, None, None, 0, 0, 0, True)
reshape_default_3 = aten.reshape.default(attention_default, [-1, 8])
view_9 = aten.view.default(reshape_default_3, [16, 2, -1])""")

    def test_bmm_scatter_masked_fill(self):
        self.assertExpectedInline(self.graph("bmm_scatter_masked_fill"), """\
view = aten.view.default(arg0_1, [16, -1])
view_2 = aten.view.default(arg2_1, [16, -1])
view_5 = aten.view.default(arg4_1, [16, -1])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_2, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_5, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 0.5, None, arg3_1, 0, 0, 0, True)""")

    def test_gather_pad_targets(self):
        self.assertExpectedInline(self.graph("gather_pad_targets"), """attention_default = hstu.attention.default(arg0_1, arg2_1, arg3_1, arg1_1, 8, 0.5, arg4_1, None, 0, 0, 0, True)""")

    def test_contextual_window(self):
        self.assertExpectedInline(self.graph("contextual_window"), """attention_default = hstu.attention.default(arg0_1, arg2_1, arg3_1, arg1_1, 8, 0.5, arg4_1, arg5_1, 3, 2, 0, True)""")

    def test_fbgemm_dense(self):
        self.assertExpectedInline(self.graph("fbgemm_dense"), """\
view = aten.view.default(arg0_1, [16, -1])
view_2 = aten.view.default(arg2_1, [16, -1])
view_4 = aten.view.default(arg3_1, [16, -1])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_2, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_4, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)
reshape_default_3 = aten.reshape.default(attention_default, [-1, 8])
view_11 = aten.view.default(reshape_default_3, [16, 2, -1])""")

    def test_aten_jagged_dense(self):
        self.assertExpectedInline(self.graph("aten_jagged_dense"), """\
view = aten.view.default(arg0_1, [16, -1])
view_2 = aten.view.default(arg2_1, [16, -1])
view_5 = aten.view.default(arg3_1, [16, -1])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_2, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_5, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)
reshape_default_3 = aten.reshape.default(attention_default, [-1, 8])
view_8 = aten.view.default(reshape_default_3, [16, 2, -1])""")

    def test_nested_padded(self):
        self.assertExpectedInline(self.graph("nested_padded"), """\
detach = aten.detach.default(arg0_1)
view = aten.view.default(detach, [16, 8])
detach_1 = aten.detach.default(arg2_1)
view_2 = aten.view.default(detach_1, [16, 8])
detach_2 = aten.detach.default(arg3_1)
view_6 = aten.view.default(detach_2, [16, 8])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_2, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_6, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)""")

    def test_non_causal(self):
        self.assertExpectedInline(self.graph("non_causal"), """attention_default = hstu.attention.default(arg1_1, arg2_1, arg3_1, arg0_1, 8, 0.5, None, None, 0, 0, 0, False)""")
