"""HSTU rewrites under DistributedDataParallel, 2 gloo processes, default ``optimize_ddp``.

Dynamo's DDPOptimizer splits the model's graph at gradient-bucket boundaries (small buckets here,
so it does) and compiles every piece separately; the backend's pre-split hook rewrites the whole
graph first (docs/distributed.md). One compiled training step is compared with eager DDP.

Torchrec-style model parallelism as well: a row-sharded item embedding (allreduce/allgather in an
autograd.Function, outside the compiled region) feeding a DDP-wrapped, compiled HSTU dense part;
the embedding's shard gradients are compared with eager too.

And ``optimize_ddp="python_reducer"`` with compiled autograd, in the same pair of processes (last).
"""
import pytest

from _checks import check_rewritten_and_equal_to_eager, run_cases


# one pair of processes runs every case (the module scope keeps the tests on one xdist worker);
# python_reducer last: its mode is fixed when DDP is built and changes Dynamo's inlining rules for the rest
# of the process
@pytest.fixture(scope="module")
def ranks():
    return run_cases("ddp", "sharded_embedding", "python_reducer")


def test_ddp_every_block_rewritten_across_bucket_splits(ranks):
    check_rewritten_and_equal_to_eager(ranks["ddp"], split=True)


def test_sharded_embedding_feeding_ddp_dense_part(ranks):
    check_rewritten_and_equal_to_eager(ranks["sharded_embedding"], split=True)


def test_python_reducer_every_block_rewritten(ranks):
    """DDP with ``optimize_ddp="python_reducer"`` and compiled autograd: Dynamo does not split the forward
    graph; DDP's gradient allreduces are traced into the compiled backward (a second graph, also given to
    the backend)."""
    for r in ranks["python_reducer"]:
        # forward + compiled-autograd backward graph(s), all given to the backend; only the forward
        # holds HSTU blocks. Tensor.backward() itself is Dynamo's own graph break in this mode.
        assert r["graphs"] >= 2 and r["graph_breaks"] == ["Unsupported Tensor.backward() call"], r["graph_breaks"]
    check_rewritten_and_equal_to_eager(ranks["python_reducer"], split=False, dynamo_graphs=None, comm_hook=False)
