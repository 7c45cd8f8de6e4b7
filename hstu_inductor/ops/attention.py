"""``hstu::attention`` / ``hstu::attention_bwd`` / ``hstu::delta_attention`` custom ops.

CPU (and any device without kernels) runs the eager reference; CUDA runs the Triton kernels
from :mod:`hstu_inductor.kernels` when they are importable and enabled in the config, else the
reference. Fake implementations only use shapes, so the ops trace with symbolic ``L``/``B``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import config
from ..reference import delta_hstu_mha, hstu_mha, hstu_mha_backward, validate_attention_inputs
from ._kernels import cuda_kernels

__all__ = ["attention", "attention_bwd", "delta_attention"]


def _reference_fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                   contextual_seq_len, min_full_attn_seq_len, causal):
    return hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal=causal, dropout_pr=0.0, training=False,
                    num_targets=num_targets, attn_scale=attn_scale, max_attn_len=max_attn_len,
                    contextual_seq_len=contextual_seq_len, min_full_attn_seq_len=min_full_attn_seq_len)


@torch.library.custom_op("hstu::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
              num_targets: Optional[Tensor] = None, attn_scale: Optional[Tensor] = None, max_attn_len: int = 0,
              contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0, causal: bool = True) -> Tensor:
    """Jagged HSTU attention forward, ``[L, H, Dv]`` (see ``reference.hstu_mha``)."""
    return _reference_fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                          contextual_seq_len, min_full_attn_seq_len, causal).contiguous()


@attention.register_kernel("cuda")
def _attention_cuda(q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None, max_attn_len=0,
                    contextual_seq_len=0, min_full_attn_seq_len=0, causal=True):
    kern = cuda_kernels()
    if kern is None:
        return _reference_fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                              contextual_seq_len, min_full_attn_seq_len, causal).contiguous()
    validate_attention_inputs(q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                              contextual_seq_len, min_full_attn_seq_len, causal=causal)
    return kern.hstu_attention_fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                                   contextual_seq_len, min_full_attn_seq_len, causal, tma=_tma())


@attention.register_fake
def _attention_fake(q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None, max_attn_len=0,
                    contextual_seq_len=0, min_full_attn_seq_len=0, causal=True):
    validate_attention_inputs(q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                              contextual_seq_len, min_full_attn_seq_len, causal=causal)
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype)


def _tma():
    return {"auto": None, "on": True, "off": False}[config.tma]


def _reference_bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                   contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad):
    dq, dk, dv, d_scale = hstu_mha_backward(grad, max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets,
                                            attn_scale, max_attn_len, contextual_seq_len, min_full_attn_seq_len,
                                            need_scale_grad)
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(),
            d_scale.contiguous() if need_scale_grad else q.new_empty(0))


@torch.library.custom_op("hstu::attention_bwd", mutates_args=())
def attention_bwd(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int,
                  alpha: float, num_targets: Optional[Tensor], attn_scale: Optional[Tensor], max_attn_len: int,
                  contextual_seq_len: int, min_full_attn_seq_len: int, causal: bool,
                  need_scale_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, d_attn_scale)``; ``d_attn_scale`` is empty unless requested."""
    return _reference_bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                          contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad)


@attention_bwd.register_kernel("cuda")
def _attention_bwd_cuda(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                        contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad):
    kern = cuda_kernels()
    if kern is None or need_scale_grad:  # the kernels do not produce d(attn_scale)
        return _reference_bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                                      max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal,
                                      need_scale_grad)
    dq, dk, dv = kern.hstu_attention_bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                                         max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal,
                                         deterministic=config.deterministic, tma=_tma())
    return dq, dk, dv, q.new_empty(0)


@attention_bwd.register_fake
def _attention_bwd_fake(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, max_attn_len,
                        contextual_seq_len, min_full_attn_seq_len, causal, need_scale_grad):
    d_scale = torch.empty_like(attn_scale) if need_scale_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), d_scale


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


@torch.library.custom_op("hstu::delta_attention", mutates_args=())
def delta_attention(delta_q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
                    num_targets: Optional[Tensor] = None, attn_scale: Optional[Tensor] = None,
                    max_attn_len: int = 0, contextual_seq_len: int = 0) -> Tensor:
    """Cached attention for inference: the last ``D`` rows of every sequence (``[B*D, H, Dv]``)."""
    return delta_hstu_mha(max_seq_len, alpha, delta_q, k, v, seq_offsets, num_targets, attn_scale, max_attn_len,
                          contextual_seq_len).contiguous()


@delta_attention.register_kernel("cuda")
def _delta_attention_cuda(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                          max_attn_len=0, contextual_seq_len=0):
    kern = cuda_kernels()
    if kern is None:
        return delta_hstu_mha(max_seq_len, alpha, delta_q, k, v, seq_offsets, num_targets, attn_scale,
                              max_attn_len, contextual_seq_len).contiguous()
    validate_attention_inputs(delta_q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                              contextual_seq_len, 0, num_query_rows=delta_q.shape[0])
    return kern.delta_hstu_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale,
                                         max_attn_len, contextual_seq_len, tma=_tma())


@delta_attention.register_fake
def _delta_attention_fake(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                          max_attn_len=0, contextual_seq_len=0):
    validate_attention_inputs(delta_q, k, v, seq_offsets, max_seq_len, num_targets, attn_scale, max_attn_len,
                              contextual_seq_len, 0, num_query_rows=delta_q.shape[0])
    return delta_q.new_empty((delta_q.shape[0], delta_q.shape[1], v.shape[2]))
