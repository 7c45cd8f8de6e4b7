"""Metamorphic coverage: semantics-preserving transformations of the graphs Dynamo captures.

The spelling grammar (``grammar``) only draws spellings from families the matcher already knows,
so its rate says little about code we did not foresee. Here a model (a grammar sample or any other
case) is compiled through a wrapping Dynamo backend, :class:`Metamorphic`, that rewrites each
captured graph into an *equivalent* one before the real backend sees it, and we measure whether the
real backend still rewrites the attention, never rewrites a near miss, and still equals eager.

Design choices (and why):

- **Transform the torch-level FX graph that Dynamo hands to the backend**, not the user's source:
  every model gets the same transformations for free, and it is exactly what the backend reads
  (``call_function`` on ``torch.*`` / ``operator.*`` / ``F.*`` and ``call_method`` nodes). The
  wrapper copies ``gm``, applies the transformations, then calls the inner backend
  (``hstu_inductor.backend.hstu_eager_backend`` by default). It sets ``__wrapped__`` to the inner
  backend, so the frame is traced with our backend's Dynamo options
  (``capture_dynamic_output_shape_ops``) as for a plain ``backend="hstu_eager"`` compile.
- **Each transformation is a small generic function** ``fn(gm, rng) -> int`` (sites changed) over
  node targets and example values (``node.meta["example_value"]``: dtypes, shapes), never over the
  grammar's names, so it applies to any model (the public-style GR/tzrec stacks too). It picks a
  random non-empty subset of its applicable sites, so one seed exercises one combination and many
  seeds cover many. New nodes get an ``example_value`` computed in the graph's own fake mode, so
  transformations compose (a later one reads the dtypes of an earlier one's nodes).
- **Values are preserved exactly** (integer and boolean re-association and commutation, slicing
  forms, in-place twins, where/masked_fill/mul of a 0/1 mask, buffers) **or up to float rounding**
  (moving a scalar factor across a linear op, ``x / c`` vs ``x * (1 / c)``). No float sums are
  re-associated. Masking by multiplication differs from ``where`` only on non-finite scores, which
  these models never produce.
- **A failing transformation never breaks the run**: each is applied to a copy of the current
  graph; if it raises, the copy is dropped and the error recorded in ``Record.transform_errors``.
- ``mask_buffer`` turns a constant tensor (a mask, an ``arange``) into a graph *input*, which is how
  a registered buffer reaches a backend under Dynamo (``inline_inbuilt_nn_modules``). The wrapper
  evaluates the lifted constant subgraph once (real tensors, or fakes of the caller's fake mode in
  the fake modes), hands the value to the inner backend as an example input and passes the same
  tensor first on every call, as Dynamo passes a module's buffers (static shape, marked a static
  input, a ``GraphArg`` naming ``L['self']._buffers[...]``). Dynamo guards a buffer's metadata, not
  its values, so a backend may rewrite such a graph only by reading the value at compile time and
  guarding it at run time (the backend's ``ConstantGuard``), or by checking it on every call.
- ``sizes_coincide`` is not a graph transformation but a size choice of the run (``COINCIDE``):
  sizes where ``B * H * D == N``, ``D == N`` or ``B == H``, where a size-based reading of the graph
  can confuse two dimensions.

``run(case, transforms, mode)`` mirrors ``grammar_run.run`` (same modes, same outcome names and
tolerances) and returns a :class:`Record`; ``scripts/metamorphic_rates.py`` runs many;
``docs/metamorphic.md`` has the transformations and the measured rates.

Modules: this one holds the registry (``TRANSFORMS``, ``ALL``), the wrapping backend and the runs
(``Case``, ``Record``, ``run``), and re-exports the transformations; ``metamorphic_graph`` holds
the graph helpers they share; each transformation has a module of its own: ``metamorphic_reassoc``,
``metamorphic_inplace``, ``metamorphic_split`` (``split_forms``), ``metamorphic_masks``
(``mask_apply``, ``mask_buffer``) and ``metamorphic_scale`` (``scale_move``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from typing import Callable

import torch
from torch.fx import GraphModule

from .. import _compat, backend
from ..report import collecting
from . import grammar_run
from .grammar import Sample, sample
from .metamorphic_graph import copy_graph_module
from .metamorphic_inplace import _to_inplace, inplace
from .metamorphic_masks import mask_apply, mask_buffer
from .metamorphic_reassoc import reassoc
from .metamorphic_scale import scale_move
from .metamorphic_split import split_forms

FakeTensor, FakeTensorMode, _ = _compat.fake_tensor_types()

# the names callers read through this module (tests, scripts/metamorphic_rates.py); ``_to_inplace``
# rewrites one node in place, for a caller that builds a graph by hand
__all__ = ["ALL", "COINCIDE", "MODES", "SIZE_TRANSFORMS", "TRANSFORMS", "Case", "Metamorphic", "Record",
           "copy_graph_module", "grammar_case", "run", "reassoc", "inplace", "split_forms", "mask_apply",
           "mask_buffer", "scale_move", "_to_inplace"]

# ------------------------------------------------------------------------------------------------
# The registry and the wrapping backend

TRANSFORMS: dict[str, Callable[[GraphModule, random.Random], int]] = {
    "reassoc": reassoc,
    "inplace": inplace,
    "split_forms": split_forms,
    "mask_apply": mask_apply,
    "mask_buffer": mask_buffer,
    "scale_move": scale_move,
}
SIZE_TRANSFORMS = ("sizes_coincide",)  # a size choice of the run, not a graph transformation
ALL = tuple(TRANSFORMS) + SIZE_TRANSFORMS


class Metamorphic:
    """Dynamo backend: ``torch.compile(model, backend=Metamorphic(inner, transforms, seed))``
    transforms a copy of every captured graph (``transforms`` in order, each on a random subset of
    its sites drawn from ``seed`` and the graph's index) and compiles it with ``inner``. ``calls``
    holds, per backend call, the sites changed per transformation and their descriptions."""

    def __init__(self, inner=None, transforms=(), seed: int = 0):
        self.inner = inner if inner is not None else backend.hstu_eager_backend
        self.__wrapped__ = self.inner  # our frames keep hstu's Dynamo options (_compat.unwrap_backend)
        unknown = [t for t in transforms if t not in TRANSFORMS]
        if unknown:
            raise ValueError(f"unknown graph transformations {unknown}; known: {sorted(TRANSFORMS)}")
        self.transforms, self.seed = tuple(transforms), seed
        self.calls: list = []

    def __call__(self, gm: GraphModule, example_inputs):
        rng = random.Random(f"{self.seed}:{len(self.calls)}:{'+'.join(self.transforms)}")
        call = {"changed": {}, "sites": [], "errors": []}
        self.calls.append(call)
        new = copy_graph_module(gm)
        fake = _caller_fake_mode(example_inputs) is not None
        for name in self.transforms:
            if fake and name in _NEEDS_VALUES:  # not applied: counted as such, never as a decline
                call["changed"][name] = 0
                continue
            trial = copy_graph_module(new)
            try:
                call["changed"][name] = TRANSFORMS[name](trial, rng)
                trial.graph.lint()
                trial.recompile()
                new = trial
            except Exception as e:  # a transformation bug must not hide the others' results
                call["changed"][name] = 0
                call["errors"].append(f"{name}: {type(e).__name__}: {e}"[:300])
        call["sites"] = list(new.meta.get("metamorphic_sites", []))
        buffers = new.meta.get("metamorphic_buffers", [])
        for key in ("metamorphic_sites", "metamorphic_buffers", "metamorphic_fake_mode"):
            new.meta.pop(key, None)
        if not buffers:
            return self.inner(new, example_inputs)
        lifted = _WithBuffers(None, [value for _, value in buffers])
        # the buffers' values are example inputs like the user's (real, or fakes of the caller's mode)
        lifted.compiled = self.inner(new, lifted.values_for(example_inputs) + list(example_inputs))
        return lifted


# Transformations whose result has no meaning under fake tensors: a lifted buffer's values would be fake,
# so no backend could tell what the graph computes (the constant it replaced could be read).
_NEEDS_VALUES = ("mask_buffer",)


def _caller_fake_mode(args):
    """The fake mode of the caller's fake tensors (the fake modes), else None."""
    return next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)


