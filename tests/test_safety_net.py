"""The backend's safety net (backend.py, "Safety net"), its frame config across ``torch._dynamo.reset()``,
and the dynamic-shape crash of a loop over heads with a boolean-mask unpad (exact size-bound rounding,
``_compat.install_exact_int_rounding``).

Each stage test injects an exception into one stage of ours and checks: the compiled function still runs
and equals eager, exactly one warning is logged, ``explain()`` names the stage and the exception, and
``config.strict = True`` re-raises it. The stages run on a tiny STU preprocess block (rewritten), mostly
under ``backend="hstu_eager"``; the cost rule and the Inductor compile need ``backend="hstu"``.
"""
from __future__ import annotations

import logging
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import hstu_inductor
from hstu_inductor import _compat, cost_rule
from hstu_inductor.patterns import pipeline
from hstu_inductor.patterns.registry import REWRITERS
from _helpers import offsets_from_lengths, rel_err


class Injected(RuntimeError):
    """The failure the tests inject."""


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Preprocess(torch.nn.Module):
    """layer norm -> uvqk projection -> silu -> split: rewritten to ``hstu.stu_preprocess``."""

    def __init__(self, E=8, H=2, D=4):
        super().__init__()
        self.norm = torch.nn.LayerNorm(E)
        self.uvqk = torch.nn.Linear(E, 4 * H * D)
        self.hd = H * D

    def forward(self, x):
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).split(self.hd, dim=-1)
        return u * v + q * k


def _has_hstu_ops(gm) -> bool:
    return any(n.op == "call_function" and str(n.target).startswith("hstu.") for n in gm.graph.nodes)


def _raise(what):
    def boom(*args, **kwargs):
        raise Injected(f"injected {what} failure")

    return boom


def _failing_rewriter(gm, report):
    raise Injected("injected rewriters failure")


def _fail_on_rewritten(real, what):
    """``real`` (a compile function) raising on graphs that hold hstu ops, i.e. only on the rewritten one."""

    def compile_(gm, *args, **kwargs):
        if _has_hstu_ops(gm):
            raise Injected(f"injected {what} failure")
        return real(gm, *args, **kwargs)

    return compile_


def _inject(monkeypatch, stage):
    if stage == "canonicalise":
        monkeypatch.setattr(pipeline, "canonicalize", _raise(stage))
    elif stage == "ATen retrace":
        monkeypatch.setattr(_compat, "trace_aten", _raise(stage))
    elif stage == "rewriters":
        monkeypatch.setitem(REWRITERS, "preprocess", [_failing_rewriter])
    elif stage == "cost rule":
        monkeypatch.setattr(cost_rule, "decide", _raise(stage))
    elif stage == "compile (aot_eager)":
        monkeypatch.setattr(_compat, "aot_eager", _fail_on_rewritten(_compat.aot_eager, stage))
    elif stage == "compile (Inductor)":
        monkeypatch.setattr(_compat, "compile_fx", _fail_on_rewritten(_compat.compile_fx, stage))
    else:
        raise AssertionError(stage)


def _warnings(caplog) -> list:
    return [r for r in caplog.records if r.name == "hstu_inductor" and r.levelno >= logging.WARNING]


