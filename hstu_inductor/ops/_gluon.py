"""Routing of ``hstu::attention``'s CUDA forward and ``hstu::attention_bwd``'s CUDA backward to the
warp-specialised Gluon kernels (:mod:`hstu_inductor.kernels.gluon_attention`,
:mod:`hstu_inductor.kernels.gluon_backward`) when the call is in their scope (one scope, :func:`_in_scope`).

Scope: an sm90 GPU (exactly: wgmma/TMA/setmaxnreg), q/k/v bf16 or fp16 of one shape ``[L, H, 128]`` with unit
stride on D, heads adjacent (``stride(1) == 128``) and 16-byte aligned base and row stride (TMA), causal, optional
``num_targets``, and nothing else (no ``attn_scale``, window, contextual prefix, min-full length, rab, intervals or
table bias). ``config.gluon = "off"`` (env ``HSTU_INDUCTOR_GLUON=off``) turns it off; outside the scope the
Triton kernel runs as before. Same results: the fp32-silu Gluon kernel was bitwise equal to the Triton kernel on
H100 (docs/gluon_forward.md).

The backward (:func:`route_bwd`) has the same scope and launch rules, plus: no ``attn_scale`` gradient (implied by
no ``attn_scale``), ``grad`` of q's shape (any dtype and layout: ``gluon_backward`` casts it to q's dtype and copies
it when its TMA view cannot address it; the autograd formula passes it contiguous). The Gluon backward computes
the Triton backward's default "split" algorithm (no atomics, bitwise repeatable; bitwise equal to it on H100,
docs/gluon_backward.md), so it serves both ``config.deterministic`` settings (False only allows atomics).

How it is launched:

* plain eager: directly (:func:`route` -> ``"direct"``);
* traced (torch.compile, make_fx): through the opaque custom ops ``hstu::_gluon_fwd`` / ``hstu::_gluon_bwd``
  (-> ``"op"``; they have fake impls, so Inductor calls them as extern kernels from its Python wrapper). A Gluon
  kernel cannot go through ``wrap_triton`` (Triton 3.6's ``triton_kernel_wrapper`` takes ``@triton.jit`` kernels);
* torch.export / AOTInductor / Inductor's C++ wrapper: never (-> None, the Triton kernel): an AOTI package runs
  without Python, so an opaque Python op could not run in it. Detected by ``torch.compiler.is_exporting()``,
  Inductor's ``cpp_wrapper`` option (AOTI sets it) and ``V.aot_compilation``.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import Tensor

from .. import config
from .. import _compat
from .._compat import guarded, plain_eager
from ..spec import AttentionSpec
from . import variants
from . import _kernels
from ._kernels import load

log = logging.getLogger("hstu_inductor")

__all__ = ["route", "route_bwd", "forward", "backward", "gluon_fwd", "gluon_bwd"]

_D = 128
_DTYPES = (torch.bfloat16, torch.float16)


def _module():
    # no triton.experimental.gluon (other Triton versions): the Triton kernel runs
    return load("gluon_attention", "Gluon attention forward", "the Triton kernel runs", logging.INFO)


def _bwd_module():
    return load("gluon_backward", "Gluon attention backward", "the Triton backward runs", logging.INFO)


@functools.cache
def _sm90(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) == (9, 0)


def _device_ok(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def _layout_ok(t: Tensor) -> bool:
    """A [L, H, 128] operand the kernel's 2-D TMA descriptors ([L, H*128] views) can address."""
    es = t.element_size()
    try:
        base_ok = t.data_ptr() % 16 == 0
    except RuntimeError:  # fake tensor while tracing: allocations are aligned, the view's offset decides
        base_ok = guarded((t.storage_offset() * es) % 16 == 0)
    return (base_ok and guarded(t.stride(2) == 1) and guarded(t.stride(1) == _D)
            and guarded((t.stride(0) * es) % 16 == 0))


def _aot_or_export() -> bool:
    """True while torch.export traces, or Inductor compiles for AOTI / its C++ wrapper (no Python at run time)."""
    if torch.compiler.is_exporting():
        return True
    try:
        return _compat.aot_or_cpp_wrapper()
    except Exception:  # cannot tell: stay on the Triton path
        return True


def _in_scope(q: Tensor, k: Tensor, v: Tensor, attn_scale: Optional[Tensor], spec: AttentionSpec, has_bias: bool,
              module) -> bool:
    """The Gluon kernels' scope (forward and backward alike); ``module`` loads the kernel module."""
    if config.gluon == "off":
        return False
    if has_bias or attn_scale is not None or not spec.plain_causal:
        return False
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return False
    if not (guarded(q.shape[2] == _D) and guarded(v.shape[2] == _D) and guarded(k.shape[2] == _D)
            and guarded(q.shape[1] == k.shape[1]) and guarded(v.shape[1] == q.shape[1])
            and guarded(q.shape[0] == k.shape[0]) and guarded(v.shape[0] == q.shape[0])):
        return False
    if not _device_ok(q.device) or module() is None:
        return False
    return all(_layout_ok(t) for t in (q, k, v))


def _launch_mode(*tensors) -> Optional[str]:
    """``"direct"`` in plain eager, None under export / AOTI / the C++ wrapper, else ``"op"`` (traced)."""
    if plain_eager(*tensors):
        return "direct"
    if _aot_or_export():
        return None
    return "op"


