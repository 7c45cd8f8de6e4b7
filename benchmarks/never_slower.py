"""Is ``backend="hstu"`` ever slower than stock Inductor? Plain-PyTorch models we did not tune, over a grid.

    python benchmarks/never_slower.py --out OUTDIR [--models reference grammar:auto:3 metamorphic:auto:2]
        [--batch 1 4 16 64 128] [--n 256 1024 4096] [--tasks infer train]
        [--modes default reduce-overhead dynamic] [--static] [--rounds 2] [--providers inductor hstu]
    python benchmarks/never_slower.py --list --models reference grammar:auto:3 metamorphic:auto:2

The grid of issue 32 item 6 (every cell >= 1.0x stock Inductor within the measured spread, in both rounds):

    python benchmarks/never_slower.py --models reference grammar:auto:3 metamorphic:auto:2 --batch 1 4 32
        --n 256 1024 2048 --tasks infer train --modes default reduce-overhead dynamic --static --rounds 2 --out OUT

Models (``--models``, default ``reference``), each the same plain PyTorch for every provider:

- ``reference``: ``reference.STULayer`` (E = ``--embedding``, default H*D; H = ``--heads``, D = ``--dim``,
  bf16, lengths ~ U[0.9N, N], 1..20 targets);
- ``grammar:SEED``: the spelling ``hstu_inductor.testing.grammar.sample(SEED)``, built for each N with
  ``Sample.build(N, H, D)`` (its mask constants follow N), in the sample's own dtype (fp32 or bf16:
  the ``dtype`` column), the same lengths as the reference batch;
- ``grammar:auto:K``: the first K seeds from ``never_slower_models.GRAMMAR_START`` whose sample is HSTU attention
  (``expected_hstu``: no mutation, or the learned bias inside the silu, i.e. HSTU with a relative
  attention bias) and differentiable (no aten jagged op without autograd; whether a seed's fbgemm
  jagged ops stay fbgemm depends on fbgemm_gpu being installed, so ``--list`` shows what this
  install picks), so that train and infer time the same models. At least half of them (rounded up)
  have a form that carries the layer (``stu``/``stack2``: LayerNorm, projection, output block);
  the rest take the first eligible seeds of any form (bare attention on q/k/v, or on a fused uvqk),
  so the pick stays the grammar's spellings, only skewed towards whole layers;
- ``metamorphic:SEED:T1+T2``: the grammar sample SEED compiled through
  ``testing.metamorphic.Metamorphic(inner, (T1, T2), SEED)``, which transforms every captured
  graph into an equivalent one before ``inner`` compiles it. Both sides compile the same
  transformation of the graph: stock Inductor's ``inner`` is ``compile_fx`` with the mode's
  Inductor options (``list_mode_options``: ``triton.cudagraphs`` for reduce-overhead), ``hstu``'s
  is ``hstu_backend`` with the mode. (The graph is the one each backend's Dynamo capture yields:
  ``hstu`` traces its frames with ``capture_dynamic_output_shape_ops``, so a data-dependent-shape
  op splits stock Inductor's graph but not ours, as in plain use; the ``transformed`` column shows
  the sites each side changed, and a cell whose two sides changed different sites says so.)
- ``metamorphic:auto:K``: the first K eligible seeds (as ``grammar:auto``) from
  ``never_slower_models.METAMORPHIC_START``, each with max(2, ceil(6/K)) of the graph transformations
  (``metamorphic.TRANSFORMS``: all of them apply to the real tensors timed here, including
  ``mask_buffer``, which needs values) taken in turn from a fixed shuffle, so the K picks together
  apply all six.

Providers (``--providers``, default ``inductor hstu``): ``inductor`` (``torch.compile(model)``) is the
baseline of every cell and always timed; ``hstu`` (``backend="hstu"``, every rewrite),
``hstu_attention`` / ``hstu_blocks`` (only the attention, or only the preprocess/output blocks,
rewritten: ``hstu_inductor.config.patch(patterns=...)``, kept active while the provider warms up and
is timed, since a recompile happens inside a call).

Modes: ``default`` / ``reduce-overhead`` with ``dynamic=True`` (``--static``: a fresh static compile
per cell, as a first compile sees it); ``dynamic``: ``dynamic=True`` in the default mode whatever
``--static`` says. A dynamic compile serves every (B, N) of a (model, task, mode) for the reference,
every B of one N for a grammar sample (its model is built per N).

Side by side: all providers are compiled after one ``torch._dynamo.reset()`` (per cell when static,
per dynamic compile otherwise) and stay alive together (Dynamo's recompile limit is raised so that
their cache entries fit). In every cell (model, task, mode, B, N) each provider warms up (3 calls:
compile, recompile, CUDA-graph recording), then they are timed in alternation for ``--rounds``
rounds, round r in provider order, reversed on odd rounds so that order bias cancels. Timing: CUDA
events around ``--iters`` calls, median of 5 repeats. Rows (one per provider and round) go to
``never_slower.csv`` as they are measured, so a run cut short (``--budget-s``) keeps what it
measured; a provider or model that fails, or runs out of memory, is a row with a note (the train
task of a sample that is not differentiable: one skipped row). The summary (printed, and
``never_slower.md``) gives per cell and provider the ratio Inductor / provider of each round and
their spread ((max - min) / mean of the rounds' ratios), then per provider and round the minimum
ratio and its cell, and the cells that fail the issue's criterion: a round's ratio below 1.0 by more
than the cell's spread (ratio < 1 - spread).

``--list`` prints the resolved models (spec, form, dtype, what is sampled) and times nothing. A hidden
``--device cpu`` runs the whole path on CPU (wall-clock timing, one thread) to check the plumbing
without a GPU, e.g. ``--device cpu --batch 2 --n 16 --heads 2 --dim 8 --iters 1``; its times mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import gc
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from never_slower_models import (  # noqa: E402  (the model list)
    ModelSpec, dtype_name, resolve_models, describe, build_model, input_seed, seq_lengths, make_inputs, output_shape, step_fn)

log = logging.getLogger("hstu_inductor.benchmarks.never_slower")
PROVIDERS = {"inductor": None, "hstu": {"attention": True, "preprocess": True, "output": True},
             "hstu_attention": {"attention": True, "preprocess": False, "output": False},
             "hstu_blocks": {"attention": False, "preprocess": True, "output": True}}
MODES = ("default", "reduce-overhead", "dynamic")
FIELDS = ["model", "dtype", "task", "mode", "dynamic", "provider", "B", "N", "round", "ms", "rewrites", "cost_rule",
          "cudagraph_skips", "compile_s", "transformed", "note"]
CELL_KEYS = ("model", "dtype", "task", "mode", "dynamic", "B", "N")


# ------------------------------------------------------------------------------------------------
# Compiling the providers

class _BoundBackend:
    """A backend with its mode options bound: ``Metamorphic`` calls ``inner(gm, example_inputs)``, and
    ``torch.compile(mode=...)`` would hand the mode to the wrapper, which takes none. ``__wrapped__``
    lets ``_compat.unwrap_backend`` find the function, so hstu's frames keep hstu's Dynamo options."""

    def __init__(self, fn, **kwargs):
        self.fn, self.kwargs = fn, kwargs
        self.__wrapped__ = fn

    def __call__(self, gm, example_inputs):
        return self.fn(gm, example_inputs, **self.kwargs)


def _inner_backend(prov: str, mode: str | None, dynamic: bool):
    if prov == "inductor":
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        # what torch.compile(mode=...) hands compile_fx (_TorchCompileInductorWrapper.apply_mode)
        patches = dict(list_mode_options(mode, dynamic)) if mode else {}
        return _BoundBackend(compile_fx, config_patches=patches)
    from hstu_inductor.backend import hstu_backend
    return _BoundBackend(hstu_backend, mode=mode)


def compile_provider(module, ms: ModelSpec, prov: str, mode: str, dynamic: bool):
    """``(compiled module, Metamorphic wrapper or None)``; nothing is compiled before the first call."""
    inductor_mode = None if mode in ("default", "dynamic") else mode
    if ms.kind == "metamorphic":
        from hstu_inductor.testing.metamorphic import Metamorphic

        meta = Metamorphic(_inner_backend(prov, inductor_mode, dynamic), ms.transforms, ms.seed)
        return torch.compile(module, backend=meta, dynamic=dynamic), meta
    if prov == "inductor":
        return torch.compile(module, mode=inductor_mode, dynamic=dynamic), None
    if prov == "hstu":
        return torch.compile(module, backend="hstu", mode=inductor_mode, dynamic=dynamic), None
    # a backend object of its own: Dynamo reuses a cache entry compiled by the same backend object, so the
    # partial providers, compiled beside "hstu" under other patterns, would otherwise run its graph
    return torch.compile(module, backend=_inner_backend(prov, inductor_mode, dynamic), dynamic=dynamic), None


def provider_patch(prov: str):
    import hstu_inductor

    return hstu_inductor.config.patch(patterns=PROVIDERS[prov]) if PROVIDERS[prov] else contextlib.nullcontext()


def fresh_dynamo() -> None:
    """Drop every compiled graph (both providers' cache entries, CUDA-graph trees) and free their memory."""
    import hstu_inductor

    gc.collect()
    torch._dynamo.reset()
    hstu_inductor.backend.register()  # idempotent; keeps our frame config however reset() treats callbacks
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def raise_recompile_limit(n: int = 64) -> None:
    """All providers' entries live in one code object's cache (a dynamic compile adds a B=1 specialisation
    or two per provider); past Dynamo's limit (8) a frame would silently run eagerly."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), n))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * n)


# ------------------------------------------------------------------------------------------------
# Timing

class _SkipLog(logging.Handler):
    """Inductor's "skipping cudagraphs due to ..." warnings (a graph run without CUDA graphs under
    reduce-overhead pays its launches on the host: the reason belongs next to the time)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        torch._logging.set_logs(cudagraphs=True)
        for name in ("torch", "torch._inductor"):
            logging.getLogger(name).addHandler(self)

    def emit(self, record):
        msg = record.getMessage()
        if "cudagraph" in msg.lower() and "skip" in msg.lower():
            self.messages.append(msg.splitlines()[0][:160])


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters, mark, device="cuda"):
    """Median over 5 repeats of the mean time of ``iters`` back-to-back calls (ms). CPU (plumbing
    checks only): wall time."""
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(5):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        for _ in range(iters):
            if mark:
                torch.compiler.cudagraph_mark_step_begin()
            fn()
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            times.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(times)


