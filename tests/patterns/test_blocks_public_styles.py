"""STU stacks written like generative-recommenders' and TorchEasyRec's plain-PyTorch paths
(``public_style_models.py``): every layer gets its three rewrites (attention, preprocess, output),
and the compiled stack equals eager in fp32 on the CPU, outputs and every gradient."""
from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

pytest.importorskip("fbgemm_gpu")  # the public code pads with fbgemm's jagged ops

from public_style_models import PublicStyleStack  # noqa: E402
from test_blocks_common import check_compiled, rewritten  # noqa: E402

from hstu_inductor.patterns import rewrite_dynamo_graph  # noqa: E402
from _helpers import REWRITE_BACKEND

E, H, DQ, DV, N, LAYERS = 16, 2, 4, 8, 8, 2


def _batch(seed=0, lengths=(3, 8, 6)):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    L = sum(lengths)
    targets = torch.tensor([1, 2, 0][:len(lengths)])
    scale = torch.rand(L, generator=g) * 0.5 + 0.1  # per-row attn_scale [L]
    return torch.randn(L, E, generator=g), offsets, targets, scale


def _stack(**kw):
    torch.manual_seed(0)
    return PublicStyleStack(LAYERS, E, H, DQ, DV, **kw)


EVERY_LAYER = {"attention": LAYERS, "preprocess": LAYERS, "output": LAYERS}
_OP_KIND = {"attention": "attention", "stu_preprocess": "preprocess", "stu_output": "output"}


def executed_rewrites(fn, *args):
    """How many hstu ops of each kind one call of ``fn`` runs once compiled: the rewritten nodes of
    every Dynamo graph times the number of times that graph runs. Unlike ``explain``'s counts (one
    per compiled graph), a graph that Dynamo compiles once and reuses for several layers counts
    once per layer. The original graphs run (eager-equal); only the rewrites are counted."""
    runs = {k: 0 for k in EVERY_LAYER}

    def backend(gm, example_inputs, **_):
        new = rewrite_dynamo_graph(gm)
        kinds = [_OP_KIND[n.target._opname.replace("_save", "")] for n in (new.graph.nodes if new else ())
                 if n.op == "call_function" and getattr(n.target, "namespace", None) == "hstu"
                 and n.target._opname.replace("_save", "") in _OP_KIND]

        def run(*a):
            for k in kinds:
                runs[k] += 1
            return gm.forward(*a)
        return run

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return runs

# (model options, uses num_targets, uses a per-row attn_scale)
CONFIGS = {
    "gr_targets_rowscale_window_context": (dict(style="gr", max_attn_len=3, contextual=2), True, True),
    "gr_groupnorm_no_concat_no_targets_rowscale": (dict(style="gr", group_norm=True, concat=False,
                                                        target_aware=False), False, True),
    "tzrec_targets_groupnorm_window_late_silu": (dict(style="tzrec", group_norm=True, max_attn_len=4,
                                                      late_silu=True), True, False),
}


class TestPublicStyles(TestCase):
    def _check(self, name, train):
        kw, use_targets, use_scale = CONFIGS[name]
        x, off, targets, scale = _batch()
        rep = check_compiled(_stack(**kw), x, off, N, targets if use_targets else None,
                             scale if use_scale else None, train=train, counts=EVERY_LAYER)
        self.assertEqual(rep.near_misses, [])

    def test_training_every_layer_rewritten_and_eager_equal(self):
        # F.dropout(y, p=0.0, training=True) in every layer
        for name in CONFIGS:
            with self.subTest(name):
                self._check(name, train=True)

    def test_inference(self):
        self._check("gr_targets_rowscale_window_context", train=False)

    def test_bf16_fp32_upcasts(self):
        """bf16 model: ``.to(float32)`` around both norms and the fp32 ``y`` cast down before
        ``addmm`` are rewritten too; the result is within bf16 rounding of eager."""
        m = _stack(style="gr", group_norm=True).to(torch.bfloat16)
        x, off, targets, scale = _batch()
        x, scale = x.to(torch.bfloat16), scale.to(torch.bfloat16)
        graphs, rep = rewritten(m, x, off, N, targets, scale)
        self.assertEqual(dict(rep.counts), EVERY_LAYER, rep.near_misses)
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(m, backend=REWRITE_BACKEND)(x, off, N, targets, scale).double()
            want = m(x, off, N, targets, scale).double()
        self.assertLess(((got - want).norm() / want.norm()).item(), 2e-2)

    def test_graph_break_in_every_layer(self):
        """Unpad with ``torch.nested.masked_select`` (a graph break in every layer): every layer
        still runs its three rewritten ops. (Dynamo compiles some frames once and reuses them for
        both layers, so ``explain`` counts fewer compiled rewrites than layers.)"""
        x, off, targets, _ = _batch()
        m = _stack(style="gr", masked_select=True)
        self.assertEqual(executed_rewrites(m, x, off, N, targets), EVERY_LAYER)
        check_compiled(m, x, off, N, targets, train=True)

    def test_near_miss_twin_targets_see_each_other(self):
        """The GR mask with ``dist >= 0`` instead of ``eye | dist > 0``: targets (which share the
        clamped id) attend to each other. Attention is left alone and reported in every layer; the
        blocks around it are left to Inductor too (``config.lone_blocks``), or rewritten with it on;
        eager-equal."""
        import hstu_inductor

        x, off, targets, _ = _batch()
        rep = check_compiled(_stack(style="gr", targets_see_each_other=True), x, off, N, targets, train=False,
                             counts={"attention": 0, "preprocess": 0, "output": 0})
        reasons = [r for k, r in rep.near_misses if k == "attention"]
        self.assertEqual(len(reasons), LAYERS, rep.near_misses)
        self.assertTrue(all("mask" in r for r in reasons), reasons)
        with hstu_inductor.config.patch(lone_blocks=True):
            check_compiled(_stack(style="gr", targets_see_each_other=True), x, off, N, targets, train=False,
                           counts={"attention": 0, "preprocess": LAYERS, "output": LAYERS})

    def test_training_dropout_becomes_the_ops_dropout(self):
        """``F.dropout(y, p=0.2, training=True)`` before ``addmm(x, y, W)``: fused (the op's own
        seeded dropout)."""
        m = _stack(style="gr", dropout=0.2)
        x, off, targets, _ = _batch()
        graphs, rep = rewritten(m, x, off, N, targets)
        self.assertEqual(dict(rep.counts), EVERY_LAYER, rep.near_misses)
        self.assertTrue(all("dropout(train, p=0.2)" in d for k, d in rep.details if k == "output"))
        # the op's dropout itself (values, mask, gradients): test_blocks_output.TestOutputTrainingDropout


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
