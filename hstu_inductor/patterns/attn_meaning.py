"""Attention, stage 3 (prove) by meaning: what the structurally checked pieces compute, at any size.

The pieces of a candidate (``attn_structure``: pads, the score chain ``S -> X``, the unpad, row
scales) are read element by element with the value interpreter (``core.elements``): one element at
symbolic coordinates stands for all of them, so the proof costs the same at ``B=128, N=4096`` as at
``B=2, N=4``, static or dynamic, whatever the mask constants.

* **Pads.** Element ``(b, p, f)`` of each pad ``D`` (``[B, N, *F]`` viewed as ``D.shape``) must be
  ``src(off(b) + p, f)`` where ``p < n_b`` and 0 elsewhere: decided by ``core.decide`` (z3).
* **Score chain.** The chain's nodes that read the scores are float data; everything else they read
  (the mask, a padded per-row scale, a bias) is an element expression of the score position. Those
  expressions are split into cases (``core.semantics.cases``); per combination of cases the float part
  is evaluated on random scores (``float64``, the user's own ops) and must be 0 or
  ``c * s_i * silu(alpha * S + beta * R)`` with one ``(alpha, beta, c)`` for all combinations. The
  mask is then the disjunction of the combinations' conditions, and it must *be* HSTU's
  ``valid(i, j)`` (``core.semantics.hstu_valid``) for parameters read off its integer constants:
  decided for every ``i, j < n <= N`` and ``0 <= t <= n``, not sampled.
* **Unpad.** Row ``off(b) + p`` of the output must be element ``(b, p)`` of the dense output.
* **Row scales.** Each factor must be ``c * s_row ** power`` on the rows the unpad reads.

A symbolic ``N`` is a symbol here like any size; the chain's float constants are evaluated at several
values of it (the scale must be a constant or ``k / N``: ``attn_prove.n_law``).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import operator

import sympy
import torch

from . import attn_layout as lay
from .attn_find import PadMismatch, meta_val
from .core import decide
from .core.domain import Domain, off, tgt
from .core.elements import Elements, unravel
from .core.values import Unsupported, boolean, is_bool, num, size_expr, time_budget
from .core.semantics import cases, hstu_valid, interval_valid
from .prover import Decline, hints, mask_candidates, silu, sym_expr, valid_at

aten = torch.ops.aten

_SAMPLES = 64          # float samples per case combination
_ELEMENTWISE = {aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar,
                aten.masked_fill.Scalar, aten.masked_fill.Tensor}
_MAX_COMBOS = 256      # case combinations of the score chain's inputs


class _RealLeaf(sympy.Function):
    """Marker base for data leaves (Real-valued in the decision procedure)."""


def _leaf_fn(name, integer=False):
    f = sympy.Function(name)
    if integer:
        f.is_int_leaf = True
    return f


def _offsets_leaf(plan):
    if plan.lengths:
        return lambda idx: off(idx[0] + 1) - off(idx[0])
    return lambda idx: off(idx[0])


def _rows(x) -> sympy.Expr:
    return size_expr(meta_val(x).shape[0])


def _domain(plan, rows_of, scale=None) -> Domain:
    """The domain of a proof over the jagged rows of ``rows_of``, with the graph's shape environment.
    Every per-token input (q, k, v, a per-row ``scale``, the interval tensor) has the ``L`` jagged rows:
    that is the inputs' contract, which the op checks at run time; under ``mark_dynamic`` each has
    a symbol of its own."""
    env = None
    for n in (rows_of, plan.offsets, plan.S):
        for s in getattr(meta_val(n), "shape", ()):
            if isinstance(s, torch.SymInt):
                env = s.node.shape_env
                break
        if env is not None:
            break
    dom = Domain(plan.B, plan.N, _rows(rows_of), env)
    dom.row_sizes = [_rows(x) for x in (plan.q.src, plan.k.src, plan.v.src)]
    if scale is not None and meta_val(scale).dim() == 1:
        dom.row_sizes.append(_rows(scale))
    if plan.intervals is not None:
        dom.row_sizes.append(size_expr(meta_val(plan.intervals.node).shape[plan.intervals.row_dim]))
    return dom


# ---------------------------------------------------------------------------------------------
# Pads


def prove_pads(plan) -> None:
    """Every pad ``D`` is ``jagged_to_padded(src, offsets, N)`` viewed as ``D.shape``; one
    :class:`PadMismatch` naming every pad that is not (its next source candidate may be)."""
    bad, seen = [], []
    for x in (plan.q, plan.k, plan.v):
        if any(x.D is y for y in seen):
            continue
        seen.append(x.D)
        try:
            prove_pad(plan, x)
        except PadMismatch as e:
            bad.append(e)
        except Unsupported as e:
            bad.append(PadMismatch(f"pad of {x.src.name}: {e}", x.D))
    if bad:
        raise PadMismatch(str(bad[0]), *(d for e in bad for d in e.Ds))


def prove_pad(plan, x) -> None:
    dom = _domain(plan, x.src)
    b = dom.sequence("b")
    p = dom.coord("p", plan.N)
    fshape = [sym_expr(s) for s in meta_val(x.src).shape[1:]]
    fs = tuple(dom.coord(f"f{k}", s) for k, s in enumerate(fshape))
    src = _leaf_fn(f"src_{x.src.name}")
    E = Elements(dom, {x.src: lambda idx: src(*idx), plan.offsets: _offsets_leaf(plan)})
    lin = b * lay.to_expr(plan.N) + p
    for f, s in zip(fs, fshape):
        lin = lin * s + f
    got = E.at(x.D, unravel(E, sympy.expand(lin), E.shape(x.D)))
    want = sympy.Piecewise((src(off(b) + p, *fs), sympy.Lt(p, dom.length(b))), (0, True))
    ok, cex = decide.equal(dom, got, want)
    if not ok:
        raise PadMismatch(f"pad of {x.src.name} is not jagged_to_padded(offsets, N={plan.N}) with zero padding"
                          + (f" (e.g. at {_short(cex)})" if isinstance(cex, dict) else ""), x.D)


def _short(model: dict) -> str:
    keep = {k: v for k, v in model.items() if not k.startswith("k!") and len(k) < 24}
    return ", ".join(f"{k}={v}" for k, v in sorted(keep.items())[:8])


# ---------------------------------------------------------------------------------------------
# The score chain


class Chain:
    """The score positions' logical coordinates and the interpreter the chain's inputs are read with."""

    def __init__(self, plan, sub):
        self.plan, self.sub = plan, sub
        self.dom = dom = _domain(plan, plan.q.src, sub.scale_leaf)
        self.b = dom.sequence("b")
        N = lay.to_expr(plan.N)
        self.i = dom.coord("i", N)
        self.j = dom.coord("j", N)
        self.axes = {"b": self.b, "i": self.i, "j": self.j}
        self.digits = {}
        for size, axis, stride in plan.Z:  # head digits: one symbol per mode of the scores' batch
            if axis == "b":
                continue
            h = dom.coord("h", size)
            self.axes[axis] = self.axes.get(axis, sympy.Integer(0)) + h * stride
        self._leaves(plan, sub)

    def _leaves(self, plan, sub) -> None:
        """The interpreter, with the candidate's inputs as leaves (offsets, num_targets, scale, bias, intervals)."""
        leaves = {plan.offsets: _offsets_leaf(plan)}
        if plan.num_targets is not None:
            leaves[plan.num_targets] = lambda idx: tgt(idx[0])
        self.scale_fn = None
        if sub.scale_leaf is not None:
            if meta_val(sub.scale_leaf).dim() == 0:
                self.scale_fn = sympy.Symbol("attn_scale")
                leaves[sub.scale_leaf] = lambda idx: self.scale_fn
            else:
                self.scale_fn = _leaf_fn("attn_scale")
                leaves[sub.scale_leaf] = lambda idx: self.scale_fn(idx[-1] if idx else 0)
        self.bias_fns = {}
        if plan.rab is not None:
            for k, t in enumerate(plan.rab.terms):
                f = _leaf_fn(f"rab{k}")
                self.bias_fns[t.node] = f
                leaves[t.node] = (lambda f: lambda idx: f(*idx))(f)
        self.iv_fn = None
        if plan.intervals is not None:
            self.iv_fn = _leaf_fn("iv", integer=True)
            leaves[plan.intervals.node] = lambda idx: self.iv_fn(*idx)
        self.E = Elements(self.dom, leaves)
        self.E._versions(plan.S.graph)

    def position(self, layout) -> tuple:
        """Coordinates of the logical element ``(b, heads, i, j)`` in a tensor of ``layout``; a mode of
        an axis the scores do not carry (a value feature) gets a digit symbol of its own."""
        out = []
        for dim in layout:
            x = sympy.Integer(0)
            for mode in dim:
                size, axis, stride = mode
                if axis is None:
                    digit = sympy.Integer(0)
                elif axis in self.axes:
                    digit = self.dom.mod(self.dom.floordiv(self.axes[axis], stride), size)
                else:
                    key = (size, axis, stride)
                    if key not in self.digits:
                        self.digits[key] = self.dom.coord("d", size)
                    digit = self.digits[key]
                x = x * size + digit
            out.append(sympy.expand(x))
        return tuple(out)

    def in_seq(self):
        n = self.dom.length(self.b)
        return [sympy.Lt(self.i, n), sympy.Lt(self.j, n)]

    def mask_args(self):
        """``(same sequence, i, j, n, t)``: ``valid(params)`` is the first and ``hstu_valid`` of the rest."""
        return (sympy.true, self.i, self.j, *_mask_symbols(self))

    def valid(self, params):
        """HSTU's mask at the score position, for mask parameters ``params``."""
        same, i, j, n, t = self.mask_args()
        return sympy.And(same, hstu_valid(i, j, n, t, params))

    sampled = True  # the mask's parameters are filtered on random (i, j, n, t) first