def _error_note(e: BaseException) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    text = str(e).splitlines()[0][:120] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def _transformed(meta, first_call: int) -> str:
    """Sites changed per transformation by the compiles since ``first_call`` (Metamorphic.calls)."""
    if meta is None or len(meta.calls) <= first_call:
        return ""
    changed, errors = {}, 0
    for call in meta.calls[first_call:]:
        for name, k in call["changed"].items():
            changed[name] = changed.get(name, 0) + k
        errors += len(call["errors"])
    text = " ".join(f"{k}={v}" for k, v in changed.items())
    return text + (f" errors={errors}" if errors else "")


def warm_up(prov, fn, mode, device, skips, meta) -> dict:
    """Compile (on first call), recompile and record CUDA graphs; what the compile reported."""
    from hstu_inductor.report import collecting

    info = dict(compile_s=float("nan"), rewrites="", cost_rule="", cudagraph_skips="", transformed="", note="",
                ok=False)
    skips.messages.clear()
    first_call = len(meta.calls) if meta is not None else 0
    t0 = time.time()
    try:
        with provider_patch(prov), collecting() as report:
            for _ in range(3):
                if mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                fn()
        _sync(device)
        info["ok"] = True
        if prov != "inductor" and report.graphs:
            info["rewrites"] = "/".join(str(report.counts.get(k, 0)) for k in ("preprocess", "attention", "output"))
            info["cost_rule"] = "; ".join(report.cost_rule)[:200]
        if report.fallbacks:
            info["note"] = ("fallback: " + "; ".join(str(f) for f in report.fallbacks))[:200]
    except Exception as e:  # noqa: BLE001  (a provider failing is a row, not a crash)
        info["note"] = _error_note(e)
        log.debug("warm-up of %s failed", prov, exc_info=e)
    info["compile_s"] = round(time.time() - t0, 1)
    info["cudagraph_skips"] = "; ".join(sorted(set(skips.messages)))[:300]
    info["transformed"] = _transformed(meta, first_call)
    return info


