"""``hstu::attention`` / ``hstu::attention_bwd`` / ``hstu::attention_bwd_rab`` / ``hstu::attention_bwd_bias`` /
``hstu::delta_attention``.

All are ``torch.library.triton_op`` s. The mask options arrive as plain schema arguments and become one
:class:`~hstu_inductor.spec.AttentionSpec` at the top of each body; the attention bodies then ask the variant
registry (:mod:`.variants`) which implementation runs: on CUDA the Triton kernels of :mod:`hstu_inductor.kernels`
(launched through ``wrap_triton``, with or without TMA descriptors), anywhere else - or with
``config.kernels == "off"`` / no usable Triton - the eager reference. Because they are triton_ops:

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
from ..spec import AttentionSpec
from . import _gluon  # noqa: F401  (registers the Gluon variants)
from . import variants
from ._checks import check_jagged_values
from . import _kernels
from ._kernels import delta_kernels

__all__ = ["attention", "attention_bwd", "attention_bwd_rab", "attention_bwd_bias", "delta_attention"]


def _tma():
    return {"auto": None, "on": True, "off": False}[config.tma]


def _delta_kernels_for(t: Tensor):
    """The cached-attention kernels module (kernels/delta.py) when ``t`` lives on CUDA, else None."""
    return delta_kernels() if t.device.type == "cuda" else None


_INDEX_DTYPES = (torch.int32, torch.int64)


def _plain_inputs_ok(q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, spec: AttentionSpec) -> bool:
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
            and max_seq_len >= 1 and spec.holds(has_targets=num_targets is not None)
            and seq_offsets.dim() == 1 and seq_offsets.dtype in _INDEX_DTYPES and seq_offsets.shape[0] >= 1
            and (num_targets is None or (num_targets.dim() == 1 and num_targets.shape[0] == seq_offsets.shape[0] - 1
                                         and not num_targets.is_floating_point()))
            and (attn_scale is None or attn_scale.numel() == 1
                 or (attn_scale.dim() == 1 and attn_scale.shape[0] == qs[0])))


@triton_op("hstu::attention", mutates_args=())
@AttentionSpec.op_params
def attention(q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
              num_targets: Optional[Tensor] = None, attn_scale: Optional[Tensor] = None, max_attn_len: int = 0,
              contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0, causal: bool = True,
              rab: Optional[Tensor] = None, intervals: Optional[Tensor] = None, timestamps: Optional[Tensor] = None,
              pos_w: Optional[Tensor] = None, ts_w: Optional[Tensor] = None,
              ts_bounds: Optional[Tensor] = None, ts_next: bool = True, **added) -> Tensor:
    """Jagged HSTU attention forward, ``[L, H, Dv]`` (see ``reference.hstu_mha``); the bias inside the silu is
    ``rab`` plus the table bias of ``timestamps``/``pos_w``/``ts_w`` (docs/semantics.md), time buckets from the
    thresholds ``ts_bounds`` (None: those of the default fp64-log bucket) of the gap ``ts(next(i)) - ts(j)``
    (``ts_next``, the original HSTU) or ``ts(i) - ts(j)``."""
    spec = AttentionSpec.from_op_args(max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal, ts_next,
                                      **added)
    call = variants.AttentionCall(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, spec, rab,
                                  intervals, timestamps, pos_w, ts_w, ts_bounds)
    if call.has_bias or not _plain_inputs_ok(q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, spec):
        validate_attention_inputs(q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                                  contextual_seq_len, min_full_attn_seq_len, causal=causal, check_values=False)
        validate_rab_intervals(q, seq_offsets, max_seq_len, rab, intervals, num_targets, max_attn_len,
                               contextual_seq_len, min_full_attn_seq_len)
        validate_rab_tables(q, max_seq_len, timestamps, pos_w, ts_w, ts_bounds, seq_offsets)
    check_jagged_values(seq_offsets, k.shape[0], max_seq_len, num_targets)
    return variants.run("fwd", call)


# --------------------------------------------------------------------------------------------
# Variants: the Triton kernels (TMA descriptors or pointer loads) and the eager reference.
# The warp-specialised Gluon kernels register in ops/_gluon.py.
# --------------------------------------------------------------------------------------------


def _triton_scope(tma: bool):
    """Scope of the Triton kernels with (``tma``) or without tensor descriptors: CUDA with the kernels enabled,
    and for the backward no ``attn_scale`` gradient (the kernels do not compute it)."""
    def scope(c: variants.AttentionCall):
        if c.need_scale_grad:
            return None
        kern = _kernels.kernels_for(c.q)
        if kern is None:
            return None
        uses = kern.uses_tma(_tma(), c.q.device, (c.q, c.k, c.v), c.max_seq_len)
        return kern if uses == tma else None
    return scope


def _triton_fwd(tma: bool):
    def run(kern, c: variants.AttentionCall):
        return kern.hstu_attention_fwd(c.q, c.k, c.v, c.seq_offsets, c.max_seq_len, c.alpha, c.num_targets,
                                       c.attn_scale, spec=c.spec, tma=tma, **_bias_kw(c))
    return run


def _reference_fwd(_, c: variants.AttentionCall):
    return hstu_mha(c.max_seq_len, c.alpha, c.q, c.k, c.v, c.seq_offsets, dropout_pr=0.0, training=False,
                    num_targets=c.num_targets, attn_scale=c.attn_scale, rab=_dense_bias(c), intervals=c.intervals,
                    spec=c.spec).contiguous()


def _always(_c):
    return True


def _bias_kw(c: variants.AttentionCall) -> dict:
    """Kernel keywords; none at all without a bias or intervals (the launch is then the bias-free one)."""
    kw = {}
    if c.rab is not None or c.intervals is not None:
        kw.update(rab=c.rab, intervals=c.intervals)
    if c.has_tables:
        kw.update(timestamps=c.timestamps if c.ts_w is not None else None, pos_w=c.pos_w, ts_w=c.ts_w)
        if c.ts_bounds is not None:  # None: the kernels use the default thresholds (cached there)
            kw["ts_bounds"] = c.ts_bounds
    return kw


def _dense_bias(c: variants.AttentionCall):
    """The reference path's bias: ``rab`` plus the materialised table bias ``[B, 1, N, N]``."""
    if not c.has_tables:
        return c.rab
    tb = relative_bias(c.timestamps, c.seq_offsets, c.max_seq_len, c.pos_w, c.ts_w, c.ts_bounds, c.spec.ts_next)
    return tb if c.rab is None else c.rab + tb


