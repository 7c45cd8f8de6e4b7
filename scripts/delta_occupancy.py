"""Registers, shared memory and programs per SM of the cached-attention kernel (kernels/delta.py) for sm90,
compiled on a GPU-less machine, per config and row block: the numbers behind ``delta_plans``' ``per_sm``.

    .venv/bin/python scripts/delta_occupancy.py [--ptx FILE | --candidates]

The launch is specialised as the runtime specialises it at N=1024, B=128, H=4, Dq=Dv=128: pointers and
integers divisible by 16 carry ``tt.divisibility`` (without it Triton does not pipeline the K/V loads through
shared memory, and the registers differ: (64, 3, 8) at 16 rows compiles to 233 registers and 22 KB instead of
80 and 71.7 KB, the figures ncu reported on the H100), and integers equal to 1 are constants. ``--ptx FILE``
writes the PTX of the default 16-bit config with the one-launch fold (its barriers and atomic can be read);
``--candidates``: the named plans of ``delta_plans.CANDIDATES`` at 128 rows.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hstu_inductor.kernels import delta as Kd  # noqa: E402
from hstu_inductor.kernels import delta_plans as P  # noqa: E402

REGS, SMEM, MAX_WARPS = 65536, 227 * 1024, 64  # per SM on sm90 (227 KB usable by blocks)


def compile_delta(plan, rows, dtype="bf16", split=2):
    """The kernel as launched with ``plan`` (a ``delta_plans.Plan``, or (BLOCK_N, stages, warps) with the row
    block of ``PLANS``) and ``split`` programs per row block (1: no partials; more: the fold)."""
    if not isinstance(plan, P.Plan):
        plan = P.default_plan(rows)._replace(block_n=plan[0], stages=plan[1], warps=plan[2])
    ints = dict(stride_qm=512, stride_qh=128, stride_km=512, stride_kh=128, stride_vm=512, stride_vh=128,
                stride_om=512, stride_oh=128, stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, stride_sm=0,
                H=4, DQ=128, DV=128, ROWS=124417, MAX_N=1024, DELTA_ROWS=rows, CTX=0, WINDOW=0, SPLIT=split,
                PLANE=128 * rows * 4 * 128)
    ptrs = dict(Q=dtype, K=dtype, V=dtype, O=dtype, P="fp32", CNT="i32", SEQ_OFFSETS="i64")
    consts = dict(NUM_TARGETS=None, ATTN_SCALE=None, CAUSAL=True, HAS_TGT=False, HAS_CTX=False, HAS_WINDOW=False,
                  SCALE_MODE=0, PARTIAL=split > 1, FOLD=split > 1, FAST=0 if dtype == "fp32" else 1,
                  PREC="tf32x3" if dtype == "fp32" else "tf32", EVEN_DQ=True, EVEN_DV=True, BLOCK_DQ=128,
                  BLOCK_DV=128, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, TMA=plan.tma, Q_SMEM=plan.qsmem)
    sig, attrs = {}, {}
    for i, name in enumerate(Kd._hstu_delta_kernel.arg_names):
        if name in consts or ints.get(name) == 1:
            sig[name] = "constexpr"
            consts.setdefault(name, ints.get(name))
        elif name in ptrs:
            sig[name], attrs[(i,)] = "*" + ptrs[name], [["tt.divisibility", 16]]
        elif name in ("alpha", "scale_const"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(Kd._hstu_delta_kernel, sig, consts, attrs)
    opts = dict(num_warps=plan.warps, num_stages=plan.stages)
    if plan.maxnreg:
        opts["maxnreg"] = plan.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def usage(kernel, warps):
    """(registers, spill bytes, shared bytes, programs per SM)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    shared = kernel.metadata.shared
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp in units of 256
    per_sm = min(REGS // (per_warp * warps), SMEM // (shared + 1024), MAX_WARPS // warps, 32)  # +1 KB reserved
    return regs, spills, shared, per_sm


def main():
    if sys.argv[1:2] == ["--ptx"]:
        with open(sys.argv[2], "w") as f:
            f.write(compile_delta(Kd._CONFIGS[3], 1, split=2).asm["ptx"])
        return
    print("registers / spilled bytes / shared bytes / programs per SM, for split 1 and split 2 (the fold)")
    if sys.argv[1:2] == ["--candidates"]:  # delta_plans.CANDIDATES at 128 rows (what per_sm records)
        for name, plan in P.CANDIDATES.items():
            cols = ["%3d / %3d / %6d / %d" % usage(compile_delta(plan, 128, "bf16", split), plan.warps)
                    for split in (1, 2)]
            print(f"bf16  128 rows {name:18s} {cols[0]:24s} {cols[1]}", flush=True)
        return
    for dtype, configs in (("bf16", Kd._CONFIGS), ("fp32", [(32, 3, 8), (32, 3, 4), (32, 2, 4)])):
        for rows in (1, 16, 32, 64):
            for config in configs:
                cols = ["%3d / %3d / %6d / %d" % usage(compile_delta(config, rows, dtype, split), config[2])
                        for split in (1, 2)]
                print(f"{dtype:5s} {rows:3d} rows {str(config):13s} {cols[0]:24s} {cols[1]}", flush=True)


if __name__ == "__main__":
    main()
