"""Rewriters for the two dense STU blocks around attention: ``preprocess`` and ``output``.

    preprocess:  LayerNorm(x) -> projection -> u, v, q, k (four consecutive column blocks) -> silu(u)
                 => torch.ops.hstu.stu_preprocess[_save](x, ln_w, ln_b, eps, W, b, hv, hq, silu_all)
                    (u, v, q, k: views of its (act, uvqk) outputs holding the same columns)
    output:      x + projection( [cat(u, a,] Norm(a) * u [)] )  (either order, maybe in another shape)
                 => torch.ops.hstu.stu_output[_save](a, u, x, n_w, n_b, eps, groups, W, b, concat_ua)
(the ``_save`` variants, emitted with ``config.block_backward="save"``, compute the same outputs
and also return the intermediates their backward reads)
    after both:  act used only as the output op's u
                 => u = uvqk[:, :u_dim] with silu_u=True: the silu moves into the output kernels
                    (``fuse_u_silu``)

The matcher is hand-written over the ATen graph produced by ``_compat.trace_aten``, by meaning rather
than by spelling where the meaning can be read off the graph:

- ``stages.py``: the normalisation (``NORM_SPELLINGS``) and projection (``PROJECTION_SPELLINGS``) stages;
  spellings return ``None`` ("not this spelling") or raise ``Decline`` ("recognisably this block, but not
  provably the op's semantics"), which becomes a ``report.near_misses`` entry.
- ``columns.py``: which columns of the projection output each view holds, from its fake layout
  (``SPLIT_SPELLINGS``: the index-based views followed; ``ACTIVATION_SPELLINGS``: silu spelled).
- ``preprocess.py``: u, v, q, k are the views holding the column blocks ``[0, hv)``, ``[hv, 2hv)``,
  ``[2hv, 2hv+hq)``, ``[2hv+hq, D)``, however the projection was cut; silu(u) anywhere before u is used.
- ``output.py``: ``Norm(attn) * u`` in either order, maybe computed in another shape and viewed back
  (``Y_WRAPPER_SPELLINGS``: eval/training dropout between the product and the projection).
- ``fuse.py``: ``fuse_u_silu``.

Proof (docs/patterns.md, "Preprocess and output blocks"): every constant the op takes is read from the
matched nodes; the pieces by their layout; no write into memory the block reads between where the
user's code read it and where the op does (writes *from* a block tensor into another buffer are reads);
the matched norm/projection subgraph is run on fresh random inputs against the hstu op (``_probe``).
"""
from __future__ import annotations

from .columns import ACTIVATION_SPELLINGS, SPLIT_SPELLINGS
from .common import Decline, _probe
from .fuse import _op_arg, fuse_u_silu
from .output import Y_WRAPPER_SPELLINGS, rewrite_output
from .preprocess import rewrite_preprocess
from .stages import NORM_SPELLINGS, PROJECTION_SPELLINGS

__all__ = [
    "Decline", "rewrite_preprocess", "rewrite_output", "fuse_u_silu", "NORM_SPELLINGS", "PROJECTION_SPELLINGS",
    "SPLIT_SPELLINGS", "ACTIVATION_SPELLINGS", "Y_WRAPPER_SPELLINGS", "_probe", "_op_arg",
]
