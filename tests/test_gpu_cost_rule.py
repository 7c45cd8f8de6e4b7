"""The cost rule on CUDA with Inductor: both graphs compiled under ``dynamic=True``, each call runs the one
its sizes select, and both compute the eager layer's result. Skipped without CUDA.

    PYTHONPATH=$PWD HSTU_INDUCTOR_AUTOTUNE=0 python -m pytest -q -p no:xdist -m gpu tests/test_gpu_cost_rule.py
"""
from __future__ import annotations

import pytest
import torch

import hstu_inductor
from hstu_inductor.reference import STULayer
from hstu_inductor.report import collecting
from _helpers import cuda_stu_batch, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, D = 256, 2, 64




@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_dynamic_dispatch_with_inductor(dispatch_choices, train):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = STULayer(E, H, D, D).to("cuda", torch.bfloat16).train(train)
    sizes = [(4, 256), (16, 512), (2, 128), (8, 1024)]
    threshold = 16 * H * 512 ** 2  # (16, 512) and (8, 1024) rewritten, the others stock Inductor
    model = torch.compile(layer, backend="hstu", dynamic=True)
    phase = "train" if train else "infer"
    with hstu_inductor.config.patch(cost_rule="auto", cost_rule_min_work={phase: threshold}), \
            collecting() as report:
        for i, (B, N) in enumerate(sizes):
            x, off, nt = cuda_stu_batch(B, N, E, seed=i)
            xx = x.detach().requires_grad_(train)
            with torch.set_grad_enabled(train):
                out = model(xx, off, N, nt)
                grads = torch.autograd.grad(out, xx, torch.ones_like(out)) if train else ()
            xe = x.detach().requires_grad_(train)
            with torch.set_grad_enabled(train):
                ref = layer(xe, off, N, nt)
                ref_grads = torch.autograd.grad(ref, xe, torch.ones_like(ref)) if train else ()
            assert rel_err(out, ref) < 2e-2, (B, N)
            for g, r in zip(grads, ref_grads):
                assert rel_err(g, r) < 2e-2, (B, N)
    assert any("per call" in line for line in report.cost_rule), str(report)
    assert report.counts["attention"] >= 1, str(report)
    assert dispatch_choices == [B * H * N * N < threshold for B, N in sizes], dispatch_choices


def test_reduce_overhead_not_decided():
    torch._dynamo.reset()
    layer = STULayer(E, H, D, D).to("cuda", torch.bfloat16).eval()
    x, off, nt = cuda_stu_batch(2, 128, E, seed=0)
    model = torch.compile(layer, backend="hstu", mode="reduce-overhead")
    with hstu_inductor.config.patch(cost_rule="auto", cost_rule_min_work={"infer": 10 ** 12}), \
            collecting() as report, torch.no_grad():
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            model(x, off, 128, nt)
    assert report.cost_rule == [] and report.counts["attention"] == 1, str(report)
