"""``hstu::stu_preprocess`` and ``hstu::stu_output``: the two dense blocks around attention.

The implementations are the eager reference; their backward ops differentiate the reference
(recomputing the normalisation instead of saving it). Fused Triton versions replace the CUDA
implementations later without changing these schemas.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..reference.jagged import require

__all__ = ["stu_preprocess", "stu_output"]


def _layer_norm32(x, weight, bias, eps, groups=0):
    """Normalisation with fp32 statistics; ``groups > 0`` = group norm over contiguous chunks."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    if groups:
        return F.group_norm(x.float(), groups, w, b, eps)
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)


def _preprocess_ref(x, ln_weight, ln_bias, eps, weight, bias, u_dim, qk_dim, silu_all):
    normed = _layer_norm32(x, ln_weight, ln_bias, eps).to(x.dtype)
    uvqk = F.linear(normed, weight, bias)
    if silu_all:
        uvqk = F.silu(uvqk)
    u, v, q, k = torch.split(uvqk, [u_dim, u_dim, qk_dim, qk_dim], dim=-1)
    if not silu_all:
        u = F.silu(u)
    return tuple(t.contiguous() for t in (u, v, q, k))


def _check_preprocess(x, weight, u_dim, qk_dim):
    require(x.dim() == 2, lambda: f"x must be [L, E], got {tuple(x.shape)}")
    require(weight.dim() == 2 and weight.shape[1] == x.shape[1],
                 lambda: f"weight must be [2*(u_dim+qk_dim), E]={x.shape[1]}, got {tuple(weight.shape)}")
    require(weight.shape[0] == 2 * (u_dim + qk_dim),
                 lambda: f"weight has {weight.shape[0]} rows, expected 2*(u_dim+qk_dim)={2 * (u_dim + qk_dim)}")