# ------------------------------------------------------------------------------------------------
# The run

class Rows:
    """``never_slower.csv``, one flushed row at a time."""

    def __init__(self, path):
        self.path = path
        self.file = open(path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=FIELDS)
        self.writer.writeheader()

    def write(self, row: dict) -> None:
        self.writer.writerow({k: row.get(k, "") for k in FIELDS})
        self.file.flush()

    def close(self) -> None:
        self.file.close()


@dataclasses.dataclass
class Cell:
    ms: ModelSpec
    task: str
    mode: str
    dynamic: bool
    B: int
    N: int

    def key(self) -> dict:
        return dict(model=self.ms.spec, dtype=dtype_name(self.ms.dtype), task=self.task, mode=self.mode,
                    dynamic=self.dynamic, B=self.B, N=self.N)


def measure_cell(cell: Cell, module, compiled: dict, args, rows: Rows, skips) -> None:
    """Warm every provider up, then time them in alternation for ``args.rounds`` rounds."""
    provs = list(compiled)
    E = args.embedding
    try:
        inputs = make_inputs(cell.ms, cell.B, cell.N, args.heads, args.dim, E, args.device,
                             requires_grad=cell.task == "train")
        L = sum(seq_lengths(cell.B, cell.N, input_seed(cell.B, cell.N)))
        g = torch.Generator().manual_seed(input_seed(cell.B, cell.N) + 1)
        dout = torch.randn(output_shape(cell.ms, L, args.heads, args.dim, E), generator=g).to(
            args.device, cell.ms.dtype)
    except Exception as e:  # noqa: BLE001
        note = "inputs: " + _error_note(e)
        for r in range(args.rounds):
            for prov in provs:
                rows.write({**cell.key(), "provider": prov, "round": r, "ms": float("nan"), "note": note})
        return
    fns = {p: step_fn(compiled[p][0], module, cell.task, inputs, dout) for p in provs}
    warm = {p: warm_up(p, fns[p], cell.mode, args.device, skips, compiled[p][1]) for p in provs}
    _note_different_transforms(warm)
    mark = cell.mode == "reduce-overhead"
    for r in range(args.rounds):
        for prov in (provs if r % 2 == 0 else provs[::-1]):
            info = warm[prov]
            row = {**cell.key(), "provider": prov, "round": r, "ms": float("nan"),
                   **{k: v for k, v in info.items() if k != "ok"}}
            if info["ok"]:
                try:
                    with provider_patch(prov):
                        row["ms"] = timed(fns[prov], args.iters, mark, args.device)
                except Exception as e:  # noqa: BLE001
                    row["note"] = "; ".join(x for x in (info["note"], _error_note(e)) if x)
            rows.write(row)
            log.info("%s %s %s %-15s B=%-3d N=%-4d r%d %8.3f ms  %s %s", cell.ms.spec, cell.task, cell.mode, prov,
                     cell.B, cell.N, r, row["ms"], row["rewrites"], row["note"])


