"""Triton kernels with a dense rab, the in-kernel table bias (pos_w / ts_w from timestamps) and interval
masks (docs/semantics.md) against the fp64 reference (``relative_bias`` + the dense path).

CPU: the Triton interpreter at small sizes (fresh random inputs, lengths 0, 1 and N, NaN-poisoned
outputs); ``@pytest.mark.gpu``: bf16/fp16 at realistic sizes.
"""
from __future__ import annotations

import pytest
import torch

from hstu_inductor import config
from hstu_inductor.kernels import attention as K
from hstu_inductor.kernels import common
from hstu_inductor.reference import hstu_mha, relative_bias, sla_intervals

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
SMALL = pytest.mark.skipif(HAS_CUDA, reason="interpreter-sized cases; the gpu-marked tests cover CUDA")
TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
LENGTHS = [13, 0, 1, 32]  # includes 0, 1 and N
N = 32


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite values (unwritten output?)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)


def _batch(lengths, H, D, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(lengths).cumsum(0)
    L = sum(lengths)
    q, k, v, dout = (torch.randn(L, H, D, generator=g).to(dtype=dtype, device=device) for _ in range(4))
    return q, k, v, dout, off.to(device)


def _rab(shape, n, H, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, n, n, generator=g).to(dtype=dtype, device=device)


def _random_intervals(lengths, heads, seed, device=DEV):
    """Sorted random triples per head and row, values in [0, n_b + 2] (past n_b on purpose)."""
    g = torch.Generator().manual_seed(seed)
    cols = [torch.randint(0, n + 3, (heads, n, 3), generator=g) for n in lengths]
    return torch.cat(cols, dim=1).sort(dim=-1).values.to(device)


def _check(q, k, v, dout, off, n, alpha, *, rab=None, intervals=None, tma=False, deterministic=True,
           tol=None, ref_inputs=None, tables=None, ts_bounds=None, ts_next=True, **kw):
    """Kernel fwd + bwd (incl. d rab, d pos_w, d ts_w) against autograd through the fp64 reference.
    ``tables``: (timestamps, pos_w or None, ts_w or None), the reference bias ``relative_bias``."""
    tol = tol or TOL[q.dtype]
    tkw = {}
    if tables is not None:
        tkw = dict(timestamps=tables[0] if tables[2] is not None else None, pos_w=tables[1], ts_w=tables[2])
        if ts_bounds is not None:
            tkw["ts_bounds"] = ts_bounds
        if not ts_next:
            tkw["ts_next"] = False
    out = K.hstu_attention_fwd(q, k, v, off, n, alpha, tma=tma, rab=rab, intervals=intervals, **tkw, **kw)
    got = K.hstu_attention_bwd(dout, q, k, v, off, n, alpha, tma=tma, deterministic=deterministic, rab=rab,
                               intervals=intervals, rab_grad=rab is not None, table_grad=tables is not None,
                               **tkw, **kw)
    rq, rk, rv, rdo = ref_inputs or (q, k, v, dout)
    leaves = [t.detach().double().requires_grad_() for t in (rq, rk, rv)]
    rab64 = None if rab is None else rab.detach().double().requires_grad_()
    bias, names, dtypes = rab64, ["dq", "dk", "dv"], [q.dtype] * 3
    want_leaves = list(leaves) + ([rab64] if rab is not None else [])
    names += ["drab"] if rab is not None else []
    dtypes += [rab.dtype] if rab is not None else []
    if tables is not None:
        tabs = [None if t is None else t.detach().double().requires_grad_() for t in tables[1:]]
        tb = relative_bias(tables[0], off, n, *tabs, ts_bounds=ts_bounds, ts_next=ts_next)
        bias = tb if bias is None else bias + tb
        for name, t, t64 in zip(("dpos", "dts"), tables[1:], tabs):
            if t is not None:
                want_leaves.append(t64)
                names.append(name)
                dtypes.append(t.dtype)
        got = got[:-2] + tuple(g for g in got[-2:] if g is not None)
    ref = hstu_mha(n, alpha, *leaves, off, rab=bias, intervals=intervals, training=False, **kw)
    ref.backward(rdo.double())
    want = [t.grad for t in want_leaves]
    assert out.dtype == q.dtype and rel_err(out, ref) < tol, f"fwd {rel_err(out, ref):.2e}"
    assert len(got) == len(want)
    for name, dt, x, r in zip(names, dtypes, got, want):
        assert x.shape == r.shape and x.dtype == dt, name
        e = rel_err(x, r)
        assert e < tol, f"{name} rel err {e:.2e}"


# ------------------------------------------------------------------------------------------
# CPU (interpreter)
# ------------------------------------------------------------------------------------------

def _mask_kwargs(opts, rows, seed):
    """Kernel keywords from a case's mask options: tensors for num_targets, attn_scale ("scalar" / "rows")
    and intervals (True: random per head and row)."""
    kw = dict(opts)
    if "num_targets" in kw:
        kw["num_targets"] = torch.tensor(kw["num_targets"], device=DEV)
    if kw.get("attn_scale") == "scalar":
        kw["attn_scale"] = torch.tensor(0.21, device=DEV)
    elif kw.get("attn_scale") == "rows":
        kw["attn_scale"] = torch.rand(rows, device=DEV) + 0.2
    if kw.pop("intervals", False):
        kw["intervals"] = _random_intervals(LENGTHS, 2, seed=seed)
    return kw


RAB_CASES = {  # rab broadcast shape, mask options, tma, backward algorithm
    "BH_ctx_targets": ((4, 2), dict(contextual_seq_len=3, num_targets=[2, 0, 1, 3]), True, "split"),
    "1H_window_minfull": ((1, 2), dict(max_attn_len=5, min_full_attn_seq_len=4), False, "atomic"),
    "B1_noncausal_scale": ((4, 1), dict(causal=False, attn_scale="scalar"), False, "split"),
    "11_causal_rowscale": ((1, 1), dict(attn_scale="rows", num_targets=[1, 0, 0, 2]), True, "atomic"),
}


@SMALL
@pytest.mark.parametrize("case", list(RAB_CASES))
def test_rab_fwd_bwd(case, poison, monkeypatch):
    shape, opts, tma, algo = RAB_CASES[case]
    monkeypatch.setattr(config, "bwd_algo", algo)
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=hash(case) % 997)
    kw = _mask_kwargs(opts, q.shape[0], seed=0)
    rab = _rab(shape, N, 2, torch.float32, seed=len(case))
    _check(q, k, v, dout, off, N, 0.25, rab=rab, tma=tma, deterministic=algo == "split", **kw)


@SMALL
@pytest.mark.parametrize("heads,with_rab,tma", [(1, False, False), (2, True, True)], ids=["1head", "Hheads_rab"])
def test_intervals_random(heads, with_rab, tma, poison):
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=20 + heads)
    iv = _random_intervals(LENGTHS, heads, seed=heads)
    rab = _rab((1, 2), N, 2, torch.float32, seed=3) if with_rab else None
    _check(q, k, v, dout, off, N, 0.3, rab=rab, intervals=iv.to(torch.int32 if heads == 1 else torch.int64),
           tma=tma)


