"""A grammar of plain-PyTorch HSTU attention spellings: random models from a seed.

``sample(seed)`` draws one choice per *family* (how the jagged rows are padded, how the row
index is computed, which zero buffer, how the scores are multiplied, how the mask is written, where
the scale sits, which activation, how the output is unpadded, dtype, layer wiring, and possibly a
near-miss *mutation*) and returns a :class:`Sample`. ``Sample.build(N, H, D)`` makes the
``nn.Module``; ``Sample.inputs(B, N, H, D, ...)`` makes its inputs. The model computes exactly
what its choices say, in eager mode; without a mutation its output equals
``hstu_inductor.reference.hstu_mha`` with the sample's constants (``Sample.reference``), with a
mutation it is *not* HSTU attention and must not be rewritten.

Everything here is our own code, written from ``/work/shared/HSTU_SEMANTICS.md``.

Constants. ``N`` (max length), ``alpha`` and the mask constants are Python constants of the model,
as in real models. The family choices do not depend on the size; the mask constants are a function
of ``N`` drawn once per seed as fractions, so the same seed means the same spelling at every size
and a window always stays below ``N``: window ``w = max(1, N // r)`` with ``r`` in {2, 4, 8, 16}
(256 .. 2048 at N=4096, 1 .. 8 at N=16), ``min_full_attn_seq_len f = max(1, N // r')`` with ``r'``
in {4, 8} (only with a window), contextual prefix ``c`` in {1, 2, 3} (at most ``N // 4``).

The measurement runner is ``hstu_inductor.testing.grammar_run``; ``scripts/spelling_rates.py``
runs it over many seeds.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import random

import torch
import torch.nn.functional as F
from torch import nn

from ..reference import hstu_mha

HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
if HAS_FBGEMM:
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.*)
    except Exception:  # pragma: no cover - a broken install counts as absent
        HAS_FBGEMM = False

# ------------------------------------------------------------------------------------------------
# The families and their values. The lists do not depend on what is installed, so a seed draws the
# same choices everywhere; without fbgemm its two values are replaced by aten's equivalents after
# the draw (``FBGEMM_FALLBACK``).

PADS = ["index_put", "index_copy", "scatter", "gather_mul", "embedding", "take_where", "onehot_mm",
        "masked_scatter", "aten_j2p", "nested", "fbgemm_j2p"]
FBGEMM_FALLBACK = {"fbgemm_j2p": "aten_j2p", "fbgemm_d2j": "aten_p2j"}
FAMILIES = {
    "form": ["attention", "uvqk", "stu", "stack2"],
    "dtype": ["fp32", "bf16"],
    "pad_layout": ["same", "mixed", "fused"],  # fused: one pad of uvqk, then split (uvqk/stu forms)
    "pad": PADS,
    "split": ["split", "chunk", "slices"],
    "row_index": ["searchsorted", "repeat_interleave", "repeat_interleave_size", "bucketize", "cumsum_onehot"],
    "position": ["offsets_index", "offsets_repeat"],
    "zero": ["zeros", "new_zeros", "zeros_like", "empty_zero_", "full", "new_full"],
    "score": ["einsum_bnhd", "einsum_bhnd", "matmul", "bmm"],
    "mask": ["tril", "arange", "ids"],
    "mask_apply": ["where", "masked_fill", "float_mul"],
    "length_mask": ["no", "yes"],
    "targets": ["no", "yes"],
    "contextual": ["no", "yes"],
    "window": ["no", "yes"],
    "min_full": ["no", "yes"],
    "causal": ["yes", "no"],
    "scale": ["div_n", "mul_inv_n", "alpha_in_q", "pv_div_n", "scalar", "row", "row_after_pv"],
    "activation": ["silu", "x_sigmoid", "nn_silu"],
    "unpad": ["index", "index_select", "gather", "aten_p2j", "fbgemm_d2j"],
    "mutation": ["none", "off_by_one", "anti_causal", "softmax", "bias_in_silu", "data_mask",
                 "nonconst_scale", "extra_user"],
}
ALPHAS = [0.5, 0.25, 1.0, 0.125, 1 / math.sqrt(128)]
NEAR_MISS_RATE = 0.25
NO_AUTOGRAD = {"aten_j2p", "aten_p2j"}  # aten jagged <-> dense ops have no autograd formula


def _pick(rng: random.Random, values, weights=None):
    return rng.choices(values, weights=weights)[0] if weights else rng.choice(values)


@dataclasses.dataclass
class Sample:
    """One generated spelling: its choices, whether it is HSTU, and how to build it."""

    seed: int
    choices: dict
    alpha: float
    fractions: dict  # window / min_full divisors and the contextual length, see the module doc

    @property
    def mutation(self) -> str | None:
        m = self.choices["mutation"]
        return None if m == "none" else m

    @property
    def expected_hstu(self) -> bool:
        """True: must be rewritten. False: a near miss, must not be rewritten. A learned bias inside
        the silu is HSTU with a relative attention bias (``hstu.attention(rab=...)``)."""
        return self.mutation in (None, "bias_in_silu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.choices["dtype"] == "bf16" else torch.float32

    @property
    def differentiable(self) -> bool:
        c = self.choices
        used = {c["pad"], c.get("pad_k", c["pad"]), c.get("pad_v", c["pad"]), c["unpad"]}
        return not (used & NO_AUTOGRAD)

    def constants(self, N: int) -> dict:
        """The mask constants of the model built for max length ``N`` (0 = option off)."""
        c = self.choices
        w = max(1, N // self.fractions["w"]) if c["window"] == "yes" else 0
        f = max(1, N // self.fractions["f"]) if c["min_full"] == "yes" else 0
        ctx = min(self.fractions["c"], max(1, N // 4)) if c["contextual"] == "yes" else 0
        return {"max_attn_len": w, "min_full_attn_seq_len": f, "contextual_seq_len": ctx}

    def input_names(self) -> list:
        c = self.choices
        names = {"attention": ["q", "k", "v"], "uvqk": ["uvqk"]}.get(c["form"], ["x"]) + ["offsets"]
        if c["targets"] == "yes":
            names.append("num_targets")
        if c["scale"] in ("scalar", "row", "row_after_pv"):
            names.append("attn_scale")
        if self.mutation == "data_mask":
            names.append("user_mask")
        return names

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.choices.items())

    def build(self, N: int, H: int, D: int, reference: bool = False) -> "GrammarModel":
        """The model at max length ``N`` (its constants follow ``N``), ``H`` heads of size ``D``.
        ``reference=True``: the same model (same parameters for the same torch seed) with the
        attention replaced by ``reference.hstu_mha``."""
        return GrammarModel(self, N, H, D, reference=reference)

    def inputs(self, B: int, N: int, H: int, D: int, lengths=None, seed: int = 0,
               requires_grad: bool = False, device="cpu") -> tuple:
        """Positional inputs (``input_names()``): jagged tensors ``[L, ...]`` in the sample's dtype,
        ``offsets [B+1]``, ``num_targets [B]`` in ``[0, n_b]``, ``attn_scale`` (scalar or ``[L]``,
        fp32), a bool ``user_mask [B, N, N]`` for the data-mask near miss. Lengths default to
        random in ``[0, N]``. Works under ``FakeTensorMode`` when ``lengths`` is given as a list."""
        g = random.Random(seed)
        if lengths is None:
            lengths = [g.randint(0, N) for _ in range(B)]
        assert len(lengths) == B and all(0 <= n <= N for n in lengths), lengths
        off = [0]
        for n in lengths:
            off.append(off[-1] + n)
        L = off[-1]
        tg = torch.Generator().manual_seed(seed)
        fake = torch._guards.detect_fake_mode() is not None

        def randn(*shape, dtype=None):
            t = torch.empty(*shape, dtype=dtype or self.dtype, device=device)
            if not fake:
                t = torch.randn(*shape, generator=tg).to(device=device, dtype=dtype or self.dtype)
            return t.requires_grad_(requires_grad)

        E = H * D
        out = []
        for name in self.input_names():
            if name in ("q", "k", "v"):
                out.append(randn(L, H, D))
            elif name == "uvqk":
                out.append(randn(L, 4 * E))
            elif name == "x":
                out.append(randn(L, E))
            elif name == "offsets":
                out.append(torch.tensor(off, dtype=torch.int64, device=device))
            elif name == "num_targets":
                out.append(torch.tensor([g.randint(0, n) for n in lengths], dtype=torch.int64, device=device))
            elif name == "attn_scale":
                shape = () if self.choices["scale"] == "scalar" else (L,)
                t = torch.empty(shape, device=device)
                if not fake:
                    t = (torch.rand(shape, generator=tg) + 0.5).to(device)
                out.append(t)
            elif name == "user_mask":
                t = torch.empty(B, N, N, dtype=torch.bool, device=device)
                if not fake:
                    t = (torch.rand(B, N, N, generator=tg) < 0.7).to(device)
                out.append(t)
        return tuple(out)


def sample(seed: int) -> Sample:
    """The spelling of ``seed`` (deterministic; independent of sizes)."""
    rng = random.Random(seed)
    c = {}
    c["form"] = _pick(rng, FAMILIES["form"], [4, 2, 2, 1])
    c["dtype"] = _pick(rng, FAMILIES["dtype"], [4, 1])
    layouts = FAMILIES["pad_layout"] if c["form"] != "attention" else ["same", "mixed"]
    c["pad_layout"] = _pick(rng, layouts)
    c["pad"] = _pick(rng, PADS)
    if c["pad_layout"] == "mixed":
        c["pad_k"] = _pick(rng, PADS)
        c["pad_v"] = _pick(rng, PADS)
    if c["pad_layout"] == "fused":
        c["split"] = _pick(rng, FAMILIES["split"])
    for fam in ("row_index", "position", "zero", "score", "activation", "unpad", "mask_apply", "length_mask"):
        c[fam] = _pick(rng, FAMILIES[fam])
    c["causal"] = _pick(rng, FAMILIES["causal"], [5, 1])
    causal = c["causal"] == "yes"
    for opt in ("targets", "contextual", "window"):
        c[opt] = _pick(rng, ["no", "yes"], [2, 1]) if causal else "no"
    c["min_full"] = _pick(rng, ["no", "yes"]) if c["window"] == "yes" else "no"
    needs_ids = c["targets"] == "yes" or c["contextual"] == "yes" or c["min_full"] == "yes"
    c["mask"] = "ids" if needs_ids else (_pick(rng, FAMILIES["mask"]) if causal else "none")
    c["scale"] = _pick(rng, FAMILIES["scale"])
    mutations = FAMILIES["mutation"][1:]
    c["mutation"] = _pick(rng, mutations) if rng.random() < NEAR_MISS_RATE else "none"
    if c["mutation"] in ("off_by_one", "anti_causal"):  # the mutated mask replaces the whole mask
        c.update(causal="yes", targets="no", contextual="no", window="no", min_full="no",
                 mask=_pick(rng, ["tril", "arange"]))
    if c["mutation"] == "nonconst_scale":
        c["scale"] = "div_n"  # replaced by the non-constant one
        c["nonconst"] = _pick(rng, ["max", "per_seq"])
    fractions = {"w": _pick(rng, [2, 4, 8, 16]), "f": _pick(rng, [4, 8]), "c": _pick(rng, [1, 2, 3])}
    if not HAS_FBGEMM:
        c = {k: FBGEMM_FALLBACK.get(v, v) for k, v in c.items()}
    return Sample(seed, c, _pick(rng, ALPHAS), fractions)


# ------------------------------------------------------------------------------------------------
# The pieces. ``ctx`` holds the jagged metadata of one call; row ids are computed on first use.

class _Ctx:
    def __init__(self, sample: Sample, offsets, L, N, user_mask=None):
        self.c, self.offsets, self.L, self.N, self.user_mask = sample.choices, offsets, L, N, user_mask
        self.B = offsets.numel() - 1
        self.lengths = offsets[1:] - offsets[:-1]
        self._ids = None

    def rows(self):
        return torch.arange(self.L, device=self.offsets.device)

    def seq_pos(self):
        """Sequence index and position of every jagged row (row-index and position families)."""
        if self._ids is not None:
            return self._ids
        o, L, B, kind = self.offsets, self.L, self.B, self.c["row_index"]
        rows = self.rows()
        if kind == "searchsorted":
            seq = torch.searchsorted(o, rows, right=True) - 1
        elif kind == "repeat_interleave":
            seq = torch.repeat_interleave(torch.arange(B, device=o.device), self.lengths)
        elif kind == "repeat_interleave_size":
            seq = torch.repeat_interleave(torch.arange(B, device=o.device), self.lengths, output_size=L)
        elif kind == "bucketize":
            seq = torch.bucketize(rows, o[1:], right=True)
        else:  # cumsum_onehot: a one at every sequence start (after the first), summed up
            starts = o[1:-1]
            seq = torch.zeros(L + 1, dtype=o.dtype, device=o.device).scatter_add(0, starts, torch.ones_like(starts))
            seq = seq.cumsum(0)[:L]
        if self.c["position"] == "offsets_index":
            pos = rows - o[seq]
        else:
            pos = rows - torch.repeat_interleave(o[:-1], self.lengths, output_size=L)
        self._ids = (seq, pos)
        return self._ids

    def padded_index(self):
        """For every padded slot ``(b, p)``: its jagged row ``offsets[b] + p`` and its validity."""
        ar = torch.arange(self.N, device=self.offsets.device)
        return self.offsets[:-1, None] + ar[None, :], ar[None, :] < self.lengths[:, None]

    def zeros(self, shape, x):
        kind = self.c["zero"]
        if kind == "zeros":
            return torch.zeros(shape, dtype=x.dtype, device=x.device)
        if kind == "new_zeros":
            return x.new_zeros(shape)
        if kind == "zeros_like":
            return torch.zeros_like(x.new_empty(()).expand(shape))
        if kind == "empty_zero_":
            return x.new_empty(shape).zero_()
        if kind == "full":
            return torch.full(shape, 0.0, dtype=x.dtype, device=x.device)
        return x.new_full(shape, 0.0)


def pad(kind: str, x, ctx: _Ctx):
    """``x [L, F]`` -> ``[B, N, F]``, zero padded, spelled ``kind``."""
    B, N, L, Fd = ctx.B, ctx.N, ctx.L, x.shape[1]
    if kind == "index_put":
        seq, pos = ctx.seq_pos()
        return torch.index_put(ctx.zeros((B, N, Fd), x), (seq, pos), x)
    if kind == "index_copy":
        seq, pos = ctx.seq_pos()
        return ctx.zeros((B * N, Fd), x).index_copy(0, seq * N + pos, x).view(B, N, Fd)
    if kind == "scatter":
        seq, pos = ctx.seq_pos()
        idx = (seq * N + pos)[:, None].expand(-1, Fd)
        return ctx.zeros((B * N, Fd), x).scatter(0, idx, x).view(B, N, Fd)
    if kind == "masked_scatter":
        _, valid = ctx.padded_index()
        return ctx.zeros((B, N, Fd), x).masked_scatter(valid[:, :, None].expand(B, N, Fd), x)
    if kind == "gather_mul":
        idx, valid = ctx.padded_index()
        return x[idx.clamp(max=L - 1)] * valid[:, :, None].to(x.dtype)
    if kind == "embedding":  # row 0 of the table is the zero sentinel
        idx, valid = ctx.padded_index()
        table = torch.cat([x.new_zeros(1, Fd), x])
        return F.embedding(torch.where(valid, idx + 1, 0), table)
    if kind == "take_where":
        idx, valid = ctx.padded_index()
        flat = idx.clamp(max=L - 1)[:, :, None] * Fd + torch.arange(Fd, device=x.device)
        return torch.where(valid[:, :, None], torch.take(x, flat), 0.0)
    if kind == "onehot_mm":
        idx, valid = ctx.padded_index()
        onehot = (idx.reshape(-1, 1) == ctx.rows()[None, :]) & valid.reshape(-1, 1)
        return (onehot.to(x.dtype) @ x).view(B, N, Fd)
    if kind == "aten_j2p":
        return torch.ops.aten._jagged_to_padded_dense_forward(x, [ctx.offsets], [N], 0.0)
    if kind == "nested":
        nt = torch.nested.nested_tensor_from_jagged(x, ctx.offsets)
        return nt.to_padded_tensor(0.0, output_size=(B, N, Fd))
    if kind == "fbgemm_j2p":
        return torch.ops.fbgemm.jagged_to_padded_dense(x, [ctx.offsets], [N], 0.0)
    raise ValueError(kind)


def unpad(kind: str, dense, ctx: _Ctx):
    """``dense [B, N, F]`` -> ``[L, F]``, spelled ``kind``."""
    B, N, L, Fd = ctx.B, ctx.N, ctx.L, dense.shape[-1]
    if kind == "index":
        seq, pos = ctx.seq_pos()
        return dense[seq, pos]
    if kind == "index_select":
        seq, pos = ctx.seq_pos()
        return dense.reshape(B * N, Fd).index_select(0, seq * N + pos)
    if kind == "gather":
        seq, pos = ctx.seq_pos()
        return dense.reshape(B * N, Fd).gather(0, (seq * N + pos)[:, None].expand(-1, Fd))
    if kind == "aten_p2j":
        return torch.ops.aten._padded_dense_to_jagged_forward(dense, [ctx.offsets], L)
    if kind == "fbgemm_d2j":
        return torch.ops.fbgemm.dense_to_jagged(dense, [ctx.offsets], L)[0]
    raise ValueError(kind)


def scores(kind: str, qp, kp):
    """``qp, kp [B, N, H, D]`` -> ``S [B, H, N, N]``."""
    B, N, H, D = qp.shape
    if kind == "einsum_bnhd":
        return torch.einsum("bnhd,bmhd->bhnm", qp, kp)
    if kind == "einsum_bhnd":
        return torch.einsum("bhnd,bhmd->bhnm", qp.transpose(1, 2), kp.transpose(1, 2))
    if kind == "matmul":
        return qp.transpose(1, 2) @ kp.transpose(1, 2).transpose(-1, -2)
    qh = qp.permute(0, 2, 1, 3).reshape(B * H, N, D)
    kh = kp.permute(0, 2, 1, 3).reshape(B * H, N, D)
    return torch.bmm(qh, kh.transpose(1, 2)).view(B, H, N, N)


def values(kind: str, p, vp):
    """``p [B, H, N, N]``, ``vp [B, N, H, Dv]`` -> ``[B, N, H, Dv]`` (spelled like the scores)."""
    B, N, H, Dv = vp.shape
    if kind == "einsum_bnhd":
        return torch.einsum("bhnm,bmhd->bnhd", p, vp)
    if kind == "einsum_bhnd":
        return torch.einsum("bhnm,bhmd->bhnd", p, vp.transpose(1, 2)).transpose(1, 2)
    if kind == "matmul":
        return torch.matmul(p, vp.transpose(1, 2)).transpose(1, 2)
    vh = vp.permute(0, 2, 1, 3).reshape(B * H, N, Dv)
    return torch.bmm(p.reshape(B * H, N, N), vh).view(B, H, N, Dv).transpose(1, 2)


def mask(sample: Sample, ctx: _Ctx, num_targets, consts: dict, device):
    """The attention mask as a bool ``[N, N]`` or ``[B, 1, N, N]``, or None (no mask at all)."""
    c, N, mut = sample.choices, ctx.N, sample.mutation
    ar = torch.arange(N, device=device)
    w = consts["max_attn_len"]
    if c["mask"] == "none":
        m = None
    elif c["mask"] == "tril":
        if mut == "off_by_one":
            m = torch.tril(torch.ones(N, N, device=device), diagonal=1)
        elif mut == "anti_causal":
            m = torch.triu(torch.ones(N, N, device=device))
        else:
            m = torch.ones(N, N, device=device).tril()
            if w:
                m = m.triu(-w)
        m = m.bool()
    elif c["mask"] == "arange":
        i, j = ar[:, None], ar[None, :]
        if mut == "off_by_one":
            m = i + 1 >= j
        elif mut == "anti_causal":
            m = i <= j
        else:
            m = i >= j
            if w:
                m = m & (i - j <= w)
    else:  # ids, straight from the semantics
        n = ctx.lengths[:, None]
        ctxlen, f = consts["contextual_seq_len"], consts["min_full_attn_seq_len"]
        if ctxlen:
            ids = torch.clamp(ar[None, :] - (ctxlen - 1), min=0)
            end = n - ctxlen + 1
        else:
            ids = ar[None, :].expand(ctx.B, N)
            end = n
        if num_targets is not None:
            end = end - num_targets[:, None]
            ids = torch.minimum(ids, end)
        d = ids[:, :, None] - ids[:, None, :]
        eye = torch.eye(N, dtype=torch.bool, device=device)
        m = eye | (d > 0)
        if w:
            near = d <= w
            if f:
                near = near | (ids[:, :, None] >= (end - f)[:, :, None])
            m = m & near
        if ctxlen:
            m = m | ((ids[:, :, None] == 0) & (ids[:, None, :] < end[:, :, None]))
        m = m[:, None]
    if c["length_mask"] == "yes":
        inside = ar[None, :] < ctx.lengths[:, None]
        both = (inside[:, :, None] & inside[:, None, :])[:, None]
        m = both if m is None else m & both
    if mut == "data_mask":
        user = ctx.user_mask[:, None]
        m = user if m is None else m & user
    return m


def apply_mask(kind: str, p, m):
    if m is None:
        return p
    if kind == "where":
        return torch.where(m, p, 0.0)
    if kind == "masked_fill":
        return p.masked_fill(~m, 0.0)
    return p * m.to(p.dtype)


class GrammarModel(nn.Module):
    """The module of one :class:`Sample` at one size; forward takes ``Sample.input_names()``."""

    def __init__(self, sample: Sample, N: int, H: int, D: int, reference: bool = False):
        super().__init__()
        self.sample, self.N, self.H, self.D, self.reference = sample, N, H, D, reference
        self.alpha = sample.alpha
        self.consts = sample.constants(N)
        c = sample.choices
        self.act = nn.SiLU() if c["activation"] == "nn_silu" else None
        if sample.mutation == "bias_in_silu":
            self.bias = nn.Parameter(torch.tensor(0.1))
        E = H * D
        layers = {"stu": 1, "stack2": 2}.get(c["form"], 0)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.norm = nn.LayerNorm(E)
            layer.proj = nn.Linear(E, 4 * E)
            layer.norm_a = nn.LayerNorm(E)
            layer.out = nn.Linear(E, E)
            self.layers.append(layer)

    # -- activation and the score chain --------------------------------------------------------
    def _act(self, x):
        kind = self.sample.choices["activation"]
        if self.sample.mutation == "softmax":
            return torch.softmax(x, dim=-1)
        if self.sample.mutation == "bias_in_silu":
            x = x + self.bias
        if kind == "silu":
            return F.silu(x)
        if kind == "x_sigmoid":
            return x * torch.sigmoid(x)
        return self.act(x)

    def attend(self, padded, ctx: _Ctx, num_targets, attn_scale):
        """``padded = (qp, kp, vp) [B, N, H, D]`` -> jagged ``[L, H*D]`` (+ the raw scores)."""
        c, N, alpha = self.sample.choices, self.N, self.alpha
        qp, kp, vp = padded
        scale = c["scale"]
        if scale == "alpha_in_q":
            qp = qp * alpha
        s = scores(c["score"], qp, kp)
        x = s if scale == "alpha_in_q" else alpha * s
        p = self._act(x)
        m = mask(self.sample, ctx, num_targets, self.consts, s.device)
        if scale in ("div_n", "alpha_in_q"):
            p = p / N
        elif scale == "mul_inv_n":
            p = p * (1.0 / N)
        elif scale == "scalar":
            p = p * attn_scale
        elif scale == "row":
            p = p * pad(c["pad"], attn_scale[:, None], ctx)[:, None, :, :]
        if self.sample.mutation == "nonconst_scale":  # 1/N replaced by 1/max(n_b) or by 1/n_b
            if c["nonconst"] == "max":
                p = p * (N / ctx.lengths.max())
            else:
                p = p * N / ctx.lengths.clamp(min=1)[:, None, None, None]
        p = apply_mask(c["mask_apply"], p, m)
        out = values(c["score"], p, vp)
        if scale == "pv_div_n":
            out = out / N
        elif scale == "row_after_pv":
            out = out * pad(c["pad"], attn_scale[:, None], ctx)[:, :, :, None]
        B = ctx.B
        return unpad(c["unpad"], out.reshape(B, N, -1), ctx), s

    def _pads(self):
        c = self.sample.choices
        if c["pad_layout"] == "mixed":
            return c["pad"], c["pad_k"], c["pad_v"]
        return (c["pad"],) * 3

    def attention(self, q, k, v, offsets, num_targets, attn_scale, user_mask=None, fused=None):
        """Jagged ``q, k, v [L, H, D]`` (or ``fused = [L, 4*H*D]`` u, v, q, k) -> ``[L, H, D]``."""
        H, D, N = self.H, self.D, self.N
        L = (q if fused is None else fused).shape[0]
        if self.reference:
            rab = self.bias.expand(1, 1, N, N) if self.sample.mutation == "bias_in_silu" else None
            out = hstu_mha(N, self.alpha, q, k, v, offsets, causal=self.sample.choices["causal"] == "yes",
                           num_targets=num_targets, attn_scale=attn_scale, rab=rab, **self.consts)
            return out, None
        ctx = _Ctx(self.sample, offsets, L, N, user_mask)
        B = ctx.B
        if fused is not None:
            E = H * D
            big = pad(self.sample.choices["pad"], fused, ctx)
            kind = self.sample.choices["split"]
            if kind == "split":
                _, vp, qp, kp = torch.split(big, [E, E, E, E], dim=-1)
            elif kind == "chunk":
                _, vp, qp, kp = big.chunk(4, dim=-1)
            else:
                vp, qp, kp = big[..., E:2 * E], big[..., 2 * E:3 * E], big[..., 3 * E:]
            padded = tuple(t.reshape(B, N, H, D) for t in (qp, kp, vp))
        else:
            padded = tuple(pad(kind, t.reshape(L, -1), ctx).view(B, N, H, -1)
                           for kind, t in zip(self._pads(), (q, k, v)))
        out, s = self.attend(padded, ctx, num_targets, attn_scale)
        return out.view(L, H, -1), s

    # -- wiring ----------------------------------------------------------------------------------
    def forward(self, *args):
        named = dict(zip(self.sample.input_names(), args))
        c, H, D = self.sample.choices, self.H, self.D
        offsets, nt, scale = named["offsets"], named.get("num_targets"), named.get("attn_scale")
        user_mask = named.get("user_mask")
        dtype = self.sample.dtype
        up = (lambda t: t.float()) if dtype != torch.float32 else (lambda t: t)
        scores_out = None
        if c["form"] == "attention":
            q, k, v = (up(named[n]) for n in "qkv")
            out, scores_out = self.attention(q, k, v, offsets, nt, scale, user_mask)
        elif c["form"] == "uvqk":
            uvqk = up(named["uvqk"])
            out, scores_out = self._from_uvqk(uvqk, offsets, nt, scale, user_mask)
        else:
            x = up(named["x"])
            for layer in self.layers:
                uvqk = layer.proj(layer.norm(x))
                u = F.silu(uvqk[:, :H * D])
                a, scores_out = self._from_uvqk(uvqk, offsets, nt, scale, user_mask)
                x = x + layer.out(u * layer.norm_a(a.reshape(-1, H * D)))
            out = x
        out = out.to(dtype)
        if self.sample.mutation == "extra_user" and scores_out is not None:
            return out, scores_out
        return out

    def _from_uvqk(self, uvqk, offsets, nt, scale, user_mask):
        H, D, E = self.H, self.D, self.H * self.D
        L = uvqk.shape[0]
        if self.sample.choices["pad_layout"] == "fused" and not self.reference:
            return self.attention(None, None, None, offsets, nt, scale, user_mask, fused=uvqk)
        _, v, q, k = torch.split(uvqk, [E, E, E, E], dim=-1)
        q, k, v = (t.reshape(L, H, D) for t in (q, k, v))
        return self.attention(q, k, v, offsets, nt, scale, user_mask)


def reference_output(sample: Sample, model: GrammarModel, inputs: tuple):
    """The sample's output with its attention computed by ``reference.hstu_mha`` (same parameters);
    only meaningful for HSTU samples. Inputs are used as given (no copy)."""
    ref = sample.build(model.N, model.H, model.D, reference=True)
    ref.load_state_dict(model.state_dict())
    return ref(*inputs)
