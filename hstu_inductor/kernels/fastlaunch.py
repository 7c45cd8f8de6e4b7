"""Cached launches of compiled kernels (the Gluon attention kernels, the jagged-input check): ``kernel[grid](*args,
**meta)`` without ``JITFunction.run`` on repeat calls (the Gluon forward's host function cost 98-164 us on the
H100; benchmarks/RESULTS.md, 2026-11-24).

The first call for a specialisation goes through ``kernel[grid]`` (compiles, fills Triton's cache) and keeps the
``CompiledKernel`` under a key computed here; later calls with the same key call its launcher directly. What is
skipped: building and validating gluon ``TensorDescriptor`` objects, Triton's binder (specialising every
argument, ``repr`` of every descriptor layout), its cache-key string, ``launch_metadata`` and the two empty hook
chains the C launcher would call. What stays: the launcher (TMA descriptor encoding, pointer checks, launch).

The key (:func:`_arg_key`, :func:`launch`) holds everything Triton 3.6 specialises on (``do_not_specialize``
parameters by type only; ``runtime/jit.py``
``create_function_from_signature`` -> ``native_specialize_impl``; ``python/src/specialize.cc``), and a little
more. Private Triton API lives only here; anything unexpected falls back to ``kernel[grid]``.

Switch: ``hstu_inductor.config.fastlaunch`` (env ``HSTU_INDUCTOR_FASTLAUNCH``): ``"on"`` (default), ``"off"``
(always ``kernel[grid]``), ``"verify"`` (cached launches, each checked against the kernel Triton's own cache would
launch; tests).
"""
from __future__ import annotations

import torch

from .. import config

__all__ = ["Desc", "launch", "clear"]

VERIFIED = 0  # cached launches checked in "verify" mode (tests)
_MAX_ENTRIES = 64  # per kernel; keys differ only by dtype, targets, alignment and a few flags
_CACHES: dict = {}  # id(kernel) -> (kernel, {key: entry}, modelled); by id: hashing a JITFunction costs ~0.6 us
_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)


class Desc:
    """What the launcher reads of a TMA descriptor (``base``, ``shape``, ``strides``, ``padding``), built without
    the gluon ``TensorDescriptor``'s validation; that class is built from it on uncached calls, so its checks
    still run once per key. ``key``: what Triton specialises a gluon descriptor on (base dtype, block shape,
    layout), plus base and row-stride alignment so that an input those checks reject never hits the cache."""

    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "padding", "key")

    def __init__(self, base: torch.Tensor, shape: list, strides: list, block_shape: list, layout):
        self.base, self.shape, self.strides, self.block_shape, self.layout = base, shape, strides, block_shape, layout
        self.padding = "zero"
        es = base.element_size()
        self.key = (base.dtype, block_shape[0], block_shape[1], layout,
                    not base.data_ptr() & 15, not (strides[0] * es) & 15)

    def gluon(self):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        return TensorDescriptor(self.base, self.shape, self.strides, self.block_shape, self.layout)


def clear():
    """Forget every cached kernel (tests)."""
    _CACHES.clear()


def _int_key(a: int):
    # specialize.cc handle_long_type: 1 becomes a constexpr; else i32 / i64 / u64 by range, "D" if a % 16 == 0
    if a == 1:
        return "one"
    return _int_size(a), not a & 15


def _int_size(a: int) -> int:
    return 32 if _I32[0] <= a <= _I32[1] else (64 if _I64[0] <= a <= _I64[1] else 65)


def _arg_key(args, nospec=()) -> tuple | None:
    """Triton's specialisation of each runtime argument, or None for an argument we do not model (the call then
    goes through ``kernel[grid]``, uncached). ``nospec``: positions of ``do_not_specialize`` parameters, which
    Triton types only (an int by its range, a pointer by its dtype)."""
    out = []
    for i, a in enumerate(args):
        t = type(a)
        if t is Desc:
            out.append(a.key)
        elif t is torch.Tensor:  # handle_tensor: pointer dtype, "D" if the address is 16-byte aligned
            out.append((a.dtype, i in nospec or not a.data_ptr() & 15))
        elif t is int:
            out.append(("n", _int_size(a)) if i in nospec else _int_key(a))
        elif a is None:  # a constexpr None in the signature
            out.append("none")
        elif t is float:  # handle_float_type: always fp32, no value specialisation
            out.append("f")
        else:  # bool, numpy scalars, tensor subclasses, ...: not modelled here
            return None
    return tuple(out)


_VERSIONS = ("3.6.", )  # Triton versions whose binder, cache key and launcher convention this module copies


def _triton():
    """(driver, knobs, HookChain, CompiledKernel) of this Triton, or None (the fast path is then never used)."""
    global _TRITON
    if _TRITON is False:
        try:
            import triton
            from triton import knobs
            from triton.compiler.compiler import CompiledKernel
            from triton.knobs import HookChain
            from triton.runtime.driver import driver

            knobs.runtime.debug, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook  # noqa: B018
            knobs.compilation.instrumentation_mode  # noqa: B018
            ok = triton.__version__.startswith(_VERSIONS)
            _TRITON = (driver, knobs, HookChain, CompiledKernel) if ok else None
        except Exception:  # another Triton: kernel[grid] only
            _TRITON = None
    return _TRITON


