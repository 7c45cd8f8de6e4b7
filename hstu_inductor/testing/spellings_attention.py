"""Spellings of jagged silu attention that the "attention" rewriter recognises: the pattern table.

Every function here is plain PyTorch, written the way a user might write HSTU attention. They are
both the documentation of what is matched and the test corpus (``tests/patterns``). The matcher
does **not** enumerate them: it proves the semantics of whatever subgraph it finds (see
``hstu_inductor/patterns/attention.py`` and its stages), so mixes of these spellings (any pad x any product x any mask) match too.

Signature of every spelling: ``fn(q, k, v, offsets, num_targets=None, attn_scale=None)`` with
``q, k: [L, H, D]`` (or ``[L, H*D]`` where noted), ``v: [L, H, Dv]``, returning ``[L, H, Dv]``
(or ``[L, H*Dv]``). ``N`` (max_seq_len) and ``ALPHA`` are module constants, as they are in models.
Two other input forms (last column of ``SPELLINGS``): ``"lengths"``, the same with per-sequence
``lengths [B]`` instead of ``offsets``; ``"uvqk"``, ``fn(uvqk, offsets, num_targets=None,
attn_scale=None)`` with one projection output ``uvqk [L, 2*H*(Dv+Dq)]`` (u, v, q, k in this order).

``NEAR_MISSES`` lists functions that look like HSTU attention but are not (or are not provably);
the rewriter must leave them alone and report why.

``DELTA_SPELLINGS`` / ``DELTA_NEAR_MISSES`` (at the end) are the same for cached (delta)
attention, rewritten to ``hstu.delta_attention`` in inference only (``attn_delta.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference import delta_hstu_mha, hstu_mha

N = 8
ALPHA = 0.5
CONTEXT = 2
WINDOW = 3


# ------------------------------------------------------------------------------------------------
# Shared pieces (plain torch; users write these in countless ways)

def _row_ids(offsets, total):
    """Sequence index and position of every jagged row (searchsorted spelling)."""
    rows = torch.arange(total, device=offsets.device)
    seq = torch.searchsorted(offsets, rows, right=True) - 1
    return seq, rows - offsets[seq]


def _row_ids_repeat(offsets, total):
    """Sequence index and position of every jagged row (repeat_interleave spelling)."""
    lengths = offsets[1:] - offsets[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                  output_size=total)
    return seq, torch.arange(total, device=offsets.device) - offsets[:-1][seq]


def _pad_index_put(x, offsets):
    """[L, ...] -> [B, N, ...] with index_put into zeros."""
    B = offsets.numel() - 1
    seq, pos = _row_ids_repeat(offsets, x.shape[0])
    out = x.new_zeros((B, N, *x.shape[1:]))
    return torch.index_put(out, (seq, pos), x)


def _pad_index_copy(x, offsets):
    """[L, F] -> [B*N, F] with index_copy of flat rows b*N + p."""
    B = offsets.numel() - 1
    seq, pos = _row_ids(offsets, x.shape[0])
    return x.new_zeros((B * N, x.shape[1])).index_copy(0, seq * N + pos, x)


def _pad_scatter(x, offsets):
    """[L, F] -> [B*N, F] with scatter on an expanded row index."""
    B = offsets.numel() - 1
    seq, pos = _row_ids_repeat(offsets, x.shape[0])
    idx = (seq * N + pos).unsqueeze(1).expand(-1, x.shape[1])
    return torch.zeros(B * N, x.shape[1], dtype=x.dtype, device=x.device).scatter(0, idx, x)


def _pad_gather_cumsum(x, offsets):
    """[L, H, D] -> [B, N, H, D]: gather rows offsets[b] + p (cumsum-free arange trick) and zero
    the padding with a multiply."""
    lengths = offsets[1:] - offsets[:-1]
    pos = torch.arange(N, device=x.device)
    valid = pos[None, :] < lengths[:, None]
    rows = (offsets[:-1, None] + pos[None, :]).clamp(max=x.shape[0] - 1)
    out = x.index_select(0, rows.reshape(-1)).view(lengths.numel(), N, *x.shape[1:])
    return out * valid.view(*valid.shape, *([1] * (x.dim() - 1))).to(x.dtype)


def _unpad_index(dense, offsets, total):
    """[B, N, ...] -> [L, ...] with advanced indexing."""
    seq, pos = _row_ids(offsets, total)
    return dense[seq, pos]


def _unpad_index_select(dense_flat, offsets, total):
    """[B*N, ...] -> [L, ...] with index_select of flat rows."""
    seq, pos = _row_ids_repeat(offsets, total)
    return dense_flat.index_select(0, seq * N + pos)


def _causal_mask_arange(offsets):
    """[B, N, N] bool: j <= i and both in the sequence (arange comparisons)."""
    lengths = offsets[1:] - offsets[:-1]
    i = torch.arange(N, device=offsets.device)
    ok = (i[:, None] >= i[None, :])[None] & (i[None, None, :] < lengths[:, None, None])
    return ok & (i[None, :, None] < lengths[:, None, None])


def _ids(offsets, num_targets=None, contextual=0):
    """Position ids per HSTU: contextual prefix collapses to 0, targets share the last id."""
    lengths = offsets[1:] - offsets[:-1]
    p = torch.arange(N, device=offsets.device)[None, :]
    if contextual > 0:
        ids = torch.clamp(p - contextual + 1, min=0)
        end = lengths[:, None] - contextual + 1
    else:
        ids, end = p.expand(lengths.numel(), N), lengths[:, None]
    if num_targets is not None:
        end = end - num_targets[:, None]
        ids = torch.minimum(ids, end)
    return ids, end


# ------------------------------------------------------------------------------------------------
# Spellings (the table)

def reference_spelling(q, k, v, offsets, num_targets=None, attn_scale=None):
    """The project's own eager reference (``hstu_inductor.reference.hstu_mha``), as HSTUModel uses it:
    cat+index pad, einsum products, ``silu(alpha*s) / N``, id mask applied by a float multiply."""
    return hstu_mha(N, ALPHA, q, k, v, offsets, num_targets=num_targets, attn_scale=attn_scale)


def einsum_index_put_tril(q, k, v, offsets, num_targets=None, attn_scale=None):
    """index_put pad (repeat_interleave row ids), einsum, F.silu, ``torch.tril`` on the scores,
    ``* (1/N)``; no in-sequence mask (padding rows are zero), advanced-index unpad."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    s = torch.einsum("bnhd,bmhd->bhnm", qp, kp)
    p = torch.tril(F.silu(ALPHA * s)) * (1.0 / N)
    out = torch.einsum("bhnm,bmhd->bnhd", p, vp)
    return _unpad_index(out, offsets, q.shape[0])


