"""Hypothesis fuzzing of the ops on the GPU (issue 22 item 7): ``hstu::attention`` forward and gradients
(q, k, v and a dense rab) and ``hstu::delta_attention`` against the fp64 reference, with random shapes,
mask options, dtypes, scales, rab broadcasts and interval masks per example. The CPU suite covers the
same ops under the interpreter with fixed cases (tests/kernels, test_ops_*); this draws what those
fixed cases do not: odd head dims, N=1, empty and full sequences, every mask option together.

``HSTU_GPU_FUZZ_EXAMPLES=n`` runs ``n`` random examples (default 25, derandomized).
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hstu_inductor import ops
from hstu_inductor.reference import delta_hstu_mha, hstu_mha

from _helpers import check_output, offsets_from_lengths, rel_err

EXAMPLES = int(os.environ.get("HSTU_GPU_FUZZ_EXAMPLES", "0"))
SETTINGS = settings(max_examples=EXAMPLES or 25, deadline=None, derandomize=not EXAMPLES, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
DEVICE = "cuda"
TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}
pytestmark = pytest.mark.gpu


@st.composite
def cases(draw):
    N = draw(st.one_of(st.just(1), st.integers(2, 300)))
    B = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.one_of(st.just(0), st.just(1), st.just(N), st.integers(0, N)), min_size=B, max_size=B))
    mask = draw(st.sampled_from(["causal", "targets", "window", "intervals", "noncausal"]))
    c = dict(N=N, lengths=lengths, mask=mask, seed=draw(st.integers(0, 2**16)), H=draw(st.integers(1, 4)),
             Dq=draw(st.sampled_from([16, 24, 32, 64, 128])), Dv=draw(st.sampled_from([16, 32, 64, 128])),
             dtype=draw(st.sampled_from(list(TOL))), scale=draw(st.sampled_from([None, "scalar", "row"])),
             rab=draw(st.sampled_from([None, (1, 1), (1, "H"), ("B", "H"), ("B", 1)])), opts={}, targets=None)
    if mask == "targets":
        c["targets"] = [draw(st.integers(0, n)) for n in lengths]
    if mask == "window":
        c["opts"] = dict(max_attn_len=draw(st.integers(1, N)), contextual_seq_len=draw(st.integers(0, 4)))
        c["opts"]["min_full_attn_seq_len"] = draw(st.integers(0, N))
    return c


def _inputs(c):
    device = DEVICE
    g = torch.Generator().manual_seed(c["seed"])
    B, N, H, L = len(c["lengths"]), c["N"], c["H"], sum(c["lengths"])
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(L, H, c["Dq"]), r(L, H, c["Dq"]), r(L, H, c["Dv"])
    off = offsets_from_lengths(c["lengths"]).to(device)
    kw = dict(num_targets=None if c["targets"] is None else torch.tensor(c["targets"], device=device), **c["opts"])
    if c["scale"] == "scalar":
        kw["attn_scale"] = torch.rand((), generator=g, dtype=torch.float64) + 0.1
    elif c["scale"] == "row":
        kw["attn_scale"] = torch.rand(L, generator=g, dtype=torch.float64) + 0.1
    if c["rab"] is not None:
        dims = [B if d == "B" else H if d == "H" else 1 for d in c["rab"]]
        kw["rab"] = r(*dims, N, N)
    if c["mask"] == "intervals":  # [0, a) u [b, c) per head and row
        a, bb, cc = (torch.randint(0, N + 1, (H, L), generator=g) for _ in range(3))
        bb, cc = torch.minimum(bb, cc), torch.maximum(bb, cc)
        kw["intervals"] = torch.stack([a, bb, cc], -1).to(device)
    kw = {key: (t.to(device) if isinstance(t, torch.Tensor) else t) for key, t in kw.items()}
    return [t.to(device) for t in (q, k, v)], off, kw


def _cast(kw, dtype):
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}


@SETTINGS
@given(c=cases())
def test_attention_op_fuzz(c):
    (q, k, v), off, kw = _inputs(c)
    dtype, N, alpha = c["dtype"], c["N"], 1.0 / c["Dq"]
    causal = c["mask"] != "noncausal" and c["mask"] != "intervals"
    low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    lkw = _cast(kw, dtype)
    if "rab" in lkw:
        lkw["rab"].requires_grad_()
    out = ops.attention(*low, off, N, alpha, lkw.get("num_targets"), lkw.get("attn_scale"),
                        lkw.get("max_attn_len", 0), lkw.get("contextual_seq_len", 0),
                        lkw.get("min_full_attn_seq_len", 0), causal, lkw.get("rab"), lkw.get("intervals"))
    hi = [t.requires_grad_() for t in (q, k, v)]
    if "rab" in kw:
        kw["rab"].requires_grad_()
    want = hstu_mha(N, alpha, *hi, off, causal=causal, **kw)
    tol = TOL[dtype]
    if not check_output(out, want, tol):
        return
    g = torch.randn_like(want)
    leaves = [*low, lkw["rab"]] if "rab" in lkw else low
    got = torch.autograd.grad(out, leaves, g.to(dtype))
    ref = torch.autograd.grad(want, [*hi, kw["rab"]] if "rab" in kw else hi, g)
    for name, a, b in zip(["dq", "dk", "dv", "drab"], got, ref):
        if b.any():
            assert rel_err(a, b) < tol, name


@SETTINGS
@given(c=cases(), rows=st.integers(1, 80))
def test_delta_attention_op_fuzz(c, rows):
    """Cached attention: the last ``rows`` rows of every sequence (lengths raised to >= rows)."""
    c = dict(c, lengths=[max(n, min(rows, c["N"])) for n in c["lengths"]], rab=None)
    rows = min(rows, c["N"])
    if c["mask"] == "intervals" or c["mask"] == "noncausal":
        c["mask"] = "causal"
    c["opts"] = {k: v for k, v in c["opts"].items() if k != "min_full_attn_seq_len"}
    (q, k, v), off, kw = _inputs(c)
    ends = off[1:]
    idx = (ends[:, None] - rows + torch.arange(rows, device=DEVICE)[None, :]).reshape(-1)
    dq = q[idx]
    if c["scale"] == "row":
        kw["attn_scale"] = kw["attn_scale"][idx]
    kw.pop("intervals", None)
    dtype, N, alpha = c["dtype"], c["N"], 1.0 / c["Dq"]
    lkw = _cast(kw, dtype)
    out = ops.delta_attention(dq.to(dtype), k.to(dtype), v.to(dtype), off, N, alpha, lkw.get("num_targets"),
                              lkw.get("attn_scale"), lkw.get("max_attn_len", 0), lkw.get("contextual_seq_len", 0))
    want = delta_hstu_mha(N, alpha, dq, k, v, off, **kw)
    check_output(out, want, TOL[dtype])
