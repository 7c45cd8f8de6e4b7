"""``hstu::attention`` with ``rab`` / ``intervals`` / the table bias (``timestamps``, ``pos_w``, ``ts_w``):
opcheck, equality with the reference, gradients (``grad_rab`` summed over broadcast dims, both tables),
input errors. CPU: the ops run the eager reference."""
from __future__ import annotations

import pytest
import torch

import hstu_inductor  # noqa: F401  (registers torch.ops.hstu.*)
from _helpers import random_jagged, rel_err
from hstu_inductor import reference as ref
from hstu_inductor.reference.rab import time_bucket_bounds

ops = torch.ops.hstu
LENGTHS = [3, 0, 5, 1]
N, H = 6, 2
RAB_SHAPES = {"BH": (4, H), "1H": (1, H), "B1": (4, 1), "11": (1, 1)}


def _intervals(heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, N + 2, (heads, sum(LENGTHS), 3), generator=g).sort(dim=-1).values


def _args(shape="1H", intervals=False, seed=0, grad=True, mask=True):
    q, k, v, off = random_jagged(LENGTHS, H, 3, 4, seed=seed, requires_grad=grad)
    g = torch.Generator().manual_seed(seed + 1)
    rab = None if shape is None else torch.randn(*RAB_SHAPES[shape], N, N, generator=g, dtype=torch.float64,
                                                 requires_grad=grad)
    iv = _intervals(seed=seed) if intervals else None
    nt = torch.tensor([1, 0, 2, 0]) if mask and not intervals else None
    w = 2 if mask and not intervals else 0
    return (q, k, v, off, N, 0.7, nt, None, w, 0, 0, True, rab, iv)


CASES = {"rab_BH": ("BH", False), "rab_11_intervals": ("11", True), "intervals_only": (None, True),
         "rab_B1": ("B1", False)}


# opcheck's aot_dispatch_dynamic test costs ~5 s per case on 2 cores: every case runs it under
# ``slow``; CI runs the schema/autograd-registration/fake-tensor checks of all and one full opcheck.
_FAST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck_attention_rab_fast(name):
    torch.library.opcheck(ops.attention, _args(*CASES[name]), test_utils=_FAST_UTILS)


