"""FSDP2 with ``fully_shard`` on the whole model only (see test_fsdp.py for the set-up): the
unsharded parameters are plain tensors in the model's forward, so a whole-model compile is one
graph holding every block."""
import pytest

from _checks import check_fsdp, fsdp_results
from _workers import LAYERS

if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

# (shard, compile) -> rewrites per kind summed over the compiled graphs: LAYERS when the model is
# one graph, 1 when each layer is compiled on its own (one compiled STULayer.forward, reused).
VARIANTS = {("root", "whole"): LAYERS, ("root", "block"): 1}



# one pair of processes runs every variant; the module scope also keeps this file's tests on one
# xdist worker (tests/conftest.py), so the pair runs once per suite
@pytest.fixture(scope="module")
def results():
    return fsdp_results(VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=lambda v: "-".join(v))
def test_fsdp2_every_block_rewritten_and_grads_equal(results, variant):
    check_fsdp(results[variant], VARIANTS[variant])
