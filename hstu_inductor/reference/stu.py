"""The STU layer (one HSTU block) and a small HSTU model, in plain PyTorch.

These modules are deliberately written with ordinary torch ops (no hstu_inductor API) so that
``torch.compile(model, backend="hstu")`` has to *recognise* them, exactly as it must for users.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import hstu_mha
from .jagged import row_to_sequence

def _stats(t):
    """Normalisation statistics dtype: fp32, or the input's own when wider (fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


__all__ = ["split_activate", "preprocess_views", "uvqk_grad", "linear_param_grads", "stu_preprocess", "stu_output",
           "stu_layer", "STULayer", "HSTUModel"]


def split_activate(uvqk, u_dim, qk_dim, silu_all=False):
    """The uvqk projection output ``[L, 2(u_dim+qk_dim)]`` split into ``(silu(u), v, q, k)`` (silu
    on all four with ``silu_all``); pieces without their own silu are views of ``uvqk``."""
    if silu_all:
        uvqk = F.silu(uvqk)
    u, v, q, k = torch.split(uvqk, [u_dim, u_dim, qk_dim, qk_dim], dim=-1)
    return (u if silu_all else F.silu(u)), v, q, k


def preprocess_views(act, uvqk, u_dim, qk_dim, silu_all=False):
    """``(u, v, q, k)`` of ``hstu::stu_preprocess``'s ``(act, uvqk)``, as views (no copy): ``u = act``
    and v, q, k column slices of ``uvqk``, or all four column slices of ``act`` with ``silu_all``."""
    u, v, q, k = torch.split(act if silu_all else uvqk, [u_dim, u_dim, qk_dim, qk_dim], dim=-1)
    return (u if silu_all else act), v, q, k


def uvqk_grad(d_act, d_uvqk, pre, width):
    """The gradient of a projection output ``uvqk: [L, width]`` from the gradients of ``act`` = silu of
    its first ``d_act.shape[1]`` columns (all of them for silu on u, v, q, k; the u columns otherwise)
    and of ``uvqk`` itself (``hstu::stu_preprocess``'s two outputs). ``pre`` holds at least the
    pre-activations of the activated columns. A gradient that is None counts as zero.
    The silu part is padded and added rather than concatenated, so that a compiler fuses the
    assembly of ``d_uvqk`` (from its views' gradients) and this sum into one pass."""
    if d_act is None:
        return d_uvqk if d_uvqk is not None else pre.new_zeros(pre.shape[0], width)
    grad = torch.ops.aten.silu_backward(d_act, pre[:, :d_act.shape[1]])
    if grad.shape[1] < width:
        grad = F.pad(grad, (0, width - grad.shape[1]))
    return grad if d_uvqk is None else d_uvqk + grad


def linear_param_grads(grad, inp, width, has_bias):
    """``(d_weight, d_bias or None)`` of ``F.linear(inp[:, :width], weight, bias)`` from its output gradient
    ``grad: [L, out]``. ``inp`` wider than ``width`` holds a ones column at ``width`` (the STU kernels store
    their projection inputs so, ``kernels.norms.ones_column_width``): then one GEMM yields both, the bias
    gradient as its column ``width``, instead of a GEMM plus a pass over ``grad``."""
    if inp.shape[1] > width:
        both = grad.t().mm(inp)
        return both[:, :width], (both[:, width] if has_bias else None)
    return grad.t().mm(inp), (grad.sum(0) if has_bias else None)


def stu_preprocess(x, ln_weight, ln_bias, w_uvqk, b_uvqk, num_heads, attn_dim, hidden_dim, eps=1e-6, silu_all=False):
    """LayerNorm(x) (fp32 statistics) -> uvqk projection -> split -> silu(u). Returns (u, v, q, k).

    ``u: [L, H*Dv]`` (activated); ``v: [L, H, Dv]``; ``q, k: [L, H, Dq]``.
    """
    L = x.shape[0]
    normed = F.layer_norm(_stats(x), (x.shape[-1],), _stats(ln_weight), _stats(ln_bias), eps).to(x.dtype)
    uvqk = torch.addmm(b_uvqk, normed, w_uvqk) if b_uvqk is not None else normed @ w_uvqk
    u, v, q, k = split_activate(uvqk, num_heads * hidden_dim, num_heads * attn_dim, silu_all)
    return u, v.view(L, num_heads, hidden_dim), q.view(L, num_heads, attn_dim), k.view(L, num_heads, attn_dim)


def stu_output(attn, u, x, norm_weight, norm_bias, w_o, b_o, num_heads, eps=1e-6, concat_ua=False,
               group_norm=False, dropout_ratio=0.0, training=False):
    """``x + (u * Norm(attn) [concat u, attn]) @ W_o (+ b_o)``; ``attn: [L, H*Dv]``."""
    a32 = _stats(attn)
    if group_norm:
        # [L, H*Dv] as [N=L, C=H*Dv]: H groups of Dv contiguous channels = per-head normalisation.
        normed = F.group_norm(a32, num_heads, _stats(norm_weight), _stats(norm_bias), eps)
    else:
        normed = F.layer_norm(a32, (attn.shape[-1],), _stats(norm_weight), _stats(norm_bias), eps)
    y = u * normed.to(attn.dtype)
    if concat_ua:
        y = torch.cat([u, attn, y], dim=1)
    if training and dropout_ratio > 0.0:
        y = F.dropout(y, p=dropout_ratio, training=True)
    return x + F.linear(y, w_o, b_o)


