"""``AttentionSpec``: the scalar options of one HSTU attention call, as one frozen value.

The mask (``causal``, the window ``max_attn_len``, the contextual prefix ``contextual_seq_len``, the
full-attention tail ``min_full_attn_seq_len``) and the option of the table bias (``ts_next``) travel together
from the pattern's proof to the kernels. This class is the one place that

* validates them (one message per rule, for eager calls and under tracing alike: :meth:`validate`);
* flattens them at the ``torch.library`` schema boundary (:meth:`op_args` / :meth:`from_op_args`: the op
  schemas keep plain ints and bools, which export, AOTI and opcheck handle);
* derives the kernels' compile-time switches and run-time lengths (:meth:`kernel_flags`,
  :meth:`kernel_lengths`);
* says which kernel variants can serve it (:attr:`plain_causal`, read by ``ops/variants.py``).

Tensors (``num_targets``, ``attn_scale``, the bias inputs) stay op arguments: their presence is passed to
the methods that depend on it. Semantics of every option: docs/semantics.md.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Union

import torch

__all__ = ["AttentionSpec", "KernelMask", "KERNEL_LENGTHS"]

IntLike = Union[int, torch.SymInt]

# the Python type torch.library's schema inference reads for each field annotation (int -> SymInt)
_SCHEMA_TYPES = {"bool": bool, "IntLike": int, "int": int, "float": float}


def _schema_type(annotation):
    if isinstance(annotation, str):  # this module's annotations are strings (postponed evaluation)
        return _SCHEMA_TYPES[annotation]
    return int if annotation is IntLike else annotation

_MASK_RESET = ("num_targets, max_attn_len, contextual_seq_len and min_full_attn_seq_len must then be unset/0")


class KernelMask:
    """Bits of the attention kernels' constexpr switch set ``MASK`` (:meth:`AttentionSpec.kernel_flags`; read only
    by the helpers of ``kernels/attention_jit.py``)."""
    CAUSAL = 1
    TARGETS = 2
    CONTEXT = 4
    WINDOW = 8
    MINFULL = 16


# The kernels take four run-time mask lengths (ML0..ML3, :meth:`AttentionSpec.kernel_lengths`); ML3 is free for
# the next option that needs one, so that adding it does not change the kernels' signatures.
KERNEL_LENGTHS = 4


def _require(cond, msg) -> None:
    """``torch._check`` raising ValueError: a clear message on eager calls, a guard or runtime assert on
    symbolic values while tracing (under Dynamo without the message: its closure may only hold constants)."""
    if torch.compiler.is_compiling():
        torch._check(cond)
    else:
        torch._check_with(ValueError, cond, msg)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Scalar options of one jagged HSTU attention call (docs/semantics.md)."""

    causal: bool = True
    max_attn_len: IntLike = 0
    contextual_seq_len: IntLike = 0
    min_full_attn_seq_len: IntLike = 0
    # the time gap of the table bias: ts(next(i)) - ts(j) (the original HSTU) when True, ts(i) - ts(j) else
    ts_next: bool = True

    # The mask options in the order of the ops' positional schema (after ``attn_scale``; ``ts_next`` is the
    # forward's last argument). That layout is public: exported programs and callers pass them by position.
    OP_FIELDS = ("max_attn_len", "contextual_seq_len", "min_full_attn_seq_len", "causal")
    POSITIONAL = OP_FIELDS + ("ts_next",)

    @classmethod
    def from_op_args(cls, max_attn_len, contextual_seq_len, min_full_attn_seq_len, causal, ts_next: bool = True,
                     **added) -> "AttentionSpec":
        return cls(causal=bool(causal), max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
                   min_full_attn_seq_len=min_full_attn_seq_len, ts_next=bool(ts_next), **added)

    def op_args(self) -> tuple:
        """The mask options in schema order (:attr:`OP_FIELDS`)."""
        return tuple(getattr(self, name) for name in self.OP_FIELDS)

    def keys_up_to_query(self, has_intervals: bool) -> bool:
        """True when no mask option lets a query read a key after it (causal, no contextual prefix, no
        intervals, every option added later at its default): the ``j > i`` half of an ``N x N`` map of the
        table bias is never read. A symbolic contextual length counts as nonzero."""
        from ._compat import guarded

        return (not has_intervals and self.causal and guarded(self.contextual_seq_len == 0)
                and all(getattr(self, f.name) == f.default for f in self.added_fields()))

    # ------------------------------------------------------------------ options added later

    @classmethod
    def added_fields(cls) -> list:
        """Fields beyond the positional layout: keyword-only arguments at the end of every attention op."""
        return [f for f in dataclasses.fields(cls) if f.name not in cls.POSITIONAL]

    def added_op_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in self.added_fields()}

    @classmethod
    def op_params(cls, fn):
        """Decorator for an op body taking ``**added``: its signature (from which ``torch.library`` infers the
        schema) gains one keyword-only parameter per added field, so that a new option reaches every attention
        op, its autograd formula and the kernels without editing them."""
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                     annotation=_schema_type(f.type)) for f in cls.added_fields()]
        fn.__signature__ = sig.replace(parameters=params)
        return fn

    # ------------------------------------------------------------------ validation

    def _rules(self, has_targets: bool, has_intervals: bool) -> list:
        """``(holds, message)`` for every rule of the options: the one list :meth:`validate` and :meth:`holds`
        read."""
        rules = [(getattr(self, name) >= 0, lambda name=name: f"{name} must be >= 0, got {getattr(self, name)}")
                 for name in ("max_attn_len", "contextual_seq_len", "min_full_attn_seq_len")]
        unset = not has_targets and self.max_attn_len == 0 and self.contextual_seq_len == 0 \
            and self.min_full_attn_seq_len == 0
        rules.append((self.causal or unset,
                      lambda: f"causal=False means full attention inside each sequence; {_MASK_RESET}"))
        if has_intervals:
            rules.append((unset, lambda: f"intervals replace the causal/targets/window/contextual mask: {_MASK_RESET}"))
        return rules

    def validate(self, *, has_targets: bool = False, has_intervals: bool = False) -> None:
        """Raise ValueError for options that mean nothing together."""
        for ok, message in self._rules(has_targets, has_intervals):
            _require(ok, message)

    def holds(self, *, has_targets: bool = False) -> bool:
        """The rules of :meth:`validate` (without intervals) as one bool, for plain int options: the ops' eager
        fast path, which skips the validators (and their ``torch._check`` calls) when everything holds."""
        return all(ok for ok, _ in self._rules(has_targets, False))

    # ------------------------------------------------------------------ kernels

    def kernel_flags(self, *, has_targets: bool, has_intervals: bool = False) -> dict:
        """The attention kernels' constexpr mask switches (validated first): ``MASK``, a set of
        :class:`KernelMask` bits, and ``HAS_IV`` with intervals."""
        self.validate(has_targets=has_targets, has_intervals=has_intervals)
        if has_intervals:  # the interval mask alone decides; no HSTU switch keeps the id helpers trivial
            return dict(MASK=0, HAS_IV=True)
        return dict(MASK=self.kernel_mask(has_targets))

    def kernel_mask(self, has_targets: bool) -> int:
        if not self.causal:
            return 0
        bits = KernelMask.CAUSAL
        if has_targets:
            bits |= KernelMask.TARGETS
        if self.contextual_seq_len > 0:
            bits |= KernelMask.CONTEXT
        if self.max_attn_len > 0:
            bits |= KernelMask.WINDOW
            if self.min_full_attn_seq_len > 0:
                bits |= KernelMask.MINFULL
        return bits

    def kernel_lengths(self) -> tuple:
        """``(ML0, ML1, ML2, ML3)``, the kernels' run-time mask lengths: contextual prefix, window, full-attention
        tail, and 0 (free)."""
        return int(self.contextual_seq_len), int(self.max_attn_len), int(self.min_full_attn_seq_len), 0

    # ------------------------------------------------------------------ variant scopes

    @property
    def plain_causal(self) -> bool:
        """Causal, with no window, contextual prefix or full-attention tail (static zeros): the mask of the
        warp-specialised kernels."""
        if not self.causal:
            return False
        return all(isinstance(x, int) and x == 0
                   for x in (self.max_attn_len, self.contextual_seq_len, self.min_full_attn_seq_len))
