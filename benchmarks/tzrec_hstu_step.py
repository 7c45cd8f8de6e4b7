"""TorchEasyRec's original HSTU (``tzrec/modules/hstu.py``, two ``SequentialTransductionUnitJagged`` layers with
their relative bias) trained under stock Inductor and under ``backend="hstu"``, side by side in one process.

    git clone https://github.com/alibaba/TorchEasyRec /tmp/TorchEasyRec    (one file is loaded, read only)
    python benchmarks/tzrec_hstu_step.py /tmp/TorchEasyRec --out OUTDIR     # B=32, N=1024, E=512, H=4, D=128, bf16
    python benchmarks/tzrec_hstu_step.py /tmp/TorchEasyRec --check          # small, CPU: rewrites and errors

The encoder is ``scripts/peer_tzrec_hstu.py``'s: the file's layers as the original code calls them (a causal
mask held in a buffer, ``1 - mask`` passed to each layer, dense ``[B, N]`` timestamps, the paper's bucket
``floor(log|dt| / 0.301)``, 128 buckets). Without fbgemm_gpu installed, its two jagged ops run in plain
PyTorch (``hstu_inductor.testing.fbgemm_shim``, said in the output): opaque ops under both backends, a few
kernels each where fbgemm's are one, so the stock step is somewhat slower than with fbgemm.

Providers: ``inductor`` (stock ``torch.compile``), ``hstu`` (the default: the bias computed in the kernels from
the tables in training, path (b)), ``hstu_dense`` (``config.rab_tables = False``: the dense bias built by
Inductor, path (a)). For each: what was rewritten, one training step (forward + backward of the input and
every parameter, ``do_bench`` median), its peak memory, and the relative errors of the output, the input
gradient and the bias tables' gradients against the fp32 eager model. Writes ``tzrec_hstu_step.csv``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
sys.path.insert(0, HERE)

import peer_tzrec_hstu as peer  # noqa: E402  (the encoder, the file's loader, the fbgemm shim)
from _common import compiled_with_counts, layer_args  # noqa: E402


def make_inputs(B, N, E, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.9 * N), N + 1, (B,), generator=g).tolist()
    x, offsets, ts = peer.inputs(N, E, lengths, seed)
    return x.to(device, dtype), offsets.to(device), ts.to(device)


def _tables(model):
    return [p for name, p in model.named_parameters() if name.endswith(("_ts_w", "_pos_w"))]


def _grads(model, inputs, gy):
    x = inputs[0].detach().requires_grad_(True)
    y = model(x, *inputs[1:])
    return (y,) + torch.autograd.grad(y, [x] + _tables(model), gy)


def run(args):
    from hstu_inductor import config

    hstu = peer.load(args.root)
    device = "cuda" if torch.cuda.is_available() and not args.check else "cpu"
    dtype = torch.float32 if args.check else torch.bfloat16
    B, N, E, H, D = args.batch, args.n, args.embedding, args.heads, args.dim
    inputs = make_inputs(B, N, E, device, dtype)
    rows = []
    for prov in args.providers:
        torch.manual_seed(0)
        ref_model = peer.Encoder(hstu, N, E, H, D).to(device)
        model = peer.Encoder(hstu, N, E, H, D).to(device)
        model.load_state_dict(ref_model.state_dict())
        model = model.to(dtype)
        gy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        want = _grads(ref_model, (inputs[0].float(),) + inputs[1:], gy.float())
        backend = "inductor" if prov == "inductor" else "hstu"
        with config.patch(rab_tables=False if prov == "hstu_dense" else config.rab_tables):
            compiled, counts = compiled_with_counts(model, inputs, backend)

            def step():
                return _grads(compiled, inputs, gy)

            got = step()
            errs = [peer.rel(a.detach().double(), b.detach().double()) for a, b in zip(got, want)]
            ms = peak = float("nan")
            if device == "cuda":
                from triton.testing import do_bench

                from _common import peak_mib
                peak = peak_mib(step)[0]
                ms = do_bench(step, rep=args.rep, return_mode="median")
        row = dict(provider=prov, rewritten=counts, ms=round(ms, 3), peak_mib=round(peak, 1),
                   err_out=f"{errs[0]:.2e}", err_dx=f"{errs[1]:.2e}", err_d_tables=f"{max(errs[2:]):.2e}")
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    provs = ["hstu", "inductor", "hstu_dense"]
    ap.add_argument("root", nargs="?", default="/tmp/TorchEasyRec")
    ap.add_argument("--providers", nargs="+", default=provs, choices=provs)
    ap.add_argument("--check", action="store_true", help="small CPU run (B=4, N=32, fp32): rewrites and errors")
    layer_args(ap)
    args = ap.parse_args()
    if args.check:
        args.batch, args.n, args.embedding, args.heads, args.dim = 4, 32, 32, 2, 8
    if peer.FBGEMM_SHIM:
        print("fbgemm_gpu not installed: its jagged ops run in plain PyTorch (hstu_inductor.testing.fbgemm_shim)")
    rows = run(args)
    if not args.check:
        from _common import write_csv
        write_csv(rows, args.out, "tzrec_hstu_step.csv")
        t = {r["provider"]: r["ms"] for r in rows}
        if "inductor" in t and "hstu" in t:
            print(f"hstu: {t['inductor'] / t['hstu']:.1f}x stock Inductor", flush=True)


if __name__ == "__main__":
    main()
