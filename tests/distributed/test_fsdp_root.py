"""FSDP2 with ``fully_shard`` on the whole model only (see test_fsdp.py for the set-up): the
unsharded parameters are plain tensors in the model's forward, so a whole-model compile is one
graph holding every block."""
import pytest

from _checks import check_fsdp

if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)
from _launch import run_workers
from _workers import LAYERS, fsdp_cases

# (shard, compile) -> rewrites per kind summed over the compiled graphs: LAYERS when one graph
# holds every block, 1 when the blocks share one compiled graph (STULayer.forward, reused).
VARIANTS = {("root", "whole"): LAYERS, ("root", "block"): 1}


@pytest.fixture(scope="module")
def results():
    per_rank = run_workers(fsdp_cases, world=2, args=(list(VARIANTS),), timeout=240)
    return {v: [r[v] for r in per_rank] for v in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS), ids=lambda v: "-".join(v))
def test_fsdp2_every_block_rewritten_and_grads_equal(results, variant):
    check_fsdp(results[variant], VARIANTS[variant])
