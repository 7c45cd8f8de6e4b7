"""Host-side arguments of the attention kernels' optional bias and mask inputs: the dense relative
attention bias (``rab``), interval masks, and the table bias (``pos_w`` / ``ts_w`` with timestamps), whose
time-bucket thresholds come with the plan the kernels' :func:`attention_jit._time_bucket` reads.
Checks shapes and dtypes and returns the kernel arguments (placeholders without the input).
"""
from __future__ import annotations

import torch

from .. import _compat
from ..reference.rab import default_time_bucket_bounds, is_bucket_map
from .attention_jit import MAP_HAS_TS


def _rab_args(rab, B, H, max_seq_len):
    """(rab, stride_b, stride_h, stride_i, stride_j) for a dense ``[B|1, H|1, N, N]`` rab (stride 0 along
    broadcast dims), or placeholders without one."""
    if rab is None:
        return (None, 0, 0, 0, 0)
    if rab.dim() != 4 or rab.shape[0] not in (1, B) or rab.shape[1] not in (1, H) \
            or rab.shape[2] != max_seq_len or rab.shape[3] != max_seq_len:
        raise ValueError(f"hstu attention: rab must be [B|1, H|1, N, N] = [{B}|1, {H}|1, {max_seq_len}, "
                         f"{max_seq_len}], got {tuple(rab.shape)}")
    if rab.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"hstu attention: rab must be fp16/bf16/fp32, got {rab.dtype}")
    return (rab, rab.stride(0) if rab.shape[0] > 1 else 0, rab.stride(1) if rab.shape[1] > 1 else 0,
            rab.stride(2), rab.stride(3))


def _iv_args(intervals, H, rows):
    """(intervals, stride_h, stride_row, stride_col) for ``[H|1, L, 3]`` int32/int64 intervals."""
    if intervals is None:
        return (None, 0, 0, 0)
    if intervals.dim() != 3 or intervals.shape[0] not in (1, H) or intervals.shape[1] != rows \
            or intervals.shape[2] != 3 or intervals.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"hstu attention: intervals must be an int32/int64 [H|1, L, 3] = [{H}|1, {rows}, 3] "
                         f"tensor, got {tuple(intervals.shape)} {intervals.dtype}")
    return (intervals, intervals.stride(0) if intervals.shape[0] > 1 else 0, intervals.stride(1),
            intervals.stride(2))


def _tab_args(timestamps, pos_w, ts_w, rows, max_seq_len, ts_bounds=None, batch=None, ts_next=True, heads=None):
    """((timestamps, pos_w, ts_w, num_buckets), (thresholds, guess plan), constexpr switches) for the table bias
    (docs/semantics.md), tensors contiguous (tiny or [L]); placeholders without tables. ``timestamps`` may be the
    call's ``[B, N, N]`` bucket map (``hstu::time_bucket_map``; ``HAS_TS = 5``). ``ts_next``: the
    time gap is ``ts(next(i)) - ts(j)``, else ``ts(i) - ts(j)`` (``HAS_TS`` + 2). A table may be shared by the
    heads (1-D) or have one row per head (``[H, ...]``, ``heads`` = H): ``TAB_HEADS`` bit 1 (position), 2 (time)."""
    if ts_w is not None and timestamps is None:
        raise ValueError("hstu attention: ts_w needs timestamps")
    if pos_w is not None and (pos_w.dim() not in (1, 2) or pos_w.shape[-1] != 2 * max_seq_len - 1
                              or (pos_w.dim() == 2 and pos_w.shape[0] != heads)):
        raise ValueError(f"hstu attention: pos_w must be [2N - 1] or [H, 2N - 1] = [{heads}, {2 * max_seq_len - 1}], "
                         f"got {tuple(pos_w.shape)}")
    if ts_w is not None:
        if ts_w.dim() not in (1, 2) or ts_w.shape[-1] < 1 or (ts_w.dim() == 2 and ts_w.shape[0] != heads):
            raise ValueError(f"hstu attention: ts_w must be [num_buckets + 1] or [H, num_buckets + 1] (H={heads}), "
                             f"got {tuple(ts_w.shape)}")
    if ts_w is not None and is_bucket_map(timestamps):  # hstu::time_bucket_map's buckets: read as they are
        if tuple(timestamps.shape) != (batch, max_seq_len, max_seq_len) or ts_bounds is not None:
            raise ValueError(f"hstu attention: a bucket map must be [B, N, N] = [{batch}, {max_seq_len}, "
                             f"{max_seq_len}] without ts_bounds, got {tuple(timestamps.shape)}")
    elif ts_w is not None:
        dense = timestamps.dim() == 2
        shape_ok = tuple(timestamps.shape) == (batch, max_seq_len) if dense else \
            (timestamps.dim() == 1 and timestamps.shape[0] == rows)
        if not shape_ok or timestamps.dtype not in (torch.int32, torch.int64, torch.float32, torch.float64):
            raise ValueError(f"hstu attention: timestamps must be an int32/int64/fp32/fp64 [L] = [{rows}] (jagged) or "
                             f"[B, N] = [{batch}, {max_seq_len}] (padded) tensor, got {tuple(timestamps.shape)} "
                             f"{timestamps.dtype}")
    for t in (pos_w, ts_w):
        if t is not None and t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"hstu attention: pos_w / ts_w must be fp16/bf16/fp32, got {t.dtype}")
    if ts_bounds is not None and ts_w is None:
        raise ValueError("hstu attention: ts_bounds (time-bucket thresholds) are only used with ts_w")
    flags = {}
    if pos_w is not None:
        flags["HAS_POS"] = True
    per_head = (1 if pos_w is not None and pos_w.dim() == 2 else 0) + (2 if ts_w is not None and ts_w.dim() == 2 else 0)
    if per_head:
        flags["TAB_HEADS"] = per_head
    bnd = (None, None)
    if ts_w is not None and is_bucket_map(timestamps):
        flags["HAS_TS"], flags["TS_STEPS"] = MAP_HAS_TS, 1
        plan = torch.zeros(4, dtype=torch.float32, device=timestamps.device)  # read, unused, by _bias_operands
        bnd = (plan, plan)
    elif ts_w is not None:
        bnd, flags["HAS_TS"], flags["TS_STEPS"] = ts_switches(timestamps, ts_w.shape[-1] - 1, ts_bounds, ts_next)
    cont = lambda t: None if t is None else t.contiguous()  # noqa: E731
    return ((cont(timestamps) if ts_w is not None else None, cont(pos_w), cont(ts_w),
             ts_w.shape[-1] - 1 if ts_w is not None else 0), bnd, flags)


