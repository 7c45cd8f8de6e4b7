"""FSDP2 with ``fully_shard`` on the whole model only (see test_fsdp.py for the set-up): the
unsharded parameters are plain tensors in the model's forward, so a whole-model compile is one
graph holding every block."""
import pytest

from _checks import fsdp_test
from _workers import LAYERS

if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

# (shard, compile) -> rewrites per kind summed over the compiled graphs: LAYERS when the model is
# one graph, 1 when each layer is compiled on its own (one compiled STULayer.forward, reused).
VARIANTS = {("root", "whole"): LAYERS, ("root", "block"): 1}

test_fsdp2_every_block_rewritten_and_grads_equal = fsdp_test(VARIANTS)
