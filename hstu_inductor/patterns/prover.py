"""Numerical prover for pattern candidates: evaluate extracted subgraphs on fresh probe inputs.

The attention rewriter splits a candidate into pieces whose meaning is fixed by the jagged
semantics (pad, score function, unpad); ``attn_prove`` checks each piece with these tools by running the
*user's own ATen nodes* on random probe inputs and comparing with the semantic reference
(``hstu_inductor.reference``). Pieces:

* :func:`closure` / :func:`evaluate`: the backward closure of some nodes, cut at chosen leaves,
  executed eagerly (floating dtypes promoted to float64, every device mapped to CPU, SymInts
  bound to the probe's sizes).
* :func:`make_probes`: random jagged lengths in ``[0, N]`` (including 0, 1 and N), random
  ``num_targets`` in ``[0, n_b]``; sizes fixed where the graph is static, small where symbolic;
  :func:`probe_values`: random values exact in float32 and never 0.
* :func:`mask_candidates` / :func:`valid_at`: the candidate mask parameters, filtered cheaply,
  confirmed on the full reference mask (``reference.hstu_mask``).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import random
from typing import Iterable, Optional

import sympy
import torch

from .. import _compat
from . import constants
from ..reference import hstu_mask, jagged_to_padded
from ..reference.mask import hstu_valid
from ..spec import AttentionSpec

aten = torch.ops.aten


class Decline(Exception):
    """A candidate is not (provably) HSTU attention; the message is the near-miss reason."""


class TooLarge(Decline):
    """The numeric probes would be too large at these sizes (they only cross-check the value-level
    proof, which does not depend on the sizes)."""


class Unprobeable(TooLarge):
    """The probes cannot take these sizes (a static row count that their lengths must sum to, while
    the jagged rows are an unbacked symbol): like :class:`TooLarge`, the cross-check is skipped."""


# ---------------------------------------------------------------------------------------------
# Subgraph closure and evaluation


def closure(outputs: Iterable[torch.fx.Node], leaves: set) -> tuple[list, set]:
    """Nodes needed to compute ``outputs`` when ``leaves`` are given. Returns ``(nodes in graph
    order, leaf nodes reached)``; placeholders, get_attr nodes and ``sym_size`` reads are leaves
    too (a size read is a SymInt like a size placeholder: export graphs spell L that way)."""
    seen, reached = set(), set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in leaves or n.op in ("placeholder", "get_attr") or n.target is aten.sym_size.int:
            reached.add(n)
            continue
        for a in n.all_input_nodes:
            stack.append(a)
    order = [n for n in next(iter(outputs)).graph.nodes if n in seen and n not in reached]
    return order, reached


def attribute(gm, target: str):
    """The module attribute a ``get_attr`` node reads (dotted path)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _to_probe(x):
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64
    if isinstance(x, torch.device):
        return torch.device("cpu")
    return x


_SKIP = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default}


def _no_double(target) -> bool:
    ns = getattr(target, "namespace", None) or getattr(getattr(target, "_schema", None), "name", "").split("::")[0]
    return ns == "fbgemm"


def _to_cpu(x):
    return torch.device("cpu") if isinstance(x, torch.device) else x


def evaluate(gm: torch.fx.GraphModule, order: list, env: dict, native: bool = False) -> dict:
    """Run ``order`` (graph order) eagerly on ``env`` (node -> concrete value); returns env.
    ``native``: keep the graph's dtypes (only devices are mapped to CPU), for subgraphs whose
    rounding is their meaning (a time bucket computed in float32)."""
    env = dict(env)
    conv = _to_cpu if native else _to_probe

    def load(a):
        if isinstance(a, torch.fx.Node):
            if a not in env:
                if a.op == "get_attr" or (a.op == "placeholder" and constants.value(a) is not None):
                    obj = attribute(gm, a.target) if a.op == "get_attr" else constants.value(a)
                    env[a] = obj.detach().to("cpu").to(torch.float64) if obj.is_floating_point() and not native \
                        else obj.detach().cpu()
                else:
                    raise Decline(f"probe evaluation reached an unbound input {a.name}")
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(load(x) for x in a)
        if isinstance(a, dict):
            return {k: load(v) for k, v in a.items()}
        return conv(a)

    for n in order:
        if n.op != "call_function":
            raise Decline(f"cannot evaluate {n.op} node {n.name}")
        if n.target in _SKIP:
            continue
        if n.target is aten.empty.memory_format or n.target is aten.new_empty.default or \
                n.target is aten.empty_like.default:
            raise Decline(f"uninitialised tensor {n.name} in the candidate")
        args, kwargs = load(n.args), load(n.kwargs)
        try:
            if _no_double(n.target) and not native:  # e.g. fbgemm CPU kernels: run in float32, exact for data movement
                down = lambda a: a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.float64 else a  # noqa
                args = torch.utils._pytree.tree_map(down, args)
                res = n.target(*args, **kwargs)
                env[n] = torch.utils._pytree.tree_map(
                    lambda a: a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a, res)
            else:
                env[n] = n.target(*args, **kwargs)
        except Decline:
            raise
        except Exception as e:  # shape mismatch at probe sizes: the subgraph is not size-generic
            raise Decline(f"could not evaluate {n.name} ({getattr(n.target, '__name__', n.target)}) on a probe: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:120]}") from e
    return env


