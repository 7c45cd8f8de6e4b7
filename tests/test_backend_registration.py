"""``backend="hstu"`` is found by name (entry point), accepts ``mode=``/``options=``, validates config."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from _helpers import offsets_from_lengths

# The script runs in a FRESH interpreter and never imports hstu_inductor itself: torch.compile must
# find the backend through the ``torch_dynamo_backends`` entry point.
_FRESH_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import torch

    results = {"imported_before": "hstu_inductor" in sys.modules}
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    expected = m(x)

    def rel(out):
        return float((out - expected).norm() / expected.norm())

    def attempt(name, **kw):
        torch._dynamo.reset()
        try:
            with torch.no_grad():  # an inference graph: half the C++ to build, same lookup
                results[name] = {"err": rel(torch.compile(m, backend="hstu", **kw)(x))}
        except Exception as e:  # report, do not crash: each case is asserted separately
            results[name] = {"exc": f"{type(e).__name__}: {e}"[:2000]}

    attempt("default")
    results["imported_after"] = "hstu_inductor" in sys.modules
    attempt("max_autotune", mode="max-autotune-no-cudagraphs")
    attempt("options", options={"epilogue_fusion": False, "max_autotune": False})
    print("RESULTS=" + json.dumps(results))
""")


@pytest.fixture(scope="module")
def fresh_results():
    proc = subprocess.run([sys.executable, "-c", _FRESH_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS=")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULTS="):])


@pytest.mark.parametrize("name, attr", [("hstu", "hstu_backend"), ("hstu_eager", "hstu_eager_backend")])
def test_entry_point_declared(name, attr):
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    found = [ep for ep in eps if ep.name == name]
    assert len(found) == 1, eps
    assert found[0].value == f"hstu_inductor.backend:{attr}"
    import hstu_inductor.backend

    assert found[0].load() is getattr(hstu_inductor.backend, attr)


def test_fresh_process_compiles_without_import(fresh_results):
    assert fresh_results["imported_before"] is False
    assert "exc" not in fresh_results["default"], fresh_results["default"]
    assert fresh_results["default"]["err"] < 1e-5
    # the backend was loaded lazily through the entry point
    assert fresh_results["imported_after"] is True


def test_fresh_process_accepts_mode(fresh_results):
    res = fresh_results["max_autotune"]
    assert "exc" not in res, res
    assert res["err"] < 1e-5


def test_fresh_process_accepts_options(fresh_results):
    res = fresh_results["options"]
    assert "exc" not in res, res
    assert res["err"] < 1e-5


def test_listed_by_dynamo():
    import hstu_inductor  # noqa: F401

    assert {"hstu", "hstu_eager"} <= set(torch._dynamo.list_backends())


# ------------------------------------------------------------------------------------------------
# In-process: mode/options really reach Inductor; config validation.
# ------------------------------------------------------------------------------------------------
def _pointwise(x):
    return torch.sin(x) * 2.0 + x.square()


@pytest.fixture
def spy_compile_fx(monkeypatch):
    import hstu_inductor._compat as compat

    calls = []
    real = compat.compile_fx

    def spy(gm, example_inputs, config_patches=None):
        calls.append(dict(config_patches or {}))
        return real(gm, example_inputs, config_patches)

    monkeypatch.setattr(compat, "compile_fx", spy)
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


def test_mode_options_reach_inductor(spy_compile_fx):
    x = torch.randn(16)
    out = torch.compile(_pointwise, backend="hstu", mode="max-autotune-no-cudagraphs")(x)
    assert torch.allclose(out, _pointwise(x), rtol=1e-5, atol=1e-6)
    assert spy_compile_fx, "the hstu backend did not call compile_fx"
    expected = torch._inductor.list_mode_options("max-autotune-no-cudagraphs")
    for key, val in expected.items():
        assert spy_compile_fx[-1].get(key) == val, (key, spy_compile_fx[-1])


def test_user_options_reach_inductor(spy_compile_fx):
    x = torch.randn(16)
    out = torch.compile(_pointwise, backend="hstu", options={"epilogue_fusion": False})(x)
    assert torch.allclose(out, _pointwise(x), rtol=1e-5, atol=1e-6)
    assert spy_compile_fx[-1].get("epilogue_fusion") is False


def test_default_mode_adds_no_mode_patches(spy_compile_fx):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    x = torch.randn(16)
    torch.compile(_pointwise, backend="hstu")(x)
    patches = spy_compile_fx[-1]
    mode_keys = set(torch._inductor.list_mode_options("max-autotune-no-cudagraphs"))
    assert not (set(patches) & mode_keys), patches
    # The only thing the backend may add is its own cache-safe post-grad pass.
    assert set(patches) <= {"post_grad_custom_post_pass"}, patches
    for p in patches.values():
        assert isinstance(p, CustomGraphPass) and p.uuid() is not None


def test_user_post_grad_pass_still_runs(spy_compile_fx):
    import uuid

    from torch._inductor.custom_graph_pass import CustomGraphPass

    calls = []
    token = uuid.uuid4().hex.encode()  # unique: no FX-graph-cache hit may skip the passes

    class Counting(CustomGraphPass):
        def __call__(self, graph):
            calls.append(len(graph.nodes))

        def uuid(self):
            return token

    x = torch.randn(16)
    out = torch.compile(_pointwise, backend="hstu", options={"post_grad_custom_post_pass": Counting()})(x)
    assert torch.allclose(out, _pointwise(x), rtol=1e-5, atol=1e-6)
    assert calls, "the user's post_grad_custom_post_pass was dropped"


