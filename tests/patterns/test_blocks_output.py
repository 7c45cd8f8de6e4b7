"""output: x + projection(u * Norm(attn) [cat u, attn]) (eval dropout)  =>  hstu.stu_output."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from expecttest import TestCase
from torch import nn

import hstu_inductor  # noqa: F401
from hstu_inductor import reference
from test_blocks_common import assert_near_miss, check_compiled, rewritten, summary
from _helpers import REWRITE_BACKEND

E, H, DV, L = 16, 2, 4, 7
C = H * DV


def _inputs(rows=L, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, d, generator=g).to(dtype) for d in (C, C, E))  # attn, u, x


def _rand(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.5)


class RefOutput(nn.Module):
    """The reference spelling (hstu_inductor.reference.stu_output)."""

    def __init__(self, concat_ua=False, group_norm=False, dropout_ratio=0.0):
        super().__init__()
        self.kw = dict(concat_ua=concat_ua, group_norm=group_norm, dropout_ratio=dropout_ratio)
        self.nw, self.nb = _rand(C), _rand(C)
        self.w, self.b = _rand(E, C * (3 if concat_ua else 1)), _rand(E)

    def forward(self, attn, u, x):
        return reference.stu_output(attn, u, x, self.nw, self.nb, self.w, self.b, H, training=self.training,
                                    **self.kw)


class NormFirstMatmulResidualRight(nn.Module):
    """nn.LayerNorm(attn) * u, ``y @ W`` (no bias, matmul layout), ``proj + x``."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(C, eps=1e-3)
        self.w = _rand(C, E)

    def forward(self, attn, u, x):
        return (self.norm(attn) * u) @ self.w + x


class ModulesDropoutEval(nn.Module):
    """nn.GroupNorm-free spelling with nn.Dropout (eval) and nn.Linear."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(C, elementwise_affine=False)
        self.drop = nn.Dropout(0.3)
        self.proj = nn.Linear(C, E)

    def forward(self, attn, u, x):
        return x + self.proj(self.drop(u * self.norm(attn)))


class BiasAddedAfterResidual(nn.Module):
    """``x + y @ W + b``: the residual add is fused with bias=None; ``+ b`` stays the user's op."""

    def __init__(self):
        super().__init__()
        self.w, self.b = _rand(C, E), _rand(E)

    def forward(self, attn, u, x):
        return x + u * F.layer_norm(attn, (C,)) @ self.w + self.b


class TestOutputSpellings(TestCase):
    def _graph(self, m, *args, spelling=None):
        graphs, report = rewritten(m, *args)
        self.assertEqual(report.counts["output"], 1, str(report))
        if spelling is not None:
            self.assertEqual([d for k, d in report.details if k == "output"], [spelling])
        return summary(graphs[0])

    def _numerics(self, m, train_ok=True):
        if train_ok:
            check_compiled(m, *_inputs(), train=True, counts={"output": 1})
        m.eval()
        check_compiled(m, *_inputs(seed=1), train=False, counts={"output": 1})

    def test_reference_layer_norm(self):
        m = RefOutput()
        self.assertExpectedInline(self._graph(m, *_inputs(), spelling="u*layer_norm(attn) -> linear+bias -> + x"),
                                  """\
stu_output_save_default = hstu.stu_output_save(arg4_1, arg5_1, arg6_1, arg0_1, arg1_1, 1e-06, 0, arg2_1, arg3_1, False)
getitem_3 = getitem(stu_output_save_default, 0)""")
        self._numerics(m)

    def test_reference_group_norm_concat(self):
        m = RefOutput(concat_ua=True, group_norm=True)
        self.assertExpectedInline(self._graph(m, *_inputs(),
                                              spelling="cat[u, attn, u*group_norm(attn)] -> linear+bias -> + x"),
                                  """\
stu_output_save_default = hstu.stu_output_save(arg4_1, arg5_1, arg6_1, arg0_1, arg1_1, 1e-06, 2, arg2_1, arg3_1, True)
getitem_3 = getitem(stu_output_save_default, 0)""")
        self._numerics(m)

    def test_reference_dropout_in_eval(self):
        m = RefOutput(dropout_ratio=0.2).eval()
        self._graph(m, *_inputs())
        self._numerics(m, train_ok=False)

    def test_dropout_p0_in_training(self):
        self._numerics(RefOutput(dropout_ratio=0.0).train())

    def test_norm_first_matmul_residual_right(self):
        m = NormFirstMatmulResidualRight()
        self.assertExpectedInline(self._graph(m, *_inputs(), spelling="layer_norm(attn)*u -> matmul -> + x"),
                                  """\
t_default = t(arg4_1)
stu_output_save_default = hstu.stu_output_save(arg2_1, arg3_1, arg5_1, arg0_1, arg1_1, 0.001, 0, t_default, None, False)
getitem_3 = getitem(stu_output_save_default, 0)""")
        self._numerics(m)

    def test_modules_dropout_eval(self):
        m = ModulesDropoutEval().eval()
        self.assertExpectedInline(self._graph(m, *_inputs()), """\
stu_output_save_default = hstu.stu_output_save(arg0_1, arg1_1, arg4_1, None, None, 1e-05, 0, arg2_1, arg3_1, False)
getitem_3 = getitem(stu_output_save_default, 0)""")
        check_compiled(m, *_inputs(), train=True, counts={"output": 1})  # eval mode, grads still flow

    def test_bias_added_after_residual(self):
        m = BiasAddedAfterResidual()
        self.assertExpectedInline(self._graph(m, *_inputs(), spelling="u*layer_norm(attn) -> matmul -> + x"),
                                  """\
t_default = t(arg2_1)
stu_output_save_default = hstu.stu_output_save(arg0_1, arg1_1, arg3_1, None, None, 1e-05, 0, t_default, None, False)
getitem_3 = getitem(stu_output_save_default, 0)
add_1 = add.Tensor(getitem_3, arg4_1)""")
        self._numerics(m)

    def test_bf16_upcast(self):
        m = RefOutput().to(torch.bfloat16)
        ins = _inputs(dtype=torch.bfloat16)
        self._graph(m, *ins, spelling="u*layer_norm(fp32)(attn) -> linear+bias -> + x")
        check_compiled(m, *ins, train=True, rtol=2e-2, grad_rtol=5e-2, counts={"output": 1})