def ts_switches(timestamps, num_buckets, ts_bounds, ts_next) -> tuple:
    """((thresholds, guess plan), HAS_TS, TS_STEPS) of timestamps ([L] jagged or [B, N] padded) for the kernels
    that compute time buckets (docs/semantics.md)."""
    bnd = _ts_bounds_and_plan(ts_bounds, num_buckets, timestamps.dtype, timestamps.device)
    # binary-search steps of the fallback (2**steps > num_buckets); a symbolic size takes the most
    steps = int(num_buckets).bit_length() if type(num_buckets) is int else 31
    return bnd, (2 if timestamps.dim() == 2 else 1) + (0 if ts_next else 2), steps


# The time bucket of the table bias is #{k : |dt| >= ts_bounds[k]} (reference.buckets_from_bounds). The
# kernels guess it from a line in log2(|dt|) fitted to the thresholds and correct the guess by one bucket
# either way (_time_bucket); _ts_plan fits the line and checks it, all with torch ops on the thresholds'
# device: no host sync, so it traces (torch.compile, AOTI) and captures (CUDA graphs).
_GUESS_MARGIN = 1.0 / 64  # slack (in buckets) for the device's fp32 log2 and fp32 FMA rounding
_GAP32_TOP = 2 ** 29  # thresholds below it: a clamped gap still in the last bucket (attention_jit._gap32)
_DEFAULT_BOUNDS: dict = {}  # (num_buckets, gap dtype, device) -> (thresholds, plan): eager calls only
_USER_PLANS: dict = {}  # id(ts_bounds) -> (ts_bounds, version, plan); the tensor is held so its id stays its own


def _gap_top(dtype):
    """The largest non-negative time gap of the timestamps' dtype (inf for floats)."""
    return float("inf") if dtype.is_floating_point else torch.iinfo(dtype).max


