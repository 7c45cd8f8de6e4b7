"""Compile the Gluon HSTU backward kernels (dK/dV and dQ) for sm90 on a GPU-less machine; print registers, spills,
shared memory (a sibling of scripts/gluon_compile.py, whose ptxas report it reuses).

    PYTHONPATH=. .venv/bin/python scripts/gluon_bwd_compile.py [NAME=k=v,k=v ...] [--ptx DIR]

Each argument is a variant: a name and overrides of ``GLUON_BWD_CONFIG`` plus ``kernel:dq|dkdv`` (default both),
``HAS_TGT`` and ``dtype``. Without arguments the default config of both kernels, with and without targets.
Besides ptxas -v it reports the highest register index in the SASS (``maxR``: what the 240-register consumer
partitions actually use) and the SASS counts of HGMMA / MUFU.TANH / BAR.SYNC.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from triton.experimental.gluon import language as gl  # noqa: E402

from gluon_compile import compile_sm90, parse_args, ptxas_report, summarize  # noqa: E402
from hstu_inductor.kernels import gluon_backward as gb  # noqa: E402


def _desc(dtype, rows, layout):
    return f"tensordesc<{dtype}[{rows}, 128],{layout!r}>"


def compile_variant(kernel: str, cfg: dict, has_tgt=True, dtype="bf16"):
    cfg = {**gb.GLUON_BWD_CONFIG, **cfg}
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    D, BM, BN = 128, gb.BLOCK_M, cfg["BLOCK_N"]
    ml = gl.NVMMASharedLayout.get_default_for([BM, D], gdt)
    nl = gl.NVMMASharedLayout.get_default_for([BN, D], gdt)
    common = dict(HAS_TGT=has_tgt, PINGPONG=cfg["PINGPONG"], DYNAMIC=cfg["DYNAMIC"],
                  CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"])
    scalars = {"stride_om": "i32", "H": "i32", "ROWS": "i32", "MAX_N": "i32", "N_BLOCKS": "i32", "n_items": "i32",
               "half_alpha": "fp32"}
    if kernel == "dkdv":
        fn = gb._hstu_bwd_dkdv_ws_kernel
        sig = {n: _desc(dtype, BM, ml) for n in ("k_desc", "v_desc", "q_desc", "do_desc", "dk_desc", "dv_desc")}
        sig |= {"DK": f"*{dtype}", "DV": f"*{dtype}", "SEQ_OFFSETS": "*i64", "NUM_TARGETS": "*i64",
                "COUNTER": "*i32"} | scalars | {"dk_scale": "fp32", "dv_scale": "fp32"}
        consts = dict(common, STAGES=cfg["KV_STAGES"])
        div16 = ("DK", "DV", "SEQ_OFFSETS", "NUM_TARGETS", "stride_om", "H", "ROWS", "MAX_N")
    else:
        fn = gb._hstu_bwd_dq_ws_kernel
        sig = {"q_desc": _desc(dtype, BM, ml), "do_desc": _desc(dtype, BM, ml), "k_desc": _desc(dtype, BN, nl),
               "v_desc": _desc(dtype, BN, nl), "dq_desc": _desc(dtype, BM, ml)}
        sig |= {"DQ": f"*{dtype}", "SEQ_OFFSETS": "*i64", "NUM_TARGETS": "*i64", "COUNTER": "*i32"} | scalars \
            | {"out_scale": "fp32"}
        consts = dict(common, BLOCK_N=BN, KSTAGES=cfg["DQ_KSTAGES"], VSTAGES=cfg["DQ_VSTAGES"],
                      OVERLAP=cfg["OVERLAP"], REGS=cfg["DQ_REGS"])
        div16 = ("DQ", "SEQ_OFFSETS", "NUM_TARGETS", "stride_om", "H", "ROWS", "MAX_N")
    return compile_sm90(fn, sig, consts, div16, cfg.get("MAXNREG"))


def sass_stats(cubin: bytes) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    # innermost loops (a backward branch with no other backward branch inside) that issue HGMMA: the tile loops;
    # spill instructions inside them are what costs (spills of per-item values outside them are cheap)
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,6})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in ins for m in [re.search(r"BRA (?:!?U?P\d, )?0x([0-9a-f]+)", t)]
             if m and int(m.group(1), 16) < a]
    inner = [(lo, hi) for lo, hi in loops if not any(lo <= l2 and h2 <= hi and (l2, h2) != (lo, hi) for l2, h2 in loops)]
    tile_loops = [(lo, hi) for lo, hi in inner if any(lo <= a <= hi and "HGMMA" in t for a, t in ins)]
    loop_spills = sum(1 for lo, hi in tile_loops for a, t in ins if lo <= a <= hi and ("STL" in t or "LDL" in t))
    return (f"maxR={max(regs) if regs else '?'} tile_loops={len(tile_loops)} spill_ops_in_tile_loops={loop_spills} "
            f"HGMMA={len(re.findall(r'HGMMA', sass))} "
            f"MUFU.TANH={len(re.findall(r'MUFU.TANH', sass))} BAR.SYNC={len(re.findall(r'BAR.SYNC', sass))} "
            f"STL={len(re.findall(r'STL', sass))} LDL={len(re.findall(r'LDL', sass))}"), sass


def main(argv):
    variants, out_dir = parse_args(argv, text_keys=("dtype", "kernel"))
    if not variants:
        variants = [("dkdv_tgt", {"kernel": "dkdv"}), ("dq_tgt", {"kernel": "dq"}),
                    ("dkdv_notgt", {"kernel": "dkdv", "HAS_TGT": False}), ("dq_notgt", {"kernel": "dq", "HAS_TGT": False})]
    expanded = []
    for name, cfg in variants:
        kern = cfg.pop("kernel", None)
        for kk in ([kern] if kern else ["dkdv", "dq"]):
            expanded.append((name if kern else f"{name}_{kk}", kk, cfg))
    for name, kern, cfg in expanded:
        cfg = dict(cfg)
        has_tgt = cfg.pop("HAS_TGT", True)
        dtype = cfg.pop("dtype", "bf16")
        try:
            k = compile_variant(kern, cfg, has_tgt, dtype)
        except Exception as e:  # keep going with the other variants
            print(f"{name:28s} FAILED: {type(e).__name__}: {str(e)[:2000]}")
            continue
        rep = ptxas_report(k.asm["ptx"])
        summarize(name, k, rep)
        stats, sass = sass_stats(k.asm["cubin"])
        print(f"{'':28s} {stats}", flush=True)
        if out_dir:
            for ext, text in (("ptx", k.asm["ptx"]), ("ttgir", k.asm["ttgir"]), ("ptxas.txt", rep), ("sass", sass)):
                with open(os.path.join(out_dir, f"{name}.{ext}"), "w") as f:
                    f.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
