"""A small concrete instance run beside the generaliser's fake trace (``generalize._Generaliser``).

One sequence of N rows gives a graph with ``L == N`` (or ``L`` within 2 of ``N``), and a literal of
that value may stand for either size: the shapes cannot tell ``arange(N)`` (positions) from
``arange(L)`` (rows), a clamp at ``N - 1`` from one at ``L - 1``, or a sentinel row ``N`` from ``L``.
The sizes differ on any other input, so the generalised graph is also run, node by node, on one
valid jagged input where they do (one sequence of ``L < N`` rows, small): a reading that indexes
out of range there, or that leaves the candidate's output without the jagged rows, contradicts its
choice, which is revised like a shape error. This only steers the choices; the proof on the
generalised graph is what makes a rewrite sound, and where no reading runs here the unsteered
choices are taken as before.
"""
from __future__ import annotations

import sympy
import torch

from .. import _compat
from .prover import sym_expr

_N, _L = 11, 6  # small N and L, apart by more than the +-1 / +-2 of sentinel rows and clamps


def coincide(sizes) -> bool:
    """A batch of one whose row count is within 2 of a max length: literals of sizes are ambiguous."""
    return sizes.B is None and sizes.L is not None and any(abs(sizes.L - n) <= 2 for n in sizes.Ns)


class SmallInstance:
    """Concrete values of the generalised graph's nodes at one small binding of its symbols."""

    def __init__(self, binding: dict, vals: dict):
        self.binding, self.vals = binding, vals
        self.on = True

    @classmethod
    def build(cls, g):
        """The instance for generaliser ``g`` after its placeholders, or None where its inputs are
        not all understood (another symbol, a jagged descriptor that is not a placeholder)."""
        if g.sizes.descriptor is None or g.sizes.B is not None:
            return None
        binding = {}
        for expr, _, kind in g.named_atoms:
            if isinstance(expr, sympy.Symbol):
                binding[expr] = _N if kind == "N" else _L
        for i, base in enumerate(g.const_bases):  # mask constants: small, distinct, below _N
            for s in sympy.sympify(g.consts[base]).free_symbols:
                binding[s] = 2 + i
        gen = torch.Generator().manual_seed(0)
        vals = {}
        for ph in g.graph.find_nodes(op="placeholder"):
            v = ph.meta.get("val")
            if isinstance(v, torch.SymInt):
                x = sympy.sympify(sym_expr(v)).subs(binding)
                if not x.is_Integer:
                    return None
                vals[ph] = int(x)
            elif isinstance(v, torch.Tensor):
                t = _tensor(ph.name, v, g.sizes, binding, gen)
                if t is None:
                    return None
                vals[ph] = t
            else:
                vals[ph] = v
        return cls(binding, vals)

    def value(self, a):
        if isinstance(a, torch.fx.Node):
            if a in self.vals:
                return self.vals[a]
            v = a.meta.get("val")
            if isinstance(v, torch.SymInt):
                x = sympy.sympify(sym_expr(v)).subs(self.binding)
                if x.is_Integer:
                    return int(x)
            raise KeyError(a.name)
        return a

    def constant(self, node, obj) -> None:
        if isinstance(obj, torch.Tensor) and _is_fake(obj):
            self.on = False
        self.vals[node] = obj

    def step(self, node, target, args, kwargs) -> None:
        """Run ``node`` on the instance; raises what the op raises (a contradiction)."""
        if not self.on:
            return
        try:
            a = torch.fx.node.map_aggregate(args, self.value)
            k = torch.fx.node.map_aggregate(kwargs, self.value)
        except KeyError:  # an input it has no value for: stop steering, the proof decides
            self.on = False
            return
        with _compat.no_fake_mode(), torch.no_grad():
            self.vals[node] = target(*a, **k)

    def rows_ok(self, out, rows_real: int, L_real) -> bool:
        """The candidate's output keeps the jagged rows (its first dim is L here when it was L)."""
        v = self.vals.get(out) if self.on else None
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or rows_real != L_real:
            return True
        return int(v.shape[0]) == _L


def _tensor(name, v, sizes, binding, gen):
    def ints(exprs):
        out = [sympy.sympify(sym_expr(s)).subs(binding) for s in exprs]
        return [int(x) for x in out] if all(x.is_Integer for x in out) else None

    shape, stride = ints(v.shape), ints(v.stride())
    if shape is None or stride is None:
        return None
    with _compat.no_fake_mode():
        if name == sizes.descriptor:  # one sequence of _L rows
            want = [_L] if sizes.lengths else [0, _L]
            return torch.tensor(want, dtype=v.dtype) if shape == [len(want)] else None
        t = torch.empty_strided(shape, stride, dtype=v.dtype)
        if v.is_floating_point():
            return t.copy_(torch.randn(shape, generator=gen, dtype=torch.float64))
        if v.dtype is torch.bool:
            return t.copy_(torch.rand(shape, generator=gen) < 0.5)
        return t.zero_()  # num_targets and other integer inputs: 0 is valid for all of them


def _is_fake(t) -> bool:
    return hasattr(t, "fake_mode")
