"""``hstu::stu_preprocess`` and ``hstu::stu_output``: the two dense blocks around attention.

Both are ``torch.library.triton_op`` s: torch.compile/AOTInductor trace into their bodies (so an
exported package needs no Python for them), while ``torch.export`` keeps them as single nodes.
CUDA inputs (fp16/bf16/fp32, kernels enabled) run the fused Triton kernels of
:mod:`hstu_inductor.kernels.stu_blocks` (launched through ``wrap_triton``); everything else runs
the ATen bodies below, which are the semantic reference. The backward ops are closed-form. The
preprocess backward either *recomputes* the normalisation and the projection's pre-activations from
the saved inputs (``stu_preprocess``) or reads them from the forward (``stu_preprocess_save``:
no recompute, for ``[L, E]`` more activation memory plus the projection output ``uvqk``, which
the attention's v, q, k views keep alive anyway unless silu is on all four); likewise the output block
(``stu_output`` recomputes its projection input and statistics, ``stu_output_save`` keeps them).

Dropout in the output block is a pure function of ``(seed, flat index)``
(:mod:`hstu_inductor.reference.dropout`); the CPU body and the Triton kernels produce the same mask.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op

from ..reference.dropout import dropout_keep_mask
from ..reference.jagged import require
from ..reference.stu import linear_param_grads, preprocess_views, uvqk_grad
from ._kernels import stu_kernels

__all__ = ["stu_preprocess", "stu_preprocess_save", "preprocess_views", "stu_output", "stu_output_save",
           "stu_preprocess_bwd", "stu_output_bwd"]

aten = torch.ops.aten


# Test hook: run the Triton path for CPU tensors too (under TRITON_INTERPRET=1), so the op wiring
# (host code, autograd) is exercised without a GPU.
_KERNELS_ON_CPU = False


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernels_for(*tensors: Optional[Tensor], norm_params=(), channels: int = 0, groups: int = 0):
    """The STU kernels module when every given tensor is on CUDA and shares an fp16/bf16/fp32 dtype
    (``norm_params``, read in fp32 by the kernels, may be any of those dtypes), else None."""
    t0 = tensors[0]
    if not (t0.device.type == "cuda" or _KERNELS_ON_CPU):
        return None
    if t0.dtype not in _KERNEL_DTYPES:
        return None
    if any(t is not None and (t.device != t0.device or t.dtype != t0.dtype) for t in tensors):
        return None
    if any(t is not None and (t.device != t0.device or t.dtype not in _KERNEL_DTYPES) for t in norm_params):
        return None
    kern = stu_kernels()
    if kern is None or not kern.supported_channels(channels, groups):
        return None
    return kern


def _stats_dtype(x: Tensor) -> torch.dtype:
    """Normalisation statistics in fp32, or wider when the input is wider (fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _upcast(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]):
    dt = _stats_dtype(x)
    return x.to(dt), (weight.to(dt) if weight is not None else None), (bias.to(dt) if bias is not None else None)


def _norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, groups: int = 0):
    """Layer norm over the last dim (``groups=0``) or group norm with ``groups`` groups of
    contiguous channels of a ``[L, C]`` tensor, with fp32 (or wider) statistics.
    Returns ``(normed, mean, rstd)`` in the statistics dtype."""
    x32, w, b = _upcast(x, weight, bias)
    if groups:
        return aten.native_group_norm(x32, w, b, x32.shape[0], x32.shape[1], 1, groups, eps)
    return aten.native_layer_norm(x32, [x32.shape[-1]], w, b, eps)


def _norm_bwd(grad32: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight, bias, groups: int):
    """Gradients ``(dx, dweight, dbias)`` of :func:`_norm_fwd` (each cast to its input's dtype)."""
    x32, w, b = _upcast(x, weight, bias)
    mask = [True, weight is not None, bias is not None]
    if groups:
        dx, dw, db = aten.native_group_norm_backward(grad32, x32, mean, rstd, w, x32.shape[0], x32.shape[1], 1,
                                                     groups, mask)
    else:
        dx, dw, db = aten.native_layer_norm_backward(grad32, x32, [x32.shape[-1]], mean, rstd, w, b, mask)
    return (dx.to(x.dtype), dw.to(weight.dtype) if weight is not None else None,
            db.to(bias.dtype) if bias is not None else None)


