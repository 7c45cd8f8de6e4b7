"""Is ``backend="hstu"`` ever slower than stock Inductor? One plain-PyTorch STU layer over a grid.

    python benchmarks/never_slower.py --out OUTDIR [--batch 1 4 16 64 128] [--n 256 1024 4096]
        [--tasks infer train] [--modes default reduce-overhead] [--static]

Issue 22 item 6: the rewritten STU blocks and attention must never lose to Inductor's own code, for
B=1..128, N=256..4096, inference and training, with and without CUDA graphs. The model is
``reference.STULayer`` (E=512, H=4, D=128, bf16, lengths ~ U[0.9N, N), 1..20 targets), i.e. the same
plain PyTorch for every provider:

- ``inductor``: ``torch.compile(layer)``;
- ``hstu``: ``backend="hstu"`` with every rewrite; ``hstu_attention`` / ``hstu_blocks``: only the
  attention, or only the preprocess/output blocks, rewritten (to see which rewrite loses where).

One compile per (task, mode, provider) with ``dynamic=True`` (``--static``: a fresh static compile per
size, as a first compile sees it), then every (B, N). Timing: CUDA events around ``--iters`` calls,
median of 5 repeats, after warm-up (CUDA-graph recording included in the warm-up). Rows go to
``never_slower.csv`` as they are measured, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

log = logging.getLogger("hstu_inductor.benchmarks.never_slower")
PROVIDERS = {"inductor": None, "hstu": {"attention": True, "preprocess": True, "output": True},
             "hstu_attention": {"attention": True, "preprocess": False, "output": False},
             "hstu_blocks": {"attention": False, "preprocess": True, "output": True}}


class _SkipLog(logging.Handler):
    """Inductor's "skipping cudagraphs due to ..." warnings (a graph run without CUDA graphs under
    reduce-overhead pays its launches on the host: the reason belongs next to the time)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        torch._logging.set_logs(cudagraphs=True)
        for name in ("torch", "torch._inductor"):
            logging.getLogger(name).addHandler(self)

    def emit(self, record):
        msg = record.getMessage()
        if "cudagraph" in msg.lower() and "skip" in msg.lower():
            self.messages.append(msg.splitlines()[0][:160])


def make_batch(B, N, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, int(0.9 * N)), N + 1, (B,), generator=g)
    off = torch.zeros(B + 1, dtype=torch.int64)
    off[1:] = lengths.cumsum(0)
    nt = torch.minimum(torch.randint(1, 21, (B,), generator=g), lengths)
    x = torch.randn(int(off[-1]), E, generator=g).to("cuda", torch.bfloat16)
    return x, off.cuda(), nt.cuda()


def timed(fn, iters, mark):
    """Median over 5 repeats of the mean time of ``iters`` back-to-back calls (ms)."""
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            if mark:
                torch.compiler.cudagraph_mark_step_begin()
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def step_fn(model, layer, task, x, off, N, nt, dout):
    if task == "infer":
        def fwd():
            with torch.no_grad():
                return model(x, off, N, nt)
        return fwd
    xx = x.detach().requires_grad_()
    params = tuple(layer.parameters())

    def fwd_bwd():
        out = model(xx, off, N, nt)
        return torch.autograd.grad(out, (xx, *params), dout)
    return fwd_bwd