def _ts_plan(bounds: torch.Tensor, nb: int, gap_dtype) -> torch.Tensor:
    """int32 ``[bits of fp32 (slope, offset, fits, *bounds, nan), *ceil(bounds), INT32_MAX, ok32]`` for
    ``attention_jit._time_bucket`` (fp32 values by their bits: one buffer, copied bit-exactly where an fp32
    copy could flush the small integers' subnormal patterns). The guess ``floor(slope * log2(fp32(x)) +
    offset)`` is fitted by least squares to ``(log2 bounds[k-1], k)``, centred, and ``fits = 1`` when at both
    ends of every bucket (each threshold and the gap just below it, 0 and the largest gap) it is the true
    bucket or the one below, by a margin; as the guess is monotone in x, it then is everywhere. ``ok32``:
    what the 32-bit gap path may answer (``attention_jit._gap32``)."""
    dev, top = bounds.device, _gap_top(gap_dtype)
    f64 = torch.float64
    k = torch.arange(1, nb + 1, device=dev, dtype=f64)
    lb = torch.log2(bounds.to(torch.float32).to(f64))  # what the kernel sees: log2 of fp32(x)
    use = torch.isfinite(lb) & (lb >= 0) & (bounds < top)
    # slope by least squares on (log2 bounds[k-1], k), weighted towards large thresholds: integer rounding
    # (ceil(e^0.301k) = 2, 2, 3, 4, ...) bends the small ones off the line
    w = use.to(f64) * torch.where(use, lb, 0.0).clamp(max=12.0) ** 2
    cnt = w.sum().clamp(min=1e-300)
    lz = torch.where(use, lb, 0.0)
    ml, mk = (w * lz).sum() / cnt, (w * k).sum() / cnt
    var = (w * (lz - ml) ** 2).sum()
    slope = torch.where(var > 0, (w * (lz - ml) * (k - mk)).sum() / var.clamp(min=1e-300), 0.0)
    slope = slope.to(torch.float32).to(f64)  # the kernel's fp32 operand
    if gap_dtype.is_floating_point:
        below = torch.nextafter(bounds, torch.full_like(bounds, -torch.inf)).clamp(min=0)
    else:
        below = (bounds - 1).clamp(min=0)
    # factory calls, not torch.tensor(list): no constant to lift when traced
    pts = torch.cat([bounds, below, bounds.new_zeros(1), bounds.new_full((1,), top)]).clamp(max=top)
    truth = torch.searchsorted(bounds, pts, right=True)
    # offset: centre u - truth over both ends of the inner buckets in [-1, 1) (guess = truth or truth - 1)
    lp = torch.log2(pts.to(torch.float32).to(f64))
    inner = (truth > 0) & (truth < nb) & torch.isfinite(lp)
    e = torch.where(inner, slope * torch.where(inner, lp, 0.0) - truth, 0.0)
    e_hi = torch.where(inner, e, -torch.inf).amax()
    e_lo = torch.where(inner, e, torch.inf).amin()
    off = torch.where(torch.isfinite(e_hi) & torch.isfinite(e_lo), -(e_hi + e_lo) / 2, 0.0)
    off = off.to(torch.float32).to(f64)

    def guess(u):
        return torch.floor(torch.where(u > 0, u, 0.0).clamp(max=float(nb))).to(torch.int64)

    u = lp * slope + off
    fits = ((guess(u - _GUESS_MARGIN) >= truth - 1) & (guess(u + _GUESS_MARGIN) <= truth)).all() & (slope >= 0)
    head = torch.cat([torch.stack([slope, off, fits.to(f64)]).to(torch.float32), bounds.to(torch.float32),
                      torch.full((1,), torch.nan, dtype=torch.float32, device=dev)])
    # the integer thresholds of the 32-bit path: x >= b <=> x >= ceil(b) for an integer gap x (its gaps are
    # below 2**31: a larger threshold is never reached, as INT32_MAX). ok32: 1 when the guess fits, 2 when
    # also every threshold is below 2**29 (_GAP32_TOP), so that a gap clamped at 2**30 lands in the last bucket
    thr = torch.ceil(bounds.to(f64)) if bounds.dtype.is_floating_point else bounds.to(f64)
    ok32 = fits.to(torch.int32) * (1 + (thr < _GAP32_TOP).all().to(torch.int32))
    thr32 = torch.cat([thr.clamp(min=0, max=2 ** 31 - 1).to(torch.int32),
                       torch.full((1,), 2 ** 31 - 1, dtype=torch.int32, device=dev), ok32.reshape(1)])
    return torch.cat([head.view(torch.int32), thr32])


def _ts_bounds_and_plan(ts_bounds, nb, ts_dtype, device):
    """(thresholds, plan) on ``device``: ``ts_bounds`` or the default fp64-log bucket's
    (``reference.default_time_bucket_bounds``), computed once per (num_buckets, dtype, device) in eager code.
    Traced (torch.compile / AOTI) or under CUDA-graph capture both are computed in the graph instead."""
    eager = _compat.plain_eager(ts_bounds) and not (
        device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if ts_bounds is None:
        key = (int(nb), ts_dtype, device) if eager else None
        got = _DEFAULT_BOUNDS.get(key) if eager else None
        if got is None:
            bounds = default_time_bucket_bounds(nb, ts_dtype, device)
            got = (bounds, _ts_plan(bounds, nb, ts_dtype))
            if eager:
                _DEFAULT_BOUNDS[key] = got
        return got
    want = ts_dtype if ts_dtype.is_floating_point else torch.int64
    if ts_bounds.dim() != 1 or ts_bounds.shape[0] != nb or ts_bounds.dtype != want:
        raise ValueError(f"hstu attention: ts_bounds must be a {want} [num_buckets] = [{nb}] tensor for "
                         f"{ts_dtype} timestamps, got {tuple(ts_bounds.shape)} {ts_bounds.dtype}")
    ts_bounds = ts_bounds.contiguous()
    if not eager:
        return ts_bounds, _ts_plan(ts_bounds, nb, ts_dtype)
    hit = _USER_PLANS.get(id(ts_bounds))
    if hit is not None and hit[0] is ts_bounds and hit[1] == ts_bounds._version:
        return ts_bounds, hit[2]
    plan = _ts_plan(ts_bounds, nb, ts_dtype)
    if len(_USER_PLANS) >= 16:
        _USER_PLANS.clear()
    _USER_PLANS[id(ts_bounds)] = (ts_bounds, ts_bounds._version, plan)
    return ts_bounds, plan