def matmul_index_copy_where(q, k, v, offsets, num_targets=None, attn_scale=None):
    """2-D ``[L, H*D]`` inputs, index_copy pad to ``[B*N, H*D]``, heads moved with view+transpose,
    ``@`` products, ``x * sigmoid(x)`` with alpha folded into q, arange mask applied by ``where``,
    ``/ N``, index_select unpad on flat rows."""
    L = q.shape[0]
    B = offsets.numel() - 1
    H = 2
    q2 = q.reshape(L, -1) * ALPHA
    qp, kp, vp = (_pad_index_copy(t, offsets).view(B, N, H, -1).transpose(1, 2)
                  for t in (q2, k.reshape(L, -1), v.reshape(L, -1)))
    s = qp @ kp.transpose(-1, -2)
    p = torch.where(_causal_mask_arange(offsets)[:, None], s * torch.sigmoid(s), 0.0) / N
    out = (p @ vp).transpose(1, 2).reshape(B * N, -1)
    return _unpad_index_select(out, offsets, L).view(L, H, -1)


def bmm_scatter_masked_fill(q, k, v, offsets, num_targets=None, attn_scale=None):
    """scatter pad, heads-first ``[B*H, N, D]`` with permute+reshape, ``torch.bmm``, silu,
    ``masked_fill(~mask, 0)``, scalar ``attn_scale`` tensor, gather unpad."""
    L, H, D = q.shape
    B = offsets.numel() - 1

    def heads_first(t):
        return _pad_scatter(t.reshape(L, -1), offsets).view(B, N, H, -1).permute(0, 2, 1, 3).reshape(B * H, N, -1)

    s = torch.bmm(heads_first(q), heads_first(k).transpose(1, 2))
    mask = _causal_mask_arange(offsets).repeat_interleave(H, dim=0)
    p = F.silu(s * ALPHA).masked_fill(~mask, 0.0) * attn_scale
    out = torch.bmm(p, heads_first(v)).view(B, H, N, -1).permute(0, 2, 1, 3)
    seq, pos = _row_ids(offsets, L)
    return out[seq, pos]


def gather_pad_targets(q, k, v, offsets, num_targets=None, attn_scale=None):
    """index_select+multiply pad, matmul with ``[B, H, N, D]`` heads, id clamping for num_targets
    (targets see history and themselves: ``eye | dist > 0``), mask as float multiply, ``/ N``."""
    L = q.shape[0]
    qp, kp, vp = (_pad_gather_cumsum(t, offsets).transpose(1, 2) for t in (q, k, v))
    ids, _ = _ids(offsets, num_targets)
    lengths = offsets[1:] - offsets[:-1]
    pos = torch.arange(N, device=q.device)
    dist = ids[:, :, None] - ids[:, None, :]
    eye = torch.eye(N, dtype=torch.bool, device=q.device)[None]
    in_seq = (pos[None, :, None] < lengths[:, None, None]) & (pos[None, None, :] < lengths[:, None, None])
    mask = (eye | (dist > 0)) & in_seq
    p = F.silu(torch.matmul(qp, kp.transpose(2, 3)) * ALPHA) * mask[:, None].float() / N
    out = torch.matmul(p, vp).transpose(1, 2)
    return _unpad_index(out, offsets, L)


