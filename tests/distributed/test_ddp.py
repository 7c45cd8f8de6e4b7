"""HSTU rewrites under DistributedDataParallel, 2 gloo processes, default ``optimize_ddp``.

Dynamo's DDPOptimizer splits the model's graph at gradient-bucket boundaries (small buckets here,
so it does) and compiles every piece separately; the backend's pre-split hook rewrites the whole
graph first (docs/distributed.md). One compiled training step is compared with eager DDP.

Torchrec-style model parallelism as well: a row-sharded item embedding (allreduce/allgather in an
autograd.Function, outside the compiled region) feeding a DDP-wrapped, compiled HSTU dense part;
the embedding's shard gradients are compared with eager too.
"""
import pytest

from _checks import check_rewritten_and_equal_to_eager, run_cases


# one pair of processes runs both cases (the module scope keeps both tests on one xdist worker)
@pytest.fixture(scope="module")
def ranks():
    return run_cases("ddp", "sharded_embedding")


def test_ddp_every_block_rewritten_across_bucket_splits(ranks):
    check_rewritten_and_equal_to_eager(ranks["ddp"], split=True)


def test_sharded_embedding_feeding_ddp_dense_part(ranks):
    check_rewritten_and_equal_to_eager(ranks["sharded_embedding"], split=True)
