"""benchmarks/never_slower.py's model list, without a GPU or a compile: the auto picks are HSTU,
differentiable and deterministic, every picked model builds and runs eagerly on CPU at tiny sizes
(forward, and the training step the benchmark times), and the summary's ratios, spread and failure
criterion read a CSV as documented."""
from __future__ import annotations

import csv
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import never_slower as ns  # noqa: E402
import never_slower_models as nm  # noqa: E402

B, N, H, D = 2, 16, 2, 8
E = H * D
SPECS = ["reference", "grammar:auto:3", "metamorphic:auto:2"]


def test_auto_picks():
    from hstu_inductor.testing.grammar import sample
    from hstu_inductor.testing.metamorphic import TRANSFORMS

    models = nm.resolve_models(SPECS[1:])
    assert [m.kind for m in models] == ["grammar"] * 3 + ["metamorphic"] * 2
    assert nm.resolve_models(SPECS[1:]) == models
    for m in models:
        s = sample(m.seed)
        assert s.expected_hstu and s.differentiable, m.spec
    grammar_forms = [m.form for m in models[:3]]
    assert sum(f in nm.LAYER_FORMS for f in grammar_forms) >= 2, grammar_forms
    assert {m.seed for m in models[:3]}.isdisjoint(m.seed for m in models[3:])
    assert set().union(*(m.transforms for m in models[3:])) == set(TRANSFORMS)
    assert all(len(m.transforms) >= 2 for m in models[3:])


def test_explicit_specs():
    (m,) = nm.resolve_models(["metamorphic:7:inplace+reassoc"])
    assert (m.kind, m.seed, m.transforms) == ("metamorphic", 7, ("inplace", "reassoc"))
    for bad in ("grammar", "metamorphic:7", "metamorphic:7:sizes_coincide", "stu"):
        with pytest.raises(ValueError):
            nm.resolve_models([bad])


@pytest.mark.parametrize("spec", SPECS)
def test_models_run_eagerly_on_cpu(spec):
    L = sum(nm.seq_lengths(B, N, nm.input_seed(B, N)))
    for m in nm.resolve_models([spec]):
        module = nm.build_model(m, N, H, D, E, "cpu")
        args = nm.make_inputs(m, B, N, H, D, E, "cpu")
        with torch.no_grad():
            out = nm.first_output(module(*args))
        assert out.shape == nm.output_shape(m, L, H, D, E), m.spec
        assert out.dtype == m.dtype and torch.isfinite(out.float()).all(), m.spec
        train_args = nm.make_inputs(m, B, N, H, D, E, "cpu", requires_grad=True)
        grads = nm.step_fn(module, module, "train", train_args, torch.ones_like(out))()
        assert len(grads) > len(list(module.parameters())), m.spec  # the inputs' gradients too
        assert all(torch.isfinite(g.float()).all() for g in grads), m.spec


def _write(path, cells):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ns.FIELDS)
        w.writeheader()
        for (B_, N_), times in cells.items():
            for r, (ind, hstu) in enumerate(times):
                for prov, ms in (("inductor", ind), ("hstu", hstu)):
                    w.writerow(dict(model="reference", dtype="bf16", task="infer", mode="default", dynamic=False,
                                    provider=prov, B=B_, N=N_, round=r, ms=ms))


def test_summary_ratios_and_failures(tmp_path):
    path = str(tmp_path / "never_slower.csv")
    # (1, 256): 0.9x and 0.95x, spread 5.4%: fails; (4, 256): 0.96x and 1.04x, spread 8%: within it
    _write(path, {(1, 256): [(0.9, 1.0), (0.95, 1.0)], (4, 256): [(0.96, 1.0), (1.04, 1.0)],
                  (32, 256): [(2.0, 1.0), (float("nan"), 1.0)]})
    text = ns.summary(path)
    fail = text.split("spread (in any round):")[1].split("\n\n")[0]
    assert "B=1 N=256" in fail and "B=4 N=256" not in fail and "B=32" not in fail
    assert "hstu, round 0: 0.90x at reference (bf16) infer default B=1 N=256" in text
    assert "hstu, round 1: 0.95x" in text
    assert f"{abs(0.9 - 0.95) / 0.925:.1%}" in text and "8.0%" in text
    assert "Not measured in every round" in text and "B=32 N=256" in text.split("Not measured")[1]