def contextual_window(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Contextual prefix (ids clamped), targets, ``max_attn_len`` window, per-row ``attn_scale``
    (padded with index_put), reference-style einsum."""
    L = q.shape[0]
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    ids, end = _ids(offsets, num_targets, CONTEXT)
    pos = torch.arange(N, device=q.device)
    d = ids[:, :, None] - ids[:, None, :]
    lengths = offsets[1:] - offsets[:-1]
    valid = ((pos[:, None] == pos[None, :])[None] | (d > 0)) & (d <= WINDOW)
    valid = valid | ((ids[:, :, None] == 0) & (ids[:, None, :] < end[:, :, None]))
    valid = valid & (pos[None, :, None] < lengths[:, None, None]) & (pos[None, None, :] < lengths[:, None, None])
    scale = _pad_index_put(attn_scale, offsets)  # [B, N]
    s = torch.einsum("bihd,bjhd->bhij", qp, kp)
    p = F.silu(ALPHA * s) * scale[:, None, :, None] * valid[:, None]
    out = torch.einsum("bhij,bjhd->bihd", p, vp)
    return _unpad_index(out, offsets, L)


def fbgemm_dense(q, k, v, offsets, num_targets=None, attn_scale=None):
    """fbgemm ``jagged_to_padded_dense`` / ``dense_to_jagged`` on ``[L, H*D]``, einsum, tril mask
    built with ``torch.ones(...).tril()`` (only when fbgemm_gpu imports)."""
    L, H, D = q.shape
    B = offsets.numel() - 1
    qp, kp, vp = (torch.ops.fbgemm.jagged_to_padded_dense(t.reshape(L, -1), [offsets], [N], 0.0).view(B, N, H, -1)
                  for t in (q, k, v))
    s = torch.einsum("bnhd,bmhd->bhnm", qp, kp)
    tril = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    p = F.silu(s * ALPHA) * tril / N
    out = torch.einsum("bhnm,bmhd->bnhd", p, vp).reshape(B, N, -1)
    return torch.ops.fbgemm.dense_to_jagged(out, [offsets], L)[0].view(L, H, -1)


def aten_jagged_dense(q, k, v, offsets, num_targets=None, attn_scale=None):
    """``aten._jagged_to_padded_dense_forward`` / ``_padded_dense_to_jagged_forward`` (no autograd
    formula: inference only), bmm on ``[B*H, N, D]``."""
    L, H, D = q.shape
    B = offsets.numel() - 1

    def pad(t):
        d = torch.ops.aten._jagged_to_padded_dense_forward(t.reshape(L, -1), [offsets], [N], 0.0)
        return d.view(B, N, H, -1).transpose(1, 2).reshape(B * H, N, -1)

    s = torch.bmm(pad(q), pad(k).transpose(1, 2))
    p = F.silu(ALPHA * s) * _causal_mask_arange(offsets).repeat_interleave(H, 0) / N
    out = torch.bmm(p, pad(v)).view(B, H, N, -1).transpose(1, 2).reshape(B, N, -1)
    return torch.ops.aten._padded_dense_to_jagged_forward(out, [offsets], L).view(L, H, -1)


def nested_padded(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Nested jagged tensors: ``nested_tensor_from_jagged(...).to_padded_tensor(0.0)`` pads,
    einsum + tril mask, advanced-index unpad."""
    L = q.shape[0]
    B = offsets.numel() - 1

    def pad(t):
        nt = torch.nested.nested_tensor_from_jagged(t, offsets)
        return nt.to_padded_tensor(0.0, output_size=(B, N, *t.shape[1:]))

    s = torch.einsum("bnhd,bmhd->bhnm", pad(q), pad(k))
    mask = torch.tril(torch.ones(N, N, device=q.device))
    p = F.silu(ALPHA * s) * mask / N
    out = torch.einsum("bhnm,bmhd->bnhd", p, pad(v))
    return _unpad_index(out, offsets, L)


def lengths_cat_cumsum(q, k, v, lengths, num_targets=None, attn_scale=None):
    """Per-sequence ``lengths`` input; offsets computed as ``cat([0], lengths.cumsum(0))``; index_put
    pads, einsum, ``tril``, advanced-index unpad."""
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    p = torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp))) / N
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])


def lengths_pad_cumsum_mask(q, k, v, lengths, num_targets=None, attn_scale=None):
    """``lengths`` input; rows located with ``F.pad(lengths.cumsum(0), (1, 0))`` (scatter pad on flat
    rows, index_select unpad) while the padding mask uses ``arange(N) < lengths[:, None]``
    directly; ``bmm`` heads-first, ``where`` mask, targets clamp the ids."""
    L, H, _ = q.shape
    B = lengths.numel()
    offsets = F.pad(lengths.cumsum(0), (1, 0))

    def heads_first(t):
        return _pad_scatter(t.reshape(L, -1), offsets).view(B, N, H, -1).transpose(1, 2).reshape(B * H, N, -1)

    pos = torch.arange(N, device=q.device)
    valid = pos[None, :] < lengths[:, None]  # [B, N]
    ids = torch.minimum(pos[None, :], (lengths - num_targets)[:, None])
    mask = ((pos[:, None] == pos[None, :])[None] | (ids[:, :, None] > ids[:, None, :]))
    mask = mask & valid[:, :, None] & valid[:, None, :]
    s = torch.bmm(heads_first(q), heads_first(k).transpose(1, 2))
    p = torch.where(mask.repeat_interleave(H, 0), F.silu(ALPHA * s), 0.0) / N
    out = torch.bmm(p, heads_first(v)).view(B, H, N, -1).transpose(1, 2).reshape(B * N, -1)
    return _unpad_index_select(out, offsets, L).view(L, H, -1)


def lengths_fbgemm_cumsum(q, k, v, lengths, num_targets=None, attn_scale=None):
    """``lengths`` input; offsets from ``fbgemm.asynchronous_complete_cumsum``; fbgemm
    ``jagged_to_padded_dense`` / ``dense_to_jagged`` (only when fbgemm_gpu imports)."""
    L, H, _ = q.shape
    B = lengths.numel()
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    qp, kp, vp = (torch.ops.fbgemm.jagged_to_padded_dense(t.reshape(L, -1), [offsets], [N], 0.0).view(B, N, H, -1)
                  for t in (q, k, v))
    p = F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) * torch.ones(N, N, device=q.device).tril() / N
    out = torch.einsum("bhnm,bmhd->bnhd", p, vp).reshape(B, N, -1)
    return torch.ops.fbgemm.dense_to_jagged(out, [offsets], L)[0].view(L, H, -1)


def _uvqk_sizes(uvqk, heads=2):
    """``[H*Dv, H*Dv, H*Dq, H*Dq]`` of a uvqk projection with Dq == Dv (as in the tests)."""
    d = uvqk.shape[-1] // 4
    return [d, d, d, d], heads