def stu_layer(x, seq_offsets, max_seq_len, params, num_heads, attn_dim, hidden_dim, alpha=None, eps=1e-6,
              num_targets=None, max_attn_len=0, contextual_seq_len=0, concat_ua=False, group_norm=False,
              dropout_ratio=0.0, training=False):
    """Functional STU layer. ``params``: dict with ln_weight, ln_bias, w_uvqk, b_uvqk, norm_weight,
    norm_bias, w_o, b_o (``w_o`` is ``[E, H*Dv or 3*H*Dv]``, ``F.linear`` layout)."""
    alpha = 1.0 / math.sqrt(attn_dim) if alpha is None else alpha
    u, v, q, k = stu_preprocess(x, params["ln_weight"], params["ln_bias"], params["w_uvqk"], params["b_uvqk"],
                                num_heads, attn_dim, hidden_dim, eps)
    attn = hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal=True, dropout_pr=0.0, training=training,
                    num_targets=num_targets, max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len)
    attn = attn.reshape(x.shape[0], num_heads * hidden_dim)
    return stu_output(attn, u, x, params["norm_weight"], params["norm_bias"], params["w_o"], params["b_o"],
                      num_heads, eps, concat_ua, group_norm, dropout_ratio, training)


class STULayer(nn.Module):
    """One HSTU block with its parameters; ``forward(x, seq_offsets, max_seq_len, num_targets=None)``."""

    def __init__(self, embedding_dim, num_heads, attn_dim, hidden_dim, alpha=None, eps=1e-6, max_attn_len=0,
                 contextual_seq_len=0, concat_ua=False, group_norm=False, dropout_ratio=0.0):
        super().__init__()
        E, H = embedding_dim, num_heads
        self.num_heads, self.attn_dim, self.hidden_dim = H, attn_dim, hidden_dim
        self.alpha = 1.0 / math.sqrt(attn_dim) if alpha is None else alpha
        self.eps, self.max_attn_len, self.contextual_seq_len = eps, max_attn_len, contextual_seq_len
        self.concat_ua, self.group_norm, self.dropout_ratio = concat_ua, group_norm, dropout_ratio
        self.ln_weight = nn.Parameter(torch.ones(E))
        self.ln_bias = nn.Parameter(torch.zeros(E))
        self.w_uvqk = nn.Parameter(torch.empty(E, 2 * H * (hidden_dim + attn_dim)))
        self.b_uvqk = nn.Parameter(torch.zeros(2 * H * (hidden_dim + attn_dim)))
        self.norm_weight = nn.Parameter(torch.ones(H * hidden_dim))
        self.norm_bias = nn.Parameter(torch.zeros(H * hidden_dim))
        self.w_o = nn.Parameter(torch.empty(E, H * hidden_dim * (3 if concat_ua else 1)))
        self.b_o = nn.Parameter(torch.zeros(E))
        nn.init.xavier_uniform_(self.w_uvqk)
        nn.init.xavier_uniform_(self.w_o)

    def forward(self, x, seq_offsets, max_seq_len, num_targets=None):
        params = {n: p for n, p in self.named_parameters(recurse=False)}
        return stu_layer(x, seq_offsets, max_seq_len, params, self.num_heads, self.attn_dim, self.hidden_dim,
                         self.alpha, self.eps, num_targets, self.max_attn_len, self.contextual_seq_len,
                         self.concat_ua, self.group_norm, self.dropout_ratio, self.training)


class HSTUModel(nn.Module):
    """Item embeddings + learned positions -> stacked STU layers -> LayerNorm -> next-item logits.

    ``forward(item_ids [L], seq_offsets [B+1], num_targets=None) -> logits [L, num_items]``.
    """

    def __init__(self, num_items, max_seq_len, embedding_dim=64, num_layers=2, num_heads=2, attn_dim=32,
                 hidden_dim=32, **layer_kwargs):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.item_emb = nn.Embedding(num_items, embedding_dim)
        self.pos_emb = nn.Embedding(max_seq_len, embedding_dim)
        self.layers = nn.ModuleList(
            STULayer(embedding_dim, num_heads, attn_dim, hidden_dim, **layer_kwargs) for _ in range(num_layers)
        )
        self.final_norm = nn.LayerNorm(embedding_dim)
        nn.init.normal_(self.item_emb.weight, std=embedding_dim ** -0.5)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, item_ids, seq_offsets, num_targets=None):
        _, pos = row_to_sequence(seq_offsets, item_ids.shape[0])
        x = self.item_emb(item_ids) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x, seq_offsets, self.max_seq_len, num_targets)
        return self.final_norm(x) @ self.item_emb.weight.t()
