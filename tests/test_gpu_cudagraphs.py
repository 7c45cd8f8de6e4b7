"""CUDA graphs under ``mode="reduce-overhead"``: a rewritten graph must not be run without them.

On torch 2.11 the TTIR mutation analysis of ``wrap_triton`` kernels reported the jagged offsets as
mutated (the kernels compute store addresses from ``offsets[b]``), so functionalization wrote the
graph input back and Inductor skipped CUDA graphs for every graph with a rewritten attention
("skipping cudagraphs due to mutated inputs"): at small sizes ``backend="hstu"`` lost to stock
Inductor (issue 22). Skipped without CUDA.

    PYTHONPATH=$PWD HSTU_INDUCTOR_AUTOTUNE=0 python -m pytest -q -p no:xdist -m gpu tests/test_gpu_cudagraphs.py
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import hstu_inductor
from hstu_inductor.reference import STULayer
from hstu_inductor.report import collecting
from _helpers import cuda_stu_batch, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]




@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("B", [1, 4])
def test_reduce_overhead_keeps_cuda_graphs(B, train):
    torch._dynamo.reset()
    hstu_inductor.backend.register()
    torch.manual_seed(0)
    N, E = 256, 256
    layer = STULayer(E, 2, 64, 64).to("cuda", torch.bfloat16).train(train)
    x, off, nt = cuda_stu_batch(B, N, E, seed=B)
    counters.clear()
    model = torch.compile(layer, backend="hstu", mode="reduce-overhead")
    with collecting() as report:
        for step in range(3):  # warm-up, recording, replay
            torch.compiler.cudagraph_mark_step_begin()
            xx = x.detach().requires_grad_(train)
            with torch.set_grad_enabled(train):
                out = model(xx, off, N, nt)
                if train:
                    (dx,) = torch.autograd.grad(out, xx, torch.ones_like(out))
    assert report.counts.get("attention", 0) == 1, report
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    xe = x.detach().requires_grad_(train)
    with torch.set_grad_enabled(train):
        want = layer(xe, off, N, nt)
        assert rel_err(out, want) < 2e-2
        if train:
            (dxe,) = torch.autograd.grad(want, xe, torch.ones_like(want))
            assert rel_err(dx, dxe) < 5e-2
    torch._dynamo.reset()