def _empty(q):
    return q.new_empty(0)  # a fresh one per output: outputs may not alias


def _triton_bwd(tma: bool):
    def run(kern, c: variants.AttentionCall):
        """``(dq, dk, dv, d_scale, d_rab, d_pos, d_ts)``, None for gradients not computed."""
        extra = _bias_kw(c)
        need_rab, need_tab = c.rab_grad_wanted, c.table_grad_wanted
        if c.rab is not None or c.intervals is not None:
            extra["rab_grad"] = need_rab
        if need_tab:
            extra["table_grad"] = True
        got = kern.hstu_attention_bwd(c.grad, c.q, c.k, c.v, c.seq_offsets, c.max_seq_len, c.alpha, c.num_targets,
                                      c.attn_scale, spec=c.spec, deterministic=config.deterministic, tma=tma,
                                      **extra)
        rest = list(got[3:])
        d_rab = rest.pop(0) if need_rab else None
        d_pos, d_ts = rest if need_tab else (None, None)
        return got[0], got[1], got[2], _empty(c.q), d_rab, d_pos, d_ts
    return run


def _reference_bwd(_, c: variants.AttentionCall):
    need_rab, need_tab = c.rab_grad_wanted, c.table_grad_wanted
    got = hstu_mha_backward(c.grad, c.max_seq_len, c.alpha, c.q, c.k, c.v, c.seq_offsets,
                            num_targets=c.num_targets, attn_scale=c.attn_scale, need_scale_grad=c.need_scale_grad,
                            rab=_dense_bias(c), intervals=c.intervals, need_rab_grad=need_rab or need_tab,
                            spec=c.spec)
    dq, dk, dv = (t.contiguous() for t in got[:3])
    d_scale = got[3].contiguous() if c.need_scale_grad else _empty(c.q)
    d_rab = d_pos = d_ts = None
    if need_rab:
        d_rab = got[4].sum_to_size(c.rab.shape).to(c.rab.dtype).contiguous()
    if need_tab:
        d_bias = got[4]
        per_head = [t is not None and t.dim() == 2 for t in (c.pos_w, c.ts_w)]
        if any(per_head):  # every head's own gradient (a bias broadcast over heads gave one shared row)
            d_bias = d_bias.expand(d_bias.shape[0], c.q.shape[1], *d_bias.shape[2:])
        d_pos, d_ts = relative_bias_backward(d_bias, c.timestamps, c.seq_offsets, c.max_seq_len,
                                             c.ts_w.shape[-1] - 1 if c.ts_w is not None else None, c.ts_bounds,
                                             c.spec.ts_next, *per_head)
        d_pos = d_pos.to(c.pos_w.dtype) if c.pos_w is not None else None
        d_ts = d_ts.to(c.ts_w.dtype) if c.ts_w is not None else None
    return dq, dk, dv, d_scale, d_rab, d_pos, d_ts


