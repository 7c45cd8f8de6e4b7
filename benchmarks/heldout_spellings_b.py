"""Held-out spellings, set B: more plain-PyTorch STU layers in styles that neither the grammar
(``hstu_inductor/testing/grammar.py``), the metamorphic transformations nor ``heldout_spellings.py``
write, and near misses (look like HSTU, compute something else) outside the grammar's mutations.

    python benchmarks/heldout_spellings_b.py --eager                     # each model vs reference.hstu_mha, eager
    python benchmarks/heldout_spellings_b.py --check                     # small, CPU: rewritten and equal to eager
    python benchmarks/heldout_spellings_b.py --fake                      # B=128, N=4096 static under fake tensors

HSTU spellings (``SPELLINGS``; each docstring says what is new in it):
``pad_sequence``, ``bool_setitem_baddbmm``, ``manual_norm``, ``attn_submodule``, ``targets_no_ids``,
``band_window``, ``nested_maxlen_concat``, ``group_norm_out``, ``bf16_accumulate``, ``silu_all_tril_idx``,
``contextual_rows``, ``nonzero_rows``, and on the near misses' plain base ``alpha_over_n`` (1/N
"folded into alpha": HSTU with alpha / N) and ``neg_fill_before_silu`` (``finfo.min`` fill before the
silu). ``plain_control``: the near misses' base, unchanged.

Near misses (``NEAR_MISSES``): ``sigmoid_gate`` (sigmoid, not silu), ``bias_after_silu`` (a learned
[N, N] bias added after the silu), ``strict_causal`` (the diagonal masked out), ``per_head_alpha`` (a
constant per-head temperature buffer).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from heldout_spellings import _Layer, make_inputs, rel  # noqa: E402


class _LayerB(_Layer):
    """``_Layer`` plus what the checks need: ``alpha``, the mask constants of the model for
    ``reference.hstu_mha`` (``hstu_kwargs``), the dtype the model runs in, and eval mode."""

    DTYPE = torch.float32
    EVAL = False
    HSTU = True

    def __init__(self, E, H, D, N):
        super().__init__(E, H, D, N)
        self.alpha = D ** -0.5

    @property
    def ref_alpha(self):
        return self.alpha

    def hstu_kwargs(self, *extra):
        return {}

    def reference(self, *args):
        """The same layer (same parameters) with ``attend`` replaced by ``reference.hstu_mha``."""
        from hstu_inductor.reference import hstu_mha

        def ref(q, k, v, offsets, *extra):
            L, H = q.shape[0], self.H
            o = hstu_mha(self.N, self.ref_alpha, *(t.reshape(L, H, -1).float() for t in (q, k, v)), offsets,
                         **self.hstu_kwargs(*extra))
            return o.reshape(L, -1).to(q.dtype)
        self.attend = ref
        try:
            return self(*args)
        finally:
            del self.attend


# ------------------------------------------------------------------------------------------------
# HSTU spellings

class PadSequence(_LayerB):
    """``lengths`` input; padded by ``pad_sequence(torch.split(t, lengths.tolist()))`` to the longest
    sequence of the batch (a data-dependent T, not N; the scale is still 1/N); heads by ``unflatten``
    + ``transpose``; ``q @ k.mT``; ``where(tril, s, s.new_zeros(()))``; unpadded by ``dense[valid]``."""

    inputs = ("x", "lengths")

    def forward(self, x, lengths):
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        return super().forward(x, offsets, lengths)

    def attend(self, q, k, v, offsets, lengths):
        H, D, N = self.H, self.D, self.N
        sizes = lengths.tolist()

        def heads(t):  # [L, H*D] -> [B, H, T, D]
            return pad_sequence(torch.split(t, sizes), batch_first=True).unflatten(-1, (H, D)).transpose(1, 2)
        qh, kh, vh = heads(q), heads(k), heads(v)
        T = qh.shape[2]
        s = F.silu(torch.matmul(qh, kh.mT) * self.alpha)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        p = torch.where(causal, s, s.new_zeros(())) / N
        o = (p @ vh).transpose(1, 2).flatten(2)
        valid = torch.arange(T, device=q.device) < lengths[:, None]
        return o[valid]


class BoolSetitemBaddbmm(_LayerB):
    """Padded by a boolean-mask setitem ``dense[valid] = t`` (``valid = arange(N) < lengths[:, None]``);
    ``[B*H, N, D]`` heads; scores ``torch.baddbmm(empty, q, k^T, beta=0, alpha=alpha)`` (the HF idiom);
    silu spelled ``s / (1 + exp(-s))``; mask ``ones(N, N).triu(1) == 0``; unpadded by ``dense[valid]``."""

    def attend(self, q, k, v, offsets):
        B, H, D, N = offsets.numel() - 1, self.H, self.D, self.N
        valid = torch.arange(N, device=q.device)[None, :] < offsets.diff()[:, None]

        def heads(t):
            dense = t.new_zeros(B, N, H * D)
            dense[valid] = t
            return dense.view(B, N, H, D).permute(0, 2, 1, 3).reshape(B * H, N, D)
        qh, kh, vh = heads(q), heads(k), heads(v)
        s = torch.baddbmm(qh.new_empty(B * H, N, N), qh, kh.transpose(1, 2), beta=0.0, alpha=self.alpha)
        p = s / (1 + torch.exp(-s))
        keep = torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1) == 0
        p = torch.where(keep, p, 0.0) / N
        o = torch.bmm(p, vh).view(B, H, N, D).permute(0, 2, 1, 3).reshape(B, N, H * D)
        return o[valid]


class ManualNorm(_LayerB):
    """Both layer norms written out (``(x - mean) * rsqrt(var + eps) * w + b``), ``F.linear`` on the
    modules' weights, ``torch.tensor_split(uvqk, 4, -1)``, ``u * sigmoid(u)``; the row's sequence
    counted by a comparison (``(offsets[1:-1, None] <= r).sum(0)``), padded by ``scatter_add_`` on flat
    rows; ``1/N`` folded into v before the pad; causal mask from two ``cumsum`` of ones, multiplied in
    as a bool; unpadded by ``index_select``."""

    @staticmethod
    def norm(x, ln):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + ln.eps) * ln.weight + ln.bias

    def forward(self, x, offsets):
        uvqk = F.linear(self.norm(x, self.ln), self.proj.weight, self.proj.bias)
        u, v, q, k = torch.tensor_split(uvqk, 4, dim=-1)
        a = self.attend(q, k, v, offsets)
        y = u * torch.sigmoid(u) * self.norm(a, self.ln_out)
        return x + F.linear(y, self.out.weight, self.out.bias)

    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        r = torch.arange(L, device=q.device)
        seg = (offsets[1:-1, None] <= r[None]).sum(0)
        flat = seg * N + r - offsets[seg]

        def pad(t):
            idx = flat[:, None].expand(-1, H * D)
            return torch.zeros(B * N, H * D, dtype=t.dtype, device=t.device).scatter_add_(0, idx, t).view(B, N, H, D)
        qp, kp, vp = pad(q), pad(k), pad(v * (1.0 / N))
        s = torch.einsum("bihd,bjhd->bhij", qp, kp) * self.alpha
        ones = torch.ones(N, N, device=q.device)
        causal = ones.cumsum(1) <= ones.cumsum(0)  # j + 1 <= i + 1
        p = F.silu(s) * causal
        o = torch.einsum("bhij,bjhd->bihd", p, vp).reshape(B * N, H * D)
        return o.index_select(0, flat)


class SiluAttention(nn.Module):
    """An attention submodule with its own forward: q, k, v ``[L, H, D]`` -> ``[L, H, D]``."""

    def __init__(self, H, D, N, alpha):
        super().__init__()
        self.H, self.D, self.N, self.alpha = H, D, N, alpha
        mask = torch.ones(N, N).cumsum(0).ge(torch.arange(1, N + 1)).float()  # [i, j]: i + 1 >= j + 1
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, q, k, v, offsets):
        L, N = q.shape[0], self.N
        col = torch.arange(N, device=q.device)
        src = offsets[:-1, None] + col
        src = torch.where(col < offsets.diff()[:, None], src, L)  # row L: a zero sentinel appended by F.pad

        def heads(t):  # [L, H, D] -> [B, H, N, D]
            return F.pad(t, (0, 0, 0, 0, 0, 1))[src].permute(0, 2, 1, 3)
        qh, kh, vh = heads(q), heads(k), heads(v)
        s = torch.matmul(qh, kh.permute(0, 1, 3, 2)) * self.alpha
        p = F.silu(s) * self.mask / N
        o = torch.matmul(p, vh).permute(0, 2, 1, 3)  # [B, N, H, D]
        seg = torch.searchsorted(offsets, torch.arange(L, device=q.device), right=True) - 1
        return o[seg, torch.arange(L, device=q.device) - offsets[seg]]


class AttnSubmodule(_LayerB):
    """Attention in an ``nn.Module`` of its own; pad by indexing a copy of the rows with a zero sentinel
    row appended by ``F.pad`` (padding slots point at it); heads kept as a dim through ``permute``
    chains; the mask a float ``[N, N]`` buffer (``register_buffer(persistent=False)``) built from a
    ``cumsum`` of ones, multiplied in."""

    def __init__(self, E, H, D, N):
        super().__init__(E, H, D, N)
        self.attn = SiluAttention(H, D, N, self.alpha)

    def attend(self, q, k, v, offsets):
        L, H = q.shape[0], self.H
        return self.attn(q.view(L, H, -1), k.view(L, H, -1), v.view(L, H, -1), offsets).reshape(L, -1)


class TargetsNoIds(_LayerB):
    """``num_targets`` without position ids: a row sees ``j <= i`` among history keys, plus itself
    (``((j <= i) & (j < n - t)) | (i == j)``); padded by ``torch.take_along_dim`` on clamped rows and
    ``where`` on validity; ``[B, H, N, D]`` matmuls."""

    inputs = ("x", "offsets", "num_targets")

    def forward(self, x, offsets, num_targets):
        return super().forward(x, offsets, num_targets)

    def hstu_kwargs(self, num_targets):
        return {"num_targets": num_targets}

    def attend(self, q, k, v, offsets, num_targets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        lengths = offsets[1:] - offsets[:-1]
        ar = torch.arange(N, device=q.device)
        idx = (offsets[:-1, None] + ar).clamp(max=L - 1).reshape(-1, 1)
        inside = (ar < lengths[:, None]).reshape(-1, 1)

        def heads(t):
            g = torch.where(inside, torch.take_along_dim(t, idx, dim=0), 0.0)
            return g.view(B, N, H, D).transpose(1, 2)
        qh, kh, vh = heads(q), heads(k), heads(v)
        i, j = ar[:, None], ar[None, :]
        history = (lengths - num_targets)[:, None, None]
        allowed = ((j <= i) & (j < history)) | (i == j)
        p = F.silu(self.alpha * (qh @ kh.transpose(-2, -1))) * allowed[:, None] / N
        o = (p @ vh).transpose(1, 2).reshape(B * N, H * D)
        return o[torch.nonzero(inside.view(-1)).squeeze(1)]


class BandWindow(_LayerB):
    """A local window written as a float band ``tril() - tril(-W)`` (``0 <= i - j < W``, i.e.
    ``max_attn_len = W - 1``); padded by a setitem on a flat view of the buffer
    (``buf.view(B*N, -1)[rows] = t``); heads by ``unflatten`` + ``movedim``; ``bmm`` on
    ``flatten(0, 1)``; silu as ``sigmoid(x).mul(x)``."""

    def __init__(self, E, H, D, N):
        super().__init__(E, H, D, N)
        self.W = N // 4

    def hstu_kwargs(self):
        return {"max_attn_len": self.W - 1}

    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        seg = torch.searchsorted(offsets[1:], torch.arange(L, device=q.device), right=True)
        rows = seg * N + torch.arange(L, device=q.device) - offsets[seg]

        def heads(t):  # -> [B*H, N, D]
            buf = torch.zeros(B, N, H * D, dtype=t.dtype, device=t.device)
            buf.view(B * N, -1)[rows] = t
            return buf.unflatten(-1, (H, D)).movedim(2, 1).flatten(0, 1)
        qh, kh, vh = heads(q), heads(k), heads(v)
        ones = torch.ones(N, N, device=q.device)
        band = ones.tril() - ones.tril(-self.W)
        s = torch.bmm(qh, kh.transpose(1, 2)) * self.alpha
        p = torch.sigmoid(s).mul(s) * band / N
        o = torch.bmm(p, vh).unflatten(0, (B, H)).movedim(1, 2).flatten(2)  # [B, N, H*D]
        return o.flatten(0, 1)[rows]


class NestedMaxlenConcat(_LayerB):
    """``chunk(4, -1)``; pad by ``nested_tensor_from_jagged(t, offsets, max_seqlen=N).to_padded_tensor(0.0)``
    (no ``output_size``: the cached max_seqlen decides the width); ``einsum`` with an ellipsis on
    ``[B, H, N, D]``; ``torch.div(p, N)``; unpad by a flat boolean mask; the output block is the
    concat form ``out(cat([u, a, u * norm(a)]))`` with an ``nn.Dropout(p=0.0)``."""

    def __init__(self, E, H, D, N):
        super().__init__(E, H, D, N)
        self.out = nn.Linear(3 * H * D, E)
        self.drop = nn.Dropout(0.0)

    def forward(self, x, offsets):
        u, v, q, k = self.proj(self.ln(x)).chunk(4, dim=-1)
        u = F.silu(u)
        a = self.attend(q, k, v, offsets)
        return x + self.drop(self.out(torch.cat([u, a, u * self.ln_out(a)], dim=-1)))

    def attend(self, q, k, v, offsets):
        B, H, D, N = offsets.numel() - 1, self.H, self.D, self.N

        def heads(t):
            nt = torch.nested.nested_tensor_from_jagged(t, offsets, max_seqlen=N)
            return nt.to_padded_tensor(0.0).view(B, N, H, D).transpose(1, 2)
        qh, kh, vh = heads(q), heads(k), heads(v)
        s = torch.einsum("...id,...jd->...ij", qh, kh)
        i = torch.arange(N, device=q.device)
        p = torch.div(F.silu(self.alpha * s) * (i[:, None] >= i[None, :]), N)
        o = torch.einsum("...ij,...jd->...id", p, vh).transpose(1, 2).reshape(B * N, H * D)
        keep = (i[None, :] < offsets.diff()[:, None]).flatten()
        return o[keep]


class GroupNormOut(_LayerB):
    """Output norm ``F.group_norm(a, H)`` (one group per head; the spec's variant) after an
    ``nn.Dropout(0.1)`` run in eval mode; pad by indexing ``cat([t, zeros(1)])`` at
    ``where(valid, offsets[b] + p, L)``; scores ``q.transpose(1, 2) @ k.permute(0, 2, 3, 1)``;
    mask ``where(mask, s, s.new_zeros(()))``; unpad ``dense[seg, pos]`` with seg from ``bucketize``."""

    EVAL = True

    def __init__(self, E, H, D, N):
        super().__init__(E, H, D, N)
        self.gn = nn.GroupNorm(H, H * D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, offsets):
        u, v, q, k = self.proj(self.ln(x)).split(self.H * self.D, dim=-1)
        a = self.attend(q, k, v, offsets)
        y = F.silu(u) * F.group_norm(a, self.H, self.gn.weight, self.gn.bias, self.gn.eps)
        return x + self.out(self.drop(y))

    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        col = torch.arange(N, device=q.device)
        src = torch.where(col < offsets.diff()[:, None], offsets[:-1, None] + col, L)

        def pad(t):  # [B, N, H, D]
            return torch.cat([t, t.new_zeros(1, H * D)])[src].view(B, N, H, D)
        qp, kp, vp = pad(q), pad(k), pad(v)
        s = qp.transpose(1, 2) @ kp.permute(0, 2, 3, 1)
        mask = col[:, None] >= col[None, :]
        p = torch.where(mask, F.silu(s * self.alpha), s.new_zeros(())) / N
        o = (p @ vp.transpose(1, 2)).transpose(1, 2)  # [B, N, H, D]
        r = torch.arange(L, device=q.device)
        seg = torch.bucketize(r, offsets, right=True) - 1
        return o[seg, r - offsets[seg]].reshape(L, H * D)


class Bf16Accumulate(_LayerB):
    """All bf16 (parameters and activations), layer norms in fp32 (``F.layer_norm`` on ``.float()``d input and
    weights, cast back); attention in
    bf16 throughout; pad by ``index_put_(..., accumulate=True)``, row ids by the method
    ``arange(B).repeat_interleave(lengths)`` (no output_size), positions ``arange(L) - offsets[seg]``."""

    DTYPE = torch.bfloat16

    @staticmethod
    def norm32(x, ln):
        return F.layer_norm(x.float(), ln.normalized_shape, ln.weight.float(), ln.bias.float(), ln.eps).to(x.dtype)

    def forward(self, x, offsets):
        u, v, q, k = self.proj(self.norm32(x, self.ln)).split(self.H * self.D, dim=-1)
        a = self.attend(q, k, v, offsets)
        return x + self.out(F.silu(u) * self.norm32(a, self.ln_out))

    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        seg = torch.arange(B, device=q.device).repeat_interleave(offsets[1:] - offsets[:-1])
        pos = torch.arange(L, device=q.device) - offsets[seg]

        def heads(t):
            z = torch.zeros(B, N, H * D, dtype=t.dtype, device=t.device)
            return z.index_put_((seg, pos), t, accumulate=True).view(B, N, H, D).transpose(1, 2)
        qh, kh, vh = heads(q), heads(k), heads(v)
        s = F.silu(torch.matmul(qh, kh.transpose(2, 3)) * self.alpha)
        causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
        o = torch.matmul(s.masked_fill(causal.logical_not(), 0) / N, vh)
        return o.transpose(1, 2)[seg, pos].flatten(1)


class SiluAllTrilIdx(_LayerB):
    """The silu applied to all of ``uvqk`` before a ``chunk(4)`` (the spec's variant); pad by
    ``index_put_`` of a 1-tuple of flat rows into ``[B*N, F]``, seg from ``bucketize(r, offsets,
    right=True) - 1``; the causal mask set through ``m[tuple(torch.tril_indices(N, N))] = True``."""

    def forward(self, x, offsets):
        u, v, q, k = F.silu(self.proj(self.ln(x))).chunk(4, dim=-1)
        a = self.attend(q, k, v, offsets)
        return x + self.out(u * self.ln_out(a))

    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        r = torch.arange(L, device=q.device)
        seg = torch.bucketize(r, offsets, right=True) - 1
        flat = seg * N + r - offsets[seg]

        def pad(t):
            return t.new_zeros(B * N, H * D).index_put_((flat,), t).view(B, N, H, D)
        qp, kp, vp = pad(q), pad(k), pad(v)
        m = torch.zeros(N, N, dtype=torch.bool, device=q.device)
        m[tuple(torch.tril_indices(N, N, device=q.device))] = True
        s = torch.einsum("bqhd,bkhd->bhqk", qp, kp)
        p = torch.where(m, F.silu(self.alpha * s), 0.0) / N
        return torch.einsum("bhqk,bkhd->bqhd", p, vp).reshape(B * N, H * D)[flat]


class ContextualRows(_LayerB):
    """A contextual prefix written without ids: the first ``c`` rows see every key
    (``(j <= i) | (i < c)``; padding keys are zero, so they add nothing); pad by ``index_copy_`` of
    ``[L, H, D]`` rows into ``zeros(B * N, H, D)``, row starts by ``repeat_interleave(offsets[:-1])``;
    ``bmm``; ``masked_fill``; the ``1/N`` on the dense output."""

    def __init__(self, E, H, D, N):
        super().__init__(E, H, D, N)
        self.c = 2

    def hstu_kwargs(self):
        return {"contextual_seq_len": self.c}

    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        lengths = offsets[1:] - offsets[:-1]
        start = torch.repeat_interleave(offsets[:-1], lengths, output_size=L)
        seg = torch.repeat_interleave(torch.arange(B, device=q.device), lengths, output_size=L)
        rows = seg * N + torch.arange(L, device=q.device) - start

        def heads(t):  # [B*H, N, D]
            z = torch.zeros(B * N, H, D, dtype=t.dtype, device=t.device).index_copy_(0, rows, t.view(L, H, D))
            return z.view(B, N, H, D).transpose(1, 2).reshape(B * H, N, D)
        qh, kh, vh = heads(q), heads(k), heads(v)
        ar = torch.arange(N, device=q.device)
        visible = (ar[None, :] <= ar[:, None]) | (ar[:, None] < self.c)
        s = F.silu(torch.bmm(qh, kh.transpose(1, 2)) * self.alpha).masked_fill(~visible, 0.0)
        o = torch.bmm(s, vh).view(B, H, N, D).transpose(1, 2).reshape(B * N, H * D) / N
        return o[rows]


class NonzeroRows(_LayerB):
    """Row ids from the validity mask itself: ``b, t = torch.nonzero(valid, as_tuple=True)``; pad by
    ``dense[b, t] = x``; ``einsum`` on ``[B, H, N, D]`` made by ``permute``; arange mask by ``where``;
    the ``1/N`` applied to the jagged output after the unpad."""

    def attend(self, q, k, v, offsets):
        B, H, D, N = offsets.numel() - 1, self.H, self.D, self.N
        ar = torch.arange(N, device=q.device)
        b, t = torch.nonzero(ar < (offsets[1:] - offsets[:-1])[:, None], as_tuple=True)

        def heads(x):
            dense = x.new_zeros(B, N, H, D)
            dense[b, t] = x.view(-1, H, D)
            return dense.permute(0, 2, 1, 3)
        qh, kh, vh = heads(q), heads(k), heads(v)
        s = torch.einsum("bhid,bhjd->bhij", qh, kh)
        p = torch.where(ar[:, None] >= ar[None, :], F.silu(s * self.alpha), 0.0)
        o = torch.einsum("bhij,bhjd->bihd", p, vh)
        return o[b, t].flatten(1) / N


SPELLINGS = {
    "pad_sequence": PadSequence, "bool_setitem_baddbmm": BoolSetitemBaddbmm, "manual_norm": ManualNorm,
    "attn_submodule": AttnSubmodule, "targets_no_ids": TargetsNoIds, "band_window": BandWindow,
    "nested_maxlen_concat": NestedMaxlenConcat, "group_norm_out": GroupNormOut, "bf16_accumulate": Bf16Accumulate,
    "silu_all_tril_idx": SiluAllTrilIdx, "contextual_rows": ContextualRows, "nonzero_rows": NonzeroRows,
}


# ------------------------------------------------------------------------------------------------
# Near misses: one plain layer, four wrong activations / masks

class _PlainNearMiss(_LayerB):
    """Plain jagged attention (searchsorted rows, ``index_put`` pad, ``matmul`` on ``[B, H, N, D]``);
    ``scores`` / ``keep`` / ``weights`` are the hooks the near misses change."""

    HSTU = False

    def scores(self, s):
        return F.silu(self.alpha * s)

    def keep(self, N, device):
        return torch.ones(N, N, dtype=torch.bool, device=device).tril()

    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        seg, pos = self.rows(offsets, L)

        def heads(t):
            z = torch.zeros(B, N, H * D, dtype=t.dtype, device=t.device)
            return torch.index_put(z, (seg, pos), t).view(B, N, H, D).transpose(1, 2)
        qh, kh, vh = heads(q), heads(k), heads(v)
        p = self.weights(qh @ kh.transpose(-1, -2), self.keep(N, q.device)) / N
        return (p @ vh).transpose(1, 2)[seg, pos].reshape(L, H * D)

    def weights(self, s, keep):
        return torch.where(keep, self.scores(s), 0.0)


class PlainControl(_PlainNearMiss):
    """The near misses' base unchanged: HSTU (the control)."""

    HSTU = True


class SigmoidGate(_PlainNearMiss):
    """``sigmoid(alpha * s)`` (a gate), not ``alpha * s * sigmoid(alpha * s)``."""

    def scores(self, s):
        return torch.sigmoid(self.alpha * s)


class AlphaOverN(_PlainNearMiss):
    """The ``1/N`` "folded into alpha": ``silu(s * (alpha / N)) / N``. Meant as a near miss, but it is
    HSTU all the same, with ``alpha' = alpha / N`` (alpha is free): the reference uses ``alpha / N``."""

    HSTU = True

    @property
    def ref_alpha(self):
        return self.alpha / self.N

    def scores(self, s):
        return F.silu(s * (self.alpha / self.N))


class NegFillBeforeSilu(_PlainNearMiss):
    """The softmax habit: masked scores filled with ``finfo.min`` *before* the silu
    (``silu(finfo.min) == -0.0`` exactly, so this is HSTU)."""

    HSTU = True

    def weights(self, s, keep):
        return F.silu((self.alpha * s).masked_fill(~keep, torch.finfo(s.dtype).min))


class PerHeadAlpha(_PlainNearMiss):
    """A per-head temperature, a constant non-persistent buffer ``alpha * [1, 1.5, ...]``: HSTU has one
    alpha for all heads."""

    def __init__(self, E, H, D, N):
        super().__init__(E, H, D, N)
        self.register_buffer("temp", self.alpha * (1 + 0.5 * torch.arange(H)), persistent=False)

    def scores(self, s):
        return F.silu(s * self.temp[:, None, None])


class BiasAfterSilu(_PlainNearMiss):
    """A learned relative bias ``[N, N]`` added after the silu (the rab belongs inside it)."""

    def __init__(self, E, H, D, N):
        super().__init__(E, H, D, N)
        self.rel_bias = nn.Parameter(0.1 * torch.randn(N, N))

    def scores(self, s):
        return F.silu(self.alpha * s) + self.rel_bias


class StrictCausal(_PlainNearMiss):
    """``tril(diagonal=-1)``: a row never sees itself (off by one the other way from the grammar's)."""

    def keep(self, N, device):
        return torch.ones(N, N, dtype=torch.bool, device=device).tril(-1)


SPELLINGS.update(alpha_over_n=AlphaOverN, neg_fill_before_silu=NegFillBeforeSilu)
NEAR_MISSES = {"sigmoid_gate": SigmoidGate, "bias_after_silu": BiasAfterSilu, "strict_causal": StrictCausal,
               "per_head_alpha": PerHeadAlpha}
CONTROLS = {"plain_control": PlainControl}
ALL = {**SPELLINGS, **CONTROLS, **NEAR_MISSES}


# ------------------------------------------------------------------------------------------------

def _inputs(cls, model, B=4, N=16, E=16, lengths=None, seed=0):
    """``make_inputs`` in the model's dtype; ``lengths`` overrides make_inputs' lengths (a list)."""
    args = make_inputs(model, B, N, E, dtype=cls.DTYPE, seed=seed)
    if lengths is None:
        return args
    g = torch.Generator().manual_seed(seed)
    lt = torch.tensor(lengths)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = lt.cumsum(0)
    named = {"x": torch.randn(int(offsets[-1]), E, generator=g).to(cls.DTYPE), "offsets": offsets, "lengths": lt,
             "num_targets": torch.randint(0, 8, (len(lengths),), generator=g).clamp(max=lt)}
    return tuple(named[n] for n in model.inputs)


def _build(name, E=16, H=2, D=8, N=16):
    cls = ALL[name]
    torch.manual_seed(0)
    model = cls(E, H, D, N).to(cls.DTYPE)
    if cls.EVAL:
        model.eval()
    return cls, model


VARIED = [16, 0, 5, 11, 1, 16]  # a full one, an empty one, a single row


def eager(names):
    """Each model against its own layer with ``reference.hstu_mha`` as the attention, in eager mode, on
    make_inputs' lengths and on ``VARIED`` (zero-length and one-row sequences)."""
    ok = True
    for name in names:
        cls, model = _build(name)
        errs = []
        for lengths in (None, VARIED):
            args = _inputs(cls, model, B=len(VARIED) if lengths else 4, lengths=lengths)
            with torch.no_grad():
                errs.append(rel(model(*args), model.reference(*args)))
        tol = 2e-2 if cls.DTYPE == torch.bfloat16 else 1e-5
        hstu = all(e < tol for e in errs)
        good = hstu == cls.HSTU
        ok = ok and good
        print(f"{name:22s} expected {'HSTU' if cls.HSTU else 'near miss':9s} eager vs reference: "
              f"{' / '.join(f'{e:.1e}' for e in errs)}  {'ok' if good else 'UNEXPECTED'}", flush=True)
    return ok


def check(names, dynamic_modes=(False, True), lengths=None):
    """Small, CPU: HSTU spellings rewritten in full (attention, preprocess, output) and equal to eager;
    near misses not rewritten (attention 0) and equal to eager."""
    import hstu_inductor

    ok = True
    for name in names:
        for dynamic in dynamic_modes:
            cls, model = _build(name)
            args = _inputs(cls, model, B=len(lengths) if lengths else 4, lengths=lengths)
            start = time.perf_counter()
            try:
                rep = hstu_inductor.explain(model, *args, dynamic=dynamic, backend="hstu_eager")
            except Exception as e:  # a crash is a finding: print and go on
                import traceback
                ok = False
                tail = "".join(traceback.format_exception(e)[-6:])
                print(f"{name:22s} dynamic={dynamic!s:5s} CRASH {type(e).__name__}: {str(e)[:300]}\n{tail}", flush=True)
                continue
            secs = time.perf_counter() - start
            with torch.no_grad():
                ref = model(*args)
            err = rel(rep.output, ref)
            tol = 2e-2 if cls.DTYPE == torch.bfloat16 else 1e-5
            if cls.HSTU:
                good = rep.counts == {"attention": 1, "preprocess": 1, "output": 1} and err < tol
            else:
                good = rep.counts["attention"] == 0 and err == 0.0
            ok = ok and good
            print(f"{name:22s} dynamic={dynamic!s:5s} {rep.counts} rel err {err:.1e} ({secs:.0f} s) "
                  f"{'ok' if good else 'NOT OK'}", flush=True)
            for kind, reason in rep.near_misses:
                print(f"    near miss {kind}: {reason}", flush=True)
            for f in rep.fallbacks:
                print(f"    fallback: {f}", flush=True)
            for b in rep.graph_breaks:
                print(f"    graph break {b.where}: {b.reason} {b.effect}", flush=True)
    return ok


def fake(names, B=128, N=4096, E=512, H=4, D=128):
    """B=128, N=4096 static under FakeTensorMode (nothing allocated): what is rewritten, and the time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hstu_inductor.report import collecting

    for name in names:
        torch._dynamo.reset()
        cls = ALL[name]
        real = make_inputs(cls, B, N, E, dtype=cls.DTYPE, fake=True)
        # the model is real (its parameters are small; a buffer such as a mask must hold values the
        # prover can read, as it does in a real run), the inputs fake
        model = cls(E, H, D, N).to(cls.DTYPE)
        if cls.EVAL:
            model.eval()
        with FakeTensorMode() as mode:
            args = tuple(torch.empty(t.shape, dtype=t.dtype) if t.device.type == "meta" else mode.from_tensor(t)
                         for t in real)
        start = time.perf_counter()
        err = ""
        with collecting() as rep, mode, torch.no_grad():
            try:
                torch.compile(model, backend="hstu_eager", dynamic=False)(*args)
            except Exception as e:  # running the graph on fake inputs of a mode without a shape env
                err = f"(then raised {type(e).__name__}: {str(e)[:80]}...)"
        proofs = ", ".join(f"{s:.2f}" for _, _, s in rep.proofs)
        print(f"{name:22s} B={B} N={N}: {rep.counts} in {time.perf_counter() - start:.1f} s "
              f"(proofs {proofs} s) {rep.near_misses or ''} {err}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spelling", nargs="+", default=list(ALL), choices=list(ALL))
    ap.add_argument("--eager", action="store_true", help="eager: each model against reference.hstu_mha")
    ap.add_argument("--check", action="store_true", help="small CPU check: rewritten (or not) and equal to eager")
    ap.add_argument("--varied", action="store_true", help="with --check: lengths VARIED (empty and 1-row sequences)")
    ap.add_argument("--static-only", action="store_true", help="with --check: dynamic=False only")
    ap.add_argument("--fake", action="store_true", help="B=128, N=4096 static under fake tensors (CPU)")
    args = ap.parse_args()
    if args.eager:
        sys.exit(0 if eager(args.spelling) else 1)
    if args.check:
        modes = (False,) if args.static_only else (False, True)
        sys.exit(0 if check(args.spelling, modes, VARIED if args.varied else None) else 1)
    if args.fake:
        return fake(args.spelling)
    ap.print_help()


if __name__ == "__main__":
    main()