def uvqk_split_padded(uvqk, offsets, num_targets=None, attn_scale=None):
    """One padded projection output: ``uvqk [L, 2H(Dv+Dq)]`` padded once (index_put) to
    ``[B, N, 2H(Dv+Dq)]``, then ``torch.split`` into u, v, q, k (u unused here), heads by ``view``,
    einsum, targets-free ``tril``; unpad of the dense output."""
    sizes, H = _uvqk_sizes(uvqk)
    padded = _pad_index_put(uvqk, offsets)
    B = padded.shape[0]
    _, v, q, k = (t.view(B, N, H, -1) for t in torch.split(padded, sizes, dim=-1))
    p = torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", q, k))) * (1.0 / N)
    out = torch.einsum("bhnm,bmhd->bnhd", p, v)
    return _unpad_index(out, offsets, uvqk.shape[0])


def uvqk_slices_matmul(uvqk, offsets, num_targets=None, attn_scale=None):
    """``uvqk`` padded to flat rows ``[B*N, F]`` (index_copy), viewed ``[B, N, 4, H, D]``, q/k/v
    taken with ``select`` on the chunk dim and a ``[..., a:b]`` slice, heads-first ``matmul``,
    arange mask, ``/ N``."""
    sizes, H = _uvqk_sizes(uvqk)
    B = offsets.numel() - 1
    padded = _pad_index_copy(uvqk, offsets).view(B, N, 4, H, -1)
    q = padded[:, :, 2].transpose(1, 2)
    k = padded[:, :, 3].transpose(1, 2)
    v = padded.view(B, N, -1)[:, :, sizes[0]:sizes[0] + sizes[1]].view(B, N, H, -1).transpose(1, 2)
    p = F.silu(torch.matmul(q, k.transpose(-1, -2)) * ALPHA) * _causal_mask_arange(offsets)[:, None] / N
    out = torch.matmul(p, v).transpose(1, 2)
    return _unpad_index(out, offsets, uvqk.shape[0])


def row_scale_after_pv(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Per-row ``attn_scale [L]`` applied after ``P @ V`` on the dense output (padded with index_put,
    ``[B, N, 1, 1]``), ``tril`` mask, einsum: equal to scaling every score row."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    p = torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)))
    out = torch.einsum("bhnm,bmhd->bnhd", p, vp) * _pad_index_put(attn_scale, offsets)[:, :, None, None]
    return _unpad_index(out, offsets, q.shape[0])


def inv_n_after_pv(q, k, v, offsets, num_targets=None, attn_scale=None):
    """``1/N`` applied to the dense output after ``P @ V`` (``out / N``) and a scalar ``attn_scale``
    multiplied into the unpadded output; bmm heads-first, masked_fill."""
    L, H, _ = q.shape
    B = offsets.numel() - 1

    def heads_first(t):
        return _pad_index_put(t, offsets).transpose(1, 2).reshape(B * H, N, -1)

    s = torch.bmm(heads_first(q), heads_first(k).transpose(1, 2))
    p = F.silu(ALPHA * s).masked_fill(~_causal_mask_arange(offsets).repeat_interleave(H, 0), 0.0)
    out = (torch.bmm(p, heads_first(v)) / N).view(B, H, N, -1).transpose(1, 2)
    return _unpad_index(out, offsets, L) * attn_scale


def nested_masked_select(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Unpad with ``torch.nested.masked_select(dense, valid).values()`` (padded dense + validity mask
    -> nested jagged tensor -> values). Dynamo does not trace ``torch.nested.masked_select`` (graph
    break): the compiled graph ends at the dense ``[B, N, H*D]`` output, which is rewritten as
    ``pad(hstu.attention(...))`` (its padding rows are proven zero); the unpad runs eagerly."""
    L, H, _ = q.shape
    B = offsets.numel() - 1
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    p = torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp))) / N
    out = torch.einsum("bhnm,bmhd->bnhd", p, vp).reshape(B, N, -1)
    lengths = offsets[1:] - offsets[:-1]
    valid = torch.arange(N, device=q.device)[None, :, None] < lengths[:, None, None]
    return torch.nested.masked_select(out, valid.expand_as(out)).values().view(L, H, -1)


def non_causal(q, k, v, offsets, num_targets=None, attn_scale=None):
    """No mask at all: every in-sequence pair attends (``causal=False``, modelled by the op)."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    p = F.silu(torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA) / N
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])


