"""One plain-PyTorch STU layer with a relative attention bias (rab), trained under stock Inductor and under
``backend="hstu"``, against the same layer without the bias, side by side in one process.

    python benchmarks/stu_rab_layer.py --out OUTDIR                 # B=32, N=1024, E=512, H=4, D=128, bf16
    python benchmarks/stu_rab_layer.py --check                      # small, CPU: what is rewritten, errors

The layer (written for this benchmark, in a style the tests do not use): jagged rows padded with
``new_zeros(...).index_put((seg, pos), t)``, sequence ids from ``bucketize`` of the row index in the offsets
(see benchmarks/RESULTS.md for ``offsets[1:]`` under stock Inductor on CUDA);
the bias is

- time: ``|ts(next(i)) - ts(j)|`` of the padded timestamps (the next row's by a left shift that repeats the
  last column, as the original HSTU), or with ``--gap own`` ``|ts(i) - ts(j)|``, ``torch.bucketize``
  against log-spaced boundaries held in a module
  buffer, into an ``nn.Embedding(num_buckets + 1, 1)``;
- position: an ``nn.Embedding(2N - 1, 1)`` over ``j - i + N - 1``;
- ``--per-head``: both embeddings with a column per head (``nn.Embedding(V, H)``), the ``[B, N, N, H]`` gathers
  moved to the head axis;

(else shared by the heads), added to the scaled scores inside the silu; causal mask, ``1/N`` scaling.

Providers: ``inductor`` (stock ``torch.compile``), ``hstu`` (the backend's default: the tables in training),
``hstu_tables`` (``config.rab_tables = True``: the bias computed in the kernels from the tables, path (b)),
``hstu_dense`` (``config.rab_tables = False``: the dense bias built by Inductor, path (a)), and the layer
without the bias (``norab``) under both backends. For each: what was rewritten (``explain``), one training
step (forward + backward of every parameter, ``do_bench`` median), the peak memory of the step, and the
relative error of the output and of both tables' gradients against an fp32 eager reference. ``--gpu-time``:
also the step's kernel time (the profiler's sum) and host time (GPU stalled), to tell a host-bound step.
Writes ``stu_rab_layer.csv``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import compiled_with_counts, layer_args  # noqa: E402

log = logging.getLogger("stu_rab_layer")


class RabLayer(torch.nn.Module):
    def __init__(self, E, H, D, N, num_buckets=64, rab=True, gap="next", per_head=False):
        super().__init__()
        self.H, self.D, self.N, self.rab, self.gap, self.per_head = H, D, N, rab, gap, per_head
        self.norm = torch.nn.LayerNorm(E)
        self.uvqk = torch.nn.Linear(E, 4 * H * D, bias=False)
        self.out_norm = torch.nn.LayerNorm(H * D)
        self.proj = torch.nn.Linear(H * D, E)
        if rab:
            # boundaries of |dt| in seconds, 1 s .. ~1 year, log-spaced (a buffer: saved with the model)
            self.register_buffer("bounds", torch.logspace(0, 7.5, num_buckets, dtype=torch.float64).round())
            cols = H if per_head else 1  # a bias per head: [B, N, N, H] gathers moved to the head axis
            self.time_emb = torch.nn.Embedding(num_buckets + 1, cols)
            self.pos_emb = torch.nn.Embedding(2 * N - 1, cols)
            torch.nn.init.normal_(self.time_emb.weight, std=0.3)
            torch.nn.init.normal_(self.pos_emb.weight, std=0.3)

    def bias(self, tsp):
        N = self.N
        query = torch.cat([tsp[:, 1:], tsp[:, -1:]], dim=1) if self.gap == "next" else tsp
        gap = (query.unsqueeze(2) - tsp.unsqueeze(1)).abs()
        t = self.time_emb(torch.bucketize(gap, self.bounds))
        ar = torch.arange(N, device=tsp.device)
        p = self.pos_emb(ar.unsqueeze(0) - ar.unsqueeze(1) + (N - 1))
        if self.per_head:
            return (t + p.unsqueeze(0)).permute(0, 3, 1, 2)  # [B, H, N, N]
        return (t + p).squeeze(-1).unsqueeze(1)  # [B, 1, N, N]

    def forward(self, x, offsets, ts):
        L, B, H, D, N = x.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        rows = torch.arange(L, device=x.device)
        seg = torch.bucketize(rows, offsets, right=True) - 1
        pos = rows - offsets[seg]
        u, q, k, v = self.uvqk(self.norm(x)).chunk(4, dim=-1)

        def pad(t):
            return t.new_zeros((B, N) + t.shape[1:]).index_put((seg, pos), t)
        qp, kp, vp = (pad(t.reshape(L, H, D)).transpose(1, 2) for t in (q, k, v))
        s = qp @ kp.transpose(-1, -2) / D ** 0.5
        if self.rab:
            s = s + self.bias(pad(ts)).to(s.dtype)
        keep = torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
        a = (F.silu(s) / N).masked_fill(~keep, 0.0) @ vp
        a = a.transpose(1, 2)[seg, pos].reshape(L, H * D)
        return x + self.proj(F.silu(u) * self.out_norm(a))


def make_inputs(B, N, E, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.9 * N), N + 1, (B,), generator=g)
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    L = int(offsets[-1])
    # int64 seconds, increasing per sequence, gaps log-spread over 1 s .. 1e6 s
    ts = torch.cat([1.7e9 + (10 ** (torch.rand(int(n), generator=g, dtype=torch.float64) * 6)).floor().cumsum(0)
                    for n in lengths]).to(torch.int64)
    x = torch.randn(L, E, generator=g)
    return x.to(device, dtype), offsets.to(device), ts.to(device)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _grads(model, inputs, gy):
    x = inputs[0].detach().requires_grad_(True)
    y = model(x, *inputs[1:])
    params = [model.time_emb.weight, model.pos_emb.weight] if model.rab else []
    return (y,) + torch.autograd.grad(y, [x] + params, gy)


def run(args, providers):
    from hstu_inductor import config

    device = "cuda" if torch.cuda.is_available() and not args.check else "cpu"
    dtype = torch.float32 if args.check else torch.bfloat16
    B, N, E, H, D = args.batch, args.n, args.embedding, args.heads, args.dim
    inputs = make_inputs(B, N, E, device, dtype)
    rows = []
    for prov in providers:
        rab = not prov.startswith("norab")
        torch.manual_seed(0)
        model = RabLayer(E, H, D, N, rab=rab, gap=args.gap, per_head=args.per_head).to(device)
        ref_model = RabLayer(E, H, D, N, rab=rab, gap=args.gap, per_head=args.per_head).to(device)
        ref_model.load_state_dict(model.state_dict())
        model = model.to(dtype)
        gy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        want = _grads(ref_model, (inputs[0].float(),) + inputs[1:], gy.float())  # fp32 eager reference
        backend = "inductor" if prov.endswith("inductor") else "hstu"
        extra = {}
        tables = {"hstu_tables": True, "hstu_dense": False}.get(prov, config.rab_tables)
        with config.patch(rab_tables=tables):
            compiled, counts = compiled_with_counts(model, inputs, backend)

            def step():
                return _grads(compiled, inputs, gy)

            got = step()
            errs = [rel(a, b) for a, b in zip(got, want)]
            ms = peak = float("nan")
            if device == "cuda":
                from triton.testing import do_bench

                from _common import peak_mib
                peak = peak_mib(step)[0]
                ms = do_bench(step, rep=args.rep, return_mode="median")
                if args.gpu_time:
                    from _common import host_ms, kernel_profile, top_kernels
                    total, per = kernel_profile(step)
                    extra = dict(kernel_ms=round(total, 3), host_ms=round(host_ms(step), 3))
                    print(f"{prov} kernels: {top_kernels(per)}", flush=True)
        row = dict(provider=prov, rewritten=counts, ms=round(ms, 3), **extra, peak_mib=round(peak, 1),
                   err_out=f"{errs[0]:.2e}", err_dx=f"{errs[1]:.2e}",
                   err_d_time=f"{errs[2]:.2e}" if rab else "", err_d_pos=f"{errs[3]:.2e}" if rab else "")
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    provs = ["inductor", "hstu", "hstu_tables", "hstu_dense", "norab_inductor", "norab_hstu"]
    ap.add_argument("--providers", nargs="+", default=provs, choices=provs)
    ap.add_argument("--per-head", action="store_true",
                    help="tables with a column per head (nn.Embedding(V, H)), as the issue's model; default shared")
    ap.add_argument("--gap", choices=["next", "own"], default="next",
                    help="time gap ts(next(i)) - ts(j) (the original HSTU's) or ts(i) - ts(j)")
    ap.add_argument("--check", action="store_true", help="small CPU run (B=4, N=32): rewrites and errors")
    ap.add_argument("--gpu-time", action="store_true",
                    help="also each step's kernel time (profiler sum, its largest kernels printed) and host time "
                         "(GPU stalled)")
    layer_args(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        args.batch, args.n, args.embedding, args.heads, args.dim = 4, 32, 32, 2, 8
    rows = run(args, args.providers)
    if not args.check:
        from _common import write_csv
        write_csv(rows, args.out, "stu_rab_layer.csv")
        t = {r["provider"]: r["ms"] for r in rows}
        if "inductor" in t and "hstu_tables" in t:
            print(f"hstu_tables: {t['inductor'] / t['hstu_tables']:.1f}x stock Inductor", flush=True)
        if "norab_hstu" in t and "hstu_tables" in t:
            print(f"hstu_tables: {t['hstu_tables'] / t['norab_hstu']:.2f}x the layer without rab under hstu")
        k = {r["provider"]: r.get("kernel_ms") for r in rows}
        if k.get("norab_hstu") and k.get("hstu_tables"):
            print(f"hstu_tables: kernel time {k['hstu_tables'] / k['norab_hstu']:.2f}x the layer without rab")


if __name__ == "__main__":
    main()
