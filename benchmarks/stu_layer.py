"""Benchmark one STU layer and an HSTUModel training step: eager, stock Inductor, backend="hstu".

    python benchmarks/stu_layer.py --n 1024 2048 --out OUTDIR

Layer (issue defaults): B=64, E=512, H=4, Dq=Dv=128, lengths ~ U[0.9N, N), 1..20 targets, bf16,
training mode. For each provider: forward (no grad) and forward+backward time (``do_bench``
medians), peak memory of a forward+backward step above what was allocated before it
(``torch.cuda.max_memory_allocated``), and the relative error of the output and of dx against
eager. The "floor" column is the layer's FLOPs at the GPU's dense bf16 peak (matmuls and the causal
attention), so ``ms / floor`` says how far each provider is from it.

Model step: ``HSTUModel`` (4 layers, same layer shape, ``--model-batch`` sequences), forward,
next-item cross-entropy, backward and an AdamW step; steps/s per provider.

Writes ``stu_layer.csv`` and ``stu_layer.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch
import torch._functorch.config
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PROVIDERS = ["eager", "inductor", "hstu", "hstu_save", "hstu_recompute"]
DEFAULT_PROVIDERS = ["eager", "inductor", "hstu"]
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak (SXM)


def make_batch(B, N, E, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.9 * N), N, (B,), generator=g)
    off = torch.zeros(B + 1, dtype=torch.int64)
    off[1:] = lengths.cumsum(0)
    nt = torch.minimum(torch.randint(1, 21, (B,), generator=g), lengths)
    x = torch.randn(int(off[-1]), E, generator=g).to(device=device, dtype=dtype)
    return x, off.to(device), nt.to(device), lengths


def layer_flops(lengths, E, H, Dq, Dv, concat=False):
    """(forward, backward) FLOPs of one layer: the two projections and the causal attention."""
    L = float(lengths.sum())
    n2 = float((lengths.double() ** 2).sum())
    proj_in = 2 * L * E * 2 * H * (Dq + Dv)
    proj_out = 2 * L * H * Dv * (3 if concat else 1) * E
    att_f, att_b = H * n2 * (Dq + Dv), H * n2 * (3 * Dq + 2 * Dv)
    fwd = proj_in + proj_out + att_f
    bwd = 2 * (proj_in + proj_out) + att_b
    return fwd, bwd


def peak_flops():
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_BF16.items() if k in name), 989e12)


def provider_options(provider):
    """``hstu_save`` / ``hstu_recompute``: ``backend="hstu"`` with that preprocess backward (the plain
    ``hstu`` provider uses the default). Active for the provider's whole run (compiles are lazy)."""
    import contextlib

    if provider in ("hstu_save", "hstu_recompute"):
        import hstu_inductor

        return hstu_inductor.config.patch(block_backward=provider.split("_")[1])
    return contextlib.nullcontext()


def compile_with(provider, module):
    torch._dynamo.reset()
    if provider == "eager":
        return module
    if provider == "inductor":
        return torch.compile(module)
    import hstu_inductor  # noqa: F401  (registers backend="hstu")

    return torch.compile(module, backend="hstu")


