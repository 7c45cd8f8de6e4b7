"""Train an HSTU model with the original relative attention bias (rab) under ``backend="hstu"``.

    python examples/train_hstu_rab.py                 # CPU (the hstu ops run their reference)
    python examples/train_hstu_rab.py --device cuda   # on a GPU (Triton kernels)

The model below is plain PyTorch, written here and not taken from hstu_inductor: jagged item
sequences with per-event timestamps, STU layers whose attention adds the original HSTU's bias
inside the silu (issue 21, docs/semantics.md):

    score(i, j) = silu(alpha * q_i . k_j + rab(i, j)) / N      (causal, inside each sequence)
    rab(i, j)   = pos_w[N - 1 + j - i] + ts_w[bucket(ts(next(i)) - ts(j))],  next(i) = min(i + 1, N - 1)
    bucket(dt)  = clamp(floor(ln(max(|dt|, 1)) / 0.301), 0, num_buckets)

The script prints what ``hstu_inductor.explain`` reports was rewritten (an attention with a bias
inside the silu is rewritten only once the pattern matcher knows that form; until then explain()
lists it as a near miss and it runs on stock Inductor), checks once that the compiled loss equals
eager's, then
trains with a tqdm bar and writes the loss curve to a PNG (both optional extras, as in
``train_hstu.py``).
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import hstu_inductor
from _common import add_model_args, optimise, next_item_loss, progress, save_loss_curve, setup_logging, synthetic_batch


class RabSTULayer(nn.Module):
    """LayerNorm -> uvqk projection -> jagged causal silu attention with rab -> u * LayerNorm(attn) -> W_o, residual."""

    def __init__(self, dim, heads, head_dim, max_seq_len, num_buckets):
        super().__init__()
        self.heads, self.head_dim, self.max_seq_len, self.num_buckets = heads, head_dim, max_seq_len, num_buckets
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * heads * head_dim)
        self.norm_attn = nn.LayerNorm(heads * head_dim)
        self.out = nn.Linear(heads * head_dim, dim)
        # the two learned tables of the original HSTU's bias
        self.pos_w = nn.Parameter(torch.empty(2 * max_seq_len - 1).normal_(std=0.02))
        self.ts_w = nn.Parameter(torch.empty(num_buckets + 1).normal_(std=0.02))

    def relative_bias(self, ts_padded):
        """``[B, N, N]``: position bias by ``j - i`` plus time bias by the log-bucketed gap between the
        query's next event and the key."""
        N = self.max_seq_len
        i = torch.arange(N, device=ts_padded.device)
        pos_bias = self.pos_w[(N - 1) + i.view(1, N) - i.view(N, 1)]  # [N, N]
        ts_next = ts_padded[:, torch.clamp(i + 1, max=N - 1)]  # [B, N]
        gap = (ts_next.unsqueeze(2) - ts_padded.unsqueeze(1)).abs().double()  # [B, N, N]
        bucket = torch.floor(torch.log(gap.clamp(min=1.0)) / 0.301).clamp(0, self.num_buckets).long()
        return pos_bias.unsqueeze(0) + self.ts_w[bucket]

    def forward(self, x, rows, seq, pos, keep, rab_ts):
        L, N, H, D = x.shape[0], self.max_seq_len, self.heads, self.head_dim
        u, v, q, k = self.uvqk(self.norm_in(x)).split(H * D, dim=-1)
        u = F.silu(u)

        def pad(t):  # [L, H*D] -> [B, N, H, D], zeros past each sequence's end (row L)
            return torch.cat([t, t.new_zeros(1, t.shape[1])])[rows].view(*rows.shape, H, D)

        scores = torch.einsum("bihd,bjhd->bhij", pad(q), pad(k)) / math.sqrt(D)
        scores = scores + self.relative_bias(rab_ts).unsqueeze(1).to(scores.dtype)
        weights = F.silu(scores) / N * keep  # keep: [B, 1, N, N] causal and inside the sequence
        attn = torch.einsum("bhij,bjhd->bihd", weights, pad(v))[seq, pos].reshape(L, H * D)
        return x + self.out(u * self.norm_attn(attn))


