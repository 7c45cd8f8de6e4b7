"""Debugging the PyTorch way: the ``hstu`` log name of ``torch._logging`` and the ``hstu_rewrites``
structured-trace artifact (docs/debugging.md)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hstu_inductor
from hstu_inductor.report import RewriteReport
from hstu_inductor.testing import spellings_attention as sp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs():
    """B=2 sequences (lengths 3 and N=8), H=2, D=4."""
    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 3, 11])
    return tuple(torch.randn(11, 2, 4, generator=g) for _ in range(3)) + (offsets,)


@pytest.fixture
def torch_logs_restored():
    """Give torch._logging and our logger back as they were: ``set_logs`` makes every registered
    logger stop propagating, and other tests read our records through pytest's root handler."""
    if "TORCH_LOGS" in os.environ:
        pytest.skip("TORCH_LOGS is set: torch ignores set_logs()")
    ours = logging.getLogger("hstu_inductor")
    saved = ours.level, ours.propagate, list(ours.handlers)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._logging.set_logs()
    ours.setLevel(saved[0])
    ours.propagate = saved[1]
    ours.handlers[:] = saved[2]


# torch_logs_restored before capfd: its teardown then runs after capfd's, so the handlers that
# set_logs() creates bind pytest's session stream, not this test's capture
def test_hstu_log_shows_rewrites_and_near_misses(torch_logs_restored, capfd, monkeypatch):
    torch._logging.set_logs(modules={"hstu": logging.INFO})
    # Without TORCH_TRACE torch's trace logger has no handler once its first record is dropped, and the
    # artifact's payload is never built. (pytest attaches its capture handlers to non-propagating
    # loggers, torch's trace logger among them: a process without pytest is imitated here.)
    monkeypatch.setattr(torch._logging._internal.trace_log, "handlers", [])
    built = []
    as_dict = RewriteReport.as_dict
    monkeypatch.setattr(RewriteReport, "as_dict", lambda self: built.append(1) or as_dict(self))
    ours = logging.getLogger("hstu_inductor")
    assert ours.isEnabledFor(logging.INFO) and not ours.isEnabledFor(logging.DEBUG)
    args = _inputs()
    with torch.no_grad():
        torch.compile(sp.reference_spelling, backend="hstu_eager")(*args)
        torch.compile(sp.anti_causal, backend="hstu_eager")(*args)
    err = capfd.readouterr().err
    assert "rewritten attention  1" in err and "+ attention: silu attention (N=8" in err, err
    assert "near misses (1):" in err and "- attention:" in err and "not causal" in err, err
    assert "rewritten graph" not in err, err  # the DEBUG record
    assert not built

    torch._logging.set_logs(modules={"hstu": logging.DEBUG})  # TORCH_LOGS="+hstu"
    assert ours.isEnabledFor(logging.DEBUG)


_TRACED = textwrap.dedent("""
    import torch
    import hstu_inductor
    from hstu_inductor.testing import spellings_attention as sp
    g = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(11, 2, 4, generator=g) for _ in range(3)) + (torch.tensor([0, 3, 11]),)
    with torch.no_grad():
        torch.compile(sp.reference_spelling, backend="hstu_eager")(*args)
        torch.compile(sp.anti_causal, backend="hstu_eager")(*args)
""")


def _artifacts(trace_dir, name) -> list:
    """(metadata, payload) of every structured-trace record of artifact ``name`` under ``trace_dir``."""
    found = []
    for fname in sorted(os.listdir(trace_dir)):
        lines = open(os.path.join(trace_dir, fname)).read().splitlines()
        for i, line in enumerate(lines):
            if '"artifact"' not in line:
                continue
            meta = json.loads(line[line.index("] ") + 2:])
            if meta["artifact"].get("name") != name:
                continue
            payload = []
            for more in lines[i + 1:]:
                if not more.startswith("\t"):
                    break
                payload.append(more[1:])
            found.append((meta, json.loads("\n".join(payload))))
    return found


def test_structured_trace_lists_rewrites_per_frame_and_default_output_is_quiet(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_COMPILE_DEBUG")}
    env.update(TORCH_TRACE=str(tmp_path / "trace"), HSTU_INDUCTOR_COST_RULE="off",
               PYTHONPATH=os.pathsep.join([REPO, env.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _TRACED], env=env, cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # without TORCH_LOGS the library prints nothing (the rewrite, the near miss: INFO records)
    assert "hstu_inductor" not in run.stderr and "hstu_inductor" not in run.stdout, run.stderr[-3000:]

    found = _artifacts(tmp_path / "trace", "hstu_rewrites")
    assert len(found) == 2, found
    (meta0, first), (meta1, second) = found
    assert meta0["artifact"]["encoding"] == "json"
    # Dynamo's compile id rides along: tlparse files each report under its frame
    assert (meta0["frame_id"], meta0["frame_compile_id"]) == (0, 0)
    assert (meta1["frame_id"], meta1["frame_compile_id"]) == (1, 0)
    assert first["counts"] == {"attention": 1, "preprocess": 0, "output": 0}
    assert [r["kind"] for r in first["rewrites"]] == ["attention"]
    assert first["rewrites"][0]["what"].startswith("silu attention (N=8")
    assert [p["kind"] for p in first["proofs"]] == ["attention"] and first["proofs"][0]["seconds"] > 0
    assert first["near_misses"] == [] and first["fallbacks"] == []
    assert second["counts"]["attention"] == 0
    assert [m["kind"] for m in second["near_misses"]] == ["attention"]
    assert "not causal" in second["near_misses"][0]["reason"]


def test_hstu_is_a_torch_log_name():
    from hstu_inductor import _compat

    assert _compat.register_torch_log("hstu", "hstu_inductor") is None  # again: idempotent
    assert _compat.register_torch_log("dynamo", "hstu_inductor") is not None  # torch's own name: left alone
    assert hstu_inductor.RewriteReport().as_dict()["counts"] == {"attention": 0, "preprocess": 0, "output": 0}