def _chain_inputs(ch: Chain):
    """``(data nodes in order, {(node, arg): element expression})`` of the score chain: the data nodes
    read the scores; the expressions are every other tensor they read, at their position."""
    plan, sub = ch.plan, ch.sub
    data = [n for n in sub.s_order if n in _sderived(sub, plan)]
    inputs = {}
    for n in data:
        pos = ch.position(sub.layouts[n])
        if n.target in (aten.tril.default, aten.triu.default):
            k = n.args[1] if len(n.args) > 1 else n.kwargs.get("diagonal", 0)
            i, j = pos[-2], pos[-1]
            inputs[(n, "keep")] = sympy.Le(j - i, k) if n.target is aten.tril.default else sympy.Ge(j - i, k)
            continue
        for a in _tensor_args(n):
            if a in ch.sderived:
                continue
            inputs[(n, a)] = ch.E.at(ch.E.src(n, a), ch.E.broadcast(a, pos))
    return data, inputs


def _sderived(sub, plan):
    return set(sub.layouts)


def _tensor_args(n):
    out = []
    for a in (*n.args, *n.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, torch.fx.Node) and isinstance(meta_val(x), torch.Tensor) and x not in out:
                out.append(x)
    return out


class _Sample:
    """Random float inputs of one evaluation of the chain's data part."""

    def __init__(self, K, gen):
        m = K // 4
        u = torch.rand(m, generator=gen, dtype=torch.float64) * 1.8 + 0.2
        v = torch.rand(m, generator=gen, dtype=torch.float64) * 1.8 + 0.2
        self.sigma = torch.cat([u, -u, v, -v])
        self.no_bias = torch.zeros(K, dtype=torch.bool)
        self.no_bias[: 2 * m] = True
        self.m = m
        self.terms: dict = {}  # bias term -> its random vector (zero in the fitting half)
        self.bias = torch.zeros(K, dtype=torch.float64)  # sum of sign * term: what the op adds
        self.K = K
        self.gen = gen
        self.leaves: dict = {}

    def term(self, t):
        """The random elements of bias term ``t`` (independent of the other terms)."""
        key = id(t)
        if key not in self.terms:
            r = torch.randn(self.m, generator=self.gen, dtype=torch.float64)
            v = torch.cat([torch.zeros(2 * self.m, dtype=torch.float64), r, r])
            self.terms[key] = v
            self.bias = self.bias + t.sign * v
        return self.terms[key]

    def leaf(self, key):
        """A random vector for a data leaf application (a per-row scale, a bias element)."""
        if key not in self.leaves:
            self.leaves[key] = torch.rand(self.K, generator=self.gen, dtype=torch.float64) + 0.5
        return self.leaves[key]