@SMALL
def test_sla_intervals_atomic_and_rab(poison, monkeypatch):
    monkeypatch.setattr(config, "bwd_algo", "atomic")
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=31)
    iv = sla_intervals(off, torch.tensor([3, 0, 1, 4]), k1=4, k2=2, contextual_seq_len=3)
    _check(q, k, v, dout, off, N, 0.3, intervals=iv, deterministic=False)
    _check(q, k, v, dout, off, N, 0.3, intervals=iv, rab=_rab((4, 1), N, 2, torch.float32, seed=4), tma=True)


@SMALL
@pytest.mark.parametrize("algo", ["split", "atomic"])
def test_interval_tile_skipping(algo, poison, monkeypatch):
    """A 16-row band that no row sees and whose rows see nothing: its q/k/v/dO rows hold NaN, which any
    visit of its tiles would spread (v, dO enter dots with zero weights), so finite results that match
    the reference on zeroed rows prove that whole key tiles (fwd, dQ) and query tiles (dK/dV) are
    skipped. The other rows' intervals span both sides of the band (the gap between x0 and x1)."""
    monkeypatch.setattr(config, "bwd_algo", algo)
    lengths, n = [48, 5, 40], 48
    q, k, v, dout, off = _batch(lengths, 2, 16, torch.float32, seed=41)
    g = torch.Generator().manual_seed(42)
    iv = _random_intervals(lengths, 2, seed=43)
    x0 = torch.randint(0, 17, (2, 16), generator=g)
    x1 = torch.randint(32, 49, (2, 16), generator=g)
    x2 = torch.maximum(x1, torch.randint(32, 51, (2, 16), generator=g))
    iv[:, :16] = iv[:, :16].clamp(max=16)
    iv[:, 16:32] = 0
    iv[:, 32:48] = torch.stack([x0, x1, x2], dim=-1)
    band = slice(16, 32)
    clean = [t.clone() for t in (q, k, v, dout)]
    for t, c in zip((q, k, v, dout), clean):
        t[band] = float("nan")
        c[band] = 0.0
    rab = _rab((1, 2), n, 2, torch.float32, seed=44)
    with K.force_configs(fwd=(16, 16, 4, 1), dkdv=(16, 16, 4, 1), dq=(16, 16, 4, 1)):
        _check(q, k, v, dout, off, n, 0.3, rab=rab, intervals=iv, deterministic=algo == "split",
               ref_inputs=clean)


