"""User-facing options of hstu_inductor. Change them as module attributes or with :func:`patch`.

    import hstu_inductor
    hstu_inductor.config.tma = "off"
    with hstu_inductor.config.patch(patterns={"attention": False}):
        ...
"""
from __future__ import annotations

import contextlib
import os

#: TMA (tensor-descriptor) kernel variants: "auto" (on for sm90+), "on" (error if unsupported), "off".
tma: str = os.environ.get("HSTU_INDUCTOR_TMA", "auto")

#: Which subgraph kinds the backend rewrites.
patterns: dict[str, bool] = {"attention": True, "preprocess": True, "output": True}

#: Use the Triton kernels for CUDA tensors ("auto": when triton imports); "off" runs the reference.
kernels: str = os.environ.get("HSTU_INDUCTOR_KERNELS", "auto")

#: The attention forward and backward on sm90 GPUs: "auto" runs the warp-specialised Gluon kernels
#: (kernels/gluon_attention.py, kernels/gluon_backward.py) for calls in their scope (bf16/fp16, D = 128, causal,
#: optional targets, no other mask option or bias, no attn_scale gradient; not under torch.export / AOTInductor),
#: "off" always the Triton kernels. One switch for both (they compute the Triton kernels' results bitwise).
#: See ops/_gluon.py, docs/gluon_forward.md and docs/gluon_backward.md.
gluon: str = os.environ.get("HSTU_INDUCTOR_GLUON", "auto")

#: Deterministic attention backward (no atomics); slower.
deterministic: bool = os.environ.get("HSTU_INDUCTOR_DETERMINISTIC", "0") == "1"

#: What the backward of the fused STU blocks does with the forward's intermediates (preprocess:
#: LayerNorm output, statistics, projection pre-activations; output block: the projection input
#: and the norm statistics): "save" them (``hstu.stu_preprocess_save`` / ``hstu.stu_output_save``;
#: more activation memory) or "recompute" them (``hstu.stu_preprocess`` / ``hstu.stu_output``; a
#: LayerNorm, a u-column matmul and the output block's norm kernel more per layer).
#: The default was chosen by measurement (benchmarks/RESULTS.md, "save or recompute").
block_backward: str = os.environ.get("HSTU_INDUCTOR_BLOCK_BACKWARD", "save")

#: True: where the preprocess op's ``silu(u)`` feeds only output ops, they take the pre-activation columns
#: of the projection instead and apply the silu in their kernels (``silu_u``), so the separate silu tensor
#: and its gradient are never written (``patterns.blocks.fuse_u_silu``). False: the unfused graph, for comparison.
fuse_u_silu: bool = os.environ.get("HSTU_INDUCTOR_FUSE_U_SILU", "1") == "1"

#: Under ``dynamic=True`` every dim is symbolic, head and feature dims included, although a model
#: fixes them through its weights. True: the attention rewriter takes symbolic feature dims of
#: q/k/v as constants, with a guard each (a call with other feature sizes recompiles).
specialize_features: bool = os.environ.get("HSTU_INDUCTOR_SPECIALIZE_FEATURES", "1") == "1"

#: Value checks of the jagged inputs of the attention ops (``seq_offsets[0] == 0``, non-decreasing
#: offsets, ``seq_offsets[-1] == L``, every length <= max_seq_len, ``0 <= num_targets <= length``).
#: They are part of the ops' bodies, so they also run inside torch.compile graphs and AOTI packages:
#: "auto": CPU checks synchronously (a RuntimeError naming the problem); CUDA uses one device-side
#: assert per call (no host sync; a failure is a CUDA device-side assert, which ends the process's
#: CUDA context). "always": like CPU on every device (CUDA: one host sync per call, a catchable
#: RuntimeError). "off": no value checks by the ops (the kernels stay memory-safe; results for
#: invalid inputs are unspecified). See docs/inputs.md.
check_inputs: str = os.environ.get("HSTU_INDUCTOR_CHECK_INPUTS", "auto")

#: A data-dependent-shape op (``repeat_interleave`` without ``output_size``, ``nonzero``, ...) makes
#: Dynamo break the graph unless ``torch._dynamo.config.capture_dynamic_output_shape_ops`` is set,
#: which splits an HSTU subgraph whose row index it computes (inside a generator or a loop, Dynamo then
#: runs the whole frame eagerly). True: frames compiled for our backend are traced with that option
#: on (only they: other backends' compiles are untouched), so the op stays in the graph with an
#: unbacked size. False: Dynamo's default (the break; ``explain()`` reports it).
capture_dynamic_shape_ops: bool = os.environ.get("HSTU_INDUCTOR_CAPTURE_DYNAMIC_SHAPE_OPS", "1") == "1"