def _concrete(e, binding, sample: _Sample, ch: Chain, padding=False):
    """A case value as a torch value: numbers, size expressions at ``binding``, data leaves random.
    ``padding``: a case that occurs on padding positions only, where what the rules do not model (an
    opaque value: a row read past its sequence) takes random integers, for the finiteness check."""
    if is_bool(e):
        return torch.tensor(bool(e is sympy.true))
    e = sympy.sympify(e)
    if binding:
        e = e.xreplace({k: sympy.Integer(v) for k, v in binding.items()})
    if padding:
        e = e.xreplace({s: sympy.Integer(int(torch.randint(-3, 64, (), generator=sample.gen)))
                        for s in e.free_symbols if s.name.startswith("opaque_")})
    apps = [a for a in e.atoms(sympy.Function) if isinstance(a.func, sympy.core.function.UndefinedFunction)
            and a.func not in (off, tgt)]
    syms = [s for s in e.free_symbols if s == ch.scale_fn]
    if apps or syms:
        rep = {a: sympy.Symbol(f"_leaf{k}") for k, a in enumerate(apps + syms)}
        body = e.xreplace(rep)
        if body.free_symbols - set(rep.values()) or body.has(off, tgt):
            raise Decline(f"scores are not scale * silu(alpha * qk) with a constant scale: they are multiplied by "
                          f"{e}, which depends on the position")
        f = sympy.lambdify(list(rep.values()), body, "numpy")
        out = f(*[ch_bias(sample, ch, a).numpy() for a in rep])
        return torch.as_tensor(out, dtype=torch.float64).expand(sample.K)
    if e.free_symbols or e.has(off, tgt):
        raise Decline(f"scores are not scale * silu(alpha * qk) with a constant scale: they are combined with "
                      f"{e}, which depends on the position")
    if e in (sympy.oo, -sympy.oo):
        return torch.tensor(float(e), dtype=torch.float64)
    if e.is_Integer:
        return torch.tensor(int(e))
    return torch.tensor(float(e), dtype=torch.float64)


def ch_bias(sample: _Sample, ch: Chain, app):
    """A bias element takes its term's random vector (zero in the fitting half); a scale, random."""
    if isinstance(app, sympy.Function):
        for t in ch.plan.rab.terms if ch.plan.rab is not None else ():
            if app.func == ch.bias_fns[t.node]:
                return sample.term(t)
    return sample.leaf(app)


def _evaluate(ch: Chain, data, combo: dict, binding: dict, sample: _Sample):
    """The chain's data part on the sample, with every other input fixed by ``combo``."""
    vals = {ch.plan.S: sample.sigma}
    for n in data:
        if n is ch.plan.S:
            continue
        t = n.target
        if n.target in (aten.tril.default, aten.triu.default):
            vals[n] = torch.where(combo[(n, "keep")].to(torch.bool), vals[n.args[0]], 0.0)
            continue
        if lay.is_layout_node(n) or t in (aten.clone.default, aten.detach.default, aten.alias.default):
            vals[n] = vals[n.args[0]]
            continue
        if t is aten._to_copy.default:
            dt = meta_val(n).dtype
            x = vals[n.args[0]]
            vals[n] = x.to(torch.float64) if dt.is_floating_point else x.to(dt)
            continue

        if torch.Tag.pointwise not in getattr(t, "tags", ()) and t not in _ELEMENTWISE:
            # one sample per position: an op that moves or mixes elements (roll, cumsum, sort) has no
            # meaning on it, and the layout algebra has not placed its output
            raise Unsupported(f"score chain op {n.name} ({getattr(t, '__name__', t)}) is not elementwise")

        def conv(a):
            if isinstance(a, torch.fx.Node):
                if a in vals:
                    return vals[a]
                if (n, a) in combo:
                    return combo[(n, a)]
                v = meta_val(a)
                if isinstance(v, (torch.SymInt, torch.SymFloat)):
                    return _num(sympy.sympify(v.node.expr), binding)
                raise Unsupported(f"score chain node {n.name} reads {a.name}, not modelled")
            if isinstance(a, (list, tuple)):
                return type(a)(conv(x) for x in a)
            if isinstance(a, (torch.SymInt, torch.SymFloat)):
                return _num(sympy.sympify(a.node.expr), binding)
            if isinstance(a, torch.dtype) and a.is_floating_point:
                return torch.float64
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        args = conv(list(n.args))
        kwargs = {k: conv(v) for k, v in n.kwargs.items()}
        try:
            vals[n] = t(*args, **kwargs)
        except Exception as e:  # an op whose value needs the tensor's shape: not elementwise here
            raise Unsupported(f"score chain op {n.name} ({getattr(t, '__name__', t)}) is not elementwise: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:100]}") from e
        if isinstance(vals[n], torch.Tensor) and vals[n].is_floating_point():
            vals[n] = vals[n].to(torch.float64)
    out = vals[ch.plan.pv.args[0]]
    return torch.broadcast_to(out, (sample.K,)) if out.dim() == 0 else out


