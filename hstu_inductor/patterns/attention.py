"""Rewriter "attention": find silu attention over jagged sequences, prove it, call hstu.attention.

This module only drives the stages; each lives in its own module, read in this order:

1. **Find** (``attn_find``). Anchor: a ``bmm`` ``O = X @ Y`` whose left operand ``X`` is reached
   from another ``bmm`` ``S = A @ K`` through shape-preserving ops only. ``A``, ``K`` and ``Y`` are
   followed back through layout ops, scalar multiplies and feature slices to the pads that feed
   them, and each pad to the jagged source it reads.
2. **Structure** (``attn_structure``, on the layout algebra of ``attn_layout``). Each pad is taken to
   be ``pad(src)`` viewed as its shape; the algebra says which logical element (sequence ``b``, row
   ``n``, feature digits of ``src``) sits at every position of every operand, so the contractions
   are checked exactly: ``S`` contracts q/k features within a head, its batch covers every
   sequence and head once, ``X`` and ``Y`` pair the same (sequence, head), ``O`` is read back row by
   row (row scales on the output: ``attn_rowscale``).
3. **Meaning** (``attn_prove`` -> ``attn_meaning``, on the value interpreter of ``core``). Every
   tensor of the candidate is read one element at symbolic coordinates: each pad must be
   ``jagged_to_padded``; the score chain ``S -> X`` (mask built from offsets / num_targets) must be
   ``mask * s * silu(alpha * S)`` with the mask *equal* to HSTU's (decided by z3 for every length,
   target count and position); the unpad must read row ``(b, n)`` for every jagged row. The cost
   does not depend on the sizes. Random probes cross-check where they are cheap.
4. **Rewrite** (``attn_emit``). The output node is replaced by ``hstu.attention`` on the jagged
   sources (re-laid-out as ``[L, H, D]`` with the proven head split); the dead subgraph is removed
   by DCE.

Cached (delta) attention candidates (dense queries for the last rows of each sequence, rectangular
scores) go through the same stages in ``attn_delta`` and become ``hstu.delta_attention``.
Anything unproven is reported as a near miss with the reason. Details: ``docs/patterns.md``.
"""
from __future__ import annotations

import logging
import time

import torch

from .. import config
from . import attn_delta, attn_packed, buffers, constants
from . import attn_layout as lay
from .attn_emit import describe, rewrite
from .attn_find import BMM, find_score_product, is_square
from .attn_prove import prove
from .prover import Decline
from .registry import register

log = logging.getLogger("hstu_inductor")


def _prove_full(gm, S, node):
    """Padded sequences first; scores over the jagged rows themselves (packed rows) when the operands
    are read from them. The reason reported is the padded reading's unless the packed one applies."""
    try:
        return prove(gm, S, node)
    except (Decline, lay.LayoutError) as padded:
        if not attn_packed.is_candidate(S):
            raise
        try:
            return attn_packed.prove_packed(gm, S, node)
        except (Decline, lay.LayoutError) as packed:
            raise Decline(f"{padded}; read as packed rows: {packed}") from None


@register("attention")
def rewrite_attention(gm: torch.fx.GraphModule, report) -> None:
    """Replace every proven jagged silu attention in ``gm`` by ``hstu.attention`` (in place)."""
    buffers.make_explicit(gm)  # new_zeros / zeros_like / empty().zero_() ... -> zeros(dtype=...)
    consumed = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not BMM or node in consumed or not node.users:
            continue
        try:
            S = find_score_product(node, square=False)
            delta = S is not None and attn_delta.is_candidate(S, node)
            if S is not None and not delta and not is_square(S):
                S = None
        except Exception:  # malformed metadata: not a candidate
            S = None
        if S is None or S in consumed:
            continue
        start = time.perf_counter()
        read = constants.used()
        try:
            plan = attn_delta.prove_delta(gm, S, node) if delta else _prove_full(gm, S, node)
        except (Decline, lay.LayoutError) as e:
            constants.restore(read)  # a declined candidate guards nothing
            report.near_misses.append(("attention", f"{node.name}: {e}"))
            continue
        except Exception as e:
            constants.restore(read)
            if config.strict:
                raise
            log.exception("hstu_inductor: attention prover failed on %s", node.name)
            report.near_misses.append(("attention", f"{node.name}: prover error {type(e).__name__}: {e}"))
            continue
        seconds = time.perf_counter() - start
        if delta:
            attn_delta.rewrite_delta(gm, plan)
        else:
            rewrite(gm, plan)
        consumed |= {node, S}
        report.counts["attention"] += 1
        what = attn_delta.describe_delta(plan) if delta else describe(plan)
        report.details.append(("attention", what))
        report.proofs.append(("attention", node.name, seconds))
        log.info("hstu_inductor: %s proven in %.2f s", node.name, seconds)