def _find(exc: BaseException, kind=Injected):
    """``exc`` or the exception it wraps (``__cause__``, ``__context__``, Dynamo's ``inner_exception``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


# stage injected -> (backend, stage name in the report)
STAGES = {
    "canonicalise": ("hstu_eager", "canonicalise"),
    "ATen retrace": ("hstu_eager", "ATen retrace"),
    "rewriters": ("hstu_eager", "rewriters"),
    "compile (aot_eager)": ("hstu_eager", "compile"),
    "cost rule": ("hstu", "cost rule"),
    "compile (Inductor)": ("hstu", "compile"),
}


@pytest.mark.parametrize("injected", list(STAGES))
def test_failing_stage_falls_back_to_the_original_graph(injected, monkeypatch, caplog):
    backend, stage = STAGES[injected]
    model, x = Preprocess(), torch.randn(6, 8)
    with torch.no_grad():
        ref = model(x)
        _inject(monkeypatch, injected)
        with caplog.at_level(logging.WARNING, logger="hstu_inductor"):
            report = hstu_inductor.explain(model, x, backend=backend)
    assert rel_err(report.output, ref) < 1e-6
    assert report.counts == {"attention": 0, "preprocess": 0, "output": 0}, report  # the original graph ran
    assert report.graphs == 1 and not report.details and not report.lowered
    assert [(f.stage, f.error) for f in report.fallbacks] == [(stage, f"Injected: injected {injected} failure")]
    assert f"{stage} failed (Injected: injected {injected} failure)" in str(report)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and f"injected {injected} failure" in warnings[0].getMessage(), warnings


@pytest.mark.parametrize("injected", list(STAGES))
def test_strict_reraises_the_stage_failure(injected, monkeypatch):
    backend, _ = STAGES[injected]
    model, x = Preprocess(), torch.randn(6, 8)
    _inject(monkeypatch, injected)
    with hstu_inductor.config.patch(strict=True), torch.no_grad(), pytest.raises(Exception) as info:
        torch.compile(model, backend=backend)(x)
    assert _find(info.value) is not None, repr(info.value)


def test_failure_without_a_rewrite_still_compiles_the_graph(monkeypatch, caplog):
    """A graph with nothing to rewrite: a failing retrace leaves it to the stock backend all the same."""
    fn = lambda a, b: torch.sin(a) * b + 1  # noqa: E731
    a, b = torch.randn(5), torch.randn(5)
    monkeypatch.setattr(_compat, "trace_aten", _raise("ATen retrace"))
    with caplog.at_level(logging.WARNING, logger="hstu_inductor"):
        report = hstu_inductor.explain(fn, a, b, backend="hstu_eager")
    assert torch.equal(report.output, fn(a, b))
    assert [f.stage for f in report.fallbacks] == ["ATen retrace"] and len(_warnings(caplog)) == 1
    assert report.graphs == 1


# ------------------------------------------------------------------------------------------------
# A frame whose Dynamo trace fails under our frame config is traced again with Dynamo's defaults.
# The injected failure: an op whose fake implementation (run while Dynamo traces) raises while
# ``capture_dynamic_output_shape_ops`` is on.
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("hstu_safety_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    if torch._dynamo.config.capture_dynamic_output_shape_ops:
        raise Injected("injected frame trace failure")
    return torch.empty_like(x)


def _calls_twice(x):
    return torch.ops.hstu_safety_test.twice(x.sin()) + 1


def test_failing_frame_trace_is_traced_again_with_dynamo_defaults(caplog):
    x = torch.randn(7)
    before = torch._dynamo.config.capture_dynamic_output_shape_ops
    with caplog.at_level(logging.WARNING, logger="hstu_inductor"):
        report = hstu_inductor.explain(_calls_twice, x, backend="hstu_eager")
    assert torch.equal(report.output, _calls_twice(x))
    assert [f.stage for f in report.fallbacks] == ["frame trace"], report
    assert "injected frame trace failure" in report.fallbacks[0].error  # inside Dynamo's TorchRuntimeError
    assert "frame trace failed" in str(report) and report.graphs == 1
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    assert torch._dynamo.config.capture_dynamic_output_shape_ops == before
    torch._dynamo.reset()
    with hstu_inductor.config.patch(strict=True), pytest.raises(Exception) as info:
        torch.compile(_calls_twice, backend="hstu_eager")(x)
    assert _find(info.value) is not None, repr(info.value)
    assert torch._dynamo.config.capture_dynamic_output_shape_ops == before


def test_frame_config_survives_dynamo_reset():
    """The first frame traced after ``torch._dynamo.reset()`` gets our config: the boolean-mask op
    stays in the graph (one graph, no break), and only while our frame is traced."""
    from hstu_inductor.report import collecting

    def fn(x, keep):
        return torch.masked_select(x.cos(), keep) * 2

    x = torch.randn(9)
    for _ in range(2):
        torch._dynamo.reset()
        with collecting() as report:
            out = torch.compile(fn, backend="hstu_eager")(x, x > 0)
        assert torch.equal(out, fn(x, x > 0))
        assert report.graphs == 1 and not report.fallbacks, report
    assert torch._dynamo.config.capture_dynamic_output_shape_ops is False


# ------------------------------------------------------------------------------------------------
# The crash: under our frame config a boolean-mask unpad is traced with an unbacked size bounded by
# sys.maxsize - 1; equating it with K * L (K = 16 here) made torch's float rounding of the bound fail
# Dynamo's trace ("tgt_bound=VR[32, 9223372036854775808] not a subset of src_bound=...").
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [2, 16, 384, 512])
def test_unbacked_size_equals_multiple_of_a_size(K):
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        s = env.create_symintnode(env.create_symbol(5, ConstantSource("L")), hint=5)
        u = torch.nonzero(torch.ones(s, K, dtype=torch.bool)).shape[0]
        torch._check(u == K * s)
        upper = env.var_to_range[s.node.expr].upper
    assert int(upper) == (sys.maxsize - 1) // K  # exact: no float rounding


class LoopHeads(torch.nn.Module):
    """An STU layer in plain PyTorch: heads in a Python loop over a padded [B, N, H*D] layout, and a
    boolean-mask unpad (``dense[valid]``, or ``masked_select`` reshaped to ``[L, H*D]``)."""

    def __init__(self, unpad: str, E=8, H=2, D=8):
        super().__init__()
        self.unpad, self.H, self.D = unpad, H, D
        self.norm = torch.nn.LayerNorm(E)
        self.uvqk = torch.nn.Linear(E, 4 * H * D)
        self.out = torch.nn.Linear(H * D, E)

    def forward(self, x, offsets, N: int):
        H, D, L = self.H, self.D, x.shape[0]
        B = offsets.numel() - 1
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).split(H * D, dim=-1)
        lengths = offsets[1:] - offsets[:-1]
        row = torch.repeat_interleave(torch.arange(B), lengths, output_size=L)
        col = torch.arange(L) - offsets[row]
        qd, kd, vd = (torch.index_put(t.new_zeros(B, N, H * D), (row, col), t) for t in (q, k, v))
        causal = torch.ones(N, N, dtype=torch.bool).tril()
        heads = []
        for h in range(H):
            qh, kh, vh = (t[:, :, h * D:(h + 1) * D] for t in (qd, kd, vd))
            heads.append(F.silu(qh @ kh.transpose(1, 2) / math.sqrt(D)) * causal / N @ vh)
        dense = torch.cat(heads, dim=-1)
        valid = torch.arange(N)[None] < lengths[:, None]
        if self.unpad == "index":
            attn = dense[valid]
        else:
            attn = torch.masked_select(dense, valid[..., None]).view(L, H * D)
        return self.out(u * F.layer_norm(attn, (H * D,))) + x


@pytest.mark.heavy
@pytest.mark.parametrize("unpad", ["masked_select", "index"])
def test_loop_over_heads_with_boolean_mask_unpad_dynamic(unpad, caplog):
    torch.manual_seed(0)
    model = LoopHeads(unpad)
    compiled = torch.compile(model, backend="hstu", dynamic=True)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="hstu_inductor"):
        for lengths, N in (([3, 5, 1, 6], 8), ([2, 7, 4], 9)):
            offsets = offsets_from_lengths(lengths)
            x = torch.randn(sum(lengths), 8)
            assert rel_err(compiled(x, offsets, N), model(x, offsets, N)) < 1e-5
    assert not _warnings(caplog)  # no fallback: the frame was traced under our config
