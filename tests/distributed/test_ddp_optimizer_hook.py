"""The DDPOptimizer pre-split hook in one process (no process group: the DDPOptimizer only reads
parameter sizes), driven directly as a Dynamo backend the way convert_frame drives it under DDP."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.distributed import DDPOptimizer

import hstu_inductor
from hstu_inductor import _compat
from hstu_inductor.report import collecting
from _checks import block_misses
from _workers import LAYERS, SMALL_BUCKET_BYTES, fast_inner_compile, hstu_model, rank_batch, rel_err

ALL = {"attention": LAYERS, "preprocess": LAYERS, "output": LAYERS}


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(_compat, "compile_fx", _compat.compile_fx)  # restored after the test
    torch._dynamo.reset()
    yield fast_inner_compile()
    torch._dynamo.reset()


def _step(backend):
    """(report, loss, grads) of one step of the test model compiled with ``backend``; eager if None."""
    model = hstu_model()
    ids, offsets, labels = rank_batch(0)
    fwd = model if backend is None else torch.compile(model, backend=backend)
    with collecting() as report:
        loss = F.cross_entropy(fwd(ids, offsets), labels)
        loss.backward()
    return report, loss.detach(), [p.grad for p in model.parameters()]


def _optimizer(backend):
    return DDPOptimizer(bucket_bytes_cap=SMALL_BUCKET_BYTES, backend_compile_fn=backend,
                        first_bucket_cap=SMALL_BUCKET_BYTES)


def test_hook_installed():
    assert _compat.ddp_pre_split_status() is None
    assert getattr(DDPOptimizer.compile_fn, "_hstu_pre_split", False)
    assert _compat.install_ddp_pre_split(lambda split, backend, gm: split(gm)) is None  # idempotent


@pytest.mark.parametrize("wrapped", ["function", "torch.compile wrapper"])
def test_whole_graph_rewritten_before_the_split(fast, wrapped):
    backend = hstu_inductor.hstu_backend
    if wrapped != "function":  # what torch.compile(backend="hstu", options=...) hands to Dynamo
        backend = torch._TorchCompileWrapper("hstu", "default", {"max_autotune": False}, None)
    opt = _optimizer(backend)
    report, loss, grads = _step(opt.compile_fn)
    assert len(opt.buckets) > 2 and len(fast) == len(opt.buckets)  # split, each piece compiled once
    assert report.counts == ALL and block_misses(report.near_misses) == [] and report.graphs == 1
    _, loss_e, grads_e = _step(None)
    assert rel_err(loss, loss_e) < 1e-6
    assert max(rel_err(g, ge) for g, ge in zip(grads, grads_e)) < 1e-5


def test_without_hook_the_split_is_named(fast, monkeypatch):
    """The fallback (hook not installable): each piece rewritten on its own, the split reported."""
    monkeypatch.setattr(DDPOptimizer, "compile_fn", DDPOptimizer.compile_fn.__wrapped__)
    monkeypatch.setitem(_compat._DDP_HOOK, "installed", False)
    monkeypatch.setitem(_compat._DDP_HOOK, "reason", "hook removed by the test")
    opt = _optimizer(hstu_inductor.hstu_backend)
    report, _, _ = _step(opt.compile_fn)
    assert len(opt.buckets) > 2
    assert report.counts != ALL  # these buckets cut the preprocess block: why the hook exists
    msgs = [why for _, why in report.near_misses if "DDPOptimizer split" in why]
    assert len(msgs) == len(opt.buckets) and "hook removed by the test" in msgs[0] and "python_reducer" in msgs[0]


def test_other_backends_untouched(fast):
    """Wrapping any other backend, the DDPOptimizer behaves as shipped (no rewrite, no report)."""
    calls = []

    def other(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    opt = _optimizer(other)
    report, _, _ = _step(opt.compile_fn)
    assert len(calls) == len(opt.buckets) > 2 and report.graphs == 0 and not fast
    assert not any("hstu" in str(n.target) for gm in calls for n in gm.graph.nodes)


@pytest.mark.slow
def test_pieces_compiled_by_inductor():
    """The same split with the real Inductor step (C++ codegen per piece; slow on CPU)."""
    torch._dynamo.reset()
    opt = _optimizer(hstu_inductor.hstu_backend)
    report, loss, grads = _step(opt.compile_fn)
    assert len(opt.buckets) > 2 and report.counts == ALL and block_misses(report.near_misses) == []
    _, loss_e, grads_e = _step(None)
    assert rel_err(loss, loss_e) < 1e-6
    assert max(rel_err(g, ge) for g, ge in zip(grads, grads_e)) < 1e-5
