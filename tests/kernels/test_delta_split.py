"""Cached attention with the key range split across programs (kernels/delta.py) against fp64.

The partial outputs of the splits add exactly (HSTU has no softmax), so every split count must give
the reference's answer, for every mask option of cached attention. The last program of a row block
folds the partials in a fixed order: the output is bitwise repeatable and bitwise equal to the
two-launch sum, and the cached counters are left zero. The interpreter runs programs one by one, so
the GPU tests check the fold under concurrency (streams, CUDA graphs, torch.compile).
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from hstu_inductor.kernels import attention as K
from hstu_inductor.kernels import common, delta, delta_plans
from hstu_inductor.kernels.delta_plans import Plan
from hstu_inductor.reference import delta_hstu_mha
from hstu_inductor.spec import AttentionSpec

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite values (unwritten output?)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _batch(lengths, H, Dq, Dv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(lengths).cumsum(0)
    L = sum(lengths)
    k, v = torch.randn(L, H, Dq, generator=g), torch.randn(L, H, Dv, generator=g)
    dq = torch.randn(len(lengths) * D, H, Dq, generator=g)
    return (t.to(DEV, dtype) for t in (dq, k, v)), off.to(DEV)


def _cases(B, D, g):
    """Every mask option of cached attention, and the three scale modes."""
    return [
        {},
        dict(num_targets=torch.tensor([2, 1, 0, 0, 3]), contextual_seq_len=3, max_attn_len=5,
             attn_scale=torch.rand(B * D, generator=g) + 0.5),
        dict(num_targets=torch.tensor([2, 1, 0, 0, 3]), contextual_seq_len=3),
        dict(max_attn_len=6, num_targets=torch.tensor([1, 4, 2, 0, 0])),
        dict(max_attn_len=4, contextual_seq_len=2),
        dict(attn_scale=torch.tensor([0.25])),
    ]


def _reference(N, alpha, dq, k, v, off, kw):
    kw64 = {a: (b.double() if a == "attn_scale" else b) for a, b in kw.items()}
    return delta_hstu_mha(N, alpha, dq.double(), k.double(), v.double(), off, **kw64)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter-sized cases; the gpu-marked tests cover CUDA")
# 1-3: uneven shares of the 5 key tiles; 8: empty splits. Together they draw each of the four rotated
# option sets once (2 + split % 4).
@pytest.mark.parametrize("split", (1, 2, 3, 8))
def test_fold_equals_reference(split, monkeypatch):
    """Splits over 1-5 key tiles of 16 (empty splits, uneven shares), fresh inputs, poisoned outputs
    and partials: the one-launch fold against fp64, bitwise repeatable, equal to the two-launch sum and to
    a fresh counter buffer, counters left zero."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)
    monkeypatch.setattr(delta, "_COUNTERS", {})
    lengths = [70, 9, 33, 3, 64]
    N, H, Dq, Dv, D = 72, 2, 32, 16, 3
    B = len(lengths)
    (dq, k, v), off = _batch(lengths, H, Dq, Dv, D, torch.float32, seed=split)
    cases = _cases(B, D, torch.Generator().manual_seed(100 + split))
    for i, kw in enumerate(cases[:2] + [cases[2 + split % 4]]):  # plain, all options, one rotated
        run = functools.partial(delta.delta_forward, dq, k, v, off, N, 0.3, split=split, config=(16, 2, 4), **kw)
        out = run()
        assert out.shape == (B * D, H, Dv)
        assert rel_err(out, _reference(N, 0.3, dq, k, v, off, kw)) < 2e-4, (split, kw)
        assert torch.equal(run(), out), (split, kw)
        if i == 0:
            assert torch.equal(run(fold=False), out)
            monkeypatch.setattr(delta, "CACHE_COUNTERS", False)
            assert torch.equal(run(), out)
            monkeypatch.setattr(delta, "CACHE_COUNTERS", True)
    counters = list(delta._COUNTERS.values())
    assert len(counters) == (split > 1) and all(not c.any() for c in counters)


# Interpreter-sized plans: row blocks below, at and above the 37 rows, Q from shared memory, K/V by descriptors
# (the interpreter ignores warps and stages: what differs is the row tiling and the load code).
_SHAPES = {"m16": Plan(16, 16, 2, 4, 5), "m16qt": Plan(16, 16, 2, 4, 5, qsmem=True, tma=True),
           "m32q": Plan(32, 16, 2, 4, 5, qsmem=True), "m64t": Plan(64, 16, 2, 4, 5, tma=True)}


