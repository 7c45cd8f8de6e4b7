"""Output-block spelling families met in public code, each with its near-miss twin:
the residual as ``addmm``'s input (``addmm(x, y, W)``, bias folded into the residual or added
after) or ``baddbmm``'s (one batch), per-head group norm on a ``[L, H, Dv]`` view with ``[H]`` parameters, ``silu(u)`` computed
inside the output block, and ``y`` computed in fp32 from upcast ``attn``/``u`` and cast down once
before the projection (bf16)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from expecttest import TestCase
from torch import nn

from test_blocks_common import assert_near_miss, check_compiled, rewritten

E, H, DV, L = 16, 2, 4, 7
C = H * DV


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(L, d, generator=g).to(dtype) for d in (C, C, E))  # attn, u, x


def _p(*shape, base=0.0):
    return nn.Parameter(base + torch.randn(*shape) * 0.4)


class Family(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        per_head = kind in ("gn_view", "gn_view_concat", "gn_transposed")
        self.nw, self.nb = _p(H if per_head else C, base=1.0), _p(H if per_head else C)
        self.w = _p(C * (3 if kind in ("gn_view_concat", "fp32_concat") else 1), E)  # [K, E]
        self.b = _p(E)

    def _ln(self, a):
        return F.layer_norm(a, (C,), self.nw, self.nb, 1e-6)

    def forward(self, attn, u, x):
        k = self.kind
        if k == "addmm_residual":
            return torch.addmm(x, u * self._ln(attn), self.w)
        if k == "bias_into_residual":
            return torch.addmm(x + self.b, self._ln(attn) * u, self.w)
        if k == "bias_after_addmm":
            return torch.addmm(x, u * self._ln(attn), self.w) + self.b
        if k in ("baddbmm_residual", "baddbmm_scaled"):
            y = u * self._ln(attn)
            alpha = 2.0 if k == "baddbmm_scaled" else 1.0
            return torch.baddbmm(x.unsqueeze(0), y.unsqueeze(0), self.w.unsqueeze(0), alpha=alpha).squeeze(0)
        if k == "late_silu":  # silu(u) first computed here, not after the split
            return torch.addmm(x, F.silu(u) * self._ln(attn), self.w)
        if k in ("gn_view", "gn_view_concat"):
            normed = F.group_norm(attn.view(-1, H, DV), H, self.nw, self.nb, 1e-6).view(-1, C)
            y = u * normed
            if k == "gn_view_concat":
                y = torch.cat([u, attn, y], dim=1)
            return torch.addmm(x, y, self.w)
        if k in ("fp32", "fp32_concat", "fp32_u_scaled"):
            dt = x.dtype
            a32, u32 = attn.to(torch.float32), u.to(torch.float32)
            if k == "fp32_u_scaled":
                u32 = u32 * 2.0
            y = u32 * F.layer_norm(a32, (C,), self.nw.to(torch.float32), self.nb.to(torch.float32), 1e-6)
            if k == "fp32_concat":
                y = torch.cat([u32, a32, y], dim=1)
            y = F.dropout(y, p=0.0, training=self.training).to(dt)
            return torch.addmm(x, y, self.w.to(dt)).to(dt)
        if k in ("dropout_after_projection", "dropout_after_projection_train"):
            drop = F.dropout(F.linear(u * self._ln(attn), self.w.t(), self.b), p=0.1,
                             training=k.endswith("_train"))
            return x + drop
        if k == "hand_written_ln":  # (a - mean) / sqrt(mean((a - mean)^2) + eps) * w + b
            mean = attn.mean(-1, keepdim=True)
            normed = (attn - mean) / torch.sqrt(((attn - mean) ** 2).mean(-1, keepdim=True) + 1e-6) * self.nw + self.nb
            return x + F.linear(u * normed, self.w.t())
        if k == "addmm_scaled":
            return torch.addmm(x, u * self._ln(attn), self.w, beta=0.5)
        if k == "gn_transposed":  # groups of strided elements: not contiguous channel groups
            normed = F.group_norm(attn.view(-1, H, DV).transpose(1, 2), DV, self.nw.repeat(2), self.nb.repeat(2),
                                  1e-6)
            return torch.addmm(x, u * normed.reshape(-1, C), self.w)
        raise ValueError(k)


def _family(kind, dtype=torch.float32):
    torch.manual_seed(0)
    return Family(kind).to(dtype)


class TestOutputFamilies(TestCase):
    def _spelling(self, kind, *args):
        _, report = rewritten(_family(kind), *(args or _inputs()))
        self.assertEqual(report.counts["output"], 1, str(report))
        return [d for k, d in report.details if k == "output"][0]

    def test_residual_as_addmm_input(self):
        for kind in ("addmm_residual", "bias_into_residual", "bias_after_addmm"):
            with self.subTest(kind):
                self.assertTrue(self._spelling(kind).endswith("-> addmm(x, y, W)"))
                check_compiled(_family(kind), *_inputs(), train=True, counts={"output": 1})

    def test_residual_as_baddbmm_input(self):
        self.assertTrue(self._spelling("baddbmm_residual").endswith("-> baddbmm(x, y, W)"))
        check_compiled(_family("baddbmm_residual"), *_inputs(), train=True, counts={"output": 1})

    def test_silu_of_u_inside_the_output_block(self):
        check_compiled(_family("late_silu"), *_inputs(), train=True, counts={"output": 1})

    def test_per_head_group_norm_on_a_view(self):
        """``group_norm(attn.view(-1, H, Dv), H, w[H], b[H])``: the op's group norm with ``H``
        groups and every parameter repeated over its head's ``Dv`` channels."""
        self.assertEqual(self._spelling("gn_view"), "u*group_norm(view, params x4)(attn) -> addmm(x, y, W)")
        for kind in ("gn_view", "gn_view_concat"):
            with self.subTest(kind):
                check_compiled(_family(kind), *_inputs(), train=True, counts={"output": 1})

    def test_layer_norm_by_hand(self):
        self.assertEqual(self._spelling("hand_written_ln"), "u*layer_norm(hand-written)(attn) -> linear -> + x")
        check_compiled(_family("hand_written_ln"), *_inputs(), train=True, counts={"output": 1})

    def test_eval_dropout_after_the_projection(self):
        """``x + dropout(out(y))`` in eval mode: the dropout is the identity, the residual adds the projection."""
        check_compiled(_family("dropout_after_projection"), *_inputs(), train=False, counts={"output": 1})

    def test_fp32_region_cast_down_before_the_projection(self):
        ins = _inputs(dtype=torch.bfloat16)
        _, report = rewritten(_family("fp32_concat", torch.bfloat16), *ins)
        self.assertEqual([d for k, d in report.details if k == "output"],
                         ["cat[u, attn, u*layer_norm(fp32)(attn)] -> to(torch.bfloat16) -> dropout(eval)/clone "
                          "-> addmm(x, y, W)"])
        for kind in ("fp32", "fp32_concat"):
            with self.subTest(kind):
                check_compiled(_family(kind, torch.bfloat16), *ins, train=True, rtol=2e-2, grad_rtol=5e-2,
                               counts={"output": 1})
                check_compiled(_family(kind), *_inputs(), train=True, counts={"output": 1})  # fp32: no casts