def _note_different_transforms(warm: dict) -> None:
    """Both sides transform their own capture of the frame: say so where the captures differed."""
    seen = {p: w["transformed"] for p, w in warm.items() if w["transformed"]}
    if len(set(seen.values())) > 1:
        for p in seen:
            warm[p]["note"] = "; ".join(x for x in (warm[p]["note"], "transformed sites differ between providers")
                                        if x)


def _skip(rows: Rows, ms: ModelSpec, task: str, mode: str, dynamic: bool, reason: str) -> None:
    log.warning("skipped %s %s %s: %s", ms.spec, task, mode, reason)
    rows.write(dict(model=ms.spec, dtype=dtype_name(ms.dtype), task=task, mode=mode, dynamic=dynamic, provider="-",
                    ms=float("nan"), note="skipped: " + reason))


def run_sizes(ms, task, mode, dynamic, args, rows, skips, deadline) -> bool:
    """Every (N, B) of one (model, task, mode); False once the budget is spent."""
    module = compiled = None
    for N in args.n:
        if module is None or ms.kind != "reference":
            compiled = module = None
            fresh_dynamo()
            module = build_model(ms, N, args.heads, args.dim, args.embedding, args.device)
            module.train(task == "train")
        for B in args.batch:
            if time.time() > deadline:
                log.warning("budget spent: stopping before %s %s %s B=%d N=%d", ms.spec, task, mode, B, N)
                return False
            if compiled is None or not dynamic:
                compiled = None
                fresh_dynamo()
                compiled = {p: compile_provider(module, ms, p, mode, dynamic) for p in args.providers}
            measure_cell(Cell(ms, task, mode, dynamic, B, N), module, compiled, args, rows, skips)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return True