class _WithBuffers:
    """The compiled function of a graph with lifted buffers: computes their values once per fake
    mode of the caller (real tensors otherwise) and passes the same tensors first on every call, as
    Dynamo passes a module's buffers (a backend may guard them by identity and version)."""

    def __init__(self, compiled, buffers: list):
        self.compiled, self.buffers, self.values = compiled, buffers, {}

    def values_for(self, args) -> list:
        mode = _caller_fake_mode(args)
        key = id(mode)
        if key not in self.values:
            ctx = mode if mode is not None else _compat.no_fake_mode()
            with ctx, torch.no_grad():
                self.values[key] = [b() for b in self.buffers]
            if mode is None:
                # Dynamo hands a backend real example inputs and records a buffer as static-shaped: so is
                # this value when AOTAutograd fakes it (else with size symbols of no source, which fail
                # Dynamo's guard building)
                for k, v in enumerate(self.values[key]):
                    _compat.fake_as_static_input(v, f"metamorphic_buffer_{k}")
        return self.values[key]

    def __call__(self, *args):
        return self.compiled(*self.values_for(args), *args)


# ------------------------------------------------------------------------------------------------
# Cases, modes and runs

@dataclasses.dataclass
class Case:
    """A model to transform: how to build it at ``(N, H, D)`` and make inputs, and what the
    backend must do with it (``layers`` attention rewrites if HSTU; at most ``near_miss_layers``
    if not)."""

    name: str
    seed: int
    expected_hstu: bool
    layers: int
    build: Callable
    inputs: Callable  # (B, N, H, D, lengths, seed, requires_grad) -> tuple
    dtype: torch.dtype = torch.float32
    differentiable: bool = True
    near_miss_layers: int = 0
    choices: dict = dataclasses.field(default_factory=dict)
    lengths: Callable | None = None  # (B, N, seed, L=None) -> list; default: grammar_run._lengths


