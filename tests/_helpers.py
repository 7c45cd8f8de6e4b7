"""Shared test helpers: independent slow-loop implementations written from HSTU_SEMANTICS.md.

Nothing here imports ``hstu_inductor``: these are the second, deliberately naive spellings of the
spec that the library's vectorised reference is checked against.
"""
from __future__ import annotations

import math
import operator
import os

import torch


# The backend of the rewrite tests (tests/patterns). "hstu_eager" makes the same rewrites as
# "hstu" (one code path, hstu_inductor.backend._rewritten) and runs the rewritten graph op by op,
# each hstu op as one call, so these tests check what is rewritten and that it computes what eager
# does without tracing the ops' bodies into the graph or generating and building C++ (together
# about three quarters of such a test's time). The ops traced into Inductor's graphs are tested end
# to end by test_backend_*, test_fuzz_backend, test_explain, test_input_checks, test_export,
# opcheck's AOT tests, tests/distributed and the production-size compiles in test_production_sizes;
# ``make test-inductor`` runs the rewrite tests through Inductor as well.
REWRITE_BACKEND = os.environ.get("HSTU_TEST_REWRITE_BACKEND", "hstu_eager")
assert REWRITE_BACKEND in ("hstu", "hstu_eager"), f"HSTU_TEST_REWRITE_BACKEND={REWRITE_BACKEND!r}"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``b`` must not be all zeros)."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    den = b.norm().item()
    assert den > 0, "reference tensor is all zeros: the comparison would prove nothing"
    return (a - b).norm().item() / den


