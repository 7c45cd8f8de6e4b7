"""One Triton kernel for all value checks of the jagged inputs (eager CUDA calls of the ops).

The traceable check of ``ops/_checks.py`` is about 15 small ATen ops (slices, compares, ``all``,
``stack``, ``_assert_async``): inside a compiled graph Inductor fuses them, but a direct eager call
pays one host launch each (about 0.1 ms of host time). :func:`check_jagged` does the
same checks in one launch, ending in ``tl.device_assert`` (compiled with ``debug=True``): like
``torch._assert_async`` on CUDA, a failure is a device-side assert and no host sync is needed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fastlaunch

__all__ = ["check_jagged"]

_BLOCK = 256  # sequences per program; fixed, so one compile serves every batch size


# The sizes change from call to call (L with every batch): no integer specialisation, so they never
# trigger a recompile.
_SIZES = ["B", "total_len", "max_seq_len", "min_length"]


@triton.jit(debug=True, do_not_specialize=_SIZES)
def _check_jagged_kernel(OFFSETS, NUM_TARGETS, OK, B, total_len, max_seq_len, min_length, HAS_TGT: tl.constexpr,
                         WRITE_OK: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = b < B
    lo = tl.load(OFFSETS + b, mask=live, other=0)
    hi = tl.load(OFFSETS + b + 1, mask=live, other=0)
    n = hi - lo
    ok = (n >= 0) & (n <= max_seq_len) & (n >= min_length)
    if HAS_TGT:
        t = tl.load(NUM_TARGETS + b, mask=live, other=0)
        ok = ok & (t >= 0) & (t <= n)
    ok = ok | (b >= B)
    ok = ok & (tl.load(OFFSETS) == 0) & (tl.load(OFFSETS + B) == total_len)
    if WRITE_OK:  # tests: the interpreter compiles device_assert away (no debug option there)
        tl.store(OK + tl.program_id(0), tl.min(ok.to(tl.int32), axis=0))
    # the message of the ATen spelling's single assert (ops/_checks.py::_ALL)
    tl.device_assert(ok, "hstu attention: invalid jagged inputs (need offsets[0]=0, non-decreasing, offsets[-1]=L, "
                     "lengths <= max_seq_len, 0 <= num_targets <= length); config.check_inputs='always' names "
                     "the failed one")


def check_jagged(offsets, total_len: int, max_seq_len: int, num_targets=None, min_length: int = 0, ok_out=None) -> None:
    """Assert on the device, in one launch, what ``ops/_checks.py::_flags`` checks: ``offsets[0] == 0``,
    ``0 <= length <= max_seq_len``, ``offsets[-1] == total_len``, ``0 <= num_targets <= length``,
    ``length >= min_length``. ``offsets``: 1-D int32/int64 (``B + 1 >= 1`` entries, contiguous);
    ``num_targets``: ``[B]`` integers on the same device, or None. Launched directly (plain eager only).
    ``ok_out`` (tests): an int32 tensor of ``grid`` entries, set to 1 where a program's checks held."""
    dev = offsets.device
    if dev.type == "cuda" and dev.index != torch.cuda.current_device():  # Triton launches on the current device
        with torch.cuda.device(dev):
            return check_jagged(offsets, total_len, max_seq_len, num_targets, min_length, ok_out)
    B = offsets.shape[0] - 1
    grid = (max(1, (B + _BLOCK - 1) // _BLOCK),)  # B == 0 still checks offsets[0] == 0 == L; not triton.cdiv: ~5 us
    # through the cached launcher (fastlaunch.py): Triton's own kernel[grid] path is most of this call's host time
    fastlaunch.launch(_check_jagged_kernel, grid,
                      (offsets, num_targets if num_targets is not None else offsets, ok_out, B, int(total_len),
                       int(max_seq_len), int(min_length)),
                      dict(HAS_TGT=num_targets is not None, WRITE_OK=ok_out is not None, BLOCK=_BLOCK))
