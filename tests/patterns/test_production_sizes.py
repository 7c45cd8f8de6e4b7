"""Size-independent attention proofs (``patterns/attn_meaning.py``): static graphs at production sizes.

The value-level proof reads one element at symbolic coordinates, so a static B=128, N=4096 graph costs
what a small one does. Large sizes are exercised without running the model at that size: the program
is exported under ``FakeTensorMode`` and rewritten (nothing is allocated); one real compile at B=16,
N=2048 checks the numbers against eager.
"""
from __future__ import annotations

import logging
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hstu_inductor
from hstu_inductor.testing import spellings_attention as sp
from hstu_inductor.report import collecting
from _rewrite import FnModule as _Fn, rewrite_exported
from _helpers import REWRITE_BACKEND


def _rewrite_fake(fn, B, N, H, D, monkeypatch, need_nt=False, row_scale=False, L=None):
    """Export ``fn(q, k, v, offsets[, num_targets, attn_scale])`` under fake tensors at the given
    sizes and run the rewriters on its ATen graph. Returns (report, rewritten graph, seconds)."""
    monkeypatch.setattr(sp, "N", N)
    L = L if L is not None else B * N - 3 * N // 2
    with FakeTensorMode():
        q, k, v = (torch.empty(L, H, D) for _ in range(3))
        args = [q, k, v, torch.empty(B + 1, dtype=torch.int64)]
        if need_nt or row_scale:
            args.append(torch.empty(B, dtype=torch.int64) if need_nt else None)
        if row_scale:
            args.append(torch.empty(L))
        ep = torch.export.export(_Fn(fn), tuple(args))
    return rewrite_exported(ep)


def _ops(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("name", ["einsum_index_put_tril", "matmul_index_copy_where", "gather_pad_targets"])
def test_production_static_sizes_rewritten(name, monkeypatch):
    """B=128, N=4096, H=4, D=128 static: rewritten, proven at the real sizes in about a second."""
    fn, need_nt, scale, *_ = sp.SPELLINGS[name]
    report, gm, secs = _rewrite_fake(fn, 128, 4096, 4, 128, monkeypatch, need_nt=need_nt)
    assert report.counts["attention"] == 1, report.near_misses
    (op,) = _ops(gm, torch.ops.hstu.attention.default)
    assert op.args[4] == 4096
    # the literal 1/4096 is the op's default 1/N: no scale tensor, which the Gluon forward requires
    scale = op.args[7] if len(op.args) > 7 else op.kwargs.get("attn_scale")
    assert scale is None, scale
    logging.getLogger("hstu_inductor").info("%s: proof at B=128 N=4096 took %.2f s", name, secs)


def test_window_and_context_constants_kept(monkeypatch):
    """A window equal to B (16) is the constant window, not the batch size."""
    monkeypatch.setattr(sp, "WINDOW", 16)
    fn, need_nt, scale, *_ = sp.SPELLINGS["contextual_window"]
    report, gm, _ = _rewrite_fake(fn, 16, 2048, 2, 8, monkeypatch, need_nt=True, row_scale=True)
    assert report.counts["attention"] == 1, report.near_misses
    (op,) = _ops(gm, torch.ops.hstu.attention.default)
    assert (op.args[8], op.args[9]) == (16, sp.CONTEXT)  # max_attn_len, contextual_seq_len


def test_feature_size_equal_to_n(monkeypatch):
    """H*D == N (512) and D == B (128): sizes that coincide change nothing."""
    fn = sp.SPELLINGS["matmul_index_copy_where"][0]
    report, gm, _ = _rewrite_fake(fn, 128, 512, 4, 128, monkeypatch)
    assert report.counts["attention"] == 1, report.near_misses


@pytest.mark.parametrize("name", ["anti_causal", "leaky_causal", "length_normalised"])
def test_near_misses_untouched_at_large_sizes(name, monkeypatch):
    fn, reason = sp.NEAR_MISSES[name]
    report, gm, _ = _rewrite_fake(fn, 16, 2048, 2, 8, monkeypatch)
    assert report.counts["attention"] == 0
    assert report.near_misses and reason in report.near_misses[0][1], report.near_misses
    assert not _ops(gm, torch.ops.hstu.attention.default)


def test_real_compile_b16_n2048_equal_to_eager(monkeypatch):
    """One real static compile at B=16, N=2048, H=4, D=32: rewritten and equal to eager."""
    monkeypatch.setattr(sp, "N", 2048)
    fn = sp.SPELLINGS["einsum_index_put_tril"][0]
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 2049, (16,), generator=g)
    lengths[0], lengths[1] = 2048, 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    L = int(offsets[-1])
    q, k, v = (torch.randn(L, 4, 32, generator=g) for _ in range(3))
    torch._dynamo.reset()
    start = time.perf_counter()
    with collecting() as report:
        out = torch.compile(fn, backend="hstu", dynamic=False)(q, k, v, offsets)
    logging.getLogger("hstu_inductor").info("compile+run %.1f s; %s", time.perf_counter() - start, report.details)
    assert report.counts["attention"] == 1, report.near_misses
    ref = fn(q, k, v, offsets)  # eager, the semantic reference (fp64 would double the test's time)
    err = (out - ref).norm() / ref.norm()
    assert err < 1e-5, err