def grammar_case(seed_or_sample) -> Case:
    """A grammar sample as a case (same model, inputs and expectation as ``grammar_run``)."""
    s = seed_or_sample if isinstance(seed_or_sample, Sample) else sample(seed_or_sample)
    return Case(name=f"grammar:{s.seed}", seed=s.seed, expected_hstu=s.expected_hstu,
                layers=grammar_run._layers(s), build=s.build,
                inputs=lambda B, N, H, D, lengths, seed, requires_grad=False: s.inputs(
                    B, N, H, D, lengths=lengths, seed=seed, requires_grad=requires_grad),
                dtype=s.dtype, differentiable=s.differentiable,
                near_miss_layers=grammar_run._hstu_layers_of_near_miss(s), choices=dict(s.choices))


MODES = {k: v for k, v in grammar_run.MODES.items() if k != "fake_one"}  # fake_one: export only
# sizes_coincide: per mode family, sizes where two dimensions the graph reads coincide
COINCIDE = {
    "small": {"bhd_eq_n": dict(B=2, N=16, H=2, D=4), "d_eq_n": dict(B=4, N=16, H=2, D=16),
              "b_eq_h": dict(B=2, N=16, H=2, D=8)},
    "one": {"hd_eq_n": dict(B=1, N=16, H=2, D=8), "d_eq_n": dict(B=1, N=16, H=2, D=16),
            "b_eq_h": dict(B=1, N=16, H=1, D=8)},
    "production": {"bhd_eq_n": dict(B=8, N=4096, H=4, D=128), "d_eq_n": dict(B=128, N=128, H=4, D=128),
                   "b_eq_h": dict(B=4, N=4096, H=4, D=128)},
}


@dataclasses.dataclass
class Record:
    case: str
    seed: int
    mode: str
    transforms: tuple
    expected_hstu: bool
    choices: dict = dataclasses.field(default_factory=dict)
    sizes: dict = dataclasses.field(default_factory=dict)
    size_config: str = ""  # sizes_coincide: which coincidence
    changed: dict = dataclasses.field(default_factory=dict)  # transformation -> sites changed (all graphs)
    sites: list = dataclasses.field(default_factory=list)
    transform_errors: list = dataclasses.field(default_factory=list)
    counts: dict = dataclasses.field(default_factory=dict)
    reasons: list = dataclasses.field(default_factory=list)
    outcome: str = "error"
    numeric_ok: bool | None = None
    numeric_err: float | None = None
    grad_err: float | None = None
    seconds: float = 0.0
    graphs: int = 0
    error: str | None = None
    traceback: str | None = None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["transforms"] = list(self.transforms)
        return d


def _outcome(case: Case, counts: dict) -> str:
    n = counts.get("attention", 0)
    if not case.expected_hstu:
        return "false_positive" if n > case.near_miss_layers else "near_miss_kept"
    return "rewritten" if n >= case.layers else ("partial" if n else "declined")