def _tables(lengths, n, num_buckets, ts_dtype, which, seed, device=DEV):
    """(timestamps [L], pos_w, ts_w) with fresh random values. Timestamps: increasing with random gaps
    spanning 1 s .. 1e8 s (many buckets, clamping at num_buckets), repeats (dt = 0) and a few shuffled rows
    (negative dt); int timestamps near 1.7e9 (fp64 bucket boundaries)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for length in lengths:
        gaps = (10 ** (torch.rand(length, generator=g, dtype=torch.float64) * 8)).floor()
        gaps[torch.rand(length, generator=g) < 0.2] = 0
        t = 1.7e9 + gaps.cumsum(0) if ts_dtype == torch.int64 else gaps.cumsum(0) / 1e3
        if length > 3:
            t[:3] = t[torch.randperm(3, generator=g)]
        parts.append(t)
    ts = torch.cat(parts).to(ts_dtype).to(device)
    pos_w = torch.randn(2 * n - 1, generator=g).to(device) if "pos" in which else None
    ts_w = torch.randn(num_buckets + 1, generator=g).to(device) if "ts" in which else None
    return ts, pos_w, ts_w


TABLE_CASES = {  # tables, timestamp dtype, mask options, dense rab too, tma, backward algorithm
    "both_ctx_targets": ("pos+ts", torch.int64, dict(contextual_seq_len=3, num_targets=[2, 0, 1, 3],
                                                     attn_scale="scalar"), None, True, "split"),
    "pos_window_minfull": ("pos", torch.int64, dict(max_attn_len=5, min_full_attn_seq_len=4), None, False, "atomic"),
    "ts_noncausal_rows": ("ts", torch.float32, dict(causal=False, attn_scale="rows"), None, False, "split"),
    "both_intervals_rab1H": ("pos+ts", torch.int32, dict(intervals=True), (1, 2), True, "atomic"),
}


@SMALL
@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_table_bias_fwd_bwd(case, poison, monkeypatch):
    """(b): the bias computed in-kernel from timestamps and the two tables, crossed with every mask option;
    gradients to q, k, v and both tables (and a dense rab added on top in one case)."""
    which, ts_dtype, opts, rab_shape, tma, algo = TABLE_CASES[case]
    monkeypatch.setattr(config, "bwd_algo", algo)
    seed = sum(map(ord, case))
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=seed)
    kw = _mask_kwargs(opts, q.shape[0], seed=seed)
    rab = _rab(rab_shape, N, 2, torch.float32, seed=seed) if rab_shape else None
    tables = _tables(LENGTHS, N, 20, ts_dtype, which, seed=seed + 1)
    _check(q, k, v, dout, off, N, 0.25, rab=rab, tma=tma, deterministic=algo == "split", tables=tables, **kw)


MAP_CASES = {  # timestamps (jagged or dense [B, N]), gap, mask options, backward algorithm, buckets
    "jagged_next_targets": (False, True, dict(num_targets=[2, 0, 1, 3]), "atomic", 20),
    "dense_own_window": (True, False, dict(max_attn_len=5), "split", 20),
    "jagged_next_ctx": (False, True, dict(contextual_seq_len=3), "atomic", 20),  # the map's upper triangle too
    "dense_next_noncausal": (True, True, dict(causal=False), "atomic", 20),
    "jagged_next_int16_map": (False, True, dict(), "atomic", 300),  # more buckets than a byte holds
}


@SMALL
@pytest.mark.parametrize("case", list(MAP_CASES))
def test_bucket_map_equals_per_tile_buckets(case, poison, monkeypatch):
    """The buckets read from the call's [B, N, N] map (kernels/bucket_map.py, unwritten elements poisoned to
    the dtype's max) give the same output and gradients, bit for bit, as every kernel computing its own; and
    the kernels take the map only within ``config.bucket_map_mb``."""
    from hstu_inductor.kernels import bucket_map

    dense, ts_next, opts, algo, nb = MAP_CASES[case]
    monkeypatch.setattr(config, "bwd_algo", algo)
    monkeypatch.setattr(config, "table_grad_mb", 0)  # both table gradients summed in the dK/dV kernel
    seed = sum(map(ord, case))
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=seed)
    kw = _mask_kwargs(opts, q.shape[0], seed=seed)
    ts, pos_w, ts_w = _tables(LENGTHS, N, nb, torch.int64, "pos+ts", seed=seed + 1)
    if dense:
        ts = _dense_stamps(ts, LENGTHS, N, seed + 2)
    tkw = dict(timestamps=ts, pos_w=pos_w, ts_w=ts_w, ts_next=ts_next)
    used = []
    real = bucket_map.with_bucket_map

    def spy(*a):
        got = real(*a)
        used.append(got[1]["HAS_TS"])
        return got

    monkeypatch.setattr(K, "with_bucket_map", spy)
    results = {}
    for mb in (1024, 0):
        monkeypatch.setattr(config, "bucket_map_mb", mb)
        out = K.hstu_attention_fwd(q, k, v, off, N, 0.25, **tkw, **kw)
        grads = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.25, deterministic=algo == "split", table_grad=True,
                                     **tkw, **kw)
        results[mb] = (out, *grads[:3], *grads[-2:])
    assert used == [5, 5, 1 + dense + 2 * (not ts_next), 1 + dense + 2 * (not ts_next)]
    for name, a, b in zip(("out", "dq", "dk", "dv", "dpos", "dts"), results[1024], results[0]):
        assert torch.isfinite(a).all() and torch.equal(a, b), name
    _check(q, k, v, dout, off, N, 0.25, deterministic=algo == "split", tables=(ts, pos_w, ts_w),
           ts_next=ts_next, **kw)  # the map's path against the fp64 reference (bucket_map_mb = 0 now: the other)


DENSE_GRAD_CASES = {  # tables (per head: "H"), mask options, backward algorithm
    "both_targets_atomic": ("pos+ts", dict(num_targets=[2, 0, 1, 3]), "atomic"),
    "both_ctx_split": ("pos+ts", dict(contextual_seq_len=3, attn_scale="scalar"), "split"),
    "pos_window": ("pos", dict(max_attn_len=5, min_full_attn_seq_len=4), "atomic"),
    "ts_noncausal_rows": ("ts", dict(causal=False, attn_scale="rows"), "split"),
    "ts_300_buckets": ("ts", dict(), "atomic"),  # an int16 map; per-bucket sums by atomics, not registers
    "ts_heads_targets": ("ts H", dict(num_targets=[1, 0, 0, 2]), "atomic"),  # per head: summed in dK/dV
}


@SMALL
@pytest.mark.parametrize("case", list(DENSE_GRAD_CASES))
def test_table_grads_through_dense_buffer(case, poison, monkeypatch):
    """Within ``config.table_grad_mb`` the dK/dV kernel adds the bias gradient of shared tables into one dense
    buffer and kernels/table_grad.py reduces it into the tables (d pos_w by diagonals, d ts_w by the map's
    buckets): every gradient equals autograd through the fp64 reference, every mask option; with the budget at 0
    the in-kernel sums run instead and agree with it. Per-head tables always take the in-kernel sums."""
    from hstu_inductor.kernels import table_grad

    which, opts, algo = DENSE_GRAD_CASES[case]
    monkeypatch.setattr(config, "bwd_algo", algo)
    seed = sum(map(ord, case))
    H = 3
    q, k, v, dout, off = _batch(LENGTHS, H, 16, torch.float32, seed=seed)
    kw = _mask_kwargs(opts, q.shape[0], seed=seed)
    ts, pos_w, ts_w = _tables(LENGTHS, N, 300 if "300" in case else 20, torch.int64, which, seed=seed + 1)
    if "H" in which:
        ts_w = torch.randn(H, 21, generator=torch.Generator().manual_seed(seed + 2)).to(DEV)
    reduced = []
    real = table_grad.reduce_table_grads
    monkeypatch.setattr(table_grad, "reduce_table_grads", lambda g, *a: (reduced.append(g.shape), real(g, *a)))
    tkw = dict(timestamps=ts if ts_w is not None else None, pos_w=pos_w, ts_w=ts_w)
    _check(q, k, v, dout, off, N, 0.25, tables=(ts, pos_w, ts_w), deterministic=False, **kw)
    assert reduced == ([] if "H" in which else [(len(LENGTHS), 1, N, N)])
    dense = {}
    for span in (0, 10 ** 6):  # d ts_w element by element into the program's row / by per-bucket sums, every tile
        monkeypatch.setattr(table_grad, "_SPAN", span)
        dense[span] = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.25, table_grad=True, **tkw, **kw)[-2:]
    monkeypatch.setattr(config, "table_grad_mb", 0)
    in_kernel = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.25, table_grad=True, **tkw, **kw)[-2:]
    assert len(reduced) == (0 if "H" in which else 3)
    for got in dense.values():
        for a, b in zip(got, in_kernel):
            assert (a is None) == (b is None) and (a is None or rel_err(a, b) < 1e-5)


def test_table_grad_buffer_budget(monkeypatch):
    """The dense table-gradient buffer ([B, 1, N, N] fp32) is used within ``config.table_grad_mb`` only, for
    tables shared by the heads, with a time table only when its bucket map is there."""
    from hstu_inductor.kernels import table_grad as TG

    def use(flags, mb, n=8):
        monkeypatch.setattr(config, "table_grad_mb", mb)
        return TG.use_dense_grad(flags, 5, 2, n)

    assert use(dict(HAS_POS=True), 1024) and use(dict(HAS_POS=True, HAS_TS=5), 1024) and use(dict(HAS_TS=5), 1024)
    assert not use(dict(HAS_POS=True, HAS_TS=1), 1024)  # timestamps, no map: the kernel's own sums
    assert not use(dict(HAS_POS=True, TAB_HEADS=1), 1024) and not use(dict(HAS_TS=5, TAB_HEADS=2), 1024)
    assert not use({}, 1024) and not use(dict(HAS_POS=True), 0)
    assert use(dict(HAS_POS=True), 2 * 8 * 8 * 4 / 2 ** 20)  # exactly the budget
    assert not use(dict(HAS_POS=True), 2 * 8 * 8 * 4 / 2 ** 20 - 1e-9)
    assert not use(dict(HAS_POS=True), 1e9, n=46341)  # 32-bit offsets


@SMALL
@pytest.mark.parametrize("case", ["lower_targets", "full_ctx"])
def test_precomputed_bucket_map(case, poison, monkeypatch):
    """The kernels given a precomputed map in place of the timestamps (what ``hstu::time_bucket_map`` hands the
    attention for a whole step: its CUDA kernel with ``lower`` for a causal mask, else every element as the
    reference computes them) give the timestamps' results bit for bit, forward and every gradient."""
    from hstu_inductor.kernels import bucket_map
    from hstu_inductor.kernels.attention_bias_args import ts_switches
    from hstu_inductor.reference.rab import bucket_map as reference_map

    monkeypatch.setattr(config, "bwd_algo", "atomic")
    seed = sum(map(ord, case))
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=seed)
    ts, pos_w, ts_w = _tables(LENGTHS, N, 20, torch.int64, "pos+ts", seed=seed + 1)
    kw = dict(num_targets=torch.tensor([2, 0, 1, 3])) if case == "lower_targets" else dict(contextual_seq_len=3)
    if case == "lower_targets":
        bnd, has_ts, steps = ts_switches(ts, 20, None, True)
        bmap = bucket_map.make_bucket_map(ts, off, q.shape[0], len(LENGTHS), N, 20, bnd, has_ts, steps, True)
    else:
        bmap = reference_map(ts, off, N, 20)
    got = {}
    for name, stamps in (("timestamps", ts), ("map", bmap)):
        tkw = dict(timestamps=stamps, pos_w=pos_w, ts_w=ts_w, **kw)
        out = K.hstu_attention_fwd(q, k, v, off, N, 0.25, **tkw)
        got[name] = (out, *K.hstu_attention_bwd(dout, q, k, v, off, N, 0.25, table_grad=True, **tkw))
    for what, a, b in zip(("out", "dq", "dk", "dv", "dpos", "dts"), got["timestamps"], got["map"]):
        assert torch.isfinite(a).all() and torch.equal(a, b), what


