"""HSTU rewrites under FSDP2 (``fully_shard``) on a CPU device mesh, 2 gloo processes.

FSDP2 runs on a CPU mesh over gloo (measured on torch 2.13). Its parameters are DTensors outside forward; inside a
sharded module's forward they are all-gathered plain tensors, so Dynamo sees ordinary parameters.
Dynamo breaks the graph at each ``fully_shard`` module's hooks (``skip_fsdp_hooks``), so a block
sharded on its own is its own graph: compiled once and reused by every layer (no recompiles).
With ``fully_shard`` on the whole model only, the unsharded parameters are plain tensors in the
model's forward, so a whole-model compile is one graph holding every block.
Gradients: each rank's local shard, compiled vs eager FSDP2.
"""
import pytest

from _checks import check_fsdp, fsdp_results
from _workers import LAYERS

if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

# (shard, compile) -> rewrites per kind summed over the compiled graphs: 1 where every layer is its own
# graph (sharded per layer, FSDP hooks break the graph at each layer; or compiled per block) sharing one
# compiled STULayer.forward; LAYERS where the model is one graph (sharded at the root, compiled whole).
VARIANTS = {("layer", "whole"): 1, ("layer", "block"): 1, ("root", "whole"): LAYERS, ("root", "block"): 1}


# one pair of processes runs every variant; the module scope also keeps this file's tests on one
# xdist worker (tests/conftest.py), so the pair runs once per suite
@pytest.fixture(scope="module")
def results():
    return fsdp_results(VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=lambda v: "-".join(v))
def test_fsdp2_every_block_rewritten_and_grads_equal(results, variant):
    check_fsdp(results[variant], VARIANTS[variant])