def _inner_exception(exc):
    """The exception a backend raised, unwrapped from Dynamo's BackendCompilerFailed."""
    inner = getattr(exc, "inner_exception", None)
    return inner if inner is not None else (exc.__cause__ or exc)


@pytest.mark.parametrize("value", ["maybe", "ON", True])
def test_bad_tma_value_raises_valueerror_at_compile(monkeypatch, value):
    import hstu_inductor

    monkeypatch.setattr(hstu_inductor.config, "tma", value)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(_pointwise, backend="hstu")(torch.randn(4))
    torch._dynamo.reset()
    inner = _inner_exception(info.value)
    assert isinstance(inner, ValueError), repr(info.value)
    assert "tma" in str(inner) and "'auto', 'on', 'off'" in str(inner)
    assert "tma" in str(info.value)  # the message the user sees names the option


def test_config_patch_validates_immediately():
    import hstu_inductor

    with pytest.raises(ValueError, match="tma"):
        with hstu_inductor.config.patch(tma="sometimes"):
            pass
    assert hstu_inductor.config.tma in ("auto", "on", "off")  # restored
    with pytest.raises(ValueError, match="unknown kinds"):
        with hstu_inductor.config.patch(patterns={"attn": False}):
            pass
    assert set(hstu_inductor.config.patterns) == {"attention", "preprocess", "output"}
    with pytest.raises(AttributeError, match="no option"):
        with hstu_inductor.config.patch(not_an_option=1):
            pass


def test_config_patch_restores():
    import hstu_inductor

    before = hstu_inductor.config.snapshot()
    with hstu_inductor.config.patch(tma="off", patterns={"attention": False}):
        assert hstu_inductor.config.tma == "off"
        assert hstu_inductor.config.patterns == {**before["patterns"], "attention": False}
    assert hstu_inductor.config.snapshot() == before


def test_pattern_pass_uuid_is_stable_and_config_sensitive():
    import copy

    import hstu_inductor
    from hstu_inductor.patterns import HSTUPatternPass

    a, b = HSTUPatternPass(), HSTUPatternPass()
    assert isinstance(a.uuid(), bytes) and a.uuid() == b.uuid() == a.uuid()
    assert copy.deepcopy(a).uuid() == a.uuid()
    base = a.uuid()
    with hstu_inductor.config.patch(patterns={"attention": False}):
        assert a.uuid() != base  # the FX graph cache must not reuse graphs across options
    with hstu_inductor.config.patch(tma="off" if hstu_inductor.config.tma != "off" else "on"):
        assert a.uuid() != base
    assert a.uuid() == base


# ------------------------------------------------------------------------------------------------
# backend="hstu_eager": the same rewrites, run op by op (no Inductor).
# ------------------------------------------------------------------------------------------------
def _spelling_with_grads():
    from hstu_inductor.testing import spellings_attention as sp

    g = torch.Generator().manual_seed(5)
    lengths = [3, 0, sp.N, 1]
    L = sum(lengths)
    q, k, v = (torch.randn(L, 2, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    return sp.einsum_index_put_tril, (q, k, v, offsets_from_lengths(lengths))


def test_eager_backend_makes_the_same_rewrites_without_inductor(spy_compile_fx):
    from hstu_inductor.report import collecting

    fn, args = _spelling_with_grads()
    ref = fn(*args)
    ref_grads = torch.autograd.grad(ref.square().sum(), args[:3])
    results = {}
    for name in ("hstu_eager", "hstu"):
        torch._dynamo.reset()
        spy_compile_fx.clear()
        with collecting() as report, torch.set_grad_enabled(name == "hstu_eager"):
            out = torch.compile(fn, backend=name)(*args)
        assert (out - ref).norm() / ref.norm() < 1e-10, name
        if name == "hstu_eager":  # its backward (AOTAutograd, eager); "hstu"'s is test_fuzz_backend's
            grads = torch.autograd.grad(out.square().sum(), args[:3])
            for got, want in zip(grads, ref_grads):
                assert (got - want).norm() / want.norm() < 1e-10, name
        results[name] = (dict(report.counts), list(report.details), list(report.near_misses), len(spy_compile_fx))
    assert results["hstu_eager"][0]["attention"] == 1, results
    assert results["hstu_eager"][:3] == results["hstu"][:3]
    assert results["hstu_eager"][3] == 0 and results["hstu"][3] >= 1  # Inductor only behind "hstu"


def test_eager_backend_rejects_inductor_options():
    for kw in ({"mode": "max-autotune"}, {"options": {"epilogue_fusion": False}}):
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(_pointwise, backend="hstu_eager", **kw)(torch.randn(4))
        inner = _inner_exception(info.value)
        assert isinstance(inner, ValueError) and "no mode or options" in str(inner), repr(info.value)
    torch._dynamo.reset()


def test_explain_backend_choice(spy_compile_fx):
    import hstu_inductor

    fn, args = _spelling_with_grads()
    with torch.no_grad():
        fast = hstu_inductor.explain(fn, *args, backend="hstu_eager")
        assert not spy_compile_fx and not fast.lowered  # no Inductor, so nothing lowered to report
        full = hstu_inductor.explain(fn, *args)
        assert spy_compile_fx
        ref = fn(*args)
    assert fast.counts == full.counts and fast.counts["attention"] == 1
    assert fast.details == full.details and fast.near_misses == full.near_misses
    for report in (fast, full):
        assert (report.output - ref).norm() / ref.norm() < 1e-10
    with pytest.raises(ValueError, match="hstu_eager"):
        hstu_inductor.explain(fn, *args, backend="inductor")