def _num(e, binding):
    e = e.xreplace({k: sympy.Integer(v) for k, v in binding.items()}) if binding else e
    if not e.is_number:
        raise Unsupported(f"size {e} in the score chain has no value")
    return int(e) if e.is_Integer else float(e)


def _feasible(ch: Chain, cond, extra=()) -> bool:
    if cond is sympy.false:
        return False
    if cond is sympy.true and not extra:
        return True
    r = decide.satisfiable(ch.dom, sympy.And(cond, *extra))
    if r is None:
        raise Decline("could not decide whether a case of the score chain occurs (solver timeout)")
    return r


def _classify(g, sample: _Sample, srow, alpha_cands):
    """``(alpha, c)`` when ``g == c * s * silu(alpha * sigma)`` on the bias-free half, ``'zero'``, or None."""
    if bool((g == 0).all()):
        return "zero"
    if not bool(torch.isfinite(g).all()):
        return None
    m = sample.K // 4
    sel = sample.no_bias
    s = srow if srow is not None else torch.ones(sample.K, dtype=torch.float64)
    gp, gm = g[:m] / s[:m], g[m:2 * m] / s[m:2 * m]
    u = sample.sigma[:m]
    diff = gp - gm  # c * alpha * u
    if bool((diff == 0).any()):
        return None
    ratio = (gp + gm) / diff  # tanh(alpha * u / 2)
    if bool((ratio.abs() >= 1).any()):
        return None
    a_est = float((2 * torch.atanh(ratio) / u).median())
    for a in [*(x for x in alpha_cands if math.isclose(x, a_est, rel_tol=1e-6)), a_est]:
        if a == 0:
            continue
        c = float((diff / (a * u)).median())
        want = c * s[sel] * silu(a * sample.sigma[sel])
        if torch.allclose(g[sel], want, rtol=1e-9, atol=0):
            return a, c
    return None


def _fit_beta(g, sample, srow, alpha, c, beta_cands):
    s = srow if srow is not None else torch.ones(sample.K, dtype=torch.float64)
    sel = ~sample.no_bias
    for beta in beta_cands:
        want = c * s[sel] * silu(alpha * sample.sigma[sel] + beta * sample.bias[sel])
        if torch.allclose(g[sel], want, rtol=1e-9, atol=0):
            return beta
    return None


