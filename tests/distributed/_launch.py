"""Run a function in N local processes over gloo (127.0.0.1, a free port), with a deadline.

Kept free of pytest so the spawned children import only this module and what the worker needs.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, outdir, fn, args):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes share the CI machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_workers(fn, world: int = 2, args: tuple = (), timeout: float = 300.0) -> list:
    """``fn(rank, world, *args)`` in ``world`` spawned processes; returns each rank's result.
    Raises (with the child's traceback) if a child fails, and kills the children after ``timeout``."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.spawn(_entry, args=(world, free_port(), outdir, fn, args), nprocs=world, join=False)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout:.0f}s")
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