def run(args):
    import hstu_inductor

    hstu_inductor.backend.register()  # backend="hstu" without the installed entry point
    os.makedirs(args.out, exist_ok=True)
    rows = Rows(os.path.join(args.out, "never_slower.csv"))
    skips = _SkipLog()
    raise_recompile_limit()
    deadline = time.time() + args.budget_s
    try:
        for ms in args.resolved:
            for task in args.tasks:
                for mode in args.modes:
                    dynamic = mode == "dynamic" or not args.static
                    if task == "train" and not ms.differentiable:
                        _skip(rows, ms, task, mode, dynamic, "not differentiable (an aten jagged op without autograd)")
                        continue
                    try:
                        if not run_sizes(ms, task, mode, dynamic, args, rows, skips, deadline):
                            return rows.path
                    except Exception as e:  # noqa: BLE001  (building the model failed: the others still run)
                        _skip(rows, ms, task, mode, dynamic, _error_note(e))
    finally:
        rows.close()
        fresh_dynamo()
    return rows.path


# ------------------------------------------------------------------------------------------------
# The summary

def _ms(row) -> float:
    try:
        return float(row["ms"]) if row is not None else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def _ratio(base, row) -> float:
    b, m = _ms(base), _ms(row)
    return b / m if b == b and m == m and m > 0 else float("nan")


def _cells(rows) -> dict:
    """cell key -> provider -> round -> row (CSV order)."""
    cells = {}
    for r in rows:
        if r["provider"] == "-":
            continue
        key = tuple(r.get(k, "") for k in CELL_KEYS)
        cells.setdefault(key, {}).setdefault(r["provider"], {})[int(r.get("round") or 0)] = r
    return cells


def _fmt(values, spec) -> str:
    return " / ".join(format(v, spec) if v == v else "-" for v in values)


def _cell_name(key, prov) -> str:
    model, dtype, task, mode, dynamic, B, N = key
    return f"{model} ({dtype}) {task} {mode}{' dynamic' if dynamic == 'True' and mode != 'dynamic' else ''} " \
           f"B={B} N={N}, {prov}"