def prove_chain(gm, plan, sub, ch=None):
    """The score chain, by cases: fills ``alpha``, the mask parameters, the rab ratio, and returns
    ``(c per N binding, scale_used)`` for the caller's scale bookkeeping. ``ch``: the score positions'
    coordinates (default: padded sequences, :class:`Chain`)."""
    ch = Chain(plan, sub) if ch is None else ch
    ch.sderived = set(sub.layouts)
    data, inputs = _chain_inputs(ch)
    keys = list(inputs)
    split = [cases(inputs[k]) for k in keys]
    if math.prod(len(c) for c in split) > _MAX_COMBOS:
        raise Decline(f"score chain has too many cases to enumerate ({math.prod(len(c) for c in split)})")
    for k, cs in zip(keys, split):
        for cond, _ in cs:
            if any(isinstance(a.func, sympy.core.function.UndefinedFunction) and a.func not in (off, tgt)
                   and not getattr(a.func, "is_int_leaf", False) for a in cond.atoms(sympy.Function)):
                raise Decline(f"mask depends on float data ({k[1].name if hasattr(k[1], 'name') else k[1]})")
    from .prover import scalar_constants
    floats, ints = scalar_constants(sub.s_order)
    alpha_cands = sorted({1.0} | {c for c in floats if c != 0} | {1.0 / c for c in floats if c != 0})
    hint = hints(meta_val(plan.q.src), meta_val(plan.offsets), meta_val(plan.S))
    bindings = _bindings(plan, hint)
    in_seq = ch.in_seq()
    gen = torch.Generator().manual_seed(1234)
    sample = _Sample(_SAMPLES, gen)
    srow_app = None
    if ch.scale_fn is not None:
        # canonical like every element read (a batch of one: off(0) = 0)
        srow_app = ch.scale_fn if isinstance(ch.scale_fn, sympy.Symbol) else \
            ch.dom.canon(ch.scale_fn(off(ch.b) + ch.i))
    results = {}  # combo index -> (cond, [per-binding class])
    chosen = None
    beta = None
    consts = []
    for bi, binding in enumerate(bindings):
        per = []
        for combo in itertools.product(*split):
            cond = sympy.And(*[c for c, _ in combo])
            if cond is sympy.false:
                continue
            key = tuple(str(c) for c, _ in combo)
            if key not in results:
                if not _feasible(ch, cond):
                    results[key] = None
                    continue
                results[key] = {"cond": cond, "inseq": _feasible(ch, cond, in_seq), "cls": []}
            r = results[key]
            if r is None:
                continue
            if r["inseq"] and srow_app is not None:
                if "at_row" not in r:  # the scale gathered at an index that is the row in-sequence
                    r["at_row"] = [(c, _at_the_row(ch.dom, v, srow_app, [cond, *in_seq])) for c, v in combo]
                combo = r["at_row"]
            values = {k: _concrete(v, binding, sample, ch, padding=not r["inseq"]) for k, (_, v) in zip(keys, combo)}
            g = _evaluate(ch, data, values, binding, sample)
            if not bool(torch.isfinite(g).all()):
                raise Decline("scores are not finite on some positions (e.g. -inf masking before the silu)")
            apps = {a for _, v in combo if isinstance(v, sympy.Basic) for a in _scale_apps(v, ch)}
            if apps and r["inseq"] and not _is_row_scale(apps, srow_app):
                raise Decline(f"scores are not scale * silu(alpha * qk) with the query row's attn_scale: they are "
                              f"scaled by {', '.join(map(str, apps))}")
            srow = sample.leaf(srow_app) if apps else None
            cls = _classify(g, sample, srow, alpha_cands) if r["inseq"] else "zero" if bool((g == 0).all()) else "pad"
            if cls is None:
                raise Decline("scores are not scale * silu(alpha * qk) for any alpha "
                              "(other activation or normalisation?)")
            if cls not in ("zero", "pad"):
                a, c = cls
                if chosen is None:
                    chosen = a
                elif not math.isclose(a, chosen, rel_tol=1e-9):
                    raise Decline(f"scores use alpha={a:g} in some positions and {chosen:g} in others")
                if plan.rab is not None:
                    cands = [1.0, a, -1.0, *[x for x in floats if x], *[1 / x for x in floats if x]]
                    bt = _fit_beta(g, sample, srow, a, c, dict.fromkeys(cands))
                    if bt is None:
                        raise Decline("scores with a bias are not scale * silu(alpha * qk + b * bias) for any "
                                      "b among the graph's constants (bias added after the activation?)")
                    if beta is not None and not math.isclose(bt, beta, rel_tol=1e-9):
                        raise Decline("the bias enters the scores with different coefficients")
                    beta = bt
                per.append((c, apps != set()))
                r["cls"].append(("hstu", c))
            else:
                r["cls"].append((cls, None))
            if plan.dense and r is not None and _feasible(ch, cond, _padding_rows(ch)):
                g0 = _evaluate(ch, data, values, binding, _zero_scores(sample))
                if not bool((g0 == 0).all()):
                    raise Decline("attention output is used padded (no unpad) but its padding rows are not zero")
        cs = {round(c, 15) for c, _ in per}
        if len({c for c in cs}) > 1 and not all(math.isclose(c, per[0][0], rel_tol=1e-9) for c, _ in per):
            raise Decline("scores are scaled by different constants in different positions")
        if per:
            consts.append((binding, per[0][0], per[0][1]))
    if chosen is None:
        raise Decline("attention scores are zero everywhere")
    scale_used = any(u for _, _, u in consts)
    if scale_used and not all(u for _, _, u in consts):
        raise Decline("the attn_scale input scales some positions and not others")
    # the mask: where the scores are kept
    kept = [r["cond"] for r in results.values() if r is not None and r["inseq"]
            and any(k == "hstu" for k, _ in r["cls"])]
    mask = sympy.Or(*kept) if kept else sympy.false
    if plan.intervals is not None:
        plan.params = (True, 0, 0, 0)
        _prove_intervals(ch, mask, in_seq)
    else:
        plan.params = _fit_mask(ch, mask, ints, in_seq)
    plan.alpha = float(chosen * plan.q.factor * plan.k.factor)
    if plan.rab is not None:
        plan.rab.ratio = beta / chosen
        plan.rab.coeff = float(beta)
        _tables(plan, ch)
    return consts, scale_used


def _tables(plan, ch) -> None:
    """Bias terms proven to be the table bias go to the op's tables (path b); the rest stay dense."""
    from .. import config
    from . import attn_tables
    from .attn_table_meaning import prove_term

    if not config.rab_tables:
        return
    checks = attn_tables.analyse(plan)
    for tc in checks:
        if tc.reason is None:
            try:
                prove_term(tc, ch)
            except Decline as e:
                tc.reason = str(e)
    attn_tables.finish(checks, plan)


def _at_the_row(dom, v, srow, assume):
    """``v`` with each read of the scale at an index equal to the row's under ``assume`` (decided)
    replaced by ``srow``: a gather pad reads it at ``min(off(b) + i, L - 1)``, which is the row on
    every in-sequence position."""
    if isinstance(srow, sympy.Symbol) or not isinstance(v, sympy.Basic):
        return v
    reps = {}
    for a in v.atoms(sympy.Function):
        if a.func == srow.func and a != srow and len(a.args) == len(srow.args):
            same = sympy.And(*[sympy.Eq(x, y) for x, y in zip(a.args, srow.args)])
            if decide.valid(dom, same, assume)[0] is True:
                reps[a] = srow
    return v.xreplace(reps) if reps else v


def _is_row_scale(apps, srow_app) -> bool:
    if len(apps) != 1:
        return False
    (a,) = apps
    if isinstance(srow_app, sympy.Symbol):
        return a == srow_app
    return a.func == srow_app.func and all(sympy.expand(x - y) == 0 for x, y in zip(a.args, srow_app.args))


