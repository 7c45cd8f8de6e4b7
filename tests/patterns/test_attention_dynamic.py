"""Dynamic shapes: L and B vary between calls; at most one recompile, and the rewrite fires on
the dynamic graph (inference and training)."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from hstu_inductor.report import collecting

from test_attention_helpers import grad_leaves, spelling_inputs
from _helpers import REWRITE_BACKEND

CALLS = [(5, 0, 8, 3), (2, 7, 1), (8, 8, 4, 6, 1), (3, 3)]


CASES = [(name, mode) for name in ("reference", "matmul_index_copy_where", "contextual_window",
                                   "lengths_pad_cumsum_mask") for mode in ("automatic", "mark_dynamic")]
# sliced uvqk pad, row scale after P @ V (one mode each keeps the suite short)
CASES += [("uvqk_split_padded", "automatic"), ("row_scale_after_pv", "mark_dynamic")]


@pytest.mark.parametrize("name,mode", CASES)
def test_dynamic_batch_and_length(name, mode, fresh_dynamo):
    counter = CompileCounterWithBackend(REWRITE_BACKEND)
    compiled = None
    rewrites = []
    for i, lengths in enumerate(CALLS):
        fn, args = spelling_inputs(name, lengths, requires_grad=True, seed=10 + i)
        _, args_e = spelling_inputs(name, lengths, requires_grad=True, seed=10 + i)
        if compiled is None:
            compiled = torch.compile(fn, backend=counter)
        if mode == "mark_dynamic":
            for a in args:
                if isinstance(a, torch.Tensor):
                    torch._dynamo.mark_dynamic(a, 0)
        with collecting() as report:
            out = compiled(*args)
        rewrites.append(report.counts["attention"])
        ref = fn(*args_e)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        g = torch.randn_like(ref)
        got = torch.autograd.grad(out, grad_leaves(args), g)
        want = torch.autograd.grad(ref, grad_leaves(args_e), g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert counter.frame_count <= 2, counter.frame_count
    # every compiled frame was rewritten (the dynamic one included)
    assert sum(rewrites) == counter.frame_count, rewrites
