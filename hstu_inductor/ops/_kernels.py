"""Lazy access to the Triton kernels for the CUDA implementations of the ops."""
from __future__ import annotations

import functools
import importlib
import logging

from .. import config

log = logging.getLogger("hstu_inductor")


@functools.cache
def load(name: str, what: str, fallback: str, level: int = logging.WARNING):
    """``hstu_inductor.kernels.<name>``, imported once; None when it cannot be imported (Triton missing or
    broken: ``fallback`` still computes the right answer), said once in the log."""
    try:
        return importlib.import_module(f"..kernels.{name}", __package__)
    except Exception as e:
        log.log(level, "hstu_inductor: %s unavailable (%s); %s", what, e, fallback)
        return None


def _enabled(name: str, what: str, fallback: str):
    """:func:`load`, or None when the Triton kernels are disabled (``config.kernels == "off"``)."""
    return None if config.kernels == "off" else load(name, what, fallback)


def cuda_kernels():
    """The attention kernels module, or None when disabled or unavailable."""
    return _enabled("attention", "Triton kernels", "CUDA ops run the eager reference")


def kernels_for(t):
    """The attention kernels module when ``t`` lives on CUDA and kernels are enabled, else None (the scope of
    every kernel variant starts here)."""
    return cuda_kernels() if t.device.type == "cuda" else None


def delta_kernels():
    """:mod:`hstu_inductor.kernels.delta` (cached attention), or None when disabled or unavailable."""
    return _enabled("delta", "cached-attention Triton kernels", "the reference runs")


def stu_kernels():
    """The fused STU block kernels module (:mod:`hstu_inductor.kernels.stu_blocks`), or None."""
    return _enabled("stu_blocks", "STU Triton kernels", "CUDA ops run the ATen bodies")


def fused_check():
    """``kernels.checks.check_jagged`` (all jagged value checks in one launch), or None when the Triton
    kernels are disabled or unavailable."""
    mod = _enabled("checks", "fused check kernel", "input checks use ATen ops")
    return None if mod is None else mod.check_jagged