def test_bucket_map_budget_and_dtype(monkeypatch):
    """The map is used within ``config.bucket_map_mb`` only: uint8 up to 255 buckets, int16 above, none past
    32767 buckets; the upper triangle is skipped only when no mask option lets a query read a later key."""
    from hstu_inductor.kernels import bucket_map as BM
    from hstu_inductor.spec import AttentionSpec

    calls = []
    monkeypatch.setattr(BM, "launcher", lambda kern, args: type("L", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: calls.append((grid, kw)))})())
    off = torch.tensor([0, 5, 12])
    ts = torch.arange(12)

    def run(nb, mb, n=8):
        monkeypatch.setattr(config, "bucket_map_mb", mb)
        args = (ts, None, torch.zeros(nb + 1), nb)
        return BM.with_bucket_map(args, (None, None), dict(HAS_TS=1, TS_STEPS=3), off, 12, 2, n, AttentionSpec(),
                                  None)

    (bmap, _, _, _), flags = run(20, 1024)
    assert flags["HAS_TS"] == 5 and bmap.shape == (2, 8, 8) and bmap.dtype == torch.uint8
    assert calls[-1][0] == (1, 2) and calls[-1][1]["LOWER"] is True and calls[-1][1]["HAS_TS"] == 1
    assert run(300, 1024)[0][0].dtype == torch.int16
    assert run(40000, 1024)[1]["HAS_TS"] == 1  # more buckets than int16 holds: computed per tile
    assert run(20, 2 * 8 * 8 / 2 ** 20)[1]["HAS_TS"] == 5  # exactly the budget
    assert run(20, 2 * 8 * 8 / 2 ** 20 - 1e-9)[1]["HAS_TS"] == 1
    assert run(20, 0)[1]["HAS_TS"] == 1
    n_launch = len(calls)
    assert run(20, 1e9, n=46341)[1]["HAS_TS"] == 1 and len(calls) == n_launch  # 32-bit offsets in the readers
    assert AttentionSpec().keys_up_to_query(False)
    assert AttentionSpec(max_attn_len=4, min_full_attn_seq_len=2).keys_up_to_query(False)
    assert not AttentionSpec(contextual_seq_len=2).keys_up_to_query(False)
    assert not AttentionSpec(causal=False).keys_up_to_query(False)
    assert not AttentionSpec().keys_up_to_query(True)


def _dense_stamps(ts, lengths, n, seed, pad=None):
    """``[B, N]`` timestamps: each sequence's jagged timestamps, then ``pad`` (random values of the same
    range when None: a padded input's padding is data the bias reads at ``next(n_b - 1) = n_b``)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(len(lengths), n, dtype=ts.dtype)
    start = 0
    for b, m in enumerate(lengths):
        out[b, :m] = ts[start:start + m].cpu()
        fill = torch.randint(0, 10 ** 6, (n - m,), generator=g).to(ts.dtype) if pad is None else pad
        out[b, m:] = fill
        start += m
    return out.to(ts.device)


@SMALL
@pytest.mark.parametrize("ts_dtype", [torch.int64, torch.float32])
def test_table_bias_dense_timestamps(ts_dtype, poison):
    """Timestamps as a padded ``[B, N]`` input (the original HSTU's ``all_timestamps``): the bias reads the
    caller's padding at ``next(i)`` of each sequence's last row. The reference bias equals an element loop
    of the definition; the kernels equal it, forward and backward (both tables); with zero padding the
    padded input gives the jagged input's result."""
    from hstu_inductor.reference.rab import time_buckets

    seed = 91 if ts_dtype == torch.int64 else 92
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=seed)
    ts, pos_w, ts_w = _tables(LENGTHS, N, 20, ts_dtype, "pos+ts", seed=seed + 1)
    dense = _dense_stamps(ts, LENGTHS, N, seed + 2)
    bias = relative_bias(dense, off, N, pos_w.double(), ts_w.double())
    for b, m in enumerate(LENGTHS):
        for i in range(m):
            nxt = min(i + 1, N - 1)
            for j in range(m):
                bk = time_buckets((dense[b, nxt] - dense[b, j]).reshape(1), 20)
                assert float(bias[b, 0, i, j]) == float(pos_w[N - 1 + j - i].double() + ts_w[bk[0]].double())
    _check(q, k, v, dout, off, N, 0.25, tables=(dense, pos_w, ts_w), num_targets=torch.tensor([2, 0, 1, 3]))
    zero = _dense_stamps(ts, LENGTHS, N, seed, pad=0)
    got = K.hstu_attention_fwd(q, k, v, off, N, 0.25, timestamps=zero, pos_w=pos_w, ts_w=ts_w)
    want = K.hstu_attention_fwd(q, k, v, off, N, 0.25, timestamps=ts, pos_w=pos_w, ts_w=ts_w)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="timestamps must be"):
        K.hstu_attention_fwd(q, k, v, off, N, 0.25, timestamps=dense[:, 1:], ts_w=ts_w)


@SMALL
@pytest.mark.parametrize("layout", ["jagged", "dense"])
def test_table_bias_own_row_gap(layout, poison, monkeypatch):
    """``ts_next=False``: the time bucket of ``ts(i) - ts(j)`` (a query's own timestamp, not its next row's).
    The reference equals an element loop of that definition; the kernels equal the reference, forward and
    backward (both tables, the atomic and the split backward)."""
    from hstu_inductor.reference.rab import time_buckets

    seed = 93 if layout == "jagged" else 94
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=seed)
    ts, pos_w, ts_w = _tables(LENGTHS, N, 20, torch.int64, "pos+ts", seed=seed + 1)
    stamps = ts if layout == "jagged" else _dense_stamps(ts, LENGTHS, N, seed + 2)
    bias = relative_bias(stamps, off, N, pos_w.double(), ts_w.double(), ts_next=False)
    start = 0
    for b, m in enumerate(LENGTHS):
        row = ts[start:start + m].cpu()
        for i in range(m):
            for j in range(m):
                bk = time_buckets((row[i] - row[j]).reshape(1), 20)
                assert float(bias[b, 0, i, j]) == float(pos_w[N - 1 + j - i].double() + ts_w[bk[0]].double())
        start += m
    assert not torch.equal(bias, relative_bias(stamps, off, N, pos_w.double(), ts_w.double()))
    for algo in ("atomic", "split"):
        monkeypatch.setattr(config, "bwd_algo", algo)
        _check(q, k, v, dout, off, N, 0.25, tables=(stamps, pos_w, ts_w), ts_next=False,
               deterministic=algo == "split", num_targets=torch.tensor([2, 0, 1, 3]))


@SMALL
@pytest.mark.parametrize("heads", ["both", "pos", "ts"])
def test_table_bias_per_head(heads, poison, monkeypatch):
    """Tables with a row per head (``pos_w: [H, 2N-1]``, ``ts_w: [H, nb+1]``), alone or beside a shared one: the
    kernels equal autograd through the fp64 reference, forward and every table gradient ([H, ...] per head),
    with the atomic and the split backward."""
    H = 3
    q, k, v, dout, off = _batch(LENGTHS, H, 16, torch.float32, seed=71)
    ts, pos_w, ts_w = _tables(LENGTHS, N, 15, torch.int64, "pos+ts", seed=72)
    g = torch.Generator().manual_seed(73)
    if heads in ("both", "pos"):
        pos_w = torch.randn(H, 2 * N - 1, generator=g).to(DEV)
    if heads in ("both", "ts"):
        ts_w = torch.randn(H, 16, generator=g).to(DEV)
    bias = relative_bias(ts, off, N, pos_w.double(), ts_w.double())
    assert bias.shape[1] == H and not torch.equal(bias[:, 0], bias[:, 1])  # the heads differ
    for algo in ("atomic", "split"):
        monkeypatch.setattr(config, "bwd_algo", algo)
        _check(q, k, v, dout, off, N, 0.25, tables=(ts, pos_w, ts_w), deterministic=algo == "split",
               num_targets=torch.tensor([2, 0, 1, 3]))


