"""Run one grammar sample (``hstu_inductor.testing.grammar``) in one mode and record what happened.

Modes (``MODES``):

- ``fake_static``: ``B=128, N=4096, H=4, D=128`` (the model's constants at ``N=4096``), exported
  with ``torch.export`` under ``FakeTensorMode`` with static shapes and rewritten; nothing is
  allocated and nothing runs, so there is no numeric result.
- ``fake_auto``: the same with ``torch.export.Dim.AUTO`` on the jagged rows and the batch dims.
  ``torch.export`` refuses nested tensors, so in both fake modes the samples that build them are
  compiled instead (``torch.compile(backend="hstu_eager")`` called on the fake inputs, static or
  with ``maybe_mark_dynamic`` on the same dims); ``Record.path`` says which.
- ``compile_static`` / ``compile_dynamic``: ``B=4, N=16, H=2, D=8`` with lengths ``[N, 0, 1, r]``,
  ``torch.compile(model, backend="hstu_eager", dynamic=False / True)`` after
  ``torch._dynamo.reset()``; outputs (and, with ``grads=True``, gradients of the float inputs and
  parameters) compared with eager by relative norm (fp32 ``1e-5`` / ``1e-4`` for gradients, bf16
  ``2e-2``).
- ``compile_one``: one sequence (``B=1``, ``N=16``, 3..15 rows), ``dynamic=True``; Dynamo specialises
  the size-1 batch, so this is the graph that serving at batch size 1 compiles. (A length of ``N``
  would share N's symbol, and 2 rows a static L; the graph then admits only that one input, on
  which a near miss can equal HSTU exactly: its rewrite is right, but measures nothing.)
- ``fake_one``: one sequence at production size (``B=1, N=4096, H=4, D=128``), exported statically
  under ``FakeTensorMode`` as ``fake_static`` (serving at batch size 1). The length is drawn per
  seed (``one_length``): ``N`` for a third of the seeds (a full sequence, so ``L == N``), else
  uniform in ``[N/4, N)``. Static shapes admit only that length (``offsets[1] == L``), so a
  near miss is still told apart by the proof on small instances, never by this input.

A record's ``outcome``: ``rewritten`` (HSTU, every attention layer rewritten), ``partial`` (some),
``declined`` (HSTU, none), ``near_miss_kept`` (a near miss left alone: right),
``false_positive`` (a near miss rewritten: wrong), ``error`` (the model, export or compile raised;
``error`` holds the exception). ``numeric_ok`` is False for any mismatch with eager, whatever the
rewrite count.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
import traceback

import torch

from .. import _compat, backend  # noqa: F401  (backend: the hstu ops and the hstu_eager backend)
from ..patterns import run_rewriters
from ..report import collecting
from .grammar import Sample, reference_output, sample

_, FakeTensorMode, DynamicOutputShapeException = _compat.fake_tensor_types()

MODES = {
    "fake_static": dict(B=128, N=4096, H=4, D=128),
    "fake_auto": dict(B=128, N=4096, H=4, D=128),
    "compile_static": dict(B=4, N=16, H=2, D=8),
    "compile_dynamic": dict(B=4, N=16, H=2, D=8),
    "compile_one": dict(B=1, N=16, H=2, D=8),
    "fake_one": dict(B=1, N=4096, H=4, D=128),
}
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 5e-2)}  # (outputs, gradients)


@dataclasses.dataclass
class Record:
    seed: int
    mode: str
    choices: dict
    expected_hstu: bool
    counts: dict = dataclasses.field(default_factory=dict)
    reasons: list = dataclasses.field(default_factory=list)  # attention near-miss reasons
    outcome: str = "error"
    numeric_ok: bool | None = None  # None: not run (fake modes, or stopped before)
    numeric_err: float | None = None
    grad_err: float | None = None
    ref_err: float | None = None  # the generated model vs reference.hstu_mha (HSTU samples)
    seconds: float = 0.0
    graphs: int = 0
    error: str | None = None
    path: str = ""  # fake modes: "export", or "compile" for models torch.export refuses (nested tensors)
    traceback: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _layers(s: Sample) -> int:
    return {"stack2": 2}.get(s.choices["form"], 1)


def _hstu_layers_of_near_miss(s: Sample) -> int:
    """Layers of a near miss that are still HSTU: the extra user (the scores returned) is the last
    layer's only, so the layers before it may be rewritten; every other mutation is in all of them."""
    return _layers(s) - 1 if s.mutation == "extra_user" else 0


# Static modes with one sequence of a fixed length: a per-sequence or batch-max scale 1/n_b is the
# constant 1/L there, so such a sample computes HSTU's values and must be rewritten (by value, not label).
_STATIC_BATCH_OF_ONE = ("fake_one",)


