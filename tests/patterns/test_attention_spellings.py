"""Every spelling of the pattern table is rewritten to hstu.attention, with eager-equal results in
inference and training (outputs and all input gradients)."""
from __future__ import annotations

import importlib.util

import expecttest
import pytest
import torch

import hstu_inductor
from hstu_inductor.testing import spellings_attention as sp
from hstu_inductor.report import collecting

from test_attention_helpers import grad_leaves, rewritten_graph, spelling_inputs, summarize
from _helpers import REWRITE_BACKEND

HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
if HAS_FBGEMM:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm, which the fbgemm spellings call)


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
        report = hstu_inductor.explain(fn, *args, backend=REWRITE_BACKEND)
        expected = fn(*args)
    assert report.counts["attention"] == 1, report
    assert not _attention_misses(report), report
    torch.testing.assert_close(report.output, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [n for n, s in sp.SPELLINGS.items() if s[4]])
def test_training_matches_eager(name, fresh_dynamo):
    _skip(name)
    fn, args = spelling_inputs(name, requires_grad=True, seed=1)
    fn_eager, args_eager = spelling_inputs(name, requires_grad=True, seed=1)
    if args[-1] is not None:  # attn_scale gets a gradient too
        args[-1].requires_grad_(True)
        args_eager[-1].requires_grad_(True)
    compiled = torch.compile(fn, backend=REWRITE_BACKEND)
    with collecting() as report:
        out = compiled(*args)
    ref = fn_eager(*args_eager)
    assert report.counts["attention"] == 1, report
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, grad_leaves(args), grad)
    want = torch.autograd.grad(ref, grad_leaves(args_eager), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


class TestRewrittenGraphs(expecttest.TestCase):
    """The rewritten ATen graph per spelling: the jagged sources are re-laid-out as [L, H, D], one
    hstu.attention call replaces pads, products, mask and unpad (dead nodes removed)."""

    def graph(self, name):
        _skip(name)
        fn, args = spelling_inputs(name)
        # torch.nested.masked_select is a graph break: the attention is the first graph
        gm, report = rewritten_graph(fn, *args, fullgraph=name != "nested_masked_select")
        self.assertEqual(report.counts["attention"], 1)
        return summarize(gm)

    def test_reference(self):
        self.assertExpectedInline(self.graph("reference"), """attention_default = hstu.attention.default(arg0_1, arg1_1, arg2_1, arg3_1, 8, 0.5, arg4_1, None, 0, 0, 0, True)""")

    def test_einsum_index_put_tril(self):
        self.assertExpectedInline(self.graph("einsum_index_put_tril"), """attention_default = hstu.attention.default(arg1_1, arg2_1, arg3_1, arg0_1, 8, 0.5, None, None, 0, 0, 0, True)""")

    def test_matmul_index_copy_where(self):
        self.assertExpectedInline(self.graph("matmul_index_copy_where"), """\
view = aten.view.default(arg0_1, [17, -1])
mul = aten.mul.Tensor(view, 0.5)
view_1 = aten.view.default(arg2_1, [17, -1])
view_2 = aten.view.default(arg3_1, [17, -1])
reshape_default = aten.reshape.default(mul, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_1, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_2, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 1, None, None, 0, 0, 0, True)
reshape_default_3 = aten.reshape.default(attention_default, [-1, 8])
view_9 = aten.view.default(reshape_default_3, [17, 2, -1])""")

    def test_bmm_scatter_masked_fill(self):
        self.assertExpectedInline(self.graph("bmm_scatter_masked_fill"), """\
view = aten.view.default(arg0_1, [17, -1])
view_2 = aten.view.default(arg2_1, [17, -1])
view_5 = aten.view.default(arg4_1, [17, -1])
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
view = aten.view.default(arg0_1, [17, -1])
view_2 = aten.view.default(arg2_1, [17, -1])
view_4 = aten.view.default(arg3_1, [17, -1])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_2, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_4, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)
reshape_default_3 = aten.reshape.default(attention_default, [-1, 8])
view_11 = aten.view.default(reshape_default_3, [17, 2, -1])""")

    def test_aten_jagged_dense(self):
        self.assertExpectedInline(self.graph("aten_jagged_dense"), """\
view = aten.view.default(arg0_1, [17, -1])
view_2 = aten.view.default(arg2_1, [17, -1])
view_5 = aten.view.default(arg3_1, [17, -1])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_2, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_5, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)
reshape_default_3 = aten.reshape.default(attention_default, [-1, 8])
view_8 = aten.view.default(reshape_default_3, [17, 2, -1])""")

    def test_nested_padded(self):
        self.assertExpectedInline(self.graph("nested_padded"), """attention_default = hstu.attention.default(arg0_1, arg2_1, arg3_1, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)""")

    def test_non_causal(self):
        self.assertExpectedInline(self.graph("non_causal"), """attention_default = hstu.attention.default(arg1_1, arg2_1, arg3_1, arg0_1, 8, 0.5, None, None, 0, 0, 0, False)""")

    def test_lengths_cat_cumsum(self):
        self.assertExpectedInline(self.graph("lengths_cat_cumsum"), """\
cumsum_default = aten.cumsum.default(arg0_1, 0)
new_zeros_default = aten.new_zeros.default(cumsum_default, [1])
cat_default = aten.cat.default([new_zeros_default, cumsum_default])
attention_default = hstu.attention.default(arg1_1, arg2_1, arg3_1, cat_default, 8, 0.5, None, None, 0, 0, 0, True)""")

    def test_lengths_pad_cumsum_mask(self):
        self.assertExpectedInline(self.graph("lengths_pad_cumsum_mask"), """\
view = aten.view.default(arg0_1, [17, -1])
view_2 = aten.view.default(arg3_1, [17, -1])
view_5 = aten.view.default(arg4_1, [17, -1])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_2, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_5, [-1, 2, 4])
cumsum_default = aten.cumsum.default(arg1_1, 0)
new_zeros_default = aten.new_zeros.default(cumsum_default, [1])
cat_default = aten.cat.default([new_zeros_default, cumsum_default])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, cat_default, 8, 0.5, arg2_1, None, 0, 0, 0, True)
reshape_default_3 = aten.reshape.default(attention_default, [-1, 8])
view_8 = aten.view.default(reshape_default_3, [17, 2, -1])""")

    def test_lengths_fbgemm_cumsum(self):
        self.assertExpectedInline(self.graph("lengths_fbgemm_cumsum"), """\
view = aten.view.default(arg0_1, [17, -1])
view_2 = aten.view.default(arg2_1, [17, -1])
view_4 = aten.view.default(arg3_1, [17, -1])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_2, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_4, [-1, 2, 4])
cumsum_default = aten.cumsum.default(arg1_1, 0)
new_zeros_default = aten.new_zeros.default(cumsum_default, [1])
cat_default = aten.cat.default([new_zeros_default, cumsum_default])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, cat_default, 8, 0.5, None, None, 0, 0, 0, True)
reshape_default_3 = aten.reshape.default(attention_default, [-1, 8])
view_11 = aten.view.default(reshape_default_3, [17, 2, -1])""")

    def test_uvqk_split_padded(self):
        self.assertExpectedInline(self.graph("uvqk_split_padded"), """\
slice_tensor = aten.slice.Tensor(arg0_1, 1, 16, 24)
reshape_default = aten.reshape.default(slice_tensor, [-1, 2, 4])
slice_tensor_1 = aten.slice.Tensor(arg0_1, 1, 24, 32)
reshape_default_1 = aten.reshape.default(slice_tensor_1, [-1, 2, 4])
slice_tensor_2 = aten.slice.Tensor(arg0_1, 1, 8, 16)
reshape_default_2 = aten.reshape.default(slice_tensor_2, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)""")

    def test_uvqk_slices_matmul(self):
        self.assertExpectedInline(self.graph("uvqk_slices_matmul"), """\
slice_tensor = aten.slice.Tensor(arg0_1, 1, 16, 24)
reshape_default = aten.reshape.default(slice_tensor, [-1, 2, 4])
slice_tensor_1 = aten.slice.Tensor(arg0_1, 1, 24, 32)
reshape_default_1 = aten.reshape.default(slice_tensor_1, [-1, 2, 4])
slice_tensor_2 = aten.slice.Tensor(arg0_1, 1, 8, 16)
reshape_default_2 = aten.reshape.default(slice_tensor_2, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)""")

    def test_row_scale_after_pv(self):
        self.assertExpectedInline(self.graph("row_scale_after_pv"), """attention_default = hstu.attention.default(arg1_1, arg2_1, arg3_1, arg0_1, 8, 0.5, None, arg4_1, 0, 0, 0, True)""")

    def test_inv_n_after_pv(self):
        self.assertExpectedInline(self.graph("inv_n_after_pv"), """\
mul_tensor = aten.mul.Tensor(arg4_1, 0.125)
attention_default = hstu.attention.default(arg0_1, arg2_1, arg3_1, arg1_1, 8, 0.5, None, mul_tensor, 0, 0, 0, True)""")

    def test_zero_buffers_borrowed(self):
        self.assertExpectedInline(self.graph("zero_buffers_borrowed"), """\
view = aten.view.default(arg0_1, [17, -1])
view_1 = aten.view.default(arg2_1, [17, -1])
view_2 = aten.view.default(arg3_1, [17, -1])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
reshape_default_1 = aten.reshape.default(view_1, [-1, 2, 4])
reshape_default_2 = aten.reshape.default(view_2, [-1, 2, 4])
attention_default = hstu.attention.default(reshape_default, reshape_default_1, reshape_default_2, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)""")

    def test_zero_buffers_default_dtype(self):
        self.assertExpectedInline(self.graph("zero_buffers_default_dtype"), """\
view = aten.view.default(arg3_1, [17, -1])
reshape_default = aten.reshape.default(view, [-1, 2, 4])
attention_default = hstu.attention.default(arg0_1, arg2_1, reshape_default, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)""")

    def test_row_scale_b1n1(self):
        self.assertExpectedInline(self.graph("row_scale_b1n1"), """attention_default = hstu.attention.default(arg0_1, arg2_1, arg3_1, arg1_1, 8, 0.5, arg5_1, arg4_1, 0, 0, 0, True)""")

    def test_nested_masked_select(self):
        self.assertExpectedInline(self.graph("nested_masked_select"), """\
attention_default = hstu.attention.default(arg0_1, arg2_1, arg3_1, arg1_1, 8, 0.5, None, None, 0, 0, 0, True)
reshape_default = aten.reshape.default(attention_default, [-1, 8])
sym_size_int = aten.sym_size.int(attention_default, 0)
arange_start = aten.arange.start(0, sym_size_int)
searchsorted_tensor = aten.searchsorted.Tensor(arg1_1, arange_start)
sub_tensor = aten.sub.Tensor(searchsorted_tensor, 1)
index_tensor = aten.index.Tensor(arg1_1, [sub_tensor])
sub_tensor_1 = aten.sub.Tensor(arange_start, index_tensor)
mul_tensor = aten.mul.Tensor(sub_tensor, 8)
add_tensor = aten.add.Tensor(mul_tensor, sub_tensor_1)
sym_size_int_1 = aten.sym_size.int(arg1_1, 0)
sub_7 = sub(sym_size_int_1, 1)
mul_1 = mul(sub_7, 8)
new_zeros_default = aten.new_zeros.default(reshape_default, [mul_1, 8])
index_put_default = aten.index_put.default(new_zeros_default, [add_tensor], reshape_default)
reshape_default_1 = aten.reshape.default(index_put_default, [-1, 8, 8])
slice_10 = aten.slice.Tensor(arg1_1, 0, 1, 9223372036854775807)
slice_11 = aten.slice.Tensor(arg1_1, 0, 0, -1)
sub_6 = aten.sub.Tensor(slice_10, slice_11)
arange_6 = aten.arange.default(8)
unsqueeze_4 = aten.unsqueeze.default(arange_6, 0)
unsqueeze_5 = aten.unsqueeze.default(unsqueeze_4, 2)
unsqueeze_6 = aten.unsqueeze.default(sub_6, 1)
unsqueeze_7 = aten.unsqueeze.default(unsqueeze_6, 2)
lt = aten.lt.Tensor(unsqueeze_5, unsqueeze_7)
expand = aten.expand.default(lt, [5, 8, 8])""")
