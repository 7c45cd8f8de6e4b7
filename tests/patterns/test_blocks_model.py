"""The reference STU layer / HSTU model: one preprocess and one output rewrite per layer,
eager-equal in training and inference, dynamic L with at most one recompile; probe unit test."""
from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

import hstu_inductor
from hstu_inductor.patterns import blocks
from hstu_inductor.reference import HSTUModel, STULayer
from hstu_inductor.report import RewriteReport, collecting
from test_blocks_common import check_compiled, jagged_rows, rewritten, small_stu_layer
from _helpers import REWRITE_BACKEND, forward_copies_pass

E, H, DQ, DV, N = 16, 2, 4, 8, 8


def _batch(lengths, seed=0):
    return jagged_rows(lengths, E, seed)


def _layer(**kw):
    return small_stu_layer(STULayer, E, H, DQ, DV, **kw)


@pytest.mark.parametrize("kw", [{}, {"concat_ua": True}, {"concat_ua": True, "group_norm": True}, {"group_norm": True}],
                         ids=["plain", "concat_ua", "concat_ua-group_norm", "group_norm"])
def test_stu_layer_variants(kw):
    m = _layer(**kw)
    x, off = _batch([3, 5])
    rep = check_compiled(m, x, off, N, train=True, counts={"preprocess": 1, "output": 1})
    assert [k for k, _ in rep.near_misses if k in ("preprocess", "output")] == []
    m.eval()
    check_compiled(m, *_batch([4, 2], seed=1), N, train=False, counts={"preprocess": 1, "output": 1})


class TestReferenceModel(TestCase):

    def test_stu_layer_training_dropout_is_rewritten(self):
        """Output dropout in training becomes the op's seeded dropout (its values and gradients are
        checked in test_blocks_output.TestOutputTrainingDropout); eval mode stays eager-equal."""
        m = _layer(dropout_ratio=0.2)
        graphs, rep = rewritten(m, *_batch([3, 5]), N)
        self.assertEqual((rep.counts["preprocess"], rep.counts["output"]), (1, 1), rep.near_misses)
        self.assertTrue(any("dropout(train, p=0.2)" in d for k, d in rep.details if k == "output"))
        x, off = _batch([3, 5])
        torch._dynamo.reset()
        cm = torch.compile(m, backend=REWRITE_BACKEND)
        torch.manual_seed(3)
        a = cm(x, off, N)
        torch.manual_seed(3)
        self.assertTrue(torch.equal(a, cm(x, off, N)))
        m.eval()
        check_compiled(m, *_batch([3, 5]), N, train=False, counts={"preprocess": 1, "output": 1})

    def test_hstu_model_counts_per_layer(self):
        torch.manual_seed(0)
        model = HSTUModel(50, N, embedding_dim=E, num_layers=3, num_heads=H, attn_dim=DQ, hidden_dim=DV)
        ids, off = torch.randint(0, 50, (9,)), torch.tensor([0, 4, 9])
        rep = hstu_inductor.explain(model, ids, off, backend=REWRITE_BACKEND)
        self.assertEqual((rep.counts["preprocess"], rep.counts["output"]), (3, 3), str(rep))
        torch.testing.assert_close(rep.output, model(ids, off), rtol=1e-4, atol=1e-4)
        check_compiled(model, ids, off, train=True, counts={"preprocess": 3, "output": 3})

    def test_dynamic_length_one_recompile(self):
        m = _layer(concat_ua=True)
        torch._dynamo.reset()
        compiled = torch.compile(m, backend=REWRITE_BACKEND)
        with collecting() as rep:
            for i, lengths in enumerate(([3, 4], [5, 6], [2, 7], [8, 1])):
                x, off = _batch(lengths, seed=i)
                x.requires_grad_()
                out = compiled(x, off, N)
                (g,) = torch.autograd.grad(out.sum(), x)
                x2 = x.detach().clone().requires_grad_()
                want = m(x2, off, N)
                (g2,) = torch.autograd.grad(want.sum(), x2)
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(g, g2, rtol=1e-3, atol=1e-3)
        self.assertLessEqual(rep.graphs, 2)  # first compile + at most one dynamic recompile
        self.assertEqual(rep.counts["preprocess"], rep.graphs)
        self.assertEqual(rep.counts["output"], rep.graphs)


class TestNoCopiesBeforeAttention(TestCase):
    """v, q, k reach the attention as views of the projection: Inductor's forward graph (post-grad, where
    the ops' bodies are inlined) copies none of them. They used to be the op's contiguous clones, one
    copy kernel each (issue 22 item 6)."""

    def test_stu_layer(self):
        for mode in ("save", "recompute"):
            with self.subTest(mode=mode), hstu_inductor.config.patch(block_backward=mode):
                found = []
                m = _layer()
                x, off = _batch([3, 5], seed=4)
                x.requires_grad_()
                torch._dynamo.reset()
                inspect = forward_copies_pass(2 * H * (DQ + DV), found)
                compiled = torch.compile(m, backend="hstu", options={"post_grad_custom_post_pass": inspect})
                with collecting() as rep:
                    out = compiled(x, off, N)
                self.assertEqual((rep.counts["preprocess"], rep.counts["attention"]), (1, 1), str(rep))
                self.assertEqual(len(found), 1)
                copies, views = found[0]
                self.assertEqual(copies, [])
                self.assertTrue(any(v.target is torch.ops.aten.slice.Tensor for v in views), views)
                (gx,) = torch.autograd.grad(out.sum(), x)
                x2 = x.detach().clone().requires_grad_()
                want = m(x2, off, N)
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(gx, torch.autograd.grad(want.sum(), x2)[0], rtol=1e-3, atol=1e-3)


class TestProbe(TestCase):
    def test_probe_rejects_a_wrong_constant(self):
        """The numeric probe catches a structurally plausible but wrong reading (eps 1e-1 vs 1e-5)."""
        import torch.nn.functional as F
        from hstu_inductor import _compat

        def f(x, w):
            return F.layer_norm(x, (E,), eps=1e-5) @ w.t()

        gm = _compat.trace_aten(f, (torch.randn(5, E), torch.randn(12, E)))
        nodes = {n.name: n for n in gm.graph.nodes}
        x, w, mm = nodes["x_1"], nodes["w_1"], nodes["mm"]

        def op(eps):
            return lambda x_, w_: [F.linear(F.layer_norm(x_, (E,), eps=eps), w_)]

        self.assertIsNone(blocks._probe([x, w], {x}, [mm], op(1e-5), 5))
        self.assertIn("differs from the hstu op", blocks._probe([x, w], {x}, [mm], op(1e-1), 5))

    def test_report_type(self):
        self.assertIsInstance(RewriteReport(), RewriteReport)


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