def _sizes(mode: str, transforms, seed: int) -> tuple[dict, str]:
    sizes = dict(MODES[mode])
    if "sizes_coincide" not in transforms:
        return sizes, ""
    family = "production" if mode.startswith("fake") else ("one" if sizes["B"] == 1 else "small")
    name = random.Random(f"sizes:{seed}").choice(sorted(COINCIDE[family]))
    return dict(COINCIDE[family][name]), name


def _lengths(case: Case, B, N, seed, L=None):
    fn = case.lengths or grammar_run._lengths
    return fn(B, N, seed, L)


def _compiled(case: Case, mode: str, meta: Metamorphic, rec: Record, grads: bool, sizes: dict):
    B, N, H, D = sizes["B"], sizes["N"], sizes["H"], sizes["D"]
    grads = grads and case.differentiable
    with contextlib.nullcontext() if case.differentiable else torch.no_grad():
        torch.manual_seed(case.seed)
        model = case.build(N, H, D)
        inputs = case.inputs(B, N, H, D, _lengths(case, B, N, case.seed), case.seed, requires_grad=grads)
        eager = grammar_run._tuple(model(*inputs))
        torch._dynamo.reset()
        backend.register()  # reset() dropped the Dynamo callbacks the import installed
        with collecting() as report:
            compiled = torch.compile(model, backend=meta, dynamic=mode in ("compile_dynamic", "compile_one"))
            got = grammar_run._tuple(compiled(*inputs))
        rec.numeric_err, rec.grad_err, rec.numeric_ok = grammar_run.compare_with_eager(
            model, inputs, eager, got, case.dtype, grads)
    return report


def _fake(case: Case, mode: str, meta: Metamorphic, sizes: dict):
    """Production sizes under ``FakeTensorMode``: ``torch.compile`` with the wrapper called on fake
    inputs inside the fake mode (``grammar_run.fake_compiled``); ``fake_auto`` marks the
    batch/row dims dynamic (``maybe_mark_dynamic``, as ``Dim.AUTO``)."""
    B, N, H, D = sizes["B"], sizes["N"], sizes["H"], sizes["D"]
    with FakeTensorMode() as fake_mode:
        torch.manual_seed(case.seed)
        model = case.build(N, H, D)
        lengths = _lengths(case, B, N, case.seed, L=B * N - 3 * N // 2) if B > 1 \
            else [grammar_run.one_length(N, case.seed)]
        inputs = case.inputs(B, N, H, D, lengths, case.seed)
    return grammar_run.fake_compiled(model, inputs, mode, fake_mode, backend_fn=meta)


def run(case, transforms=(), mode: str = "compile_static", grads: bool = False, seed: int | None = None) -> Record:
    """One case (a :class:`Case`, a grammar :class:`Sample` or a grammar seed) in one mode with the
    transformations ``transforms`` (names of ``ALL``, applied in order); never raises. The
    transformations' random choices follow ``seed`` (default: the case's seed)."""
    if not isinstance(case, Case):
        case = grammar_case(case)
    transforms = tuple(transforms)
    unknown = set(transforms) - set(ALL)
    if unknown:
        raise ValueError(f"unknown transformations {sorted(unknown)}; known: {list(ALL)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {sorted(MODES)}")
    seed = case.seed if seed is None else seed
    sizes, size_name = _sizes(mode, transforms, seed)
    rec = Record(case.name, case.seed, mode, transforms, case.expected_hstu, dict(case.choices), sizes, size_name)
    meta = Metamorphic(backend.hstu_eager_backend, [t for t in transforms if t in TRANSFORMS], seed)
    start = time.perf_counter()
    try:
        report = _fake(case, mode, meta, sizes) if mode.startswith("fake") \
            else _compiled(case, mode, meta, rec, grads, sizes)
        rec.counts, rec.graphs = dict(report.counts), report.graphs
        rec.reasons = [r for k, r in report.near_misses if k == "attention"]
        rec.outcome = _outcome(case, rec.counts)
    except Exception as e:  # recorded, not raised: one bad model must not stop a measurement
        grammar_run.record_error(rec, e)
    finally:
        torch._dynamo.reset()
    for call in meta.calls:
        for name, k in call["changed"].items():
            rec.changed[name] = rec.changed.get(name, 0) + k
        rec.sites += call["sites"]
        rec.transform_errors += call["errors"]
    if size_name:
        rec.changed["sizes_coincide"] = 1
    rec.seconds = time.perf_counter() - start
    return rec
