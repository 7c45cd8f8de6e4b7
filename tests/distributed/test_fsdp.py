"""HSTU rewrites under FSDP2 (``fully_shard``) on a CPU device mesh, 2 gloo processes.

FSDP2 runs on a CPU mesh over gloo (measured on torch 2.13). Its parameters are DTensors outside forward; inside a
sharded module's forward they are all-gathered plain tensors, so Dynamo sees ordinary parameters.
Dynamo breaks the graph at each ``fully_shard`` module's hooks (``skip_fsdp_hooks``), so a block
sharded on its own is its own graph: compiled once and reused by every layer (no recompiles).
Gradients: each rank's local shard, compiled vs eager FSDP2.
"""
import pytest

from _checks import check_fsdp

if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)
from _launch import run_workers
from _workers import LAYERS, fsdp_cases

# (shard, compile) -> rewrites per kind summed over the compiled graphs: LAYERS when one graph
# holds every block, 1 when the blocks share one compiled graph (STULayer.forward, reused).
VARIANTS = {("layer", "whole"): 1, ("layer", "block"): 1}


@pytest.fixture(scope="module")
def results():
    per_rank = run_workers(fsdp_cases, world=2, args=(list(VARIANTS),), timeout=240)
    return {v: [r[v] for r in per_rank] for v in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS), ids=lambda v: "-".join(v))
def test_fsdp2_every_block_rewritten_and_grads_equal(results, variant):
    check_fsdp(results[variant], VARIANTS[variant])