def test_opcheck_attention_rab_full():
    torch.library.opcheck(ops.attention, _args(*CASES["rab_11_intervals"]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_opcheck_attention_rab_all(name):
    torch.library.opcheck(ops.attention, _args(*CASES[name]))


def _bwd_args(need_scale_grad):
    args = list(_args("1H", True, grad=False))
    args[7] = torch.rand(sum(LENGTHS), dtype=torch.float64) + 0.2
    grad = torch.randn(sum(LENGTHS), H, 4, dtype=torch.float64)
    return (grad, *args[:12], need_scale_grad, args[12], args[13])


@pytest.mark.parametrize("op", ["attention_bwd_rab", "attention_bwd"])
def test_opcheck_attention_bwd_rab_fast(op):
    torch.library.opcheck(getattr(ops, op), _bwd_args(True), test_utils=_FAST_UTILS)


@pytest.mark.slow
@pytest.mark.parametrize("need_scale_grad", [False, True])
def test_opcheck_attention_bwd_rab(need_scale_grad):
    torch.library.opcheck(ops.attention_bwd_rab, _bwd_args(need_scale_grad))
    torch.library.opcheck(ops.attention_bwd, _bwd_args(need_scale_grad))


@pytest.mark.parametrize("shape", list(RAB_SHAPES))
def test_attention_op_rab_equals_reference(shape):
    for intervals in (False, True):
        args = _args(shape, intervals, seed=3)
        q, k, v, off, Nn, alpha, nt, scale, w, c, f, causal, rab, iv = args
        out = ops.attention(*args)
        want = ref.hstu_mha(Nn, alpha, q, k, v, off, num_targets=nt, max_attn_len=w, rab=rab, intervals=iv)
        assert rel_err(out, want) < 1e-12
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, [q, k, v, rab], g)
        exp = torch.autograd.grad(want, [q, k, v, rab], g)
        assert got[3].shape == rab.shape
        for a, b in zip(got, exp):
            assert rel_err(a, b) < 1e-12


def test_attention_op_rab_gradcheck():
    args = list(_args("B1", True, seed=4))

    def fn(q_, k_, v_, r_):
        a = list(args)
        a[0], a[1], a[2], a[12] = q_, k_, v_, r_
        return ops.attention(*a)

    assert torch.autograd.gradcheck(fn, (args[0], args[1], args[2], args[12]), eps=1e-6, atol=1e-7)


def test_rab_grad_only_when_requested():
    args = list(_args("BH", seed=6))
    args[12] = args[12].detach()
    ops.attention(*args).sum().backward()
    assert args[12].grad is None and args[0].grad is not None


def test_old_positional_call_unchanged():
    """Existing callers (12 positional args, attention_bwd's 14) keep working."""
    q, k, v, off = random_jagged(LENGTHS, H, 3, 4, seed=8)
    out = ops.attention(q, k, v, off, N, 0.5, None, None, 0, 0, 0, True)
    dq, dk, dv, ds = ops.attention_bwd(torch.ones_like(out), q, k, v, off, N, 0.5, None, None, 0, 0, 0, True, False)
    assert dq.shape == q.shape and ds.numel() == 0


def test_rab_interval_input_errors():
    q, k, v, off, Nn, alpha, nt, scale, w, c, f, causal, rab, iv = _args("BH", grad=False)
    bad = [
        (dict(rab=torch.zeros(4, 2, N, N + 1, dtype=torch.float64)), "rab must be"),
        (dict(rab=torch.zeros(2, 2, N, N, dtype=torch.float64)), "rab must be"),
        (dict(rab=torch.zeros(4, 3, N, N, dtype=torch.float64)), "rab must be"),
        (dict(rab=torch.zeros(4, 2, N, N, dtype=torch.int32)), "floating point"),
        (dict(intervals=torch.zeros(1, q.shape[0], 2, dtype=torch.int64)), "intervals must be"),
        (dict(intervals=torch.zeros(1, q.shape[0] + 1, 3, dtype=torch.int64)), "intervals must be"),
        (dict(intervals=torch.zeros(1, q.shape[0], 3)), "int32 or int64"),
        (dict(intervals=torch.zeros(1, q.shape[0], 3, dtype=torch.int32), num_targets=torch.tensor([0, 0, 1, 0])),
         "replace"),
    ]
    for kw, msg in bad:
        a = dict(num_targets=None, rab=None, intervals=None)
        a.update(kw)
        # the mask rules (AttentionSpec.validate) raise ValueError, the tensor checks RuntimeError (torch._check)
        with pytest.raises((RuntimeError, ValueError), match=msg):
            ops.attention(q, k, v, off, Nn, alpha, a["num_targets"], None, 0, 0, 0, True, a["rab"], a["intervals"])


# ------------------------------------------------------------------------------------------------
# The table bias (path b): timestamps [L], pos_w [2N-1], ts_w [num_buckets+1]
# ------------------------------------------------------------------------------------------------
def _tables(which="pos+ts", seed=0, grad=True):
    g = torch.Generator().manual_seed(seed + 7)
    if "dense" in which:  # padded [B, N] timestamps, random padding (read at next(n_b - 1))
        ts = torch.randint(0, 10 ** 6, (len(LENGTHS), N), generator=g)
    else:
        ts = torch.randint(0, 10 ** 6, (sum(LENGTHS),), generator=g)
    pos_w = torch.randn(2 * N - 1, generator=g, dtype=torch.float64, requires_grad=grad) if "pos" in which else None
    ts_w = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=grad) if "ts" in which else None
    return (ts if ts_w is not None else None, pos_w, ts_w)


def _targs(shape=None, intervals=False, which="pos+ts", seed=0, grad=True):
    return _args(shape, intervals, seed=seed, grad=grad) + _tables(which, seed, grad)


TABLE_CASES = {"tables_mask": (None, False, "pos+ts"), "pos_intervals": (None, True, "pos"),
               "ts_rab1H": ("1H", False, "ts"), "dense_ts": (None, False, "pos+ts+dense")}


@pytest.mark.parametrize("name", list(TABLE_CASES))
def test_opcheck_attention_tables_fast(name):
    torch.library.opcheck(ops.attention, _targs(*TABLE_CASES[name]), test_utils=_FAST_UTILS)