#: name -> (function, needs num_targets, needs attn_scale ("scalar" / "row" / None), needs fbgemm,
#:          differentiable, inputs ("qkv" / "lengths" / "uvqk", see the module docstring))
def zero_buffers_borrowed(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Zero buffers made from *another* tensor: q padded into ``k.new_zeros(...)``, k into
    ``torch.zeros_like(q_padded)``, v into ``v.new_full(..., 0.0)``; index_copy on flat rows,
    heads-first ``matmul``, ``tril``, ``/ N``. The buffers read only metadata (made explicit
    ``zeros`` by ``patterns.buffers`` before the proof)."""
    L, H, D = q.shape
    B = offsets.numel() - 1
    seq, pos = _row_ids(offsets, L)
    rows = seq * N + pos
    qp = k.new_zeros((B * N, H * D)).index_copy(0, rows, q.reshape(L, -1))
    kp = torch.zeros_like(qp).index_copy(0, rows, k.reshape(L, -1))
    vp = v.new_full((B * N, v.shape[1] * v.shape[2]), 0.0).index_copy(0, rows, v.reshape(L, -1))
    qp, kp, vp = (t.view(B, N, H, -1).transpose(1, 2) for t in (qp, kp, vp))
    p = torch.tril(F.silu(ALPHA * (qp @ kp.transpose(-1, -2)))) / N
    out = (p @ vp).transpose(1, 2)
    return _unpad_index(out, offsets, L)


def zero_buffers_default_dtype(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Zero buffers with the default dtype (no ``dtype=``): ``torch.zeros(B, N, H, D)`` for q and k
    (index_put), ``torch.empty(B*N, H*Dv).zero_()`` for v (index_copy); einsum, arange mask."""
    L, H, D = q.shape
    B = offsets.numel() - 1
    seq, pos = _row_ids_repeat(offsets, L)
    qp = torch.zeros(B, N, H, D, device=q.device).index_put((seq, pos), q)
    kp = torch.zeros(B, N, H, D, device=q.device).index_put((seq, pos), k)
    vp = torch.empty(B * N, H * v.shape[2], device=q.device).zero_().index_copy(0, seq * N + pos, v.reshape(L, -1))
    s = torch.einsum("bnhd,bmhd->bhnm", qp, kp)
    p = F.silu(ALPHA * s) * _causal_mask_arange(offsets)[:, None] / N
    out = torch.einsum("bhnm,bmhd->bnhd", p, vp.view(B, N, H, -1))
    return _unpad_index(out, offsets, L)


def row_scale_b1n1(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Per-row ``attn_scale [L]`` padded (``empty(...).fill_(0)`` + index_put, default dtype) to
    ``[B, 1, N, 1]`` and multiplied after silu, before ``P @ V`` (generative-recommenders' layout);
    mask from ids (targets) applied after the scale."""
    L = q.shape[0]
    B = offsets.numel() - 1
    seq, pos = _row_ids_repeat(offsets, L)
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    scale = torch.empty(B, N, device=q.device).fill_(0.0).index_put((seq, pos), attn_scale)
    ids, _ = _ids(offsets, num_targets)
    d = ids[:, :, None] - ids[:, None, :]
    eye = torch.eye(N, dtype=torch.bool, device=q.device)[None]
    s = F.silu(torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA) * scale[:, None, :, None]
    p = s * (eye | (d > 0))[:, None]
    out = torch.einsum("bhnm,bmhd->bnhd", p, vp)
    return _unpad_index(out, offsets, L)


SPELLINGS = {
    "reference": (reference_spelling, True, None, False, True, "qkv"),
    "einsum_index_put_tril": (einsum_index_put_tril, False, None, False, True, "qkv"),
    "matmul_index_copy_where": (matmul_index_copy_where, False, None, False, True, "qkv"),
    "bmm_scatter_masked_fill": (bmm_scatter_masked_fill, False, "scalar", False, True, "qkv"),
    "gather_pad_targets": (gather_pad_targets, True, None, False, True, "qkv"),
    "contextual_window": (contextual_window, True, "row", False, True, "qkv"),
    "fbgemm_dense": (fbgemm_dense, False, None, True, True, "qkv"),
    "aten_jagged_dense": (aten_jagged_dense, False, None, False, False, "qkv"),
    "nested_padded": (nested_padded, False, None, False, True, "qkv"),
    "lengths_cat_cumsum": (lengths_cat_cumsum, False, None, False, True, "lengths"),
    "lengths_pad_cumsum_mask": (lengths_pad_cumsum_mask, True, None, False, True, "lengths"),
    "lengths_fbgemm_cumsum": (lengths_fbgemm_cumsum, False, None, True, True, "lengths"),
    "uvqk_split_padded": (uvqk_split_padded, False, None, False, True, "uvqk"),
    "uvqk_slices_matmul": (uvqk_slices_matmul, False, None, False, True, "uvqk"),
    "row_scale_after_pv": (row_scale_after_pv, False, "row", False, True, "qkv"),
    "inv_n_after_pv": (inv_n_after_pv, False, "scalar", False, True, "qkv"),
    "nested_masked_select": (nested_masked_select, False, None, False, True, "qkv"),
    "non_causal": (non_causal, False, None, False, True, "qkv"),
    "zero_buffers_borrowed": (zero_buffers_borrowed, False, None, False, True, "qkv"),
    "zero_buffers_default_dtype": (zero_buffers_default_dtype, False, None, False, True, "qkv"),
    "row_scale_b1n1": (row_scale_b1n1, True, "row", False, True, "qkv"),
}


# ------------------------------------------------------------------------------------------------
# Near misses: must NOT be rewritten

def softmax_attention(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Softmax attention over padded sequences (masked with -inf): not HSTU."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    s = torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA
    s = s.masked_fill(~_causal_mask_arange(offsets)[:, None], -1e9)
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", torch.softmax(s, -1), vp), offsets, q.shape[0])


def anti_causal(q, k, v, offsets, num_targets=None, attn_scale=None):
    """``triu`` instead of ``tril``: rows attend to the future."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    p = torch.triu(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp))) / N
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])


def leaky_causal(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Claimed causal, but ``tril(diagonal=1)`` lets every row see one future row."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    p = torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)), diagonal=1) / N
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])