def _check_saved(op: str, names: str, saved) -> None:
    """A ``_bwd`` op takes the forward's intermediates all together or not at all."""
    require(all(t is None for t in saved) or all(t is not None for t in saved),
            lambda: f"{op}: pass all of {names} or none of them")



# ----------------------------------------------------------------------------------------------
# preprocess: LayerNorm(x) -> x @ W^T + b -> split (u, v, q, k) -> silu(u) (or silu on all four)
# ----------------------------------------------------------------------------------------------
def _check_preprocess(x, weight, u_dim, qk_dim):
    require(x.dim() == 2, lambda: f"x must be [L, E], got {tuple(x.shape)}")
    require(weight.dim() == 2 and weight.shape[1] == x.shape[1],
            lambda: f"weight must be [2*(u_dim+qk_dim), E={x.shape[1]}], got {tuple(weight.shape)}")
    require(weight.shape[0] == 2 * (u_dim + qk_dim),
            lambda: f"weight has {weight.shape[0]} rows, expected 2*(u_dim+qk_dim)={2 * (u_dim + qk_dim)}")
    require(x.dtype == weight.dtype, lambda: f"x ({x.dtype}) and weight ({weight.dtype}) dtypes differ")


def _preprocess_projection(x, ln_weight, ln_bias, eps, weight, bias):
    normed32, mean, rstd = _norm_fwd(x, ln_weight, ln_bias, eps)
    normed = normed32.to(x.dtype)
    return normed, F.linear(normed, weight, bias), mean, rstd


@triton_op("hstu::stu_preprocess", mutates_args=())
def stu_preprocess(x: Tensor, ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], eps: float, weight: Tensor,
                   bias: Optional[Tensor], u_dim: int, qk_dim: int, silu_all: bool = False) -> tuple[Tensor, Tensor]:
    """``uvqk = LayerNorm(x) @ weight.T + bias`` and its activation, as ``(act, uvqk)`` (2-D, ``[L, *]``).

    ``act`` is ``silu(u)`` (``[L, u_dim]``, u = the first ``u_dim`` columns of uvqk) or, with
    ``silu_all``, ``silu(uvqk)``; the STU's ``(u, v, q, k)`` are views of the two
    (:func:`preprocess_views`; the columns are ``[u_dim, u_dim, qk_dim, qk_dim]``). The op returns the
    packed tensors rather than v, q, k because a custom op's outputs may not alias each other: as
    separate outputs they would be copies, while views taken outside the op cost nothing and the
    attention kernels read them strided. Both outputs are differentiable.
    ``weight`` is in ``F.linear`` layout ``[2*(u_dim+qk_dim), E]``. LayerNorm statistics are computed
    in fp32 and the normalised x is cast back to ``x.dtype``. Its backward recomputes the normalised
    x and the pre-activations (see ``stu_preprocess_save``).
    """
    return tuple(stu_preprocess_save(x, ln_weight, ln_bias, eps, weight, bias, u_dim, qk_dim, silu_all)[:2])


