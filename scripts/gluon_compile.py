"""Compile the Gluon HSTU forward for sm90 on a GPU-less machine; print registers, spills, shared memory.

    PYTHONPATH=. .venv/bin/python scripts/gluon_compile.py [NAME=k=v,k=v ...] [--ptx DIR]

Each argument is a variant: a name and overrides of ``GLUON_CONFIG`` (and HAS_TGT, dtype). Without arguments
the default config with and without targets is compiled. ``--ptx DIR`` writes each variant's PTX and
ptxas report there. Triton ships ptxas, so ``triton.compile`` with ``GPUTarget("cuda", 90, 128)`` needs no driver.
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

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from hstu_inductor.kernels import gluon_attention as ga  # noqa: E402


def compile_variant(cfg: dict, has_tgt=True, dtype="bf16"):
    cfg = {**ga.GLUON_CONFIG, **cfg}
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    D = 128
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    ql = gl.NVMMASharedLayout.get_default_for([BM, D], gdt)
    kl = gl.NVMMASharedLayout.get_default_for([BN, D], gdt)
    persistent = cfg.get("PERSISTENT", False)
    fn = ga._hstu_fwd_ws_persistent_kernel if persistent else ga._hstu_fwd_ws_kernel
    sig = {
        "q_desc": f"tensordesc<{dtype}[{BM}, {D}],{ql!r}>",
        "k_desc": f"tensordesc<{dtype}[{BN}, {D}],{kl!r}>",
        "v_desc": f"tensordesc<{dtype}[{BN}, {D}],{kl!r}>",
        "o_desc": f"tensordesc<{dtype}[{BM}, {D}],{ql!r}>",
        "O": f"*{dtype}", "SEQ_OFFSETS": "*i64", "NUM_TARGETS": "*i64",
        "stride_om": "i32", "H": "i32", "ROWS": "i32", "MAX_N": "i32", "half_alpha": "fp32", "scale": "fp32",
    }
    if persistent:
        sig = {k: sig[k] for k in list(sig)[:7]} | {"COUNTER": "*i32"} | {k: sig[k] for k in list(sig)[7:11]} \
            | {"n_items": "i32"} | {k: sig[k] for k in list(sig)[11:]}
    consts = dict(HAS_TGT=has_tgt, BLOCK_M=BM, BLOCK_N=BN, STAGES=cfg["STAGES"], PINGPONG=cfg["PINGPONG"],
                  PACKED=cfg["PACKED"], SYNC=cfg["SYNC"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
                  PRODUCER_REGS=cfg["PRODUCER_REGS"])
    if persistent:
        consts.update(DYNAMIC=cfg["DYNAMIC"])
    return compile_sm90(fn, sig, consts, ("O", "SEQ_OFFSETS", "NUM_TARGETS", "stride_om", "H", "ROWS", "MAX_N"),
                        cfg.get("MAXNREG"))


def compile_sm90(fn, sig: dict, consts: dict, div16, maxnreg=None):
    """``fn`` compiled for sm90 (4 warps) with the argument types ``sig`` and the constexprs ``consts``; the
    arguments named in ``div16`` are specialised as the JIT would (16-byte aligned pointers, multiples of 16)."""
    sig = dict(sig, **{k: "constexpr" for k in consts})
    assert sorted(sig) == sorted(fn.arg_names), (sorted(sig), sorted(fn.arg_names))
    sig = {a: sig[a] for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    opts = {"num_warps": 4, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 128), options=opts)


def ptxas_report(ptx: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    return r.stderr + r.stdout


def summarize(name, k, rep):
    regs = re.findall(r"Used (\d+) registers", rep)
    spills = re.findall(r"(\d+) bytes spill stores", rep)
    loads = re.findall(r"(\d+) bytes spill loads", rep)
    stack = re.findall(r"(\d+) bytes stack frame", rep)
    ptx = k.asm["ptx"]
    setmax = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    nwg = len(re.findall(r"wgmma\.mma_async", ptx))
    st = sorted(set(re.findall(r"st\.global(?:\.v\d)?\.b\d+", ptx)))
    bars = sorted(set(re.findall(r"bar\.sync\s+(\d+)(?:,\s*(\d+))?|barrier\.sync(?:\.aligned)?\s+(\d+)(?:,\s*(\d+))?",
                                 ptx)))
    warn = [l for l in rep.splitlines() if "warning" in l.lower()]
    print(f"{name:28s} regs={regs} spill_st={spills} spill_ld={loads} stack={stack} "
          f"shared={k.metadata.shared} B "
          f"warps={getattr(k.metadata, 'num_warps', '?')} setmaxnreg={setmax} wgmma={nwg} named_bars={bars} "
          f"stores={st}")
    for w in warn:
        print("   ", w)


def parse_args(argv, text_keys=("dtype",)):
    """``(variants, out_dir)`` from ``[--ptx DIR] NAME=k=v,k:v ...``: each variant a name and config overrides
    (ints, True/False, or text for ``text_keys``); ``--ptx`` creates DIR."""
    out_dir = None
    if "--ptx" in argv:
        i = argv.index("--ptx")
        out_dir = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
        os.makedirs(out_dir, exist_ok=True)
    variants = []
    for a in argv:
        name, _, rest = a.partition("=")
        cfg = {}
        for kv in filter(None, rest.split(",")):
            k, v = kv.split(":") if ":" in kv else kv.split("=")
            cfg[k] = v if k in text_keys else (v == "True" if v in ("True", "False") else int(v))
        variants.append((name, cfg))
    return variants, out_dir


def main(argv):
    variants, out_dir = parse_args(argv)
    if not variants:
        variants = [("default_tgt", {}), ("default_notgt", {"HAS_TGT": False})]
    for name, cfg in variants:
        cfg = dict(cfg)
        has_tgt = cfg.pop("HAS_TGT", True)
        dtype = cfg.pop("dtype", "bf16")
        k = compile_variant(cfg, has_tgt, dtype)
        rep = ptxas_report(k.asm["ptx"])
        summarize(name, k, rep)
        if out_dir:
            with open(os.path.join(out_dir, f"{name}.ptx"), "w") as f:
                f.write(k.asm["ptx"])
            with open(os.path.join(out_dir, f"{name}.ttgir"), "w") as f:
                f.write(k.asm["ttgir"])
            with open(os.path.join(out_dir, f"{name}.ptxas.txt"), "w") as f:
                f.write(rep)


if __name__ == "__main__":
    main(sys.argv[1:])
