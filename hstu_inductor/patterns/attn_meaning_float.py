"""The value-level attention proof (``attn_meaning``): the score chain's float part, on samples.

Per combination of cases of its non-score inputs, the chain's data part runs the user's own ops
(``float64``) on random scores; the result must be 0 or ``c * s_i * silu(alpha * S + beta * R)``.
Here: the samples (``_Sample``: scores in ``+u, -u`` pairs, half of them with a random bias), a
case's value as a tensor (``_concrete``), the evaluation (``_evaluate``), and reading ``alpha`` and
``c`` (``_classify``) and the bias coefficient ``beta`` (``_fit_beta``) off the result.
"""
from __future__ import annotations

import math

import sympy
import torch

from . import attn_layout as lay
from .attn_find import meta_val
from .attn_meaning_chain import Chain
from .core.domain import off, tgt
from .core.values import Unsupported, is_bool
from .prover import Decline, silu

aten = torch.ops.aten

_ELEMENTWISE = {aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar,
                aten.masked_fill.Scalar, aten.masked_fill.Tensor}


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


def _zero_scores(sample):
    z = _Sample.__new__(_Sample)
    z.__dict__.update(sample.__dict__)
    z.sigma = torch.zeros_like(sample.sigma)
    return z
