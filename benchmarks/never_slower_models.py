"""The models ``never_slower.py`` times: the reference layer, grammar samples and metamorphically transformed
ones (``--models`` specs, resolved to :class:`ModelSpec`), their inputs and their training or inference step."""
from __future__ import annotations

import dataclasses
import math
import random

import torch

LAYER_FORMS = ("stu", "stack2")  # grammar forms that carry LayerNorm + projection + output around the attention
GRAMMAR_START, METAMORPHIC_START = 0, 5000  # fixed, distinct: the two auto picks are different models
_SEARCH = 100_000  # seeds an auto pick may scan before it gives up


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One resolved model: ``kind`` is reference / grammar / metamorphic; ``seed`` the grammar seed."""

    spec: str
    kind: str
    seed: int | None = None
    transforms: tuple = ()

    @property
    def sample(self):
        from hstu_inductor.testing.grammar import sample
        return None if self.seed is None else sample(self.seed)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.kind == "reference" else self.sample.dtype

    @property
    def form(self) -> str:
        return "STULayer" if self.kind == "reference" else self.sample.choices["form"]

    @property
    def differentiable(self) -> bool:
        return self.kind == "reference" or self.sample.differentiable


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def _eligible(s) -> bool:
    return s.expected_hstu and s.differentiable


def auto_seeds(k: int, start: int) -> list:
    """The first ``k`` eligible grammar seeds from ``start``, at least ceil(k/2) of a layer form."""
    from hstu_inductor.testing.grammar import sample

    others_allowed = k - (k + 1) // 2
    picked, others = [], 0
    for seed in range(start, start + _SEARCH):
        if len(picked) == k:
            break
        s = sample(seed)
        layer = s.choices["form"] in LAYER_FORMS
        if _eligible(s) and (layer or others < others_allowed):
            picked.append(seed)
            others += not layer
    if len(picked) < k:
        raise ValueError(f"only {len(picked)} eligible grammar seeds in [{start}, {start + _SEARCH})")
    return picked


def auto_transforms(k: int) -> list:
    """Per pick i < k: a tuple of graph transformations (registry order), taken in turn from a fixed shuffle."""
    from hstu_inductor.testing.metamorphic import TRANSFORMS

    # all of TRANSFORMS apply here: the ones in metamorphic._NEEDS_VALUES are skipped only on fake tensors
    names = list(TRANSFORMS)
    order = sorted(names)
    random.Random("never_slower:transforms").shuffle(order)
    size = min(len(names), max(2, math.ceil(len(names) / k)))
    picks = []
    for i in range(k):
        chosen = {order[(i * size + j) % len(order)] for j in range(size)}
        picks.append(tuple(t for t in names if t in chosen))
    return picks


def _parse_transforms(text: str) -> tuple:
    from hstu_inductor.testing.metamorphic import SIZE_TRANSFORMS, TRANSFORMS

    names = tuple(t for t in text.split("+") if t)
    unknown = [t for t in names if t not in TRANSFORMS]
    if not names or unknown:
        extra = f" ({', '.join(SIZE_TRANSFORMS)} is a size choice: this benchmark sets its sizes)" \
            if set(unknown) & set(SIZE_TRANSFORMS) else ""
        raise ValueError(f"metamorphic transformations {text!r}: expected one or more of {sorted(TRANSFORMS)} "
                         f"joined by '+'{extra}")
    return names


def _resolve(spec: str) -> list:
    parts = spec.split(":")
    if spec == "reference":
        return [ModelSpec("reference", "reference")]
    if parts[0] == "grammar" and len(parts) == 3 and parts[1] == "auto":
        return [ModelSpec(f"grammar:{s}", "grammar", s) for s in auto_seeds(int(parts[2]), GRAMMAR_START)]
    if parts[0] == "grammar" and len(parts) == 2:
        return [ModelSpec(spec, "grammar", int(parts[1]))]
    if parts[0] == "metamorphic" and len(parts) == 3 and parts[1] == "auto":
        k = int(parts[2])
        return [ModelSpec(f"metamorphic:{s}:{'+'.join(ts)}", "metamorphic", s, ts)
                for s, ts in zip(auto_seeds(k, METAMORPHIC_START), auto_transforms(k))]
    if parts[0] == "metamorphic" and len(parts) == 3:
        ts = _parse_transforms(parts[2])
        return [ModelSpec(f"metamorphic:{int(parts[1])}:{'+'.join(ts)}", "metamorphic", int(parts[1]), ts)]
    raise ValueError(f"unknown model {spec!r}: expected reference, grammar:SEED, grammar:auto:K, "
                     "metamorphic:SEED:T1+T2 or metamorphic:auto:K")


def resolve_models(specs) -> list:
    """The models of ``--models``, in order, each once."""
    out = []
    for spec in specs:
        out += [m for m in _resolve(spec) if m not in out]
    return out


def describe(ms: ModelSpec, H: int, D: int, E: int) -> str:
    """One line for ``--list``: the spec, its form and dtype, and what it computes."""
    head = f"{ms.spec:<48} form={ms.form:<9} dtype={dtype_name(ms.dtype)}"
    if ms.kind == "reference":
        return f"{head}  reference.STULayer(E={E}, H={H}, D={D}), lengths U[0.9N, N], 1..20 targets"
    s = ms.sample
    what = f"hstu={'yes' if s.expected_hstu else 'no (near miss)'} differentiable={'yes' if s.differentiable else 'no'}"
    if ms.kind == "metamorphic":
        what += f" transforms={'+'.join(ms.transforms)}"
    return f"{head}  {what}  alpha={s.alpha:.4g} {s.describe()}"


def build_model(ms: ModelSpec, N: int, H: int, D: int, E: int, device) -> torch.nn.Module:
    """The module for max length ``N`` (the reference layer takes N per call and is the same for all N)."""
    torch.manual_seed(ms.seed or 0)
    if ms.kind == "reference":
        from hstu_inductor.reference import STULayer
        return STULayer(E, H, D, D).to(device, torch.bfloat16)
    return ms.sample.build(N, H, D).to(device)


def input_seed(B: int, N: int) -> int:
    return B * 7919 + N


def seq_lengths(B: int, N: int, seed: int) -> list:
    """Lengths ~ U[0.9N, N]: the first draw of ``make_batch``'s generator, so every model gets the same."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(max(1, int(0.9 * N)), N + 1, (B,), generator=g).tolist()


