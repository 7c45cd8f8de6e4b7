"""Torchrec-style model parallelism: a row-sharded item embedding (allreduce/allgather in an
autograd.Function, outside the compiled region) feeding a DDP-wrapped, compiled HSTU dense part
(2 gloo processes). The embedding's shard gradients are compared with eager too."""
from _checks import check_rewritten_and_equal_to_eager, run_case


def test_sharded_embedding_feeding_ddp_dense_part():
    check_rewritten_and_equal_to_eager(run_case("sharded_embedding"), split=True)