def _scale_apps(v, ch):
    if ch.scale_fn is None:
        return set()
    if isinstance(ch.scale_fn, sympy.Symbol):
        return {ch.scale_fn} if v.has(ch.scale_fn) else set()
    return {a for a in v.atoms(sympy.Function) if a.func == ch.scale_fn}


def _zero_scores(sample):
    z = _Sample.__new__(_Sample)
    z.__dict__.update(sample.__dict__)
    z.sigma = torch.zeros_like(sample.sigma)
    return z


def _padding_rows(ch):
    n = ch.dom.length(ch.b)
    return [sympy.Ge(ch.i, n), sympy.Lt(ch.j, n)]


def _bindings(plan, hint):
    """Values of the size symbols the float part is evaluated at: the hints, and for a symbolic N
    two more values of it (its law, constant or ``1/N``, is checked over them)."""
    base = {s: int(v) for s, v in hint.items()}
    if isinstance(plan.N, int) or sympy.sympify(plan.N).is_Integer:
        return [base]
    out = []
    Nexpr = sympy.sympify(plan.N)
    (sym,) = Nexpr.free_symbols
    for extra in (0, 3, 11):
        b = dict(base)
        b[sym] = base.get(sym, 8) + extra
        out.append(b)
    return out


# -- the mask ----------------------------------------------------------------------------------

def _mask_symbols(ch):
    """The mask's free parameters other than i, j: the sequence's length and targets."""
    n = ch.dom.length(ch.b)
    t = tgt(ch.b) if ch.plan.num_targets is not None else None
    return n, t


def _fit_mask(ch: Chain, mask, ints, in_seq):
    """The HSTU mask parameters that make ``mask`` equal ``valid(i, j)`` on every in-sequence element."""
    n, t = _mask_symbols(ch)
    N = ch.plan.N
    consts = {abs(int(a)) for a in mask.atoms(sympy.Integer)} | {abs(i) for i in ints}
    Nint = int(N) if isinstance(N, int) or sympy.sympify(N).is_Integer else None
    cap = Nint if Nint is not None else max(consts | {64}) + 2
    cands = mask_candidates({c for c in consts if 0 < c <= cap + 1}, cap, t is not None)
    survivors = _sample_filter(ch, mask, cands, n, t, cap) if ch.sampled else []
    eq = decide.Equivalence(ch.dom, mask, in_seq)
    for params in survivors:
        if eq.check(ch.valid(params)):
            return params
    # the cheap filter can miss facts of the batch (one sequence: n_b = L; rows read through the
    # offsets): every candidate, each rejected by a counterexample found so far or decided
    seen = _CounterexampleFilter(ch, eq)
    for params in cands:
        if params not in survivors and not seen.rejects(params) and eq.check(ch.valid(params)):
            return params
    # no parameter set: say where the first plausible reading differs
    params = survivors[0] if survivors else (True, 0, 0, 0)
    ok, cex = decide.valid(ch.dom, sympy.Equivalent(mask, ch.valid(params)), in_seq)
    where = f" (e.g. at {_short(cex)})" if isinstance(cex, dict) else ""
    causal_like, _ = decide.valid(ch.dom, sympy.Implies(mask, sympy.Le(ch.j, ch.i)), in_seq)
    what = "matches no HSTU mask" if causal_like else "has entries above the diagonal (not causal)"
    raise Decline(f"attention mask {what} for any (max_attn_len, contextual_seq_len, "
                  f"min_full_attn_seq_len) taken from the graph's constants{where}")


class _CounterexampleFilter:
    """Rejects a candidate numerically (``valid_at``) at the counterexamples z3 found so far, so that
    the symbolic ``valid(params)`` is built and decided only for candidates that survive them all."""

    def __init__(self, ch, eq):
        self.ch, self.eq, self.seen, self.cols = ch, eq, -1, None

    def rejects(self, params) -> bool:
        if self.seen != len(self.eq.models):
            self.seen = len(self.eq.models)
            same, i, j, n, t = self.ch.mask_args()
            exprs = [same, i, j, n] + ([t] if t is not None else [])
            pts = [(v, want) for v, want in self.eq.points(exprs) if v[1] < v[3] and v[2] < v[3]]
            self.cols = None
            if pts:
                cols = torch.tensor([list(map(int, v)) + [int(want)] for v, want in pts]).unbind(1)
                self.cols = (*cols[:4], cols[4] if t is not None else None, cols[-1])
        if self.cols is None:
            return False
        same, i, j, n, t, want = self.cols
        causal, w, c, f = params
        got = same.bool() & valid_at(torch.arange(len(i)), i, j, n, t, w, c, f, causal)
        return not torch.equal(got, want.bool())


