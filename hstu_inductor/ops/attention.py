"""``hstu::attention`` / ``hstu::attention_bwd`` / ``hstu::attention_bwd_rab`` / ``hstu::attention_bwd_bias`` /
``hstu::delta_attention``.

All three are ``torch.library.triton_op`` s. Their bodies pick the implementation by device:
CUDA runs the Triton kernels of :mod:`hstu_inductor.kernels` (launched through ``wrap_triton``),
anything else - or CUDA with ``config.kernels == "off"`` / no usable Triton - runs the eager
reference. Because they are triton_ops:

* ``torch.export`` keeps each as one node (what the export rewrite produces);
* torch.compile / AOTInductor trace *into* the body, so Inductor's generated code (and an AOTI
  package) contains our Triton kernels - or, on CPU, plain ATen - and no call back into Python;
* the body doubles as the fake (meta) implementation, so it only uses shapes, never data.

On sm90 GPUs the CUDA forward and backward run the warp-specialised Gluon kernels for calls in their scope
(:mod:`._gluon`: causal, optional targets, D = 128, 16-bit, no other mask option or bias).

The forward ops check the values of the jagged inputs in a way that survives compilation
(:mod:`._checks`, ``config.check_inputs``); the backward op trusts the offsets its forward checked.

``rab`` (dense relative attention bias ``[B|1, H|1, N, N]``) and ``intervals`` (``[H|1, L, 3]``, replacing
the HSTU mask) are trailing optional arguments (docs/semantics.md). ``attention_bwd`` takes them too
and still returns four tensors; ``attention_bwd_rab`` also returns ``d_rab`` and is what autograd calls
when rab needs a gradient (a fifth output on ``attention_bwd`` would break its existing callers).

The original HSTU's table bias (``pos_w[N-1+j-i] + ts_w[bucket(ts(next(i)) - ts(j))]``) is three more
trailing optional tensors, ``timestamps: [L]`` (or ``[B, N]`` padded by the caller), ``pos_w: [2N-1]``, ``ts_w: [num_buckets+1]`` (either table
may be left out; ``num_buckets`` is ``len(ts_w) - 1``, so no extra int argument). The kernels compute the
bias in-kernel; elsewhere the body materialises it with ``reference.relative_bias``. Separate tensors
rather than one tuple argument: a custom-op schema has no optional tuples, and autograd, fake tensors,
opcheck and AOTI all handle plain optional tensors. Any table routes the backward to
``attention_bwd_bias``, which also returns ``d_pos_w`` / ``d_ts_w``. A last optional ``ts_bounds: [num_buckets]``
(``reference.time_bucket_bounds``) gives the time-bucket thresholds of any monotone bucketisation (a user's
fp32-log bucket); None means the default fp64-log bucket's, which the kernels cache per (num_buckets, dtype,
device).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from .. import config
from .._compat import plain_eager
from ..reference import (delta_hstu_mha, hstu_mha, hstu_mha_backward, relative_bias, relative_bias_backward,
                         validate_attention_inputs, validate_rab_intervals, validate_rab_tables)
from . import _gluon
from ._checks import check_jagged_values
from ._kernels import cuda_kernels, delta_kernels

__all__ = ["attention", "attention_bwd", "attention_bwd_rab", "attention_bwd_bias", "delta_attention"]


def _tma():
    return {"auto": None, "on": True, "off": False}[config.tma]


def _kernels_for(t: Tensor):
    """The kernels module when ``t`` lives on CUDA and kernels are enabled, else None."""
    return cuda_kernels() if t.device.type == "cuda" else None


def _delta_kernels_for(t: Tensor):
    """The cached-attention kernels module (kernels/delta.py) when ``t`` lives on CUDA, else None."""
    return delta_kernels() if t.device.type == "cuda" else None


_INDEX_DTYPES = (torch.int32, torch.int64)


def _plain_inputs_ok(q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, w, c, f, causal) -> bool:
    """True when a plain eager call passes every shape/dtype/device check of ``validate_attention_inputs``
    (no rab/intervals), as plain Python compares: its ~25 ``torch._check`` calls cost ~20 us of host time
    per call. False (or traced, where the checks must stay ``torch._check``): the validators
    run and name the problem."""
    if not plain_eager(q, k, v, seq_offsets, num_targets, attn_scale):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    return (len(qs) == len(ks) == len(vs) == 3 and qs == ks and ks[:2] == vs[:2]
            and q.dtype == k.dtype == v.dtype and q.is_floating_point()
            and q.device == k.device == v.device == seq_offsets.device
            and max_seq_len >= 1 and w >= 0 and c >= 0 and f >= 0
            and (causal or (num_targets is None and w == 0 and c == 0 and f == 0))
            and seq_offsets.dim() == 1 and seq_offsets.dtype in _INDEX_DTYPES and seq_offsets.shape[0] >= 1
            and (num_targets is None or (num_targets.dim() == 1 and num_targets.shape[0] == seq_offsets.shape[0] - 1
                                         and not num_targets.is_floating_point()))
            and (attn_scale is None or attn_scale.numel() == 1
                 or (attn_scale.dim() == 1 and attn_scale.shape[0] == qs[0])))


@triton_op("hstu::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
              num_targets: Optional[Tensor] = None, attn_scale: Optional[Tensor] = None, max_attn_len: int = 0,
              contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0, causal: bool = True,
              rab: Optional[Tensor] = None, intervals: Optional[Tensor] = None, timestamps: Optional[Tensor] = None,
              pos_w: Optional[Tensor] = None, ts_w: Optional[Tensor] = None,
              ts_bounds: Optional[Tensor] = None, ts_next: bool = True) -> Tensor:
    """Jagged HSTU attention forward, ``[L, H, Dv]`` (see ``reference.hstu_mha``); the bias inside the silu is
    ``rab`` plus the table bias of ``timestamps``/``pos_w``/``ts_w`` (docs/semantics.md), time buckets from the
    thresholds ``ts_bounds`` (None: those of the default fp64-log bucket) of the gap ``ts(next(i)) - ts(j)``
    (``ts_next``, the original HSTU) or ``ts(i) - ts(j)``."""
    plain = not _has_bias(rab, intervals, timestamps, pos_w, ts_w, ts_bounds)
    if not (plain and _plain_inputs_ok(q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                                       contextual_seq_len, min_full_attn_seq_len, causal)):
        validate_attention_inputs(q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                                  contextual_seq_len, min_full_attn_seq_len, causal=causal, check_values=False)
        validate_rab_intervals(q, seq_offsets, max_seq_len, rab, intervals, num_targets, max_attn_len,
                               contextual_seq_len, min_full_attn_seq_len)
        validate_rab_tables(q, max_seq_len, timestamps, pos_w, ts_w, ts_bounds, seq_offsets)
    check_jagged_values(seq_offsets, k.shape[0], max_seq_len, num_targets)
    kern = _kernels_for(q)
    if kern is not None:
        how = _gluon.route(q, k, v, num_targets, attn_scale, max_attn_len, contextual_seq_len, min_full_attn_seq_len,
                           causal, not plain)
        if how is not None:
            return _gluon.forward(how, q, k, v, seq_offsets, max_seq_len, alpha, num_targets)
        return kern.hstu_attention_fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                                       max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal, tma=_tma(),
                                       **_bias_kw(rab, intervals, timestamps, pos_w, ts_w, ts_bounds, ts_next))
    return hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal=causal, dropout_pr=0.0, training=False,
                    num_targets=num_targets, attn_scale=attn_scale, max_attn_len=max_attn_len,
                    contextual_seq_len=contextual_seq_len, min_full_attn_seq_len=min_full_attn_seq_len,
                    rab=_dense_bias(rab, seq_offsets, max_seq_len, timestamps, pos_w, ts_w, ts_bounds, ts_next),
                    intervals=intervals).contiguous()


def _has_bias(*bias_args) -> bool:
    """Any of rab, intervals, timestamps, pos_w, ts_w, ts_bounds given (the kernels' bias/mask extras)."""
    return any(t is not None for t in bias_args)


def _has_tables(pos_w, ts_w) -> bool:
    return pos_w is not None or ts_w is not None


def _bias_kw(rab, intervals, timestamps, pos_w, ts_w, ts_bounds=None, ts_next=True) -> dict:
    """Kernel keywords; none at all without a bias or intervals (the launch is then the bias-free one)."""
    kw = {}
    if rab is not None or intervals is not None:
        kw.update(rab=rab, intervals=intervals)
    if _has_tables(pos_w, ts_w):
        kw.update(timestamps=timestamps if ts_w is not None else None, pos_w=pos_w, ts_w=ts_w)
        if ts_bounds is not None:  # None: the kernels use the default thresholds (cached there)
            kw["ts_bounds"] = ts_bounds
        if not ts_next:
            kw["ts_next"] = False
    return kw


def _dense_bias(rab, seq_offsets, max_seq_len, timestamps, pos_w, ts_w, ts_bounds=None, ts_next=True):
    """The reference path's bias: ``rab`` plus the materialised table bias ``[B, 1, N, N]``."""
    if not _has_tables(pos_w, ts_w):
        return rab
    tb = relative_bias(timestamps, seq_offsets, max_seq_len, pos_w, ts_w, ts_bounds, ts_next)
    return tb if rab is None else rab + tb


def _bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len, contextual_seq_len,
         min_full_attn_seq_len, causal, need_scale_grad, rab, intervals, need_rab_grad, timestamps=None, pos_w=None,
         ts_w=None, need_table_grad=None, ts_bounds=None, ts_next=True):
    """Body of the backward ops: ``(dq, dk, dv, d_attn_scale[, d_rab])``, empty ``d_attn_scale`` unless
    requested (the kernels do not compute it, so that case runs the reference). ``need_table_grad`` not
    None (``attention_bwd_bias``): always ``(dq, dk, dv, d_attn_scale, d_rab, d_pos_w, d_ts_w)``, empty
    tensors for gradients not requested."""
    bias_op = need_table_grad is not None
    need_tab = bool(need_table_grad) and _has_tables(pos_w, ts_w)
    need_rab = need_rab_grad and rab is not None
    empty = lambda: q.new_empty(0)  # noqa: E731  (a fresh one per output: outputs may not alias)
    kern = None if need_scale_grad else _kernels_for(q)
    how = None if kern is None else _gluon.route_bwd(
        grad, q, k, v, num_targets, attn_scale, max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal,
        _has_bias(rab, intervals, timestamps, pos_w, ts_w, ts_bounds), need_scale_grad)
    if how is not None:  # no bias in scope: no d_rab / table gradients to return
        dq, dk, dv = _gluon.backward(how, grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets)
        d_scale, d_rab, d_pos, d_ts = empty(), None, None, None
    elif kern is not None:
        extra = _bias_kw(rab, intervals, timestamps, pos_w, ts_w, ts_bounds, ts_next)
        if rab is not None or intervals is not None:
            extra["rab_grad"] = need_rab
        if need_tab:
            extra["table_grad"] = True
        got = kern.hstu_attention_bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                                      max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal,
                                      deterministic=config.deterministic, tma=_tma(), **extra)
        dq, dk, dv, d_scale, rest = got[0], got[1], got[2], empty(), list(got[3:])
        d_rab = rest.pop(0) if need_rab else None
        d_pos, d_ts = rest if need_tab else (None, None)
    else:
        bias = _dense_bias(rab, seq_offsets, max_seq_len, timestamps, pos_w, ts_w, ts_bounds, ts_next)
        need_bias = need_rab or need_tab
        got = hstu_mha_backward(grad, max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, attn_scale,
                                max_attn_len, contextual_seq_len, min_full_attn_seq_len, need_scale_grad, rab=bias,
                                intervals=intervals, need_rab_grad=need_bias)
        dq, dk, dv = (t.contiguous() for t in got[:3])
        d_scale = got[3].contiguous() if need_scale_grad else empty()
        d_rab = d_pos = d_ts = None
        if need_rab:
            d_rab = got[4].sum_to_size(rab.shape).to(rab.dtype).contiguous()
        if need_tab:
            d_pos, d_ts = relative_bias_backward(got[4], timestamps, seq_offsets, max_seq_len,
                                                 ts_w.shape[0] - 1 if ts_w is not None else None, ts_bounds,
                                                 ts_next)
            d_pos = d_pos.to(pos_w.dtype) if pos_w is not None else None
            d_ts = d_ts.to(ts_w.dtype) if ts_w is not None else None
    if not bias_op:
        return (dq, dk, dv, d_scale) + ((d_rab,) if need_rab_grad else ())
    return dq, dk, dv, d_scale, *(empty() if t is None else t for t in (d_rab, d_pos, d_ts))