@SMALL
def test_table_bias_per_head_op_and_errors():
    """``hstu::attention`` with per-head tables (the reference path on CPU) has autograd's gradients of the dense
    reference bias; a table with the wrong number of rows is refused by name."""
    H = 2
    q, k, v, dout, off = _batch(LENGTHS, H, 8, torch.float64, seed=81)
    ts, _, _ = _tables(LENGTHS, N, 9, torch.int64, "ts", seed=82)
    g = torch.Generator().manual_seed(83)
    pos_w = torch.randn(H, 2 * N - 1, generator=g, dtype=torch.float64).requires_grad_()
    ts_w = torch.randn(H, 10, generator=g, dtype=torch.float64).requires_grad_()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = torch.ops.hstu.attention(*leaves, off, N, 0.3, timestamps=ts, pos_w=pos_w, ts_w=ts_w)
    out.backward(dout)
    ref_tabs = [t.detach().clone().requires_grad_() for t in (pos_w, ts_w)]
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = hstu_mha(N, 0.3, *ref_leaves, off, rab=relative_bias(ts, off, N, *ref_tabs), training=False)
    ref.backward(dout)
    assert rel_err(out, ref) < 1e-12
    for got, want in zip([pos_w.grad, ts_w.grad] + [t.grad for t in leaves],
                         [t.grad for t in ref_tabs] + [t.grad for t in ref_leaves]):
        assert got.shape == want.shape and rel_err(got, want) < 1e-12
    with pytest.raises((RuntimeError, ValueError), match="pos_w must be"):
        torch.ops.hstu.attention(q, k, v, off, N, 0.3, pos_w=torch.randn(H + 1, 2 * N - 1, dtype=torch.float64))
    with pytest.raises((RuntimeError, ValueError), match="ts_w must be"):
        torch.ops.hstu.attention(q, k, v, off, N, 0.3, timestamps=ts, ts_w=torch.randn(H + 1, 10, dtype=torch.float64))


@SMALL
def test_table_bias_block_shapes(poison):
    """Other tile shapes for the diagonal (pos_w) reduction: BLOCK_M > BLOCK_N in the dK/dV kernel (two
    wrap-arounds) and BLOCK_M == BLOCK_N; a sequence of exactly N rows (next(N-1) = N-1)."""
    lengths = [32, 7]
    q, k, v, dout, off = _batch(lengths, 2, 16, torch.float32, seed=61)
    tables = _tables(lengths, N, 12, torch.int64, "pos+ts", seed=62)
    for dkdv in ((32, 16, 4, 1), (16, 16, 4, 1)):
        with K.force_configs(fwd=(16, 32, 4, 1), dkdv=dkdv, dq=(16, 16, 4, 1)):
            _check(q, k, v, dout, off, N, 0.3, tables=tables, num_targets=torch.tensor([3, 1], device=DEV))


@SMALL
def test_rab_grad_no_batch_head_buffer(monkeypatch):
    """d rab of a broadcast rab is reduced in the kernel (atomics into rab's shape): no [B, H, N, N]
    tensor is allocated unless ``deterministic`` asks for the one-writer scratch."""
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=71)
    shapes = []
    real_zeros = torch.zeros

    def zeros(*size, **kw):
        shapes.append(tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size))
                      else tuple(size))
        return real_zeros(*size, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    for shape, deterministic in (((1, 2), False), ((4, 1), False), ((1, 1), True)):
        rab = _rab(shape, N, 2, torch.float32, seed=72)
        shapes.clear()
        K.hstu_attention_bwd(dout, q, k, v, off, N, 0.3, rab=rab, rab_grad=True, deterministic=deterministic)
        assert ((4, 2, N, N) in shapes) == deterministic, shapes
        assert deterministic or (*shape, N, N) in shapes, shapes


@SMALL
def test_fp16_rab_and_intervals(poison):
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float16, seed=51)
    iv = _random_intervals(LENGTHS, 2, seed=52)
    _check(q, k, v, dout, off, N, 0.3, rab=_rab((4, 2), N, 2, torch.float16, seed=53), intervals=iv)


def test_rab_interval_argument_errors():
    q, k, v, dout, off = _batch([3, 2], 2, 16, torch.float32, seed=0, device="cpu")
    with pytest.raises(ValueError, match="rab must be"):
        K.hstu_attention_fwd(q, k, v, off, 4, 0.1, rab=torch.zeros(2, 2, 4, 5))
    with pytest.raises(ValueError, match="rab must be"):
        K.hstu_attention_bwd(dout, q, k, v, off, 4, 0.1, rab=torch.zeros(3, 1, 4, 4), rab_grad=True)
    with pytest.raises(ValueError, match="intervals must be"):
        K.hstu_attention_fwd(q, k, v, off, 4, 0.1, intervals=torch.zeros(1, 5, 3))
    with pytest.raises(ValueError, match="pos_w must be"):
        K.hstu_attention_fwd(q, k, v, off, 4, 0.1, pos_w=torch.zeros(8))
    with pytest.raises(ValueError, match="ts_w needs timestamps"):
        K.hstu_attention_fwd(q, k, v, off, 4, 0.1, ts_w=torch.zeros(3))
    with pytest.raises(ValueError, match="timestamps must be"):
        K.hstu_attention_fwd(q, k, v, off, 4, 0.1, ts_w=torch.zeros(3), timestamps=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="intervals replace"):
        K.hstu_attention_fwd(q, k, v, off, 4, 0.1, intervals=torch.zeros(1, 5, 3, dtype=torch.int64),
                             max_attn_len=2)


# ------------------------------------------------------------------------------------------
# GPU: realistic sizes, 16-bit
# ------------------------------------------------------------------------------------------


def _gpu_batch(tma, B, n, H, D, dtype, seed):
    """(q, k, v, dout, offsets, num_targets on the CPU) with lengths in [n/2, n], one of n and one of 1."""
    if tma and not K.tma_supported(torch.device("cuda")):
        pytest.skip("no TMA on this GPU")
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(n // 2, n + 1, (B,), generator=g).tolist()
    lengths[0], lengths[1] = n, 1
    nt = torch.randint(0, 20, (B,), generator=g).clamp(max=torch.tensor(lengths))
    return (*_batch(lengths, H, D, dtype, seed=seed + 1), nt)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(8, 2), (1, 2), (8, 1), (1, 1)], ids=["BH", "1H", "B1", "11"])
