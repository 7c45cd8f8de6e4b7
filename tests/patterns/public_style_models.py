"""STU stacks written the way two public plain-PyTorch HSTU code bases write them (no tests here).

Our own code, same ops and structure as:

- generative-recommenders' ``HammerKernel.PYTORCH`` path (``ops/pytorch/pt_hstu_attention.py``,
  ``pt_layer_norm.py``, ``pt_hstu_linear.py``, ``modules/stu.py``): fbgemm pads, ``einsum``,
  a bool mask built from clamped ids and multiplied in, ``silu(s) * attn_scale`` with a per-row
  scale padded to ``[B, 1, N, 1]`` (or ``/ N``), upcasts ``.to(float32)`` around both norms,
  group norm on ``attn.view(-1, H, Dv)`` with per-head ``[H]`` parameters, ``cat([u, attn, y])``,
  ``F.dropout(y, p, training)``, ``torch.addmm(x, y, W)`` (the residual is addmm's input).
- TorchEasyRec (``tzrec/ops/_pytorch``, ``tzrec/modules/gr/stu.py``): the same, with
  ``silu(s) / scaling_seqlen`` and no per-row scale.

Used by ``test_blocks_public_styles.py``. Sizes are tiny; everything runs on the CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # registers torch.ops.fbgemm.* (the public code pads with fbgemm); tests skip without it
    import fbgemm_gpu  # noqa: F401
except ImportError:
    pass


def _fp32_layer_norm(x, w, b, eps):
    """LayerNorm with statistics in fp32, result in the input dtype (the GR/tzrec helper)."""
    dt = x.dtype
    return F.layer_norm(x.to(torch.float32), [x.shape[-1]], w.to(torch.float32), b.to(torch.float32), eps).to(dt)


def _valid_mask(N, lengths, num_targets, max_attn_len, contextual, targets_see_each_other=False):
    """``[B|1, N, N]`` bool: causal HSTU mask from clamped position ids (targets, window, context).
    ``targets_see_each_other``: ``dist >= 0`` instead of ``eye | dist > 0`` (a near miss: with
    targets, rows sharing the clamped id attend to each other)."""
    pos = torch.arange(N, device=lengths.device).view(1, N)
    last = lengths.view(-1, 1, 1)
    if contextual > 0:
        pos = torch.clamp(pos - contextual + 1, min=0)
        last = last - contextual + 1
    if num_targets is not None:
        last = last - num_targets.view(-1, 1, 1)
        pos = torch.clamp(pos, max=last)
        rows = pos.view(-1, N, 1).expand(-1, N, N)
        cols = pos.view(-1, 1, N).expand(-1, N, N)
    else:
        rows = pos.view(N, 1).expand(N, N)
        cols = rows.t()
        rows, cols = rows.view(1, N, N), cols.view(1, N, N)
    dist = rows - cols
    ok = torch.eye(N, dtype=torch.bool, device=lengths.device).view(1, N, N)
    ok = (dist >= 0) if targets_see_each_other else ok | (dist > 0)
    if max_attn_len > 0:
        ok = ok & (dist <= max_attn_len)
    if contextual > 0:
        ok = ok | ((rows == 0) & (cols < last))
    return ok


def _pad(t, offsets, N):
    return torch.ops.fbgemm.jagged_to_padded_dense(t, [offsets], [N], 0.0)


def silu_attention(N, alpha, q, k, v, offsets, num_targets=None, attn_scale=None, max_attn_len=0,
                   contextual=0, dropout_p=0.0, training=False, divide_by=None, masked_select=False,
                   targets_see_each_other=False):
    """``q, k: [L, H, Dq]``, ``v: [L, H, Dv]`` -> ``[L, H, Dv]``. ``attn_scale``: scalar or ``[L]``;
    without it the scores are divided by ``divide_by`` (default ``N``). ``masked_select``: unpad
    with ``torch.nested.masked_select`` (a graph break in every layer) instead of fbgemm."""
    L, H, Dq = q.shape
    Dv = v.shape[2]
    qp = _pad(q.reshape(L, H * Dq), offsets, N).view(-1, N, H, Dq).transpose(1, 2)
    kp = _pad(k.reshape(L, H * Dq), offsets, N).view(-1, N, H, Dq).transpose(1, 2)
    vp = _pad(v.reshape(L, H * Dv), offsets, N).view(-1, N, H, Dv).transpose(1, 2)
    s = torch.einsum("bhnd,bhmd->bhnm", qp, kp) * alpha
    if attn_scale is not None:
        if attn_scale.ndim > 0:
            attn_scale = _pad(attn_scale.unsqueeze(-1), offsets, N).unsqueeze(1).to(s.dtype)
        s = F.silu(s) * attn_scale
    else:
        s = F.silu(s) / (N if divide_by is None else divide_by)
    mask = _valid_mask(N, offsets[1:] - offsets[:-1], num_targets, max_attn_len, contextual, targets_see_each_other)
    s = s * mask.unsqueeze(1)
    if dropout_p > 0.0:
        s = F.dropout(s, p=dropout_p, training=training)
    dense = torch.einsum("bhnm,bhmv->bhnv", s, vp)
    if masked_select:
        dense = dense.transpose(1, 2).reshape(dense.shape[0], N, H * Dv)
        valid = torch.arange(N, device=q.device)[None, :, None] < (offsets[1:] - offsets[:-1])[:, None, None]
        return torch.nested.masked_select(dense, valid.expand_as(dense)).values().view(L, H, Dv)
    return torch.ops.fbgemm.dense_to_jagged(dense.transpose(1, 2).flatten(2, 3), [offsets], L)[0].view(L, H, Dv)


def output_block(attn, u, x, nw, nb, W, eps, p, training, concat, group_norm, H, Dv):
    """``addmm(x, dropout([u, attn,] u * Norm(attn)), W)`` with fp32 upcasts (GR / tzrec layout:
    ``W [K, E]``, group norm parameters per head ``[H]``)."""
    dt = x.dtype
    a32, u32 = attn.to(torch.float32), u.to(torch.float32)
    if group_norm:
        normed = F.group_norm(a32.view(-1, H, Dv), num_groups=H, weight=nw.to(torch.float32),
                              bias=nb.to(torch.float32), eps=eps).view(-1, H * Dv)
    else:
        normed = F.layer_norm(a32, (a32.shape[-1],), nw.to(torch.float32), nb.to(torch.float32), eps)
    y = u32 * normed
    if concat:
        y = torch.cat([u32, a32, y], dim=1)
    y = F.dropout(y, p=p, training=training).to(dt)
    return torch.addmm(x, y, W.to(x.dtype)).to(dt)


class PublicStyleLayer(nn.Module):
    """One STU layer. ``style``: ``"gr"`` (per-row ``attn_scale`` allowed, concat_u option) or
    ``"tzrec"`` (``silu / scaling_seqlen``, concat of u and attn always on, like tzrec's STU).
    ``late_silu``: ``silu(u)`` computed after the attention instead of right after the split."""

    def __init__(self, E, H, Dq, Dv, style="gr", concat=True, group_norm=False, dropout=0.0,
                 max_attn_len=0, contextual=0, target_aware=True, eps=1e-6, masked_select=False, late_silu=False,
                 targets_see_each_other=False):
        super().__init__()
        self.E, self.H, self.Dq, self.Dv = E, H, Dq, Dv
        self.style, self.concat, self.group_norm, self.dropout = style, concat, group_norm, dropout
        self.max_attn_len, self.contextual, self.target_aware, self.eps = max_attn_len, contextual, target_aware, eps
        self.masked_select, self.late_silu = masked_select, late_silu
        self.targets_see_each_other = targets_see_each_other
        self.alpha = 1.0 / Dq ** 0.5
        self.uvqk_w = nn.Parameter(torch.randn(E, 2 * H * (Dv + Dq)) * 0.3)
        self.uvqk_b = nn.Parameter(torch.randn(2 * H * (Dv + Dq)) * 0.1)
        self.in_w = nn.Parameter(1 + 0.3 * torch.randn(E))
        self.in_b = nn.Parameter(0.1 * torch.randn(E))
        self.out_w = nn.Parameter(torch.randn(H * Dv * (3 if concat else 1), E) * 0.3)
        C = H if group_norm else H * Dv
        self.out_nw = nn.Parameter(1 + 0.3 * torch.randn(C))
        self.out_nb = nn.Parameter(0.1 * torch.randn(C))

    def forward(self, x, offsets, N, num_targets=None, attn_scale=None):
        H, Dq, Dv, dt = self.H, self.Dq, self.Dv, x.dtype
        normed = _fp32_layer_norm(x, self.in_w.to(dt), self.in_b.to(dt), self.eps)
        uvqk = torch.addmm(self.uvqk_b.to(dt), normed, self.uvqk_w.to(dt))
        u, v, q, k = torch.split(uvqk, [H * Dv, H * Dv, H * Dq, H * Dq], dim=1)
        if not self.late_silu:  # else silu(u) is first computed in the output block
            u = F.silu(u)
        q, k, v = q.view(-1, H, Dq), k.view(-1, H, Dq), v.view(-1, H, Dv)
        attn = silu_attention(N, self.alpha, q, k, v, offsets,
                              num_targets=num_targets if self.target_aware else None,
                              attn_scale=attn_scale if self.style == "gr" else None,
                              max_attn_len=self.max_attn_len, contextual=self.contextual,
                              masked_select=self.masked_select,
                              targets_see_each_other=self.targets_see_each_other).view(-1, H * Dv)
        if self.late_silu:
            u = F.silu(u)
        return output_block(attn, u, x, self.out_nw.to(dt), self.out_nb.to(dt), self.out_w.to(dt), self.eps,
                            self.dropout, self.training, self.concat, self.group_norm, H, Dv)


class PublicStyleStack(nn.Module):
    """``num_layers`` layers applied in turn (the STUStack loop)."""

    def __init__(self, num_layers, *args, **kw):
        super().__init__()
        self.layers = nn.ModuleList(PublicStyleLayer(*args, **kw) for _ in range(num_layers))

    def forward(self, x, offsets, N, num_targets=None, attn_scale=None):
        for layer in self.layers:
            x = layer(x, offsets, N, num_targets, attn_scale)
        return x