@triton_op("hstu::stu_preprocess_save", mutates_args=())
def stu_preprocess_save(x: Tensor, ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], eps: float,
                        weight: Tensor, bias: Optional[Tensor], u_dim: int, qk_dim: int, silu_all: bool = False
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`stu_preprocess` that also returns the intermediates its backward needs, so that the
    backward reads them instead of recomputing them: ``(act, uvqk, normed, mean, rstd)`` with
    ``normed`` the LayerNorm output (``x.dtype``; on the kernel path with a bias ``[L, E']``, the output in its
    first E columns followed by a ones column, ``kernels.norms.ones_column_width``) and ``mean``/``rstd``
    ``[L, 1]`` statistics (fp32 or wider); the backward reads its pre-activations from ``uvqk``. The forward
    computes all of them anyway; saving costs memory (``normed``, and ``uvqk`` where the attention's v, q, k
    views do not keep it alive anyway: with ``silu_all``), not time. ``hstu_inductor.config.block_backward``
    selects which op the pattern emits."""
    _check_preprocess(x, weight, u_dim, qk_dim)
    kern = _kernels_for(x, weight, bias, norm_params=(ln_weight, ln_bias), channels=x.shape[1])
    project = kern.preprocess_projection if kern is not None else _preprocess_projection
    normed, uvqk, mean, rstd = project(x, ln_weight, ln_bias, eps, weight, bias)
    return _activate(uvqk, u_dim, silu_all), uvqk, normed, mean, rstd


def _activate(uvqk: Tensor, u_dim: int, silu_all: bool) -> Tensor:
    """The op's ``act``: a new tensor, never a view of ``uvqk``. ATen on both paths (kernels/stu_blocks.py
    says why)."""
    return F.silu(uvqk if silu_all else uvqk[:, :u_dim])


@triton_op("hstu::stu_preprocess_bwd", mutates_args=())
def stu_preprocess_bwd(d_act: Optional[Tensor], d_uvqk: Optional[Tensor], x: Tensor, ln_weight: Optional[Tensor],
                       ln_bias: Optional[Tensor], eps: float, weight: Tensor, bias: Optional[Tensor], u_dim: int,
                       qk_dim: int, silu_all: bool, uvqk: Optional[Tensor] = None, normed: Optional[Tensor] = None,
                       mean: Optional[Tensor] = None, rstd: Optional[Tensor] = None) -> list[Tensor]:
    """Gradients for ``x, ln_weight, ln_bias, weight, bias`` (only for the tensors that are not None)
    from ``d_act`` and ``d_uvqk``, the gradients of :func:`stu_preprocess`'s two outputs (None: zero;
    ``d_uvqk`` is typically assembled by autograd from the gradients of the v, q, k views).
    ``uvqk, normed, mean, rstd`` are :func:`stu_preprocess_save`'s outputs after ``act``; when they are
    not given they are recomputed from ``x`` (LayerNorm forward plus the activated columns of the
    projection)."""
    saved = (uvqk, normed, mean, rstd)
    _check_saved("stu_preprocess_bwd", "uvqk, normed, mean, rstd", saved)
    kern = _kernels_for(x, d_act, d_uvqk, weight, bias, norm_params=(ln_weight, ln_bias), channels=x.shape[1])
    if kern is not None:
        grads = kern.stu_preprocess_bwd(d_act, d_uvqk, x, ln_weight, ln_bias, eps, weight, bias, u_dim, qk_dim,
                                        silu_all, *saved)
        return [g.contiguous() for g in grads]
    if normed is None:
        normed, uvqk, mean, rstd = _preprocess_projection(x, ln_weight, ln_bias, eps, weight, bias)
    grad = uvqk_grad(d_act, d_uvqk, uvqk, weight.shape[0])
    grads = [None, None, None, *linear_param_grads(grad, normed, x.shape[1], bias is not None)]
    d_normed = grad.mm(weight)
    grads[0], grads[1], grads[2] = _norm_bwd(d_normed.to(_stats_dtype(x)), x, mean, rstd, ln_weight, ln_bias, 0)
    # contiguous: real and fake (meta) strides of mm/transposes can differ; callers get dense grads.
    return [g.contiguous() for g in grads if g is not None]


# ----------------------------------------------------------------------------------------------
# output: x + F.linear(u * Norm(attn) [or cat(u, attn, u * Norm(attn))], weight, bias)
# ----------------------------------------------------------------------------------------------
def _check_output(attn, u, x, weight, concat_ua, dropout_p=0.0, seed=None):
    require(0.0 <= dropout_p < 1.0, lambda: f"dropout_p must be in [0, 1), got {dropout_p}")
    require(dropout_p == 0.0 or seed is not None, lambda: "dropout_p > 0 needs a seed tensor")
    require(seed is None or (seed.numel() == 1 and seed.dtype == torch.int64),
            lambda: "seed must be a one-element int64 tensor")
    require(attn.dim() == 2 and attn.shape == u.shape,
            lambda: f"attn {tuple(attn.shape)} and u {tuple(u.shape)} must both be [L, H*Dv]")
    require(x.dim() == 2 and x.shape[0] == attn.shape[0], lambda: "x must be [L, E] with the rows of attn")
    cols = attn.shape[1] * (3 if concat_ua else 1)
    require(weight.dim() == 2 and weight.shape[0] == x.shape[1] and weight.shape[1] == cols,
            lambda: f"weight must be [E, {cols}], got {tuple(weight.shape)}")


def _dropout_scale(y: Tensor, dropout_p: float, seed: Optional[Tensor]) -> Optional[Tensor]:
    """``keep / (1 - p)`` over the projection input ``y`` (row-major flat index), or None without dropout."""
    if dropout_p == 0.0:
        return None
    keep = dropout_keep_mask(seed.reshape(()), y.shape, dropout_p, device=y.device)
    return keep.to(y.dtype) * (1.0 / (1.0 - dropout_p))


def _output_y(attn, u, norm_weight, norm_bias, eps, norm_groups, concat_ua, dropout_p=0.0, seed=None):
    """The projection input, the normalised attn, its statistics and the dropout scale (or None);
    ``u`` is the block's u (already activated)."""
    normed32, mean, rstd = _norm_fwd(attn, norm_weight, norm_bias, eps, norm_groups)
    normed = normed32.to(attn.dtype)
    y = u * normed
    if concat_ua:
        y = torch.cat([u, attn, y], dim=-1)
    drop = _dropout_scale(y, dropout_p, seed)
    return (y * drop if drop is not None else y), normed, mean, rstd, drop


