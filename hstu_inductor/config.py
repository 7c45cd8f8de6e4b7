"""User-facing options of hstu_inductor. Change them as module attributes or with :func:`patch`.

    import hstu_inductor
    hstu_inductor.config.tma = "off"
    with hstu_inductor.config.patch(patterns={"attention": False}):
        ...

Every option is one :class:`Option` in :data:`OPTIONS`; the module attributes, :func:`validate`,
:func:`snapshot`, :func:`patch`, :func:`cache_key` and docs/options.md (:func:`markdown`) all come from
that table. Environment variables are read once, when this module is imported (:func:`read_env`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    default: Any
    doc: str  # one line, for docs/options.md
    # The code compiled for a graph depends on the value: it goes into cache_key(), so Inductor's caches
    # never hand out code built under another value.
    codegen: bool
    env: str | None = None
    parse: Callable[[str], Any] = str  # the environment variable's text -> the value
    allowed: tuple = ()  # the valid values, unless `check` decides
    check: Callable[[Any], bool] | None = None
    expect: str = ""  # what `check` accepts, in words

    def valid(self, value) -> bool:
        if self.check is not None:
            return self.check(value)
        # the type too: True == 1, but True is no dQ mode and 1 is no flag
        return any(value == a and type(value) is type(a) for a in self.allowed)

    def expected(self) -> str:
        return self.expect or "one of " + repr(self.allowed)


def _flag(text: str) -> bool:
    return text == "1"


def _tri(text: str):
    return {"1": True, "0": False}.get(text, text)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fastlaunch(text: str) -> str:
    text = text.lower()
    return {"0": "off", "false": "off", "no": "off", "1": "on", "true": "on", "yes": "on"}.get(text, text)


_KINDS = ("attention", "preprocess", "output")
_BOOL = (True, False)

OPTIONS: tuple[Option, ...] = (
    Option("tma", "auto", 'TMA (tensor-descriptor) kernel variants: "auto" (on for sm90+), "on" (error if '
           'unsupported), "off".', True, "HSTU_INDUCTOR_TMA", allowed=("auto", "on", "off")),
    Option("patterns", dict.fromkeys(_KINDS, True), "Which subgraph kinds the backend rewrites; a patch may name "
           "some kinds only.", True, check=lambda v: isinstance(v, dict) and set(v) <= set(_KINDS) and all(
               isinstance(x, bool) for x in v.values()),
           expect="{kind: bool} over the kinds " + ", ".join(_KINDS) + " (unknown kinds are refused)"),
    Option("kernels", "auto", 'The Triton kernels for CUDA tensors ("auto": when triton imports); "off" runs the '
           "reference.", True, "HSTU_INDUCTOR_KERNELS", allowed=("auto", "off")),
    Option("gluon", "auto", 'The warp-specialised Gluon attention forward and backward on sm90, for calls in their '
           'scope; "off": always the Triton kernels (docs/gluon_forward.md, docs/gluon_backward.md).', True,
           "HSTU_INDUCTOR_GLUON", allowed=("auto", "off")),
    Option("deterministic", False, "Deterministic attention backward (no atomics); slower.", True,
           "HSTU_INDUCTOR_DETERMINISTIC", _flag, _BOOL),
    # "save" measured faster (benchmarks/RESULTS.md, "save or recompute")
    Option("block_backward", "save", "What the fused STU blocks' backward does with the forward's intermediates: "
           '"save" them (more activation memory) or "recompute" them (more kernels per layer).', True,
           "HSTU_INDUCTOR_BLOCK_BACKWARD", allowed=("save", "recompute")),
    Option("fuse_u_silu", True, "Where the preprocess op's silu(u) feeds only output ops, they apply the silu in "
           "their kernels, so silu(u) and its gradient are never written.", True, "HSTU_INDUCTOR_FUSE_U_SILU",
           _flag, _BOOL),
    Option("specialize_features", True, "Under dynamic=True, symbolic feature dims of q/k/v are taken as constants "
           "with a guard each (other feature sizes recompile).", True, "HSTU_INDUCTOR_SPECIALIZE_FEATURES",
           _flag, _BOOL),
    Option("check_inputs", "auto", "Value checks of the attention ops' jagged inputs: \"auto\" (CPU: a "
           'RuntimeError; CUDA: one device-side assert), "always" (a host sync and a RuntimeError), "off" '
           "(docs/inputs.md).", True, "HSTU_INDUCTOR_CHECK_INPUTS", allowed=("auto", "always", "off")),
    # Not codegen: it changes the graph Dynamo hands the backend, which Inductor's cache key hashes anyway.
    Option("capture_dynamic_shape_ops", True, "Frames compiled for this backend are traced with Dynamo's "
           "capture_dynamic_output_shape_ops, so a data-dependent-shape op does not split an HSTU subgraph.",
           False, "HSTU_INDUCTOR_CAPTURE_DYNAMIC_SHAPE_OPS", _flag, _BOOL),
    # "auto": in training the in-kernel tables win by far, since the dense path builds the N x N bias and
    # scatters its gradient into the tables (STU layer step 6.2 ms against 29.5 ms, H200, B=32, N=1024);
    # without table gradients the dense path is faster (op forward with its bias build 1.5 ms against
    # 8.2 ms, B=128, N=1024; benchmarks/RESULTS.md, 2026-11-28, "relative attention bias").
    Option("rab_tables", "auto", "A bias proven to be HSTU's position / bucketed-time tables goes to the op's "
           "in-kernel table bias (no N x N bias in memory) instead of the dense rab: \"auto\" in graphs that "
           "compute gradients (training), True always, False never.", True, "HSTU_INDUCTOR_RAB_TABLES",
           _tri, ("auto", True, False)),
    # Off because a preprocess / output rewrite alone lost to Inductor's fused code in every case measured
    # (0.50-0.85x: H100, STU layer, B=4/32, N=1024; benchmarks/RESULTS.md, "partial rewrites").
    Option("lone_blocks", False, "Rewrite the preprocess / output blocks of a graph whose attention candidates "
           "were all declined (they then run without the attention rewrite beside them).", True,
           "HSTU_INDUCTOR_LONE_BLOCKS", _flag, _BOOL),
    Option("cost_rule", "auto", "\"auto\": stock Inductor's code for graphs too small for the rewrites to pay for "
           'their host time (docs/cost_rule.md); "off": always rewrite.', True, "HSTU_INDUCTOR_COST_RULE",
           allowed=("auto", "off")),
    # The rewrites lost at 16.8M and won at 33.6M in inference, lost at 67M and won at 134M in training
    # (H100, one STU layer, E=512, H=4, D=128, bf16; benchmarks/RESULTS.md, 2026-11-24).
    Option("cost_rule_min_work", {"infer": 24e6, "train": 96e6}, "The cost rule's thresholds: the attention's "
           "B * H * max_seq_len**2 from which inference / training graphs are rewritten.", True,
           check=lambda v: isinstance(v, dict) and set(v) == {"infer", "train"} and all(
               _number(x) and x >= 0 for x in v.values()),
           expect="{'infer': number >= 0, 'train': number >= 0}"),
    Option("prover", "meaning", 'How an attention candidate is proven: "meaning" (symbolic element reads and z3, any '
           'size), "probes" (small random inputs only) (docs/patterns.md, "The proof").', True,
           "HSTU_INDUCTOR_PROVER", allowed=("meaning", "probes")),
    # codegen: a proof past its budget declines the candidate, so the graph compiles unrewritten
    Option("proof_budget_s", 30.0, "Seconds one attention candidate's proof may take before it is declined "
           "(docs/proof_time.md).", True, "HSTU_INDUCTOR_PROOF_BUDGET_S", float,
           check=lambda v: _number(v) and v > 0, expect="a number of seconds > 0"),
    Option("strict", False, "Raise instead of falling back to stock Inductor when our passes fail unexpectedly.",
           False, "HSTU_INDUCTOR_STRICT", _flag, _BOOL),
    Option("silu", "tanh", 'The attention kernels\' silu for 16-bit CUDA inputs: "exact" (exp2, fp32), "tanh" '
           '(fp32 tanh.approx), "packed" (bf16x2/f16x2 tanh).', True, "HSTU_INDUCTOR_SILU",
           allowed=("exact", "tanh", "packed")),
    Option("tile_order", "seq", 'Program order of the attention kernels: "seq" (row blocks of one sequence and head '
           'adjacent: they share K/V in L2) or "block" (block-major, for benchmarks).', True,
           "HSTU_INDUCTOR_TILE_ORDER", allowed=("seq", "block")),
    # "auto": split, but atomic with the in-kernel table bias, whose per-element evaluation then runs in two
    # kernels instead of three (H200, B=128, N=1024 fwd+bwd: 24.1 ms against 29.8; the dense-rab and plain
    # kernels are faster split: benchmarks/RESULTS.md, 2026-11-28, "relative attention bias").
    Option("bwd_algo", "auto", 'The non-deterministic attention backward: "split" (a separate dQ kernel, no '
           'atomics), "atomic" (dQ by fp32 atomics), "auto" (atomic with the in-kernel table bias, else split).',
           True, "HSTU_INDUCTOR_BWD_ALGO", allowed=("auto", "split", "atomic")),
    Option("dq_mode", 1, 'dQ accumulation of bwd_algo="atomic": 1 pointer atomics, 2 TMA reduce-add, 3 vectorized '
           "red.v2 (sm90).", True, "HSTU_INDUCTOR_DQ_MODE", int, (1, 2, 3)),
    # The map costs B * N^2 bytes (uint8 buckets; int16 above 255 buckets): per op call, or, emitted by the
    # patterns, per attention layer from its forward to its backward.
    Option("bucket_map_mb", 1024, "The table bias's time buckets as one [B, N, N] map, computed once for every "
           "head (compiled: once per training step, hstu::time_bucket_map) and read by the attention kernels, "
           "when it takes at most this many MiB; 0: each kernel computes the bucket itself (docs/kernels.md).",
           True, "HSTU_INDUCTOR_BUCKET_MAP_MB", float, check=lambda v: _number(v) and v >= 0,
           expect="a number of MiB >= 0"),
    # fp32 [B, 1, N, N], transient in the backward: 512 MiB at B=128, N=1024.
    Option("table_grad_mb", 4096, "Gradients of table-bias tables shared by the heads through one dense fp32 "
           "[B, N, N] bias gradient per call, reduced by a separate kernel, when it takes at most this many MiB "
           "(a time table only with the bucket map); 0: reduced inside the dK/dV kernel (docs/kernels.md).", True,
           "HSTU_INDUCTOR_TABLE_GRAD_MB", float, check=lambda v: _number(v) and v >= 0, expect="a number of MiB >= 0"),
    Option("autotune", True, "Autotune the attention kernels (False: one default config each).", True,
           "HSTU_INDUCTOR_AUTOTUNE", lambda text: text != "0", _BOOL),
    Option("delta_config", None, "An index into kernels/delta.py's _CONFIGS replacing the cached attention plan's "
           "tile and pipeline (None: the plan's own).", True, "HSTU_INDUCTOR_DELTA_CONFIG", int,
           check=lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
           expect="None or an index into _CONFIGS"),
    Option("fastlaunch", "on", 'Launches of the Gluon kernels and the input check: "on" (cached), "off" (always '
           'kernel[grid]), "verify" '
           "(cached, each checked against Triton's own; tests).", False, "HSTU_INDUCTOR_FASTLAUNCH", _fastlaunch,
           ("on", "off", "verify")),
)
_BY_NAME = {o.name: o for o in OPTIONS}
_G = globals()


def read_env(environ=os.environ) -> dict:
    """Every option's value from ``environ`` (its default where its variable is unset). Text that does not
    parse is kept as it is, so that :func:`validate` names it instead of the import failing."""
    values = {}
    for o in OPTIONS:
        text = environ.get(o.env) if o.env else None
        try:
            values[o.name] = o.default if text is None else o.parse(text)
        except ValueError:
            values[o.name] = text
    return values


def _error(o: Option, value) -> ValueError:
    env = f" (env {o.env})" if o.env else ""
    return ValueError(f"hstu_inductor.config.{o.name}={value!r}{env}; expected {o.expected()}")


def validate() -> None:
    """Raise ValueError for an option outside its documented values."""
    for o in OPTIONS:
        if not o.valid(_G[o.name]):
            raise _error(o, _G[o.name])


def get(name: str):
    """The option's value, checked: for the kernels, which run outside any compile (and its validate())."""
    value = _G[name]
    if not _BY_NAME[name].valid(value):
        raise _error(_BY_NAME[name], value)
    return value