for _direction, _run_triton, _run_reference in (("fwd", _triton_fwd, _reference_fwd),
                                               ("bwd", _triton_bwd, _reference_bwd)):
    variants.register(variants.Variant("triton_tma", _direction, 20, _triton_scope(True), _run_triton(True)))
    variants.register(variants.Variant("triton", _direction, 10, _triton_scope(False), _run_triton(False)))
    variants.register(variants.Variant("reference", _direction, 0, _always, _run_reference))


def _bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len, contextual_seq_len,
         min_full_attn_seq_len, causal, need_scale_grad, rab, intervals, need_rab_grad, timestamps=None, pos_w=None,
         ts_w=None, need_table_grad=None, ts_bounds=None, ts_next=True, added=None):
    """Body of the backward ops: ``(dq, dk, dv, d_attn_scale[, d_rab])``, empty ``d_attn_scale`` unless
    requested (the kernels do not compute it, so that case runs the reference). ``need_table_grad`` not
    None (``attention_bwd_bias``): always ``(dq, dk, dv, d_attn_scale, d_rab, d_pos_w, d_ts_w)``, empty
    tensors for gradients not requested."""
    spec = AttentionSpec.from_op_args(max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal, ts_next,
                                      **(added or {}))
    call = variants.AttentionCall(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, spec, rab,
                                  intervals, timestamps, pos_w, ts_w, ts_bounds, grad=grad,
                                  need_scale_grad=need_scale_grad, need_rab_grad=need_rab_grad,
                                  need_table_grad=bool(need_table_grad))
    dq, dk, dv, d_scale, d_rab, d_pos, d_ts = variants.run("bwd", call)
    if need_table_grad is None:
        return (dq, dk, dv, d_scale) + ((d_rab,) if need_rab_grad else ())
    return dq, dk, dv, d_scale, *(_empty(q) if t is None else t for t in (d_rab, d_pos, d_ts))


@triton_op("hstu::attention_bwd", mutates_args=())
@AttentionSpec.op_params
def attention_bwd(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int,
                  alpha: float, num_targets: Optional[Tensor], attn_scale: Optional[Tensor], max_attn_len: int,
                  contextual_seq_len: int, min_full_attn_seq_len: int, causal: bool,
                  need_scale_grad: bool, rab: Optional[Tensor] = None,
                  intervals: Optional[Tensor] = None, **added) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, d_attn_scale)``; ``d_attn_scale`` is empty unless requested."""
    return _bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad, rab, intervals, False, added=added)


@triton_op("hstu::attention_bwd_rab", mutates_args=())
@AttentionSpec.op_params
def attention_bwd_rab(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int,
                      alpha: float, num_targets: Optional[Tensor], attn_scale: Optional[Tensor], max_attn_len: int,
                      contextual_seq_len: int, min_full_attn_seq_len: int, causal: bool, need_scale_grad: bool,
                      rab: Tensor, intervals: Optional[Tensor], **added
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`attention_bwd` plus ``d_rab`` (rab's shape and dtype, summed over its broadcast dims)."""
    return _bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad, rab, intervals, True, added=added)


