"""Routing of ``hstu::attention``'s CUDA forward to the warp-specialised Gluon kernel
(:mod:`hstu_inductor.kernels.gluon_attention`) when the call is in its scope.

Scope: an sm90 GPU (exactly: wgmma/TMA/setmaxnreg), q/k/v bf16 or fp16 of one shape ``[L, H, 128]`` with unit
stride on D, heads adjacent (``stride(1) == 128``) and 16-byte aligned base and row stride (TMA), causal, optional
``num_targets``, and nothing else (no ``attn_scale``, window, contextual prefix, min-full length, rab, intervals or
table bias). ``config.gluon = "off"`` (env ``HSTU_INDUCTOR_GLUON=off``) turns it off; outside the scope the
Triton kernel runs as before. Same results: the fp32-silu Gluon kernel was bitwise equal to the Triton kernel on
H100 (docs/gluon_forward.md).

How it is launched:

* plain eager: directly (:func:`route` -> ``"direct"``);
* traced (torch.compile, make_fx): through the opaque custom op ``hstu::_gluon_fwd`` (-> ``"op"``; it has a fake
  impl, so Inductor calls it as an extern kernel from its Python wrapper). A Gluon kernel cannot go through
  ``wrap_triton`` (Triton 3.6's ``triton_kernel_wrapper`` takes ``@triton.jit`` kernels);
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
from .._compat import guarded, plain_eager
from ._kernels import load

log = logging.getLogger("hstu_inductor")

__all__ = ["route", "gluon_fwd"]

_D = 128
_DTYPES = (torch.bfloat16, torch.float16)


def _module():
    # no triton.experimental.gluon (other Triton versions): the Triton kernel runs
    return load("gluon_attention", "Gluon attention forward", "the Triton kernel runs", logging.INFO)


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
        from torch._inductor import config as inductor_config
        from torch._inductor.virtualized import V

        return bool(inductor_config.cpp_wrapper) or bool(V.aot_compilation)
    except Exception:  # cannot tell: stay on the Triton path
        return True


def route(q: Tensor, k: Tensor, v: Tensor, num_targets: Optional[Tensor], attn_scale: Optional[Tensor],
          max_attn_len: int, contextual_seq_len: int, min_full_attn_seq_len: int, causal: bool,
          has_bias: bool) -> Optional[str]:
    """How the forward of this call uses the Gluon kernel: ``"direct"`` (launch it), ``"op"`` (through
    ``hstu::_gluon_fwd``), or None (the Triton kernel)."""
    if config.gluon == "off":
        return None
    if has_bias or attn_scale is not None or not causal:
        return None
    if not (isinstance(max_attn_len, int) and isinstance(contextual_seq_len, int)
            and isinstance(min_full_attn_seq_len, int)):
        return None  # symbolic mask sizes: keep the general kernel
    if max_attn_len or contextual_seq_len or min_full_attn_seq_len:
        return None
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return None
    if not (guarded(q.shape[2] == _D) and guarded(v.shape[2] == _D) and guarded(k.shape[2] == _D)
            and guarded(q.shape[1] == k.shape[1]) and guarded(v.shape[1] == q.shape[1])
            and guarded(q.shape[0] == k.shape[0]) and guarded(v.shape[0] == q.shape[0])):
        return None
    if not _device_ok(q.device) or _module() is None:
        return None
    if not all(_layout_ok(t) for t in (q, k, v)):
        return None
    if plain_eager(q, k, v, num_targets):
        return "direct"
    if _aot_or_export():
        return None
    return "op"


def direct(q, k, v, seq_offsets, max_seq_len, alpha, num_targets):
    return _module().gluon_forward(q, k, v, seq_offsets, max_seq_len, alpha, num_targets)


@torch.library.custom_op("hstu::_gluon_fwd", mutates_args=())
def gluon_fwd(q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, alpha: float,
              num_targets: Optional[Tensor] = None) -> Tensor:
    """The Gluon forward as an opaque op (what traced calls of ``hstu::attention`` record)."""
    return _module().gluon_forward(q, k, v, seq_offsets, max_seq_len, alpha, num_targets)


@gluon_fwd.register_fake
def _(q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
