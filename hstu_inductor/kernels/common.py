"""Helpers every kernel module shares: interpreter detection, how a kernel is launched, output
allocation (with the NaN-poisoning test hook)."""
from __future__ import annotations

import os

import torch
import triton
from torch.library import wrap_triton

from .._compat import plain_eager

__all__ = ["interpret", "launcher", "launch", "new_tensor", "rowmajor", "address_source"]

# Test hook: fill freshly allocated kernel outputs with NaN so unwritten elements show up.
POISON_OUTPUTS = False


def interpret() -> bool:
    """True under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    try:
        return bool(triton.knobs.runtime.interpret)
    except Exception:  # pragma: no cover - older triton
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launcher(kernel, args):
    """``kernel`` itself for a plain eager call or under the interpreter (where wrap_triton is
    unsupported on 2.11); otherwise ``wrap_triton(kernel)``, so that inside the hstu triton_ops
    torch.compile / AOTInductor record the launch as a user-defined Triton kernel."""
    return kernel if interpret() or plain_eager(*args) else wrap_triton(kernel)


def address_source(t):
    """``t`` for a kernel that computes *store* addresses from values it loads from ``t`` (the jagged
    offsets: ``start = offsets[b]``). Traced (``wrap_triton``), a private copy: torch 2.11's TTIR
    mutation analysis follows a store's address back through the load into ``t`` and reports ``t`` as
    mutated. ``t`` is the graph's offsets input, so functionalization then writes it back (an input
    mutation), and Inductor skips CUDA graphs for the whole graph ("mutated inputs"; seen on the
    H100). The copy is B+1 integers; plain eager calls (no analysis) pass ``t`` itself."""
    if t is None or interpret() or plain_eager(t):
        return t
    return t.clone()


def launch(kernel, grid, *args, **kwargs):
    launcher(kernel, args)[grid](*args, **kwargs)


def new_tensor(shape, dtype, device):
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def rowmajor(t):
    """``t`` with a contiguous last dimension (the kernels index rows by stride, columns densely)."""
    return t if t.stride(-1) == 1 else t.contiguous()
