"""The dK/dV kernel's bias-gradient adds alone: fp32 atomics today against vectorised or packed reductions.

    python benchmarks/bias_grad_adds.py [--batch 128] [--n 1024] [--heads 4] [--out DIR]

For table biases shared by the heads, path (b)'s dK/dV kernel adds each score tile's bias gradient into one
fp32 ``[B, N, N]`` plane (the heads summed there; kernels/table_grad.py). Those adds cost about 1 ms of its
3 ms at B=128, N=1024 (RESULTS.md, 2026-11-29 fifth session). This kernel makes only those adds, from a
``[keys, queries]`` tile laid out as the dK/dV kernel's (an MMA accumulator: each thread holds pairs of
adjacent queries), one program per (sequence, head, 64 keys), the causal half, in four ways:

* ``fp32``: ``tl.atomic_add`` into the query-major plane ``G[b, i, j]`` (today's layout; one ``atom.f32`` per
  element);
* ``fp32_v2``: ``red.global.add.v2.f32`` into a key-major plane ``G[b, j, i]`` (a thread's pair is adjacent);
* ``bf16``: ``tl.atomic_add`` into a key-major bf16 plane (Triton 3.6 emits one ``atom.bf16`` per element);
* ``bf16x2``: ``red.global.add.noftz.bf16x2`` into it (one add per pair).

Results must equal ``fp32``'s (exactly for ``fp32_v2``); the printed error is against it.
"""
from __future__ import annotations

import argparse
import logging
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from _common import write_csv

log = logging.getLogger("bias_grad_adds")

_RED = {
    "fp32_v2": ("{ .reg .pred p; setp.ne.b32 p, $4, 0; @p red.relaxed.gpu.global.add.v2.f32 [$2], {$6, $7}; "
                "mov.b32 $0, 0; mov.b32 $1, 0; }", "=r,=r,l,l,r,r,r,r"),
    # 16-bit pairs arrive packed in one 32-bit register
    "bf16x2": ("{ .reg .pred p; setp.ne.b32 p, $4, 0; @p red.relaxed.gpu.global.add.noftz.bf16x2 [$2], $6; "
               "mov.b32 $0, 0; mov.b32 $1, 0; }", "=r,=r,l,l,r,r,r"),
}


@triton.jit
def _adds(G, N, H: tl.constexpr, MODE: tl.constexpr, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    n_kb = N // BLOCK_N
    b = pid // n_kb // H
    kb = pid % n_kb
    j = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    g_b = G + b.to(tl.int64) * N * N
    for q0 in range(kb * BLOCK_N // BLOCK_M * BLOCK_M, N, BLOCK_M):
        i = q0 + tl.arange(0, BLOCK_M)
        # the tile from a dot: an MMA accumulator's layout, as dS^T in the dK/dV kernel
        a = (j[:, None] * 0.001 + tl.zeros([BLOCK_N, 16], tl.float32)).to(tl.bfloat16)
        c = (i[None, :] * 0.002 + tl.zeros([16, BLOCK_M], tl.float32)).to(tl.bfloat16)
        ok = i[None, :] >= j[:, None]
        x = tl.where(ok, tl.dot(a, c), 0.0)
        pair_ok = (i[None, :] | 1) >= j[:, None]  # pair (2m, 2m + 1) holds a valid element; the other adds 0
        if MODE == 0:
            tl.atomic_add(g_b + (i[None, :] * N + j[:, None]), x, mask=ok, sem="relaxed")
        elif MODE == 1:
            tl.atomic_add(g_b + (j[:, None] * N + i[None, :]), x.to(tl.bfloat16), mask=ok, sem="relaxed")
        else:
            val = x if MODE == 2 else x.to(tl.bfloat16)
            ptr = (g_b + (j[:, None] * N + i[None, :])).to(tl.int64, bitcast=True)
            tl.inline_asm_elementwise(ASM, CONSTRAINTS, [ptr, pair_ok.to(tl.int32), val], dtype=tl.int32,
                                      is_pure=False, pack=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out")))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    B, N, H = args.batch, args.n, args.heads
    grid = (B * H * (N // 64),)
    rows, want = [], None
    for name, mode, dtype in (("fp32", 0, torch.float32), ("fp32_v2", 2, torch.float32),
                              ("bf16", 1, torch.bfloat16), ("bf16x2", 3, torch.bfloat16)):
        g = torch.zeros(B, N, N, device="cuda", dtype=dtype)
        asm, constraints = _RED.get(name, ("", ""))
        step = lambda: _adds[grid](g, N, H, MODE=mode, ASM=asm, CONSTRAINTS=constraints,  # noqa: E731
                                   BLOCK_M=64, BLOCK_N=64, num_warps=4)
        step()
        ms = do_bench(step, rep=200, return_mode="median")
        g.zero_()
        step()
        got = g.float() if mode == 0 else g.float().transpose(1, 2)
        if want is None:
            want = got
        err = float((got - want).norm() / want.norm())
        rows.append(dict(device=torch.cuda.get_device_name(), B=B, N=N, H=H, adds=name, ms=round(ms, 3),
                         rel_err_vs_fp32=f"{err:.2e}"))
        log.info("%-8s %.3f ms  rel err vs fp32 %.2e", name, ms, err)
    write_csv(rows, args.out, "bias_grad_adds.csv")


if __name__ == "__main__":
    main()
