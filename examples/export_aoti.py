"""Export an HSTU model for inference, rewrite it, package it with AOTInductor, serve the .pt2.

    python examples/export_aoti.py                 # CPU
    python examples/export_aoti.py --device cuda   # GPU (kernels compiled into the package)

Two programs are packaged:
1. the full model (``HSTUModel``): every STU layer's preprocess, attention and output blocks are
   rewritten to hstu ops inside the exported program;
2. a cached-inference step: the last ``D`` positions of each sequence attend over the full
   sequence (``delta_hstu_mha``, the KV-cache path), compared with rows of the full attention.

Each package is loaded back with ``torch._inductor.aoti_load_package`` (which needs no import of
hstu_inductor), checked against eager on two batch shapes, and timed against eager.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch.export import Dim

import hstu_inductor.export as hx
from hstu_inductor.reference import HSTUModel, delta_hstu_mha, hstu_mha


def jagged_batch(lengths, num_items, device, seed):
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return torch.randint(0, num_items, (int(off[-1]),), generator=g).to(device), off.to(device)


class CachedAttention(torch.nn.Module):
    """The last ``D`` rows of each sequence attend over cached k/v (plain torch reference)."""

    def __init__(self, max_seq_len, alpha):
        super().__init__()
        self.max_seq_len, self.alpha = max_seq_len, alpha

    def forward(self, delta_q, k, v, seq_offsets):
        return delta_hstu_mha(self.max_seq_len, self.alpha, delta_q, k, v, seq_offsets)


def timed(fn, *args, reps=20):
    sync = torch.cuda.synchronize if args[0].is_cuda else (lambda: None)
    with torch.no_grad():
        for _ in range(3):
            fn(*args)
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        sync()
    return (time.perf_counter() - t) / reps * 1e3


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences in the timed batch")
    p.add_argument("--out-dir", default=None, help="where to write the .pt2 files (default: a temp dir)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="hstu_export_")
    os.makedirs(out_dir, exist_ok=True)
    N, num_items = args.max_seq_len, 256
    torch.manual_seed(0)

    # 1. the full model
    model = HSTUModel(num_items, N, embedding_dim=64, num_layers=2, num_heads=2, attn_dim=32,
                      hidden_dim=32).to(dev).eval()
    ids, off = jagged_batch([N, N // 2, N - 3, 5], num_items, dev, seed=1)
    result = hx.export_and_package(model, (ids, off), dynamic_shapes=({0: Dim.AUTO}, {0: Dim.AUTO}),
                                   package_path=os.path.join(out_dir, "hstu_model.pt2"))
    print("== HSTUModel ==")
    print(result.report)
    runner = torch._inductor.aoti_load_package(result.package_path)
    timed_lengths = [N - (i * 7) % (N // 4 + 1) for i in range(args.batch)]
    for lengths, seed in (([3, N, 7], 2), (timed_lengths, 1)):
        ids, off = jagged_batch(lengths, num_items, dev, seed)
        with torch.no_grad():
            err = rel_err(runner(ids, off), model(ids, off))
        print(f"B={len(lengths)} L={int(off[-1])}: package vs eager rel err {err:.2e}")
        assert err < (1e-5 if dev.type == "cpu" else 2e-3), err
    stock_path = torch._inductor.aoti_compile_and_package(
        torch.export.export(model, (ids, off), dynamic_shapes=({0: Dim.AUTO}, {0: Dim.AUTO})),
        package_path=os.path.join(out_dir, "stock_model.pt2"))
    stock = torch._inductor.aoti_load_package(stock_path)
    print(f"latency (B={len(off) - 1}, L={int(off[-1])}): eager {timed(model, ids, off):.3f} ms, "
          f"stock AOTI {timed(stock, ids, off):.3f} ms, hstu AOTI {timed(runner, ids, off):.3f} ms")

    # 2. the cached (delta) attention step
    H, D, Dd = 2, 32, 4
    cached = CachedAttention(N, 1.0 / D).to(dev)
    lengths = [N, 9, N - 1]
    off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    L = int(off[-1])
    k, v = torch.randn(L, H, D, device=dev), torch.randn(L, H, D, device=dev)
    q = torch.randn(L, H, D, device=dev)
    last = torch.cat([torch.arange(int(e) - Dd, int(e)) for e in off[1:]]).to(dev)
    delta_q = q[last]
    ep = torch.export.export(cached, (delta_q, k, v, off),
                             dynamic_shapes=({0: Dim.AUTO}, {0: Dim.AUTO}, {0: Dim.AUTO}, {0: Dim.AUTO}))
    new_ep, report = hx.rewrite_exported_program(ep)
    print("\n== cached attention step ==")
    print(report)
    path = hx.aoti_compile_and_package(new_ep, os.path.join(out_dir, "hstu_cached.pt2"))
    cached_runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        full = hstu_mha(N, 1.0 / D, q, k, v, off)[last]
        got = cached_runner(delta_q, k, v, off)
    err = rel_err(got, full)
    print(f"cached package vs rows of full attention: rel err {err:.2e}")
    assert err < (1e-5 if dev.type == "cpu" else 2e-3), err
    print(f"latency: eager {timed(cached, delta_q, k, v, off):.3f} ms, "
          f"package {timed(cached_runner, delta_q, k, v, off):.3f} ms")
    print(f"\npackages in {out_dir}; load them with torch._inductor.aoti_load_package (no hstu_inductor import)")


if __name__ == "__main__":
    main()
