"""Module state read by value: the buffers and frozen parameters of a model, at compile time.

A mask kept as a registered buffer (the original HSTU's ``triu(ones(N, N), 1)``) is a graph input
whose value the proof needs. The backend hands the values of such inputs over for the graph being
rewritten (:func:`known`); the value interpreter reads them (``core.tables`` recognises their closed
form, exhaustively) and records each one it read (:func:`record`). A rewrite that rests on a value is
guarded by the backend (``backend.ConstantGuard``): while the tensor is the same object, unchanged
(same storage, same version counter), the rewritten graph runs; otherwise the stock compile of the
original graph does. It never computes with a stale value.

Inputs are identified by their position among the graph's placeholders (the Dynamo graph and its ATen
retrace have the same inputs, in the same order).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

_local = threading.local()


@contextlib.contextmanager
def known(values: Optional[dict]):
    """Inside: ``values`` (placeholder position -> tensor) are the constants of the graph rewritten."""
    before = getattr(_local, "state", None)
    _local.state = ({} if values is None else dict(values), set())
    try:
        yield
    finally:
        _local.state = before


def _position(node) -> int:
    return next(i for i, p in enumerate(node.graph.find_nodes(op="placeholder")) if p is node)


def value(node) -> Optional[torch.Tensor]:
    """The compile-time value of placeholder ``node``, when it is module state; else None."""
    state = getattr(_local, "state", None)
    if state is None or node.op != "placeholder" or not state[0]:
        return None
    return state[0].get(_position(node))


def record(node) -> None:
    state = getattr(_local, "state", None)
    if state is not None:
        state[1].add(_position(node))


def used() -> set:
    """Positions of the constants read by rewrites so far (the caller guards them)."""
    state = getattr(_local, "state", None)
    return set(state[1]) if state is not None else set()


def restore(positions: set) -> None:
    """Forget reads made since ``positions`` was taken (a candidate that was declined)."""
    state = getattr(_local, "state", None)
    if state is not None:
        state[1].intersection_update(positions)


def module_state(gm: torch.fx.GraphModule, example_inputs) -> dict:
    """Placeholder position -> value for the inputs of a Dynamo graph that are module buffers or
    parameters that do not require grad (Dynamo's source names say which)."""
    out = {}
    for i, (p, x) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        arg = p.meta.get("grapharg")
        src = getattr(getattr(arg, "source", None), "name", "")
        src = src() if callable(src) else str(src)
        if not isinstance(x, torch.Tensor) or type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
            continue
        if "._buffers[" in src or ("._parameters[" in src and not x.requires_grad):
            out[i] = x
    return out
