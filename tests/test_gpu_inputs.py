"""Edge and invalid jagged inputs on CUDA: the op (Triton kernels), the rewritten backend graph and
the checks of ``config.check_inputs``. Skipped without CUDA.

    PYTHONPATH=$PWD HSTU_INDUCTOR_AUTOTUNE=0 python3 -m pytest -q -m gpu tests/test_gpu_inputs.py
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hstu_inductor
import hstu_inductor.report
from hstu_inductor.reference import hstu_mha

from _helpers import offsets_from_lengths, rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-3}
H, D = 2, 64

# name: (lengths, max_seq_len, num_targets)
EDGES = {
    "all_empty": ([0, 0, 0], 64, None),
    "all_empty_targets": ([0, 0, 0], 64, [0, 0, 0]),  # issue 22: crashed with targets only
    "no_sequence": ([], 64, None),
    "no_sequence_targets": ([], 64, []),
    "one_sequence": ([50], 64, [3]),
    "N_is_1": ([1, 0, 1, 1], 1, [0, 0, 1, 0]),
    "one_sequence_of_length_N": ([128], 128, [0]),
    "zeros_mixed_in": ([0, 70, 0, 0, 128, 1, 0], 128, None),
    "targets_0_and_length": ([40, 17, 128, 1], 128, [0, 17, 128, 1]),
}


def _inputs(lengths, dtype, seed, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    L = sum(lengths)
    q, k, v = (torch.randn(L, H, D, device="cuda", dtype=dtype, generator=g).requires_grad_(requires_grad)
               for _ in range(3))
    return q, k, v, offsets_from_lengths(lengths).cuda()


def _compare(out, ref, tol):
    assert out.shape == ref.shape and torch.isfinite(out).all()
    if ref.numel() and ref.any():
        assert rel_err(out, ref) < tol
    else:
        assert not out.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(EDGES))
def test_op_edge_inputs_fwd_bwd(name, dtype):
    """The issue's all-empty batch used to raise "max(): Expected reduction dim ..." on CUDA."""
    lengths, N, targets = EDGES[name]
    q, k, v, off = _inputs(lengths, dtype, seed=len(lengths), requires_grad=True)
    nt = torch.tensor(targets, device="cuda", dtype=torch.int64) if targets is not None else None
    out = torch.ops.hstu.attention(q, k, v, off, N, 1.0 / D, nt, None, 0, 0, 0, True)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = hstu_mha(N, 1.0 / D, *r, off, num_targets=nt)
    _compare(out, ref.detach(), TOL[dtype])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
    if ref.numel():
        ref_grads = torch.autograd.grad(ref, r, dout.double())
        for g_, rg in zip(grads, ref_grads):
            _compare(g_, rg, TOL[dtype])
    torch.cuda.synchronize()