def data_mask(q, k, v, offsets, num_targets=None, attn_scale=None, user_mask=None):
    """The mask is a user tensor ([B, N, N] bool input): data the op does not model."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    p = F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) * user_mask[:, None] / N
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])


def length_normalised(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Scores divided by each sequence's actual length (not by the constant N, not by attn_scale)."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(q.dtype)
    p = torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp))) / lengths[:, None, None, None]
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])


def dropout_weights(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Dropout on the attention weights (training): not modelled by hstu.attention."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    p = F.dropout(torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp))) / N, p=0.5, training=True)
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])


def scores_returned(q, k, v, offsets, num_targets=None, attn_scale=None):
    """The score matrix is also returned: an intermediate with an extra user."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    s = torch.einsum("bnhd,bmhd->bhnm", qp, kp)
    p = torch.tril(F.silu(ALPHA * s)) / N
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0]), s


def lengths_inconsistent(q, k, v, lengths, num_targets=None, attn_scale=None):
    """``lengths`` input: rows located with offsets from ``lengths.cumsum``, but the padding mask
    reads another sequence's length (``lengths.flip(0)``)."""
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    pos = torch.arange(N, device=q.device)
    valid = pos[None, :] < lengths.flip(0)[:, None]
    mask = (pos[:, None] >= pos[None, :])[None] & valid[:, :, None] & valid[:, None, :]
    p = F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) * mask[:, None] / N
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])


