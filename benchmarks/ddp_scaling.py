"""HSTUModel training steps/s under DistributedDataParallel: stock Inductor vs backend="hstu".

Launch with torchrun, once per GPU count; each run appends its rows to ``--results`` and rank 0
prints every row collected so far (so the second run prints the 1- and 2-GPU comparison):

    export NCCL_NVLS_ENABLE=0
    torchrun --standalone --nproc-per-node 1 benchmarks/ddp_scaling.py --results $OUT/ddp.jsonl
    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_scaling.py --results $OUT/ddp.jsonl

Each rank trains on its own batch (``--batch`` sequences, lengths ~ U[0.9N, N)): forward,
next-item cross-entropy, backward (DDP's bucketed allreduce), AdamW step. Model: ``--layers``
STU layers, E/H/D as in benchmarks/stu_layer.py, ``--dtype`` parameters. Both backends compile
the DDP-wrapped model, so Dynamo's DDPOptimizer splits both graphs at the same gradient buckets.
Per backend: warm-up steps (compile), then ``--steps`` timed steps; steps/s is that of the slowest
rank; samples/s = world size x batch x steps/s; scaling = samples/s over world size x 1-GPU
samples/s of the same backend. The rewrite counts are rank 0's first (compiling) step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hstu_inductor  # noqa: E402
from hstu_inductor.reference import HSTUModel  # noqa: E402
from hstu_inductor.report import collecting  # noqa: E402


def batch(args, rank, device):
    """(ids, offsets, next-item targets, rows with a target) of this rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    N = args.max_seq_len
    lengths = torch.randint(int(0.9 * N), N + 1, (args.batch,), generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, args.items, (int(off[-1]),), generator=g)
    has_next = torch.ones(ids.shape[0], dtype=torch.bool)
    has_next[off[1:] - 1] = False
    targets = torch.roll(ids, -1)[has_next]
    return ids.to(device), off.to(device), targets.to(device), has_next.to(device)


def run(args, backend, rank, world, device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = HSTUModel(args.items, args.max_seq_len, embedding_dim=args.embedding, num_layers=args.layers,
                      num_heads=args.heads, attn_dim=args.dim, hidden_dim=args.dim)
    model = model.to(device=device, dtype=getattr(torch, args.dtype)).train()
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb)
    fn = torch.compile(ddp, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, off, targets, has_next = batch(args, rank, device)

    def step():
        loss = F.cross_entropy(fn(ids, off)[has_next].float(), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    with collecting() as report:
        step()
    for _ in range(args.warmup - 1):
        step()
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)  # NCCL: GPU tensors only
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    steps_per_s = args.steps / elapsed.item()
    return {"backend": backend, "world": world, "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else "cpu", "torch": torch.__version__, "steps_per_s": steps_per_s,
            "samples_per_s": steps_per_s * world * args.batch, "loss": loss.item(),
            "rewrites": dict(report.counts) if backend == "hstu" else {}, "near_misses": len(report.near_misses),
            "config": {k: getattr(args, k) for k in ("layers", "embedding", "heads", "dim", "max_seq_len", "batch",
                                                      "items", "dtype", "bucket_cap_mb")}}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(rows) -> str:
    """One line per (backend, world); scaling against the same backend and config on 1 process."""
    base = {(r["backend"], json.dumps(r["config"], sort_keys=True)): r["samples_per_s"] for r in rows
            if r["world"] == 1}
    lines = [f"{'backend':9s} {'GPUs':>4s} {'steps/s':>8s} {'samples/s':>10s} {'scaling':>8s}  rewrites (a/p/o)  device"]
    for r in sorted(rows, key=lambda r: (json.dumps(r["config"], sort_keys=True), r["world"], r["backend"])):
        one = base.get((r["backend"], json.dumps(r["config"], sort_keys=True)))
        scaling = f"{r['samples_per_s'] / (r['world'] * one):8.2f}" if one else f"{'-':>8s}"
        rw = r["rewrites"]
        rw = f"{rw.get('attention', 0)}/{rw.get('preprocess', 0)}/{rw.get('output', 0)}" if rw else "-"
        lines.append(f"{r['backend']:9s} {r['world']:4d} {r['steps_per_s']:8.2f} {r['samples_per_s']:10.1f} "
                     f"{scaling}  {rw:16s}  {r['device']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=["inductor", "hstu"], choices=["inductor", "hstu"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embedding", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32, help="sequences per rank")
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help=">= 1 under torch.compile")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--results", default=None, help="JSON-lines file the rows are appended to (and read from)")
    args = ap.parse_args()
    if "LOCAL_RANK" not in os.environ:
        ap.error("launch with torchrun (e.g. torchrun --standalone --nproc-per-node 2 benchmarks/ddp_scaling.py)")

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if rank == 0:
        print(f"hstu_inductor {hstu_inductor.__version__}, torch {torch.__version__}, world {world}, "
              f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', '(unset)')}", flush=True)
    rows = []
    for backend in args.backends:
        row = run(args, backend, rank, world, device)
        rows.append(row)
        if rank == 0:
            print(f"  {backend:9s} {world} x {row['device']}: {row['steps_per_s']:.2f} steps/s, "
                  f"rewrites {row['rewrites'] or '-'}", flush=True)
    if rank == 0:
        if args.results:
            with open(args.results, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            with open(args.results) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        print(table(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