def test_opcheck_attention_tables_full():
    torch.library.opcheck(ops.attention, _targs(*TABLE_CASES["tables_mask"]))


def test_opcheck_attention_bwd_bias_fast():
    args = _targs("B1", True, grad=False)
    grad = torch.randn(sum(LENGTHS), H, 4, dtype=torch.float64)
    torch.library.opcheck(ops.attention_bwd_bias, (grad, *args[:12], False, *args[12:], True, True),
                          test_utils=_FAST_UTILS)


@pytest.mark.parametrize("name", list(TABLE_CASES))
def test_attention_op_tables_equal_reference(name):
    """Forward and gradients to q, k, v, pos_w, ts_w (and a dense rab beside them) against autograd through
    ``reference.relative_bias`` + ``hstu_mha``, fp64."""
    args = _targs(*TABLE_CASES[name], seed=11)
    q, k, v, off, Nn, alpha, nt, scale, w, c, f, causal, rab, iv, ts, pos_w, ts_w = args
    out = ops.attention(*args)
    bias = ref.relative_bias(ts, off, Nn, pos_w, ts_w)
    bias = bias if rab is None else rab + bias
    want = ref.hstu_mha(Nn, alpha, q, k, v, off, num_targets=nt, max_attn_len=w, rab=bias, intervals=iv)
    assert rel_err(out, want) < 1e-12
    leaves = [t for t in (q, k, v, rab, pos_w, ts_w) if t is not None]
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, leaves, g)):
        assert a.shape == b.shape and rel_err(a, b) < 1e-12


def test_attention_op_tables_own_row_gap():
    """``ts_next=False`` (the gap ``ts(i) - ts(j)``): opcheck, and forward and table gradients equal the
    reference of that gap, which differs from the original's ``ts(next(i)) - ts(j)``."""
    args = _targs(None, False, "pos+ts", seed=13) + (None, False)
    torch.library.opcheck(ops.attention, args, test_utils=_FAST_UTILS)
    q, k, v, off, Nn, alpha, nt, scale, w, c, f, causal, rab, iv, ts, pos_w, ts_w = args[:17]
    out = ops.attention(*args)
    bias = ref.relative_bias(ts, off, Nn, pos_w, ts_w, ts_next=False)
    assert not torch.equal(bias, ref.relative_bias(ts, off, Nn, pos_w, ts_w))
    want = ref.hstu_mha(Nn, alpha, q, k, v, off, num_targets=nt, max_attn_len=w, rab=bias)
    assert rel_err(out, want) < 1e-12
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [q, pos_w, ts_w], g), torch.autograd.grad(want, [q, pos_w, ts_w], g)):
        assert rel_err(a, b) < 1e-12


def test_attention_op_tables_gradcheck():
    args = list(_targs(None, False, "pos+ts", seed=12))

    def fn(q_, p_, t_):
        a = list(args)
        a[0], a[15], a[16] = q_, p_, t_
        return ops.attention(*a)

    assert torch.autograd.gradcheck(fn, (args[0], args[15], args[16]), eps=1e-6, atol=1e-7)


def test_table_grads_only_when_requested():
    args = list(_targs(None, False, "pos+ts", seed=13))
    args[15] = args[15].detach()
    ops.attention(*args).sum().backward()
    assert args[15].grad is None and args[16].grad is not None


def test_table_input_errors():
    q, k, v, off, Nn, alpha, *_ = _args(None, grad=False)
    ts, pos_w, ts_w = _tables(grad=False)
    base = (q, k, v, off, Nn, alpha, None, None, 0, 0, 0, True, None, None)
    for kw, msg in [(dict(ts_w=ts_w), "needs timestamps"), (dict(timestamps=ts, pos_w=pos_w), "only used with ts_w"),
                    (dict(pos_w=pos_w[1:]), "pos_w must be"), (dict(timestamps=ts[1:], ts_w=ts_w), "timestamps must"),
                    (dict(timestamps=ts, ts_w=ts_w.to(torch.int64)), "floating point")]:
        a = dict(timestamps=None, pos_w=None, ts_w=None)
        a.update(kw)
        with pytest.raises(RuntimeError, match=msg):
            ops.attention(*base, a["timestamps"], a["pos_w"], a["ts_w"])