#: True: a bias proven to be the original HSTU's position / bucketed-time tables goes to the attention
#: op's in-kernel table bias (``timestamps, pos_w, ts_w, ts_bounds``: no N x N bias in memory). False
#: (default): every bias is passed as the dense ``rab`` the user's graph computes. Off by default
#: because the in-kernel path is still the slower one: on the H100 (B=128, N=1024, fwd+bwd) 30.7 ms
#: against 5.1 ms for the dense [B, 1, N, N] rab, which needs +1256 MiB against +488 MiB
#: (benchmarks/RESULTS.md, 2026-11-24). Turn it on where the N x N bias does not fit.
rab_tables: bool = os.environ.get("HSTU_INDUCTOR_RAB_TABLES", "0") == "1"

#: The cost rule (cost_rule.py): "auto" keeps stock Inductor's code for graphs too small for the rewrites to pay
#: for their host time (CUDA, without CUDA graphs; per call under dynamic shapes), "off" always rewrites.
cost_rule: str = os.environ.get("HSTU_INDUCTOR_COST_RULE", "auto")

#: The cost rule's thresholds: an attention's ``B * H * max_seq_len**2`` (score elements per call) from which the
#: rewrites run, for inference and for training graphs. Measured on an H100 host with one STU layer (E=512,
#: H=4, D=128, bf16; benchmarks/RESULTS.md, 2026-11-24): the rewrites lost at 16.8M and won at 33.6M in
#: inference, lost at 67M and won at 134M in training. Hosts with faster single-thread Python lower both.
cost_rule_min_work: dict = {"infer": 24e6, "train": 96e6}

#: How the attention rewriter proves what a candidate computes: "meaning" reads every tensor element at
#: symbolic coordinates and decides the mask with z3, at any size (the decision; numeric probes cross-check
#: it where they are cheap); "probes" runs the user's ops on small random inputs only (the older prover,
#: for comparison; it declines candidates too large to probe). docs/patterns.md, "The proof".
prover: str = os.environ.get("HSTU_INDUCTOR_PROVER", "meaning")

#: Seconds one attention candidate's proof may take; past it the candidate is declined with that reason
#: (a proof takes well under a second at B=128, N=4096: docs/proof_time.md).
proof_budget_s: float = float(os.environ.get("HSTU_INDUCTOR_PROOF_BUDGET_S", "30"))

#: Raise instead of falling back to stock Inductor when our passes fail unexpectedly.
strict: bool = os.environ.get("HSTU_INDUCTOR_STRICT", "0") == "1"

_VALID = {"tma": ("auto", "on", "off"), "kernels": ("auto", "off"), "gluon": ("auto", "off"), "block_backward": ("save", "recompute"),
          "check_inputs": ("auto", "always", "off"), "cost_rule": ("auto", "off"), "prover": ("meaning", "probes")}


def validate() -> None:
    """Raise ValueError for an option outside its documented values."""
    g = globals()
    for name, allowed in _VALID.items():
        if g[name] not in allowed:
            raise ValueError(f"hstu_inductor.config.{name}={g[name]!r}; expected one of {allowed}")
    if set(cost_rule_min_work) != {"infer", "train"} or not all(
            isinstance(v, (int, float)) and v >= 0 for v in cost_rule_min_work.values()):
        raise ValueError(f"hstu_inductor.config.cost_rule_min_work={cost_rule_min_work!r}; expected "
                         "{'infer': number >= 0, 'train': number >= 0}")
    if not (isinstance(proof_budget_s, (int, float)) and proof_budget_s > 0):
        raise ValueError(f"hstu_inductor.config.proof_budget_s={proof_budget_s!r}; expected a number of seconds > 0")
    unknown = set(patterns) - {"attention", "preprocess", "output"}
    if unknown:
        raise ValueError(f"hstu_inductor.config.patterns has unknown kinds {sorted(unknown)}")


def snapshot() -> dict:
    """The current options, e.g. for cache keys and reports."""
    return {"tma": tma, "patterns": dict(patterns), "kernels": kernels, "gluon": gluon,
            "deterministic": deterministic,
            "block_backward": block_backward, "fuse_u_silu": fuse_u_silu, "check_inputs": check_inputs,
            "strict": strict,
            "specialize_features": specialize_features, "capture_dynamic_shape_ops": capture_dynamic_shape_ops,
            "rab_tables": rab_tables, "prover": prover, "proof_budget_s": proof_budget_s, "cost_rule": cost_rule, "cost_rule_min_work": dict(cost_rule_min_work)}


@contextlib.contextmanager
def patch(**changes):
    """Temporarily set options; ``patterns`` may be a partial dict."""
    g = globals()
    old = snapshot()
    try:
        for key, value in changes.items():
            if key not in old:
                raise AttributeError(f"hstu_inductor.config has no option {key!r}")
            g[key] = {**g[key], **value} if key in ("patterns", "cost_rule_min_work") else value
        validate()
        yield
    finally:
        for key, value in old.items():
            g[key] = value
