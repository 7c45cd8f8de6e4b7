"""The original HSTU's relative attention bias from two learned tables (HSTU_SEMANTICS.md), as a dense rab.

``relative_bias`` materialises ``rab_b(i, j) = pos_w[N-1+j-i] + ts_w[bucket(ts_b(next(i)) - ts_b(j))]`` as a
``[B, 1, N, N]`` tensor for the ``rab`` argument of ``hstu_mha`` / the kernels / ``hstu::attention``.
It is differentiable: autograd scatters the dense ``d_rab`` into ``pos_w`` and ``ts_w`` (summed over
heads by the broadcast); ``relative_bias_backward`` is the same scatter in closed form. The kernels
compute this bias in-kernel from the tables (``hstu::attention(..., timestamps, pos_w, ts_w)``).
"""
from __future__ import annotations

import torch

from .._compat import guarded
from .jagged import jagged_to_padded

__all__ = ["time_buckets", "time_bucket_bounds", "buckets_from_bounds", "relative_bias", "relative_bias_backward",
           "bucket_map", "is_bucket_map"]


def time_buckets(dt: torch.Tensor, num_buckets: int, bounds: torch.Tensor | None = None) -> torch.Tensor:
    """``clamp(floor(log(max(|dt|, 1)) / 0.301), 0, num_buckets)`` (natural log, computed in fp64), int64.
    With ``bounds`` (:func:`time_bucket_bounds`), the bucket is :func:`buckets_from_bounds` instead."""
    if bounds is not None:
        return buckets_from_bounds(dt, bounds)
    x = torch.log(dt.abs().to(torch.float64).clamp(min=1.0)) / 0.301
    return torch.floor(x).clamp(0, num_buckets).to(torch.int64)