def test_backend_edge_inputs():
    """backend="hstu" on the plain reference: each edge batch matches fp64 eager, fwd and bwd
    (whether or not a given static shape is rewritten)."""
    for name, (lengths, N, targets) in EDGES.items():
        torch._dynamo.reset()

        def attn(q, k, v, off, nt):
            return hstu_mha(N, 1.0 / D, q, k, v, off, num_targets=nt)

        q, k, v, off = _inputs(lengths, torch.bfloat16, seed=7, requires_grad=True)
        nt = torch.tensor(targets, device="cuda", dtype=torch.int64) if targets is not None else None
        out = torch.compile(attn, backend="hstu")(q, k, v, off, nt)
        r = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attn(*r, off, nt)
        _compare(out, ref.detach(), TOL[torch.bfloat16])
        if ref.numel() and ref.any():
            dout = torch.randn_like(out)
            for g_, rg in zip(torch.autograd.grad(out, (q, k, v), dout),
                              torch.autograd.grad(ref, r, dout.double())):
                _compare(g_, rg, TOL[torch.bfloat16])
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["auto", "always"])
@pytest.mark.parametrize("lengths", [[0, 0, 0], []], ids=["all_empty", "no_sequence"])
def test_empty_batch_with_targets_every_op(lengths, mode):
    """Issue 22: an empty batch with num_targets on CUDA (both check modes): attention fwd/bwd (empty
    output, empty gradients), cached attention with D=0, and the direct kernels."""
    from hstu_inductor.kernels import attention as K

    q, k, v, off = _inputs(lengths, torch.bfloat16, seed=5, requires_grad=True)
    nt = torch.zeros(len(lengths), dtype=torch.int64, device="cuda")
    with hstu_inductor.config.patch(check_inputs=mode):
        out = torch.ops.hstu.attention(q, k, v, off, 64, 1.0 / D, nt, None, 0, 0, 0, True)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        delta = torch.ops.hstu.delta_attention(q.detach()[:0], k.detach(), v.detach(), off, 64, 1.0 / D, nt, None, 0, 0)
    assert out.shape == (0, H, D) and delta.shape == (0, H, D)
    assert all(g.shape == (0, H, D) for g in grads)
    assert K.hstu_attention_fwd(q.detach(), k.detach(), v.detach(), off, 64, 1.0 / D, nt).shape == (0, H, D)
    assert all(g.shape == (0, H, D) for g in K.hstu_attention_bwd(out.detach(), q.detach(), k.detach(), v.detach(),
                                                                 off, 64, 1.0 / D, nt))
    # the check is not vacuous on an empty batch: a target count above a length of 0 is refused
    if lengths and mode == "always":
        with hstu_inductor.config.patch(check_inputs="always"), pytest.raises(RuntimeError, match="num_targets"):
            torch.ops.hstu.attention(q, k, v, off, 64, 1.0 / D, nt + 1, None, 0, 0, 0, True)
    torch.cuda.synchronize()