def expected_hstu(s: Sample, mode: str) -> bool:
    """Whether the sample computes HSTU attention at ``mode``'s sizes."""
    if s.mutation == "nonconst_scale" and mode in _STATIC_BATCH_OF_ONE:
        return True
    return s.expected_hstu


def _outcome(s: Sample, counts: dict, mode: str = "") -> str:
    n = counts.get("attention", 0)
    if not expected_hstu(s, mode):
        return "false_positive" if n > _hstu_layers_of_near_miss(s) else "near_miss_kept"
    return "rewritten" if n >= _layers(s) else ("partial" if n else "declined")


def _tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def rel_err(a, b) -> float:
    """``||a - b|| / ||b||`` in float64; 0 for two all-zero tensors, inf for shapes that differ."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def _lengths(B, N, seed, L=None):
    """Compile modes: ``[N, 0, 1, r, ...]``; fake modes: lengths summing to ``L`` near ``B*N``."""
    if L is None:
        rng = random.Random(seed)
        if B == 1:  # one sequence: 3..N-1 rows, so Dynamo keeps L symbolic (0/1 specialise, L == N duck-sizes)
            return [rng.randint(3, N - 1)]
        return ([N, 0, 1] + [rng.randint(0, N) for _ in range(B)])[:B]
    out = [N] * (B - 2) + [L - (B - 2) * N, 0]
    assert 0 <= out[-2] <= N, (B, N, L)
    return out


def one_length(N: int, seed: int) -> int:
    """``fake_one``'s single length: ``N`` for a third of the seeds, else uniform in ``[N/4, N)``
    (a generator of its own, so the grammar's draw for the seed is unchanged)."""
    rng = random.Random(seed * 7919 + 17)
    return N if rng.random() < 1 / 3 else rng.randint(N // 4, N - 1)


def _dynamic_shapes(s: Sample, inputs):
    auto = torch.export.Dim.AUTO
    return {"args": tuple(None if t.dim() == 0 else {0: auto} for t in inputs)}


def _fake(s: Sample, mode: str, rec: Record):
    m = MODES[mode]
    B, N, H, D = m["B"], m["N"], m["H"], m["D"]
    with FakeTensorMode() as fake_mode:
        torch.manual_seed(s.seed)
        model = s.build(N, H, D)
        lengths = [one_length(N, s.seed)] if B == 1 else _lengths(B, N, s.seed, L=B * N - 3 * N // 2)
        inputs = s.inputs(B, N, H, D, lengths=lengths, seed=s.seed)
    if _uses_nested(s):
        rec.path = "compile"
        return fake_compiled(model, inputs, mode, fake_mode)
    rec.path = "export"
    with fake_mode:
        shapes = _dynamic_shapes(s, inputs) if mode == "fake_auto" else None
        ep = torch.export.export(model, inputs, dynamic_shapes=shapes)
    vals = [n.meta["val"] for n in ep.graph_module.graph.find_nodes(op="placeholder")]
    with collecting() as report, torch._guards.detect_fake_mode(vals):
        gm = _compat.trace_aten(ep.graph_module, vals)
        run_rewriters(gm)
    return report


def _uses_nested(s: Sample) -> bool:
    return "nested" in s.choices.values()


def fake_compiled(model, inputs, mode: str, fake_mode, backend_fn="hstu_eager"):
    """``torch.compile`` with ``backend_fn`` called on the fake inputs inside their fake mode (the
    report of the compile); ``fake_auto`` marks the batch/row dims dynamic (``maybe_mark_dynamic``, as
    ``Dim.AUTO``). Used where ``torch.export`` cannot be: it refuses nested tensors
    (``nested_tensor_from_jagged`` under its tracer), so such models are measured the way their users
    run them."""
    torch._dynamo.reset()
    backend.register()
    if mode == "fake_auto":
        for t in inputs:
            if t.dim():
                torch._dynamo.maybe_mark_dynamic(t, 0)
    with collecting() as report, fake_mode, torch.no_grad():
        try:
            torch.compile(model, backend=backend_fn, dynamic=None if mode == "fake_auto" else False)(*inputs)
        except DynamicOutputShapeException:
            # running the compiled graph: a data-dependent op (kept in the graph) on fake tensors of a
            # mode without a shape env has no output size. Compiling (and rewriting) is done by then;
            # Dynamo turns such an exception during tracing into a graph break, never into this.
            pass
    return report


def _compiled(s: Sample, mode: str, rec: Record, grads: bool):
    m = MODES[mode]
    B, N, H, D = m["B"], m["N"], m["H"], m["D"]
    grads = grads and s.differentiable
    # aten's jagged <-> dense ops have no derivative: such models run without autograd (eager and
    # compiled), or AOTAutograd's joint trace of their parameters would fail.
    with contextlib.nullcontext() if s.differentiable else torch.no_grad():
        return _compiled_run(s, mode, rec, grads, B, N, H, D)


def _compiled_run(s: Sample, mode: str, rec: Record, grads: bool, B, N, H, D):
    torch.manual_seed(s.seed)
    model = s.build(N, H, D)
    inputs = s.inputs(B, N, H, D, lengths=_lengths(B, N, s.seed), seed=s.seed, requires_grad=grads)
    eager = _tuple(model(*inputs))
    if s.expected_hstu:
        with torch.no_grad():
            ref = _tuple(reference_output(s, model, inputs))
        rec.ref_err = rel_err(eager[0], ref[0])
    torch._dynamo.reset()
    backend.register()  # as in a fresh process: reset() dropped the Dynamo callbacks the import installed
    with collecting() as report:
        compiled = torch.compile(model, backend="hstu_eager", dynamic=mode in ("compile_dynamic", "compile_one"))
        got = _tuple(compiled(*inputs))
    rec.counts, rec.graphs = dict(report.counts), report.graphs
    rec.numeric_err, rec.grad_err, rec.numeric_ok = compare_with_eager(model, inputs, eager, got, s.dtype, grads)
    return report


def compare_with_eager(model, inputs, eager, got, dtype, grads: bool):
    """``(output error, gradient error or None, within TOLERANCE[dtype])`` of compiled outputs ``got``
    against ``eager``; the gradients of the float inputs and parameters under one fixed cotangent."""
    tol_out, tol_grad = TOLERANCE[dtype]
    err = max((rel_err(a, b) for a, b in zip(got, eager)), default=0.0) if len(got) == len(eager) else float("inf")
    ok, grad_err = err < tol_out, None
    if grads:
        leaves = [t for t in inputs if t.is_floating_point() and t.requires_grad] + list(model.parameters())
        cot = [torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t.dtype) for t in eager]

        def grad(outs):
            return torch.autograd.grad([o for o in outs if o.requires_grad], leaves,
                                       [c for o, c in zip(outs, cot) if o.requires_grad], allow_unused=True)

        pairs = [(a, b) for a, b in zip(grad(got), grad(eager)) if b is not None and b.norm() > 0]
        grad_err = max((rel_err(a, b) if a is not None else float("inf") for a, b in pairs), default=0.0)
        ok = ok and grad_err < tol_grad
    return err, grad_err, ok


def record_error(rec, e: Exception) -> None:
    """An exception of one run, recorded on ``rec`` (a measurement goes on past one bad model)."""
    rec.outcome = "error"
    rec.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
    rec.reasons = [rec.error]
    rec.traceback = traceback.format_exc(limit=-3)


def run(seed_or_sample, mode: str, grads: bool = False) -> Record:
    """One sample in one mode; never raises (an exception is recorded as ``outcome="error"``)."""
    s = seed_or_sample if isinstance(seed_or_sample, Sample) else sample(seed_or_sample)
    rec = Record(s.seed, mode, dict(s.choices), expected_hstu(s, mode))
    start = time.perf_counter()
    try:
        report = _fake(s, mode, rec) if mode.startswith("fake") else _compiled(s, mode, rec, grads)
        rec.counts, rec.graphs = dict(report.counts), report.graphs
        rec.reasons = [r for k, r in report.near_misses if k == "attention"]
        rec.outcome = _outcome(s, rec.counts, mode)
    except Exception as e:  # recorded, not raised: one bad model must not stop a measurement
        record_error(rec, e)
    finally:
        torch._dynamo.reset()
    rec.seconds = time.perf_counter() - start
    return rec


def start_measurement(parser, modes: str, known, level=logging.WARNING) -> list:
    """For a measuring script: log progress, not one report per graph, no warnings; the modes of
    the comma-separated ``modes`` (an unknown one is a usage error of ``parser``)."""
    import warnings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("hstu_inductor").setLevel(level)
    warnings.filterwarnings("ignore")
    out = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = set(out) - set(known)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {sorted(known)}")
    return out


def write_tables(out, md: str) -> None:
    """``OUT.md`` of a measuring script, logged and printed (``OUT.json`` is written as it goes)."""
    out.with_suffix(".md").write_text(md)
    logging.getLogger(__name__).info("wrote %s and %s", out.with_suffix(".json"), out.with_suffix(".md"))
    print(md)
