"""Assertions shared by the multi-process test files."""
from _launch import run_workers
from _workers import LAYERS, all_cases

ALL = {"attention": LAYERS, "preprocess": LAYERS, "output": LAYERS}


def block_misses(near_misses) -> list:
    """Near misses other than the model's final LayerNorm -> logits projection (a LayerNorm
    feeding a projection that explain() lists, correctly, as not an HSTU preprocess)."""
    return [(k, r) for k, r in near_misses if "is not split into four chunks" not in r]


def run_cases(*cases) -> dict:
    """``{case: per-rank results}`` of cases (_workers.DDP_CASES keys, FSDP2 ``(shard, compile)`` variants),
    run in turn by one pair of gloo processes."""
    per_rank = run_workers(all_cases, world=2, args=(cases,), timeout=300)
    return {c: [r[c] for r in per_rank] for c in cases}


def check_rewritten_and_equal_to_eager(ranks, *, split: bool, dynamo_graphs=1, comm_hook=True, tol=1e-5):
    """Every block rewritten in the one Dynamo graph of the model; loss and every gradient equal
    to eager DDP; DDP reduced as many buckets as in eager; the ranks ended with the same averaged
    gradients although their batches differ."""
    for r in ranks:
        assert r["counts"] == ALL and block_misses(r["near_misses"]) == [], r
        assert dynamo_graphs is None or r["dynamo_graphs"] == dynamo_graphs
        assert r["recompiles"] == 0
        if split:
            assert r["pieces"] > 1, "the DDPOptimizer did not split: the test would prove nothing"
        assert r["grad_norm"] > 0 and not r["missing_grads"]
        assert r["loss_err"] < tol, r["loss_err"]
        assert max(r["grad_errs"]) < tol, r["grad_errs"]
        if comm_hook:  # DDP's C++ reducer called our counting comm hook once per bucket
            assert r["allreduces_compiled"] == r["allreduces_eager"] >= 1  # same buckets: no extra collectives
    assert ranks[0]["loss"] != ranks[1]["loss"]  # different batches per rank
    sharded = ranks[0]["sharded_params"]  # model-parallel parameters (leading) differ by rank
    for a, b in zip(ranks[0]["grads"][sharded:], ranks[1]["grads"][sharded:]):
        assert (a - b).abs().max() == 0


def check_fsdp(ranks, per_kind: int, tol=1e-5):
    """Rewrites per kind summed over the compiled graphs (``per_kind``), no near misses, no
    recompiles; loss and each rank's gradient shards equal to eager FSDP2."""
    for r in ranks:
        assert r["counts"] == {"attention": per_kind, "preprocess": per_kind, "output": per_kind}, r
        assert block_misses(r["near_misses"]) == [] and r["recompiles"] == 0
        assert r["grad_norm"] > 0 and not r["missing_grads"]
        assert r["loss_err"] < tol and max(r["grad_errs"]) < tol, (r["loss_err"], r["grad_errs"])
    assert ranks[0]["loss"] != ranks[1]["loss"]  # different batches per rank