GARBAGE = {  # name: (offsets, num_targets, max_seq_len); L = 300
    "decreasing": ([0, 250, 40, 300], None, 256),
    "negative": ([-100, 10, 300], None, 256),
    "past_L": ([0, 120, 1300], None, 256),
    "longer_than_max_seq_len": ([0, 300], None, 128),
    "targets_out_of_range": ([0, 200, 300], [-7, 500], 256),
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_offsets_do_not_crash_with_checks_off(name):
    """check_inputs="off": no check, but the kernels clamp: the process and its CUDA context survive
    (the result is unspecified). compute-sanitizer: tests/kernels/sanitize_attention.py --garbage."""
    offsets, targets, N = GARBAGE[name]
    q, k, v, _ = _inputs([300], torch.bfloat16, seed=2, requires_grad=True)
    off = torch.tensor(offsets, device="cuda")
    nt = torch.tensor(targets, device="cuda", dtype=torch.int64) if targets is not None else None
    with hstu_inductor.config.patch(check_inputs="off"):
        out = torch.ops.hstu.attention(q, k, v, off, N, 1.0 / D, nt, None, 0, 0, 0, True)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    # the context is still usable
    assert torch.ones(4, device="cuda").sum().item() == 4


@pytest.mark.parametrize("name", list(GARBAGE))
def test_always_mode_raises_catchable_named_errors(name):
    offsets, targets, N = GARBAGE[name]
    q, k, v, _ = _inputs([300], torch.bfloat16, seed=2)
    off = torch.tensor(offsets, device="cuda")
    nt = torch.tensor(targets, device="cuda", dtype=torch.int64) if targets is not None else None
    msg = {"decreasing": "non-decreasing", "negative": r"seq_offsets\[0\]", "past_L": r"seq_offsets\[-1\]",
           "longer_than_max_seq_len": "max_seq_len", "targets_out_of_range": "num_targets"}[name]
    with hstu_inductor.config.patch(check_inputs="always"):
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.hstu.attention(q, k, v, off, N, 1.0 / D, nt, None, 0, 0, 0, True)
    torch.cuda.synchronize()


def test_always_mode_in_compiled_graph():
    """The rewritten graph with check_inputs="always" raises a catchable error naming the problem."""
    torch._dynamo.reset()
    N = 128

    def attn(q, k, v, off, nt):
        return hstu_mha(N, 1.0 / D, q, k, v, off, num_targets=nt)

    lengths = [100, 0, 128, 72]
    q, k, v, off = _inputs(lengths, torch.bfloat16, seed=3)
    nt = torch.tensor([1, 0, 128, 5], device="cuda")
    with hstu_inductor.config.patch(check_inputs="always"):
        compiled = torch.compile(attn, backend="hstu")
        with hstu_inductor.report.collecting() as report:
            out = compiled(q, k, v, off, nt)
        assert report.counts["attention"] == 1, str(report)
        assert rel_err(out, attn(q.double(), k.double(), v.double(), off, nt)) < TOL[torch.bfloat16]
        with pytest.raises(RuntimeError, match="num_targets"):
            compiled(q, k, v, off, torch.tensor([1, 1, 128, 5], device="cuda"))
        with pytest.raises(RuntimeError, match="max_seq_len"):
            compiled(q, k, v, torch.tensor([0, 100, 100, 100 + 129, 300], device="cuda"), nt)
    torch.cuda.synchronize()
    torch._dynamo.reset()


_AUTO_SCRIPT = """
import torch, hstu_inductor
from hstu_inductor.reference import hstu_mha
N = 256
def attn(q, k, v, off):
    return hstu_mha(N, 0.1, q, k, v, off)
q, k, v = (torch.randn(300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
fn = torch.compile(attn, backend="hstu") if {compiled} else (
    lambda q, k, v, off: torch.ops.hstu.attention(q, k, v, off, N, 0.1, None, None, 0, 0, 0, True))
fn(q, k, v, torch.tensor([0, 100, 300], device="cuda"))
torch.cuda.synchronize()
print("valid ok", flush=True)
fn(q, k, v, torch.tensor([0, 10, 300], device="cuda"))  # length 290 > N
torch.cuda.synchronize()
print("NOT CAUGHT", flush=True)
"""


@pytest.mark.parametrize("compiled", [False, True], ids=["eager_op", "backend"])
def test_auto_mode_device_assert(compiled, tmp_path):
    """check_inputs="auto" on CUDA: a device-side assert (no host sync); it ends the CUDA context, so
    it runs in a child process."""
    proc = subprocess.run([sys.executable, "-c", _AUTO_SCRIPT.format(compiled=compiled)], capture_output=True,
                          text=True, timeout=600, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert "valid ok" in proc.stdout, proc.stderr[-3000:]
    assert "NOT CAUGHT" not in proc.stdout
    assert proc.returncode != 0
    assert "assert" in proc.stderr.lower(), proc.stderr[-3000:]


@pytest.mark.parametrize("name", list(EDGES))
def test_eager_auto_checks_in_one_launch(name, monkeypatch):
    """Issue 22: a plain eager CUDA call checks its jagged inputs with the one fused kernel
    (kernels/checks.py), which passes every valid edge input; its device-assert path is
    test_auto_mode_device_assert[eager_op]."""
    import importlib

    checks = importlib.import_module("hstu_inductor.ops._checks")
    real, calls = checks.fused_check(), []
    monkeypatch.setattr(checks, "fused_check", lambda: lambda *a: (calls.append(a), real(*a)))
    lengths, N, nt = EDGES[name]
    q, k, v, off = _inputs(lengths, torch.bfloat16, seed=5)
    nt = None if nt is None else torch.tensor(nt, device="cuda", dtype=torch.int64)
    with hstu_inductor.config.patch(check_inputs="auto"):
        out = torch.ops.hstu.attention(q, k, v, off, N, 0.1, nt, None, 0, 0, 0, True)
    torch.cuda.synchronize()
    assert len(calls) == 1
    ref = hstu_mha(N, 0.1, q.float(), k.float(), v.float(), off, num_targets=nt)
    _compare(out.float(), ref, TOL[torch.bfloat16])