class TestOutputFamilyNearMisses(TestCase):
    def test_addmm_with_beta(self):
        assert_near_miss(_family("addmm_scaled"), *_inputs(), kind="output", contains="beta/alpha")

    def test_baddbmm_with_alpha(self):
        assert_near_miss(_family("baddbmm_scaled"), *_inputs(), kind="output", contains="beta/alpha")

    def test_group_norm_on_a_transposed_view(self):
        assert_near_miss(_family("gn_transposed"), *_inputs(), kind="output",
                         contains="group norm on a view is not")

    def test_training_dropout_after_the_projection(self):
        """Random, so not compared with eager: only the decision and its reason."""
        _, report = rewritten(_family("dropout_after_projection_train"), *_inputs())
        self.assertEqual(report.counts["output"], 0, str(report))
        self.assertTrue(any("training dropout after the projection" in r for k, r in report.near_misses
                            if k == "output"), report.near_misses)

    def test_fp32_region_with_u_scaled(self):
        assert_near_miss(_family("fp32_u_scaled", torch.bfloat16), *_inputs(dtype=torch.bfloat16), kind="output",
                         contains="u is not an upcast")


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()


class TestNeverSilent(TestCase):
    """Every LayerNorm feeding a projection and every ``u * Norm(attn)`` that is not rewritten is
    reported (explain is never silent about a candidate it examined)."""

    def test_layer_norm_projection_not_split(self):
        lin = nn.Linear(E, 3 * E)

        def f(x):  # LN -> projection -> split in 3: not a preprocess block
            a, b, c = lin(F.layer_norm(x, (E,))).chunk(3, dim=-1)
            return a * b + c

        x = _inputs()[2]
        assert_near_miss(f, x, kind="preprocess", contains="is not split into four chunks")

    def test_product_without_projection(self):
        ln = nn.LayerNorm(C)

        def f(attn, u, x):  # u * Norm(attn), summed instead of projected
            return (u * ln(attn)).sum(-1, keepdim=True) + x

        assert_near_miss(f, *_inputs(), kind="output", contains="does not feed a projection with a residual")
