"""Compile the attention kernels for sm90 on a GPU-less machine and diff their PTX against a git revision.

    .venv/bin/python scripts/ptx_unchanged.py [REV]      (REV defaults to HEAD; compares the working tree)
    .venv/bin/python scripts/ptx_unchanged.py --tables [REV]   (also the table-bias kernels at the tuner's pick)
    .venv/bin/python scripts/ptx_unchanged.py --features[=all] [dkdv=32,64,4,3 fwd=64,32,4,3] [--dq-mode=3]
                                                         (registers / spills of the bias variants at a config)

Used to show that a new constexpr feature (rab, intervals) leaves the kernels compiled without it
unchanged: the PTX bodies must be identical, only the appended (unused) parameters may differ.
Triton ships ptxas, so ``triton.compile`` with ``GPUTarget("cuda", 90, 128)`` runs without a driver.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
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
from triton.compiler import ASTSource  # noqa: E402

PATH = "hstu_inductor/kernels/attention.py"


def _load(path, name):
    spec = importlib.util.spec_from_file_location(f"hstu_inductor.kernels.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _signature(fn, values):
    """Triton signature, constexprs and attributes from example values (tensors as (dtype str,), ints, floats,
    None), specialised as the JIT does: pointers 16-byte aligned, ints that are multiples of 16 marked so, ints
    equal to 1 constexpr. Without the marks loads do not vectorise and the SASS is not what the GPU runs."""
    sig, consts, attrs = {}, {}, {}
    div16 = [["tt.divisibility", 16]]
    for i, name in enumerate(fn.arg_names):
        if name not in values:
            continue
        val = values[name]
        if isinstance(val, tuple):  # pointer
            sig[name], attrs[(i,)] = "*" + val[0], div16
        elif name.isupper() and name in CONSTEXPR or val is None or isinstance(val, bool) \
                or isinstance(val, int) and val == 1:
            sig[name] = "constexpr"
            consts[name] = val
        elif isinstance(val, int):
            sig[name] = "i32"
            if val % 16 == 0:
                attrs[(i,)] = div16
        elif isinstance(val, float):
            sig[name] = "fp32"
        else:
            sig[name] = "constexpr"
            consts[name] = val
    return sig, consts, attrs


CONSTEXPR = {"MASK", "CAUSAL", "HAS_TGT", "HAS_CTX", "HAS_WINDOW", "HAS_MINFULL", "SCALE_MODE", "DELTA", "TMA", "FAST",
             "PREC", "EVEN_DQ", "EVEN_DV", "BLOCK_DQ", "BLOCK_DV", "BLOCK_M", "BLOCK_N", "SEQ_MAJOR", "Q_IN_REGS",
             "DQ_MODE", "HAS_RAB", "RAB_GRAD", "HAS_IV", "HAS_POS", "HAS_TS", "TAB_GRAD", "TS_STEPS", "TAB_HEADS"}


def _values(kind, tma, dq_mode=0, blocks=None):
    ptr = ("bf16",)
    v = {n: 16 for n in ("stride_qm", "stride_qh", "stride_km", "stride_kh", "stride_vm", "stride_vh", "stride_om",
                         "stride_oh", "stride_dom", "stride_doh", "stride_dqm", "stride_dqh", "stride_dkm",
                         "stride_dkh", "stride_dvm", "stride_dvh", "stride_sm")}
    v.update({n: 1 for n in ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_dod")})
    v.update(H=4, DQ=128, DV=128, ROWS=1000, MAX_N=1024, DELTA_ROWS=0, CTX=0, WINDOW=0, MINFULL=0, N_BUCKET=1024,
             alpha=0.1, scale_const=0.001, one=1.0, SEQ_OFFSETS=("i64",), NUM_TARGETS=("i64",), ATTN_SCALE=None,
             Q=ptr, K=ptr, V=ptr, O=ptr, DO=ptr, DK=ptr, DVo=ptr, DQo=ptr, DQA=("fp32",) if dq_mode else None,
             CAUSAL=True, HAS_TGT=True, HAS_CTX=False, HAS_WINDOW=False, HAS_MINFULL=False, SCALE_MODE=0,
             # the mask as one switch set and four lengths (spec.KernelMask: causal | targets)
             MASK=3, ML0=0, ML1=0, ML2=0, ML3=0,
             DELTA=False, TMA=tma, FAST=1, PREC="tf32", EVEN_DQ=True, EVEN_DV=True, BLOCK_DQ=128, BLOCK_DV=128,
             SEQ_MAJOR=True, DQ_MODE=dq_mode, HAS_RAB=False, HAS_IV=False, HAS_POS=False, HAS_TS=False,
             RAB_GRAD=False, TAB_GRAD=False,
             # the new arguments as the host passes them without rab/intervals
             RAB=None, IV=None, DRAB=None, TS=None, POSW=None, TSW=None, DPOS=None, DTS=None, NB=0, TAB_COPIES=1,
             TSB=None, TSP=None, TS_STEPS=0, TAB_HEADS=0)
    v.update({n: 0 for n in ("stride_rb", "stride_rh", "stride_ri", "stride_rj", "stride_ih", "stride_ir",
                             "stride_ic", "stride_gb", "stride_gh", "stride_gi", "stride_gj", "stride_pc",
                             "stride_tc")})
    blocks = blocks or {"fwd": (128, 64, 8, 2), "dkdv": (64, 128, 8, 3), "dq": (128, 64, 8, 3)}[kind]
    v.update(BLOCK_M=blocks[0], BLOCK_N=blocks[1])
    if kind != "dkdv":
        v["Q_IN_REGS"] = False
    return v, blocks[2], blocks[3]


# --features: the bias variants compiled for sm90 (they must compile; registers/spills/shared memory printed)
FEATURES = {
    "rab_1h_atomic": dict(RAB=("bf16",), HAS_RAB=True, DRAB=("fp32",), RAB_GRAD=2, stride_rh=1048576, stride_ri=1024,
                          stride_rj=1, stride_gh=1048576, stride_gi=1024, stride_gj=1),
    "tables": dict(TS=("i64",), POSW=("fp32",), TSW=("fp32",), NB=128, HAS_POS=True, HAS_TS=True, DPOS=("fp32",),
                   DTS=("fp32",), TAB_COPIES=32, stride_pc=2047, stride_tc=129, TAB_GRAD=True, TSB=("i64",),
                   TSP=("i32",), TS_STEPS=8),
}
# both tables with a row per head ([H, 2N-1], [H, NB+1])
FEATURES["tables_per_head"] = dict(FEATURES["tables"], TAB_HEADS=3)
# --features=all: also each table alone (where registers go)
FEATURES_SPLIT = {
    "plain": {},
    "pos_only": dict(POSW=("fp32",), HAS_POS=True, DPOS=("fp32",), TAB_COPIES=32, stride_pc=2047, TAB_GRAD=True),
    "ts_only": dict(TS=("i64",), TSW=("fp32",), NB=128, HAS_TS=True, DTS=("fp32",), TAB_COPIES=32, stride_tc=129,
                    TAB_GRAD=True, TSB=("i64",), TSP=("i32",), TS_STEPS=8),
    "ts_nograd": dict(TS=("i64",), TSW=("fp32",), NB=128, HAS_TS=True, TSB=("i64",), TSP=("i32",), TS_STEPS=8),
    # the gap ts(i) - ts(j) (jagged: HAS_TS 3; padded [B, N]: 4)
    "ts_own_row": dict(TS=("i64",), TSW=("fp32",), NB=128, HAS_TS=3, DTS=("fp32",), TAB_COPIES=32, stride_tc=129,
                       TAB_GRAD=True, TSB=("i64",), TSP=("i32",), TS_STEPS=8),
}
# the buckets read from the call's [B, N, N] map (kernels/bucket_map.py) instead of computed per tile
FEATURES_SPLIT["tables_map"] = dict(FEATURES["tables"], TS=("u8",), HAS_TS=5)
# the other timestamp dtypes' bucket paths (fp32: the fp32 guess; int32: int64 thresholds; fp64: as int64 when integral)
for _ts, _tsb in (("fp32", "fp32"), ("i32", "i64"), ("fp64", "fp64")):
    FEATURES_SPLIT[f"tables_{_ts}_ts"] = dict(FEATURES["tables"], TS=(_ts,), TSB=(_tsb,))


# Every HSTU mask option at once (contextual prefix 3, window 100, full-attention tail 50, targets), in both
# spellings of the kernels' mask arguments: separate switches and lengths, or spec.KernelMask bits and ML0..ML3.
FULL_MASK = dict(HAS_CTX=True, HAS_WINDOW=True, HAS_MINFULL=True, CTX=3, WINDOW=100, MINFULL=50,
                 MASK=31, ML0=3, ML1=100, ML2=50)


def _ptx(mod, kind, tma, dq_mode=0, extra=None, kernel=False, mask=None, blocks=None):
    fn = {"fwd": mod._hstu_fwd_kernel, "dkdv": mod._hstu_bwd_dkdv_kernel, "dq": mod._hstu_bwd_dq_kernel}[kind]
    values, warps, stages = _values(kind, tma, dq_mode, blocks)
    values.update(mask or {})
    values.update(extra or {})
    if kind != "dkdv":
        for name in ("DRAB", "RAB_GRAD", "DPOS", "DTS", "TAB_GRAD"):
            values.pop(name, None)
    sig, consts, attrs = _signature(fn, values)
    src = ASTSource(fn, sig, consts, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": warps, "num_stages": stages})
    return k if kernel else k.asm["ptx"]


def features(split=False, configs=None, dq_mode=0):
    """Compile every kernel with each bias feature for sm90; print registers, spills, shared memory.
    ``configs``: {kind: (BLOCK_M, BLOCK_N, warps, stages)} (default: each kind's first tuning config's shape);
    ``dq_mode``: the dK/dV kernel's dQ (0 split, 1 atomics, 3 vectorised atomics, the tables' default on sm90)."""
    mod = _load(os.path.join(ROOT, PATH), "_attention_new")
    for name, extra in {**FEATURES, **(FEATURES_SPLIT if split else {})}.items():
        for kind in ("fwd", "dq", "dkdv"):
            blocks = (configs or {}).get(kind)
            try:
                k = _ptx(mod, kind, False, dq_mode if kind == "dkdv" else 0, extra, kernel=True, blocks=blocks)
            except triton.runtime.errors.PTXASError as e:  # reported, not fatal: the other variants still build
                print(f"{name:14s} {kind:5s}: ptxas failed ({str(e).splitlines()[0][:80]})")
                continue
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(k.asm["ptx"])
            from triton.backends.nvidia.compiler import get_ptxas
            usage = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                   capture_output=True, text=True).stderr
            regs = re.findall(r"Used (\d+) registers", usage)
            spills = re.findall(r"(\d+) bytes spill stores", usage)
            print(f"{name:14s} {kind:5s}: {regs} regs, {spills} B spill stores, {k.metadata.shared} B shared")


def _body(ptx):
    """Normalised PTX body: see :func:`_code`; the last two parameters (Triton's global and profile scratch
    pointers; TMA descriptors live in the global one) are renamed: the appended parameters shift them."""
    last = max(int(i) for i in re.findall(r"_param_(\d+)", ptx))
    out = []
    for line in _code(ptx):
        line = re.sub(rf"_param_{last}\b", "_param_SCRATCH1", line)
        out.append(re.sub(rf"_param_{last - 1}\b", "_param_SCRATCH0", line))
    return out


def _code(ptx):
    """PTX code without the parameter list (the new kernels append unused parameters) and without debug
    line info (the source moved; ``$L__tmp`` labels exist only for the debug info)."""
    out = []
    in_params = False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".param") or re.match(r"^\.visible \.entry", s):
            in_params = True
            continue
        if in_params and s.startswith(")"):
            in_params = False
            continue
        if s.startswith(".section") or s.startswith(".debug"):
            break  # debug sections (source file names and line numbers) end the code
        if in_params or s.startswith(("//", ".loc", ".file")) or re.fullmatch(r"\$L__tmp\d+:", s):
            continue
        out.append(line.split("//")[0].rstrip())
    return out


VARIANTS = (("fwd", False, 0), ("fwd", True, 0), ("dq", False, 0), ("dq", True, 0),
            ("dkdv", False, 0), ("dkdv", True, 0), ("dkdv", False, 1))
VARIANTS = tuple((*v, None) for v in VARIANTS) + tuple((*v, "full_mask") for v in VARIANTS if not v[1])
MASKS = {None: None, "full_mask": FULL_MASK}
# --tables: the table-bias kernels (timestamps computed per tile) at the configs the tuner picks for them
TABLE_VARIANTS = tuple((kind, feat, blocks) for feat in ("tables", "tables_per_head")
                       for kind, blocks in (("fwd", (64, 32, 4, 3)), ("dkdv", (32, 64, 4, 3))))


def _dump(root, out, tables=False):
    """The normalised PTX bodies of ``root``'s kernels (a package tree) as JSON: one process per tree,
    since the kernels import helpers from sibling modules of their own revision."""
    sys.path.insert(0, root)
    import hstu_inductor.kernels.attention as mod
    bodies = [_body(_ptx(mod, kind, tma, dq_mode, mask=MASKS[m])) for kind, tma, dq_mode, m in VARIANTS]
    if tables:
        bodies += [_body(_ptx(mod, kind, False, 3 if kind == "dkdv" else 0, FEATURES[feat], blocks=blocks))
                   for kind, feat, blocks in TABLE_VARIANTS]
    with open(out, "w") as f:
        json.dump(bodies, f)


def _bodies(root, tables=False):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, os.path.abspath(__file__), "--dump" + ("-tables" if tables else ""), root, out],
                   check=True, env=env)
    with open(out) as f:
        return json.load(f)


def main():
    if sys.argv[1:2] in (["--features"], ["--features=all"]):
        # optional: KIND=BM,BN,WARPS,STAGES (e.g. dkdv=32,64,4,3) and --dq-mode=N
        configs = {a.split("=")[0]: tuple(int(x) for x in a.split("=")[1].split(","))
                   for a in sys.argv[2:] if not a.startswith("--")}
        dq = [int(a.split("=")[1]) for a in sys.argv[2:] if a.startswith("--dq-mode=")]
        return features(split=sys.argv[1] == "--features=all", configs=configs, dq_mode=dq[0] if dq else 0)
    if sys.argv[1:2] in (["--dump"], ["--dump-tables"]):
        return _dump(sys.argv[2], sys.argv[3], tables=sys.argv[1] == "--dump-tables")
    args = sys.argv[1:]
    tables = "--tables" in args
    args = [a for a in args if a != "--tables"]
    rev = args[0] if args else "HEAD"
    with tempfile.TemporaryDirectory() as old_root:
        tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "hstu_inductor"], check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old_root], input=tar, check=True)
        olds = _bodies(old_root, tables)
    news = _bodies(ROOT, tables)
    ok = True
    names = [f"{kind:5s} tma={tma!s:5s} dq_mode={dq_mode} {m or '':9s}" for kind, tma, dq_mode, m in VARIANTS]
    names += [f"{kind:5s} {feat} {blocks}" for kind, feat, blocks in (TABLE_VARIANTS if tables else ())]
    for name, a, b in zip(names, olds, news):
        same = a == b
        ok &= same
        print(f"{name}: {'identical' if same else 'DIFFERENT'} ({len(b)} PTX lines)")
        if not same:
            sys.stdout.writelines(list(difflib.unified_diff(a, b, lineterm="\n", n=1))[:40])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
