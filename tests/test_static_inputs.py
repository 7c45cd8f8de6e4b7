"""The rewritten graph keeps Dynamo's input metadata: AOTAutograd marks the module's parameters as static
inputs, as it does for stock Inductor, so CUDA graphs do not copy them into their static buffers on every
replay (benchmarks/RESULTS.md, 2026-11-29 sixth session: 11 copies per replay against Inductor's 5)."""
from __future__ import annotations

import pytest
import torch

from _helpers import small_hstu_batch, small_hstu_model


def _static_inputs(backend, train: bool):
    """AOTAutograd's static input positions of the one compiled graph, read by a post-grad pass."""
    found = []

    def probe(graph):
        ctx = torch._guards.TracingContext.try_get()
        found.append(sorted(ctx.fw_metadata.static_input_indices))

    torch._dynamo.reset()
    model = small_hstu_model()
    ids, offsets, num_targets = small_hstu_batch()[:3]
    kw = {"backend": backend} if backend != "inductor" else {}
    compiled = torch.compile(model.train(train), options={"post_grad_custom_post_pass": probe}, **kw)
    with torch.set_grad_enabled(train):
        compiled(ids, offsets, num_targets)
    return found


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_parameters_stay_static_inputs(train):
    from hstu_inductor.report import collecting

    stock = _static_inputs("inductor", train)
    with collecting() as report:
        ours = _static_inputs("hstu", train)
    assert report.counts["attention"] == 1, report
    params = len(list(small_hstu_model().parameters()))
    assert stock and stock[0] and len(stock[0]) >= params, stock
    assert ours and ours[0] == stock[0], (ours, stock)


def test_table_rewrite_buffers_are_static_inputs_too():
    """A table rewrite adds a buffer of its own (the bucket bounds): it is lifted as a static input beside the
    module's parameters, which stay static."""
    import sys
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "patterns"))
    from test_attention_rab_tables import LENGTHS, TableBias, make_args
    from hstu_inductor.report import collecting

    found = []

    def probe(graph):
        found.append(sorted(torch._guards.TracingContext.try_get().fw_metadata.static_input_indices))

    torch._dynamo.reset()
    model = TableBias("original", nb=128)
    args = make_args(LENGTHS, 0, "original", requires_grad=True)
    with collecting() as report:
        torch.compile(model, backend="hstu", options={"post_grad_custom_post_pass": probe})(*args)
    assert report.counts["attention"] == 1 and all("tables:" in d for _, d in report.details), report
    # pos_w, ts_w and the bounds buffer
    assert found and len(found[0]) >= 3, found