# ------------------------------------------------------------------------------------------------
# GPU: the op's kernel branch, eager and under torch.compile (Inductor embeds the kernels)
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_op_rab_intervals(compiled):
    torch.manual_seed(0)
    lengths, n, heads, d = [300, 1, 256, 97], 300, 2, 64
    q, k, v, off = (t.cuda() for t in random_jagged(lengths, heads, d, d, dtype=torch.float64, seed=9))
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    rab = torch.randn(1, heads, n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    iv = ref.sla_intervals(off.cpu(), torch.tensor([3, 0, 5, 1]), k1=64, k2=16, contextual_seq_len=4).cuda()

    def fn(q_, k_, v_, r_):
        return ops.attention(q_, k_, v_, off, n, 1.0 / d, None, None, 0, 0, 0, True, r_, iv)

    f = torch.compile(fn, fullgraph=True) if compiled else fn
    out = f(q, k, v, rab)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v, rab], g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, rab)]
    want_out = ref.hstu_mha(n, 1.0 / d, *leaves[:3], off, rab=leaves[3], intervals=iv)
    want = torch.autograd.grad(want_out, leaves, g.double())
    assert rel_err(out, want_out) < 2e-2
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and rel_err(a, b) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True, "dynamic"], ids=["eager", "compiled", "dynamic"])
def test_gpu_op_tables(compiled):
    """Path (b) through the op on the GPU (bf16 q/k/v, fp32 tables, int64 timestamps), eager and compiled,
    against the fp64 reference (``relative_bias`` + dense path); a dense [1, H] rab on top in one call.
    Compiled calls pass the default bucket's thresholds, as the patterns do: with ``ts_bounds=None`` the
    op derives them by a 64-step bisection, which torch.compile traces (the test then ran > 7 min on the H100)."""
    torch.manual_seed(1)
    lengths, n, heads, d = [300, 1, 256, 97], 300, 2, 64
    q, k, v, off = (t.cuda() for t in random_jagged(lengths, heads, d, d, dtype=torch.float64, seed=10))
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    ts = (1.7e9 + (10 ** (torch.rand(sum(lengths), dtype=torch.float64) * 6)).cumsum(0)).to(torch.int64).cuda()
    pos_w = (0.5 * torch.randn(2 * n - 1, device="cuda")).requires_grad_()
    ts_w = (0.5 * torch.randn(129, device="cuda")).requires_grad_()
    rab = torch.randn(1, heads, n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    nt = torch.tensor([3, 0, 5, 1], device="cuda")
    bounds = time_bucket_bounds(128).cuda() if compiled else None
    for use_rab in (False, True):
        def fn(q_, k_, v_, r_, p_, t_):
            return ops.attention(q_, k_, v_, off, n, 1.0 / d, nt, None, 64, 2, 0, True, r_, None, ts, p_, t_,
                                 bounds)

        # "dynamic": symbolic sizes, the bucket map's size and grid too (kernels/bucket_map.py)
        f = torch.compile(fn, fullgraph=True, dynamic=compiled == "dynamic") if compiled else fn
        ins = [q, k, v, rab if use_rab else None, pos_w, ts_w]
        leaves = [t for t in ins if t is not None]
        out = f(*ins)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, leaves, g)
        r64 = [None if t is None else t.detach().double().requires_grad_() for t in ins]
        bias = ref.relative_bias(ts, off, n, r64[4], r64[5])
        bias = bias if r64[3] is None else bias + r64[3]
        want_out = ref.hstu_mha(n, 1.0 / d, *r64[:3], off, num_targets=nt, max_attn_len=64, contextual_seq_len=2,
                                rab=bias)
        want = torch.autograd.grad(want_out, [t for t in r64 if t is not None], g.double())
        assert rel_err(out, want_out) < 2e-2
        for a, b in zip(got, want):
            assert rel_err(a, b) < 2e-2


# ------------------------------------------------------------------------------------------------
# ts_bounds: the time-bucket thresholds of any monotone bucketisation (reference.time_bucket_bounds)
# ------------------------------------------------------------------------------------------------
def _user_bucket(num_buckets):
    """The original HSTU's spelling on int64 gaps: the log in fp32 (82 of 128 thresholds differ from fp64)."""
    return lambda dt: (torch.log(dt.abs().clamp(min=1).to(torch.float32)) / 0.301).long().clamp(0, num_buckets)