def route(q: Tensor, k: Tensor, v: Tensor, num_targets: Optional[Tensor], attn_scale: Optional[Tensor],
          spec: AttentionSpec, has_bias: bool) -> Optional[str]:
    """How the forward of this call uses the Gluon kernel: ``"direct"`` (launch it), ``"op"`` (through
    ``hstu::_gluon_fwd``), or None (out of scope: another variant runs)."""
    if not _in_scope(q, k, v, attn_scale, spec, has_bias, _module):
        return None
    return _launch_mode(q, k, v, num_targets)


def route_bwd(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, num_targets: Optional[Tensor],
              attn_scale: Optional[Tensor], spec: AttentionSpec, has_bias: bool,
              need_scale_grad: bool) -> Optional[str]:
    """:func:`route` for the backward: ``"direct"``, ``"op"`` (through ``hstu::_gluon_bwd``) or None.
    ``has_bias``: rab, intervals or table bias given."""
    if need_scale_grad or grad.dim() != 3:
        return None
    if not (guarded(grad.shape[0] == q.shape[0]) and guarded(grad.shape[1] == q.shape[1])
            and guarded(grad.shape[2] == q.shape[2])):
        return None
    if not _in_scope(q, k, v, attn_scale, spec, has_bias, _bwd_module):
        return None
    return _launch_mode(grad, q, k, v, num_targets)


def forward(how: str, q, k, v, seq_offsets, max_seq_len, alpha, num_targets):
    """The Gluon forward, launched as :func:`route` said (``"direct"`` / ``"op"``)."""
    if how == "direct":
        return _module().gluon_forward(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, checked=True)
    return torch.ops.hstu._gluon_fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets)


# The opaque ops are registered with ``torch.library.Library`` rather than ``custom_op``: a compiled graph calls
# them once per step from Inductor's Python wrapper, and custom_op's Python dispatch layers (autograd wrapper,
# redispatch, output-alias checks) cost tens of microseconds per call (benchmarks/RESULTS.md, 2026-11-24, H100). Their
# inputs never require grad there (the graphs run below autograd), so they have no autograd formula.
_LIB = torch.library.Library("hstu", "FRAGMENT")
_LIB.define("_gluon_fwd(Tensor q, Tensor k, Tensor v, Tensor seq_offsets, SymInt max_seq_len, float alpha, "
            "Tensor? num_targets=None) -> Tensor")
_LIB.define("_gluon_bwd(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor seq_offsets, SymInt max_seq_len, "
            "float alpha, Tensor? num_targets=None) -> (Tensor, Tensor, Tensor)")


def gluon_fwd(q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
              num_targets: Optional[Tensor] = None) -> Tensor:
    """The Gluon forward as an opaque op (what traced calls of ``hstu::attention`` record)."""
    return _module().gluon_forward(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, checked=True)


_LIB.impl("_gluon_fwd", gluon_fwd, "CompositeExplicitAutograd")


@torch.library.register_fake("hstu::_gluon_fwd", lib=_LIB)
def _(q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


def backward(how: str, grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets):
    """``(dq, dk, dv)`` by the Gluon backward, launched as :func:`route_bwd` said (``"direct"`` / ``"op"``)."""
    if how == "direct":
        return _bwd_module().gluon_backward(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, checked=True)
    return torch.ops.hstu._gluon_bwd(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets)


def gluon_bwd(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
              num_targets: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The Gluon backward as an opaque op (what traced calls of ``hstu::attention_bwd`` record)."""
    dq, dk, dv = _bwd_module().gluon_backward(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets,
                                              checked=True)
    return dq, dk, dv


_LIB.impl("_gluon_bwd", gluon_bwd, "CompositeExplicitAutograd")


@torch.library.register_fake("hstu::_gluon_bwd", lib=_LIB)
def _(grad, q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


# The Gluon kernels as variants of hstu::attention: above the Triton kernels wherever they are in scope. The
# Triton kernels must be enabled too (config.kernels = "off" runs the reference everywhere).


def _fwd_scope(c: variants.AttentionCall) -> Optional[str]:
    if _kernels.kernels_for(c.q) is None:
        return None
    return route(c.q, c.k, c.v, c.num_targets, c.attn_scale, c.spec, c.has_bias)


def _bwd_scope(c: variants.AttentionCall) -> Optional[str]:
    if _kernels.kernels_for(c.q) is None:
        return None
    return route_bwd(c.grad, c.q, c.k, c.v, c.num_targets, c.attn_scale, c.spec, c.has_bias, c.need_scale_grad)


def _fwd_run(how: str, c: variants.AttentionCall):
    return forward(how, c.q, c.k, c.v, c.seq_offsets, c.max_seq_len, c.alpha, c.num_targets)


def _bwd_run(how: str, c: variants.AttentionCall):
    dq, dk, dv = backward(how, c.grad, c.q, c.k, c.v, c.seq_offsets, c.max_seq_len, c.alpha, c.num_targets)
    return dq, dk, dv, c.q.new_empty(0), None, None, None  # no bias in scope: no d_rab / table gradients


variants.register(variants.Variant("gluon_ws", "fwd", 30, _fwd_scope, _fwd_run))
variants.register(variants.Variant("gluon_ws", "bwd", 30, _bwd_scope, _bwd_run))