# ---------------------------------------------------------------------------------------------
# near misses
# ---------------------------------------------------------------------------------------------
class Variant(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.ln = nn.LayerNorm(C)
        self.rms = nn.RMSNorm(C)
        self.head_ln = nn.LayerNorm(DV)
        self.proj = nn.Linear(C * (3 if kind == "concat_order" else 1), E)

    def forward(self, attn, u, x):
        k = self.kind
        if k == "no_u":
            y = self.ln(attn)
        elif k == "rms":
            y = u * self.rms(attn)
        elif k == "per_head_ln":
            y = u * self.head_ln(attn.view(-1, H, DV)).view(-1, C)
        elif k == "broadcast_u":
            y = u[:, :1] * self.ln(attn)
        elif k == "concat_order":
            y = torch.cat([attn, u, u * self.ln(attn)], dim=-1)
        elif k == "double_dropout":
            y = F.dropout(F.dropout(u * self.ln(attn), p=0.1, training=True), p=0.2, training=True)
        out = x + self.proj(y)
        return out


class TestOutputNearMisses(TestCase):
    def test_norm_without_u(self):
        assert_near_miss(Variant("no_u"), *_inputs(), kind="output", contains="without the u multiply")

    def test_rms_norm(self):
        assert_near_miss(Variant("rms"), *_inputs(), kind="output", contains="neither factor")

    def test_per_head_layer_norm(self):
        assert_near_miss(Variant("per_head_ln"), *_inputs(), kind="output", contains="neither factor")

    def test_broadcast_u(self):
        assert_near_miss(Variant("broadcast_u"), *_inputs(), kind="output", contains="does not match attn")

    def test_concat_order(self):
        assert_near_miss(Variant("concat_order"), *_inputs(), kind="output", contains="concat is not [u, attn")

    def test_two_training_dropouts(self):
        """Not one dropout of the op's kind: left alone (too far from the norm to be reported)."""
        torch.manual_seed(0)
        graphs, report = rewritten(Variant("double_dropout"), *_inputs())
        self.assertEqual(report.counts["output"], 0)
        self.assertIsNone(graphs[0])


class TestOutputBackwardModes(TestCase):
    """``config.block_backward``: "save" (default, the spelling tests above) emits
    ``stu_output_save`` (the backward reads the forward's projection input and statistics);
    "recompute" emits ``stu_output``. Both equal eager."""

    def test_recompute_mode_graph_and_results(self):
        for m in (RefOutput(), RefOutput(concat_ua=True, group_norm=True)):
            with hstu_inductor.config.patch(block_backward="recompute"):
                graphs, report = rewritten(m, *_inputs())
                self.assertEqual(report.counts["output"], 1, str(report))
                g = summary(graphs[0])
                self.assertIn("= hstu.stu_output(arg", g)
                self.assertNotIn("stu_output_save", g)
                check_compiled(m, *_inputs(seed=2), train=True, counts={"output": 1})
                m.eval()
                check_compiled(m, *_inputs(seed=3), train=False, counts={"output": 1})


class TestOutputTrainingDropout(TestCase):
    """``F.dropout(u * LN(attn), p, training=True)`` before the projection becomes the op's own
    dropout: same distribution, its own RNG stream (as with stock Inductor), seeded from torch's
    generator. Eager equality is impossible for a random mask, so the test recovers the mask the
    compiled code used (square invertible projection, fp64) and checks the values it kept, the
    keep rate, reproducibility under a seed, and every gradient against eager with that mask."""

    class Square(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(C)
            self.proj = nn.Linear(C, C)  # square: the dropped projection input can be solved for

        def forward(self, attn, u, x):
            return x + self.proj(F.dropout(u * self.ln(attn), p=0.3, training=True))

    def _model(self):
        torch.manual_seed(0)
        m = self.Square().double()
        with torch.no_grad():
            m.proj.weight.add_(torch.eye(C, dtype=torch.float64) * 2)  # well conditioned
            m.ln.weight.add_(torch.randn(C, dtype=torch.float64) * 0.3)
        return m

    @staticmethod
    def _inputs(rows, seed=0):
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(rows, C, generator=g, dtype=torch.float64) for _ in range(3))

    def test_rewritten_graph(self):
        graphs, report = rewritten(self._model(), *self._inputs(5))
        self.assertEqual(report.counts["output"], 1, report.near_misses)
        self.assertIn("dropout(train, p=0.3)", report.details[0][1])
        self.assertExpectedInline(summary(graphs[0]), """\
randint_low = randint.low(-4611686018427387904, 4611686018427387904, [], dtype=torch.int64, device=device(type='cpu'))
stu_output_save_default = hstu.stu_output_save(arg2_1, arg3_1, arg6_1, arg0_1, arg1_1, 1e-05, 0, arg4_1, arg5_1, False, 0.3, randint_low)
getitem_5 = getitem(stu_output_save_default, 0)""")

    def test_mask_values_and_gradients(self):
        self._check_mask_values_and_gradients()

    def test_mask_values_and_gradients_recompute_mode(self):
        # block_backward="recompute": the backward regenerates the dropped y from the seed
        with hstu_inductor.config.patch(block_backward="recompute"):
            graphs, report = rewritten(self._model(), *self._inputs(5))
            self.assertIn("= hstu.stu_output(", summary(graphs[0]))
            self._check_mask_values_and_gradients()

    def _check_mask_values_and_gradients(self):
        p, rows = 0.3, 64
        m = self._model()
        attn, u, x = (t.requires_grad_() for t in self._inputs(rows, seed=3))
        torch._dynamo.reset()
        cm = torch.compile(m, backend=REWRITE_BACKEND)
        torch.manual_seed(11)
        out = cm(attn, u, x)
        torch.manual_seed(11)
        self.assertTrue(torch.equal(out, cm(attn, u, x)))          # reproducible under a seed
        torch.manual_seed(12)
        self.assertFalse(torch.equal(out, cm(attn, u, x)))         # and seed-dependent
        W, b = m.proj.weight.detach(), m.proj.bias.detach()
        dropped = torch.linalg.solve(W, (out.detach() - x.detach() - b).T).T
        y = (u * m.ln(attn)).detach()
        keep = dropped.abs() > 1e-9
        n, kept = keep.numel(), int(keep.sum())
        self.assertLess(abs(kept - n * (1 - p)), 4 * (n * p * (1 - p)) ** 0.5)
        torch.testing.assert_close(dropped[keep], (y / (1 - p))[keep], rtol=1e-9, atol=1e-9)
        self.assertTrue(bool((y[~keep].abs() > 1e-9).all()))        # zeros come from the mask only
        # gradients: compiled backward against eager with the recovered mask
        grad = torch.randn_like(out)
        params = [attn, u, x, *m.parameters()]
        got = torch.autograd.grad(out, params, grad)
        ref = x + m.proj(keep.to(y.dtype) * (u * m.ln(attn)) / (1 - p))
        want = torch.autograd.grad(ref, params, grad)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, rtol=1e-7, atol=1e-9)


class MutatesUAfterMul(nn.Module):
    """``u`` is modified in place after ``u * LN(a)``: fusing at the residual add would read the
    modified ``u``."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C)
        self.proj = nn.Linear(C, E)

    def forward(self, attn, u, x):
        u = u.clone()
        y = u * self.ln(attn)
        u.add_(1.0)
        return x + self.proj(y), u


class TestOutputMutation(TestCase):
    def test_in_place_between_mul_and_residual(self):
        # read functionalised, the add after the product is another tensor: the block reads the old u
        check_compiled(MutatesUAfterMul(), *_inputs(), train=False, counts={"output": 1})  # eager autograd rejects the write


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