@triton_op("hstu::stu_output", mutates_args=())
def stu_output(attn: Tensor, u: Tensor, x: Tensor, norm_weight: Optional[Tensor], norm_bias: Optional[Tensor],
               eps: float, norm_groups: int, weight: Tensor, bias: Optional[Tensor], concat_ua: bool,
               dropout_p: float = 0.0, seed: Optional[Tensor] = None, silu_u: bool = False) -> Tensor:
    """``x + F.linear(drop(u * Norm(attn) [cat u, attn before]), weight, bias)``; ``norm_groups=0`` is
    layer norm. Dropout (``dropout_p > 0``, training) applies to the whole projection input with the
    counter-based mask of ``seed`` (one-element int64 tensor), scaled by ``1 / (1 - dropout_p)``.
    ``silu_u``: ``u`` is the pre-activation and the block uses ``silu(u)`` (everywhere, the concat
    included); ``u``'s gradient is then w.r.t. the pre-activation. It lets the STU's preprocess hand
    over ``uvqk[:, :u_dim]`` instead of a tensor of its own (``patterns.blocks.fuse_u_silu``).
    Its backward recomputes the projection input and the statistics (see ``stu_output_save``)."""
    return stu_output_save(attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias, concat_ua, dropout_p,
                           seed, silu_u)[0]


