"""Eager HSTU attention (``hstu_mha``) and cached delta attention, in plain PyTorch.

This is the semantic reference every kernel and rewrite is tested against. It pads to
``[B, N, H, D]``, forms the full score matrix and is therefore O(B*H*N^2) in memory.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .jagged import (_is_concrete, gather_padded, lengths_from_offsets, padded_rows, padded_to_jagged,
                     require, row_to_sequence, validate_jagged)
from ..spec import AttentionSpec
from .mask import hstu_mask, interval_mask
from .rab import is_bucket_map

__all__ = ["hstu_mha", "hstu_mha_backward", "delta_hstu_mha", "validate_attention_inputs", "validate_rab_intervals",
           "validate_rab_tables"]


def validate_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    num_targets: torch.Tensor | None = None,
    attn_scale: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    num_query_rows: int | None = None,
    causal: bool = True,
    check_values: bool = True,
) -> None:
    """Shape/dtype/device agreement of q, k, v and the jagged metadata, with clear messages
    (and the metadata's values on concrete tensors unless ``check_values`` is False)."""
    require(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, lambda: "q, k, v must be [L, H, D]")
    require(
        q.shape[1:] == k.shape[1:], lambda: f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in [H, Dq]"
    )
    require(k.shape[:2] == v.shape[:2], lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in [L, H]")
    require(
        q.dtype == k.dtype == v.dtype, lambda: f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    )
    require(q.is_floating_point(), lambda: f"q, k, v must be floating point, got {q.dtype}")
    devices = {t.device for t in (q, k, v, seq_offsets)}
    require(len(devices) == 1, lambda: f"q, k, v and seq_offsets must be on one device, got {devices}")
    require(max_seq_len >= 1, lambda: f"max_seq_len must be >= 1, got {max_seq_len}")
    AttentionSpec(causal, max_attn_len, contextual_seq_len, min_full_attn_seq_len).validate(
        has_targets=num_targets is not None)
    if num_query_rows is None:
        require(q.shape[0] == k.shape[0], lambda: "q and k must have the same number of rows L")
    if attn_scale is not None:
        rows = q.shape[0]
        require(
            attn_scale.numel() == 1 or (attn_scale.dim() == 1 and attn_scale.shape[0] == rows),
            lambda: f"attn_scale must be a scalar or have shape [{rows}], got {tuple(attn_scale.shape)}",
        )
    validate_jagged(seq_offsets, k.shape[0], max_seq_len, num_targets, values=check_values)


def validate_rab_intervals(
    q: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    rab: torch.Tensor | None = None,
    intervals: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
) -> None:
    """Shapes/dtypes of a dense ``rab: [B|1, H|1, N, N]`` and ``intervals: [H|1, L, 3]`` (docs/semantics.md).
    Intervals replace the causal/targets/window/contextual mask, so those must be unset."""
    L, H = q.shape[0], q.shape[1]
    B = seq_offsets.shape[0] - 1
    if rab is not None:
        require(rab.dim() == 4, lambda: f"rab must be [B|1, H|1, N, N], got shape {tuple(rab.shape)}")
        require(rab.is_floating_point(), lambda: f"rab must be floating point, got {rab.dtype}")
        require(rab.device == q.device, lambda: f"rab is on {rab.device}, q on {q.device}")
        require((rab.shape[0] == 1 or rab.shape[0] == B) and (rab.shape[1] == 1 or rab.shape[1] == H)
                and rab.shape[2] == max_seq_len and rab.shape[3] == max_seq_len,
                lambda: f"rab must be [B|1, H|1, N, N] = [{B}|1, {H}|1, {max_seq_len}, {max_seq_len}], "
                        f"got {tuple(rab.shape)}")
    if intervals is not None:
        require(intervals.dim() == 3 and intervals.shape[2] == 3
                and (intervals.shape[0] == 1 or intervals.shape[0] == H) and intervals.shape[1] == L,
                lambda: f"intervals must be [H|1, L, 3] = [{H}|1, {L}, 3], got {tuple(intervals.shape)}")
        require(intervals.dtype in (torch.int32, torch.int64),
                lambda: f"intervals must be int32 or int64, got {intervals.dtype}")
        require(intervals.device == q.device, lambda: f"intervals is on {intervals.device}, q on {q.device}")
        AttentionSpec(True, max_attn_len, contextual_seq_len, min_full_attn_seq_len).validate(
            has_targets=num_targets is not None, has_intervals=True)


def validate_rab_tables(q: torch.Tensor, max_seq_len: int, timestamps: torch.Tensor | None,
                        pos_w: torch.Tensor | None, ts_w: torch.Tensor | None,
                        ts_bounds: torch.Tensor | None = None, seq_offsets: torch.Tensor | None = None) -> None:
    """The table bias of ``hstu::attention`` (docs/semantics.md): ``pos_w: [2N-1]`` and/or ``ts_w:
    [num_buckets+1]`` (fp16/bf16/fp32), ``timestamps`` (int32/int64/fp32/fp64) exactly when ``ts_w`` is given:
    jagged ``[L]`` (0 past each sequence) or padded ``[B, N]`` (``seq_offsets`` given; its padding is read), or
    their buckets as ``hstu::time_bucket_map``'s ``[B, N, N]`` uint8 / int16 map; optional ``ts_bounds: [num_buckets]`` (int64 for integer timestamps, else the timestamps' dtype). Their
    values (non-decreasing thresholds) are the caller's contract, not checked (that would need a host sync)."""
    L = q.shape[0]
    require(timestamps is None or ts_w is not None, lambda: "timestamps are only used with ts_w")
    require(ts_w is None or timestamps is not None, lambda: "ts_w needs timestamps")
    for name, t in (("pos_w", pos_w), ("ts_w", ts_w)):
        if t is not None:
            require(t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                    lambda: f"{name} must be floating point, got {t.dtype}")
            require(t.device == q.device, lambda: f"{name} is on {t.device}, q on {q.device}")
    H = q.shape[1]
    if pos_w is not None:
        require((pos_w.dim() == 1 or (pos_w.dim() == 2 and pos_w.shape[0] == H))
                and pos_w.shape[-1] == 2 * max_seq_len - 1,
                lambda: f"pos_w must be [2N - 1] = [{2 * max_seq_len - 1}] or [H, 2N - 1] = [{H}, {2 * max_seq_len - 1}], "
                        f"got {tuple(pos_w.shape)}")
    if ts_w is not None:
        require((ts_w.dim() == 1 or (ts_w.dim() == 2 and ts_w.shape[0] == H)) and ts_w.shape[-1] >= 1,
                lambda: f"ts_w must be [num_buckets + 1] or [H, num_buckets + 1] (H={H}), got {tuple(ts_w.shape)}")
        B = seq_offsets.shape[0] - 1 if seq_offsets is not None else None
        if is_bucket_map(timestamps):  # hstu::time_bucket_map's buckets in place of the timestamps
            require(B is not None and tuple(timestamps.shape) == (B, max_seq_len, max_seq_len),
                    lambda: f"a bucket map must be [B, N, N] = [{B}, {max_seq_len}, {max_seq_len}], got "
                            f"{tuple(timestamps.shape)}")
            require(ts_bounds is None, lambda: "ts_bounds are not used with a bucket map (its buckets are final)")
            require(timestamps.device == q.device, lambda: f"the bucket map is on {timestamps.device}, q on {q.device}")
            return
        require((timestamps.dim() == 1 and timestamps.shape[0] == L)
                or (timestamps.dim() == 2 and B is not None and tuple(timestamps.shape) == (B, max_seq_len)),
                lambda: f"timestamps must be [L] = [{L}] (jagged) or [B, N] = [{B}, {max_seq_len}] (padded), got "
                        f"{tuple(timestamps.shape)}")
        require(timestamps.dtype in (torch.int32, torch.int64, torch.float32, torch.float64),
                lambda: f"timestamps must be int32/int64/fp32/fp64, got {timestamps.dtype}")
        require(timestamps.device == q.device, lambda: f"timestamps is on {timestamps.device}, q on {q.device}")
    require(ts_bounds is None or ts_w is not None, lambda: "ts_bounds (time-bucket thresholds) are only used with ts_w")
    if ts_bounds is not None:
        nb = ts_w.shape[-1] - 1
        require(ts_bounds.dim() == 1 and ts_bounds.shape[0] == nb,
                lambda: f"ts_bounds must be [num_buckets] = [len(ts_w) - 1] = [{nb}], got {tuple(ts_bounds.shape)}")
        want = timestamps.dtype if timestamps.is_floating_point() else torch.int64
        require(ts_bounds.dtype == want,
                lambda: f"ts_bounds must be {want} for {timestamps.dtype} timestamps (int64 for integer timestamps, "
                        f"else the timestamps' dtype), got {ts_bounds.dtype}")
        require(ts_bounds.device == q.device, lambda: f"ts_bounds is on {ts_bounds.device}, q on {q.device}")


def _valid(seq_offsets, N, num_targets, spec, intervals):
    """``[B, H|1, N, N]`` bool: the interval mask when given (it replaces the others), else the HSTU mask."""
    if intervals is not None:
        return interval_mask(intervals, seq_offsets, N)
    return hstu_mask(lengths_from_offsets(seq_offsets), N, num_targets, spec=spec).unsqueeze(1)


def _row_scale(attn_scale, seq_offsets, max_seq_len, rows_padded_fn):
    """Per-query-row score scale ``s_i`` broadcastable to ``[B, H, Q, N]``."""
    if attn_scale is None:
        return 1.0 / max_seq_len
    if attn_scale.numel() == 1:
        return attn_scale.reshape(())
    return rows_padded_fn(attn_scale).unsqueeze(1).unsqueeze(-1)  # [B, 1, Q, 1]


def _pairs(a, b):
    """``einsum("bihd,bjhd->bhij", a, b)``: per-head products of every row pair of padded tensors.
    Spelled as one matmul, like :func:`_mix` and :func:`_mix_t`: the ops also trace this body under
    symbolic sizes (fake impl, AOTAutograd), where an einsum costs several times more."""
    return a.transpose(1, 2) @ b.permute(0, 2, 3, 1)


def _mix(p, x):
    """``einsum("bhij,bjhd->bihd", p, x)``: rows of ``x`` mixed by ``p`` ([B, H, I, J])."""
    return (p @ x.transpose(1, 2)).transpose(1, 2)


def _mix_t(p, x):
    """``einsum("bhij,bihd->bjhd", p, x)``: rows of ``x`` mixed by ``p`` transposed."""
    return (p.transpose(2, 3) @ x.transpose(1, 2)).transpose(1, 2)


def _scores(qp, kp, alpha, scale, valid, dropout_pr, training, rab=None):
    """``valid * silu(alpha * q k^T + rab) * s_i`` (+ dropout) for padded ``[B, Q|N, H, D]`` tensors;
    ``valid: [B, H|1, Q, N]``, ``rab: [B|1, H|1, Q, N]`` or None."""
    a = alpha * _pairs(qp, kp)
    if rab is not None:
        a = a + rab.to(a.dtype)
    p = F.silu(a) * scale
    p = p * valid.to(p.dtype)
    if dropout_pr > 0.0 and training:
        p = F.dropout(p, p=dropout_pr, training=True)
    return p


def hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    dropout_pr: float = 0.0,
    training: bool = True,
    num_targets: torch.Tensor | None = None,
    attn_scale: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    rab: torch.Tensor | None = None,
    intervals: torch.Tensor | None = None,
    *,
    spec: AttentionSpec | None = None,
) -> torch.Tensor:
    """Jagged HSTU attention: ``q, k: [L, H, Dq]``, ``v: [L, H, Dv]`` -> ``[L, H, Dv]``.

    ``out_i = sum_j valid(i, j) * silu(alpha <q_i, k_j> + rab(i, j)) * s_i * v_j`` per head, with
    ``s_i = 1/N`` or ``attn_scale`` (scalar or per-row ``[L]``). No softmax. ``rab``: dense
    ``[B|1, H|1, N, N]`` on padded positions (its gradient is summed over broadcast dims by autograd);
    ``intervals: [H|1, L, 3]`` replaces ``valid`` (:func:`~.mask.interval_mask`). ``spec``: all mask options
    at once (an :class:`~hstu_inductor.spec.AttentionSpec`), in place of the loose ones. docs/semantics.md.
    """
    if spec is not None:
        causal, max_attn_len, contextual_seq_len, min_full_attn_seq_len = (
            spec.causal, spec.max_attn_len, spec.contextual_seq_len, spec.min_full_attn_seq_len)
    else:
        spec = AttentionSpec(causal, max_attn_len, contextual_seq_len, min_full_attn_seq_len)
    validate_attention_inputs(
        q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale,
        max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal=causal,
    )
    validate_rab_intervals(q, seq_offsets, max_seq_len, rab, intervals, num_targets, max_attn_len,
                           contextual_seq_len, min_full_attn_seq_len)
    N, L = max_seq_len, q.shape[0]
    rows = padded_rows(seq_offsets, N, L)
    pad = lambda t: gather_padded(t, rows)  # noqa: E731
    valid = _valid(seq_offsets, N, num_targets, spec, intervals)
    scale = _row_scale(attn_scale, seq_offsets, N, pad)
    p = _scores(pad(q), pad(k), alpha, scale, valid, dropout_pr, training, rab)
    out = _mix(p, pad(v))
    return padded_to_jagged(out, seq_offsets, L)


def hstu_mha_backward(
    grad: torch.Tensor,
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    attn_scale: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    need_scale_grad: bool = False,
    rab: torch.Tensor | None = None,
    intervals: torch.Tensor | None = None,
    need_rab_grad: bool = False,
    *,
    spec: AttentionSpec | None = None,
):
    """Closed-form gradients of :func:`hstu_mha` (no dropout): ``(dq, dk, dv, d_attn_scale)``, and
    ``d_rab`` appended when ``need_rab_grad``.

    With ``A = alpha * q k^T + rab`` and ``P = valid * silu(A) * s``: ``dv = P^T g``, ``dP = g v^T``,
    ``dA = dP * valid * s * silu'(A)``, ``dq = alpha dA k``, ``dk = alpha dA^T q``,
    ``d_rab = dA`` summed over rab's broadcast dims, and ``ds_i = sum_{h,j} dP * valid * silu(A)``
    (summed over all rows for a scalar ``s``). ``d_attn_scale`` is None unless ``need_scale_grad``.
    """
    spec = spec or AttentionSpec(causal, max_attn_len, contextual_seq_len, min_full_attn_seq_len)
    N, L = max_seq_len, q.shape[0]
    rows = padded_rows(seq_offsets, N, L)
    seq, pos = row_to_sequence(seq_offsets, L)
    pad = lambda t: gather_padded(t, rows)  # noqa: E731
    unpad = lambda t: t[seq, pos]  # noqa: E731  (padded_to_jagged, sharing the row map)
    valid = _valid(seq_offsets, N, num_targets, spec, intervals).to(q.dtype)  # [B, H|1, N, N]
    scale = _row_scale(attn_scale, seq_offsets, N, pad)
    qp, kp, vp, gp = pad(q), pad(k), pad(v), pad(grad)
    a = alpha * _pairs(qp, kp)
    if rab is not None:
        a = a + rab.to(a.dtype)
    sig = torch.sigmoid(a)
    silu = a * sig
    p = silu * scale * valid
    dv = _mix_t(p, gp)
    dp = _pairs(gp, vp) * valid
    da = dp * scale * (sig * (1 + a * (1 - sig)))
    dq = alpha * _mix(da, kp)
    dk = alpha * _mix_t(da, qp)
    d_scale = None
    if need_scale_grad:
        per_row = (dp * silu).sum(dim=(1, 3))  # [B, N]
        d_scale = per_row.sum().reshape(attn_scale.shape) if attn_scale.numel() == 1 else unpad(per_row)
    if need_rab_grad:
        bcast = [d for d in (0, 1) if rab.shape[d] == 1]
        d_rab = (da.sum(dim=bcast, keepdim=True) if bcast else da).to(rab.dtype)  # sum(dim=[]) sums all
        return unpad(dq), unpad(dk), unpad(dv), d_scale, d_rab
    return unpad(dq), unpad(dk), unpad(dv), d_scale


def delta_hstu_mha(
    max_seq_len: int,
    alpha: float,
    delta_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None = None,
    attn_scale: torch.Tensor | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    *,
    spec: AttentionSpec | None = None,
) -> torch.Tensor:
    """Cached attention: ``delta_q: [B*D, H, Dq]`` are the last ``D`` rows of every sequence.

    Returns ``[B*D, H, Dv]`` equal to rows ``n_b-D .. n_b-1`` of :func:`hstu_mha` (causal, f = 0).
    ``attn_scale`` is None, a scalar, or per delta row ``[B*D]``. Requires ``n_b >= D``. ``spec``: the mask
    options at once (causal, no full-attention tail), in place of the loose ones.
    """
    if spec is not None:
        max_attn_len, contextual_seq_len = spec.max_attn_len, spec.contextual_seq_len
    spec = spec or AttentionSpec(True, max_attn_len, contextual_seq_len)
    B = seq_offsets.shape[0] - 1
    require(B > 0 or delta_q.shape[0] == 0, lambda: "seq_offsets describes no sequence")
    validate_attention_inputs(
        delta_q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale,
        max_attn_len, contextual_seq_len, 0, num_query_rows=delta_q.shape[0],
    )
    D = delta_q.shape[0] // max(B, 1)
    require(D * B == delta_q.shape[0], lambda: f"delta_q rows {delta_q.shape[0]} not a multiple of B={B}")
    N = max_seq_len
    lengths = lengths_from_offsets(seq_offsets)
    if _is_concrete(lengths) and lengths.numel():
        require(bool((lengths >= D).all()), lambda: f"every sequence needs at least D={D} rows")
    qpos = lengths.unsqueeze(1) - D + torch.arange(D, device=lengths.device, dtype=lengths.dtype)  # [B, D]
    valid = hstu_mask(lengths, N, num_targets, query_positions=qpos, spec=spec).unsqueeze(1)
    qd = delta_q.reshape(B, D, *delta_q.shape[1:])
    rows = lambda t: t.reshape(B, D)  # noqa: E731
    scale = _row_scale(attn_scale, seq_offsets, N, rows)
    kv_rows = padded_rows(seq_offsets, N, k.shape[0])
    p = _scores(qd, gather_padded(k, kv_rows), alpha, scale, valid, 0.0, False)
    out = _mix(p, gather_padded(v, kv_rows))
    return out.reshape(B * D, *out.shape[2:])
