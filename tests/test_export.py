"""torch.export + HSTU rewrite + AOTInductor package + load + run (CPU).

The packages must compute what eager computes for two different (L, B), contain every rewrite,
and load in a fresh interpreter that never imports hstu_inductor.
"""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
import torch
from torch.export import Dim

import hstu_inductor.export as hx
from hstu_inductor.testing import spellings_attention as sp
from hstu_inductor.patterns.blocks import _op_arg
from hstu_inductor.reference import HSTUModel

from _helpers import rel_err


def _batch(lengths, num_items=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return torch.randint(0, num_items, (int(off[-1]),), generator=g), off


def _no_hstu_in_package(path):
    """The package's generated code and binaries never name our ops or our Python module."""
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            data = z.read(name)
            assert b"hstu::" not in data and b"hstu_inductor" not in data, name


@pytest.fixture(scope="module")
def stu_package(tmp_path_factory):
    torch.manual_seed(0)
    model = HSTUModel(40, 12, embedding_dim=16, num_layers=2, num_heads=2, attn_dim=8, hidden_dim=8).eval()
    ids, off = _batch([5, 12, 3])
    path = str(tmp_path_factory.mktemp("aoti") / "stu.pt2")
    result = hx.export_and_package(model, (ids, off), dynamic_shapes=({0: Dim.AUTO}, {0: Dim.AUTO}),
                                   package_path=path)
    return model, result


def test_stu_model_rewritten_and_packaged(stu_package):
    model, result = stu_package
    assert result.report.counts == {"attention": 2, "preprocess": 2, "output": 2}, str(result.report)
    targets = [str(n.target) for n in result.exported_program.graph.nodes if n.op == "call_function"]
    assert targets.count("hstu.attention.default") == 2
    # fuse_u_silu survives the re-export: each output op takes the pre-activation (silu_u)
    outputs = [n for n in result.exported_program.graph.nodes if str(n.target).startswith("hstu.stu_output")]
    assert len(outputs) == 2 and all(_op_arg(n, "silu_u") is True for n in outputs), outputs
    _no_hstu_in_package(result.package_path)
    runner = torch._inductor.aoti_load_package(result.package_path)
    with torch.no_grad():
        for lengths, seed in (([5, 12, 3], 1), ([7, 1, 12, 9, 4], 2)):  # new L and B: dynamic dims
            ids, off = _batch(lengths, seed=seed)
            assert rel_err(runner(ids, off), model(ids, off)) < 1e-5


def test_stu_package_checks_jagged_inputs(stu_package, capfd):
    """The package carries the attention ops' value checks (config.check_inputs): bad offsets raise
    instead of indexing out of bounds or answering silently (the message itself is printed by
    the AOTI runtime; the Python error only says the run failed)."""
    _, result = stu_package
    runner = torch._inductor.aoti_load_package(result.package_path)
    ids, _ = _batch([5, 12, 3])
    with torch.no_grad():
        # a length 13 > N=12 and decreasing offsets already fail in the model's own position
        # embedding (as in eager); offsets ending before L pass it and reach the attention check
        for bad, ours in (([0, 13, 17, 20], False), ([0, 12, 5, 20], False), ([0, 5, 17, 19], True)):
            with pytest.raises(RuntimeError):
                runner(ids, torch.tensor(bad))
            err = capfd.readouterr().err
            assert not ours or "hstu attention: seq_offsets[-1] must equal" in err, err[-2000:]


def test_stu_package_loads_without_hstu_inductor(stu_package, tmp_path):
    model, result = stu_package
    ids, off = _batch([6, 2, 11], seed=3)
    with torch.no_grad():
        torch.save({"ids": ids, "off": off, "expected": model(ids, off)}, tmp_path / "io.pt")
    script = f"""
import sys, torch
d = torch.load({str(tmp_path / 'io.pt')!r})
out = torch._inductor.aoti_load_package({result.package_path!r})(d["ids"], d["off"])
assert "hstu_inductor" not in sys.modules, "the package imported hstu_inductor"
err = ((out - d["expected"]).norm() / d["expected"].norm()).item()
assert err < 1e-5, err
print("fresh-process ok", err)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fresh-process ok" in proc.stdout


class _Spelling(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v, offsets):
        return self.fn(q, k, v, offsets)


# `-m slow`: an attention-only program per spelling through AOTInductor. `make test` packages attention in
# the STU model (stu_package) and with the bias tables (test_aoti_package_tables): the same export path.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["einsum_index_put_tril", "matmul_index_copy_where"])
def test_attention_spelling_export(name, tmp_path):
    torch.manual_seed(11)
    model = _Spelling(getattr(sp, name))

    def inputs(lengths):
        off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        L = int(off[-1])
        return torch.randn(L, 2, 4), torch.randn(L, 2, 4), torch.randn(L, 2, 4), off  # N = sp.N = 8

    args = inputs([3, 8, 5])
    dyn = ({0: Dim.AUTO}, {0: Dim.AUTO}, {0: Dim.AUTO}, {0: Dim.AUTO})
    result = hx.export_and_package(model, args, dynamic_shapes=dyn, package_path=str(tmp_path / f"{name}.pt2"))
    assert result.report.counts["attention"] == 1, str(result.report)
    _no_hstu_in_package(result.package_path)
    runner = torch._inductor.aoti_load_package(result.package_path)
    for lengths in ([3, 8, 5], [8, 2, 6, 1]):
        a = inputs(lengths)
        assert rel_err(runner(*a), model(*a)) < 1e-5


def test_export_without_candidates_returns_program_unchanged():
    class Plain(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x @ x.t(), -1) @ x

    ep = torch.export.export(Plain(), (torch.randn(5, 3),))
    new_ep, report = hx.rewrite_exported_program(ep)
    assert new_ep is ep and not any(report.counts.values())
