"""``hstu::attention`` / ``hstu::attention_bwd`` / ``hstu::delta_attention``.

All three are ``torch.library.triton_op`` s. Their bodies pick the implementation by device:
CUDA runs the Triton kernels of :mod:`hstu_inductor.kernels` (launched through ``wrap_triton``),
anything else - or CUDA with ``config.kernels == "off"`` / no usable Triton - runs the eager
reference. Because they are triton_ops:

* ``torch.export`` keeps each as one node (what the export rewrite produces);
* torch.compile / AOTInductor trace *into* the body, so Inductor's generated code (and an AOTI
  package) contains our Triton kernels - or, on CPU, plain ATen - and no call back into Python;
* the body doubles as the fake (meta) implementation, so it only uses shapes, never data.

The forward ops check the values of the jagged inputs in a way that survives compilation
(:mod:`._checks`, ``config.check_inputs``); the backward op trusts the offsets its forward checked.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from .. import config
from ..reference import delta_hstu_mha, hstu_mha, hstu_mha_backward, validate_attention_inputs
from ._checks import check_jagged_values
from ._kernels import cuda_kernels

__all__ = ["attention", "attention_bwd", "delta_attention"]


def _tma():
    return {"auto": None, "on": True, "off": False}[config.tma]


def _kernels_for(t: Tensor):
    """The kernels module when ``t`` lives on CUDA and kernels are enabled, else None."""
    return cuda_kernels() if t.device.type == "cuda" else None


@triton_op("hstu::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
              num_targets: Optional[Tensor] = None, attn_scale: Optional[Tensor] = None, max_attn_len: int = 0,
              contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0, causal: bool = True) -> Tensor:
    """Jagged HSTU attention forward, ``[L, H, Dv]`` (see ``reference.hstu_mha``)."""
    validate_attention_inputs(q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                              contextual_seq_len, min_full_attn_seq_len, causal=causal, check_values=False)
    check_jagged_values(seq_offsets, k.shape[0], max_seq_len, num_targets)
    kern = _kernels_for(q)
    if kern is not None:
        return kern.hstu_attention_fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                                       max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal, tma=_tma())
    return hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal=causal, dropout_pr=0.0, training=False,
                    num_targets=num_targets, attn_scale=attn_scale, max_attn_len=max_attn_len,
                    contextual_seq_len=contextual_seq_len,
                    min_full_attn_seq_len=min_full_attn_seq_len).contiguous()


@triton_op("hstu::attention_bwd", mutates_args=())
def attention_bwd(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int,
                  alpha: float, num_targets: Optional[Tensor], attn_scale: Optional[Tensor], max_attn_len: int,
                  contextual_seq_len: int, min_full_attn_seq_len: int, causal: bool,
                  need_scale_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, d_attn_scale)``; ``d_attn_scale`` is empty unless requested
    (the kernels do not compute it, so that case runs the reference)."""
    kern = None if need_scale_grad else _kernels_for(q)
    if kern is not None:
        dq, dk, dv = kern.hstu_attention_bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets,
                                             attn_scale, max_attn_len, contextual_seq_len, min_full_attn_seq_len,
                                             causal, deterministic=config.deterministic, tma=_tma())
        return dq, dk, dv, q.new_empty(0)
    dq, dk, dv, d_scale = hstu_mha_backward(grad, max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets,
                                            attn_scale, max_attn_len, contextual_seq_len, min_full_attn_seq_len,
                                            need_scale_grad)
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(),
            d_scale.contiguous() if need_scale_grad else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    (q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len, contextual_seq_len,
     min_full_attn_seq_len, causal) = inputs
    ctx.save_for_backward(q, k, v, seq_offsets, num_targets, attn_scale)
    ctx.args = (max_seq_len, alpha, max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal)
    ctx.need_scale_grad = attn_scale is not None and ctx.needs_input_grad[7]


def _backward(ctx, grad):
    q, k, v, seq_offsets, num_targets, attn_scale = ctx.saved_tensors
    max_seq_len, alpha, w, c, f, causal = ctx.args
    dq, dk, dv, d_scale = torch.ops.hstu.attention_bwd(
        grad.contiguous(), q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, w, c, f, causal,
        ctx.need_scale_grad)
    return dq, dk, dv, None, None, None, None, (d_scale if ctx.need_scale_grad else None), None, None, None, None


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
    kern = _kernels_for(delta_q)
    if kern is not None:
        return kern.delta_hstu_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets,
                                             attn_scale, max_attn_len, contextual_seq_len, tma=_tma())
    return delta_hstu_mha(max_seq_len, alpha, delta_q, k, v, seq_offsets, num_targets, attn_scale, max_attn_len,
                          contextual_seq_len).contiguous()
