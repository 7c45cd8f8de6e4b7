"""Size-independent proofs: prove a graph with large static sizes on small instances of itself.

The numeric proof of attention (``attn_prove.numeric_proof``) runs the user's score chain on
probes of ``B * H * N * N`` elements. With static production sizes (``B=128, N=4096``) that is
out of reach, so such candidates raise :class:`TooLarge` carrying their static sizes. This
module then *generalises* the whole ATen graph:

1. **Find.** The static batch size ``B``, max length ``N`` and jagged row count ``L`` of the
   declined candidates are the *atoms*. Graph inputs get symbolic sizes (rows ``L``, offsets
   ``B+1``, lengths/num_targets ``B``), ``N`` becomes a new ``SymInt`` input, and symbolic
   feature dims (``dynamic=True``) are set to their hints: they are model constants.
2. **Layout.** Walking the graph in order, every integer literal in a *size position* (view /
   expand / zeros / arange / slice bounds / repeat_interleave's output size / jagged pad
   lengths ...) is re-expressed in the symbols it stands for: view sizes by factoring the
   input's symbolic dims, fresh sizes by their value (feature suffixes, known from the jagged
   tensors, stay constant), index arithmetic (``seq * N + pos``) by exact ``N``, ``N-1``,
   ``B*N``, ``L`` values. Each choice is a list of alternatives (the literal itself last);
   a choice that contradicts a later shape (an exception, or the shape env forcing an atom to a
   constant) is revised by backtracking.
3. **Prove.** The rewriters run on the generalised graph: it looks like a dynamic graph with a
   symbolic ``N``, which the existing proofs handle with small probes (B <= 4, several small
   N, mask and scale proven constant across N). Cost: independent of the real sizes.
4. **Emit.** The rewritten generalised graph is re-traced at the real inputs and the real N:
   every symbolic size folds back to the literal it came from. Before that, the *unrewritten*
   generalised graph is re-traced the same way and must give back the user's graph node for
   node (same ops, same arguments): generalising changed nothing at the real sizes.

Why this is sound: at the real sizes the generalised graph *is* the user's graph (step 4's
check), and the proof holds for it at every probed size, uniformly in B and N, which is the
same argument that proves dynamic graphs. A literal that only equals an atom by accident either
keeps the proof from going through (e.g. a window of 128 with B=128 is not constant across
probe B values: the choice is revised or the candidate declined) or is harmless (equal at the
real sizes by construction). Constants left in the score chain are probed above their value
(``attn_prove.probe_ns``), so a window of ``N - 5`` spelled as a literal is not mistaken for
"no window".
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import operator
from typing import Optional

import sympy
import torch

from torch.utils._sympy.functions import FloorDiv

from .. import _compat
from . import generalize_small
from .prover import Decline, attribute, is_static, substitute, sym_expr

log = logging.getLogger("hstu_inductor")
aten = torch.ops.aten

_MAX_ATTEMPTS = 12


class TooLarge(Decline):
    """A candidate whose numeric proof at the graph's static sizes exceeds the probe budget.
    ``plan``: its (structurally proven) plan; ``last``: the node its rewrite may replace at most
    (the unpadded output, or the last row scale after it)."""

    def __init__(self, msg, plan=None, last=None, B=None, N=None, L=None, descriptor=None, lengths=False,
                 leaves=None):
        super().__init__(msg)
        self.plan, self.last, self.leaves = plan, last, leaves
        self.sizes = Sizes(B=B, Ns=(N,) if N is not None else (), L=L, descriptor=descriptor, lengths=lengths)


@dataclasses.dataclass
class Sizes:
    """Static atoms of the declined candidates (None / empty: already symbolic)."""
    B: Optional[int] = None
    Ns: tuple = ()
    L: Optional[int] = None
    descriptor: Optional[str] = None  # name of the offsets / lengths placeholder
    lengths: bool = False
    # tensors the proof binds to probes itself (a bias, an interval tensor): node (placeholder name once
    # extracted) -> {dim: (atom "B" | "N" | "L", constant factor)}. They are inputs of the extracted
    # copy, so what computes them is never generalised; their sizes are the atoms they stand for
    cut: dict = dataclasses.field(default_factory=dict)



class GeneralizeError(Exception):
    """The graph could not be generalised (the candidate stays declined, with this reason)."""


# ---------------------------------------------------------------------------------------------
# Where integer literals are sizes

_LIST_VIEW = {"view", "_unsafe_view", "reshape"}
_LIST_FRESH = {"zeros", "ones", "empty", "full", "rand", "randn", "empty_strided"}
_LIST_FRESH_SELF = {"new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided"}
_SCALAR_SIZE_ARGS = {"arange": (0, 1), "eye": (0, 1)}
_BOUND_ARGS = {"slice": (2, 3), "narrow": (2, 3)}
_JAGGED_SIZE_ARGS = {"jagged_to_padded_dense": 2, "_jagged_to_padded_dense_forward": 2,
                     "jagged_to_padded_dense_forward": 2, "dense_to_jagged": 2,
                     "_padded_dense_to_jagged_forward": 2, "dense_to_jagged_forward": 2}
_ARITH = {"mul", "add", "sub", "rsub", "div", "floor_divide", "remainder", "fmod", "lt", "le", "gt", "ge",
          "eq", "ne", "clamp", "clamp_min", "clamp_max", "minimum", "maximum", "where", "masked_fill",
          "fill", "full", "new_full", "select", "index_select", "lift_fresh_copy", "scalar_tensor"}


# Integer literals compared with or added to integer tensors (positions, ids, distances) are the
# mask's constants: a window, a contextual prefix, a min-full length. Each value becomes a symbol
# (a ``SymInt`` input named ``hstu_const_<value>``; values 1-2 apart share one, see _clusters), so the proof holds uniformly
# in it and is probed at small values, whatever its real size (a window of 1024 at N=4096). A value
# equal to an atom is tried as that atom first (index arithmetic ``seq * N + pos`` must stay N).
CONST_PREFIX = "hstu_const_"
_MASK_ARITH = {"add", "sub", "rsub", "lt", "le", "gt", "ge", "eq", "ne", "clamp", "clamp_min", "clamp_max",
               "minimum", "maximum", "where", "masked_fill"}


def _is_mask_arith(node) -> bool:
    """Integer arithmetic on integer tensors: where a mask constant can stand."""
    if _packet(node.target) not in _MASK_ARITH:
        return False
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    return bool(tensors) and not any(v.is_floating_point() for v in tensors)


def _diagonal(node):
    """The ``diagonal`` literal of a ``tril`` / ``triu`` node (a window spelled ``ones.tril().triu(-w)``), else None."""
    if node.op != "call_function" or _packet(node.target) not in ("tril", "triu"):
        return None
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal")
    return d if _is_int(d) else None


def _mask_ints(gm) -> set:
    """The literals >= 2 that :func:`_is_mask_arith` nodes of ``gm`` use, and ``tril``/``triu``
    diagonals of size >= 2 (as their absolute values)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and _is_mask_arith(n):
            out |= {a for a in [*n.args, *n.kwargs.values()] if _is_int(a) and 2 <= a < 2 ** 31}
        if (d := _diagonal(n)) is not None and 2 <= abs(d) < 2 ** 31:
            out.add(abs(d))
    return out