# ---------------------------------------------------------------------------------------------
# Symbolic sizes


def sym_expr(x):
    if isinstance(x, torch.SymInt):
        return x.node.expr
    if isinstance(x, sympy.Expr):
        return x
    return sympy.Integer(int(x))




def hints(*vals) -> dict:
    """Symbol -> hint value for every symbol in the shape env of ``vals``."""
    for v in vals:
        if isinstance(v, torch.Tensor):
            for s in v.shape:
                if isinstance(s, torch.SymInt):
                    return _compat.shape_env_hints(s.node.shape_env)
        if isinstance(v, torch.SymInt):
            return _compat.shape_env_hints(v.node.shape_env)
    return {}


def solve_binding(pairs: list, base: dict) -> dict:
    """Extend ``base`` (symbol -> int) so that every ``expr == value`` in ``pairs`` holds."""
    binding = dict(base)
    for expr, value in pairs:
        expr = sym_expr(expr) if not isinstance(expr, sympy.Expr) else expr
        free = list(expr.free_symbols)
        if not free:
            if int(expr) != value:
                raise Unprobeable(f"static size {expr} cannot take probe value {value}")
            continue
        if len(free) != 1:
            raise Decline(f"size {expr} has several symbols")
        if expr.is_Symbol:  # the common case, without sympy.solve (probes bind sizes many times)
            binding[expr] = int(value)
            continue
        a, b = sympy.Poly(expr, free[0]).all_coeffs() if expr.is_polynomial(free[0]) and \
            sympy.degree(expr, free[0]) == 1 else (None, None)
        if a is not None and a.is_Integer and b.is_Integer and (value - b) % a == 0:
            binding[free[0]] = int((value - b) // a)
            continue
        sol = sympy.solve(sympy.Eq(expr, value), free[0])
        if len(sol) != 1 or not sol[0].is_Integer:
            raise Decline(f"cannot bind {expr} = {value}")
        binding[free[0]] = int(sol[0])
    return binding


def substitute(e, binding: dict):
    """``e`` with the symbols of ``binding`` replaced by their values (``xreplace``: a plain
    structural substitution, ~20x cheaper than ``subs``; sizes are polynomials, FloorDiv ...)."""
    if not binding or e.is_number:
        return e
    return e.xreplace({k: sympy.Integer(v) if isinstance(v, int) else v for k, v in binding.items()})


def concrete(x, binding: dict) -> int:
    if isinstance(x, int):
        return x
    e = substitute(sym_expr(x) if not isinstance(x, sympy.Expr) else x, binding)
    if not e.is_Integer and isinstance(x, torch.SymInt):
        # an unbacked size (a data-dependent op kept in the graph) that a runtime assert ties to
        # another size: the shape env's replacements say which
        e = substitute(x.node.shape_env.replace(sym_expr(x)), binding)
    if not e.is_Integer:
        raise Decline(f"unbound size {e}")
    return int(e)


def is_static(x) -> bool:
    return not isinstance(x, torch.SymInt) or sym_expr(x).is_Integer


# ---------------------------------------------------------------------------------------------
# Probes


def compose_lengths(total: int, bins: int, cap: int, rng: random.Random, want: list) -> list:
    """Random lengths in [0, cap] summing to ``total``; tries to include the values in ``want``."""
    lengths = [0] * bins
    order = list(range(bins))
    rng.shuffle(order)
    remaining = total
    for slot, w in zip(order, want):
        take = min(w, cap, remaining)
        lengths[slot] = take
        remaining -= take
    while remaining > 0:
        free = [b for b in range(bins) if lengths[b] < cap]
        if not free:
            raise Decline("static total length exceeds B * N")
        b = rng.choice(free)
        add = min(cap - lengths[b], remaining, rng.randint(1, max(1, cap)))
        lengths[b] += add
        remaining -= add
    return lengths


def make_probes(N: int, B: Optional[int], L: Optional[int], count: int, seed: int = 0) -> list:
    """Probe length lists: ``B``/``L`` None means free (symbolic in the graph).

    Covers n in {0, 1, N} where the sizes allow, and random lengths otherwise.
    """
    rng = random.Random(seed)
    probes = []
    edge_sets = [[N, 0, 1], [1, N, N - 1], [0, N // 2 + 1, 2], [N, N, 0]]
    for p in range(count):
        want = edge_sets[p % len(edge_sets)] if p < 2 * len(edge_sets) else []
        b = B if B is not None else [3, 2, 4, 3][p % 4]
        if B is None and L is not None:  # static L, symbolic B: enough sequences to hold L rows
            b = max(b, -(-L // max(N, 1)))
        if L is None:
            lengths = [rng.randint(0, N) for _ in range(b)]
            for slot, w in enumerate(want[:b]):
                lengths[(slot + p) % b] = w
            if sum(lengths) < 2:  # symbolic sizes are >= 2 (0/1 are specialised by Dynamo)
                lengths[0] = max(2, lengths[0]) if N >= 2 else lengths[0]
                if sum(lengths) < 2:
                    lengths[-1] = N
        else:
            if L > b * N:
                raise Decline(f"L={L} > B*N={b * N}")
            lengths = compose_lengths(L, b, N, rng, want)
        probes.append(lengths)
    return probes


def make_targets(lengths: list, rng: random.Random, p: int) -> list:
    out = []
    for i, n in enumerate(lengths):
        pick = (p + i) % 4
        out.append([0, n, min(1, n), rng.randint(0, n)][pick])
    return out


def probe_values(shape, gen):
    """Random float64 probe values that are exact in float32 (ops without float64 kernels run in
    float32 on them, exactly for data movement). Never exactly 0: CPU float32 randn yields exact
    zeros (in pairs) about once per few million values, and a zero score hides the mask there
    (silu(0) = 0), which made the mask fit fail at N >= 512."""
    r = torch.randn(shape, generator=gen, dtype=torch.float32)
    return r.masked_fill_(r == 0, 1.0).to(torch.float64)


def scalar_scale(scale_probe):
    """``s_i`` when it is the same for every row (1 without a scale tensor), else None."""
    if scale_probe is None:
        return torch.ones((), dtype=torch.float64)
    return scale_probe.reshape(()) if scale_probe.numel() == 1 else None


# ---------------------------------------------------------------------------------------------
# Mask semantics


def valid_at(b, i, j, lengths, targets, spec: AttentionSpec):
    """``valid(i, j)`` (``reference.hstu_valid``) at index tensors ``b, i, j`` (vectorised; used to
    filter candidate parameters cheaply before the full check against ``reference.hstu_mask``)."""
    n = lengths[b]
    t = None if targets is None else targets[b]
    return hstu_valid(i, j, n, t, spec) & (i < n) & (j < n)


def valid_at_many(b, i, j, lengths, targets, cands) -> torch.Tensor:
    """:func:`valid_at` of every candidate spec at once: ``[len(cands), len(i)]`` booleans (the sample filter
    tries thousands of candidates; one candidate at a time is mostly Python overhead). Each option becomes a
    ``[len(cands), 1]`` column."""
    cols = {}
    for field in dataclasses.fields(AttentionSpec):
        col = torch.tensor([getattr(s, field.name) for s in cands])[:, None]
        cols[field.name] = col if col.dtype == torch.bool else col.to(i.dtype)
    n = lengths[b]
    t = None if targets is None else targets[b]
    return hstu_valid(i, j, n, t, AttentionSpec(**cols)) & (i < n) & (j < n)


def mask_candidates(ints: set, N: int, has_targets: bool) -> list:
    """Candidate mask options (:class:`AttentionSpec`), in the order they are tried: plain causal first, then
    every combination of 0 and the integer constants of the mask subgraph (and their neighbours, for ``<``
    vs ``<=``) as window, contextual prefix and full-attention tail. The prover's rule for mask options:
    each option's candidate values are listed here."""
    near = sorted({v for k in ints for v in (k - 1, k, k + 1) if 1 <= v <= N})
    out = [AttentionSpec()]
    if not has_targets:
        out.append(AttentionSpec(causal=False))
    for w, c in itertools.product([0] + near, [0] + near):
        for f in ([0] + near if w > 0 else [0]):
            if (w, c, f) != (0, 0, 0):
                out.append(AttentionSpec(True, w, c, f))
    return out


def reference_mask(lengths: torch.Tensor, N: int, targets, spec: AttentionSpec) -> torch.Tensor:
    return hstu_mask(lengths, N, targets, spec=spec)


def reference_pad(values: torch.Tensor, offsets: torch.Tensor, N: int) -> torch.Tensor:
    return jagged_to_padded(values, offsets, N)


def silu(x):
    return x * torch.sigmoid(x)


def close(a: torch.Tensor, b: torch.Tensor, rtol=1e-9, atol=1e-12) -> bool:
    if a.shape != b.shape:
        return False
    return bool(torch.allclose(a.to(torch.float64), b.to(torch.float64), rtol=rtol, atol=atol))


def scalar_constants(nodes: Iterable[torch.fx.Node]) -> tuple[set, set]:
    """(float constants, int constants) appearing as plain arguments of ``nodes``."""
    floats, ints = set(), set()

    def visit(a):
        if isinstance(a, bool):
            return
        if isinstance(a, float) and math.isfinite(a):
            floats.add(a)
        elif isinstance(a, int) and abs(a) < 2 ** 31:
            ints.add(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    for n in nodes:
        for a in list(n.args) + list(n.kwargs.values()):
            visit(a)
    return floats, ints


def numel_cost(shapes: Iterable) -> int:
    return sum(math.prod(s) for s in shapes)


_ = operator  # (operator.* SymInt nodes are evaluated through their targets)
