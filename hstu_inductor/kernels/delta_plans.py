"""Launch plans of the cached-attention kernel (kernels/delta.py): the one table that picks them by delta rows.

A plan fixes the row block, the key tile, the pipeline and the load path of ``_hstu_delta_kernel``. ``PLANS`` is
the default by rows per sequence; ``CANDIDATES`` are the named alternatives that ``benchmarks/delta_attention.py
--plans`` times side by side (for the 17-128-row gap to GR's cached kernel). Switching the default after a
measurement is one edit of ``PLANS``: a bound mapped to ``None`` leaves those rows to the full forward's row
blocks (``kernels.attention.delta_hstu_attention_fwd``).

``per_sm``: programs of the plan one sm90 SM holds at Dq = Dv = 128, 16-bit, no split (registers and shared
memory from ptxas, ``scripts/delta_occupancy.py``); the split rule (``delta.choose_split``) counts slots with it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional


class Plan(NamedTuple):
    block_m: int  # query rows per program: a program owns rows [r0, r0 + block_m) of one (sequence, head)
    block_n: int  # keys per step
    stages: int
    warps: int
    per_sm: int  # programs per SM (see the module docstring)
    maxnreg: int = 0  # register cap (0: ptxas decides); eager launches only, Inductor's user-kernel configs drop it
    qsmem: bool = False  # Q an operand of S = Q K^T from shared memory, not registers (fewer registers)
    tma: bool = False  # K/V tiles through device-side descriptors (where the layout allows)


# rows per sequence up to -> plan (None: the full forward's row blocks). The first bound >= rows applies.
# <= 64: one-wave (32, 3, 4) plans (the row block is the rows rounded up to 16..64).
PLANS = (
    (16, Plan(16, 32, 3, 4, 5)),
    (32, Plan(32, 32, 3, 4, 5)),
    (64, Plan(64, 32, 3, 4, 3)),
    # 65..128: one 128-row block per (sequence, head), two 8-warp programs per SM, Q from shared memory, K/V by
    # TMA (CANDIDATES["m128n32s3w8qt"]). H100, B=128, 128 rows: 0.1172 / 0.3623 ms at N=1024 / 4096 against
    # 0.1297 / 0.3811 for the full forward's row blocks and 0.1157 / 0.3680 for GR's best
    # (benchmarks/RESULTS.md, 2026-11-24)
    (128, Plan(128, 32, 3, 8, 2, qsmem=True, tma=True)),
)

# Longer caches: for the rows of a PLANS bound, at max_seq_len >= the given keys, this plan instead. 33..64 rows
# from 2048 keys: 64-row blocks in one wave with K/V by TMA. H100, B=128: 0.3520 ms against 0.3791 (the PLANS
# plan) and 0.3524 for GR's best at N=4096; at N=1024 it is 0.1244 against 0.1124 eagerly (its launch costs more
# host time than the 0.1 ms kernel hides), though faster from a CUDA graph (0.0963 against 0.1015) and under ncu
# (95.9 against 103.2 us). benchmarks/RESULTS.md, 2026-11-24.
LONG = {64: (2048, Plan(64, 32, 2, 4, 4, qsmem=True, tma=True))}

# fp32 inputs (3-pass tf32 dots: twice the tile bytes): 8 warps, row blocks of at most 64, one program per SM
FP32 = dict(block_n=32, stages=3, warps=8, per_sm=1, maxnreg=0, qsmem=False, tma=False)
FP32_MAX_BLOCK_M = 64

# Named alternatives (benchmarks/delta_attention.py --plans). Name: m<block_m> n<block_n> s<stages> w<warps>, then
# q = qsmem, t = tma, r<cap> = maxnreg. Comments: registers / shared KB / programs per SM (scripts/delta_occupancy.py
# --candidates: sm90, 16-bit, Dq = Dv = 128, split 1).
CANDIDATES = {
    # one row block per (sequence, head) at 128 rows; two programs per SM, whose MUFU and wgmma phases overlap
    # (in the full forward two 4-warp CTAs beat one 8-warp CTA by ~25 %, RESULTS.md)
    "m128n32s3w4q": Plan(128, 32, 3, 4, 2, qsmem=True),  # 255 / 80 / 2 (the full forward keeps q in registers: spills)
    "m128n32s3w4qt": Plan(128, 32, 3, 4, 2, qsmem=True, tma=True),  # 241 / 80 / 2
    "m128n32s3w8qt": Plan(128, 32, 3, 8, 2, qsmem=True, tma=True),  # 120 / 80 / 2 (pointers: 155 / 80 / 1)
    "m128n32s4w8qt": Plan(128, 32, 4, 8, 2, qsmem=True, tma=True),  # 120 / 96 / 2: one more K/V stage in flight
    "m128n32s3w8qr128": Plan(128, 32, 3, 8, 2, maxnreg=128, qsmem=True),  # 125 / 80 / 2, pointer loads
    # 64-row blocks: at 128 rows two programs per (sequence, head), adjacent, so the second reads K/V from L2
    "m64n32s3w4q": Plan(64, 32, 3, 4, 3, qsmem=True),  # 148 / 64 / 3 (the PLANS 64-row plan: 162 / 64 / 3)
    "m64n32s3w4qt": Plan(64, 32, 3, 4, 3, qsmem=True, tma=True),  # 120 / 65 / 3
    "m64n32s2w4qt": Plan(64, 32, 2, 4, 4, qsmem=True, tma=True),  # 120 / 48 / 4: 512 row blocks in one wave
    # for the 64-row gap (comments from a compile at 64 rows, split 1)
    "m64n32s3w8qt": Plan(64, 32, 3, 8, 2, qsmem=True, tma=True),  # 95 / 65 / 2: the 128-row plan's shape
    "m64n64s2w4qt": Plan(64, 64, 2, 4, 2, qsmem=True, tma=True),  # 156 / 81 / 2: half the key steps
    # 32-row blocks at 64 rows: two programs per (sequence, head), the second reads K/V from L2 (twice the row
    # blocks of the 64-row plan: 1024 at B=128, H=4, in about 1.5 waves)
    "m32n32s3w4": Plan(32, 32, 3, 4, 4),  # 106 / 42 / 4
    "m32n32s3w4t": Plan(32, 32, 3, 4, 5, tma=True),  # 96 / 42 / 5
    "m32n64s2w4qt": Plan(32, 64, 2, 4, 3, qsmem=True, tma=True),  # 132 / 44 / 3
    # <= 16 rows, for the bandwidth target: descriptors instead of per-thread addresses
    "m16n32s3w4t": Plan(16, 32, 3, 4, 5, tma=True),  # 80 / 37 / 5 (as the PLANS 16-row plan)
    "m16n64s2w4t": Plan(16, 64, 2, 4, 5, tma=True),  # 94 / 38 / 5
}


def default_plan(rows: int, fp32: bool = False, max_seq_len=0) -> Optional[Plan]:
    """The plan ``PLANS`` gives ``rows`` delta rows per sequence (None: the full forward's row blocks), or
    ``LONG``'s for its bound at ``max_seq_len`` keys and more (16-bit inputs; a symbolic ``max_seq_len`` is
    decided on its hint and guarded)."""
    for bound, plan in PLANS:
        if rows <= bound:
            if plan is not None and fp32:
                return plan._replace(block_m=min(plan.block_m, FP32_MAX_BLOCK_M), **FP32)
            if plan is not None and bound in LONG and not fp32:
                from .._compat import guarded

                min_keys, long_plan = LONG[bound]
                if guarded(max_seq_len >= min_keys):
                    return long_plan
            return plan
    return None


def max_rows() -> int:
    """Delta rows per sequence up to which a plan of ``PLANS`` applies."""
    return max((bound for bound, plan in PLANS if plan is not None), default=0)
