"""Shared by the training examples: synthetic jagged data (with per-event timestamps), the next-item
loss, and the optional extras (``pip install -e .[examples]``): a tqdm progress bar and a matplotlib
loss curve. Without them the examples log plain lines instead (logger ``hstu_inductor.examples``)."""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

log = logging.getLogger("hstu_inductor.examples")

# Synthetic timestamps: the gap before an event is log-uniform in [1 s, 1 day). A gap in the top `noise`
# fraction opens a new session whose first item ignores the hidden rule, so the time gaps carry signal
# that a time bias (train_hstu_rab.py) can learn.
_DAY = 86400.0


def synthetic_batch(gen, batch_size, max_seq_len, num_items, device, noise=0.1, timestamps=False):
    """Jagged sequences from a hidden Markov rule ``next = (7 * item + 3) % num_items`` with noise.

    Lengths are uniform in [max_seq_len // 2, max_seq_len]; returns ``(item_ids [L], offsets [B+1])``, and
    with ``timestamps`` also ``timestamps [L]`` (int64 seconds, increasing in each sequence; an event after a
    long gap, the top ``noise`` fraction of gaps, is random instead of the noise coin of the plain data).
    """
    lengths = torch.randint(max_seq_len // 2, max_seq_len + 1, (batch_size,), generator=gen)
    offsets = torch.zeros(batch_size + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    seqs, stamps = [], []
    for n in lengths.tolist():
        seq = torch.empty(n, dtype=torch.int64)
        seq[0] = torch.randint(0, num_items, (1,), generator=gen)
        if timestamps:
            u = torch.rand(n, generator=gen)
            new_session = (u > 1 - noise).tolist()
            stamps.append(1_700_000_000 + torch.cumsum(torch.exp(u * math.log(_DAY)).long(), 0))
        for i in range(1, n):
            # the plain data draws its noise coin here; keep that stream as it was (same batches as before)
            if new_session[i] if timestamps else bool(torch.rand((), generator=gen) < noise):
                seq[i] = torch.randint(0, num_items, (1,), generator=gen)
            else:
                seq[i] = (7 * seq[i - 1] + 3) % num_items
        seqs.append(seq)
    out = (torch.cat(seqs).to(device), offsets.to(device))
    if timestamps:
        out += (torch.cat(stamps).to(device),)
    return out


def setup_logging():
    """Show this module's fallback lines (INFO) on stderr, without turning on hstu_inductor's own INFO
    log, which repeats every compile's report."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def next_item_loss(logits, item_ids, offsets):
    """Cross entropy of predicting item i+1 from position i, inside each sequence."""
    L = item_ids.shape[0]
    is_last = torch.zeros(L, dtype=torch.bool, device=item_ids.device)
    is_last[(offsets[1:] - 1).clamp(min=0)] = True
    keep = ~is_last
    keep[L - 1] = False
    targets = torch.roll(item_ids, -1)
    return F.cross_entropy(logits[keep], targets[keep])


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class _LogProgress:
    """tqdm's calls used here (``update``, ``set_postfix``, ``close``), as a log line per tenth of the run."""

    def __init__(self, total, desc, disable):
        self.total, self.desc, self.disable, self.n, self.postfix = total, desc, disable, 0, {}
        self.every = max(1, total // 10)

    def update(self, k=1):
        self.n += k
        if not self.disable and (self.n % self.every == 0 or self.n == self.total):
            extra = " ".join(f"{key} {val}" for key, val in self.postfix.items())
            log.info("%s %d/%d %s", self.desc, self.n, self.total, extra)

    def set_postfix(self, **kw):
        self.postfix = kw

    def close(self):
        pass


def progress(total, desc="train", disable=False):
    """A tqdm bar on stderr, or (tqdm not installed) a log line every tenth of ``total``."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if not disable:
            log.info("tqdm not installed (pip install -e .[examples]): logging progress instead")
        return _LogProgress(total, desc, disable)
    return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True)


def save_loss_curve(losses, path, title):
    """Write the loss per step to the PNG ``path`` with matplotlib; without matplotlib (or with no
    ``path``), log the curve's first/min/last values instead. Returns the path written, or None."""
    if not path or not losses:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed (pip install -e .[examples]): no %s; loss first %.4f, min %.4f, "
                 "last %.4f over %d steps", path, losses[0], min(losses), losses[-1], len(losses))
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1.2)
    ax.set(xlabel="step", ylabel="next-item cross entropy", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def add_model_args(p, loss_png: str):
    """The options both training examples share (model size, data, optimiser, output, backend)."""
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
    p.add_argument("--loss-png", default=loss_png, help="loss curve PNG (needs matplotlib; '' for none)")
    p.add_argument("--backend", default="hstu", choices=["hstu", "hstu_eager"],
                   help="hstu_eager: the same rewrites run op by op, no Inductor code generation (quick checks)")


def optimise(opt, loss, losses: list, bar) -> None:
    """One optimiser step on ``loss``; records it and advances the progress bar."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.update(1)
