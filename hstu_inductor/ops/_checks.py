"""Value checks of the jagged inputs that survive torch.compile and AOTInductor.

The ``hstu::*`` attention ops are what lands in a compiled graph, and their bodies are traced with
fake tensors: a host check (``int(offsets[0]) == 0``) cannot run there and would vanish from the
graph. :func:`check_jagged_values` therefore spells the checks as tensor ops ending in
``torch._assert_async``, which Inductor lowers to an assert inside its generated code (C++ on CPU:
a ``RuntimeError`` with our message; Triton on CUDA: ``tl.device_assert``) and AOTI packages keep.

``hstu_inductor.config.check_inputs`` picks how (docs/inputs.md):

* ``"auto"`` (default): CPU checks synchronously with messages naming the problem (eager: with the
  offending values); CUDA uses one device-side assert per call, so the hot path has no host sync.
  A plain eager CUDA call does all checks in one Triton launch (``kernels/checks.py``) instead of the
  ~15 ATen ops below, which cost ~0.1 ms of host time per call; traced code keeps the ATen
  spelling, which Inductor fuses and AOTI packages keep.
* ``"always"``: the synchronous, named checks on CUDA too (one device-to-host copy per call).
* ``"off"``: no value checks (the kernels stay memory-safe; results for invalid inputs are unspecified).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import config
from .._compat import plain_eager
from ..reference.jagged import _is_concrete, lengths_from_offsets, require, validate_jagged
from ._kernels import fused_check

__all__ = ["check_jagged_values"]

# One message per condition (plain text: Inductor puts it into a C++ string literal).
_MESSAGES = (
    "hstu attention: seq_offsets[0] must be 0",
    "hstu attention: seq_offsets must be non-decreasing",
    "hstu attention: seq_offsets[-1] must equal the number of jagged rows L",
    "hstu attention: every sequence length (seq_offsets[b+1] - seq_offsets[b]) must be <= max_seq_len",
    "hstu attention: num_targets[b] must satisfy 0 <= num_targets[b] <= length of sequence b",
    "hstu delta attention: every sequence needs at least D rows (D = delta_q rows / B)",
)
# torch._assert_async's CUDA message is limited to 254 characters (a longer one raises on every call)
_ALL = ("hstu attention: invalid jagged inputs (need offsets[0]=0, non-decreasing, offsets[-1]=L, "
        "lengths <= max_seq_len, 0 <= num_targets <= length); config.check_inputs='always' names the failed one")
assert len(_ALL) < 255


def _flags(offsets: Tensor, total_len, max_seq_len, num_targets: Optional[Tensor], min_length: int) -> Tensor:
    """One bool per condition of ``_MESSAGES`` (True: holds), as a ``[6]`` tensor on the offsets' device.
    Reads no data on the host, so it traces under fake tensors with symbolic ``L`` / ``max_seq_len``."""
    lengths = lengths_from_offsets(offsets)
    if num_targets is not None:
        nt = num_targets.to(device=offsets.device)
        targets_ok = ((nt >= 0) & (nt <= lengths)).all()
    else:
        targets_ok = offsets.new_ones((), dtype=torch.bool)
    return torch.stack([
        offsets[:1].eq(0).all(),
        lengths.ge(0).all(),
        offsets[-1:].eq(total_len).all(),
        lengths.le(max_seq_len).all(),
        targets_ok,
        lengths.ge(min_length).all(),
    ])


def _fused_ok(offsets: Tensor, num_targets: Optional[Tensor]) -> bool:
    """The one-launch check applies: a plain eager call (real tensors, nothing traced, so Python ints for
    the sizes) with unit-stride metadata on one device (the kernel indexes densely) and kernels on."""
    return (plain_eager(offsets, num_targets) and offsets.stride(0) == 1
            and (num_targets is None or (num_targets.device == offsets.device and num_targets.stride(0) == 1))
            and fused_check() is not None)


def check_jagged_values(offsets: Tensor, total_len, max_seq_len, num_targets: Optional[Tensor] = None,
                        min_length: int = 0) -> None:
    """Check the values of the jagged metadata as ``config.check_inputs`` says (see the module doc).
    Shapes and dtypes must already be validated (``validate_attention_inputs``)."""
    mode = config.check_inputs
    if mode == "off":
        return
    sync = offsets.device.type != "cuda" or mode == "always"
    if sync and _is_concrete(offsets) and (num_targets is None or _is_concrete(num_targets)):
        # eager: host checks whose messages carry the offending values
        validate_jagged(offsets, total_len, max_seq_len, num_targets)
        if min_length and offsets.shape[0] > 1:
            require(bool((lengths_from_offsets(offsets) >= min_length).all()),
                    lambda: f"hstu delta attention: every sequence needs at least D={min_length} rows")
        return
    if not sync and _fused_ok(offsets, num_targets):
        fused_check()(offsets, total_len, max_seq_len, num_targets, min_length)
        return
    flags = _flags(offsets, total_len, max_seq_len, num_targets, min_length)
    if sync:
        flags = flags.cpu()  # no-op on CPU; CUDA "always": the one host sync, errors stay catchable
        for ok, msg in zip(flags.unbind(0), _MESSAGES):
            torch._assert_async(ok, msg)
    else:
        torch._assert_async(flags.all(), _ALL)
