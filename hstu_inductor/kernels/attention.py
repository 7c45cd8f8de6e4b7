"""Triton kernels for jagged HSTU attention (forward, backward, cached/delta forward).

Math (HSTU_SEMANTICS.md): ``out_i = s_i * sum_j valid(i, j) * silu(alpha * <q_i, k_j>) * v_j`` per head,
with no softmax. ``valid`` is built on ids ``pi(p)`` (contextual prefix collapsed to id 0, all targets
sharing id ``M``); see :func:`attention_jit._valid` for the element-wise mask and
:func:`attention_jit._fwd_key_range` / ``_bwd_query_range`` for the conservative block-skipping bounds
derived from it.

Layout: ``q, k: [L, H, Dq]``, ``v: [L, H, Dv]`` jagged by ``seq_offsets: [B+1]`` and addressed with
their real strides (they are often views of a fused projection). Every program handles one
``(sequence, head, row block)``.

Two memory paths, chosen by ``tma``: pointer loads (any strides, any GPU, the Triton interpreter) or
device-side tensor descriptors (TMA on sm90+), both through one code path (attention_jit).

Backward: one program per key block keeps dK/dV in registers and walks the query blocks that can
see it. dQ is either
  * "atomic": accumulated with fp32 atomics (pointer atomics by default; TMA reduce-add and
    vectorized ``red.v2`` via HSTU_INDUCTOR_DQ_MODE=2/3) into an fp32 buffer, scaled and cast once, or
  * "split" (the default without the table bias): computed by a second kernel that walks key blocks per
    query block (no atomics, bitwise repeatable); it measured as fast or faster at every N on H100. With
    the in-kernel table bias "atomic" is the default (the bias is evaluated in two kernels, not three).
    HSTU_INDUCTOR_BWD_ALGO=atomic|split overrides unless ``deterministic=True``.

Optional, behind constexpr switches (off: the compiled kernels are unchanged, scripts/ptx_unchanged.py):
a dense relative attention bias added before the silu (``HAS_RAB``; its gradient ``RAB_GRAD`` written
by the dK/dV kernel) and interval masks replacing the HSTU mask (``HAS_IV``, with per-block tile
skipping). See docs/semantics.md and docs/kernels.md.

Tuning knobs (``hstu_inductor.config``, each with its environment variable; docs/options.md): ``autotune``
(HSTU_INDUCTOR_AUTOTUNE=0: one default config, no autotuning), ``silu`` (HSTU_INDUCTOR_SILU=exact|tanh|packed),
``dq_mode`` (HSTU_INDUCTOR_DQ_MODE=1|2|3), ``bwd_algo`` (HSTU_INDUCTOR_BWD_ALGO=auto|atomic|split), ``tile_order``
(HSTU_INDUCTOR_TILE_ORDER=seq|block). See docs/kernels.md.

Modules: attention_jit (the shared ``@triton.jit`` helpers), attention_fwd and attention_bwd (the kernels),
attention_bias_args (arguments of the optional bias and mask inputs). This one is the host side:
autotuning, launch, argument planning and the public functions.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _compat, config
from ..spec import AttentionSpec
from . import attention_bias_args as _bias_args
from . import attention_jit as _jit
from . import table_grad as table_grad_buffer
from .attention_bias_args import _iv_args, _rab_args, _tab_args
from .attention_bwd import _dq_finalize_kernel, _hstu_bwd_dkdv_kernel, _hstu_bwd_dq_kernel
from .attention_fwd import _hstu_fwd_kernel
from .bucket_map import with_bucket_map
from .common import interpret as _interpret
from .common import address_source
from .common import launcher as _launcher
from .common import new_tensor

log = logging.getLogger("hstu_inductor")

__all__ = [
    "hstu_attention_fwd",
    "hstu_attention_bwd",
    "delta_hstu_attention_fwd",
    "tma_supported",
]

# Not used here; tests reach them through this module (a @triton.jit probe calls K._time_bucket on the
# plan K._ts_bounds_and_plan makes).
_time_bucket = _jit._time_bucket
_gap32 = _jit._gap32
_seq_plan = _jit._seq_plan
_ts_bounds_and_plan = _bias_args._ts_bounds_and_plan


# --------------------------------------------------------------------------------------------
# Autotuning
# --------------------------------------------------------------------------------------------

# dtypes of all tensor args are appended by triton; the row strides tell a contiguous [L, H, D] tensor
# from a view of a fused projection (a best config measured for one need not suit the other)
_KEY = ["H", "DQ", "DV", "N_BUCKET", "TMA", "stride_qm", "stride_km"]


def _cfg(kind, block_m, block_n, warps, stages, maxnreg=None, qregs=False):
    kw = {"maxnreg": maxnreg} if maxnreg else {}
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    if kind != "dkdv":
        meta["Q_IN_REGS"] = bool(qregs)
    return triton.Config(meta, num_warps=warps, num_stages=stages, **kw)


# (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg[, q_in_regs]]).
# fwd/dq: BLOCK_M query rows per program, BLOCK_N keys per step.
# dkdv: BLOCK_N key rows per program, BLOCK_M query rows per step.
# maxnreg=128 with 8 warps lets two 128-row CTAs share an SM (independent warpgroups overlap better).
# q_in_regs: Q (and dO) become register A operands of wgmma, halving shared-memory reads of S = Q K^T.
# The head-dim <= 128 lists keep the configs that came first or second for some N in 512..4096 and
# some layout in the H100 tuning logs (benchmarks/RESULTS.md, 2026-11-22/23); each extra config costs a
# Triton compile on the first call of every new key.
_R = True
_GPU_CONFIGS = {
    ("fwd", "small"): [(128, 32, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3), (128, 32, 4, 4), (128, 64, 8, 2, 128)],
    ("fwd", "large"): [(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3)],
    ("dkdv", "small"): [(64, 128, 8, 3), (64, 64, 4, 2), (32, 64, 4, 3), (32, 64, 4, 4), (32, 128, 8, 3)],
    ("dkdv", "large"): [(32, 64, 4, 2), (64, 64, 8, 2), (32, 64, 8, 2), (16, 64, 4, 2)],
    ("dq", "small"): [(128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 8, 4, None, _R), (64, 32, 4, 3)],
    ("dq", "large"): [(64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 3)],
    # fp32 inputs (3-pass tf32 dots need much more shared memory and registers): small tiles
    ("fwd", "fp32"): [(32, 32, 4, 1)],
    ("dkdv", "fp32"): [(32, 32, 4, 1)],
    ("dq", "fp32"): [(32, 32, 4, 1)],
}
# A table bias (path b), D <= 128: the "small" lists with the autotuner's pick at N=1024 moved first (the untuned
# config): the table kernels sit at the register cap, and dK/dV at (64, 128, 8 warps) took 1.6x as long as at
# (32, 64, 4 warps) (H200, benchmarks/RESULTS.md 2026-11-29).
_GPU_CONFIGS.update({(kind, "tables"): [first] + [c for c in _GPU_CONFIGS[(kind, "small")] if c != first]
                     for kind, first in (("fwd", (64, 32, 4, 3)), ("dkdv", (32, 64, 4, 3)))})
# One small config under the interpreter (autotuning needs a GPU) and for quick runs.
_INTERPRET_CONFIGS = {"fwd": (32, 16, 4, 1, None, True), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1, None, True)}

_JIT = {"fwd": _hstu_fwd_kernel, "dkdv": _hstu_bwd_dkdv_kernel, "dq": _hstu_bwd_dq_kernel}

# Test hook: {"fwd": (BM, BN, warps, stages), ...} forces a config and bypasses the autotuner.
_FORCED_CONFIGS: dict = {}


@contextlib.contextmanager
def force_configs(**cfgs):
    """Run with fixed (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel ("fwd", "dkdv", "dq")."""
    old = dict(_FORCED_CONFIGS)
    _FORCED_CONFIGS.update(cfgs)
    try:
        yield
    finally:
        _FORCED_CONFIGS.clear()
        _FORCED_CONFIGS.update(old)


def _autotune_enabled() -> bool:
    return not _interpret() and config.get("autotune")


@functools.lru_cache(maxsize=None)
def _tuned(kind: str, size: str, autotune: bool, atomic_dq: bool, zero_extra: tuple = ()):
    if autotune:
        configs = [_cfg(kind, *c) for c in _GPU_CONFIGS[(kind, size)]]
    elif _interpret():
        configs = [_cfg(kind, *_INTERPRET_CONFIGS[kind])]
    else:
        configs = [_cfg(kind, *_GPU_CONFIGS[(kind, size)][0])]
    tuner = triton.autotune(configs=configs, key=_KEY, cache_results=True,
                            reset_to_zero=(["DQA"] if atomic_dq else []) + list(zero_extra) or None)(_JIT[kind])
    _TUNERS[f"{kind}/{size}/tune={autotune}/atomic={atomic_dq}" + "".join(f"/{z}" for z in zero_extra)] = tuner
    return tuner


_TUNERS: dict = {}  # for benchmark reports: name -> triton Autotuner


_OPTIONAL_FLAGS = {"fwd": ("HAS_RAB", "HAS_IV", "HAS_POS", "HAS_TS", "TS_STEPS", "TAB_HEADS"),
                   "dq": ("HAS_RAB", "HAS_IV", "HAS_POS", "HAS_TS", "TS_STEPS", "TAB_HEADS"),
                   "dkdv": ("HAS_RAB", "RAB_GRAD", "HAS_IV", "HAS_POS", "HAS_TS", "TAB_GRAD", "TS_STEPS", "TAB_HEADS")}


def _launch(kind: str, grid_rows: int, grid_x: int, block_d: int, args: tuple, kwargs: dict,
            atomic_dq: bool = False, fp32: bool = False, zero_extra: tuple = ()):
    """Launch kernel ``kind`` over grid_x * cdiv(grid_rows, BLOCK_{M|N}) programs (see :func:`_tile`).
    ``zero_extra``: further accumulated outputs (bias gradients) the autotuner zeroes between trials."""
    # every constexpr passed, the defaulted rab/interval switches too: torch's wrap_triton (Inductor's
    # user-defined-kernel path) maps arguments by position and breaks on a defaulted one left out
    kwargs = {**{k: False for k in _OPTIONAL_FLAGS[kind]}, **kwargs}
    row_block = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"
    forced = _FORCED_CONFIGS.get(kind)
    if forced is not None:
        cfg = _cfg(kind, *forced)
        rb = cfg.kwargs["BLOCK_N"] if kind == "dkdv" else cfg.kwargs["BLOCK_M"]
        extra = {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}
        _JIT[kind][(grid_x * triton.cdiv(grid_rows, rb),)](*args, **kwargs, **cfg.kwargs, num_warps=cfg.num_warps,
                                                        num_stages=cfg.num_stages, **extra)  # test hook: eager only
        return
    size = "fp32" if fp32 else ("small" if block_d <= 128 else "large")
    if size == "small" and (kwargs["HAS_POS"] or kwargs["HAS_TS"]) and (kind, "tables") in _GPU_CONFIGS:
        size = "tables"
    kern = _tuned(kind, size, _autotune_enabled(), atomic_dq, zero_extra)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("hstu %s launch: configs=%s, constexprs=%s, int args=%s", kind, size,
                  {k: v for k, v in kwargs.items()}, [a for a in args if isinstance(a, (int, float))])
    if not _compat.plain_eager(*args):  # traced: wrap_triton records the launch, Autotuner included
        _launcher(kern, args)[lambda meta: (grid_x * triton.cdiv(grid_rows, meta[row_block]),)](*args, **kwargs)
        return
    key = (kern, *(args[i] for i in _key_positions(kind, len(args))),
           *(a.dtype for a in args if isinstance(a, torch.Tensor)), *kwargs.items())
    cfg = _CHOSEN.get(key)
    if cfg is None:  # first launch of this key: the Autotuner picks (and benchmarks, when tuning)
        try:
            kern[lambda meta: (grid_x * triton.cdiv(grid_rows, meta[row_block]),)](*args, **kwargs)
            _CHOSEN[key] = kern.best_config.all_kwargs()
            return
        except triton.runtime.errors.OutOfResources as err:
            if len(kern.configs) > 1:  # the tuner already skipped configs that do not fit: none did
                raise
            # untuned, the one default config can need more shared memory than some bias variants leave
            _CHOSEN[key] = _fitting_config(kind, size, args, kwargs, grid_x, grid_rows, row_block, err)
            return
    rb = cfg[row_block]  # (a + b - 1) // b: triton.cdiv costs ~5 us (see _pow2)
    _JIT[kind].run(*args, grid=(grid_x * ((grid_rows + rb - 1) // rb),), warmup=False, **kwargs, **cfg)


def _fitting_config(kind, size, args, kwargs, grid_x, grid_rows, row_block, err) -> dict:
    """Launch the first of the tuning list's configs that fits the device (the default one did not: ``err``)
    and return it."""
    for c in _GPU_CONFIGS[(kind, size)][1:]:
        cfg = _cfg(kind, *c).all_kwargs()  # the form the tuned path keeps in _CHOSEN
        try:
            rb = cfg[row_block]
            _JIT[kind].run(*args, grid=(grid_x * ((grid_rows + rb - 1) // rb),), warmup=False, **kwargs, **cfg)
        except triton.runtime.errors.OutOfResources:
            continue
        log.warning("hstu %s: the default config needs more resources than the device has (%s); using %s",
                    kind, err, cfg)
        return cfg
    raise err


# Plain eager launches skip the Autotuner once it has picked a config for their key: its run() rebuilds
# the key from every argument on each call (dicts of ~45 arguments, list lookups, str() of every tensor's
# dtype), tens of microseconds of host time per launch. Our key holds the Autotuner's (the
# _KEY arguments and the tensors' dtypes) and all constexprs, so a hit launches the config it would.
_CHOSEN: dict = {}


@functools.lru_cache(maxsize=None)
def _key_positions(kind: str, nargs: int) -> tuple:
    """Positions in a launch's ``args`` of the _KEY arguments passed positionally (the rest are constexprs,
    part of the key through ``kwargs``)."""
    names = _JIT[kind].arg_names
    return tuple(names.index(k) for k in _KEY if names.index(k) < nargs)


# --------------------------------------------------------------------------------------------
# Host helpers
# --------------------------------------------------------------------------------------------


def tma_supported(device=None) -> bool:
    """True when device-side tensor descriptors (TMA) can be used: sm90+ (or the Triton interpreter)."""
    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    device = torch.device(device) if device is not None else None
    if _interpret():
        return True
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_ok(t: Optional[torch.Tensor]) -> bool:
    """A [rows, H, D] tensor addressable by per-(sequence, head) 2-D descriptors."""
    if t is None:
        return True
    from .._compat import guarded

    es = t.element_size()
    try:
        base_ok = t.data_ptr() % 16 == 0
    except RuntimeError:
        # Fake/functional tensor while torch.compile/AOTI traces the op: allocations are aligned
        # (Inductor copies misaligned graph inputs), so the view's storage offset decides.
        base_ok = guarded((t.storage_offset() * es) % 16 == 0)
    return (base_ok and guarded(t.stride(-1) == 1) and guarded((t.stride(0) * es) % 16 == 0)
            and guarded((t.stride(1) * es) % 16 == 0))


# tma=None takes descriptors only from this N bucket up: below it the per-program descriptor set-up
# costs more than TMA saves (H100, benchmarks/RESULTS.md, 2026-11-22/23: pointer loads 209 vs 173
# TFLOP/s fwd at N=512, 313 vs 302 at N=1024; a tie at 2048; TMA 479 vs 431 at 4096).
_TMA_MIN_N = 2048


def _use_tma(tma, device, tensors, max_seq_len=None) -> bool:
    if tma is False:
        return False
    if tma is None and max_seq_len is not None and _n_bucket(max_seq_len) < _TMA_MIN_N:
        return False
    ok_dev = tma_supported(device)
    if tma is True:
        if not ok_dev:
            raise RuntimeError(f"hstu attention: tma=True but tensor descriptors are not supported on {device} "
                               "(needs an sm90+ GPU and triton with tl.make_tensor_descriptor)")
        if not all(_tma_ok(t) for t in tensors):
            raise ValueError("hstu attention: tma=True needs 16-byte aligned q/k/v base pointers and row/head "
                             "strides, and a contiguous last dimension")
        return True
    return ok_dev and all(_tma_ok(t) for t in tensors)  # layout checks (and their guards) only when usable


# Whether a launch with ``tma`` (True / False / None: where it pays) on ``tensors`` uses descriptors (raises when
# ``tma=True`` cannot be honoured): the public name the ops' variant scopes ask.
uses_tma = _use_tma


def _alloc_fn(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_allocator():
    """Device-side descriptors need a scratch allocator in eager (Inductor/AOTI set their own)."""
    try:
        from triton.runtime import _allocation
        if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            triton.set_allocator(_alloc_fn)
    except Exception:  # pragma: no cover - allocator API moved
        triton.set_allocator(_alloc_fn)


def _device_ctx(device):
    # entering torch.cuda.device costs two device switches per call: skip it when already current
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


_new = new_tensor


def _block_d(d: int) -> int:
    if type(d) is int:
        return max(16, _pow2(d))
    return max(16, triton.next_power_of_2(d))


def _check_inputs(q, k, v, seq_offsets, num_targets=None):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("hstu attention: q, k, v must be [rows, H, D]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"hstu attention: q, k, v must share a dtype in fp16/bf16/fp32, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"hstu attention: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if seq_offsets.dtype not in (torch.int32, torch.int64) or seq_offsets.dim() != 1:
        raise ValueError("hstu attention: seq_offsets must be a 1-D int32/int64 tensor")
    if num_targets is not None and (num_targets.dim() != 1 or num_targets.shape[0] != seq_offsets.shape[0] - 1):
        raise ValueError(f"hstu attention: num_targets must have shape [B]={seq_offsets.shape[0] - 1}, "
                         f"got {tuple(num_targets.shape)}")  # the kernels read num_targets[b] for every b
    if max(q.shape[2], v.shape[2]) > 256:
        raise ValueError("hstu attention: head dims up to 256 are supported")


def _scale_args(attn_scale, max_seq_len, device, rows):
    """(SCALE_MODE, scale_const, tensor or None, stride); a per-row ``attn_scale`` must have ``rows`` rows."""
    if attn_scale is None:
        if isinstance(max_seq_len, int):
            return 0, 1.0 / max(max_seq_len, 1), None, 0
        # symbolic N under torch.compile: 1/N as a 0-d tensor computed at run time (a Python float
        # argument would specialise the compiled graph to one N); callers ensure N >= 1
        return 1, 1.0, torch.full((), 1.0, dtype=torch.float32, device=device) / max_seq_len, 0
    if attn_scale.numel() == 1:
        return 1, 1.0, attn_scale.reshape(()), 0
    if attn_scale.dim() != 1 or attn_scale.shape[0] != rows:
        raise ValueError(f"hstu attention: attn_scale must be a scalar or have shape [{rows}], "
                         f"got {tuple(attn_scale.shape)}")
    return 2, 1.0, attn_scale, attn_scale.stride(0)


def _n_bucket(max_seq_len) -> int:
    """The autotuning key for N (power of two); unused by the kernels' arithmetic, so a symbolic N
    is keyed by its compile-time value without a guard."""
    if type(max_seq_len) is int:  # eager calls: skip size_hint's import (host time per call)
        return _pow2(max_seq_len)
    return triton.next_power_of_2(_compat.size_hint(max_seq_len))


@functools.lru_cache(maxsize=256)
def _pow2(n: int) -> int:
    # memoised: triton.next_power_of_2 / triton.cdiv are constexpr-function wrappers costing ~5 us a call
    return triton.next_power_of_2(n)


def _seq_major() -> bool:
    """Tile order (:func:`_tile`). ``config.tile_order = "block"`` (``HSTU_INDUCTOR_TILE_ORDER=block``)
    selects the block-major order, for side-by-side benchmarks."""
    return config.get("tile_order") == "seq"


_SILU_MODES = {"exact": 0, "tanh": 1, "packed": 2}


def _fast_silu(dtype, device) -> int:
    """0: exp2-based fp32 silu; 1: fp32 tanh.approx; 2: packed bf16x2/f16x2 tanh + fma (16-bit on NVIDIA).

    ``config.silu`` (``HSTU_INDUCTOR_SILU=exact|tanh|packed``) picks it for 16-bit inputs."""
    if dtype == torch.float32 or device.type != "cuda" or _interpret() or torch.version.hip is not None:
        return 0
    return _SILU_MODES[config.get("silu")]


def _prec(dtype) -> str:
    """fp32 inputs: 3-pass tf32 (fp32-level accuracy on tensor cores) on GPU, IEEE in the interpreter."""
    if dtype != torch.float32:
        return "tf32"  # ignored for 16-bit operands
    return "ieee" if _interpret() else "tf32x3"


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, spec: AttentionSpec, delta_rows, tma,
         rab=None, intervals=None, timestamps=None, pos_w=None, ts_w=None, ts_bounds=None):
    _check_inputs(q, k, v, seq_offsets, num_targets)
    seq_offsets = address_source(seq_offsets)
    tab_args, tab_bnd, tab_flags = _tab_args(timestamps, pos_w, ts_w, q.shape[0], max_seq_len, ts_bounds,
                                             seq_offsets.shape[0] - 1, spec.ts_next, q.shape[1])
    rows, H, Dq = q.shape
    Dv = v.shape[2]
    B = seq_offsets.shape[0] - 1
    out = _new((rows, H, Dv), q.dtype, q.device)
    if rows == 0 or B <= 0 or H == 0 or max_seq_len <= 0:
        return out.zero_()
    if delta_rows == 0:  # cached attention reads a few rows of the map: it computes its buckets itself
        with _device_ctx(q.device):
            tab_args, tab_flags = with_bucket_map(tab_args, tab_bnd, tab_flags, seq_offsets, k.shape[0], B,
                                                  max_seq_len, spec, intervals)
    use_tma = _use_tma(tma, q.device, (q, k, v), max_seq_len)
    scale_mode, scale_const, scale_t, stride_s = _scale_args(attn_scale, max_seq_len, q.device, q.shape[0])
    flags = spec.kernel_flags(has_targets=num_targets is not None, has_intervals=intervals is not None)
    bdq, bdv = _block_d(Dq), _block_d(Dv)
    args = (q, k, v, out, seq_offsets, num_targets, scale_t,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), stride_s,  # one call each: all are 3-D
            float(alpha), float(scale_const), 1.0,
            H, Dq, Dv, k.shape[0], max_seq_len, delta_rows, *spec.kernel_lengths(), _n_bucket(max_seq_len)) + _rab_args(rab, B, H, max_seq_len) + _iv_args(intervals, H, rows) + tab_args \
        + tab_bnd
    if rab is not None:  # only then: without rab/intervals the launch (and the kernel) is the bias-free one
        flags["HAS_RAB"] = True
    flags.update(tab_flags)
    kwargs = dict(flags, SCALE_MODE=scale_mode, DELTA=delta_rows > 0, TMA=use_tma, SEQ_MAJOR=_seq_major(),
                  FAST=_fast_silu(q.dtype, q.device), PREC=_prec(q.dtype), EVEN_DQ=bdq == Dq, EVEN_DV=bdv == Dv,
                  BLOCK_DQ=bdq, BLOCK_DV=bdv)
    grid_rows = delta_rows if delta_rows > 0 else max_seq_len
    with _device_ctx(q.device):
        if use_tma:
            _ensure_allocator()
        _launch("fwd", grid_rows, B * H, max(bdq, bdv), args, kwargs, fp32=q.dtype == torch.float32)
    return out


def hstu_attention_fwd(q, k, v, seq_offsets, max_seq_len: int, alpha: float, num_targets=None, attn_scale=None,
                       max_attn_len: int = 0, contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0,
                       causal: bool = True, *, tma=None, rab=None, intervals=None, timestamps=None, pos_w=None,
                       ts_w=None, ts_bounds=None, ts_next=True, spec: Optional[AttentionSpec] = None) -> torch.Tensor:
    """Jagged HSTU attention forward: ``[L, H, Dv]`` in the dtype of ``q``. ``rab: [B|1, H|1, N, N]`` is added
    inside the silu; ``intervals: [H|1, L, 3]`` replaces the mask; ``pos_w: [2N-1]`` and/or ``ts_w:
    [num_buckets+1]`` with ``timestamps: [L]`` add the table bias computed in the kernel (docs/semantics.md);
    ``ts_bounds: [num_buckets]`` are its time-bucket thresholds (None: the default fp64-log bucket's);
    ``ts_next``: the gap of the time bucket is ``ts(next(i)) - ts(j)`` (the original HSTU), else ``ts(i) - ts(j)``.
    ``spec``: all mask options at once (what the ops pass), in place of the loose ones."""
    spec = spec or AttentionSpec(causal, max_attn_len, contextual_seq_len, min_full_attn_seq_len, ts_next)
    return _fwd(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, spec, 0, tma, rab, intervals,
                timestamps, pos_w, ts_w, ts_bounds)


def delta_hstu_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                             max_attn_len=0, contextual_seq_len=0, *, tma=None, spec=None) -> torch.Tensor:
    """Cached attention: ``delta_q: [B*D, H, Dq]`` are the last D rows of every sequence -> ``[B*D, H, Dv]``.

    Needs ``n_b >= D`` (rows of a shorter sequence that would precede its start come out as zeros).
    ``attn_scale``: None, a scalar, or one value per delta row ``[B*D]``.
    """
    B = seq_offsets.shape[0] - 1
    if B <= 0:
        return delta_q.new_zeros((delta_q.shape[0], delta_q.shape[1], v.shape[2]))
    D = delta_q.shape[0] // B
    if D * B != delta_q.shape[0]:
        raise ValueError(f"delta_q rows {delta_q.shape[0]} not a multiple of B={B}")
    if D == 0:
        return delta_q.new_zeros((0, delta_q.shape[1], v.shape[2]))
    spec = spec or AttentionSpec(True, max_attn_len, contextual_seq_len)
    return _fwd(delta_q, k, v, seq_offsets, max_seq_len, alpha, num_targets, attn_scale, spec, D, tma)


def hstu_attention_bwd(dout, q, k, v, seq_offsets, max_seq_len, alpha, num_targets=None, attn_scale=None,
                       max_attn_len=0, contextual_seq_len=0, min_full_attn_seq_len=0, causal=True, *,
                       deterministic=False, tma=None, rab=None, intervals=None, rab_grad=False, timestamps=None,
                       pos_w=None, ts_w=None, table_grad=False, ts_bounds=None, ts_next=True,
                       spec: Optional[AttentionSpec] = None):
    """Gradients (dq, dk, dv) of :func:`hstu_attention_fwd` (not of ``attn_scale``); ``d_rab`` (rab's shape and
    dtype, summed over its broadcast dims) appended when ``rab_grad``, then ``(d_pos_w, d_ts_w)`` (the
    tables' dtypes; None for an absent table) when ``table_grad``. ``spec`` as in :func:`hstu_attention_fwd`."""
    spec = spec or AttentionSpec(causal, max_attn_len, contextual_seq_len, min_full_attn_seq_len, ts_next)
    _check_inputs(q, k, v, seq_offsets, num_targets)
    seq_offsets = address_source(seq_offsets)
    L, H, Dq = q.shape
    Dv = v.shape[2]
    B = seq_offsets.shape[0] - 1
    rab_grad = bool(rab_grad) and rab is not None
    rab_args = _rab_args(rab, B, H, max_seq_len)
    iv_args = _iv_args(intervals, H, L)
    tab_args, tab_bnd, tab_flags = _tab_args(timestamps, pos_w, ts_w, L, max_seq_len, ts_bounds, B, spec.ts_next, H)
    table_grad = bool(table_grad) and bool(tab_flags)
    empty = L == 0 or B <= 0 or H == 0 or max_seq_len <= 0
    if not empty:
        with _device_ctx(q.device):  # the map kernel launches on the current device
            tab_args, tab_flags = with_bucket_map(tab_args, tab_bnd, tab_flags, seq_offsets, L, B, max_seq_len,
                                                  spec, intervals)
    # table gradients through a dense bias gradient reduced after the dK/dV kernel (kernels/table_grad.py);
    # a dense rab's own gradient takes the kernel's RAB_GRAD, and ``deterministic`` keeps the in-kernel sums
    dense_tab = table_grad and not empty and not rab_grad and not deterministic \
        and table_grad_buffer.use_dense_grad(tab_flags, _jit.MAP_HAS_TS, B, max_seq_len)
    if rab_grad or dense_tab or (table_grad and pos_w is not None):
        # d rab / d pos_w addresses follow the query block, whose range comes from num_targets (address_source)
        num_targets = address_source(num_targets)
    dk = _new((L, H, Dq), k.dtype, k.device)
    dv = _new((L, H, Dv), v.dtype, v.device)
    # d rab, scaled in the kernel (docs/kernels.md). No broadcast dim: every (b, h, i, j) has one writer,
    # stored straight into rab's shape and dtype (zeroed: skipped tiles and padding get 0). Broadcast
    # dims: fp32 atomics into rab's shape (no [B, H, N, N] buffer), cast after; with ``deterministic``,
    # the one-writer store into a [B, H, N, N] scratch in the inputs' dtype and a fixed-order sum instead.
    rab_mode, drab, scratch = 0, None, None
    if rab_grad:
        bcast = [d for d, size in ((0, B), (1, H)) if rab.shape[d] == 1 and size > 1]
        if not bcast:
            rab_mode, drab = 1, torch.zeros(rab.shape, device=q.device, dtype=rab.dtype)
        elif not deterministic:
            rab_mode, drab = 2, torch.zeros(rab.shape, device=q.device, dtype=torch.float32)
        else:
            rab_mode = 1
            scratch = drab = torch.zeros((B, H, max_seq_len, max_seq_len), device=q.device, dtype=q.dtype)
        g_strides = (drab.stride(0) if drab.shape[0] > 1 else 0, drab.stride(1) if drab.shape[1] > 1 else 0,
                     drab.stride(2), drab.stride(3))
        if _compat.size_hint(max_seq_len) > 46340:
            raise ValueError("hstu attention: rab gradients need max_seq_len <= 46340 (32-bit offsets)")
    elif dense_tab:  # the heads summed by fp32 atomics (one writer per element with one head)
        drab = torch.zeros((B, 1, max_seq_len, max_seq_len), device=q.device, dtype=torch.float32)
        rab_mode = 1 if H == 1 else 2
        g_strides = (drab.stride(0), 0, drab.stride(2), drab.stride(3))
    # table gradients: fp32 [copies, table] buffers reduced in the kernel, the copies summed here (a per-head
    # table: [copies, H, table], the kernel adds h times the table's length)
    copies = 1 if _interpret() else 32
    dpos = torch.zeros((copies, *pos_w.shape), device=q.device, dtype=torch.float32) \
        if table_grad and pos_w is not None else None
    dts = torch.zeros((copies, *ts_w.shape), device=q.device, dtype=torch.float32) \
        if table_grad and ts_w is not None else None

    def _ret(dq, dk, dv):
        got = (dq, dk, dv)
        if dense_tab:
            with _device_ctx(q.device):
                table_grad_buffer.reduce_table_grads(
                    drab, tab_args[0] if tab_flags.get("HAS_TS") == _jit.MAP_HAS_TS else None, seq_offsets, L,
                    max_seq_len, spec.keys_up_to_query(intervals is not None), dpos, dts, tab_args[3])
        if rab_grad:
            if scratch is not None:
                got += (scratch.to(torch.float32).sum(dim=bcast, keepdim=True).to(rab.dtype),)
            else:
                got += (drab.to(rab.dtype),)
        if table_grad:
            got += (None if dpos is None else dpos.sum(0).to(pos_w.dtype),
                    None if dts is None else dts.sum(0).to(ts_w.dtype))
        return got

    if empty:
        return _ret(torch.zeros_like(q, memory_format=torch.contiguous_format), dk.zero_(), dv.zero_())
    if dout.shape != (L, H, Dv):
        raise ValueError(f"dout must be {(L, H, Dv)}, got {tuple(dout.shape)}")
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    use_tma = _use_tma(tma, q.device, (q, k, v), max_seq_len)
    scale_mode, scale_const, scale_t, stride_s = _scale_args(attn_scale, max_seq_len, q.device, q.shape[0])
    flags = spec.kernel_flags(has_targets=num_targets is not None, has_intervals=intervals is not None)
    if rab is not None:  # only then: without rab/intervals the launches (and the kernels) are the bias-free ones
        flags["HAS_RAB"] = True
    flags.update(tab_flags)
    # Algorithm: "split" = dK/dV kernel + separate dQ kernel (no atomics, bitwise repeatable);
    # "atomic" = one kernel, dQ through fp32 atomics. Split is the default: with the sequence-major
    # tile order it measured faster at N <= 1024 and tied at 2048 (H100, benchmarks/RESULTS.md, 2026-11-22/23;
    # atomics win at N <= 1024 only in the block-major order, where every tile re-reads Q/dO from DRAM).
    # With the in-kernel table bias "auto" takes atomics: the bias is then evaluated in two kernels, not three.
    # config.bwd_algo = "atomic" | "split" (HSTU_INDUCTOR_BWD_ALGO) overrides.
    algo = config.get("bwd_algo")
    split = deterministic or algo == "split" or (algo == "auto" and not tab_flags)
    # With atomics, pointer loads measured faster than TMA loads in the dK/dV kernel: auto mode uses them.
    tma_dkdv = use_tma and (split or tma is True)
    if use_tma and not _tma_ok(dout):
        dout = dout.contiguous()
    bdq, bdv = _block_d(Dq), _block_d(Dv)
    common = dict(flags, SCALE_MODE=scale_mode, TMA=use_tma, SEQ_MAJOR=_seq_major(),
                  FAST=_fast_silu(q.dtype, q.device), PREC=_prec(q.dtype), EVEN_DQ=bdq == Dq, EVEN_DV=bdv == Dv,
                  BLOCK_DQ=bdq, BLOCK_DV=bdv)
    tail = (float(alpha), float(scale_const), H, Dq, Dv, L, max_seq_len, *spec.kernel_lengths(),
            _n_bucket(max_seq_len))
    if split:
        dq = _new((L, H, Dq), q.dtype, q.device)
        dq_acc = None
        dq_mode = 0
        sdq = (0, 0)
    else:
        dq_acc = torch.zeros((L, H, Dq), dtype=torch.float32, device=q.device)
        # dQ accumulation: 1 = fp32 pointer atomics (default: measured faster than TMA bulk reduce-add on
        # H200), 2 = TMA reduce-add, 3 = vectorized red.v2 (sm90, even head dim). config.dq_mode.
        dq_mode = config.get("dq_mode")
        if dq_mode == 2 and not (tma_dkdv and not _interpret() and _tma_ok(dq_acc)):
            dq_mode = 1
        if dq_mode == 3 and (_interpret() or q.device.type != "cuda" or bdq != Dq):
            dq_mode = 1
        sdq = (dq_acc.stride(0), dq_acc.stride(1))
    args = (q, k, v, dout, dq_acc, dk, dv, seq_offsets, num_targets, scale_t,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
            sdq[0], sdq[1], dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), stride_s) + tail + rab_args \
        + iv_args + ((drab,) + g_strides if rab_mode else (None, 0, 0, 0, 0)) + tab_args \
        + (dpos, dts, copies, dpos.stride(0) if dpos is not None else 0, dts.stride(0) if dts is not None else 0) \
        + tab_bnd
    dkdv_kw = dict(common, DQ_MODE=dq_mode, TMA=tma_dkdv)
    if rab_mode:
        dkdv_kw["RAB_GRAD"] = rab_mode
    if table_grad and not dense_tab:
        dkdv_kw["TAB_GRAD"] = True
    with _device_ctx(q.device):
        if use_tma:
            _ensure_allocator()
        zero_extra = tuple(name for name, t in (("DRAB", drab if rab_mode == 2 else None), ("DPOS", dpos),
                                                ("DTS", dts)) if t is not None)
        _launch("dkdv", max_seq_len, B * H, max(bdq, bdv), args, dkdv_kw, atomic_dq=not split, zero_extra=zero_extra,
                fp32=q.dtype == torch.float32)
        if split:
            args = (q, k, v, dout, dq, seq_offsets, num_targets, scale_t,
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                    dq.stride(0), dq.stride(1), stride_s, float(alpha), float(scale_const), 1.0) + tail[2:] \
                + rab_args + iv_args + tab_args + tab_bnd
            _launch("dq", max_seq_len, B * H, max(bdq, bdv), args, common, fp32=q.dtype == torch.float32)
        else:
            dq = dq_acc if q.dtype == torch.float32 else _new((L, H, Dq), q.dtype, q.device)
            numel = dq_acc.numel()
            block = 4096 if not _interpret() else 1024
            fin_args = (dq_acc, dq, scale_t, numel, float(alpha) * (scale_const if scale_mode == 0 else 1.0))
            _launcher(_dq_finalize_kernel, fin_args)[(triton.cdiv(numel, block),)](
                *fin_args, SCALE_MODE=1 if scale_mode == 1 else 0, BLOCK=block)
    return _ret(dq, dk, dv)