def row_scale_shifted(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Like ``row_scale_after_pv`` but the padded scale is shifted by one position (``roll``): row
    ``i`` is scaled by row ``i-1``'s attn_scale, not a per-row scale of the op."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    p = torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)))
    scale = _pad_index_put(attn_scale, offsets).roll(1, dims=1)
    out = torch.einsum("bhnm,bmhd->bnhd", p, vp) * scale[:, :, None, None]
    return _unpad_index(out, offsets, q.shape[0])


def uvqk_rows_sliced(uvqk, offsets, num_targets=None, attn_scale=None):
    """Padded uvqk sliced along the *rows* (``padded[:, 1:]``) before the split: query/key row
    ``n`` is sequence position ``n + 1``, not the q/k/v layout."""
    sizes, H = _uvqk_sizes(uvqk)
    padded = _pad_index_put(uvqk, offsets)
    B = padded.shape[0]
    _, v, q, k = (t.reshape(B, N - 1, H, -1) for t in torch.split(padded[:, 1:], sizes, dim=-1))
    p = torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", q, k))) / N
    out = F.pad(torch.einsum("bhnm,bmhd->bnhd", p, v), (0, 0, 0, 0, 0, 1))
    return _unpad_index(out, offsets, uvqk.shape[0])


def dense_padding_rows_filled(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Returns the dense ``[B, N, H, D]`` output (no unpad) whose padding query rows attend to the
    whole sequence (``masked_fill`` of the weights): in-sequence rows are HSTU, padding rows are not
    zero, so ``pad(hstu.attention)`` would differ."""
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    lengths = offsets[1:] - offsets[:-1]
    pad_row = torch.arange(N, device=q.device)[None, :] >= lengths[:, None]  # [B, N]
    p = torch.tril(F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp))) / N
    p = p.masked_fill(pad_row[:, None, :, None], 1.0)
    return torch.einsum("bhnm,bmhd->bnhd", p, vp)


def nested_padded_filled(q, k, v, offsets, num_targets=None, attn_scale=None):
    """``nested_padded`` without a mask and with ``to_padded_tensor(1.0, ...)``: the padding key
    rows (1.0, not 0) reach the in-sequence outputs, so this is not (non-causal) HSTU."""
    B = offsets.numel() - 1
    qp, kp, vp = (torch.nested.nested_tensor_from_jagged(t, offsets).to_padded_tensor(
        1.0, output_size=(B, N, *t.shape[1:])) for t in (q, k, v))
    p = F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) / N
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, q.shape[0])


def zero_buffer_filled_one(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Twin of ``zero_buffers_default_dtype``: v's buffer is ``torch.empty(...).fill_(1.0)``, so
    padded value rows are 1, not 0 (a constant buffer, but not a zero pad)."""
    L, H, D = q.shape
    B = offsets.numel() - 1
    seq, pos = _row_ids_repeat(offsets, L)
    qp, kp = (torch.zeros(B, N, H, D, device=q.device).index_put((seq, pos), t) for t in (q, k))
    vp = torch.empty(B, N, H, v.shape[2], device=q.device).fill_(1.0).index_put((seq, pos), v)
    p = F.silu(ALPHA * torch.einsum("bnhd,bmhd->bhnm", qp, kp)) / N  # no mask: padding keys count
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", p, vp), offsets, L)


def zero_buffer_from_values(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Twin of ``zero_buffers_borrowed``: k's "zero" buffer is ``zeros_like(q_padded) + q_padded``,
    it reads q's values, so the k operand is q + k, not a pad of k."""
    L, H, D = q.shape
    B = offsets.numel() - 1
    seq, pos = _row_ids(offsets, L)
    rows = seq * N + pos
    qp = k.new_zeros((B * N, H * D)).index_copy(0, rows, q.reshape(L, -1))
    kp = (torch.zeros_like(qp) + qp).index_copy(0, rows, k.reshape(L, -1))
    vp = v.new_zeros((B * N, v.shape[1] * v.shape[2])).index_copy(0, rows, v.reshape(L, -1))
    qp, kp, vp = (t.view(B, N, H, -1).transpose(1, 2) for t in (qp, kp, vp))
    p = torch.tril(F.silu(ALPHA * (qp @ kp.transpose(-1, -2)))) / N
    return _unpad_index((p @ vp).transpose(1, 2), offsets, L)


def row_scale_on_keys(q, k, v, offsets, num_targets=None, attn_scale=None):
    """Twin of ``row_scale_b1n1``: the padded scale is broadcast as ``[B, 1, 1, N]``, scaling key
    columns instead of query rows."""
    L = q.shape[0]
    B = offsets.numel() - 1
    seq, pos = _row_ids_repeat(offsets, L)
    qp, kp, vp = (_pad_index_put(t, offsets) for t in (q, k, v))
    scale = torch.zeros(B, N, device=q.device).index_put((seq, pos), attn_scale)
    s = torch.tril(F.silu(torch.einsum("bnhd,bmhd->bhnm", qp, kp) * ALPHA)) * scale[:, None, None, :]
    return _unpad_index(torch.einsum("bhnm,bmhd->bnhd", s, vp), offsets, L)


#: name -> (function, expected substring of the near-miss reason)
NEAR_MISSES = {
    "softmax": (softmax_attention, "softmax"),
    "anti_causal": (anti_causal, "mask"),
    "leaky_causal": (leaky_causal, "mask"),
    "data_mask": (data_mask, "data we do not model"),
    "length_normalised": (length_normalised, "not scale * silu"),
    "dropout": (dropout_weights, "dropout"),
    "scores_returned": (scores_returned, "outside the attention"),
    "lengths_inconsistent": (lengths_inconsistent, "mask"),
    "row_scale_shifted": (row_scale_shifted, "does not scale each query row"),
    "uvqk_rows_sliced": (uvqk_rows_sliced, "along rows"),
    "dense_padding_rows_filled": (dense_padding_rows_filled, "padding rows are not zero"),
    "nested_padded_filled": (nested_padded_filled, "with zero padding"),
    "zero_buffer_filled_one": (zero_buffer_filled_one, "with zero padding"),
    "zero_buffer_from_values": (zero_buffer_from_values, "expected one jagged source"),
    "row_scale_on_keys": (row_scale_on_keys, "not scale * silu"),
}

#: inputs of the near misses that differ from ``(q, k, v, offsets)``: name -> (attn_scale, inputs)
NEAR_MISS_INPUTS = {
    "lengths_inconsistent": (None, "lengths"),
    "row_scale_shifted": ("row", "qkv"),
    "uvqk_rows_sliced": (None, "uvqk"),
    "row_scale_on_keys": ("row", "qkv"),
}


# ------------------------------------------------------------------------------------------------
# Cached (delta) attention: ``fn(delta_q, k, v, offsets, num_targets=None, attn_scale=None)`` with
# ``delta_q: [B*D, H, Dq]`` (the last D rows of every sequence, D = rows // B), jagged ``k, v``,
# returning ``[B*D, H, Dv]``. Rewritten to ``hstu.delta_attention`` in inference only.

def delta_reference(delta_q, k, v, offsets, num_targets=None, attn_scale=None):
    """The project's reference ``delta_hstu_mha`` (``examples/export_aoti.py``'s CachedAttention):
    cat+index pad of k/v, ``delta_q.reshape(B, D, H, Dq)``, einsum, id mask at query positions
    ``n_b - D + d`` applied by a float multiply, ``silu(alpha*s) * (1/N)``."""
    return delta_hstu_mha(N, ALPHA, delta_q, k, v, offsets, num_targets=num_targets, attn_scale=attn_scale)


def delta_reference_window(delta_q, k, v, offsets, num_targets=None, attn_scale=None):
    """``delta_hstu_mha`` with targets, a contextual prefix and a ``max_attn_len`` window."""
    return delta_hstu_mha(N, ALPHA, delta_q, k, v, offsets, num_targets=num_targets, attn_scale=attn_scale,
                          max_attn_len=WINDOW, contextual_seq_len=CONTEXT)


def _delta_rows_tril(offsets, D, first=False):
    """``[B, D, N]`` bool: rows of ``tril(ones(N, N))`` selected by advanced indexing at the
    query positions ``n_b - D + d`` (``first=True``: rows ``0..D-1``, a near miss)."""
    lengths = offsets[1:] - offsets[:-1]
    d = torch.arange(D, device=offsets.device)
    rows = d[None, :].expand(lengths.numel(), D) if first else lengths[:, None] - D + d[None, :]
    tril = torch.ones(N, N, dtype=torch.bool, device=offsets.device).tril()
    return tril[rows]


def delta_einsum_tril_rows(delta_q, k, v, offsets, num_targets=None, attn_scale=None):
    """index_put pad of k/v, ``delta_q.view(B, D, H, Dq)``, einsum ``bdhc,bnhc->bhdn``, ``F.silu``,
    mask = the rows ``n_b-D..n_b-1`` of ``tril(ones(N, N))`` picked by indexing, ``* (1/N)``,
    output ``einsum -> [B, D, H, Dv]`` reshaped to ``[B*D, H, Dv]``."""
    B = offsets.numel() - 1
    D = delta_q.shape[0] // B
    kp, vp = _pad_index_put(k, offsets), _pad_index_put(v, offsets)
    s = torch.einsum("bdhc,bnhc->bhdn", delta_q.view(B, D, *delta_q.shape[1:]), kp)
    p = F.silu(ALPHA * s) * _delta_rows_tril(offsets, D)[:, None] * (1.0 / N)
    out = torch.einsum("bhdn,bnhe->bdhe", p, vp)
    return out.reshape(B * D, *out.shape[2:])


def delta_bmm_targets_scale(delta_q, k, v, offsets, num_targets=None, attn_scale=None):
    """scatter / index_copy pads on ``[L, H*D]``, heads-first ``bmm`` on ``[B*H, D|N, d]``, alpha
    folded into ``delta_q``, ids clamped for ``num_targets`` gathered at the delta rows
    (``eye | dist > 0``), ``masked_fill``, per-delta-row ``attn_scale [B*D]``."""
    R, H, Dq = delta_q.shape
    B = offsets.numel() - 1
    D = R // B
    L = k.shape[0]

    def heads_first(t, rows):  # [B, rows, H, d] -> [B*H, rows, d]
        return t.permute(0, 2, 1, 3).reshape(B * H, rows, -1)

    qh = heads_first((delta_q * ALPHA).view(B, D, H, Dq), D)
    kh = heads_first(_pad_scatter(k.reshape(L, -1), offsets).view(B, N, H, -1), N)
    vh = heads_first(_pad_index_copy(v.reshape(L, -1), offsets).view(B, N, H, -1), N)
    s = torch.bmm(qh, kh.transpose(1, 2))  # [B*H, D, N]
    ids, _ = _ids(offsets, num_targets)  # [B, N]
    lengths = offsets[1:] - offsets[:-1]
    qpos = lengths[:, None] - D + torch.arange(D, device=offsets.device)[None, :]  # [B, D]
    dist = torch.gather(ids, 1, qpos)[:, :, None] - ids[:, None, :]  # [B, D, N]
    pos = torch.arange(N, device=offsets.device)
    mask = ((qpos[:, :, None] == pos[None, None, :]) | (dist > 0)) & (pos[None, None, :] < lengths[:, None, None])
    scale = attn_scale.view(B, 1, D, 1).expand(B, H, D, 1).reshape(B * H, D, 1)
    p = F.silu(s).masked_fill(~mask.repeat_interleave(H, dim=0), 0.0) * scale
    out = torch.bmm(p, vh).view(B, H, D, -1).permute(0, 2, 1, 3)  # [B, D, H, Dv]
    return out.reshape(B * D, H, -1)


#: name -> (function, needs num_targets, attn_scale ("scalar" / "row" / None), max_attn_len, contextual)
DELTA_SPELLINGS = {
    "delta_reference": (delta_reference, False, None, 0, 0),
    "delta_reference_window": (delta_reference_window, True, "scalar", WINDOW, CONTEXT),
    "delta_einsum_tril_rows": (delta_einsum_tril_rows, False, None, 0, 0),
    "delta_bmm_targets_scale": (delta_bmm_targets_scale, True, "row", 0, 0),
}


def delta_first_rows(delta_q, k, v, offsets, num_targets=None, attn_scale=None):
    """Looks like ``delta_einsum_tril_rows`` but the mask treats delta_q as the *first* D rows."""
    B = offsets.numel() - 1
    D = delta_q.shape[0] // B
    kp, vp = _pad_index_put(k, offsets), _pad_index_put(v, offsets)
    s = torch.einsum("bdhc,bnhc->bhdn", delta_q.view(B, D, *delta_q.shape[1:]), kp)
    p = F.silu(ALPHA * s) * _delta_rows_tril(offsets, D, first=True)[:, None] * (1.0 / N)
    return torch.einsum("bhdn,bnhe->bdhe", p, vp).reshape(B * D, *v.shape[1:])


def delta_no_mask(delta_q, k, v, offsets, num_targets=None, attn_scale=None):
    """No causal mask: delta rows see the whole sequence (the op is causal only)."""
    B = offsets.numel() - 1
    D = delta_q.shape[0] // B
    kp, vp = _pad_index_put(k, offsets), _pad_index_put(v, offsets)
    s = torch.einsum("bdhc,bnhc->bhdn", delta_q.view(B, D, *delta_q.shape[1:]), kp)
    return torch.einsum("bhdn,bnhe->bdhe", F.silu(ALPHA * s) / N, vp).reshape(B * D, *v.shape[1:])


def delta_softmax(delta_q, k, v, offsets, num_targets=None, attn_scale=None):
    """Softmax over the delta scores (masked with -1e9): not HSTU."""
    B = offsets.numel() - 1
    D = delta_q.shape[0] // B
    kp, vp = _pad_index_put(k, offsets), _pad_index_put(v, offsets)
    s = torch.einsum("bdhc,bnhc->bhdn", delta_q.view(B, D, *delta_q.shape[1:]), kp) * ALPHA
    s = s.masked_fill(~_delta_rows_tril(offsets, D)[:, None], -1e9)
    return torch.einsum("bhdn,bnhe->bdhe", torch.softmax(s, -1), vp).reshape(B * D, *v.shape[1:])


def delta_rows_d_major(delta_q, k, v, offsets, num_targets=None, attn_scale=None):
    """Reads delta_q as ``[D, B, H, Dq]`` (row-major in d, not in b): row ``r`` is not row
    ``r % D`` of sequence ``r // D``; the layout algebra rejects it."""
    B = offsets.numel() - 1
    D = delta_q.shape[0] // B
    kp, vp = _pad_index_put(k, offsets), _pad_index_put(v, offsets)
    qd = delta_q.view(D, B, *delta_q.shape[1:]).transpose(0, 1)
    p = F.silu(ALPHA * torch.einsum("bdhc,bnhc->bhdn", qd, kp)) * _delta_rows_tril(offsets, D)[:, None] / N
    return torch.einsum("bhdn,bnhe->bdhe", p, vp).reshape(B * D, *v.shape[1:])


#: name -> (function, expected substring of the near-miss reason)
DELTA_NEAR_MISSES = {
    "delta_first_rows": (delta_first_rows, "not rows n_b-D..n_b-1"),
    "delta_rows_d_major": (delta_rows_d_major, "not the delta rows"),
    "delta_no_mask": (delta_no_mask, "not rows n_b-D..n_b-1"),
    "delta_softmax": (delta_softmax, "softmax"),
}