@triton_op("hstu::stu_output_save", mutates_args=())
def stu_output_save(attn: Tensor, u: Tensor, x: Tensor, norm_weight: Optional[Tensor], norm_bias: Optional[Tensor],
                    eps: float, norm_groups: int, weight: Tensor, bias: Optional[Tensor], concat_ua: bool,
                    dropout_p: float = 0.0, seed: Optional[Tensor] = None, silu_u: bool = False
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`stu_output` that also returns what its backward reads instead of recomputing:
    ``(out, y, mean, rstd)``, ``y`` the projection input after dropout (``[L, C]`` or ``[L, 3C]``; on the kernel
    path with a bias followed by a ones column, as ``normed`` of :func:`stu_preprocess_save`)
    and ``mean``/``rstd`` ``[L, max(norm_groups, 1)]`` statistics (fp32 or wider)."""
    _check_output(attn, u, x, weight, concat_ua, dropout_p, seed)
    kern = _kernels_for(attn, u, x, weight, bias, norm_params=(norm_weight, norm_bias), channels=attn.shape[1],
                        groups=norm_groups)
    if kern is not None:
        return kern.stu_output_fwd(attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias, concat_ua,
                                   dropout_p, seed, silu_u)
    u = F.silu(u) if silu_u else u  # in u's dtype: what the preprocess op's own act would hold
    y, _, mean, rstd, _ = _output_y(attn, u, norm_weight, norm_bias, eps, norm_groups, concat_ua, dropout_p, seed)
    return x + F.linear(y, weight, bias), y, mean, rstd


def _normed_from_stats(attn, mean, rstd, weight, bias, groups):
    """``Norm(attn)`` in attn's dtype from saved statistics ``[L, G]`` (the forward's own values)."""
    L, C = attn.shape
    x32, w, b = _upcast(attn, weight, bias)
    xhat = ((x32.view(L, mean.shape[1], -1) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).view(L, C)
    normed = xhat * w if w is not None else xhat
    return (normed + b if b is not None else normed).to(attn.dtype)


@triton_op("hstu::stu_output_bwd", mutates_args=())
def stu_output_bwd(grad: Tensor, attn: Tensor, u: Tensor, x: Tensor, norm_weight: Optional[Tensor],
                   norm_bias: Optional[Tensor], eps: float, norm_groups: int, weight: Tensor, bias: Optional[Tensor],
                   concat_ua: bool, dropout_p: float = 0.0, seed: Optional[Tensor] = None, y: Optional[Tensor] = None,
                   mean: Optional[Tensor] = None, rstd: Optional[Tensor] = None, silu_u: bool = False) -> list[Tensor]:
    """Gradients for ``attn, u, x, norm_weight, norm_bias, weight, bias`` (those not None). The
    dropout mask is regenerated from ``seed``. ``y, mean, rstd`` are :func:`stu_output_save`'s
    intermediates; when they are not given they are recomputed. ``silu_u`` as in :func:`stu_output`."""
    _check_saved("stu_output_bwd", "y, mean, rstd", (y, mean, rstd))
    kern = _kernels_for(attn, grad, u, x, weight, bias, norm_params=(norm_weight, norm_bias),
                        channels=attn.shape[1], groups=norm_groups)
    if kern is not None:
        grads = kern.stu_output_bwd(grad, attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias,
                                    concat_ua, dropout_p, seed, y, mean, rstd, silu_u)
        return [g.contiguous() for g in grads]
    u_pre, u = u, (F.silu(u) if silu_u else u)
    if y is None:
        y, normed, mean, rstd, drop = _output_y(attn, u, norm_weight, norm_bias, eps, norm_groups, concat_ua,
                                                dropout_p, seed)
    else:
        normed = _normed_from_stats(attn, mean, rstd, norm_weight, norm_bias, norm_groups)
        drop = _dropout_scale(y, dropout_p, seed)
    d_y = grad.mm(weight)
    d_w, d_b = linear_param_grads(grad, y, weight.shape[1], bias is not None)
    if drop is not None:
        d_y = d_y * drop
    if concat_ua:
        d_u, d_attn_direct, d_y = torch.split(d_y, attn.shape[1], dim=-1)
    d_normed = (d_y * u).to(_stats_dtype(attn))
    d_attn, d_nw, d_nb = _norm_bwd(d_normed, attn, mean, rstd, norm_weight, norm_bias, norm_groups)
    d_u_total = d_y * normed
    if concat_ua:
        d_u_total = d_u_total + d_u
        d_attn = d_attn + d_attn_direct
    if silu_u:  # what the preprocess backward would do with this d_u (reference.stu.uvqk_grad)
        d_u_total = aten.silu_backward(d_u_total, u_pre)
    grads = [d_attn, d_u_total, grad.clone(), d_nw, d_nb, d_w, d_b]
    return [g.contiguous() for g in grads if g is not None]


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------
def _save(ctx, inputs, intermediates) -> None:
    """Save the op inputs and the ``_save`` variants' intermediates (outputs that carry no gradient)."""
    if intermediates:
        ctx.mark_non_differentiable(*intermediates)
    ctx.save_for_backward(*inputs, *intermediates)