def _sample_filter(ch, mask, cands, n, t, cap):
    """Candidates that agree with ``mask`` on random in-sequence points (a cheap filter before the
    decision procedure)."""
    g = torch.Generator().manual_seed(7)
    M = 3000
    nn = torch.randint(1, cap + 1, (M,), generator=g)
    nn[:200] = cap
    nn[200:300] = 1
    ii = (torch.rand(M, generator=g) * nn).long()
    jj = (torch.rand(M, generator=g) * nn).long()
    jj[300:600] = ii[300:600]
    tt = (torch.rand(M, generator=g) * (nn + 1)).long().clamp(max=nn)
    tt[600:800] = 0
    tt[800:900] = nn[800:900]
    env = {ch.i: ii, ch.j: jj}
    apps = {}
    for a in mask.atoms(sympy.Function):
        if a.func == off:
            apps[a] = torch.randint(0, 1 << 20, (M,), generator=g)
        elif a.func == tgt:
            apps[a] = tt
    for s in mask.free_symbols:
        if s in env:
            continue
        if s == n:
            env[s] = nn
        elif s in ch.dom.ranges:
            lo, hi = ch.dom.ranges[s]
            hi = sympy.sympify(hi).xreplace({sympy.sympify(ch.plan.N): cap}) if not isinstance(ch.plan.N, int) else hi
            hi = int(hi) if sympy.sympify(hi).is_Integer else cap
            env[s] = torch.randint(int(lo), max(int(lo), hi) + 1, (M,), generator=g)
        else:
            env[s] = torch.full((M,), cap)
    rep = {a: sympy.Symbol(f"_a{k}") for k, a in enumerate(apps)}
    syms = list(env) + list(rep.values())
    try:
        f = sympy.lambdify(syms, mask.xreplace(rep), "numpy")
        got = torch.as_tensor(f(*[env[s].numpy() for s in env], *[apps[a].numpy() for a in apps]))
        got = got.expand(M).to(torch.bool)
    except Exception:  # lambdify could not vectorise it: no filtering, the decision decides
        return cands
    lens = nn
    b = torch.arange(M)
    out = []
    for params in cands:
        causal, w, c, f_ = params
        want = valid_at(b, ii, jj, lens, tt if t is not None else None, w, c, f_, causal)
        if torch.equal(want, got):
            out.append(params)
    return out


def _prove_intervals(ch: Chain, mask, in_seq):
    iv = ch.plan.intervals
    idx = [None, None, None]
    row = off(ch.b) + ch.i
    head = sympy.Integer(0)
    if iv.heads > 1:
        for size, axis, stride in ch.plan.head_modes:
            head = head * size + ch.dom.mod(ch.dom.floordiv(ch.axes[axis], stride), size)
    xs = []
    for k in range(3):
        idx = [None] * meta_val(iv.node).dim()
        idx[iv.row_dim] = row
        idx[iv.field_dim] = sympy.Integer(k)
        if iv.head_dim is not None:
            idx[iv.head_dim] = head if iv.heads > 1 else sympy.Integer(0)
        xs.append(ch.iv_fn(*idx))
    want = interval_valid(ch.j, *xs)
    ok, cex = decide.valid(ch.dom, sympy.Equivalent(mask, want), in_seq)
    if not ok:
        raise Decline(f"mask read from the interval tensor {iv.node.name} is not [0, x0) | [x1, x2) per row"
                      + (f" (e.g. at {_short(cex)})" if isinstance(cex, dict) else ""))


# ---------------------------------------------------------------------------------------------
# Unpad and row scales


def prove_unpad(plan, sub) -> None:
    """Row ``off(b) + p`` of the output is element ``(b, p)`` of the dense output."""
    dom = _domain(plan, plan.q.src)
    b, p, r = dom.row("o")
    Od = _leaf_fn("dense_out")
    E = Elements(dom, {sub.Odense: lambda idx: Od(*idx), plan.offsets: _offsets_leaf(plan)})
    rest = [sym_expr(s) for s in sub.rest_shape]
    fs = tuple(dom.coord(f"e{k}", s) for k, s in enumerate(rest))
    got = E.at(plan.out, (r, *fs))
    N = lay.to_expr(plan.N)
    flat = [plan.B * N, *rest]
    lin = sympy.Integer(0)
    for x, s in zip((b * N + p, *fs), flat):
        lin = lin * s + x
    want = Od(*unravel(E, sympy.expand(lin), E.shape(sub.Odense)))
    ok, cex = decide.equal(dom, got, want)
    if not ok:
        raise Decline("unpad does not read row (b, n) of the dense output for every jagged row"
                      + (f" (e.g. at {_short(cex)})" if isinstance(cex, dict) else ""))