@pytest.mark.parametrize("dynamic", [False, True])
def test_export_static_and_dynamic_rewritten(dynamic, monkeypatch):
    """``hstu_inductor.export.rewrite_exported_program`` at N=2048: static shapes and Dim.AUTO shapes
    (B and L symbolic, N constant)."""
    import hstu_inductor.export as hx
    from torch.export import Dim

    monkeypatch.setattr(sp, "N", 2048)
    fn = sp.SPELLINGS["einsum_index_put_tril"][0]
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 2049, (16,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    L = int(offsets[-1])
    q, k, v = (torch.randn(L, 2, 8, generator=g) for _ in range(3))
    shapes = {"args": ({0: Dim.AUTO},) * 4} if dynamic else None
    ep = torch.export.export(_Fn(fn), (q, k, v, offsets), dynamic_shapes=shapes)
    new_ep, report = hx.rewrite_exported_program(ep)
    assert report.counts["attention"] == 1, report.near_misses
    targets = [n.target for n in new_ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.hstu.attention.default in targets


def test_max_autotune_mode_rewritten():
    """``mode="max-autotune"`` (Inductor autotunes its own kernels) still gets the rewrite."""
    import sys, os
    sys.path.insert(0, os.path.dirname(__file__))
    from test_attention_helpers import spelling_inputs

    fn, args = spelling_inputs("matmul_index_copy_where")
    torch._dynamo.reset()
    # The mode's own settings all apply; only the C++ GEMM template candidates that it would build
    # and time for the CPU reference's bmm (7 g++ builds, most of this test's time) are left out.
    with collecting() as report, torch._inductor.config.patch(max_autotune_gemm_backends="ATEN"):
        out = torch.compile(fn, backend="hstu", mode="max-autotune")(*args)
    assert report.counts["attention"] == 1, report.near_misses
    ref = fn(*args)
    assert ((out - ref).norm() / ref.norm()) < 1e-5


# each style in one mode under `make test` (static gr, dynamic tzrec), the other under `-m slow`
@pytest.mark.parametrize("style", ["gr", pytest.param("tzrec", marks=pytest.mark.slow)])
def test_public_style_stacks_static_production_sizes(style):
    """GR- and tzrec-style stacks (fbgemm pads, per-row scale, window + contextual, group norm,
    late silu) at a static B=16, N=2048: 3 rewrites per layer on the first compile."""
    pytest.importorskip("fbgemm_gpu")
    from hstu_inductor.patterns import rewrite_dynamo_graph
    from public_style_models import PublicStyleStack

    kw = dict(style="gr", max_attn_len=16, contextual=2) if style == "gr" else \
        dict(style="tzrec", group_norm=True, max_attn_len=4, late_silu=True)
    torch.manual_seed(0)
    model = PublicStyleStack(2, 16, 2, 8, 8, **kw)
    B, N = 16, 2048
    lengths = torch.randint(N // 2, N + 1, (B,))
    lengths[0] = N
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    L = int(off[-1])
    x = torch.randn(L, 16, requires_grad=True)
    nt = torch.randint(0, 4, (B,))
    scale = torch.rand(L) + 0.5 if style == "gr" else None

    def capture(gm, example_inputs):  # rewrite only: the model is not run at this size
        rewrite_dynamo_graph(gm)
        return gm.forward

    torch._dynamo.reset()
    with collecting() as report:
        torch.compile(model, backend=capture, dynamic=False)(x, off, N, nt, scale)
    assert report.counts == {"attention": 2, "preprocess": 2, "output": 2}, report.near_misses


@pytest.mark.parametrize("style", [pytest.param("gr", marks=pytest.mark.slow), "tzrec"])
def test_public_style_stacks_dynamic_true(style):
    """The same stacks under dynamic=True: rewritten, outputs and gradients equal to eager."""
    pytest.importorskip("fbgemm_gpu")
    from public_style_models import PublicStyleStack

    kw = dict(style="gr", max_attn_len=3, contextual=2) if style == "gr" else \
        dict(style="tzrec", group_norm=True, max_attn_len=4, late_silu=True)
    torch.manual_seed(1)
    model = PublicStyleStack(2, 16, 2, 8, 8, **kw)
    lengths = torch.tensor([5, 0, 8, 1, 3])
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    x = torch.randn(int(off[-1]), 16, requires_grad=True)
    nt = torch.tensor([1, 0, 3, 1, 0])
    scale = torch.rand(int(off[-1])) + 0.5 if style == "gr" else None
    torch._dynamo.reset()
    with collecting() as report:
        out = torch.compile(model, backend=REWRITE_BACKEND, dynamic=True)(x, off, 8, nt, scale)
    assert report.counts["attention"] >= 2 and report.counts["preprocess"] >= 2 and report.counts["output"] >= 2, \
        report.near_misses
    ref = model(x, off, 8, nt, scale)
    assert ((out - ref).norm() / ref.norm()) < 1e-5
    g = torch.randn_like(ref)
    params = [x, *model.parameters()]
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        assert ((a - b).norm() / b.norm().clamp_min(1e-12)) < 1e-4


def test_n_equal_to_b_squared(monkeypatch):
    """N = 1024 = B * B with B = 32: sizes that coincide change nothing."""
    fn = sp.SPELLINGS["einsum_index_put_tril"][0]
    report, gm, _ = _rewrite_fake(fn, 32, 1024, 4, 128, monkeypatch)
    assert report.counts["attention"] == 1, report.near_misses
    (op,) = _ops(gm, torch.ops.hstu.attention.default)
    assert op.args[4] == 1024
