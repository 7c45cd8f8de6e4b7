"""Main job: train an HSTU model with ``torch.compile(backend="hstu")`` on synthetic jagged data.

    python examples/train_hstu.py                 # CPU, small model, a few dozen steps
    python examples/train_hstu.py --device cuda   # on a GPU
    python examples/train_hstu.py --ddp 2         # DistributedDataParallel, 2 local processes
    torchrun --nproc-per-node 2 examples/train_hstu.py --ddp --device cuda   # NCCL, one GPU each

The model (``hstu_inductor.reference.HSTUModel``) is written with plain torch ops; the backend
has to find its HSTU subgraphs on its own. The script prints what was rewritten, checks the
first step's loss and gradients against eager, then trains (a tqdm bar) and writes the loss curve
to a PNG (matplotlib). Both extras are optional (``pip install -e .[examples]``; ``make train``
installs them when it can): without them progress and the curve's summary are logged.

With ``--ddp`` the model is wrapped in ``DistributedDataParallel`` (gloo on CPU, NCCL on CUDA),
each rank trains on its own batches, and the report and the eager check cover the DDP-wrapped
compile (Dynamo's DDPOptimizer splits its graph at gradient buckets; docs/distributed.md).
"""
from __future__ import annotations

import argparse
import copy
import math
import os

import torch

import hstu_inductor
from _common import (add_model_args, next_item_loss, optimise, progress, rel_err, save_loss_curve, setup_logging,
                     synthetic_batch)
from hstu_inductor.reference import HSTUModel
from hstu_inductor.report import collecting


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "train_hstu_loss.png")
    p.add_argument("--ddp", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="DistributedDataParallel: spawn N local processes, or (no N) join the torchrun job")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP gradient bucket size (with --ddp)")
    args = p.parse_args(argv)
    if args.steps < 10:  # the check compares the first 5 steps' loss with the last 5's
        p.error(f"--steps must be at least 10 (got {args.steps}): the run passes when the mean loss of the "
                "last 5 steps is below that of the first 5")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    if args.bucket_cap_mb < 1:  # torch: "First bucket should be smaller/equal to other buckets"
        p.error("--bucket-cap-mb must be >= 1 under torch.compile (the DDPOptimizer's first bucket is 1 MiB)")
    if args.ddp is None:
        return train(args)
    if "LOCAL_RANK" in os.environ:  # started by torchrun: the rendezvous comes from the environment
        return train(args, distributed=True)
    if args.ddp < 1:
        p.error("--ddp without N needs torchrun; give N to spawn N local processes")
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(args, _free_port()), nprocs=args.ddp)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.ddp))
    train(args, distributed=True)


def train(args, distributed=False):
    """Single-process training, or one rank of DDP training (process group from the environment)."""
    import torch.distributed as dist

    setup_logging()  # the extras' fallback lines (also in spawned ranks)
    rank = 0
    dev = torch.device(args.device)
    if distributed:
        rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        if dev.type == "cuda":
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    gen = torch.Generator().manual_seed(args.seed + rank)  # each rank its own batches
    model = HSTUModel(args.num_items, args.max_seq_len, embedding_dim=args.embedding_dim, num_layers=args.layers,
                      num_heads=args.heads, attn_dim=args.head_dim, hidden_dim=args.head_dim).to(dev)
    say(f"HSTUModel: {sum(p.numel() for p in model.parameters())} parameters, {args.layers} layers, "
        f"device {dev}, torch {torch.__version__}"
        + (f", DDP over {dist.get_world_size()} processes" if distributed else ""))

    ids, offsets = synthetic_batch(gen, args.batch_size, args.max_seq_len, args.num_items, dev)
    say("\n== what backend='hstu' rewrites ==")
    if distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        eager = DDP(copy.deepcopy(model), bucket_cap_mb=args.bucket_cap_mb)  # the reference: eager DDP
        compiled = torch.compile(DDP(model, bucket_cap_mb=args.bucket_cap_mb), backend=args.backend)
    else:
        eager = model
        say(hstu_inductor.explain(model, ids, offsets, backend=args.backend))
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=args.backend)

    # First step: compiled loss and gradients must match eager on the same batch and weights.
    with collecting() as report:  # under DDP: what the DDP-split compile rewrote
        loss_comp = next_item_loss(compiled(ids, offsets), ids, offsets)
        loss_comp.backward()
    if distributed:
        say(report)
    grads_comp = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    say("\n== first-step check against eager ==")
    loss_eager = next_item_loss(eager(ids, offsets), ids, offsets)
    loss_eager.backward()
    grads_eager = [p.grad.clone() for p in eager.parameters()]
    model.zero_grad(set_to_none=True)
    loss_err = abs(loss_comp.item() - loss_eager.item()) / abs(loss_eager.item())
    grad_err = max(rel_err(gc, ge) for gc, ge in zip(grads_comp, grads_eager) if ge.norm() > 0)
    tol = 1e-4 if dev.type == "cpu" else 2e-3
    say(f"loss eager {loss_eager.item():.6f} compiled {loss_comp.item():.6f} rel err {loss_err:.2e}; "
        f"max grad rel err {grad_err:.2e} (tolerance {tol:g})")
    if not (loss_err < tol and grad_err < 10 * tol):
        raise SystemExit(f"FAILED (rank {rank}): compiled model disagrees with eager on the first step")

    say(f"\n== training {args.steps} steps ==")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, bar = [], progress(args.steps, disable=rank != 0)
    for step in range(1, args.steps + 1):
        ids, offsets = synthetic_batch(gen, args.batch_size, args.max_seq_len, args.num_items, dev)
        loss = next_item_loss(compiled(ids, offsets), ids, offsets)
        optimise(opt, loss, losses, bar)
    bar.close()
    if rank == 0 and save_loss_curve(losses, args.loss_png, f"HSTUModel, backend={args.backend!r}"):
        say(f"loss curve: {args.loss_png}")
    first, last = sum(losses[:5]) / min(5, len(losses)), sum(losses[-5:]) / min(5, len(losses))
    say(f"loss: first 5 steps {first:.4f} -> last 5 steps {last:.4f} (uniform guess {math.log(args.num_items):.4f})")
    if distributed:
        dist.destroy_process_group()
    if not last < first:
        raise SystemExit(f"FAILED (rank {rank}): loss did not decrease")
    say("OK")


if __name__ == "__main__":
    main()
