"""fbgemm's two jagged ops in plain PyTorch, to run public code that calls them on a machine without fbgemm_gpu
(a GPU host without its CUDA wheel).

``torch.ops.fbgemm.jagged_to_padded_dense`` and ``dense_to_jagged`` (and the three ops they call) with fbgemm's
schemas, autograd and fake tensors: opaque custom ops, as fbgemm's are, so stock Inductor cannot fuse through
them either and the prover sees the op names the user's code calls. Each is a handful of PyTorch kernels where
fbgemm's is one; a benchmark that uses the shim says so in its output. :func:`install` does nothing when
fbgemm is loaded.
"""
from __future__ import annotations

import importlib

import torch

from .. import _compat

_LIB = None


def _rows(off: torch.Tensor, n: int, total: int):
    """Per jagged row: its flat index in the padded ``[B * n]`` rows, or ``B * n`` (a spare row) past ``n``."""
    rows = torch.arange(total, device=off.device)
    seq = torch.searchsorted(off[1:], rows, right=True)
    pos = rows - off[seq]
    spare = (off.numel() - 1) * n
    return torch.where(pos < n, seq * n + pos, spare)


def _to_dense(values, offsets, max_lengths, padding_value=0.0):
    off, n = offsets[0], int(max_lengths[0])
    B = off.numel() - 1
    out = values.new_full((B * n + 1,) + tuple(values.shape[1:]), padding_value)
    out[_rows(off, n, values.shape[0])] = values
    return out[:-1].view((B, n) + tuple(values.shape[1:]))


def _to_jagged(dense, x_offsets, total_L=None):
    off = x_offsets[0]
    B, n = dense.shape[0], dense.shape[1]
    total = int(off[-1]) if total_L is None else int(total_L)
    flat = torch.cat([dense.reshape((B * n,) + tuple(dense.shape[2:])), dense.new_zeros((1,) + tuple(dense.shape[2:]))])
    return flat[_rows(off, n, total)]


def install() -> bool:
    """Register the ops under ``torch.ops.fbgemm`` unless fbgemm provides them; True when the shim is used."""
    global _LIB
    try:
        importlib.import_module("fbgemm_gpu")
        return False
    except ImportError:
        pass
    if _LIB is None:
        _LIB = register("fbgemm")
    return True


def register(ns: str) -> torch.library.Library:
    """The ops under ``torch.ops.<ns>`` (tests use a namespace of their own beside a real fbgemm). As in fbgemm,
    ``jagged_to_padded_dense`` and ``dense_to_jagged`` are composite (traced through) and their ``*_forward``
    ops (and ``jagged_to_padded_dense_backward``) the opaque ones, with autograd and fake tensors: a graph traced
    here has fbgemm's ops, names and all."""
    lib = torch.library.Library(ns, "DEF")  # noqa: TOR901 (fbgemm's namespace where fbgemm is absent)
    fb = getattr(torch.ops, ns)

    class ToDense(torch.autograd.Function):
        @staticmethod
        def forward(ctx, values, offsets, n, padding_value):
            ctx.offsets, ctx.total = offsets, values.shape[0]
            with _compat.below_autograd():
                return fb.jagged_to_padded_dense_forward(values, offsets, [n], padding_value)

        @staticmethod
        def backward(ctx, grad):
            return fb.jagged_to_padded_dense_backward(grad, ctx.offsets, ctx.total), None, None, None

    class ToJagged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, dense, offsets, total_L):
            ctx.offsets, ctx.n = offsets, dense.shape[1]
            with _compat.below_autograd():
                return fb.dense_to_jagged_forward(dense, offsets, total_L)

        @staticmethod
        def backward(ctx, grad):
            return fb.jagged_to_padded_dense_forward(grad, ctx.offsets, [ctx.n]), None, None

    for name in ("jagged_to_padded_dense", "jagged_to_padded_dense_forward"):
        lib.define(f"{name}(Tensor values, Tensor[] offsets, SymInt[] max_lengths, float padding_value=0.) -> Tensor")
    lib.define("dense_to_jagged(Tensor dense, Tensor[] x_offsets, SymInt? total_L=None) -> (Tensor, Tensor[])")
    lib.define("dense_to_jagged_forward(Tensor dense, Tensor[] x_offsets, SymInt? total_L=None) -> Tensor")
    lib.define("jagged_to_padded_dense_backward(Tensor grad_output, Tensor[] offsets, SymInt total_L) -> Tensor")
    lib.impl("jagged_to_padded_dense", lambda v, o, m, p=0.0: fb.jagged_to_padded_dense_forward(v, o, m, p),
             "CompositeImplicitAutograd")
    lib.impl("dense_to_jagged", lambda d, o, t=None: (fb.dense_to_jagged_forward(d, o, t), o),
             "CompositeImplicitAutograd")
    # fbgemm's kernels are C++, never traced: an eager call of these ops (after a graph break) must not become a
    # compiled frame of its own (the likely cause of stock Inductor's wrong results on a GPU: benchmarks/RESULTS.md)
    to_dense, to_jagged = torch.compiler.disable(_to_dense), torch.compiler.disable(_to_jagged)
    lib.impl("jagged_to_padded_dense_forward", to_dense, "CompositeExplicitAutograd")
    lib.impl("dense_to_jagged_forward", to_jagged, "CompositeExplicitAutograd")
    lib.impl("jagged_to_padded_dense_backward", to_jagged, "CompositeExplicitAutograd")
    lib.impl("jagged_to_padded_dense_forward", lambda v, o, m, p=0.0: ToDense.apply(v, o, m[0], p), "Autograd")
    lib.impl("dense_to_jagged_forward", lambda d, o, t=None: ToJagged.apply(d, o, t), "Autograd")

    @torch.library.register_fake(f"{ns}::jagged_to_padded_dense_forward", lib=lib)
    def _(values, offsets, max_lengths, padding_value=0.0):
        return values.new_empty((offsets[0].shape[0] - 1, max_lengths[0]) + tuple(values.shape[1:]))

    @torch.library.register_fake(f"{ns}::dense_to_jagged_forward", lib=lib)
    def _(dense, x_offsets, total_L=None):
        total = torch.library.get_ctx().new_dynamic_size() if total_L is None else total_L
        return dense.new_empty((total,) + tuple(dense.shape[2:]))

    @torch.library.register_fake(f"{ns}::jagged_to_padded_dense_backward", lib=lib)
    def _(grad_output, offsets, total_L):
        return grad_output.new_empty((total_L,) + tuple(grad_output.shape[2:]))

    return lib
