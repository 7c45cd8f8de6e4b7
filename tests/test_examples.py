"""Smoke test of the training examples (``make train``, ``make train-rab``) at tiny sizes, in-process.

``--backend hstu_eager`` makes the same rewrites as ``"hstu"`` without Inductor's code generation, so
both scripts run end to end (explain, the eager check, training, the loss curve) in seconds. The
fallback to log lines without tqdm and matplotlib is checked on the helpers alone.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
TINY = ["--batch-size", "2", "--max-seq-len", "8", "--num-items", "16", "--layers", "1", "--embedding-dim", "16",
        "--heads", "1", "--head-dim", "8", "--lr", "1e-2", "--backend", "hstu_eager"]


def _example(name, monkeypatch):
    """Import ``examples/<name>.py`` afresh; its modules leave sys.modules after the test (examples'
    ``_common`` is not benchmarks' ``_common``)."""
    monkeypatch.syspath_prepend(EXAMPLES)
    for mod in (name, "_common"):
        monkeypatch.setitem(sys.modules, mod, None)  # recorded, so undone (removed) at teardown
        del sys.modules[mod]
    return importlib.import_module(name)


def test_examples_train(tmp_path, monkeypatch, capsys):
    """Both scripts end to end with the extras as installed (tqdm bar, matplotlib PNG when present)."""
    has_plot = importlib.util.find_spec("matplotlib") is not None
    plain, rab = tmp_path / "plain.png", tmp_path / "rab.png"
    _example("train_hstu", monkeypatch).main(TINY + ["--steps", "10", "--loss-png", str(plain)])
    out = capsys.readouterr().out
    assert "rewritten attention  1" in out and out.rstrip().endswith("OK"), out
    _example("train_hstu_rab", monkeypatch).main(TINY + ["--steps", "1", "--loss-png", str(rab)])
    out = capsys.readouterr().out
    assert "compiled loss against eager" in out and out.rstrip().endswith("OK"), out
    # what explain() says about attention with rab, told as it is (rewritten once the matcher knows it)
    assert "attention with rab: not rewritten" in out or "layers rewritten" in out
    assert plain.exists() == rab.exists() == has_plot


def test_examples_without_extras(tmp_path, monkeypatch, caplog):
    """Without tqdm and matplotlib the examples log progress and the curve's summary instead."""
    for mod in ("tqdm", "tqdm.auto", "matplotlib"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    common = _example("_common", monkeypatch)
    caplog.set_level(logging.INFO, logger="hstu_inductor.examples")
    bar = common.progress(20)
    for step in range(20):
        bar.set_postfix(loss=f"{1 / (step + 1):.4f}")
        bar.update(1)
    bar.close()
    assert common.save_loss_curve([3.0, 2.0, 2.5], str(tmp_path / "c.png"), "t") is None
    assert not (tmp_path / "c.png").exists()
    assert "train 2/20 loss 0.5000" in caplog.text and "train 20/20" in caplog.text, caplog.text
    assert "matplotlib not installed" in caplog.text and "min 2.0000" in caplog.text, caplog.text


def test_synthetic_timestamps_keep_the_plain_stream(monkeypatch):
    """train_hstu.py's batches are unchanged by the timestamp option; timestamps rise in every sequence."""
    import torch

    common = _example("_common", monkeypatch)
    ids, off = common.synthetic_batch(torch.Generator().manual_seed(0), 3, 8, 16, "cpu")
    ids2, off2, ts = common.synthetic_batch(torch.Generator().manual_seed(0), 3, 8, 16, "cpu", timestamps=True)
    assert torch.equal(off, off2) and ts.shape == ids2.shape
    for b in range(3):
        assert bool((ts[off2[b] + 1:off2[b + 1]] > ts[off2[b]:off2[b + 1] - 1]).all())
