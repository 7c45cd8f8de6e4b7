"""hstu_inductor.testing.fbgemm_shim: fbgemm's jagged ops in plain PyTorch, for a machine without fbgemm_gpu.
Run in a subprocess that cannot import fbgemm_gpu: values against a per-sequence loop (fp64, random, rows past
N dropped), gradients by gradcheck, a compiled call, and the schemas against fbgemm's where it is installed."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys
sys.modules["fbgemm_gpu"] = None  # as on a machine without it
import torch
from hstu_inductor.testing import fbgemm_shim
assert fbgemm_shim.install()
g = torch.Generator().manual_seed(7)
lengths = [3, 0, 6, 1]  # the 6 exceeds N=4: its last rows are dropped (to dense) / zero (to jagged)
off = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
N, L = 4, sum(lengths)
v = torch.randn(L, 5, generator=g, dtype=torch.float64, requires_grad=True)
dense = torch.ops.fbgemm.jagged_to_padded_dense(v, [off], [N], padding_value=-1.5)
want = torch.full((4, N, 5), -1.5, dtype=torch.float64)
for b in range(4):
    m = min(lengths[b], N)
    want[b, :m] = v[off[b]:off[b] + m]
assert torch.equal(dense, want)
d = torch.randn(4, N, 5, generator=g, dtype=torch.float64, requires_grad=True)
jag, offs = torch.ops.fbgemm.dense_to_jagged(d, [off])
want_j = torch.zeros(L, 5, dtype=torch.float64)
for b in range(4):
    m = min(lengths[b], N)
    want_j[off[b]:off[b] + m] = d[b, :m]
assert torch.equal(jag, want_j) and offs[0] is off
torch.autograd.gradcheck(lambda x: torch.ops.fbgemm.jagged_to_padded_dense(x, [off], [N]), (v,))
torch.autograd.gradcheck(lambda x: torch.ops.fbgemm.dense_to_jagged(x, [off], L)[0], (d,))
f = lambda x: torch.ops.fbgemm.dense_to_jagged(torch.ops.fbgemm.jagged_to_padded_dense(x, [off], [N]).sin(), [off], L)[0]
assert torch.allclose(torch.compile(f, backend="eager")(v), f(v))  # Dynamo: the fake kernels
names = ["jagged_to_padded_dense", "dense_to_jagged", "jagged_to_padded_dense_forward", "dense_to_jagged_forward",
         "jagged_to_padded_dense_backward"]
print(json.dumps({n: str(getattr(torch.ops.fbgemm, n).default._schema) for n in names}))
"""


def test_shim_without_fbgemm():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    schemas = json.loads(out.stdout.strip().splitlines()[-1])
    try:
        importlib.import_module("fbgemm_gpu")
    except ImportError:
        pytest.skip("fbgemm_gpu not installed: values checked, schemas not compared")
    for name, schema in schemas.items():
        assert str(getattr(torch.ops.fbgemm, name).default._schema) == schema, name