def buckets_from_bounds(dt: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``#{k : |dt| >= bounds[k]}`` (int64): the bucket of any non-decreasing step function of ``|dt|``,
    given its thresholds (``bounds[k - 1]``: the least ``|dt|`` in bucket ``>= k``; int64 for integer gaps,
    the gaps' dtype for float gaps)."""
    x = dt.abs()
    if not dt.is_floating_point():
        x = x.to(torch.int64)
    if bounds.dtype != x.dtype:
        raise ValueError(f"bounds must be {x.dtype} for time gaps of dtype {dt.dtype}, got {bounds.dtype}")
    return torch.searchsorted(bounds.contiguous(), x.contiguous(), right=True)


def _ordered(dtype: torch.dtype):
    """(lo, hi, to_value, to_key) for bisection over the non-negative values of ``dtype`` in order: integers
    directly, floats through their bit patterns (monotone for non-negative floats)."""
    if dtype.is_floating_point:
        bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(dtype)
        if bits is None:
            raise ValueError(f"time gaps of dtype {dtype} are not supported (int32/int64/fp32/fp64)")
        inf = torch.tensor(float("inf"), dtype=dtype).view(bits).item()
        return 0, inf, (lambda key: key.to(bits).view(dtype)), (lambda key: key.to(bits).view(dtype))
    top = torch.iinfo(dtype).max
    # int32 gaps: a bucket no int32 gap reaches gets top + 1 (bounds are int64), so none is counted in it
    return 0, top if dtype == torch.int64 else top + 1, (lambda key: key.clamp(max=top).to(dtype)), (lambda key: key)


def time_bucket_bounds(num_buckets: int, dtype: torch.dtype = torch.int64, bucket_fn=None) -> torch.Tensor:
    """Thresholds (``[num_buckets]``; int64 for integer ``dtype``, else ``dtype``) of a bucketisation of the time gap: ``bounds[k - 1]`` is
    the least non-negative gap that ``bucket_fn`` puts in a bucket ``>= k`` (the dtype's largest value when
    none does). ``bucket_fn`` (default: :func:`time_buckets`) must be a non-decreasing function of ``|dt|``
    with values in ``[0, num_buckets]``; it is evaluated on CPU tensors of ``dtype`` only, by bisection
    (64 steps), so the bounds reproduce it exactly, rounding included, whatever dtype it computes in."""
    fn = bucket_fn or (lambda dt: time_buckets(dt, num_buckets))
    lo0, hi0, value, out = _ordered(dtype)
    k = torch.arange(1, num_buckets + 1, dtype=torch.int64)
    lo = torch.full((num_buckets,), lo0, dtype=torch.int64)   # bucket(value(lo)) < k, or lo == lo0
    hi = torch.full((num_buckets,), hi0, dtype=torch.int64)   # bucket(value(hi)) >= k, or hi == hi0
    below = fn(value(lo)).to(torch.int64) >= k                # already there at 0
    while True:
        live = hi - lo > 1
        if not bool(live.any()):
            break
        mid = lo + (hi - lo) // 2
        up = fn(value(mid)).to(torch.int64) >= k
        hi = torch.where(live & up, mid, hi)
        lo = torch.where(live & ~up, mid, lo)
    return out(torch.where(below, lo, hi))


MAP_DTYPES = (torch.uint8, torch.int16)


def is_bucket_map(timestamps) -> bool:
    """Whether the ``timestamps`` argument of the table bias is a precomputed ``[B, N, N]`` map of time buckets
    (``hstu::time_bucket_map``: uint8, int16 above 255 buckets) rather than timestamps."""
    return timestamps is not None and timestamps.dim() == 3 and timestamps.dtype in MAP_DTYPES


def bucket_map(timestamps, seq_offsets, max_seq_len: int, num_buckets: int, ts_bounds=None, ts_next=True):
    """The ``[B, N, N]`` map of ``bucket(ts(next(i)) - ts(j))`` (every ``i, j < N``, as :func:`relative_bias`
    computes it), uint8 up to 255 buckets, int16 up to 32767."""
    dtype = map_dtype(num_buckets)
    if dtype is None:
        raise ValueError(f"a bucket map holds at most 32767 buckets, got {num_buckets}")
    _, bucket = _indices(timestamps, seq_offsets, max_seq_len, num_buckets, timestamps.device, ts_bounds, ts_next)
    return bucket.to(dtype)


def map_dtype(num_buckets):
    """The smallest integer dtype of a bucket map holding buckets 0..num_buckets (None: more than int16 holds);
    a symbolic count is decided on its hint and guarded."""
    if guarded(num_buckets <= 255):
        return torch.uint8
    return torch.int16 if guarded(num_buckets <= 32767) else None


def map_fits(num_buckets, batch, max_seq_len, budget_mib) -> bool:
    """Whether a ``[B, N, N]`` bucket map fits ``budget_mib`` (``config.bucket_map_mb``) and the attention
    kernels' 32-bit offsets into it; symbolic sizes are decided on their hints and guarded."""
    dtype = map_dtype(num_buckets)
    if dtype is None or budget_mib <= 0 or not guarded(max_seq_len <= 46340):
        return False
    return guarded(batch * max_seq_len * max_seq_len * dtype.itemsize <= budget_mib * 2 ** 20)


def _indices(timestamps, seq_offsets, N, num_buckets, device, bounds=None, ts_next=True):
    """(pos index [N, N] = N-1+j-i, bucket index [B, N, N] or None without timestamps); the query's
    timestamp is that of ``next(i)`` (``ts_next``, the original HSTU) or of ``i``."""
    i = torch.arange(N, device=device)
    pos = N - 1 + i.unsqueeze(0) - i.unsqueeze(1)
    if timestamps is None:
        return pos, None
    if is_bucket_map(timestamps):  # the buckets themselves (hstu::time_bucket_map), clamped as the kernels read them
        return pos, timestamps.to(torch.int64).clamp(0, num_buckets)
    # [B, N]: a padded input as it is (its padding is read), jagged ones padded with 0
    ts = timestamps if timestamps.dim() == 2 else jagged_to_padded(timestamps, seq_offsets, N)
    nxt = (i + 1).clamp(max=N - 1) if ts_next else i
    return pos, time_buckets(ts[:, nxt].unsqueeze(-1) - ts.unsqueeze(1), num_buckets, bounds)


def relative_bias(timestamps: torch.Tensor | None, seq_offsets: torch.Tensor, max_seq_len: int,
                  pos_w: torch.Tensor | None, ts_w: torch.Tensor | None,
                  ts_bounds: torch.Tensor | None = None, ts_next: bool = True) -> torch.Tensor:
    """Dense ``[B, 1, N, N]`` rab of the original HSTU (``ts_next=False``: the gap ``ts(i) - ts(j)`` instead). ``timestamps: [L]`` (jagged, padded with 0) or ``[B, N]``
    (padded by the caller: ``ts(next(i))`` of a sequence's last row reads that padding),
    ``pos_w: [2N - 1]``, ``ts_w: [num_buckets + 1]``; ``next(i) = min(i + 1, N - 1)`` on padded positions.
    A table with a row per head (``[H, 2N - 1]``, ``[H, num_buckets + 1]``) makes the bias ``[B, H, N, N]``.
    Either table may be None (its term is left out; ``timestamps`` is only needed with ``ts_w``).
    ``ts_bounds`` (:func:`time_bucket_bounds`, ``[num_buckets]``) replaces the default bucketisation."""
    N = max_seq_len
    if pos_w is None and ts_w is None:
        raise ValueError("relative_bias needs pos_w and/or ts_w")
    if pos_w is not None and (pos_w.dim() not in (1, 2) or pos_w.shape[-1] != 2 * N - 1):
        raise ValueError(f"pos_w must be [2N - 1] = [{2 * N - 1}] or [H, 2N - 1], got {tuple(pos_w.shape)}")
    if ts_w is not None and (ts_w.dim() not in (1, 2) or ts_w.shape[-1] < 1):
        raise ValueError(f"ts_w must be [num_buckets + 1] or [H, num_buckets + 1], got {tuple(ts_w.shape)}")
    if ts_w is not None and timestamps is None:
        raise ValueError("ts_w needs timestamps")
    B = seq_offsets.shape[0] - 1
    dev = (pos_w if pos_w is not None else ts_w).device
    if ts_bounds is not None and (ts_w is None or tuple(ts_bounds.shape) != (ts_w.shape[-1] - 1,)):
        raise ValueError(f"ts_bounds must be [num_buckets] = [len(ts_w) - 1] and needs ts_w, got "
                         f"{tuple(ts_bounds.shape)}")
    pos, bucket = _indices(timestamps if ts_w is not None else None, seq_offsets, N,
                           ts_w.shape[-1] - 1 if ts_w is not None else 0, dev, ts_bounds, ts_next)
    # each term as [B|1, H|1, N, N]
    pos_term = None if pos_w is None else (pos_w[:, pos] if pos_w.dim() == 2 else pos_w[pos].unsqueeze(0)).unsqueeze(0)
    if ts_w is None:
        return pos_term.expand(B, *pos_term.shape[1:])
    ts_term = ts_w[:, bucket].transpose(0, 1) if ts_w.dim() == 2 else ts_w[bucket].unsqueeze(1)
    return ts_term if pos_term is None else pos_term + ts_term


def relative_bias_backward(d_bias: torch.Tensor, timestamps: torch.Tensor | None, seq_offsets: torch.Tensor,
                           max_seq_len: int, num_buckets: int | None, ts_bounds: torch.Tensor | None = None,
                           ts_next: bool = True, pos_per_head: bool = False, ts_per_head: bool = False):
    """Closed-form gradients of :func:`relative_bias`: ``d_bias: [B, H|1, N, N]`` ->
    ``(d_pos_w [2N-1], d_ts_w [num_buckets+1] or None when num_buckets is None)``, in d_bias's dtype, summed over
    heads; a table with a row per head (``*_per_head``; ``d_bias`` then has all H heads) gets ``[H, ...]``."""
    N = max_seq_len
    H = d_bias.shape[1]
    pos, bucket = _indices(timestamps if num_buckets is not None else None, seq_offsets, N, num_buckets or 0,
                           d_bias.device, ts_bounds, ts_next)
    if pos_per_head:
        d_pos = d_bias.new_zeros(H, 2 * N - 1).index_add_(1, pos.reshape(-1), d_bias.sum(0).reshape(H, -1))
    else:
        d_pos = d_bias.new_zeros(2 * N - 1).index_add_(0, pos.reshape(-1), d_bias.sum(dim=(0, 1)).reshape(-1))
    d_ts = None
    if num_buckets is not None:
        if ts_per_head:
            g = d_bias.transpose(0, 1).reshape(H, -1)
            d_ts = d_bias.new_zeros(H, num_buckets + 1).index_add_(1, bucket.reshape(-1), g)
        else:
            d_ts = d_bias.new_zeros(num_buckets + 1).index_add_(0, bucket.reshape(-1), d_bias.sum(dim=1).reshape(-1))
    return d_pos, d_ts


_FLOAT_BITS = {torch.float64: (torch.int64, 0x7FF0000000000000), torch.float32: (torch.int32, 0x7F800000)}


def default_time_bucket_bounds(num_buckets: int, dtype: torch.dtype, device) -> torch.Tensor:
    """:func:`time_bucket_bounds` of the default bucketisation (:func:`time_buckets`), computed on ``device``
    with a fixed number of pointwise steps: no host sync and no host-to-device copy, so it can be traced
    (torch.compile, AOTI: Inductor fuses it into one small kernel) and captured in a CUDA graph. Equal to
    ``time_bucket_bounds(num_buckets, dtype)`` evaluated with ``device``'s fp64 log."""
    k = torch.arange(1, num_buckets + 1, dtype=torch.int64, device=device)
    if dtype.is_floating_point:
        if dtype not in _FLOAT_BITS:
            raise ValueError(f"time gaps of dtype {dtype} are not supported (int32/int64/fp32/fp64)")
        bits, hi0 = _FLOAT_BITS[dtype]
        value = lambda key: key.to(bits).view(dtype)  # noqa: E731  (non-negative floats ordered by their bits)
    else:
        top = torch.iinfo(dtype).max
        hi0 = top if dtype == torch.int64 else top + 1
        value = lambda key: key.clamp(max=top).to(dtype)  # noqa: E731
    fn = lambda key: time_buckets(value(key), num_buckets) >= k  # noqa: E731
    lo = torch.zeros_like(k)
    hi = torch.full_like(k, hi0)
    below = fn(lo)
    for _ in range(64):  # hi - lo <= 2**63 halves to 1 within 63 steps; finished lanes stay put
        mid = lo + (hi - lo) // 2
        up = fn(mid)
        live = hi - lo > 1
        hi = torch.where(live & up, mid, hi)
        lo = torch.where(live & ~up, mid, lo)
    out = torch.where(below, lo, hi)
    return value(out) if dtype.is_floating_point else out