def test_gpu_rab(shape, dtype, tma, poison, monkeypatch):
    n, H, D = 512, 2, 128
    q, k, v, dout, off, nt = _gpu_batch(tma, 8, n, H, D, dtype, seed=1)
    rab = _rab(shape, n, H, dtype, seed=4)
    for algo in ("split", "atomic"):
        monkeypatch.setattr(config, "bwd_algo", algo)
        _check(q, k, v, dout, off, n, 1.0 / D, rab=rab, tma=tma, deterministic=algo == "split",
               num_targets=nt.to(DEV), max_attn_len=100, contextual_seq_len=5)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_intervals(dtype, tma, poison, monkeypatch):
    n, H, D = 1024, 2, 128
    q, k, v, dout, off, nt = _gpu_batch(tma, 8, n, H, D, dtype, seed=5)
    sla = sla_intervals(off.cpu(), nt, k1=128, k2=64, contextual_seq_len=8).to(DEV)
    rnd = _random_intervals((off[1:] - off[:-1]).tolist(), H, seed=8)
    rab = _rab((1, H), n, H, dtype, seed=9)
    for algo in ("split", "atomic"):
        monkeypatch.setattr(config, "bwd_algo", algo)
        _check(q, k, v, dout, off, n, 1.0 / D, intervals=sla, tma=tma, deterministic=algo == "split")
        _check(q, k, v, dout, off, n, 1.0 / D, intervals=rnd, rab=rab, tma=tma, deterministic=algo == "split")


# ------------------------------------------------------------------------------------------------
# Time buckets from thresholds (_time_bucket): exact, at and next to every threshold
# ------------------------------------------------------------------------------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hstu_inductor.reference.rab import buckets_from_bounds, time_bucket_bounds  # noqa: E402


@triton.jit
def _bucket_probe(SEQ, OUT, TSB, TSP, NB, rows, cols, R: tl.constexpr, C: tl.constexpr, TS_STEPS: tl.constexpr,
                  PER_TILE: tl.constexpr):
    """_time_bucket on one tile of the sequence ``SEQ`` = (the ``cols`` key timestamps, then the rows'): keys at
    positions 0..cols-1, query rows at cols-1.. so that each reads the next timestamp, the last one (position
    n - 1) the padding past the end. PER_TILE: skip the per-sequence plan (its per-tile fallback)."""
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    slope = tl.load(TSP).to(tl.float32, bitcast=True)
    off = tl.load(TSP + 1).to(tl.float32, bitcast=True)
    fits = tl.load(TSP + 2).to(tl.float32, bitcast=True)
    n = rows + cols - 1
    seq = K._seq_plan(SEQ, n, n + 1, 1)
    if PER_TILE:
        seq = (seq[0], False, seq[2], seq[3])
    bk = K._time_bucket(cols - 1 + r, c, cols - 1, 0, n, seq, SEQ, n + 1, TSB, TSP, NB, slope, off, fits, 1,
                        TS_STEPS, False)
    tl.store(OUT + r[:, None] * cols + c[None, :], bk, mask=(r[:, None] < rows) & (c[None, :] < cols))


def _probe(tsn, tsj, bounds, nb, per_tile=False):
    """Run _time_bucket on the tile |tsn - tsj| (tsn's last row is the padding row)."""
    tsn, tsj, bounds = tsn.to(DEV), tsj.to(DEV), bounds.to(DEV)
    tsb, tsp = K._ts_bounds_and_plan(bounds, nb, tsn.dtype, tsn.device)
    out = torch.full((tsn.numel(), tsj.numel()), -1, dtype=torch.int32, device=DEV)
    seq = torch.cat([tsj, tsn[:-1]])
    _bucket_probe[(1,)](seq, out, tsb, tsp, nb, tsn.numel(), tsj.numel(), triton.next_power_of_2(tsn.numel()),
                        triton.next_power_of_2(tsj.numel()), int(nb).bit_length(), per_tile)
    return out.cpu(), tsp.cpu()


def _expected(tsn, tsj, pad, bounds):
    dt = torch.where(pad[:, None], torch.zeros_like(tsn)[:, None], tsn[:, None]) - tsj[None, :]
    return buckets_from_bounds(dt, bounds).to(torch.int32)


def _around(bounds, dtype):
    """Gaps at, just below and just above every threshold (clipped to the gap dtype's range)."""
    if dtype.is_floating_point:
        b = bounds[torch.isfinite(bounds)]
        return torch.cat([b, torch.nextafter(b, torch.zeros_like(b)), torch.nextafter(b, torch.full_like(b, float("inf"))),
                          torch.tensor([0.0, 0.5, 1.0], dtype=dtype)]).clamp(min=0)
    top = torch.iinfo(dtype).max
    b = bounds.clamp(max=top)
    return torch.cat([b, (b - 1).clamp(min=0), (b + 1).clamp(max=top), torch.tensor([0, 1, 2, 3])]).unique()


def _user_fp32_log(nb):
    return lambda dt: (torch.log(dt.abs().clamp(min=1).to(torch.float32)) / 0.301).long().clamp(0, nb)


BUCKET_CASES = {  # timestamp dtype, num_buckets, bucket function (None: the default fp64 log)
    "int64_default": (torch.int64, 128, None), "int64_user_fp32_log": (torch.int64, 128, "user"),
    "int32_default": (torch.int32, 40, None), "fp32_default": (torch.float32, 128, None),
    "fp64_default": (torch.float64, 60, None), "int64_linear": (torch.int64, 20, "linear"),
    "fp32_user": (torch.float32, 100, "user32"),
}