@pytest.mark.skipif(HAS_CUDA, reason="interpreter-sized cases; the gpu-marked tests cover CUDA")
# one split per shape by default, alternating (the other under -m slow)
@pytest.mark.parametrize("shape,split", [pytest.param(sh, sp, marks=[pytest.mark.slow] if (k + sp // 3) % 2 else [])
                                         for k, sh in enumerate(["m16qt", "m32q", "m64t"]) for sp in (1, 3)])
def test_plans_equal_reference(shape, split, monkeypatch):
    """37 rows in 1-3 row blocks (the last one partial), each split over the key tiles, with every mask option:
    against fp64, outputs poisoned, bitwise repeatable."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)
    lengths = [70, 40, 37, 45, 64]
    N, H, Dq, Dv, D = 72, 2, 32, 16, 37
    B = len(lengths)
    (dq, k, v), off = _batch(lengths, H, Dq, Dv, D, torch.float32, seed=split + 10 * len(shape))
    cases = _cases(B, D, torch.Generator().manual_seed(7 + split))
    for kw in cases[:2] + [cases[2 + len(shape) % 4]]:
        run = functools.partial(delta.delta_forward, dq, k, v, off, N, 0.3, split=split, plan=_SHAPES[shape], **kw)
        out = run()
        assert rel_err(out, _reference(N, 0.3, dq, k, v, off, kw)) < 2e-4, (shape, split, kw)
        assert torch.equal(run(), out), (shape, split, kw)


def _named_plans():
    """Every plan a table names: the defaults of PLANS and the benchmark's CANDIDATES."""
    plans = {f"default{bound}": plan for bound, plan in delta_plans.PLANS if plan is not None}
    return {**plans, **delta_plans.CANDIDATES}


@pytest.mark.skipif(HAS_CUDA, reason="interpreter-sized cases; the gpu-marked tests cover CUDA")
def test_named_plans_equal_reference(monkeypatch):
    """Each named plan, as it would launch (its own tiles; the fp32 pipeline for fp32 inputs), on fresh inputs
    with every mask option and a row scale, against fp64."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)
    lengths = [40, 9, 33, 64]
    N, H, Dq, Dv, D = 64, 2, 32, 16, 5
    g = torch.Generator().manual_seed(3)
    for i, (name, plan) in enumerate(_named_plans().items()):
        (dq, k, v), off = _batch(lengths, H, Dq, Dv, D, torch.float32, seed=100 + i)
        kw = dict(num_targets=torch.tensor([2, 1, 0, 3]), contextual_seq_len=3, max_attn_len=5,
                  attn_scale=torch.rand(len(lengths) * D, generator=g) + 0.5)
        out = delta.delta_forward(dq, k, v, off, N, 0.3, plan=plan, **kw)
        assert rel_err(out, _reference(N, 0.3, dq, k, v, off, kw)) < 2e-4, name


@pytest.mark.skipif(HAS_CUDA, reason="interpreter-sized cases; the gpu-marked tests cover CUDA")
@pytest.mark.parametrize("shape", ["m16", "m16qt", "m64t"])
def test_rows_before_a_short_sequence_are_zero(shape, monkeypatch):
    """Sequences shorter than the delta rows (the op's checks forbid them, the kernel must not read before the
    sequence): the rows before its start are zero, as in the full forward's row blocks, the rest equal. Dq = 24:
    the masked columns of the Q load and of the K descriptor."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)
    lengths = [2, 40, 5, 19]
    N, H, Dq, Dv, D = 48, 2, 24, 16, 19
    (dq, k, v), off = _batch(lengths, H, Dq, Dv, D, torch.float32, seed=5)
    # contextual: positions < 0 have id 0, as contextual rows (the element mask's i >= 0 keeps them out too)
    out = delta.delta_forward(dq, k, v, off, N, 0.3, plan=_SHAPES[shape], split=2, contextual_seq_len=3)
    want = K.delta_hstu_attention_fwd(dq, k, v, off, N, 0.3, contextual_seq_len=3, tma=False)
    rows = out.view(len(lengths), D, H, Dv)
    assert not rows[0, :D - 2].any() and not rows[2, :D - 5].any() and rows[1].abs().sum() > 0
    assert rel_err(out, want) < 1e-5


def test_plan_table(monkeypatch):
    """PLANS picks by rows (the first bound >= rows), fp32 gets its pipeline with row blocks <= 64, and a bound
    mapped to None (or rows past the table) routes delta_attention_fwd to the full forward's row blocks."""
    P = delta_plans
    monkeypatch.setattr(P, "PLANS", ((16, Plan(16, 32, 3, 4, 5)), (64, None), (128, Plan(128, 32, 3, 8, 2, tma=True))))
    assert P.default_plan(1).block_m == 16 and P.default_plan(16).block_m == 16
    assert P.default_plan(17) is None and P.default_plan(64) is None and P.default_plan(129) is None
    assert P.default_plan(100) == P.PLANS[2][1] and P.max_rows() == 128 == delta.max_delta_rows()
    f = P.default_plan(100, fp32=True)
    assert (f.block_m, f.block_n, f.stages, f.warps, f.tma) == (64, 32, 3, 8, False)
    calls = []
    monkeypatch.setattr(delta, "delta_forward", lambda *a, **kw: calls.append(("plan", kw["plan"].block_m)))
    monkeypatch.setattr(K, "delta_hstu_attention_fwd", lambda *a, **kw: calls.append(("rowblk",)))
    k = torch.empty(64, 1, 8, dtype=torch.bfloat16)
    for rows, dtype in ((3, torch.bfloat16), (40, torch.bfloat16), (100, torch.bfloat16), (100, torch.float32),
                        (200, torch.bfloat16)):
        delta.delta_attention_fwd(torch.empty(2 * rows, 1, 8, dtype=dtype), k, k, torch.tensor([0, 32, 64]), 32, 0.1)
    assert calls == [("plan", 16), ("rowblk",), ("plan", 128), ("plan", 64), ("rowblk",)]


def test_long_cache_plan():
    """LONG: the rows of its bound take its plan from its key count on (16-bit only); fewer keys, fp32 inputs and
    other rows keep PLANS'."""
    P = delta_plans
    for bound, (min_keys, plan) in P.LONG.items():
        short = P.default_plan(bound, max_seq_len=min_keys - 1)
        assert short != plan and P.default_plan(bound, max_seq_len=min_keys) == plan
        assert P.default_plan(bound, fp32=True, max_seq_len=min_keys) == P.default_plan(bound, fp32=True)
        below = max(b for b, _ in P.PLANS if b < bound)
        assert P.default_plan(below, max_seq_len=min_keys) == P.default_plan(below)


def test_tma_switch(monkeypatch):
    """K/V descriptors: the op's tma=False wins over a plan's, tma=None follows the plan where usable."""
    x = torch.empty(8, 2, 16)
    dev = x.device
    on, off = Plan(16, 16, 2, 4, 5, tma=True), Plan(16, 16, 2, 4, 5)
    monkeypatch.setattr(K, "tma_supported", lambda device=None: True)
    assert delta._use_tma(None, on, dev, x, x) and not delta._use_tma(None, off, dev, x, x)
    assert not delta._use_tma(False, on, dev, x, x) and delta._use_tma(True, off, dev, x, x)
    assert not delta._use_tma(None, on, dev, x, x[:, :, 1:])  # an odd row stride: no descriptor


def test_counters_cached_and_fresh_when_traced(monkeypatch):
    monkeypatch.setattr(delta, "_COUNTERS", {})
    cpu = torch.device("cpu")
    x = torch.empty(1)
    a = delta._counters(5, cpu, x)
    assert a.shape == (8,) and not a.any() and delta._counters(8, cpu, x) is a
    b = delta._counters(9, cpu, x)  # grown: a new zeroed buffer replaces the old one
    assert b.shape == (16,) and list(delta._COUNTERS.values()) == [b]
    with FakeTensorMode() as mode:  # traced (as under torch.compile): a fresh buffer, the cache untouched
        c = delta._counters(5, cpu, mode.from_tensor(x))
    assert isinstance(c, FakeTensor) and c.shape == (5,) and list(delta._COUNTERS.values()) == [b]
    monkeypatch.setattr(delta, "CACHE_COUNTERS", False)
    assert delta._counters(5, cpu, x) is not b


def test_choose_split():
    # as many splits as one wave of slots holds, >= 4 key tiles per split, at most 16
    assert delta.choose_split(512, 32, 660) == 1  # B * H = 512 row blocks fill 132 SMs x 5
    assert delta.choose_split(128, 32, 660) == 5
    assert delta.choose_split(64, 64, 660) == 10
    assert delta.choose_split(64, 8, 660) == 2
    assert delta.choose_split(8, 4096, 660) == 16
    assert delta.choose_split(4096, 64, 660) == 1
    assert delta.choose_split(32, 3, 660) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [1, 16, 64, 128])
def test_gpu_split_equals_full_forward(D, dtype):
    """Real sizes: the split kernel against fp64 and against the full forward's delta path."""
    B, N, H, Dm = 32, 1024, 4, 128
    g = torch.Generator().manual_seed(D)
    lengths = torch.randint(D, N + 1, (B,), generator=g).tolist()
    (dq, k, v), off = _batch(lengths, H, Dm, Dm, D, dtype, seed=D)
    nt = torch.randint(0, 21, (B,), generator=g).clamp(max=torch.tensor(lengths)).to(DEV)
    for kw in ({}, dict(num_targets=nt), dict(num_targets=nt, max_attn_len=200, contextual_seq_len=5)):
        ref = delta_hstu_mha(N, 1 / Dm, dq.double(), k.double(), v.double(), off, **kw)
        for split in (None, 1, 3):
            out = delta.delta_forward(dq, k, v, off, N, 1 / Dm, split=split, **kw)
            assert rel_err(out, ref) < (2e-2 if dtype == torch.bfloat16 else 2e-4), (split, kw)
        assert torch.equal(out, delta.delta_forward(dq, k, v, off, N, 1 / Dm, split=3, fold=False, **kw))
        spec = AttentionSpec(True, kw.get("max_attn_len", 0), kw.get("contextual_seq_len", 0))
        full = K._fwd(dq, k, v, off, N, 1 / Dm, kw.get("num_targets"), None, spec, D, None)
        assert rel_err(full, ref) < (2e-2 if dtype == torch.bfloat16 else 2e-4)


def _plan_rows():
    """(name, rows) for every named plan at the rows the benchmark times it (half to all of the rows rounded up
    to a power of two, >= 16)."""
    return [(name, D) for name, plan in _named_plans().items() for D in (1, 16, 64, 128)
            if max(16, 1 << (D - 1).bit_length()) // 2 <= plan.block_m <= max(16, 1 << (D - 1).bit_length())]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name,D", _plan_rows())
def test_gpu_plans_equal_reference(name, D, monkeypatch):
    """Every named plan at real sizes, bf16, against fp64 without and with the mask options; outputs poisoned,
    bitwise repeatable. B=32: 128 row blocks, fewer than the slots, so the 128-row plans split and fold."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)
    B, N, H, Dm = 32, 1024, 4, 128
    g = torch.Generator().manual_seed(D + 1)
    lengths = torch.randint(max(D, N // 2), N + 1, (B,), generator=g).tolist()
    (dq, k, v), off = _batch(lengths, H, Dm, Dm, D, torch.bfloat16, seed=D + 2)
    nt = torch.randint(0, 21, (B,), generator=g).to(DEV)
    for kw in ({}, dict(num_targets=nt, max_attn_len=200, contextual_seq_len=5)):
        ref = delta_hstu_mha(N, 1 / Dm, dq.double(), k.double(), v.double(), off, **kw)
        run = functools.partial(delta.delta_forward, dq, k, v, off, N, 1 / Dm, plan=_named_plans()[name], **kw)
        out = run()
        assert rel_err(out, ref) < 2e-2, (name, D, kw)
        assert torch.equal(run(), out), (name, D, kw)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["m128n32s3w8qt", "m128n32s3w8qr128"])
def test_gpu_plan_compiled(name, monkeypatch):
    """``hstu::delta_attention`` under torch.compile with 128 rows routed to a plan: K/V descriptors created
    inside Inductor's launch, or a register cap that a traced launch drops. Bitwise equal to an eager launch of
    the plan without the cap (the kernel a traced launch compiles), every call."""
    import hstu_inductor.ops  # noqa: F401  (registers torch.ops.hstu)

    plan = delta_plans.CANDIDATES[name]
    monkeypatch.setattr(delta_plans, "PLANS", ((128, plan),))
    torch._dynamo.reset()
    batches = _gpu_batches(8, 1024, 2, 128, 128, seed=5)  # 16 row blocks: split 8, the fold
    fn = torch.compile(lambda *a: torch.ops.hstu.delta_attention(*a, 1024, 1 / 128), fullgraph=True)
    for it in range(3):
        t, off = batches[it % 2]
        want = delta.delta_forward(*t, off, 1024, 1 / 128, plan=plan._replace(maxnreg=0))
        assert torch.equal(fn(*t, off), want), it
    torch._dynamo.reset()


def _gpu_batches(B, N, H, Dm, D, count=2, seed=0):
    """``count`` batches of the same lengths in [D, N] (one of D: fewer key tiles than splits), different
    values, bf16 on the GPU: ``[((delta_q, k, v), offsets)]``."""
    lengths = torch.randint(D, N + 1, (B,), generator=torch.Generator().manual_seed(seed)).tolist()
    lengths[0] = D
    return [(tuple(t), off) for t, off in (_batch(lengths, H, Dm, Dm, D, torch.bfloat16, seed + i)
                                           for i in range(count))]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("split", [2, 5, 16])
def test_gpu_fold_concurrent_bitwise(split, monkeypatch):
    """Up to 16 programs per row block finishing together: the fold reads every partial (poisoned with NaN
    before each call; the inputs alternate, so a stale partial would differ) and equals the two-launch sum
    bitwise, every time; the cached counters are zero afterwards."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)
    batches = _gpu_batches(64, 512, 4, 128, 4)
    want = [delta.delta_forward(*t, off, 512, 1 / 128, split=split, fold=False) for t, off in batches]
    for it in range(40):
        t, off = batches[it % 2]
        assert torch.equal(delta.delta_forward(*t, off, 512, 1 / 128, split=split), want[it % 2]), it
    torch.cuda.synchronize()
    assert delta._COUNTERS and not any(c.any() for c in delta._COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_fold_two_streams():
    """Two streams folding at once use two counter buffers; both stay bitwise right."""
    batches = _gpu_batches(16, 1024, 4, 128, 2, seed=7)
    want = [delta.delta_forward(*t, off, 1024, 1 / 128, split=8, fold=False) for t, off in batches]
    streams = [torch.cuda.Stream() for _ in batches]
    outs = [[] for _ in batches]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    for _ in range(10):
        for st, (t, off), o in zip(streams, batches, outs):
            with torch.cuda.stream(st):
                o.append(delta.delta_forward(*t, off, 1024, 1 / 128, split=8))
    for st in streams:
        torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    assert all(torch.equal(x, w) for o, w in zip(outs, want) for x in o)
    keys = {key for key in delta._COUNTERS if key[1] in {st.cuda_stream for st in streams}}
    assert len(keys) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_fold_cuda_graph():
    """A captured launch gets its own zeroed counters (not the cache): replays, with eager launches in
    between, stay bitwise equal to eager."""
    batches = _gpu_batches(16, 1024, 4, 128, 2, seed=11)
    off = batches[0][1]
    want = [delta.delta_forward(*t, off, 1024, 1 / 128, split=8) for t, _ in batches]
    static = [x.clone() for x in batches[0][0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs recommends
        delta.delta_forward(*static, off, 1024, 1 / 128, split=8)
    torch.cuda.current_stream().wait_stream(side)
    cached = dict(delta._COUNTERS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = delta.delta_forward(*static, off, 1024, 1 / 128, split=8)
    assert delta._COUNTERS == cached  # nothing cached for the capture stream
    for it in range(6):
        for a, b in zip(static, batches[it % 2][0]):
            a.copy_(b)
        graph.replay()
        eager = delta.delta_forward(*batches[it % 2][0], off, 1024, 1 / 128, split=8)
        torch.cuda.synchronize()
        assert torch.equal(out, want[it % 2]) and torch.equal(eager, want[it % 2]), it


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_fold_compiled(mode):
    """``hstu::delta_attention`` under torch.compile (the kernel traced through wrap_triton, counters a graph
    buffer) and CUDA graphs: bitwise equal to eager, every call; no CUDA-graph skip."""
    from torch._dynamo.utils import counters

    import hstu_inductor.ops  # noqa: F401  (registers torch.ops.hstu)

    torch._dynamo.reset()
    counters.clear()
    batches = _gpu_batches(4, 1024, 2, 128, 2, seed=3)  # 8 row blocks: split 8, the fold
    op = torch.ops.hstu.delta_attention
    fn = torch.compile(lambda *a: op(*a, 1024, 1 / 128), mode=mode, fullgraph=True)
    for it in range(4):
        t, off = batches[it % 2]
        torch.compiler.cudagraph_mark_step_begin()
        out = fn(*t, off)
        assert torch.equal(out, op(*t, off, 1024, 1 / 128)), it
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._dynamo.reset()