_TRITON = False


def _no_hook(h, HookChain) -> bool:
    return h is None or (type(h) is HookChain and not h.calls)


def _slow(kernel, grid, args, meta):
    args = [a.gluon() if type(a) is Desc else a for a in args]
    return kernel[grid](*args, **meta)


def _modelled(kernel):
    """For a JITFunction as this module reads it (Triton 3.6) whose runtime arguments are unannotated and either
    fully specialised or ``do_not_specialize`` (what _arg_key models): the positions of the latter (a frozenset);
    anything else (None) always takes ``kernel[grid]``."""
    try:
        ok = (isinstance(kernel.pre_run_hooks, list) and isinstance(kernel.device_caches, dict)
              and hasattr(kernel, "debug") and len(kernel.params) == len(kernel.arg_names)
              and all(p.is_constexpr or not (p.do_not_specialize_on_alignment or p.annotation) for p in kernel.params))
        return frozenset(i for i, p in enumerate(kernel.params) if p.do_not_specialize) if ok else None
    except Exception:
        return None


def _entry(kernel, compiled, n_args: int, meta: dict, CompiledKernel):
    """(launcher, function, packed metadata, constexpr tail, compiled) for later launches, or None."""
    try:
        if type(compiled) is not CompiledKernel or compiled.function is None:
            return None  # not launched (async compile, interpreter, ...)
        names = kernel.arg_names[n_args:]
        if any(not p.is_constexpr for p in kernel.params[n_args:]) or any(n not in meta for n in names):
            return None  # the launcher takes every argument in signature order: constexprs must all be in meta
        kernel.cache_key  # noqa: B018  (computed at compile time already; it fills used_global_vals)
        if kernel.used_global_vals:
            return None  # JITFunction.run re-checks the globals a kernel reads on every launch: keep that path
        tail = tuple(meta[n] for n in names)
        return compiled.run, compiled.function, compiled.packed_metadata, tail, compiled
    except Exception:  # another Triton's internals
        return None


def launch(kernel, grid: tuple, args: tuple, meta: dict):
    """``kernel[grid](*args, **meta)`` (descriptors passed as :class:`Desc`), cached as the module doc says.
    ``args``: the runtime arguments in signature order; ``meta``: constexprs (the signature's last parameters)
    and compile options by name."""
    # a plain read, not config.get(): this is the path whose microseconds the module exists to save
    mode = config.fastlaunch
    tri = None if mode == "off" else _triton()
    if tri is None:
        return _slow(kernel, grid, args, meta)
    driver, knobs, HookChain, CompiledKernel = tri
    held = _CACHES.get(id(kernel))
    if held is None:  # the kernel is kept with its cache, so its id is never reused while the entry lives
        held = _CACHES[id(kernel)] = (kernel, {}, _modelled(kernel))
    rt = knobs.runtime
    spec = _arg_key(args, held[2]) if held[2] is not None else None
    if spec is None or kernel.pre_run_hooks or not (_no_hook(rt.launch_enter_hook, HookChain)
                                                    and _no_hook(rt.launch_exit_hook, HookChain)):
        return _slow(kernel, grid, args, meta)  # hooks must see every launch: Triton's path
    drv = driver.active
    device = drv.get_current_device()
    # Triton's cache is per device (device_caches) and keys on the specialisation, the constexpr values and
    # the options (meta; debug and instrumentation_mode are added by JITFunction.run from the knobs)
    key = (device, drv, bool(kernel.debug or rt.debug), knobs.compilation.instrumentation_mode,
           tuple(meta.items()), spec)
    cache = held[1]
    entry = cache.get(key)
    if entry is None:
        compiled = _slow(kernel, grid, args, meta)
        entry = _entry(kernel, compiled, len(args), meta, CompiledKernel)
        if entry is not None:
            if len(cache) >= _MAX_ENTRIES:
                cache.clear()
            cache[key] = entry
        return compiled
    if mode == "verify":
        _verify(kernel, args, meta, entry[4], device)
    run, function, packed, tail, compiled = entry
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, drv.get_current_stream(device), function, packed,
        None, None, None, *args, *tail)
    return compiled


def _verify(kernel, args, meta, compiled, device):
    """Raise unless Triton's own binder and cache would launch ``compiled`` for these arguments."""
    global VERIFIED
    from triton import knobs
    from triton.runtime.jit import compute_cache_key

    kernel_cache, key_cache, _, _, binder = kernel.device_caches[device]
    kw = dict(meta)
    kw["debug"] = kw.get("debug", kernel.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    _, spec, options = binder(*[a.gluon() if type(a) is Desc else a for a in args], **kw)
    theirs = kernel_cache.get(compute_cache_key(key_cache, spec, options))
    if theirs is not compiled:
        raise AssertionError(f"fastlaunch: cached kernel differs from Triton's for {kernel} (spec {spec})")
    VERIFIED += 1