class RabHSTU(nn.Module):
    """Item embeddings -> STU layers with rab -> LayerNorm -> next-item logits (tied to the embeddings).

    ``forward(item_ids [L], offsets [B+1], timestamps [L]) -> logits [L, num_items]``."""

    def __init__(self, num_items, max_seq_len, dim=64, layers=2, heads=2, head_dim=32, num_buckets=64):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.item_emb = nn.Embedding(num_items, dim)
        nn.init.normal_(self.item_emb.weight, std=dim ** -0.5)
        self.layers = nn.ModuleList(RabSTULayer(dim, heads, head_dim, max_seq_len, num_buckets) for _ in range(layers))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, item_ids, offsets, timestamps):
        L, N = item_ids.shape[0], self.max_seq_len
        lengths = offsets[1:] - offsets[:-1]
        p = torch.arange(N, device=offsets.device)
        inside = p.unsqueeze(0) < lengths.unsqueeze(1)  # [B, N]
        rows = torch.where(inside, offsets[:-1].unsqueeze(1) + p, L)  # padded slot -> jagged row (L: padding)
        seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=offsets.device), lengths, output_size=L)
        pos = torch.arange(L, device=offsets.device) - offsets[seq]  # jagged row -> (sequence, position)
        keep = ((p.view(N, 1) >= p.view(1, N)) & inside.unsqueeze(2) & inside.unsqueeze(1)).unsqueeze(1)
        ts = torch.cat([timestamps, timestamps.new_zeros(1)])[rows]  # [B, N], 0 past the end
        x = self.item_emb(item_ids)
        for layer in self.layers:
            x = layer(x, rows, seq, pos, keep, ts)
        return self.final_norm(x) @ self.item_emb.weight.t()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "train_hstu_rab_loss.png")
    p.add_argument("--num-buckets", type=int, default=64, help="time buckets of the bias (ts_w has num_buckets + 1)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    setup_logging()
    train(args)


def train(args):
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = RabHSTU(args.num_items, args.max_seq_len, args.embedding_dim, args.layers, args.heads, args.head_dim,
                    args.num_buckets).to(dev)
    print(f"RabHSTU: {sum(p.numel() for p in model.parameters())} parameters, {args.layers} layers with relative "
          f"attention bias, device {dev}, torch {torch.__version__}")

    batch = synthetic_batch(gen, args.batch_size, args.max_seq_len, args.num_items, dev, timestamps=True)
    print(f"\n== what backend={args.backend!r} rewrites ==")
    report = hstu_inductor.explain(model, *batch, backend=args.backend)
    print(report)
    n_attn = report.counts["attention"]
    if n_attn:
        print(f"attention with rab: {n_attn} of {args.layers} layers rewritten")
    else:  # what explain() says, nothing more: its near misses give the reason
        why = ("; ".join(reason for kind, reason in report.near_misses if kind == "attention")
               or "; ".join(report.cost_rule) or "no candidate found")
        print(f"attention with rab: not rewritten, left to stock Inductor ({why})")

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=args.backend)
    print("\n== compiled loss against eager, same batch and weights ==")
    first_loss = next_item_loss(compiled(*batch), batch[0], batch[1])  # with grad: the first training step's
    with torch.no_grad():
        loss_eager = next_item_loss(model(*batch), batch[0], batch[1]).item()
    err = abs(first_loss.item() - loss_eager) / abs(loss_eager)
    tol = 1e-4 if dev.type == "cpu" else 2e-3
    print(f"loss eager {loss_eager:.6f} compiled {first_loss.item():.6f} rel err {err:.2e} (tolerance {tol:g})")
    if not err < tol:
        raise SystemExit("FAILED: compiled model disagrees with eager")

    print(f"\n== training {args.steps} steps ==")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, bar = [], progress(args.steps)
    for step in range(args.steps):
        if step == 0:  # the checked batch (one compile less)
            loss = first_loss
        else:
            ids, offsets, ts = synthetic_batch(gen, args.batch_size, args.max_seq_len, args.num_items, dev,
                                               timestamps=True)
            loss = next_item_loss(compiled(ids, offsets, ts), ids, offsets)
        optimise(opt, loss, losses, bar)
    bar.close()
    if save_loss_curve(losses, args.loss_png, f"HSTU with rab, backend={args.backend!r}"):
        print(f"loss curve: {args.loss_png}")
    k = min(5, len(losses))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss: first {k} steps {first:.4f} -> last {k} steps {last:.4f} "
          f"(uniform guess {math.log(args.num_items):.4f})")
    if args.steps >= 10 and not last < first:
        raise SystemExit("FAILED: loss did not decrease")
    print("OK")


if __name__ == "__main__":
    main()
