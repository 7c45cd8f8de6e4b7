"""HSTU rewrites under DistributedDataParallel, 2 gloo processes, default ``optimize_ddp``.

Dynamo's DDPOptimizer splits the model's graph at gradient-bucket boundaries (small buckets here,
so it does) and compiles every piece separately; the backend's pre-split hook rewrites the whole
graph first (docs/distributed.md). One compiled training step is compared with eager DDP.
"""
from _checks import check_rewritten_and_equal_to_eager, run_case


def test_ddp_every_block_rewritten_across_bucket_splits():
    check_rewritten_and_equal_to_eager(run_case("ddp"), split=True)