def _clusters(values) -> list:
    """``(base, members)``: mask constants within 2 of each other share one symbol (``c - 1`` and ``c``
    of a contextual prefix, ``w`` and ``w + 1``), each ``base + offset``, at most 3 apart."""
    out = []
    for c in sorted(values):
        if out and c - out[-1][1][-1] <= 2 and c - out[-1][0] <= 2:
            out[-1][1].append(c)
        else:
            out.append((c, [c]))
    return out


def _packet(target) -> str:
    name = getattr(target, "__name__", "")
    return name.split(".")[0]


def _is_int(a) -> bool:
    return isinstance(a, int) and not isinstance(a, bool)


# ---------------------------------------------------------------------------------------------
# The generaliser


@dataclasses.dataclass
class _Decision:
    key: tuple
    options: list  # alternatives, best first; the literal itself is always last
    choice: int = 0


class _Generaliser:
    """One attempt: builds the generalised graph with the given choices (``overrides``)."""

    def __init__(self, gm, sizes: Sizes, overrides: dict, arith: bool = True, consts: bool = True,
                 steer: bool = False):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.gm, self.sizes, self.overrides, self.arith = gm, sizes, overrides, arith
        self.consts: dict = {}         # literal value -> symbol + offset (mask constants, see _mask_ints)
        self.const_bases: list = []    # real value of each constant symbol, in input order
        self.use_consts = consts
        self.named_atoms: list = []    # (sympy expr, hint, "B" | "N" | "L")
        self.shape_env = ShapeEnv(duck_shape=False)
        self.fake_mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)
        self.graph = torch.fx.Graph()
        self.env: dict = {}            # old node -> new node
        self.sym_nodes: dict = {}      # shape-env symbol -> (placeholder, dim) or node
        self.expr_nodes: dict = {}     # emitted sympy expr -> node
        self.decisions: list = []
        self.features: set = set()     # trailing static dims of tensors with symbolic rows
        self.atom_syms: set = set()
        self.dim_sources: dict = {}    # symbolic size expr -> (input node, dim) holding it (inputs only:
        #                                a size read of an intermediate would keep it alive)
        self.steer = steer
        self.small = None              # generalize_small.SmallInstance when steering

    @property
    def atoms(self) -> list:
        """(sympy expr, hint) of the atoms B, N..., L."""
        return [(e, h) for e, h, _ in self.named_atoms]

    # -- symbols ----------------------------------------------------------------------------
    def _symint(self, hint: int, name: str) -> torch.SymInt:
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        src = ConstantSource(name)
        sym = self.shape_env.create_symbol(hint, source=src, dynamic_dim=DimDynamic.DYNAMIC)
        return self.shape_env.create_symintnode(sym, hint=hint, source=src)

    def _int_of(self, expr) -> torch.SymInt | int:
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            return int(expr)
        return self.shape_env.create_symintnode(expr, hint=self.hint(expr))

    def hint(self, expr) -> int:
        return int(substitute(sympy.sympify(expr), _compat.shape_env_hints(self.shape_env)))

    # -- placeholders -------------------------------------------------------------------------
    def placeholders(self):

        phs = list(self.gm.graph.find_nodes(op="placeholder"))
        vals = [p.meta.get("val", p.meta.get("example_value")) for p in phs]
        # original symbols: rows (dim 0 of an input, or a bare SymInt input) stay symbolic, feature
        # symbols (only in other dims) take their hints
        keep, feature_syms = set(), set()
        for v in vals:
            if isinstance(v, torch.Tensor):
                for d, s in enumerate(v.shape):
                    (keep if d == 0 else feature_syms).update(sym_expr(s).free_symbols)
        for v in vals:
            if isinstance(v, torch.SymInt):
                free = sym_expr(v).free_symbols
                if not free & feature_syms:
                    keep |= free
        sz = self.sizes
        if sz.B is None and sz.L is None and not sz.Ns:  # nothing to generalise but mask constants
            keep |= feature_syms
        from .prover import hints as env_hints

        orig_hints = env_hints(*vals)
        fresh = {s: self._symint(orig_hints.get(s, 2), f"hstu_orig_{s}").node.expr for s in sorted(keep, key=str)}
        specialise = {s: sympy.Integer(h) for s, h in orig_hints.items() if s not in keep}

        def gen(e):
            return sympy.sympify(sym_expr(e)).subs(fresh).subs(specialise)

        L_sym = self._symint(sz.L, "hstu_L").node.expr if sz.L is not None else None
        B_sym = O_sym = None
        if sz.B is not None:
            if sz.lengths:
                B_sym = self._symint(sz.B, "hstu_B").node.expr
            else:
                O_sym = self._symint(sz.B + 1, "hstu_offsets").node.expr
                B_sym = O_sym - 1
        n_vals = [self._symint(n, f"hstu_N{i}") for i, n in enumerate(sz.Ns)]
        atoms = {"B": B_sym, "L": L_sym, "N": n_vals[0].node.expr if n_vals else None}
        for p, v in zip(phs, vals):
            new = self.graph.placeholder(p.target)
            new.meta = {k: m for k, m in p.meta.items() if k not in ("val", "example_value", "tensor_meta")}
            if isinstance(v, torch.Tensor):
                shape = [gen(s) for s in v.shape]
                if shape and shape[0].is_Integer:
                    d0 = int(shape[0])
                    is_int1d = v.dim() == 1 and not v.is_floating_point()
                    if L_sym is not None and d0 == sz.L and not (is_int1d and d0 in (sz.B, (sz.B or -2) + 1)):
                        shape[0] = L_sym
                    elif B_sym is not None and is_int1d and p.name == sz.descriptor:
                        shape[0] = B_sym if sz.lengths else O_sym
                    elif B_sym is not None and is_int1d and d0 == sz.B:
                        shape[0] = B_sym
                    elif O_sym is not None and is_int1d and d0 == sz.B + 1:
                        shape[0] = O_sym
                stride = [gen(s) for s in v.stride()]
                if sz.cut.get(p.name):
                    shape, stride = _cut_shape(shape, v, sz.cut[p.name], atoms, self.hint)
                with self.fake_mode:
                    val = torch.empty_strided([self._int_of(s) for s in shape], [self._int_of(s) for s in stride],
                                              dtype=v.dtype, device=v.device, requires_grad=v.requires_grad)
                for d, s in enumerate(shape):
                    if isinstance(s, sympy.Symbol) and s not in self.sym_nodes:
                        self.sym_nodes[s] = (new, d)
                self._note_features(val)
                self._note_dims(new, val)
            elif isinstance(v, torch.SymInt):
                e = gen(v)
                val = self._int_of(e)
                if isinstance(e, sympy.Symbol) and e not in self.sym_nodes:
                    self.sym_nodes[e] = new
            else:
                val = v
            new.meta["val"] = val
            self.env[p] = new
        for i, (n, val) in enumerate(zip(sz.Ns, n_vals)):
            ph = self.graph.placeholder(f"hstu_max_seq_len_{i}")
            ph.meta["val"] = val
            self.sym_nodes[val.node.expr] = ph
            self.named_atoms.append((val.node.expr, n, "N"))
        lo = 2 if self.use_consts is True else int(self.use_consts)  # an int: clusters from it up only
        # a literal that is a size (N - 1, L - 1, B * N: an index clamp) is index arithmetic, not a constant
        sizes_of = {n + d for n in sz.Ns for d in (-1, 0, 1)} | {n * sz.B for n in sz.Ns if sz.B}
        sizes_of |= {sz.L + d for d in (-1, 0, 1)} if sz.L else set()
        for base, members in _clusters(_mask_ints(self.gm)) if self.use_consts else ():
            if min(members) < lo or set(members) & sizes_of:
                continue
            ph = self.graph.placeholder(f"{CONST_PREFIX}{base}")
            val = self._symint(base, f"{CONST_PREFIX}{base}")
            ph.meta["val"] = val
            self.sym_nodes[val.node.expr] = ph
            self.const_bases.append(base)
            self.consts.update({c: val.node.expr + (c - base) for c in members})
        if B_sym is not None:
            self.named_atoms.append((B_sym, sz.B, "B"))
        if L_sym is not None:
            self.named_atoms.append((L_sym, sz.L, "L"))
        self.atom_syms = set().union(*(sympy.sympify(e).free_symbols for e, _ in self.atoms))
        if self.steer:
            self.small = generalize_small.SmallInstance.build(self)

    def _note_dims(self, node, val):
        if isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                e = _sx(s)
                if not e.is_number and not isinstance(e, sympy.Symbol):
                    self.dim_sources.setdefault(e, (node, d))

    def _note_features(self, val):
        if not isinstance(val, torch.Tensor) or val.dim() < 2:
            return

        rest = val.shape[1:]
        if sym_expr(val.shape[0]).is_Integer or not all(sym_expr(s).is_Integer for s in rest):
            return
        dims = tuple(int(s) for s in rest)
        for i in range(len(dims)):  # every suffix, and its dims merged
            suf = dims[i:]
            self.features.add(suf)
            self.features.add((math.prod(suf),))

    # -- emitting symbolic sizes ----------------------------------------------------------------
    def emit(self, expr):
        """An fx node (or int) computing the sympy ``expr`` over this graph's symbols."""
        expr = sympy.expand(sympy.sympify(expr))
        if expr.is_Integer:
            return int(expr)
        if expr in self.expr_nodes:
            return self.expr_nodes[expr]
        if expr in self.dim_sources:  # a size some tensor already has: read it
            node, d = self.dim_sources[expr]
            node = self._call(aten.sym_size.int, (node, d))
        elif isinstance(expr, FloorDiv):
            node = self._call(operator.floordiv, (self.emit(expr.args[0]), self.emit(expr.args[1])))
        elif isinstance(expr, sympy.Symbol):
            src = self.sym_nodes.get(expr)
            if src is None:
                raise GeneralizeError(f"no graph input carries the size {expr}")
            node = src if isinstance(src, torch.fx.Node) else self._call(aten.sym_size.int, (src[0], src[1]))
        elif isinstance(expr, sympy.Add):
            const, rest = expr.as_coeff_Add()
            terms = sympy.Add.make_args(rest)
            node = self.emit(terms[0])
            for t in terms[1:]:
                node = self._call(operator.add, (node, self.emit(t)))
            if const:
                node = self._call(operator.add, (node, int(const)))
        elif isinstance(expr, sympy.Mul):
            coeff, rest = expr.as_coeff_Mul()
            factors = []
            for f in sympy.Mul.make_args(rest):
                base, exp = f.as_base_exp()
                if not (exp.is_Integer and exp > 0):
                    raise GeneralizeError(f"cannot emit size {expr}")
                factors += [base] * int(exp)
            node = self.emit(factors[0])
            for f in factors[1:]:
                node = self._call(operator.mul, (node, self.emit(f)))
            if coeff != 1:
                node = self._call(operator.mul, (node, int(coeff)))
        elif isinstance(expr, sympy.Pow):
            base, exp = expr.as_base_exp()
            node = self.emit(base)
            for _ in range(int(exp) - 1):
                node = self._call(operator.mul, (node, self.emit(base)))
        else:
            raise GeneralizeError(f"cannot emit size {expr}")
        self.expr_nodes[expr] = node
        return node

    def _call(self, target, args, kwargs=None):
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        node.meta["val"] = self._run(target, args, kwargs or {})
        return node

    def _run(self, target, args, kwargs):
        def val(a):
            return a.meta["val"] if isinstance(a, torch.fx.Node) else a

        args = torch.fx.node.map_aggregate(args, val)
        kwargs = torch.fx.node.map_aggregate(kwargs, val)
        with self.fake_mode:
            if target is aten.constant_pad_nd.default:  # its meta guards on the padded sizes
                return _padded_like(*args)
            return target(*args, **kwargs)

    # -- choices --------------------------------------------------------------------------------
    def choose(self, key, options):
        """Pick an alternative for one literal (``options`` best first, the literal last)."""
        if len(options) == 1:
            return options[0]
        d = _Decision(key, options, self.overrides.get(key, 0))
        self.decisions.append(d)
        return options[min(d.choice, len(options) - 1)]

    def _monomials(self):
        """(expr, hint) of products of atoms: B, N, L, B*N, N*N, B*N*N ..."""
        out = []
        for r in (1, 2, 3):
            for combo in itertools.combinations_with_replacement(range(len(self.atoms)), r):
                kinds = [self.named_atoms[i][2] for i in combo]
                if any(kinds.count(k) > 1 for k in ("B", "L")):  # B*B, L*L: no size is spelled so
                    continue
                expr = sympy.Mul(*(self.atoms[i][0] for i in combo))
                out.append((expr, math.prod(self.atoms[i][1] for i in combo), r))
        return out

    @staticmethod
    def _rel_position_sizes(n_expr, n: int, c: int) -> list:
        """Expressions of N (``n_expr``, value ``n``) worth ``c`` as a relative-position table's sizes: 2N - 1
        rows, the pad-and-repeat trick's 3N - 2 / 3N - 1 (sizes and index arithmetic alike)."""
        return [sympy.expand(k * n_expr + d) for k in (2, 3) for d in (-2, -1, 0, 1) if c == k * n + d]

    def size_options(self, c: int):
        """Expressions of atoms whose value is ``c`` (best first), then ``c`` itself."""
        opts = []
        if c >= 2:
            for expr, h, deg in self._monomials():
                if c % h == 0:
                    opts.append((-deg, c // h, sympy.expand(expr * (c // h))))
        # exact values first, then fewer atoms (N = 1024 is N, not B*B with B = 32), then small factors
        opts.sort(key=lambda t: (t[1] != 1, -t[0], t[1]))
        # one row more or less than N or L (a buffer with a sentinel row, L + 1 slots for a cumsum)
        opts += [(0, 1, sympy.expand(e + d)) for e, h, kind in self.named_atoms if kind in ("N", "L")
                 for d in (1, -1) if c == h + d]
        opts += [(0, 1, x) for e, h, kind in self.named_atoms if kind == "N"
                 for x in self._rel_position_sizes(e, h, c)]
        seen, out = set(), []
        for _, _, e in opts:
            if e not in seen:
                seen.add(e)
                out.append(e)
        return out + [sympy.Integer(c)]

    def arith_options(self, c: int):
        """Index arithmetic: exact N, N-1, N+1, B*N, L values (the literal last)."""
        if not self.arith:
            return [sympy.Integer(c)]
        if c < 0:  # ``B * N`` rows spelled ``N * (B + 1) + (-N)``: the negated options
            return [-e for e in self.arith_options(-c)[:-1]] + [sympy.Integer(c)]
        opts = []
        for expr, h, kind in self.named_atoms:
            offs = (0, -1, 1) if kind in ("N", "L") else ()  # B alone is no index term
            for off in offs:
                if c == h + off and c >= 2:
                    opts.append(sympy.expand(expr + off))
            if kind == "N":
                opts += self._rel_position_sizes(expr, h, c)
        for (e1, h1, k1), (e2, h2, k2) in itertools.combinations(self.named_atoms, 2):
            if {k1, k2} == {"B", "N"} and c == h1 * h2:
                opts.append(sympy.expand(e1 * e2))
        return list(dict.fromkeys(opts)) + [sympy.Integer(c)]

    def view_options(self, in_shape, sizes):
        """Generalised ``view`` sizes: groups of input dims and output sizes with equal products
        (on the hints); each group's symbolic factors are placed on its output sizes."""

        in_exprs = [sympy.sympify(sym_expr(s)) for s in in_shape]
        if -1 in sizes or any(not _is_int(s) for s in sizes):
            return None
        out, i, j = [], 0, 0
        groups = []
        while i < len(in_exprs) or j < len(sizes):
            gi, gj = [], []
            pi = pj = 1
            while True:
                if pi == pj and (gi or gj) and (i >= len(in_exprs) or self.hint(in_exprs[i]) != 1 or gj) \
                        and (j >= len(sizes) or sizes[j] != 1 or gi):
                    break
                if (pi <= pj or j >= len(sizes)) and i < len(in_exprs):
                    gi.append(in_exprs[i])
                    pi *= self.hint(in_exprs[i])
                    i += 1
                elif j < len(sizes):
                    gj.append(sizes[j])
                    pj *= sizes[j]
                    j += 1
                else:
                    return None
            groups.append((gi, gj))
        for gi, gj in groups:
            prod = sympy.factor(sympy.Mul(*gi)) if gi else sympy.Integer(1)
            if prod.is_Integer or not gj:
                out.append([[sympy.Integer(c) for c in gj]])
                continue
            coeff, rest = prod.as_coeff_Mul()
            factors = []
            for f in sympy.Mul.make_args(rest):
                base, exp = f.as_base_exp()
                factors += [base] * int(exp) if exp.is_Integer and exp > 0 else [f]
            if not coeff.is_Integer:
                return None
            options = []
            for place in itertools.product(range(len(gj)), repeat=len(factors)):
                exprs, ok = [], True
                for pos, c in enumerate(gj):
                    fs = [factors[k] for k in range(len(factors)) if place[k] == pos]
                    h = math.prod(self.hint(f) for f in fs)
                    if h == 0 or c % h:
                        ok = False
                        break
                    exprs.append(sympy.expand(sympy.Mul(*fs) * (c // h)))
                if ok and sympy.expand(sympy.Mul(*exprs) - prod) == 0:
                    options.append((sorted(place), exprs))
            options.sort(key=lambda t: t[0])
            out.append([e for _, e in options] or [[sympy.Integer(c) for c in gj]])
        return out

    # -- one node -------------------------------------------------------------------------------
    def generalise_args(self, node, args, kwargs):
        """``args``/``kwargs`` (new nodes already mapped) with size literals replaced."""
        name = _packet(node.target)
        args = list(args)
        kwargs = dict(kwargs)
        key = node.name
        if not self.atoms and name not in _ARITH and _diagonal(node) is None:  # sizes already symbolic: only the mask constants
            return tuple(args), kwargs

        if name in _LIST_VIEW and len(args) > 1 and isinstance(args[1], (list, tuple)):
            inp = args[0].meta["val"] if isinstance(args[0], torch.fx.Node) else None
            sizes = list(args[1])
            groups = self.view_options(inp.shape, sizes) if isinstance(inp, torch.Tensor) else None
            if groups is not None:
                new = []
                for g, opts in enumerate(groups):
                    new += self.choose((key, "view", g), opts + ([opts[-1]] if len(opts) == 1 else []))
                args[1] = [self.emit(e) for e in new]
            else:
                args[1] = [self._fresh_size(key, ("view", i), s) for i, s in enumerate(sizes)]
        elif name == "expand" and len(args) > 1:
            inp = args[0].meta["val"]
            sizes, off = list(args[1]), len(args[1]) - inp.dim()
            new = []
            for i, s in enumerate(sizes):
                if _is_int(s) and s != -1 and i >= off and self.hint(_sx(inp.shape[i - off])) == s:
                    new.append(inp.shape[i - off] if not _sx(inp.shape[i - off]).is_Integer else s)
                    if isinstance(new[-1], torch.SymInt):
                        new[-1] = self.emit(_sx(new[-1]))
                elif _is_int(s) and i == len(sizes) - 1 and (s,) in self.features:
                    new.append(s)  # an index expanded over the features (gather): a feature size
                else:
                    new.append(self._fresh_size(key, ("expand", i), s))
            args[1] = new
        elif name in _LIST_FRESH or name in _LIST_FRESH_SELF:
            pos = 1 if name in _LIST_FRESH_SELF else 0
            if len(args) > pos and isinstance(args[pos], (list, tuple)):
                args[pos] = self._fresh_list(key, list(args[pos]))
            if name in ("full", "new_full") and len(args) > pos + 1 and _is_int(args[pos + 1]):
                args[pos + 1] = self._arith(key, pos + 1, args[pos + 1])
        elif name in _SCALAR_SIZE_ARGS:
            for i in _SCALAR_SIZE_ARGS[name]:
                if i < len(args) and _is_int(args[i]) and not (name == "arange" and i == 0 and len(args) > 1
                                                               and _is_int(args[1])):
                    args[i] = self._fresh_size(key, ("scalar", i), args[i])
                elif i < len(args) and _is_int(args[i]):
                    args[i] = self._arith(key, i, args[i])
        elif name in _BOUND_ARGS and isinstance(args[0], torch.fx.Node):
            inp = args[0].meta["val"]
            dim = args[1] if len(args) > 1 else 0
            for i in _BOUND_ARGS[name]:
                if i < len(args) and _is_int(args[i]) and abs(args[i]) < 2 ** 62:
                    d = _sx(inp.shape[dim])
                    if d.is_Integer:  # bounds within a static (feature) dim stay literal
                        continue
                    if self.hint(d) == args[i]:
                        args[i] = self.emit(d)
                    else:
                        args[i] = self._arith(key, i, args[i])
        elif name in _JAGGED_SIZE_ARGS:
            i = _JAGGED_SIZE_ARGS[name]
            if i < len(args):
                a = args[i]
                if isinstance(a, (list, tuple)):
                    args[i] = [self._fresh_size(key, ("jagged", k), x) if _is_int(x) else x for k, x in enumerate(a)]
                elif _is_int(a):
                    args[i] = self._fresh_size(key, ("jagged", 0), a)
        elif name == "repeat_interleave" and _is_int(kwargs.get("output_size")):
            kwargs["output_size"] = self._fresh_size(key, ("output_size",), kwargs["output_size"])
        elif name == "repeat" and len(args) > 1:
            args[1] = [self._fresh_size(key, ("repeat", i), s) if _is_int(s) else s for i, s in enumerate(args[1])]
        elif name == "constant_pad_nd" and len(args) > 1:  # F.pad amounts (the pad-and-repeat's [0, N])
            args[1] = [self._fresh_size(key, ("pad", i), s) if _is_int(s) and s > 1 else s
                       for i, s in enumerate(args[1])]
        elif (d := _diagonal(node)) is not None and abs(d) in self.consts:  # a window as a diagonal
            sign = 1 if d > 0 else -1
            opts = [sign * self.consts[abs(d)], sympy.Integer(d)]
            args = args[:1] + [self.emit(self.choose((key, "arith", 1), opts))] + args[2:]
            kwargs.pop("diagonal", None)
        elif name in _ARITH:
            for i, a in enumerate(args):
                # SymInt arithmetic (``operator.mul(4096, B)``: a buffer of B * N rows) takes a
                # literal in any position; an ATen op's first argument is its tensor
                if _is_int(a) and (i > 0 or name == "scalar_tensor" or _is_sym_arith(node)):
                    args[i] = self._arith(key, i, a, node)
            for k, a in kwargs.items():  # clamp(min=..., max=...)
                if _is_int(a) and k in ("min", "max", "other"):
                    kwargs[k] = self._arith(key, k, a, node)
        return tuple(args), kwargs

    def _fresh_size(self, key, where, c):
        if not _is_int(c) or c < 2:
            return c
        opts = self.size_options(c)
        # a feature size (an arange over a row's features) that is only a multiple of an atom
        # (512 = 4 * B): the literal first; one equal to an atom (D = B = 128) stays an atom first
        if (c,) in self.features and all(h != c for _, h, _ in self.named_atoms):
            opts = opts[-1:] + opts[:-1]
        return self.emit(self.choose((key,) + where, opts))

    def _fresh_list(self, key, sizes):
        """Sizes of a new tensor: a trailing run that is a known feature shape stays constant."""
        ints = [s for s in sizes if _is_int(s)]
        cut = len(sizes)
        if len(ints) == len(sizes):
            for t in range(len(sizes) - 1, 0, -1):
                if tuple(sizes[len(sizes) - t:]) in self.features:
                    cut = len(sizes) - t
                    break
        return [self._fresh_size(key, ("fresh", i), s) if i < cut else s for i, s in enumerate(sizes)]

    def _arith(self, key, i, c, node=None):
        if not _is_int(c):
            return c
        opts = self.arith_options(c) if self.atoms else [sympy.Integer(c)]
        if node is not None and c in self.consts and _is_mask_arith(node):
            opts = opts[:-1] + [self.consts[c]] + opts[-1:]
        return self.emit(self.choose((key, "arith", i), opts))

    def run(self):
        self.placeholders()
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                last = node.args[0]
                out = torch.fx.node.map_arg(last, self.env.__getitem__)
                val = last.meta.get("val") if isinstance(last, torch.fx.Node) else None
                if self.small is not None and isinstance(val, torch.Tensor) and val.dim() and \
                        not self.small.rows_ok(out, int(val.shape[0]), self.sizes.L):
                    raise _Failed(last.name, len(self.decisions), "on a small instance the output lost the jagged rows")
                self.graph.output(out)
                continue
            if node.op == "get_attr":
                new = self.graph.get_attr(node.target)
                obj = attribute(self.gm, node.target)
                new.meta["val"] = self.fake_mode.from_tensor(obj) if isinstance(obj, torch.Tensor) else obj
                if self.small is not None:
                    self.small.constant(new, obj)
                self.env[node] = new
                continue
            if node.op != "call_function":
                raise GeneralizeError(f"cannot generalise {node.op} node {node.name}")
            args = torch.fx.node.map_arg(node.args, self.env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, self.env.__getitem__)
            before = len(self.decisions)
            try:
                gargs, gkwargs = self.generalise_args(node, args, kwargs)
                val = self._run(node.target, gargs, gkwargs)
            except GeneralizeError:
                raise
            except Exception as e:
                raise _Failed(node.name, before, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
            forced = self._forced_atoms()
            if forced:
                raise _Failed(node.name, before, f"sizes {sorted(map(str, forced))} became constants")
            new = self.graph.call_function(node.target, gargs, gkwargs)
            new.meta = {k: m for k, m in node.meta.items() if k not in ("val", "example_value", "tensor_meta")}
            new.meta["val"] = val
            self.env[node] = new
            self._note_features(val)
            if self.small is not None:
                try:
                    self.small.step(new, node.target, gargs, gkwargs)
                except Exception as e:  # an index out of range where L != N: the reading is wrong
                    raise _Failed(node.name, before, f"on a small instance: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:160] if str(e) else ''}") from None
        gm = torch.fx.GraphModule(self.gm, self.graph)
        return gm

    def _forced_atoms(self) -> set:
        """Atom symbols the shape env has fixed to a constant (a contradicted choice); when steering
        (L and N of one value), also one made equal to another atom (a size read as the wrong one)."""
        forced = set()
        for s in self.atom_syms:
            r = self.shape_env.replacements.get(s)
            if r is not None and (sympy.sympify(r).is_number
                                  or (self.steer and sympy.sympify(r).free_symbols & (self.atom_syms - {s}))):
                forced.add(s)
        return forced


def _cut_shape(shape, v, dims, atoms, hint):
    """A cut tensor's shape with its atom dims symbolic (where the value agrees) and strides in its
    own dim order (stride-0 dims stay broadcast)."""
    shape = list(shape)
    for d, (kind, factor) in dims.items():
        atom = atoms.get(kind)
        if atom is not None and shape[d].is_Integer and int(shape[d]) == hint(atom) * factor:
            shape[d] = atom * factor
    order = sorted(range(len(shape)), key=lambda d: (-int(v.stride()[d]), d))
    stride, acc = [sympy.Integer(0)] * len(shape), sympy.Integer(1)
    for d in reversed(order):
        if int(v.stride()[d]) != 0:
            stride[d] = acc
            acc = acc * shape[d]
    return shape, stride


class _Failed(Exception):
    def __init__(self, node, decisions_before, reason):
        super().__init__(reason)
        self.node, self.decisions_before, self.reason = node, decisions_before, reason


def _padded_like(x, pad, value=0):
    """Result metadata of ``constant_pad_nd(x, pad)`` without its meta function (which would
    specialise symbolic sizes)."""
    sizes = list(x.shape)
    for i in range(len(pad) // 2):
        d = len(sizes) - 1 - i
        sizes[d] = sizes[d] + pad[2 * i] + pad[2 * i + 1]
    return x.new_empty(sizes)


def _sx(s):

    return sympy.sympify(sym_expr(s))


def generalise(gm: torch.fx.GraphModule, sizes: Sizes, arith: bool = True, consts: bool = True):
    """The generalised graph (and its generaliser): ``gm`` with the atoms of ``sizes`` symbolic, a
    ``SymInt`` input per N and per mask constant appended. ``arith``: also index-arithmetic literals
    (``seq * N``); ``consts``: mask constants as symbols. Raises GeneralizeError.

    Where L and N have (almost) the same value their literals are ambiguous: the choices are first
    steered by a small instance on which they differ (``generalize_small``), then taken unsteered."""
    if generalize_small.coincide(sizes) and not gm.meta.get("hstu_unsteerable"):
        try:
            return _generalise_steered(gm, sizes, arith, consts)
        except GeneralizeError as e:
            log.debug("hstu_inductor: no reading of the sizes runs on a small instance (%s)", e)
            gm.meta["hstu_unsteerable"] = True  # the other levels read the same sizes: not again
    return _generalise(gm, sizes, arith, consts)


def _generalise(gm, sizes, arith, consts):
    """One unsteered generalisation: a choice contradicted later is revised depth first."""
    overrides: dict = {}
    last = None
    for _ in range(_MAX_ATTEMPTS):
        g = _Generaliser(gm, sizes, overrides, arith, consts)
        try:
            out = g.run()
            log.debug("hstu_inductor: generalised %s with %d choice(s) revised", sizes, len(overrides))
            return out, g
        except _Failed as e:
            last = e
            log.debug("hstu_inductor: generalisation attempt failed at %s: %s", e.node, e.reason)
            # revise the latest choice made before (or at) the failing node that has alternatives left
            live = [d for d in g.decisions if d.choice < len(d.options) - 1]
            if not live:
                break
            d = live[-1]
            overrides = {x.key: x.choice for x in g.decisions[:g.decisions.index(d)]}
            overrides[d.key] = d.choice + 1
    raise GeneralizeError(f"could not generalise the sizes at {last.node}: {last.reason}" if last
                          else "could not generalise the sizes")


def _generalise_steered(gm, sizes, arith, consts):
    """Choices steered by the small instance. A contradiction at a node is repaired by moving one
    choice that node depends on (latest first) to its next symbolic reading (an N to an L), kept
    only if the trace then gets further; every other choice stays. Contradictions are local (an
    index range, a size mismatch), so the trace advances one repair at a time."""
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}

    def attempt(overrides):
        g = _Generaliser(gm, sizes, overrides, arith, consts, steer=True)
        try:
            return g, g.run(), None
        except _Failed as e:
            log.debug("hstu_inductor: steered attempt failed at %s: %s", e.node, e.reason)
            return g, None, e

    g, out, fail = attempt({})
    budget = 4 * _MAX_ATTEMPTS
    while fail is not None and budget > 0:
        cone = _cone(gm, fail.node)
        base = {x.key: x.choice for x in g.decisions}
        live = [d for d in g.decisions if d.key[0] in cone and d.choice < _symbolic_options(d) - 1][::-1]
        # one move, else two (a row index and its row count read as N together)
        for moves in itertools.chain(itertools.combinations(live, 1), itertools.combinations(live, 2)):
            budget -= 1
            g2, out2, fail2 = attempt({**base, **{d.key: d.choice + 1 for d in moves}})
            if fail2 is None or order[fail2.node] > order[fail.node] or budget <= 0:
                g, out, fail = g2, out2, fail2
                break
        else:
            break
    if fail is None:
        log.debug("hstu_inductor: generalised %s (steered) with %d choice(s) revised", sizes,
                  sum(d.choice > 0 for d in g.decisions))
        return out, g
    raise GeneralizeError(f"could not generalise the sizes at {fail.node}: {fail.reason}")


def _cone(gm, name) -> set:
    """Names of the node called ``name`` and of every node it depends on."""
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    out, todo = set(), [node] if node is not None else []
    while todo:
        n = todo.pop()
        if n.name not in out:
            out.add(n.name)
            todo += n.all_input_nodes
    return out


def _symbolic_options(d) -> int:
    """How many of a choice's options (best first) are expressions of symbols (not the literal)."""
    def numeric(o):
        return all(sympy.sympify(x).is_number for x in (o if isinstance(o, (list, tuple)) else [o]))
    return sum(not numeric(o) for o in d.options)


# ---------------------------------------------------------------------------------------------
# One candidate: extract, generalise, prove, specialise, splice


def extract(gm: torch.fx.GraphModule, last: torch.fx.Node, leaves: set):
    """The subgraph computing ``last`` from ``leaves`` (and the graph inputs it reads) as a graph
    module of its own: ``(module, inputs)`` with one placeholder per input node, in graph order,
    named like the node it stands for."""
    from .prover import closure

    order, reached = closure([last], set(leaves))
    inputs = [n for n in gm.graph.nodes if n in reached]
    graph = torch.fx.Graph()
    env = {}
    for n in inputs:
        if n.op == "get_attr":
            env[n] = graph.get_attr(n.target)
        else:
            env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in order:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[last])
    sub = torch.fx.GraphModule(gm, graph)
    return sub, [n for n in inputs if n.op != "get_attr"], env


def prove_generalised(gm, e: TooLarge, prove, rewrite):
    """Prove and rewrite the candidate of ``e`` on a generalised copy of its subgraph; splice the
    result (specialised back to the real sizes) into ``gm``. Returns the proven plan (of the
    generalised graph, for the report). Raises Decline / GeneralizeError.

    The copy starts at the pads' sources as the structural proof chose them. When those turn out
    not to be what the pads read (a table with a sentinel row before the real source), it is
    proven again from the furthest source candidates (``e.leaves``), and the copy that is spliced
    starts at the sources found there: the user's nodes before them (a projection) are kept."""
    plan = e.plan
    near = {x.src for x in (plan.q, plan.k, plan.v)}
    try:
        return _generalised(gm, e, near, prove, rewrite)
    except (Decline, GeneralizeError) as d:
        if not e.leaves or set(e.leaves) == near:
            raise
        first = d
    try:
        found = _generalised(gm, e, e.leaves, prove, None)
    except (Decline, GeneralizeError):
        raise first from None
    return _generalised(gm, e, found, prove, rewrite)


def _generalised(gm, e, leaves, prove, rewrite):
    """One extraction from ``leaves``: the proven plan, spliced in when ``rewrite`` is given; without
    it, the user's nodes that the proof found to be the pads' sources."""
    plan = e.plan
    sub, inputs, env = extract(gm, e.last, set(leaves) | set(e.sizes.cut))
    vals = [n.meta.get("val") for n in inputs]
    fake_mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    if fake_mode is None:
        raise GeneralizeError("the candidate reads no fake tensor input")
    sizes = dataclasses.replace(e.sizes, descriptor=env[plan.offsets].name if plan.offsets in env else None,
                                cut={env[n].name: d for n, d in e.sizes.cut.items() if n in env})
    if sizes.B == 1:
        # a batch of one stays one: the graph (offsets of 2 rows) admits no other B, and a size-1
        # symbol is pinned to 1 by the first broadcast anyway. L and N still vary, one sequence of
        # L rows per probe (as for Dynamo's B=1 graphs)
        sizes = dataclasses.replace(sizes, B=None)
    first = None
    # literals as symbols first; then mask constants kept (a literal the mask does not use as one
    # of HSTU's constants, e.g. a contextual prefix of 2 whose c - 1 = 1 stays a literal; first
    # only the constants of 2 kept, so that a large window still becomes a symbol); then
    # index-arithmetic literals that only equal N by accident kept; then both
    levels = [(True, True), (True, False), (False, True), (False, False)]
    if 2 in _mask_ints(sub):  # a contextual prefix of 2 (its c - 1 = 1 is no constant): the others alone
        levels.insert(1, (True, 3))
    for arith, consts in levels:
        try:
            gen, g = generalise(sub, sizes, arith, consts)
        except GeneralizeError:
            if first is None:
                raise
            raise first from None  # a later level that does not even generalise: the proof's reason
        log.debug("hstu_inductor: generalised at level arith=%s consts=%s", arith, consts)
        gen.recompile()
        extra = list(g.const_bases)
        back = _specialise(gen, vals, sizes, fake_mode, extra)
        diff = same_graph(sub, back)
        if diff is not None:
            raise GeneralizeError(f"the generalised graph does not specialise back to the user's ({diff})")
        S, pv = g.env[env[plan.S]], g.env[env[plan.pv]]
        try:
            with g.fake_mode:
                gen_plan = prove(gen, S, pv)
            break
        except Decline as d:
            log.debug("hstu_inductor: generalised proof at arith=%s consts=%s declined: %s", arith, consts, d)
            first = first or d
            if not any(x.key[1] == "arith" for x in g.decisions):
                raise first from None
    else:
        raise first
    if rewrite is None:
        to_sub, to_user = {v: k for k, v in g.env.items()}, {v: k for k, v in env.items()}
        return {to_user[to_sub[x.src]] for x in (gen_plan.q, gen_plan.k, gen_plan.v)}
    with g.fake_mode:
        rewrite(gen, gen_plan)
    gen.graph.eliminate_dead_code()
    gen.recompile()
    spec = _specialise(gen, vals, sizes, fake_mode, extra)
    _splice(gm, spec, inputs, e.last)
    for a in plan.metadata_asserts:  # as attn_emit.rewrite does: their cast is replaced
        gm.graph.erase_node(a)
    gen_plan.constants = {g.consts[c]: c for c in g.const_bases}
    return gen_plan


def _specialise(gen_gm, vals: list, sizes: Sizes, fake_mode, consts=()):
    """Re-trace ``gen_gm`` at the real inputs, the real N values and the real mask constants: every
    symbolic size folds back to an int literal (or to the original graph's own symbols)."""
    with fake_mode:
        return _compat.trace_aten(gen_gm, list(vals) + list(sizes.Ns) + list(consts))


def _splice(gm, spec, inputs, last):
    """Copy ``spec``'s nodes into ``gm`` before ``last`` (its inputs bound to ``inputs``) and let its
    output replace ``last``; the replaced subgraph is left to dead-code elimination."""
    phs = list(spec.graph.find_nodes(op="placeholder"))
    env = dict(zip(phs, inputs))
    out = None
    with gm.graph.inserting_before(last):
        for n in spec.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = torch.fx.node.map_arg(n.args[0], env.__getitem__)
                break
            if n.op == "get_attr":
                obj = attribute(spec, n.target)
                name = f"_hstu_const_{len([x for x in gm.graph.nodes if x.op == 'get_attr'])}"
                gm.register_buffer(name, obj) if isinstance(obj, torch.Tensor) else setattr(gm, name, obj)
                env[n] = gm.graph.get_attr(name)
                env[n].meta = dict(n.meta)
                continue
            env[n] = gm.graph.node_copy(n, env.__getitem__)
    if isinstance(out, (list, tuple)):
        out = out[0]
    last.replace_all_uses_with(out)


def same_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> Optional[str]:
    """None when ``a`` and ``b`` run the same ops on the same arguments, in the same order
    (size arithmetic on SymInts and ``sym_size`` reads aside); else the first difference."""
    def ops(gm):
        return [n for n in gm.graph.nodes if n.op == "call_function"
                and n.target is not aten.sym_size.int and not _is_sym_arith(n)]

    def norm(x, index):
        if isinstance(x, torch.fx.Node):
            if isinstance(x.meta.get("val"), torch.SymInt):  # a size, however it is read: its value
                return norm(x.meta["val"], index)
            if x.op == "placeholder":
                return ("input", placeholders(x.graph).index(x))
            if x.target is aten.sym_size.int or _is_sym_arith(x):
                v = x.meta.get("val")
                return v if isinstance(v, int) else ("sym", str(v))
            return ("node", index.get(x))
        if isinstance(x, (list, tuple)):
            return tuple(norm(y, index) for y in x)
        if isinstance(x, dict):
            return tuple(sorted((k, norm(v, index)) for k, v in x.items()))
        if isinstance(x, torch.SymInt):  # a size specialised since (a guarded feature size) is its int
            return int(sym_expr(x)) if is_static(x) else ("sym", str(x))
        return x

    ia, ib = ops(a), ops(b)
    if len(ia) != len(ib):
        return f"{len(ia)} ops vs {len(ib)}"
    xa, xb = {n: i for i, n in enumerate(ia)}, {n: i for i, n in enumerate(ib)}
    for na, nb in zip(ia, ib):
        if na.target != nb.target or norm(na.args, xa) != norm(nb.args, xb) or \
                norm(na.kwargs, xa) != norm(nb.kwargs, xb):
            return f"{na.format_node()} vs {nb.format_node()}"
    return None


def placeholders(graph) -> list:
    return list(graph.find_nodes(op="placeholder"))


def _is_sym_arith(n) -> bool:
    return n.op == "call_function" and getattr(n.target, "__module__", None) == "_operator"