def run(args):
    import hstu_inductor
    from hstu_inductor.reference import STULayer
    from hstu_inductor.report import collecting

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "never_slower.csv")
    fields = ["task", "mode", "provider", "B", "N", "ms", "rewrites", "cost_rule", "cudagraph_skips", "compile_s",
              "note"]
    skips = _SkipLog()
    f = open(path, "w", newline="")
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    deadline = time.time() + args.budget_s
    torch.manual_seed(0)
    layer = STULayer(args.embedding, args.heads, args.dim, args.dim).to("cuda", torch.bfloat16)
    sizes = [(B, N) for N in args.n for B in args.batch]
    for task in args.tasks:
        layer.train(task == "train")
        for mode in args.modes:
            for prov in args.providers:
                patch = (hstu_inductor.config.patch(patterns=PROVIDERS[prov]) if PROVIDERS[prov]
                         else contextlib.nullcontext())
                model = None
                with patch:
                    for B, N in sizes:
                        if time.time() > deadline:
                            log.warning("budget spent: stopping before %s %s %s B=%d N=%d", task, mode, prov, B, N)
                            f.close()
                            return path
                        if model is None or args.static:
                            torch._dynamo.reset()
                            kw = dict(mode=None if mode == "default" else mode, dynamic=not args.static)
                            model = torch.compile(layer, **kw) if prov == "inductor" else \
                                torch.compile(layer, backend="hstu", **kw)
                        row = dict(task=task, mode=mode, provider=prov, B=B, N=N, ms=float("nan"), rewrites="",
                                   cost_rule="", cudagraph_skips="", compile_s=float("nan"), note="")
                        skips.messages.clear()
                        try:
                            x, off, nt = make_batch(B, N, args.embedding, seed=B * 7919 + N)
                            dout = torch.randn_like(x)
                            fn = step_fn(model, layer, task, x, off, N, nt, dout)
                            t0 = time.time()
                            with collecting() as report:
                                for _ in range(3):  # compile / recompile / CUDA-graph recording
                                    if mode == "reduce-overhead":
                                        torch.compiler.cudagraph_mark_step_begin()
                                    fn()
                            torch.cuda.synchronize()
                            row["compile_s"] = round(time.time() - t0, 1)
                            if prov != "inductor":
                                c = report.counts
                                row["rewrites"] = "/".join(str(c.get(k, 0)) for k in ("preprocess", "attention",
                                                                                      "output"))
                                row["cost_rule"] = "; ".join(report.cost_rule)[:200]
                            row["cudagraph_skips"] = "; ".join(sorted(set(skips.messages)))[:300]
                            row["ms"] = timed(fn, args.iters, mode == "reduce-overhead")
                        except torch.OutOfMemoryError:
                            row["note"] = "OOM"
                        except Exception as e:  # noqa: BLE001  (a provider failing is a row, not a crash)
                            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                        finally:
                            torch.cuda.empty_cache()
                        w.writerow(row)
                        f.flush()
                        log.info("%s %s %-15s B=%-3d N=%-4d %8.3f ms  %s %s", task, mode, prov, B, N, row["ms"],
                                 row["rewrites"], row["note"])
    f.close()
    return path


def summary(path):
    """Per (task, mode, B, N): each provider's time over Inductor's; the rows where one loses."""
    rows = list(csv.DictReader(open(path)))
    ind = {(r["task"], r["mode"], r["B"], r["N"]): float(r["ms"]) for r in rows if r["provider"] == "inductor"}
    lines = ["| task | mode | B | N | provider | ms | Inductor ms | Inductor / provider | rewrites at a compile |",
             "|" + "---|" * 9]
    for r in rows:
        if r["provider"] == "inductor":
            continue
        base = ind.get((r["task"], r["mode"], r["B"], r["N"]), float("nan"))
        ms = float(r["ms"])
        lines.append(f"| {r['task']} | {r['mode']} | {r['B']} | {r['N']} | {r['provider']} | {ms:.3f} | {base:.3f} | "
                     f"{base / ms if ms == ms and ms > 0 else float('nan'):.2f} | {r['rewrites']} {r['note']} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--n", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--tasks", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    p.add_argument("--modes", nargs="+", default=["default", "reduce-overhead"],
                   choices=["default", "reduce-overhead"])
    p.add_argument("--providers", nargs="+", default=["inductor", "hstu", "hstu_attention", "hstu_blocks"],
                   choices=list(PROVIDERS))
    p.add_argument("--static", action="store_true", help="a static compile per size instead of dynamic=True")
    p.add_argument("--embedding", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=480, help="stop starting new rows after this many seconds")
    p.add_argument("--out", default="never_slower_out")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("never_slower.py times CUDA kernels: it needs a GPU")
    path = run(args)
    table = summary(path)
    with open(os.path.join(args.out, "never_slower.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
