"""HSTU rewrites under DistributedDataParallel and FSDP2, 2 gloo processes on 127.0.0.1.

One pair of processes runs every case, in this order (the module scope keeps this file's tests on one
xdist worker, tests/conftest.py):

* **DDP**, default ``optimize_ddp``: Dynamo's DDPOptimizer splits the model's graph at gradient-bucket
  boundaries (small buckets here, so it does) and compiles every piece separately; the backend's
  pre-split hook rewrites the whole graph first (docs/distributed.md). One compiled training step is
  compared with eager DDP.
* **Torchrec-style model parallelism**: a row-sharded item embedding (allreduce/allgather in an
  autograd.Function, outside the compiled region) feeding a DDP-wrapped, compiled HSTU dense part; the
  embedding's shard gradients are compared with eager too.
* **FSDP2** (``fully_shard``) on a CPU device mesh. Its parameters are DTensors outside forward; inside a
  sharded module's forward they are all-gathered plain tensors, so Dynamo sees ordinary parameters.
  Dynamo breaks the graph at each ``fully_shard`` module's hooks (``skip_fsdp_hooks``), so a block
  sharded on its own is its own graph: compiled once and reused by every layer (no recompiles). With
  ``fully_shard`` on the whole model only, the unsharded parameters are plain tensors in the model's
  forward, so a whole-model compile is one graph holding every block. Gradients: each rank's local
  shard, compiled vs eager FSDP2.
* **DDP with ``optimize_ddp="python_reducer"``** and compiled autograd, last: its mode is fixed when DDP
  is built and changes Dynamo's inlining rules for the rest of the process.
"""
import pytest

from _checks import check_fsdp, check_rewritten_and_equal_to_eager, run_cases
from _workers import LAYERS

_HAS_FSDP2 = hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard")

# (shard, compile) -> rewrites per kind summed over the compiled graphs: 1 where every layer is its own
# graph (sharded per layer, FSDP hooks break the graph at each layer; or compiled per block) sharing one
# compiled STULayer.forward; LAYERS where the model is one graph (sharded at the root, compiled whole).
FSDP_VARIANTS = {("layer", "whole"): 1, ("layer", "block"): 1, ("root", "whole"): LAYERS, ("root", "block"): 1}


# the case each test outside the FSDP2 family checks (those name theirs by their parametrization)
_CASE_OF = {"test_ddp_every_block_rewritten_across_bucket_splits": "ddp",
            "test_sharded_embedding_feeding_ddp_dense_part": "sharded_embedding",
            "test_python_reducer_every_block_rewritten": "python_reducer"}


@pytest.fixture(scope="module")
def ranks(request):
    """The cases of the tests selected in this session (`make test` leaves out the ``slow`` FSDP2 variants:
    tests/conftest.py HALVED), in the order of the module docstring; the processes' start-up and each case's
    compile are most of this file's time."""
    here = [item for item in request.session.items if item.module is request.module]
    chosen = {_CASE_OF[item.originalname] for item in here if item.originalname in _CASE_OF}
    fsdp = [v for v in FSDP_VARIANTS if _HAS_FSDP2 and any(
        item.originalname == "test_fsdp2_every_block_rewritten_and_grads_equal"
        and item.callspec.params["variant"] == v for item in here)]
    # python_reducer last: its mode changes Dynamo's inlining for the rest of the process
    cases = [c for c in ("ddp", "sharded_embedding") if c in chosen] + fsdp + \
        [c for c in ("python_reducer",) if c in chosen]
    return run_cases(*cases)


def test_ddp_every_block_rewritten_across_bucket_splits(ranks):
    check_rewritten_and_equal_to_eager(ranks["ddp"], split=True)


def test_sharded_embedding_feeding_ddp_dense_part(ranks):
    check_rewritten_and_equal_to_eager(ranks["sharded_embedding"], split=True)


@pytest.mark.slow  # `make test-all`: a compiled-autograd mode; make test keeps the default DDP and FSDP2 cases
def test_python_reducer_every_block_rewritten(ranks):
    """DDP with ``optimize_ddp="python_reducer"`` and compiled autograd: Dynamo does not split the forward
    graph; DDP's gradient allreduces are traced into the compiled backward (a second graph, also given to
    the backend)."""
    for r in ranks["python_reducer"]:
        # forward + compiled-autograd backward graph(s), all given to the backend; only the forward
        # holds HSTU blocks. Tensor.backward() itself is Dynamo's own graph break in this mode.
        assert r["graphs"] >= 2 and r["graph_breaks"] == ["Unsupported Tensor.backward() call"], r["graph_breaks"]
    check_rewritten_and_equal_to_eager(ranks["python_reducer"], split=False, dynamo_graphs=None, comm_hook=False)


@pytest.mark.skipif(not _HAS_FSDP2, reason="this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
@pytest.mark.parametrize("variant", list(FSDP_VARIANTS), ids=lambda v: "-".join(v))
def test_fsdp2_every_block_rewritten_and_grads_equal(ranks, variant):
    check_fsdp(ranks[variant], FSDP_VARIANTS[variant])