def check_output(out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """``out`` has ``ref``'s shape, is finite and within ``tol`` of it (relative norm). An all-zero ``ref``
    (every row masked or empty) must be matched by an all-zero ``out``; returns False then (no gradient to
    compare relatively), else True."""
    assert out.shape == ref.shape and torch.isfinite(out).all()
    if not ref.any():
        assert not out.any()
        return False
    assert rel_err(out, ref) < tol
    return True


def offsets_from_lengths(lengths, dtype=torch.int64) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The mask, element by element, straight from the spec text.
# ---------------------------------------------------------------------------------------------
def spec_pi_and_M(n: int, t: int | None, c: int):
    """Return (pi as a python function of a raw position, M) for one sequence of length n."""
    M = n - c + 1 if c > 0 else n
    if t is not None:
        M = M - t

    def pi(p: int) -> int:
        ident = max(p - c + 1, 0) if c > 0 else p
        if t is not None:
            ident = min(ident, M)
        return ident

    return pi, M


def spec_valid(i: int, j: int, n: int, t: int | None = None, w: int = 0, c: int = 0, f: int = 0,
               causal: bool = True) -> bool:
    """valid(i, j) for raw rows i, j of a sequence of length n (False when either is padding)."""
    if not (0 <= i < n and 0 <= j < n):
        return False
    if not causal:
        return True
    pi, M = spec_pi_and_M(n, t, c)
    d = pi(i) - pi(j)
    causal_ok = (i == j) or d > 0
    window_ok = (w == 0) or (d <= w) or (f > 0 and pi(i) >= M - f)
    contextual = c > 0 and pi(i) == 0 and pi(j) < M
    return (causal_ok and window_ok) or contextual


def spec_mask(lengths, N, num_targets=None, w=0, c=0, f=0, causal=True) -> torch.Tensor:
    """``[B, N, N]`` bool mask built with python loops from :func:`spec_valid`."""
    B = len(lengths)
    out = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        t = None if num_targets is None else int(num_targets[b])
        for i in range(N):
            for j in range(N):
                out[b, i, j] = spec_valid(i, j, int(lengths[b]), t, w, c, f, causal)
    return out


# ---------------------------------------------------------------------------------------------
# Attention, one sequence / one row / one head at a time, in float64.
# ---------------------------------------------------------------------------------------------
def spec_interval_visible(j: int, n: int, x) -> bool:
    """Key column j of a sequence of length n against one row's (x0, x1, x2): [0, x0) u [x1, x2), j < n."""
    x0, x1, x2 = (int(a) for a in x)
    return 0 <= j < n and (j < x0 or x1 <= j < x2)


def spec_sla_visible(p: int, j: int, n: int, t: int, k1: int, k2: int, c: int) -> bool:
    """Semi-local attention, sentence by sentence from HSTU_SEMANTICS.md."""
    if not (0 <= p < n and 0 <= j < n):
        return False
    K2 = max(k2, c)
    if p >= n - t:  # target row: all of history, not itself
        return j < n - t
    return j < min(K2, p + 1) or max(K2, p - k1 + 1) <= j < p + 1


def loop_attention(q, k, v, offsets, N, alpha, num_targets=None, attn_scale=None, w=0, c=0, f=0,
                   causal=True, query_rows=None, rab=None, intervals=None) -> torch.Tensor:
    """Per-sequence loop HSTU attention in float64.

    ``query_rows``: optional list (per sequence) of raw positions to compute (delta attention);
    then ``q`` holds exactly those rows, sequence by sequence, and ``attn_scale`` (if per-row)
    is indexed the same way as ``q``. ``rab: [B|1, H|1, N, N]`` is added inside the silu;
    ``intervals: [H|1, L, 3]`` replaces the mask (per head).
    """
    q, k, v = q.detach().double(), k.detach().double(), v.detach().double()
    H, Dv = v.shape[1], v.shape[2]
    outs = []
    qrow = 0
    for b in range(len(offsets) - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        n = e - s
        t = None if num_targets is None else int(num_targets[b])
        rows = range(n) if query_rows is None else query_rows[b]
        for i in rows:
            qi = q[qrow] if query_rows is not None else q[s + i]
            if attn_scale is None:
                scale = 1.0 / N
            elif attn_scale.numel() == 1:
                scale = float(attn_scale.reshape(()))
            else:
                scale = float(attn_scale[qrow if query_rows is not None else s + i])
            acc = torch.zeros(H, Dv, dtype=torch.float64)
            for j in range(n):
                if intervals is None and not spec_valid(i, j, n, t, w, c, f, causal):
                    continue
                for h in range(H):
                    if intervals is not None and not spec_interval_visible(
                            j, n, intervals[h if intervals.shape[0] > 1 else 0, s + i]):
                        continue
                    x = alpha * float(torch.dot(qi[h], k[s + j, h]))
                    if rab is not None:
                        x += float(rab[b if rab.shape[0] > 1 else 0, h if rab.shape[1] > 1 else 0, i, j])
                    score = x / (1.0 + math.exp(-x)) * scale  # silu
                    acc[h] += score * v[s + j, h]
            outs.append(acc)
            qrow += 1
    if not outs:
        return torch.zeros(0, H, Dv, dtype=torch.float64)
    return torch.stack(outs)


def random_jagged(lengths, H, Dq, Dv, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    q = torch.randn(L, H, Dq, generator=g, dtype=dtype)
    k = torch.randn(L, H, Dq, generator=g, dtype=dtype)
    v = torch.randn(L, H, Dv, generator=g, dtype=dtype)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, offsets_from_lengths(lengths)




# ---------------------------------------------------------------------------------------------
# One small HSTUModel configuration shared by the compile tests, so that Inductor's FX graph
# cache can serve the same graph to several tests (compiling is the slow part of the suite).
# ---------------------------------------------------------------------------------------------
SMALL_NUM_ITEMS, SMALL_MAX_LEN = 30, 8
SMALL_LENGTHS = [5, 0, 1, 8, 3]


def small_hstu_model(seed=0, num_layers=1, **kw):
    from hstu_inductor.reference import HSTUModel

    torch.manual_seed(seed)
    return HSTUModel(num_items=SMALL_NUM_ITEMS, max_seq_len=SMALL_MAX_LEN, embedding_dim=16, num_layers=num_layers,
                     num_heads=2, attn_dim=8, hidden_dim=8, **kw)


def small_hstu_batch(lengths=SMALL_LENGTHS, seed=1):
    """(item_ids, offsets, num_targets, labels) with fresh random ids, lengths incl. 0, 1 and N."""
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    ids = torch.randint(0, SMALL_NUM_ITEMS, (L,), generator=g)
    labels = torch.randint(0, SMALL_NUM_ITEMS, (L,), generator=g)
    nt = torch.tensor([min(1, n) for n in lengths])
    return ids, offsets_from_lengths(lengths), nt, labels


_COPIES = (torch.ops.aten.clone.default, torch.ops.aten.copy.default, torch.ops.aten.copy_.default,
           torch.ops.aten._to_copy.default)


def _is_view(n) -> bool:
    t = n.target
    return t is operator.getitem or t is torch.ops.aten.reshape.default or getattr(t, "is_view", False)


def projection_copies(graph, width):
    """``(copies, views)``: the copy nodes and the view nodes reached through views only from the
    2-D ``[L, width]`` tensors that ``graph`` computes (not views themselves), e.g. the preprocess
    projection; a copy of v, q or k shows as a clone of one of its slices."""
    todo = [n for n in graph.nodes if n.op == "call_function" and not _is_view(n)
            and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 2
            and n.meta["val"].shape[-1] == width]
    copies, views = [], []
    while todo:
        for user in todo.pop().users:
            if user.target in _COPIES:
                copies.append(user)
            elif _is_view(user):
                views.append(user)
                todo.append(user)
    return copies, views


def forward_copies_pass(width, found):
    """A ``post_grad_custom_post_pass`` appending ``projection_copies(graph, width)`` of every forward
    graph (one without tangents) to ``found``."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph):
            if not any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder")):
                found.append(projection_copies(graph, width))

        def uuid(self):
            return None  # no caching: the pass must run

    return _Pass()


def cuda_stu_batch(B: int, N: int, E: int, seed: int):
    """``(x [L, E] bf16, offsets [B+1], num_targets [B])`` on CUDA for an STU layer: lengths U[N/2, N], 0..4 targets."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(N // 2, N + 1, (B,), generator=g)
    off = torch.zeros(B + 1, dtype=torch.int64)
    off[1:] = lengths.cumsum(0)
    x = torch.randn(int(off[-1]), E, generator=g).to("cuda", torch.bfloat16)
    nt = torch.minimum(torch.randint(0, 5, (B,), generator=g), lengths).cuda()
    return x, off.cuda(), nt
