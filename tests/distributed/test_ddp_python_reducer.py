"""DDP with ``optimize_ddp="python_reducer"`` and compiled autograd (2 gloo processes): Dynamo
does not split the forward graph; DDP's gradient allreduces are traced into the compiled
backward (a second graph, also given to the backend). Own file: the mode is fixed when DDP is
built and changes Dynamo's inlining rules for the rest of the process."""
from _checks import check_rewritten_and_equal_to_eager, run_cases


def test_python_reducer_every_block_rewritten():
    ranks = run_cases("python_reducer")["python_reducer"]
    for r in ranks:
        # forward + compiled-autograd backward graph(s), all given to the backend; only the forward
        # holds HSTU blocks. Tensor.backward() itself is Dynamo's own graph break in this mode.
        assert r["graphs"] >= 2 and r["graph_breaks"] == ["Unsupported Tensor.backward() call"], r["graph_breaks"]
    check_rewritten_and_equal_to_eager(ranks, split=False, dynamo_graphs=None, comm_hook=False)