def snapshot() -> dict:
    """The current options, e.g. for reports (dicts copied)."""
    return {o.name: dict(_G[o.name]) if isinstance(_G[o.name], dict) else _G[o.name] for o in OPTIONS}


def cache_key() -> str:
    """Hash of the options that change generated code (``Option.codegen``)."""
    items = [(o.name, sorted(_G[o.name].items()) if isinstance(_G[o.name], dict) else _G[o.name])
             for o in OPTIONS if o.codegen]
    return hashlib.sha256(repr(items).encode()).hexdigest()


@contextlib.contextmanager
def patch(**changes):
    """Temporarily set options; a dict option (``patterns``, ``cost_rule_min_work``) may be given in part."""
    old = snapshot()
    try:
        for key, value in changes.items():
            if key not in _BY_NAME:
                raise AttributeError(f"hstu_inductor.config has no option {key!r}")
            _G[key] = {**_G[key], **value} if isinstance(old[key], dict) and isinstance(value, dict) else value
        validate()
        yield
    finally:
        _G.update(old)


def markdown() -> str:
    """docs/options.md."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|")

    rows = [f"| `{o.name}` | `{o.default!r}` | {f'`{o.env}`' if o.env else '-'} | {cell(o.expected())} | "
            f"{'yes' if o.codegen else 'no'} | {cell(o.doc)} |" for o in OPTIONS]
    return "\n".join([
        "# Options",
        "",
        "`hstu_inductor.config`: set an option as a module attribute (`hstu_inductor.config.tma = \"off\"`), for a",
        "block with `hstu_inductor.config.patch(tma=\"off\")`, or through its environment variable (read when",
        "`hstu_inductor` is imported). \"Code\": whether the option changes generated code; those options are part of",
        "the key of Inductor's caches (`config.cache_key()`), so flipping one never reuses code compiled under",
        "the other value. A flag's variable turns it on with `1` and off with any other text, except",
        "`HSTU_INDUCTOR_AUTOTUNE`, which only `0` turns off.",
        "",
        "Generated from `hstu_inductor/config.py` (tests/test_config_table.py checks it); to regenerate:",
        "`python -c \"from hstu_inductor import config; print(config.markdown(), end='')\" > docs/options.md`",
        "",
        "| Option | Default | Environment | Values | Code | Description |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ])


_G.update(read_env())