def summary(path):
    """Per cell and provider: the ratio Inductor / provider of each round and their spread; per provider and
    round the minimum ratio; the cells below 1.0 by more than their spread; the skipped rows."""
    rows = list(csv.DictReader(open(path)))
    lines = ["| model | dtype | task | mode | B | N | provider | Inductor ms | provider ms | Inductor / provider "
             "(per round) | spread | rewrites | note |", "|" + "---|" * 13]
    minima, failing, unmeasured = {}, [], []
    for key, provs in _cells(rows).items():
        base = provs.get("inductor", {})
        for prov, by_round in provs.items():
            if prov == "inductor":
                continue
            rounds = sorted(set(base) | set(by_round))
            ratios = [_ratio(base.get(r), by_round.get(r)) for r in rounds]
            finite = [x for x in ratios if x == x]
            spread = (max(finite) - min(finite)) / statistics.mean(finite) if len(finite) > 1 else float("nan")
            notes = {x["note"] for x in [*base.values(), *by_round.values()] if x.get("note")}
            first = by_round[min(by_round)] if by_round else {}
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[5]} | {key[6]} | {prov} | "
                         f"{_fmt([_ms(base.get(r)) for r in rounds], '.3f')} | "
                         f"{_fmt([_ms(by_round.get(r)) for r in rounds], '.3f')} | {_fmt(ratios, '.2f')} | "
                         f"{'-' if spread != spread else f'{spread:.1%}'} | {first.get('rewrites', '')} | "
                         f"{'; '.join(sorted(notes))[:200]} |")
            if len(finite) < len(ratios) or not ratios:
                unmeasured.append(_cell_name(key, prov))
            for r, x in zip(rounds, ratios):
                if x == x and ((prov, r) not in minima or x < minima[prov, r][0]):
                    minima[prov, r] = (x, _cell_name(key, prov))
            if finite and min(finite) < 1.0 - (spread if spread == spread else 0.0):
                failing.append(f"{_cell_name(key, prov)}: {_fmt(ratios, '.2f')}x, spread "
                               f"{'-' if spread != spread else f'{spread:.1%}'}")
    lines += ["", "Minimum Inductor / provider per round:"]
    lines += [f"- {prov}, round {r}: {x:.2f}x at {where}" for (prov, r), (x, where) in sorted(minima.items())] or \
        ["- none measured"]
    lines += ["", "Below 1.0x by more than the cell's spread (in any round):"]
    lines += [f"- {c}" for c in failing] or ["- none"]
    if unmeasured:
        lines += ["", "Not measured in every round (see the notes):"] + [f"- {c}" for c in unmeasured]
    skipped = [r for r in rows if r["provider"] == "-"]
    if skipped:
        lines += ["", "Skipped:"] + [f"- {r['model']} {r['task']} {r['mode']}: {r['note']}" for r in skipped]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["reference"],
                   help="reference, grammar:SEED, grammar:auto:K, metamorphic:SEED:T1+T2, metamorphic:auto:K")
    p.add_argument("--list", action="store_true", help="print the resolved models and exit (no timing, no GPU)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--n", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--tasks", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    p.add_argument("--modes", nargs="+", default=["default", "reduce-overhead"], choices=list(MODES))
    p.add_argument("--providers", nargs="+", default=["inductor", "hstu"], choices=list(PROVIDERS),
                   help="inductor, the baseline, is always timed")
    p.add_argument("--static", action="store_true",
                   help="default / reduce-overhead: a static compile per cell instead of dynamic=True")
    p.add_argument("--rounds", type=int, default=2, help="timing rounds per cell, providers in alternation")
    p.add_argument("--embedding", type=int, default=None, help="the reference layer's E (default heads * dim)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=480, help="stop starting new cells after this many seconds")
    p.add_argument("--out", default="never_slower_out")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)  # cpu: plumbing only
    args = p.parse_args(argv)
    if args.embedding is None:
        args.embedding = args.heads * args.dim
    args.providers = ["inductor"] + [x for x in dict.fromkeys(args.providers) if x != "inductor"]
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    try:
        args.resolved = resolve_models(args.models)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.list:
        for ms in args.resolved:
            print(describe(ms, args.heads, args.dim, args.embedding))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("never_slower.py times CUDA kernels: it needs a GPU")
    if args.device == "cpu":
        log.warning("--device cpu checks the plumbing only: its times say nothing about the GPU")
        torch.set_num_threads(1)  # on a shared host, intra-op threads waiting for a busy core swamp the times
    path = run(args)
    table = summary(path)
    with open(os.path.join(args.out, "never_slower.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
