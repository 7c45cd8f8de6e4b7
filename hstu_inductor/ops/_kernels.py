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


def cuda_kernels():
    """The kernels module, or None when disabled (``config.kernels == "off"``) or unavailable."""
    if config.kernels == "off":
        return None
    return _load()