def _expand(grads, optional_inputs):
    """Place a packed list of gradients back at the positions of the non-None inputs."""
    it = iter(grads)
    return [next(it) if t is not None else None for t in optional_inputs]


def _pre_setup(ctx, inputs, output):
    x, ln_weight, ln_bias, eps, weight, bias, u_dim, qk_dim, silu_all = inputs
    # stu_preprocess_save: the backward reads uvqk (also a differentiable output), normed, mean, rstd;
    # stu_preprocess: nothing (recompute)
    saved = output[1:] if len(output) > 2 else ()
    if saved:
        ctx.mark_non_differentiable(*saved[1:])
    ctx.save_for_backward(x, ln_weight, ln_bias, weight, bias, *saved)
    # an output without gradient (uvqk with silu_all, v/q/k views unused) stays None: no zeros to read
    ctx.set_materialize_grads(False)
    ctx.args = (eps, u_dim, qk_dim, silu_all)


def _pre_backward(ctx, d_act, d_uvqk, *_intermediates):
    x, ln_weight, ln_bias, weight, bias, *saved = ctx.saved_tensors
    eps, u_dim, qk_dim, silu_all = ctx.args
    grads = torch.ops.hstu.stu_preprocess_bwd(d_act, d_uvqk, x, ln_weight, ln_bias, eps, weight, bias, u_dim,
                                              qk_dim, silu_all, *saved)
    gx, gw_ln, gb_ln, gw, gb = _expand(grads, (x, ln_weight, ln_bias, weight, bias))
    return gx, gw_ln, gb_ln, None, gw, gb, None, None, None


stu_preprocess.register_autograd(_pre_backward, setup_context=_pre_setup)
stu_preprocess_save.register_autograd(_pre_backward, setup_context=_pre_setup)


def _out_setup(ctx, inputs, output):
    attn, u, x, norm_weight, norm_bias, eps, norm_groups, weight, bias, concat_ua, dropout_p, seed, silu_u = inputs
    # stu_output_save: y, mean, rstd; stu_output (a single tensor): none (recompute)
    _save(ctx, (attn, u, x, norm_weight, norm_bias, weight, bias, seed),
          output[1:] if isinstance(output, (tuple, list)) else ())
    ctx.args = (eps, norm_groups, concat_ua, dropout_p, silu_u)


def _out_backward(ctx, grad, *_intermediates):
    attn, u, x, norm_weight, norm_bias, weight, bias, seed, *saved = ctx.saved_tensors
    eps, norm_groups, concat_ua, dropout_p, silu_u = ctx.args
    grads = torch.ops.hstu.stu_output_bwd(grad.contiguous(), attn, u, x, norm_weight, norm_bias, eps, norm_groups,
                                          weight, bias, concat_ua, dropout_p, seed, *saved, silu_u=silu_u)
    ga, gu, gx, gnw, gnb, gw, gb = _expand(grads, (attn, u, x, norm_weight, norm_bias, weight, bias))
    return ga, gu, gx, gnw, gnb, None, None, gw, gb, None, None, None, None


stu_output.register_autograd(_out_backward, setup_context=_out_setup)
stu_output_save.register_autograd(_out_backward, setup_context=_out_setup)
