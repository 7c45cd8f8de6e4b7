"""Main job: train an HSTU model with ``torch.compile(backend="hstu")`` on synthetic jagged data.

    python examples/train_hstu.py                 # CPU, small model, a few dozen steps
    python examples/train_hstu.py --device cuda   # on a GPU

The model (``hstu_inductor.reference.HSTUModel``) is written with plain torch ops; the backend
has to find its HSTU subgraphs on its own. The script prints what was rewritten, checks the
first step's loss and gradients against eager, then trains and prints the loss curve.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

import hstu_inductor
from hstu_inductor.reference import HSTUModel


def synthetic_batch(gen, batch_size, max_seq_len, num_items, device, noise=0.1):
    """Jagged sequences from a hidden Markov rule ``next = (a * item + b) % num_items`` with noise.

    Lengths are uniform in [max_seq_len // 2, max_seq_len]; returns (item_ids [L], offsets [B+1]).
    """
    lengths = torch.randint(max_seq_len // 2, max_seq_len + 1, (batch_size,), generator=gen)
    offsets = torch.zeros(batch_size + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    seqs = []
    for n in lengths.tolist():
        seq = torch.empty(n, dtype=torch.int64)
        seq[0] = torch.randint(0, num_items, (1,), generator=gen)
        for i in range(1, n):
            if torch.rand((), generator=gen) < noise:
                seq[i] = torch.randint(0, num_items, (1,), generator=gen)
            else:
                seq[i] = (7 * seq[i - 1] + 3) % num_items
        seqs.append(seq)
    return torch.cat(seqs).to(device), offsets.to(device)


def next_item_loss(logits, item_ids, offsets):
    """Cross entropy of predicting item i+1 from position i, inside each sequence."""
    L = item_ids.shape[0]
    is_last = torch.zeros(L, dtype=torch.bool, device=item_ids.device)
    is_last[(offsets[1:] - 1).clamp(min=0)] = True
    keep = ~is_last
    keep[L - 1] = False
    targets = torch.roll(item_ids, -1)
    return F.cross_entropy(logits[keep], targets[keep])


class Progress:
    """A dependency-free progress bar on stderr."""

    def __init__(self, total, width=30):
        self.total, self.width, self.start = total, width, time.perf_counter()

    def update(self, step, loss):
        done = int(self.width * step / self.total)
        rate = step / max(time.perf_counter() - self.start, 1e-9)
        sys.stderr.write(f"\r[{'#' * done}{'.' * (self.width - done)}] {step}/{self.total} "
                         f"loss {loss:.4f} {rate:.2f} step/s")
        sys.stderr.flush()
        if step == self.total:
            sys.stderr.write("\n")


def plot_curve(losses, height=8, width=60):
    """ASCII loss curve: one column per (sampled) step, a '*' at the loss's row."""
    if not losses:
        return ""
    cols = [losses[int(i * len(losses) / min(width, len(losses)))] for i in range(min(width, len(losses)))]
    lo, hi = min(cols), max(cols)
    span = (hi - lo) or 1.0
    level = [round((hi - c) / span * (height - 1)) for c in cols]
    rows = [f"{hi - span * r / (height - 1):8.3f} |" + "".join("*" if lv == r else " " for lv in level)
            for r in range(height)]
    rows.append(" " * 9 + "+" + "-" * len(cols) + f"> step 1..{len(losses)}")
    return "\n".join(rows)


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=32)
    p.add_argument("--num-items", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    dev = torch.device(args.device)
    model = HSTUModel(args.num_items, args.max_seq_len, embedding_dim=args.embedding_dim, num_layers=args.layers,
                      num_heads=args.heads, attn_dim=args.head_dim, hidden_dim=args.head_dim).to(dev)
    print(f"HSTUModel: {sum(p.numel() for p in model.parameters())} parameters, {args.layers} layers, "
          f"device {dev}, torch {torch.__version__}")

    ids, offsets = synthetic_batch(gen, args.batch_size, args.max_seq_len, args.num_items, dev)
    print("\n== what backend='hstu' rewrites ==")
    report = hstu_inductor.explain(model, ids, offsets)
    print(report)
    torch._dynamo.reset()

    compiled = torch.compile(model, backend="hstu")

    # First step: compiled loss and gradients must match eager on the same batch and weights.
    print("\n== first-step check against eager ==")
    loss_eager = next_item_loss(model(ids, offsets), ids, offsets)
    grads_eager = torch.autograd.grad(loss_eager, list(model.parameters()))
    loss_comp = next_item_loss(compiled(ids, offsets), ids, offsets)
    grads_comp = torch.autograd.grad(loss_comp, list(model.parameters()))
    loss_err = abs(loss_comp.item() - loss_eager.item()) / abs(loss_eager.item())
    grad_err = max(rel_err(gc, ge) for gc, ge in zip(grads_comp, grads_eager) if ge.norm() > 0)
    tol = 1e-4 if dev.type == "cpu" else 2e-3
    print(f"loss eager {loss_eager.item():.6f} compiled {loss_comp.item():.6f} rel err {loss_err:.2e}; "
          f"max grad rel err {grad_err:.2e} (tolerance {tol:g})")
    if not (loss_err < tol and grad_err < 10 * tol):
        raise SystemExit("FAILED: compiled model disagrees with eager on the first step")

    print(f"\n== training {args.steps} steps ==")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, bar = [], Progress(args.steps)
    for step in range(1, args.steps + 1):
        ids, offsets = synthetic_batch(gen, args.batch_size, args.max_seq_len, args.num_items, dev)
        loss = next_item_loss(compiled(ids, offsets), ids, offsets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.update(step, losses[-1])
    print(plot_curve(losses))
    first, last = sum(losses[:5]) / min(5, len(losses)), sum(losses[-5:]) / min(5, len(losses))
    print(f"loss: first 5 steps {first:.4f} -> last 5 steps {last:.4f} (uniform guess {math.log(args.num_items):.4f})")
    if not last < first:
        raise SystemExit("FAILED: loss did not decrease")
    print("OK")


if __name__ == "__main__":
    main()