def bench(fn, rep):
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(10, rep // 4), rep=rep, return_mode="median")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_layer(args, N, device, dtype, rows):
    from hstu_inductor.reference import STULayer
    from hstu_inductor.report import collecting

    E, H, D = args.embedding, args.heads, args.dim
    x, off, nt, lengths = make_batch(args.batch, N, E, dtype, device, seed=N)
    torch.manual_seed(0)
    layer = STULayer(E, H, D, D).to(device=device, dtype=dtype).train()
    dout = torch.randn_like(x)
    f_fwd, f_bwd = layer_flops(lengths, E, H, D, D)
    floor_fwd, floor_fb = f_fwd / peak_flops() * 1e3, (f_fwd + f_bwd) / peak_flops() * 1e3
    ref_out = ref_dx = None
    for prov in args.providers:
        row = dict(N=N, provider=prov, fwd_ms=float("nan"), fwdbwd_ms=float("nan"), peak_mb=float("nan"),
                   err_out=float("nan"), err_dx=float("nan"), floor_fwd_ms=floor_fwd, floor_fwdbwd_ms=floor_fb,
                   note="")
        try:
            with provider_options(prov):
                t0 = time.time()
                model = compile_with(prov, layer)
                xx = x.detach().requires_grad_()
                # dynamic L and B, as a training loop sees them after its first recompile
                for t in (x, xx, off, nt):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                with collecting() as report:
                    out = model(xx, off, N, nt)
                    (dx,) = torch.autograd.grad(out, xx, dout)
                    with torch.no_grad():
                        model(x, off, N, nt)
                if prov.startswith("hstu"):
                    counts = report.counts
                    row["note"] = "rewrites " + "/".join(f"{k}={counts.get(k, 0)}" for k in ("preprocess", "attention",
                                                                                              "output"))
                    if len(set(counts.get(k, 0) for k in ("preprocess", "attention", "output"))) != 1:
                        print(report, flush=True)
                if ref_out is None:
                    ref_out, ref_dx = out.detach(), dx
                row.update(err_out=rel(out, ref_out), err_dx=rel(dx, ref_dx))
                del out, dx

                def fwd():
                    with torch.no_grad():
                        return model(x, off, N, nt)

                def fwd_bwd():
                    o = model(xx, off, N, nt)
                    return torch.autograd.grad(o, (xx, *layer.parameters()), dout)

                row["fwd_ms"] = bench(fwd, args.rep)
                row["fwdbwd_ms"] = bench(fwd_bwd, args.rep)
                if args.profile and device == "cuda":
                    profile(fwd_bwd, f"layer N={N} {prov} fwd+bwd")
                if device == "cuda":
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    fwd_bwd()
                    torch.cuda.synchronize()
                    row["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
                print(f"  layer N={N} {prov:14s} fwd {row['fwd_ms']:7.3f} ms  fwd+bwd {row['fwdbwd_ms']:7.3f} ms  "
                      f"peak {row['peak_mb']:8.1f} MB  err out {row['err_out']:.1e} dx {row['err_dx']:.1e}  "
                      f"({time.time() - t0:.0f}s) {row['note']}", flush=True)
        except Exception as e:  # a provider failing (OOM, ...) reports n/a
            row["note"] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
            print(f"  layer N={N} {prov}: {row['note']}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)


def run_model(args, N, device, dtype, rows):
    from hstu_inductor.reference import HSTUModel

    E, H, D = args.embedding, args.heads, args.dim
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(int(0.9 * N), N, (args.model_batch,), generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
    ids = torch.randint(0, args.items, (int(off[-1]),), generator=g).to(device)
    starts = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    starts[off[:-1]] = True
    last = torch.zeros_like(starts)
    last[off[1:] - 1] = True

    for prov in args.providers:
        row = dict(N=N, provider=prov, model_steps_per_s=float("nan"), note="")
        try:
            with provider_options(prov):
                torch.manual_seed(0)
                model = HSTUModel(args.items, N, embedding_dim=E, num_layers=4, num_heads=H, attn_dim=D,
                                  hidden_dim=D).to(device=device, dtype=dtype).train()
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                fn = compile_with(prov, model)
                for t in (ids, off):
                    torch._dynamo.maybe_mark_dynamic(t, 0)

                def step():
                    logits = fn(ids, off)
                    # next item of the same sequence: rows that are not a sequence's last
                    loss = F.cross_entropy(logits[~last].float(), ids[~starts])
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss

                step()
                step()
                ms = bench(step, args.rep)
                row["model_steps_per_s"] = 1e3 / ms
                print(f"  model N={N} {prov:14s} {row['model_steps_per_s']:6.2f} steps/s ({ms:.2f} ms/step)", flush=True)
        except Exception as e:
            row["note"] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
            print(f"  model N={N} {prov}: {row['note']}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)


def profile(fn, label, calls=5):
    """Top CUDA kernels of ``calls`` calls of ``fn`` (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"== {label}: {calls} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"plot skipped: {e}")
        return
    layer = [r for r in rows if "fwdbwd_ms" in r]
    if not layer:
        return
    ns = sorted({r["N"] for r in layer})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    provs = [p for p in PROVIDERS if any(r["provider"] == p for r in layer)]
    width = 0.8 / len(provs)
    for i, prov in enumerate(provs):
        for ax, key in zip(axes, ("fwdbwd_ms", "peak_mb")):
            vals = [next((r[key] for r in layer if r["N"] == n and r["provider"] == prov), float("nan")) for n in ns]
            ax.bar([j + width * i for j in range(len(ns))], vals, width=width, label=prov)
    for ax, title in zip(axes, ("fwd+bwd ms", "peak MB (fwd+bwd)")):
        ax.set_xticks([j + width * (len(provs) - 1) / 2 for j in range(len(ns))], [f"N={n}" for n in ns])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("STU layer, bf16, B=64 E=512 H=4 D=128")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--providers", nargs="+", default=DEFAULT_PROVIDERS, choices=PROVIDERS)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--embedding", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--model-batch", type=int, default=32)
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--no-model", action="store_true", help="skip the HSTUModel training-step benchmark")
    ap.add_argument("--no-layer", action="store_true", help="skip the single-layer benchmark")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of each layer fwd+bwd")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep time in ms")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out")))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    torch._functorch.config.donated_buffer = False  # the timed backward re-runs one compiled graph
    os.makedirs(args.out, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"B={args.batch} E={args.embedding} H={args.heads} D={args.dim} {args.dtype}", flush=True)
    rows = []
    for N in ([] if args.no_layer else args.n):
        run_layer(args, N, device, dtype, rows)
    model_rows = []
    if not args.no_model:
        for N in args.n:
            run_model(args, N, device, dtype, model_rows)

    print(f"\nSTU layer — B={args.batch} E={args.embedding} H={args.heads} D={args.dim} {args.dtype}")
    print(f"{'N':>5s} {'provider':14s} {'fwd ms':>8s} {'fwd+bwd ms':>10s} {'x floor':>7s} {'peak MB':>9s} "
          f"{'mem vs ind':>10s} {'speedup vs ind':>14s} {'err out':>8s} {'err dx':>8s}")
    for r in rows:
        ind = next((x for x in rows if x["N"] == r["N"] and x["provider"] == "inductor"), None)
        sp = ind["fwdbwd_ms"] / r["fwdbwd_ms"] if ind else float("nan")
        mem = r["peak_mb"] / ind["peak_mb"] if ind else float("nan")
        print(f"{r['N']:5d} {r['provider']:14s} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:10.3f} "
              f"{r['fwdbwd_ms'] / r['floor_fwdbwd_ms']:7.2f} {r['peak_mb']:9.1f} {mem:10.2f} {sp:14.2f} "
              f"{r['err_out']:8.1e} {r['err_dx']:8.1e} {r['note']}")
    if rows:
        print(f"floor (FLOPs at {peak_flops() / 1e12:.0f} TFLOP/s): "
              + ", ".join(f"N={r['N']}: fwd {r['floor_fwd_ms']:.3f} ms, fwd+bwd {r['floor_fwdbwd_ms']:.3f} ms"
                          for r in rows if r["provider"] == rows[0]["provider"]))
    for r in model_rows:
        print(f"model N={r['N']} {r['provider']:14s} {r['model_steps_per_s']:6.2f} steps/s {r['note']}")
    with open(os.path.join(args.out, "stu_layer.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows + model_rows for k in r}))
        w.writeheader()
        w.writerows(rows + model_rows)
    plot(rows, os.path.join(args.out, "stu_layer.png"))


if __name__ == "__main__":
    main()
