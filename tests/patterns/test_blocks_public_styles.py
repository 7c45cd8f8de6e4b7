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

# (model options, uses num_targets, uses a per-row attn_scale)
CONFIGS = {
    "gr_targets_rowscale_window_context": (dict(style="gr", max_attn_len=3, contextual=2), True, True),
    "gr_groupnorm_no_concat": (dict(style="gr", group_norm=True, concat=False), False, False),
    "gr_no_targets_rowscale": (dict(style="gr", target_aware=False), False, True),
    "tzrec_targets_groupnorm": (dict(style="tzrec", group_norm=True), True, False),
    "tzrec_window": (dict(style="tzrec", max_attn_len=4), True, False),
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
        for name in ("gr_targets_rowscale_window_context", "tzrec_targets_groupnorm"):
            with self.subTest(name):
                self._check(name, train=False)

    def test_training_dropout_becomes_the_ops_dropout(self):
        """``F.dropout(y, p=0.2, training=True)`` before ``addmm(x, y, W)``: fused (the op's own
        seeded dropout, reproducible under manual_seed); eval mode stays eager-equal."""
        m = _stack(style="gr", dropout=0.2)
        x, off, targets, _ = _batch()
        graphs, rep = rewritten(m, x, off, N, targets)
        self.assertEqual(dict(rep.counts), EVERY_LAYER, rep.near_misses)
        self.assertTrue(all("dropout(train, p=0.2)" in d for k, d in rep.details if k == "output"))
        torch._dynamo.reset()
        cm = torch.compile(m, backend="hstu")
        torch.manual_seed(3)
        a = cm(x, off, N, targets)
        torch.manual_seed(3)
        self.assertTrue(torch.equal(a, cm(x, off, N, targets)))
        m.eval()
        check_compiled(m, x, off, N, targets, train=False, counts=EVERY_LAYER)


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
