"""Where does backend="hstu" spend time compared with calling the kernels directly?

    python benchmarks/profile_backend.py --n 1024

Prints the top CUDA kernels (torch.profiler) of one forward for both, and the explain report.
"""
from __future__ import annotations

import argparse

import torch

import hstu_inductor
from hstu_inductor.kernels import attention as K
from hstu_inductor.reference import hstu_mha
from hstu_inductor.report import collecting


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()
    N, B, H, D = args.n, args.batch, 4, 128
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(int(0.9 * N), N, (B,), generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
    L = int(off[-1])
    q, k, v = (torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    nt = torch.randint(1, 20, (B,), generator=g).cuda()

    def ref_nt(q, k, v, off, nt):
        return hstu_mha(N, 1.0 / D, q, k, v, off, causal=True, num_targets=nt)

    compiled = torch.compile(ref_nt, backend="hstu")
    with collecting() as report, torch.no_grad():
        for t in (q, k, v, off, nt):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        compiled(q, k, v, off, nt)
    print(report)
    runs = {
        "backend=hstu": lambda: compiled(q, k, v, off, nt),
        "direct kernel": lambda: K.hstu_attention_fwd(q, k, v, off, N, 1.0 / D, num_targets=nt),
    }
    for name, fn in runs.items():
        with torch.no_grad():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
        print(f"== {name} (10 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
