"""A graph whose attention candidates were all declined keeps Inductor's code for its preprocess and
output blocks too (``config.lone_blocks``): a block rewritten alone lost to Inductor's fused code in every
measured case (benchmarks/RESULTS.md, "partial rewrites"). With the attention rewritten beside them the
blocks are rewritten as before; ``lone_blocks=True`` restores the partial rewrite."""
from __future__ import annotations

import hstu_inductor
from _helpers import REWRITE_BACKEND
from test_value_prover import Reassociated, _inputs, _rel


def _explain(model):
    x, offsets = _inputs(requires_grad=False)
    report = hstu_inductor.explain(model, x, offsets, backend=REWRITE_BACKEND)
    assert _rel(report.output, model(x, offsets)) < 1e-5
    return report


def test_blocks_dropped_beside_a_declined_attention():
    report = _explain(Reassociated("off_by_one"))
    assert report.counts == {"attention": 0, "preprocess": 0, "output": 0}, report
    kinds = {k for k, r in report.near_misses if "lone_blocks" in r}
    assert kinds == {"preprocess", "output"}, report.near_misses
    with hstu_inductor.config.patch(lone_blocks=True):
        report = _explain(Reassociated("off_by_one"))
    assert report.counts == {"attention": 0, "preprocess": 1, "output": 1}, report


def test_blocks_rewritten_beside_a_rewritten_attention():
    report = _explain(Reassociated())
    assert report.counts == {"attention": 1, "preprocess": 1, "output": 1}, report
    assert not any("lone_blocks" in r for _, r in report.near_misses), report.near_misses