@pytest.mark.parametrize("case", list(BUCKET_CASES))
def test_time_bucket_exact_at_thresholds(case):
    """_time_bucket == buckets_from_bounds exactly, for gaps at / next to every threshold, both signs: gaps below
    2**23 (the fp32 path alone) and all of them (integer gaps equal to a threshold above 2**24 tie in fp32: the
    tile's native fallback), and a padding row (timestamp 0); thresholds of the default bucket, of a user fp32-log bucket (82 of 128 differ),
    of a linear bucket (the log guess does not fit: binary search) and of an fp32-valued user bucket. On a GPU
    too: there the guess takes the approximate log2 and the tables a read-only load (inline PTX)."""
    dtype, nb, fn = BUCKET_CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    bucket_fn = {None: None, "user": _user_fp32_log(nb), "linear": lambda d: (d.abs() // 997).clamp(0, nb),
                 "user32": lambda d: (torch.log2(d.abs().clamp(min=1e-3)) * 3 + 9).floor().long().clamp(0, nb)}[fn]
    bounds = time_bucket_bounds(nb, dtype, bucket_fn)
    gaps = _around(bounds, dtype)
    gaps = gaps[torch.randperm(gaps.numel(), generator=g)]
    plan_fits = None
    for lo_span in (True, False):
        sel = gaps if not lo_span or dtype.is_floating_point else gaps[gaps < 2 ** 23]
        if sel.numel() == 0:
            continue
        t0 = torch.tensor(1_700_000_000 if dtype == torch.int64 else 0, dtype=dtype)
        half = sel.numel() // 2  # both signs: tsn above tsj and below
        tsj = torch.cat([torch.full((1,), 0, dtype=dtype) + t0 + (2 ** 23 if lo_span and not dtype.is_floating_point
                                                                   else 0)])
        tsn = torch.cat([tsj + sel[:half], tsj - sel[half:]]) if not dtype.is_floating_point else \
            torch.cat([tsj + sel[:half], tsj - sel[half:]])
        if dtype == torch.int32 and not lo_span:
            tsj = torch.zeros(1, dtype=dtype)
            tsn = torch.cat([sel[:half], -sel[half:]])
        tsj = torch.cat([tsj, tsj + torch.randint(0, 3, (2,), generator=g).to(dtype)])
        pad = torch.zeros(tsn.numel(), dtype=torch.bool)
        pad[-1] = True
        tsn[pad] = 0  # as the kernel loads it (padding has timestamp 0)
        for per_tile in (False, True) if dtype in (torch.int64, torch.float64) else (False,):
            got, tsp = _probe(tsn, tsj, bounds, nb, per_tile)
            assert torch.equal(got, _expected(tsn, tsj, pad, bounds)), (case, per_tile)
        plan_fits = float(tsp[:3].view(torch.float32)[2])
    assert plan_fits == (0.0 if fn == "linear" else 1.0)


@triton.jit
def _gap32_probe(TSN, TSJ, OUT, OK, rows, cols, far_ok, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    tsn = tl.load(TSN + r, mask=r < rows, other=0)
    tsj = tl.load(TSJ + c, mask=c < cols, other=0)
    ok, a, b = K._gap32(tsn, tsj, tl.load(TSJ), r < rows, c < cols, far_ok != 0)
    tl.store(OUT + r[:, None] * cols + c[None, :], tl.abs(a[:, None] - b[None, :]),
             mask=(r[:, None] < rows) & (c[None, :] < cols))
    tl.store(OK, ok.to(tl.int32))


GAP32_CASES = {  # name: (rows, columns, dtype, answered with far_ok, answered without)
    "epoch_seconds": ([1_700_000_000 + k * 7919 for k in range(5)], [1_700_000_100 - k * 31 for k in range(3)],
                      torch.int64, True, True),
    "padding_row": ([0, 1_700_000_000, 1_700_003_000], [1_700_000_500, 1_700_000_000], torch.int64, True, False),
    "far_rows_near_columns": ([-(2 ** 62), 2 ** 40, 5], [2 ** 28, -(2 ** 28), 7], torch.int64, True, False),
    "far_columns_near_rows": ([2 ** 28, -(2 ** 28), 7], [3, -(2 ** 62), 2 ** 40], torch.int64, True, False),
    "both_sides_far": ([0, 1_700_000_000], [1_700_000_000, 1_700_000_000 + 2 ** 30], torch.int64, False, False),
    "fp64_whole": ([1.7e9, 1.7e9 + 3, 1.7e9 - 4e8], [1.7e9 + 1e6, 1.7e9 - 5e8], torch.float64, True, True),
    "fp64_far_row": ([1.7e9, 0.0], [1.7e9 + 1e6, 1.7e9 - 5e8], torch.float64, True, False),
    "fp64_fraction": ([1.7e9 + 0.5, 1.7e9], [1.7e9, 1.7e9 + 2], torch.float64, False, False),
    "fp64_nan": ([float("nan"), 1.0], [2.0, 3.0], torch.float64, False, False),
}


@SMALL
@pytest.mark.parametrize("far_ok", [True, False])
@pytest.mark.parametrize("case", list(GAP32_CASES))
def test_gap32_exact_or_declined(case, far_ok):
    """_gap32: where it answers the tile, each 32-bit gap is the true gap, or (only with far_ok: every threshold
    below 2**29) both exceed 2**29; it declines a tile with a row and a column both far from the base, a far
    one without far_ok, and fractional or NaN fp64 timestamps."""
    rows, cols, dtype, want_far, want_near = GAP32_CASES[case]
    tsn, tsj = torch.tensor(rows, dtype=dtype), torch.tensor(cols, dtype=dtype)
    out = torch.full((tsn.numel(), tsj.numel()), -1, dtype=torch.int32)
    ok = torch.zeros(1, dtype=torch.int32)
    _gap32_probe[(1,)](tsn, tsj, out, ok, tsn.numel(), tsj.numel(), int(far_ok), triton.next_power_of_2(tsn.numel()),
                       triton.next_power_of_2(tsj.numel()))
    assert bool(ok) == (want_far if far_ok else want_near)
    if bool(ok):
        true = (tsn.to(torch.float64)[:, None] - tsj.to(torch.float64)[None, :]).abs()
        exact = true < 2 ** 29
        assert torch.equal(out.to(torch.float64)[exact], true[exact])
        assert bool((out[~exact] >= 2 ** 29).all())
        assert far_ok or bool(exact.all())


@triton.jit
def _seq_plan_probe(TS, OUT, n, MAX_N, HAS_TS: tl.constexpr):
    base, ok, pad, pad_far = K._seq_plan(TS, n, MAX_N, HAS_TS)
    tl.store(OUT, ok.to(tl.int32))
    tl.store(OUT + 1, pad_far.to(tl.int32))
    tl.store(OUT + 2, (pad - base).to(tl.int64))


SEQ_PLAN_CASES = {  # name: (timestamps, n, HAS_TS, (ok, pad_far, pad - base))
    "epoch_seconds_jagged": ([1_700_000_000 + 977 * k for k in range(300)] + [5], 300, 1, (1, 1, -1_700_000_000)),
    "span_over_2_29": ([1_700_000_000, 1_700_000_000 + 2 ** 29 + 1, 1_700_000_000], 3, 1, (0, 1, -1_700_000_000)),
    "dense_padding_near": ([1000, 1003, 1010, 1020, 0], 3, 2, (1, 0, 20)),
    "own_gap_dense_far_padding": ([1000, 1003, 2 ** 40], 2, 4, (1, 1, 2 ** 40 - 1000)),
}


@SMALL
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
@pytest.mark.parametrize("case", list(SEQ_PLAN_CASES))
def test_seq_plan(case, dtype):
    """_seq_plan: the per-sequence fast path holds exactly when every timestamp of the sequence (over 256-wide
    chunks) is within 2**29 of the first and integral; the padding row's value and whether it is far."""
    values, n, has_ts, want = SEQ_PLAN_CASES[case]
    ts = torch.tensor(values, dtype=dtype)
    out = torch.zeros(3, dtype=torch.int64)
    _seq_plan_probe[(1,)](ts, out, n, len(values), has_ts)
    assert tuple(out.tolist()) == want
    if dtype == torch.float64:  # a fraction anywhere in the sequence declines it
        ts[n // 2] += 0.5
        _seq_plan_probe[(1,)](ts, out, n, len(values), has_ts)
        assert int(out[0]) == 0


def _bounded_tables(lengths, n, nb, ts_dtype, span, seed, device=DEV):
    """(timestamps, pos_w, ts_w): increasing timestamps (a few shuffled, some repeats) whose gaps reach every
    bucket of a log bucketisation; ``span`` "small": each sequence within 2**24 of its least timestamp (the
    kernels' fp32 path), "wide": epoch-like values and gaps up to 1e12 (the native path)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for length in lengths:
        top = 5 if span == "small" else 12
        gaps = (10 ** (torch.rand(length, generator=g, dtype=torch.float64) * top)).floor()
        gaps[torch.rand(length, generator=g) < 0.15] = 0
        t = gaps.cumsum(0) + (1.7e12 if span == "wide" else 3e5)
        if length > 3:
            t[:3] = t[torch.randperm(3, generator=g)]
        parts.append(t)
    ts = torch.cat(parts).to(ts_dtype).to(device)
    return ts, torch.randn(2 * n - 1, generator=g).to(device), torch.randn(nb + 1, generator=g).to(device)


def _user_bounds(nb, dtype, kind):
    fn = {"default": None, "user": _user_fp32_log(nb), "linear": lambda d: (d.abs() // 4099).clamp(0, nb)}[kind]
    return time_bucket_bounds(nb, dtype, fn)


BOUNDED_CASES = {  # timestamp dtype, span, thresholds, num_buckets
    "int64_small_user": (torch.int64, "small", "user", 128), "int64_wide_user": (torch.int64, "wide", "user", 128),
    "int32_small_linear": (torch.int32, "small", "linear", 24), "fp64_default": (torch.float64, "small", "default", 40),
    "fp32_user": (torch.float32, "small", "default", 40),
}


@SMALL
@pytest.mark.parametrize("case", list(BOUNDED_CASES))
def test_table_bias_ts_bounds(case, poison):
    """(b) with explicit thresholds (a user's fp32-log bucket, a linear one that takes the binary search, the
    default) through both kernel paths (sequences within 2**24 of their least timestamp, and wider), fwd and
    all gradients against relative_bias(..., ts_bounds) + the fp64 reference."""
    ts_dtype, span, kind, nb = BOUNDED_CASES[case]
    seed = sum(map(ord, case))
    q, k, v, dout, off = _batch(LENGTHS, 2, 16, torch.float32, seed=seed)
    tables = _bounded_tables(LENGTHS, N, nb, ts_dtype, span, seed=seed + 1)
    bounds = _user_bounds(nb, ts_dtype, kind).to(DEV)
    _check(q, k, v, dout, off, N, 0.25, tables=tables, ts_bounds=bounds, num_targets=torch.tensor([2, 0, 1, 3]))


@pytest.mark.gpu
@pytest.mark.parametrize("span", ["small", "wide"])
@pytest.mark.parametrize("kind", ["default", "user", "linear"])
def test_gpu_tables_ts_bounds(span, kind, poison, monkeypatch):
    """(b) on the GPU, bf16, int64 timestamps, 128 buckets: default thresholds (ts_bounds=None), a user's
    fp32-log bucket and a linear one, fp32 fast path and native path, both backward algorithms."""
    n, H, D, nb = 512, 2, 128, 128
    q, k, v, dout, off, nt = _gpu_batch(False, 8, n, H, D, torch.bfloat16, seed=7)
    lengths = (off[1:] - off[:-1]).tolist()
    tables = _bounded_tables(lengths, n, nb, torch.int64, span, seed=8)
    bounds = None if kind == "default" else _user_bounds(nb, torch.int64, kind).to(DEV)
    for algo in ("split", "atomic"):
        monkeypatch.setattr(config, "bwd_algo", algo)
        _check(q, k, v, dout, off, n, 1.0 / D, tables=tables, ts_bounds=bounds, deterministic=algo == "split",
               num_targets=nt.to(DEV), max_attn_len=100, contextual_seq_len=5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_tables_per_head(tma, poison, monkeypatch):
    """Per-head tables on the GPU, bf16, N=512, H=4, 128 buckets: both tables [H, ...], forward and every
    gradient, both backward algorithms."""
    n, D = 512, 128
    q, k, v, dout, off, nt, tables = _gpu_per_head_case(tma, 8, n, 4, D, seed=17)
    for algo in ("split", "atomic"):
        monkeypatch.setattr(config, "bwd_algo", algo)
        _check(q, k, v, dout, off, n, 1.0 / D, tables=tables, tma=tma, deterministic=algo == "split",
               num_targets=nt.to(DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_bucket_map_equals_per_tile_buckets(poison, monkeypatch):
    """On the GPU (inline-PTX byte loads, bf16, N=1024, per-head tables, wide int64 timestamps): the forward
    reading the bucket map equals the one computing buckets per tile bit for bit; the gradients (fp32 atomics
    in either order) agree within rounding; and the map's path stays within bf16 bounds of the fp64 reference."""
    n, D = 1024, 128
    q, k, v, dout, off, nt, tables = _gpu_per_head_case(False, 4, n, 4, D, seed=29)
    ts, pos_w, ts_w = tables
    tkw = dict(timestamps=ts, pos_w=pos_w, ts_w=ts_w, num_targets=nt.to(DEV))
    monkeypatch.setattr(config, "bwd_algo", "atomic")
    got = {}
    for mb in (1024, 0):
        monkeypatch.setattr(config, "bucket_map_mb", mb)
        out = K.hstu_attention_fwd(q, k, v, off, n, 1.0 / D, **tkw)
        grads = K.hstu_attention_bwd(dout, q, k, v, off, n, 1.0 / D, deterministic=False, table_grad=True, **tkw)
        got[mb] = (out, *grads[:3], *grads[-2:])
    assert torch.equal(got[1024][0], got[0][0])
    for name, a, b in zip(("dq", "dk", "dv", "dpos", "dts"), got[1024][1:], got[0][1:]):
        assert rel_err(a, b) < 1e-2, name
    monkeypatch.setattr(config, "bucket_map_mb", 1024)
    _check(q, k, v, dout, off, n, 1.0 / D, tables=tables, deterministic=False, num_targets=nt.to(DEV))


def _gpu_per_head_case(tma, B, n, H, D, seed, nb=128):
    """A bf16 batch with int64 timestamps (wide span) and per-head tables ``[H, 2n-1]``, ``[H, nb+1]``:
    (q, k, v, dout, offsets, num_targets, (timestamps, pos_w, ts_w)); seeds ``seed`` .. ``seed + 2``."""
    q, k, v, dout, off, nt = _gpu_batch(tma, B, n, H, D, torch.bfloat16, seed=seed)
    ts, _, _ = _bounded_tables((off[1:] - off[:-1]).tolist(), n, nb, torch.int64, "wide", seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    pos_w = (0.5 * torch.randn(H, 2 * n - 1, generator=g)).to(DEV)
    ts_w = (0.5 * torch.randn(H, nb + 1, generator=g)).to(DEV)
    return q, k, v, dout, off, nt, (ts, pos_w, ts_w)


def _table_configs():
    return [(kind, cfg) for kind in ("fwd", "dkdv") for cfg in K._GPU_CONFIGS[(kind, "tables")]]


def test_table_config_lists_reorder_the_plain_ones():
    """The table kernels' tuning lists hold the plain (D <= 128) lists' configs, only in another order (their first
    is the untuned default): a config added to one list and not the other would be tuned, or tested, for one
    kind of kernel only."""
    for kind in ("fwd", "dkdv"):
        assert sorted(K._GPU_CONFIGS[(kind, "tables")], key=repr) == sorted(K._GPU_CONFIGS[(kind, "small")], key=repr)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind,cfg", _table_configs(), ids=repr)
def test_gpu_tables_every_config(kind, cfg, poison, monkeypatch):
    """The autotuner may pick any listed config for the table kernels: each forward and dK/dV (dQ atomics, the
    tables' default) config at N=1024, bf16, per-head tables with time buckets, against the fp64 reference."""
    from triton.runtime.errors import OutOfResources

    n, D = 1024, 128
    q, k, v, dout, off, nt, tables = _gpu_per_head_case(False, 4, n, 2, D, seed=23)
    monkeypatch.setattr(config, "bwd_algo", "atomic")
    try:
        with K.force_configs(**{kind: cfg}):
            _check(q, k, v, dout, off, n, 1.0 / D, tables=tables, deterministic=False, num_targets=nt.to(DEV))
    except OutOfResources:  # the autotuner drops configs this GPU cannot hold
        pytest.skip(f"{kind} {cfg} does not fit this GPU")
