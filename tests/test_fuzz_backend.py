"""Hypothesis fuzzing of ``backend="hstu"`` against eager on the plain reference attention.

CPU (CI): two compiled configurations (training with targets in fp32; inference with window,
contextual prefix, min-full rows and per-row attn_scale in fp64), each compiled once with dynamic
``L`` and ``B`` (``mark_dynamic``), then fed drawn batches: lengths with the edge values 0, 1 and N
mixed in, num_targets 0, = length or anything between. Examples are derandomized and few, so CI
is deterministic and its share small (two compiles). Every compiled frame must be rewritten.

GPU (``@pytest.mark.gpu``): random shapes, masks, dtypes and train/infer per example, each compiled
afresh, required to be rewritten, and compared with an fp64 eager reference. ``HSTU_GPU_FUZZ_EXAMPLES=n``
runs ``n`` random (not derandomized) examples instead of the fixed 12 (``--hypothesis-seed`` then applies).
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

from hstu_inductor.reference import hstu_mha
from hstu_inductor.report import collecting

from _helpers import check_output, offsets_from_lengths, rel_err

CPU_SETTINGS = settings(max_examples=6, deadline=None, derandomize=True, database=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def jagged_batches(draw, N, min_batch=2, max_batch=5, min_rows=2):
    """(lengths, num_targets, seed): lengths in [0, N] with 0, 1 and N favoured; targets 0, = length
    or in between."""
    B = draw(st.integers(min_batch, max_batch))
    length = st.one_of(st.just(0), st.just(1), st.just(N), st.integers(0, N))
    lengths = draw(st.lists(length, min_size=B, max_size=B))
    assume(sum(lengths) >= min_rows)
    targets = [draw(st.one_of(st.just(0), st.just(n), st.integers(0, n))) for n in lengths]
    return lengths, targets, draw(st.integers(0, 2**16))


# name: (N, H, D, dtype, train, hstu_mha options, per-row attn_scale, tolerance)
CONFIGS = {
    "train_targets_fp32": (6, 2, 4, torch.float32, True, dict(), False, 1e-5),
    "infer_window_ctx_scale_fp64": (5, 1, 3, torch.float64, False,
                                    dict(max_attn_len=2, contextual_seq_len=1, min_full_attn_seq_len=1), True, 1e-10),
}


class _Compiled:
    """One compiled function per configuration, shared by the examples; counts frames and rewrites."""

    def __init__(self, fn):
        self.counter = CompileCounterWithBackend("hstu")
        self.fn = torch.compile(fn, backend=self.counter)
        self.rewrites = 0

    def __call__(self, *args):
        for a in args:
            if isinstance(a, torch.Tensor):
                torch._dynamo.mark_dynamic(a, 0)
        with collecting() as report:
            out = self.fn(*args)
        self.rewrites += report.counts["attention"]
        assert self.counter.frame_count == 1, "dynamic L and B must not recompile"
        assert self.rewrites == self.counter.frame_count, "the compiled frame was not rewritten"
        return out


@pytest.fixture
def compiled():
    # fresh per configuration: a recompile of the same code with other H, D would mark them dynamic
    torch._dynamo.reset()
    cache = {}
    yield cache
    torch._dynamo.reset()


def _user_fn(N, opts, alpha=0.4):
    def attn(q, k, v, off, nt, scale=None):
        return hstu_mha(N, alpha, q, k, v, off, num_targets=nt, attn_scale=scale, **opts)
    return attn


def _inputs(lengths, targets, seed, H, D, dtype, train, scaled, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    q, k, v = (torch.randn(L, H, D, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(3))
    if train:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    args = [q, k, v, offsets_from_lengths(lengths).to(device), torch.tensor(targets, device=device)]
    if scaled:
        args.append((torch.rand(L, generator=g, dtype=torch.float64) + 0.1).to(device, dtype))
    return args


def _check(fn_compiled, fn_eager, args, train, tol):
    out = fn_compiled(*args)
    ref = fn_eager(*args)
    if not ref.any():  # all rows masked or empty: nothing to compare relatively
        assert torch.equal(out, ref)
        return
    assert rel_err(out, ref) < tol
    if train:
        g = torch.randn_like(ref)
        got = torch.autograd.grad(out, args[:3], g)
        want = torch.autograd.grad(ref, args[:3], g)
        for name, a, b in zip("qkv", got, want):
            assert rel_err(a, b) < 10 * tol, f"d{name}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_backend_matches_eager_fuzz(name, compiled):
    N, H, D, dtype, train, opts, scaled, tol = CONFIGS[name]
    eager = _user_fn(N, opts)

    @CPU_SETTINGS
    @given(batch=jagged_batches(N))
    def run(batch):
        if name not in compiled:
            compiled[name] = _Compiled(eager)
        lengths, targets, seed = batch
        args = _inputs(lengths, targets, seed, H, D, dtype, train, scaled)
        if train:
            _check(compiled[name], eager, args, True, tol)
        else:
            with torch.no_grad():
                _check(compiled[name], eager, args, False, tol)

    run()


# ------------------------------------------------------------------------------------------------
# GPU: random shapes, masks, dtypes and modes per example (fresh compile each)
# ------------------------------------------------------------------------------------------------
GPU_TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@st.composite
def gpu_cases(draw):
    N = draw(st.one_of(st.just(1), st.integers(2, 300)))
    lengths, targets, seed = draw(jagged_batches(N, min_batch=1, max_batch=8, min_rows=0))
    causal = True  # non-causal only without masks (below)
    opts = {}
    if draw(st.booleans()):
        opts = dict(max_attn_len=draw(st.integers(0, N)), contextual_seq_len=draw(st.integers(0, 4)))
        if opts["max_attn_len"]:
            opts["min_full_attn_seq_len"] = draw(st.integers(0, N))
    use_targets = draw(st.booleans())
    if not opts and not use_targets and draw(st.booleans()):
        causal = False
    return dict(N=N, lengths=lengths, targets=targets if use_targets else None, seed=seed, causal=causal,
                opts=opts, H=draw(st.integers(1, 4)), D=draw(st.sampled_from([16, 24, 32, 64, 128])),
                dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
                train=draw(st.booleans()), scaled=draw(st.booleans()))


GPU_EXAMPLES = int(os.environ.get("HSTU_GPU_FUZZ_EXAMPLES", "0"))
GPU_SETTINGS = settings(max_examples=GPU_EXAMPLES or 12, deadline=None, derandomize=not GPU_EXAMPLES, database=None,
                        suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.gpu
@GPU_SETTINGS
@given(case=gpu_cases())
def test_backend_matches_eager_fuzz_gpu(case):
    torch._dynamo.reset()
    N, H, D, dtype, train = case["N"], case["H"], case["D"], case["dtype"], case["train"]
    nt = case["targets"]

    def attn(q, k, v, off, nt_, scale=None):
        return hstu_mha(N, 1.0 / D, q, k, v, off, causal=case["causal"], num_targets=nt_, attn_scale=scale,
                        **case["opts"])

    args = _inputs(case["lengths"], nt if nt is not None else [0] * len(case["lengths"]), case["seed"], H, D,
                   dtype, train, case["scaled"], device="cuda")
    if nt is None:
        args[4] = None
    compiled = torch.compile(attn, backend="hstu")
    ctx = torch.enable_grad() if train else torch.no_grad()
    with ctx, collecting() as report:
        out = compiled(*args)
    # Dynamo specialises sizes 0 and 1: a first compile at L < 2 or N = 1 is a degenerate graph (no
    # query/key pairing to prove), and the next real batch recompiles; every other graph must be rewritten
    if sum(case["lengths"]) >= 2 and N >= 2:
        assert report.counts["attention"] == 1, f"not rewritten: {report}"
    with ctx:
        ref64 = [a.detach().double().requires_grad_(train) if i < 3 else
                 (a.double() if i == 5 else a) for i, a in enumerate(args)]
        ref = attn(*ref64)
    tol = GPU_TOL[dtype]
    if not check_output(out, ref, tol):
        return
    if train and out.numel():
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, args[:3], g)
        want = torch.autograd.grad(ref, ref64[:3], g.double())
        for name, a, b in zip("qkv", got, want):
            if b.any():
                assert rel_err(a, b) < tol, f"d{name}"