@triton_op("hstu::attention_bwd", mutates_args=())
def attention_bwd(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int,
                  alpha: float, num_targets: Optional[Tensor], attn_scale: Optional[Tensor], max_attn_len: int,
                  contextual_seq_len: int, min_full_attn_seq_len: int, causal: bool,
                  need_scale_grad: bool, rab: Optional[Tensor] = None,
                  intervals: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, d_attn_scale)``; ``d_attn_scale`` is empty unless requested."""
    return _bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad, rab, intervals, False)


@triton_op("hstu::attention_bwd_rab", mutates_args=())
def attention_bwd_rab(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int,
                      alpha: float, num_targets: Optional[Tensor], attn_scale: Optional[Tensor], max_attn_len: int,
                      contextual_seq_len: int, min_full_attn_seq_len: int, causal: bool, need_scale_grad: bool,
                      rab: Tensor, intervals: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`attention_bwd` plus ``d_rab`` (rab's shape and dtype, summed over its broadcast dims)."""
    return _bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad, rab, intervals, True)


@triton_op("hstu::attention_bwd_bias", mutates_args=())
def attention_bwd_bias(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int,
                       alpha: float, num_targets: Optional[Tensor], attn_scale: Optional[Tensor], max_attn_len: int,
                       contextual_seq_len: int, min_full_attn_seq_len: int, causal: bool, need_scale_grad: bool,
                       rab: Optional[Tensor], intervals: Optional[Tensor], timestamps: Optional[Tensor],
                       pos_w: Optional[Tensor], ts_w: Optional[Tensor], need_rab_grad: bool,
                       need_table_grad: bool, ts_bounds: Optional[Tensor] = None, ts_next: bool = True
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward with the table bias: ``(dq, dk, dv, d_attn_scale, d_rab, d_pos_w, d_ts_w)``; a gradient not
    requested (or of an absent input) is an empty tensor. ``ts_bounds`` as in :func:`attention`."""
    validate_rab_tables(q, max_seq_len, timestamps, pos_w, ts_w, ts_bounds, seq_offsets)
    return _bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad, rab, intervals, need_rab_grad,
                timestamps, pos_w, ts_w, need_table_grad, ts_bounds, ts_next)


def _setup_context(ctx, inputs, output):
    (q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len, contextual_seq_len,
     min_full_attn_seq_len, causal, rab, intervals, timestamps, pos_w, ts_w, ts_bounds, ts_next) = inputs
    ctx.save_for_backward(q, k, v, seq_offsets, num_targets, attn_scale, rab, intervals, timestamps, pos_w, ts_w,
                          ts_bounds)
    ctx.args = (max_seq_len, alpha, max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal)
    ctx.ts_next = ts_next
    ctx.need_scale_grad = attn_scale is not None and ctx.needs_input_grad[7]
    ctx.need_rab_grad = rab is not None and ctx.needs_input_grad[12]
    ctx.need_table_grad = (pos_w is not None and ctx.needs_input_grad[15]) or (
        ts_w is not None and ctx.needs_input_grad[16])


def _backward(ctx, grad):
    q, k, v, seq_offsets, num_targets, attn_scale, rab, intervals, timestamps, pos_w, ts_w, ts_bounds = ctx.saved_tensors
    max_seq_len, alpha, w, c, f, causal = ctx.args
    args = (grad.contiguous(), q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, w, c, f, causal,
            ctx.need_scale_grad)
    d_rab = d_pos = d_ts = None
    if _has_tables(pos_w, ts_w):
        dq, dk, dv, d_scale, d_rab, d_pos, d_ts = torch.ops.hstu.attention_bwd_bias(
            *args, rab, intervals, timestamps, pos_w, ts_w, ctx.need_rab_grad, ctx.need_table_grad, ts_bounds,
            ctx.ts_next)
        d_rab = d_rab if ctx.need_rab_grad else None
        d_pos = d_pos if ctx.need_table_grad and pos_w is not None else None
        d_ts = d_ts if ctx.need_table_grad and ts_w is not None else None
    elif ctx.need_rab_grad:
        dq, dk, dv, d_scale, d_rab = torch.ops.hstu.attention_bwd_rab(*args, rab, intervals)
    elif rab is None and intervals is None:  # the graph of models without rab/intervals is unchanged
        dq, dk, dv, d_scale = torch.ops.hstu.attention_bwd(*args)
    else:
        dq, dk, dv, d_scale = torch.ops.hstu.attention_bwd(*args, rab, intervals)
    return (dq, dk, dv, None, None, None, None, (d_scale if ctx.need_scale_grad else None), None, None, None, None,
            d_rab, None, None, d_pos, d_ts, None, None)


attention.register_autograd(_backward, setup_context=_setup_context)


@triton_op("hstu::delta_attention", mutates_args=())
def delta_attention(delta_q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
                    num_targets: Optional[Tensor] = None, attn_scale: Optional[Tensor] = None,
                    max_attn_len: int = 0, contextual_seq_len: int = 0) -> Tensor:
    """Cached attention for inference: the last ``D`` rows of every sequence (``[B*D, H, Dv]``).
    Inference only (no autograd)."""
    validate_attention_inputs(delta_q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                              contextual_seq_len, 0, num_query_rows=delta_q.shape[0], check_values=False)
    B = seq_offsets.shape[0] - 1
    check_jagged_values(seq_offsets, k.shape[0], max_seq_len, num_targets,
                        min_length=delta_q.shape[0] // B if B > 0 else 0)
    kern = _delta_kernels_for(delta_q)
    if kern is not None:
        return kern.delta_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets,
                                             attn_scale, max_attn_len, contextual_seq_len, tma=_tma())
    return delta_hstu_mha(max_seq_len, alpha, delta_q, k, v, seq_offsets, num_targets, attn_scale, max_attn_len,
                          contextual_seq_len).contiguous()