def prove_row_scale(plan, sub, m, scale_leaf) -> None:
    """``m``'s factor is ``c * s_row ** power`` on every row the unpad reads (sets ``m.c``)."""
    dom = _domain(plan, plan.q.src, m.leaf)
    s_fn = None
    leaves = {plan.offsets: _offsets_leaf(plan)}
    if m.leaf is not None:
        if meta_val(m.leaf).dim() == 0:
            s_fn = sympy.Symbol("attn_scale")
            leaves[m.leaf] = lambda idx: s_fn
        else:
            s_fn = _leaf_fn("attn_scale")
            leaves[m.leaf] = lambda idx: s_fn(idx[-1] if idx else 0)
    E = Elements(dom, leaves)
    shape = E.shape(m.main)
    if m.layout is not None:  # dense: the logical row (b, i) of each position
        ch = _RowAxes(dom, plan)
        pos = ch.position(m.layout)
        rows = [sympy.Lt(ch.i, dom.length(ch.b))]
        srow = None if s_fn is None else s_fn if isinstance(s_fn, sympy.Symbol) else dom.canon(s_fn(off(ch.b) + ch.i))
    else:  # after the unpad: jagged row r
        b, p, r = dom.row("s")
        pos = (r,) + tuple(dom.coord("e", s) for s in shape[1:])
        rows = []
        srow = None if s_fn is None else s_fn if isinstance(s_fn, sympy.Symbol) else dom.canon(s_fn(r))
    fac = E.at(m.factor, E.broadcast(m.factor, pos))
    eff = 1 / num(fac) if m.div else num(fac)
    pieces = [(c, v) for c, v in cases(eff) if _sat(dom, sympy.And(c, *rows))]
    if not pieces:
        return
    ratios = set()
    for c, v in pieces:
        if srow is not None and m.power:
            v = _at_the_row(dom, v, srow, [c, *rows])
        q = sympy.simplify(v / srow) if (srow is not None and m.power) else sympy.simplify(v)
        if q.free_symbols or q.has(sympy.Function) or not q.is_number:
            raise Decline(f"{m.node.name} does not scale each query row by "
                          f"{'its attn_scale' if m.power else 'one constant'}")
        ratios.add(float(q))
    c0 = next(iter(ratios))
    if c0 == 0 or not all(math.isclose(x, c0, rel_tol=1e-9) for x in ratios):
        raise Decline(f"{m.node.name} does not scale each query row by one constant times its attn_scale")
    m.c = c0
    if plan.dense and m.layout is not None:
        pad_rows = [sympy.Ge(ch.i, dom.length(ch.b))]
        for c, v in cases(eff):
            if _sat(dom, sympy.And(c, *pad_rows)) and v in (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
                raise Decline(f"{m.node.name} is not finite on padding rows of the dense attention output")


class _RowAxes(Chain):
    """Logical (b, heads, i) coordinates of a dense output position (no interpreter)."""

    def __init__(self, dom, plan):  # noqa: D401 - a reduced Chain
        self.dom = dom
        self.plan = plan
        self.b = dom.sequence("b")
        self.i = dom.coord("i", lay.to_expr(plan.N))
        self.axes = {"b": self.b, "i": self.i}
        self.digits = {}


def _sat(dom, cond) -> bool:
    if cond is sympy.true:
        return True
    if cond is sympy.false:
        return False
    r = decide.satisfiable(dom, cond)
    return True if r is None else r


def n_law(consts, rest) -> tuple:
    """``(k, per_n)``: the total scale (score constant per probe times ``rest``, the value/output
    factors, which may hold N) is the constant ``k`` at every probe N, or ``k / N`` at every one.
    Probes span at least two N values, so the two laws cannot both hold."""
    totals = []
    for Nv, c, binding in consts:
        r = sympy.sympify(rest).subs(binding)
        if not r.is_number:
            raise Decline(f"output scale {rest} depends on sizes other than N")
        totals.append((Nv, c * float(r)))
    if len({Nv for Nv, _ in totals}) < 2:
        raise Decline("symbolic N was probed at a single value")
    N0, t0 = totals[0]
    if all(math.isclose(t, t0, rel_tol=1e-9) for _, t in totals):
        return float(t0), False
    if all(math.isclose(t * Nv, t0 * N0, rel_tol=1e-9) for Nv, t in totals):
        return float(t0 * N0), True
    raise Decline("attention scale is neither a constant nor proportional to 1/N across probe values of N "
                  f"({', '.join(f'N={Nv}: {t:.6g}' for Nv, t in totals[::max(1, len(totals) // 4)])})")



_ = (operator, boolean, interval_valid)


# ---------------------------------------------------------------------------------------------
# The whole proof


@contextlib.contextmanager
def _compat_scope():
    """Real tensors (the float part runs the user's ops on CPU samples), no autograd."""
    from .. import _compat

    with _compat.no_fake_mode(), torch.no_grad():
        yield


def prove(gm, plan, sub) -> None:
    """Prove the candidate by meaning and fill in the plan's constants (alpha, mask parameters,
    scale); raises Decline (``PadMismatch`` for a pad, so that its next source is tried)."""
    from .. import config

    with _compat_scope(), time_budget(config.proof_budget_s):
        _prove(gm, plan, sub)


def _prove(gm, plan, sub) -> None:
    prove_pads(plan)
    plan.pads_proven = True
    consts, _ = prove_chain(gm, plan, sub)
    if not plan.dense:
        prove_unpad(plan, sub)
    pre, post = sub.pre, sub.post
    for m in pre.values():
        prove_row_scale(plan, sub, m, sub.scale_leaf)
    post_ok = 0
    for m in post.values():  # optional: a row scale after the unpad that is not proven stays the user's
        try:
            prove_row_scale(plan, sub, m, sub.scale_leaf)
        except Decline:
            break
        post_ok += 1
    kept = [*pre.values(), *list(post.values())[:post_ok]]
    if post_ok:
        plan.out = kept[-1].node
    scale_leaf = sub.scale_leaf
    if not sub.chain_scale and not any(m.power for m in kept):
        scale_leaf = None
    rest = plan.v.factor * sub.fo * math.prod(m.c for m in kept)
    if not (isinstance(plan.N, int) or sympy.sympify(plan.N).is_Integer):
        (sym,) = sympy.sympify(plan.N).free_symbols
        law = [(int(sympy.sympify(plan.N).xreplace({sym: b[sym]})), c, b) for b, c, _ in consts]
        assign_scale(plan, scale_leaf, *n_law(law, rest))
    else:
        assign_scale(plan, scale_leaf, consts[0][1] * float(sympy.sympify(rest)), None)


def assign_scale(plan, scale_leaf, factor, per_n) -> None:
    """The op's scale from the proven total ``factor``: times the scale input when there is one, else a
    constant, or None for the op's default ``1/N``. ``per_n``: symbolic N (None: static), whether the
    factor is per ``1/N`` (``n_law``)."""
    if scale_leaf is not None:
        plan.scale_node, plan.scale_factor = scale_leaf, float(factor)
        plan.scale_per_n = bool(per_n)
    elif per_n is None:
        plan.scale = None if abs(factor * int(plan.N) - 1.0) <= 1e-9 else float(factor)
    else:
        plan.scale = None if per_n and abs(factor - 1.0) <= 1e-9 else factor
        plan.scale_per_n = per_n and plan.scale is not None