@triton_op("hstu::attention_bwd_bias", mutates_args=())
@AttentionSpec.op_params
def attention_bwd_bias(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int,
                       alpha: float, num_targets: Optional[Tensor], attn_scale: Optional[Tensor], max_attn_len: int,
                       contextual_seq_len: int, min_full_attn_seq_len: int, causal: bool, need_scale_grad: bool,
                       rab: Optional[Tensor], intervals: Optional[Tensor], timestamps: Optional[Tensor],
                       pos_w: Optional[Tensor], ts_w: Optional[Tensor], need_rab_grad: bool,
                       need_table_grad: bool, ts_bounds: Optional[Tensor] = None, ts_next: bool = True, **added
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward with the table bias: ``(dq, dk, dv, d_attn_scale, d_rab, d_pos_w, d_ts_w)``; a gradient not
    requested (or of an absent input) is an empty tensor. ``ts_bounds`` as in :func:`attention`."""
    validate_rab_tables(q, max_seq_len, timestamps, pos_w, ts_w, ts_bounds, seq_offsets)
    return _bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad, rab, intervals, need_rab_grad,
                timestamps, pos_w, ts_w, need_table_grad, ts_bounds, ts_next, added)


def _setup_context(ctx, inputs, output, keyword_only_inputs=None):
    (q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len, contextual_seq_len,
     min_full_attn_seq_len, causal, rab, intervals, timestamps, pos_w, ts_w, ts_bounds, ts_next) = inputs
    # options added to AttentionSpec arrive keyword-only (torch passes them apart; they get no gradient)
    ctx.added = dict(keyword_only_inputs or {})
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
    kw = ctx.added
    d_rab = d_pos = d_ts = None
    if pos_w is not None or ts_w is not None:
        dq, dk, dv, d_scale, d_rab, d_pos, d_ts = torch.ops.hstu.attention_bwd_bias(
            *args, rab, intervals, timestamps, pos_w, ts_w, ctx.need_rab_grad, ctx.need_table_grad, ts_bounds,
            ctx.ts_next, **kw)
        d_rab = d_rab if ctx.need_rab_grad else None
        d_pos = d_pos if ctx.need_table_grad and pos_w is not None else None
        d_ts = d_ts if ctx.need_table_grad and ts_w is not None else None
    elif ctx.need_rab_grad:
        dq, dk, dv, d_scale, d_rab = torch.ops.hstu.attention_bwd_rab(*args, rab, intervals, **kw)
    elif rab is None and intervals is None:  # the graph of models without rab/intervals is unchanged
        dq, dk, dv, d_scale = torch.ops.hstu.attention_bwd(*args, **kw)
    else:
        dq, dk, dv, d_scale = torch.ops.hstu.attention_bwd(*args, rab, intervals, **kw)
    return (dq, dk, dv, None, None, None, None, (d_scale if ctx.need_scale_grad else None), None, None, None, None,
            d_rab, None, None, d_pos, d_ts, None, None)


attention.register_autograd(_backward, setup_context=_setup_context)


@triton_op("hstu::delta_attention", mutates_args=())
@AttentionSpec.op_params
def delta_attention(delta_q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
                    num_targets: Optional[Tensor] = None, attn_scale: Optional[Tensor] = None,
                    max_attn_len: int = 0, contextual_seq_len: int = 0, **added) -> Tensor:
    """Cached attention for inference: the last ``D`` rows of every sequence (``[B*D, H, Dv]``).
    Inference only (no autograd)."""
    spec = AttentionSpec(True, max_attn_len, contextual_seq_len, **added)
    validate_attention_inputs(delta_q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                              contextual_seq_len, 0, num_query_rows=delta_q.shape[0], check_values=False)
    B = seq_offsets.shape[0] - 1
    check_jagged_values(seq_offsets, k.shape[0], max_seq_len, num_targets,
                        min_length=delta_q.shape[0] // B if B > 0 else 0)
    kern = _delta_kernels_for(delta_q)
    if kern is not None:
        return kern.delta_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets,
                                        attn_scale, tma=_tma(), spec=spec)
    return delta_hstu_mha(max_seq_len, alpha, delta_q, k, v, seq_offsets, num_targets, attn_scale,
                          spec=spec).contiguous()