def _bargs(seed=0, grad=True, bounds="user"):
    args = _targs(None, False, "pos+ts", seed=seed, grad=grad)
    nb = args[16].shape[0] - 1
    b = time_bucket_bounds(nb, torch.int64, _user_bucket(nb) if bounds == "user" else None)
    return args + (b,)


def test_opcheck_attention_ts_bounds():
    torch.library.opcheck(ops.attention, _bargs(seed=21), test_utils=_FAST_UTILS)


def test_opcheck_attention_bwd_bias_ts_bounds():
    args = _bargs(seed=22, grad=False)
    grad = torch.randn(sum(LENGTHS), H, 4, dtype=torch.float64)
    torch.library.opcheck(ops.attention_bwd_bias, (grad, *args[:12], False, *args[12:17], True, True, args[17]),
                          test_utils=_FAST_UTILS)


@pytest.mark.parametrize("bounds", ["user", "default"])
def test_attention_op_ts_bounds_equal_reference(bounds):
    """Forward and all gradients with explicit thresholds against ``relative_bias(..., ts_bounds)``; timestamps
    spread so that gaps land at every bucket; the default thresholds give the same as ``ts_bounds=None``."""
    args = list(_bargs(seed=23, bounds=bounds))
    g = torch.Generator().manual_seed(24)
    args[14] = (10 ** (torch.rand(sum(LENGTHS), generator=g, dtype=torch.float64) * 4)).cumsum(0).to(torch.int64)
    q, k, v, off, Nn, alpha, nt, scale, w, c, f, causal, rab, iv, ts, pos_w, ts_w, tb = args
    out = ops.attention(*args)
    bias = ref.relative_bias(ts, off, Nn, pos_w, ts_w, tb)
    want = ref.hstu_mha(Nn, alpha, q, k, v, off, num_targets=nt, max_attn_len=w, rab=bias)
    assert rel_err(out, want) < 1e-12
    leaves = [q, k, v, pos_w, ts_w]
    gr = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, gr), torch.autograd.grad(want, leaves, gr)):
        assert rel_err(a, b) < 1e-12
    if bounds == "default":
        assert torch.equal(out, ops.attention(*args[:17]))


def test_ts_bounds_input_errors():
    q, k, v, off, Nn, alpha, *_ = _args(None, grad=False)
    ts, pos_w, ts_w = _tables(grad=False)
    nb = ts_w.shape[0] - 1
    good = time_bucket_bounds(nb, torch.int64)
    base = (q, k, v, off, Nn, alpha, None, None, 0, 0, 0, True, None, None)
    for tabs, bnd, msg in [((None, pos_w, None), good, "only used with ts_w"),
                           ((ts, None, ts_w), good[1:], r"ts_bounds must be \[num_buckets\]"),
                           ((ts, None, ts_w), good.to(torch.int32), "must be torch.int64"),
                           ((ts.double(), None, ts_w), good, "must be torch.float64")]:
        with pytest.raises(RuntimeError, match=msg):
            ops.attention(*base, *tabs, bnd)