def make_batch(B, N, E, seed=0, device="cuda"):
    """The reference layer's batch: ``x [L, E]`` bf16, ``offsets [B+1]``, ``num_targets [B]`` in 1..20."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, int(0.9 * N)), N + 1, (B,), generator=g)
    off = torch.zeros(B + 1, dtype=torch.int64)
    off[1:] = lengths.cumsum(0)
    nt = torch.minimum(torch.randint(1, 21, (B,), generator=g), lengths)
    x = torch.randn(int(off[-1]), E, generator=g).to(device, torch.bfloat16)
    return x, off.to(device), nt.to(device)


def make_inputs(ms: ModelSpec, B, N, H, D, E, device, requires_grad=False) -> tuple:
    """The positional arguments of the model's forward for one cell."""
    seed = input_seed(B, N)
    if ms.kind == "reference":
        x, off, nt = make_batch(B, N, E, seed=seed, device=device)
        return x.requires_grad_(requires_grad), off, N, nt
    return ms.sample.inputs(B, N, H, D, lengths=seq_lengths(B, N, seed), seed=seed, requires_grad=requires_grad,
                            device=device)


def output_shape(ms: ModelSpec, L: int, H: int, D: int, E: int) -> tuple:
    if ms.kind == "reference":
        return (L, E)
    return (L, H, D) if ms.form in ("attention", "uvqk") else (L, H * D)


def first_output(out):
    """A near miss with an extra user returns ``(out, scores)``: the gradient flows from ``out``."""
    return out[0] if isinstance(out, (tuple, list)) else out


def step_fn(model, module, task, args, dout):
    """One inference call (no grad), or one forward + backward to the float inputs and parameters."""
    if task == "infer":
        def fwd():
            with torch.no_grad():
                return model(*args)
        return fwd
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    leaves += [p for p in module.parameters() if p.requires_grad]

    def fwd_bwd():
        return torch.autograd.grad(first_output(model(*args)), leaves, dout)
    return fwd_bwd
