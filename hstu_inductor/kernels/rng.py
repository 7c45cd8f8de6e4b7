"""Triton side of the counter-based dropout hash of :mod:`hstu_inductor.reference.dropout`.

uint32 arithmetic wraps modulo 2**32 natively on the GPU (and in the interpreter's numpy), which is
exactly the int64-and-mask arithmetic of the torch version; the tests check the two bit for bit.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fmix32(h):
    """murmur3 finaliser on uint32 lanes (literals >= 2**31 are typed uint32 by Triton)."""
    h ^= h >> 16
    h = h * 0x85EBCA6B
    h ^= h >> 13
    h = h * 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def seed_keys(SEED):
    """(k1, k2) from the int64 seed stored at ``SEED``; once per program."""
    seed = tl.load(SEED).to(tl.int64)
    s0 = seed.to(tl.uint32)
    s1 = (seed >> 32).to(tl.uint32)
    k1 = fmix32(s0 ^ fmix32(s1 ^ 0x9E3779B9))
    k2 = fmix32(k1 ^ 0x85EBCA77)
    return k1, k2


@triton.jit
def hash32(idx, k1, k2):
    """uint32 hash of the int64 flat index ``idx`` under the seed keys."""
    i0 = idx.to(tl.uint32)
    i1 = (idx >> 32).to(tl.uint32)
    return fmix32(fmix32(i0 ^ k1) ^ k2 ^ (i1 * 0xC2B2AE3D))


@triton.jit
def keep(idx, k1, k2, thresh):
    """True where the element with int64 flat index ``idx`` survives dropout (zero-extended compare)."""
    return hash32(idx, k1, k2).to(tl.int64) >= thresh