def test_table_kernels_mutation_analysis():
    """torch's mutation analysis of the launches (what torch.compile functionalizes by) reports only the kernels'
    outputs as written (the bucket map's kernel: its map): not pos_w / ts_w / timestamps / the thresholds (it did,
    through the time bucket feeding the d ts_w addresses: compiled training then failed, "a leaf Variable that
    requires grad is being used in an in-place operation"). SEQ_OFFSETS: every kernel's addresses derive from it through a helper (as on main).
    TTIR for sm90, no GPU needed; a subprocess because the kernel tests' interpreter mode replaces the kernels."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the split backward (dQ kernel) and the atomic one (dQ in the dK/dV kernel, the default with tables); the
    # table gradients through the dense buffer (DRAB, reduced by kernels/table_grad.py) or summed in dK/dV
    cases = (("pos+ts:atomic", "DRAB", "DPOS DTS"), ("ts:split", "DRAB", "DTS"),
             ("pos+ts:atomic:inkernel", "DPOS DTS", None), ("ts:split:inkernel", "DTS", None))
    got = subprocess.run([sys.executable, os.path.join(root, "scripts", "mutation_analysis.py"),
                          *(case for case, _, _ in cases)], capture_output=True, text=True, env=env, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    for case, dkdv_out, reduced in cases:
        algo = case.split(":")[1]
        lines = {ln.split()[1]: ln.split("writes:", 1)[1].split() for ln in got.stdout.splitlines()
                 if "writes:" in ln and ln.split()[0] == case}
        # bucket_map: the time buckets' map (kernels/bucket_map.py) the other kernels read in place of timestamps
        want = {"fwd": ["O", "SEQ_OFFSETS"], "dkdv": ["DK", "DVo", "SEQ_OFFSETS", *dkdv_out.split()],
                "bucket_map": ["MAP"]}
        if reduced:
            want["table_grad"] = reduced.split()
        if algo == "split":
            want["dq"] = ["DQo", "SEQ_OFFSETS"]
        else:
            want["dkdv"].insert(0, "DQA")
        assert lines == want, got.stdout


# ------------------------------------------------------------------------------------------------
# hstu::time_bucket_map: the time buckets once per step, read by the attention in place of the timestamps
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nb,ts_next,bounds", [(20, True, "default"), (300, False, "user")])
def test_time_bucket_map_op(nb, ts_next, bounds):
    """The map equals ``relative_bias``'s buckets (uint8, int16 past 255 buckets); the attention op given the map
    in place of the timestamps equals the op given the timestamps, forward and every gradient; opcheck passes on
    the map op and on the attention with a map. Timestamps spread so that the gaps cover the buckets."""
    args = list(_bargs(seed=31, bounds=bounds))
    g = torch.Generator().manual_seed(32)
    args[14] = (10 ** (torch.rand(sum(LENGTHS), generator=g, dtype=torch.float64) * 6)).cumsum(0).to(torch.int64)
    args[16] = torch.randn(nb + 1, dtype=torch.float64, generator=g, requires_grad=True)
    tb = time_bucket_bounds(nb, torch.int64, _user_bucket(nb) if bounds == "user" else None)
    args[17] = tb
    off, ts = args[3], args[14]
    bmap = ops.time_bucket_map(ts, off, sum(LENGTHS), N, nb, tb, ts_next, True)
    assert bmap.dtype == (torch.uint8 if nb <= 255 else torch.int16) and bmap.shape == (len(LENGTHS), N, N)
    want = ref.rab._indices(ts, off, N, nb, ts.device, tb, ts_next)[1]
    assert torch.equal(bmap.long(), want) and int(want.max()) > 5
    torch.library.opcheck(ops.time_bucket_map, (ts, off, sum(LENGTHS), N, nb, tb, ts_next, True))

    with_ts = args + [ts_next]
    with_map = args[:14] + [bmap] + args[15:17] + [None, ts_next]
    leaves = [args[0], args[1], args[2], args[15], args[16]]
    gout = torch.randn(sum(LENGTHS), H, 4, dtype=torch.float64, generator=g)
    res = []
    for a in (with_ts, with_map):
        out = ops.attention(*a)
        res.append((out, *torch.autograd.grad(out, leaves, gout)))
    for x, y in zip(*res):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.library.opcheck(ops.attention, tuple(with_map), test_utils=_FAST_UTILS)


def test_time_bucket_map_errors():
    """A map of the wrong shape, or with thresholds beside it, is refused by name; more buckets than int16
    holds has no map."""
    args = list(_targs(None, False, "pos+ts", seed=33, grad=False))
    off, ts, nb = args[3], args[14], args[16].shape[0] - 1
    bmap = ops.time_bucket_map(ts, off, sum(LENGTHS), N, nb)
    with pytest.raises((ValueError, RuntimeError), match="bucket map"):
        ops.attention(*args[:14], bmap[:, :-1], *args[15:17])
    with pytest.raises((ValueError, RuntimeError), match="ts_bounds"):
        ops.attention(*args[:14], bmap, *args[15:17], time_bucket_bounds(nb, torch.int64))
    with pytest.raises(ValueError, match="32767"):
        ops.time_bucket_map(ts, off, sum(LENGTHS), N, 40000)
