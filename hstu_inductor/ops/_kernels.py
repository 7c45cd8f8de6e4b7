"""Lazy access to the Triton kernels for the CUDA implementations of the ops."""
from __future__ import annotations

import functools
import logging

from .. import config

log = logging.getLogger("hstu_inductor")


@functools.cache
def _load():
    try:
        from ..kernels import attention as kernels
    except Exception as e:  # triton missing or broken: the reference still computes the right answer
        log.warning("hstu_inductor: Triton kernels unavailable (%s); CUDA ops run the eager reference", e)
        return None
    return kernels


@functools.cache
def _load_stu():
    try:
        from ..kernels import stu_blocks
    except Exception as e:  # same fallback as the attention kernels
        log.warning("hstu_inductor: STU Triton kernels unavailable (%s); CUDA ops run the ATen bodies", e)
        return None
    return stu_blocks


@functools.cache
def _load_delta():
    try:
        from ..kernels import delta
    except Exception as e:  # same fallback as the attention kernels
        log.warning("hstu_inductor: cached-attention Triton kernels unavailable (%s); the reference runs", e)
        return None
    return delta


def delta_kernels():
    """:mod:`hstu_inductor.kernels.delta` (cached attention), or None when disabled or unavailable."""
    if config.kernels == "off":
        return None
    return _load_delta()


@functools.cache
def _load_checks():
    try:
        from ..kernels.checks import check_jagged
    except Exception as e:  # same fallback: the ATen spelling of the checks (ops/_checks.py)
        log.warning("hstu_inductor: fused check kernel unavailable (%s); input checks use ATen ops", e)
        return None
    return check_jagged


def fused_check():
    """``kernels.checks.check_jagged`` (all jagged value checks in one launch), or None when the Triton
    kernels are disabled or unavailable."""
    if config.kernels == "off":
        return None
    return _load_checks()


def stu_kernels():
    """The fused STU block kernels module (:mod:`hstu_inductor.kernels.stu_blocks`), or None."""
    if config.kernels == "off":
        return None
    return _load_stu()


def cuda_kernels():
    """The kernels module, or None when disabled (``config.kernels == "off"``) or unavailable."""
    if config.kernels == "off":
        return None
    return _load()
