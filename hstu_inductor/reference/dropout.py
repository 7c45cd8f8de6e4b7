"""Counter-based dropout mask: ``keep(seed, i)`` is a pure function of an int64 seed and the flat
element index ``i``, so the forward and the backward (and CPU and GPU) regenerate the same mask
without storing it.

The hash works on 32-bit lanes. Here it is computed in int64 with ``& 0xFFFFFFFF`` after every
product/sum (the low 32 bits of a wrapped int64 product are exact), so it matches the uint32
Triton version in :mod:`hstu_inductor.kernels.rng` bit for bit::

    fmix(h)  = murmur3 finaliser (h ^= h>>16; h *= 0x85EBCA6B; h ^= h>>13; h *= 0xC2B2AE35; h ^= h>>16)
    k1       = fmix(s0 ^ fmix(s1 ^ 0x9E3779B9))           s0, s1: low / high 32 bits of the seed
    k2       = fmix(k1 ^ 0x85EBCA77)
    hash(i)  = fmix(fmix(i0 ^ k1) ^ k2 ^ (i1 * 0xC2B2AE3D))  i0, i1: low / high 32 bits of i
    keep(i)  = hash(i) >= floor(p * 2**32)                   kept values are scaled by 1 / (1 - p)
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["keep_threshold", "dropout_hash", "dropout_keep_mask"]

_M32 = 0xFFFFFFFF


def keep_threshold(p: float) -> int:
    """``floor(p * 2**32)``: an element is kept when its 32-bit hash is ``>=`` this."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return min(int(p * 4294967296.0), _M32)


def _fmix(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def dropout_hash(seed: Tensor, index: Tensor) -> Tensor:
    """The 32-bit hash (as int64 in ``[0, 2**32)``) of int64 ``index`` under the 0-d int64 ``seed``."""
    seed = seed.to(device=index.device, dtype=torch.int64)
    index = index.to(torch.int64)
    s0, s1 = seed & _M32, (seed >> 32) & _M32
    k1 = _fmix(s0 ^ _fmix(s1 ^ 0x9E3779B9))
    k2 = _fmix(k1 ^ 0x85EBCA77)
    i0, i1 = index & _M32, (index >> 32) & _M32
    return _fmix(_fmix(i0 ^ k1) ^ k2 ^ ((i1 * 0xC2B2AE3D) & _M32))


def dropout_keep_mask(seed: Tensor, shape, p: float, device=None) -> Tensor:
    """Boolean keep mask of a contiguous tensor of ``shape`` (row-major flat index)."""
    numel = 1
    for s in shape:
        numel *= s
    index = torch.arange(numel, dtype=torch.int64, device=device if device is not None else seed.device)
    return (dropout_hash(seed, index) >= keep_threshold(p)).view(shape)