@torch.library.custom_op("hstu::stu_preprocess", mutates_args=())
def stu_preprocess(x: Tensor, ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], eps: float, weight: Tensor,
                   bias: Optional[Tensor], u_dim: int, qk_dim: int,
                   silu_all: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``LayerNorm(x) @ weight.T + bias`` split into ``(silu(u), v, q, k)`` (2-D, ``[L, *]``).

    ``weight`` is in ``F.linear`` layout ``[2*(u_dim+qk_dim), E]``; ``silu_all`` activates all four.
    """
    _check_preprocess(x, weight, u_dim, qk_dim)
    return _preprocess_ref(x, ln_weight, ln_bias, eps, weight, bias, u_dim, qk_dim, silu_all)


@stu_preprocess.register_fake
def _(x, ln_weight, ln_bias, eps, weight, bias, u_dim, qk_dim, silu_all=False):
    _check_preprocess(x, weight, u_dim, qk_dim)
    L = x.shape[0]
    return (x.new_empty(L, u_dim), x.new_empty(L, u_dim), x.new_empty(L, qk_dim), x.new_empty(L, qk_dim))


def _output_ref(attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias, concat_ua):
    y = u * _layer_norm32(attn, norm_weight, norm_bias, eps, norm_groups).to(attn.dtype)
    if concat_ua:
        y = torch.cat([u, attn, y], dim=-1)
    return x + F.linear(y, weight, bias)


def _check_output(attn, u, x, weight, concat_ua):
    require(attn.dim() == 2 and attn.shape == u.shape,
                 lambda: f"attn {tuple(attn.shape)} and u {tuple(u.shape)} must both be [L, H*Dv]")
    require(x.dim() == 2 and x.shape[0] == attn.shape[0], lambda: "x must be [L, E] with the rows of attn")
    k = attn.shape[1] * (3 if concat_ua else 1)
    require(weight.shape[0] == x.shape[1] and weight.shape[1] == k,
                 lambda: f"weight must be [E, {k}], got {tuple(weight.shape)}")


@torch.library.custom_op("hstu::stu_output", mutates_args=())
def stu_output(attn: Tensor, u: Tensor, x: Tensor, norm_weight: Optional[Tensor], norm_bias: Optional[Tensor],
               eps: float, norm_groups: int, weight: Tensor, bias: Optional[Tensor], concat_ua: bool) -> Tensor:
    """``x + F.linear(u * Norm(attn) [cat u, attn before], weight, bias)``; ``norm_groups=0`` is layer norm."""
    _check_output(attn, u, x, weight, concat_ua)
    return _output_ref(attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias, concat_ua)


@stu_output.register_fake
def _(attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias, concat_ua):
    _check_output(attn, u, x, weight, concat_ua)
    return torch.empty_like(x)


def _vjp(fn, primals, grads):
    """Gradients of ``fn`` w.r.t. the tensor entries of ``primals`` that are not None (in order)."""
    slots = [i for i, p in enumerate(primals) if isinstance(p, Tensor)]

    def partial(*tensors):
        full = list(primals)
        for i, t in zip(slots, tensors):
            full[i] = t
        return fn(*full)

    _, vjp_fn = torch.func.vjp(partial, *[primals[i] for i in slots])
    # A gradient may be the incoming grad itself (residual add): ops must not return aliases.
    return [g.clone() for g in vjp_fn(grads if len(grads) > 1 else grads[0])]


@torch.library.custom_op("hstu::stu_preprocess_bwd", mutates_args=())
def stu_preprocess_bwd(du: Tensor, dv: Tensor, dq: Tensor, dk: Tensor, x: Tensor, ln_weight: Optional[Tensor],
                       ln_bias: Optional[Tensor], eps: float, weight: Tensor, bias: Optional[Tensor], u_dim: int,
                       qk_dim: int, silu_all: bool) -> list[Tensor]:
    """Gradients for ``x, ln_weight, ln_bias, weight, bias`` (only for the tensors that are not None)."""
    fn = lambda *p: _preprocess_ref(*p, u_dim, qk_dim, silu_all)  # noqa: E731
    return _vjp(fn, (x, ln_weight, ln_bias, eps, weight, bias), (du, dv, dq, dk))


@stu_preprocess_bwd.register_fake
def _(du, dv, dq, dk, x, ln_weight, ln_bias, eps, weight, bias, u_dim, qk_dim, silu_all):
    return [torch.empty_like(t) for t in (x, ln_weight, ln_bias, weight, bias) if t is not None]


@torch.library.custom_op("hstu::stu_output_bwd", mutates_args=())
def stu_output_bwd(grad: Tensor, attn: Tensor, u: Tensor, x: Tensor, norm_weight: Optional[Tensor],
                   norm_bias: Optional[Tensor], eps: float, norm_groups: int, weight: Tensor, bias: Optional[Tensor],
                   concat_ua: bool) -> list[Tensor]:
    """Gradients for ``attn, u, x, norm_weight, norm_bias, weight, bias`` (those not None)."""
    fn = lambda a, u_, x_, nw, nb, w, b: _output_ref(a, u_, x_, nw, nb, eps, norm_groups, w, b, concat_ua)  # noqa
    return _vjp(fn, (attn, u, x, norm_weight, norm_bias, weight, bias), (grad,))


@stu_output_bwd.register_fake
def _(grad, attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias, concat_ua):
    return [torch.empty_like(t) for t in (attn, u, x, norm_weight, norm_bias, weight, bias) if t is not None]


def _expand(grads, optional_inputs):
    """Place a packed list of gradients back at the positions of the non-None inputs."""
    it = iter(grads)
    return [next(it) if t is not None else None for t in optional_inputs]


def _pre_setup(ctx, inputs, output):
    x, ln_weight, ln_bias, eps, weight, bias, u_dim, qk_dim, silu_all = inputs
    ctx.save_for_backward(x, ln_weight, ln_bias, weight, bias)
    ctx.args = (eps, u_dim, qk_dim, silu_all)


def _pre_backward(ctx, du, dv, dq, dk):
    x, ln_weight, ln_bias, weight, bias = ctx.saved_tensors
    eps, u_dim, qk_dim, silu_all = ctx.args
    grads = torch.ops.hstu.stu_preprocess_bwd(du, dv, dq, dk, x, ln_weight, ln_bias, eps, weight, bias, u_dim,
                                              qk_dim, silu_all)
    gx, gw_ln, gb_ln, gw, gb = _expand(grads, (x, ln_weight, ln_bias, weight, bias))
    return gx, gw_ln, gb_ln, None, gw, gb, None, None, None


stu_preprocess.register_autograd(_pre_backward, setup_context=_pre_setup)


def _out_setup(ctx, inputs, output):
    attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias, concat_ua = inputs
    ctx.save_for_backward(attn, u, x, norm_weight, norm_bias, weight, bias)
    ctx.args = (eps, norm_groups, concat_ua)


def _out_backward(ctx, grad):
    attn, u, x, norm_weight, norm_bias, weight, bias = ctx.saved_tensors
    eps, norm_groups, concat_ua = ctx.args
    grads = torch.ops.hstu.stu_output_bwd(grad, attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias,
                                          concat_ua)
    ga, gu, gx, gnw, gnb, gw, gb = _expand(grads, (attn, u, x, norm_weight, norm_bias, weight, bias))
    return ga, gu, gx, gnw, gnb, None, None, gw, gb, None


stu_output.register_autograd(_out_backward, setup_context=_out_setup)
