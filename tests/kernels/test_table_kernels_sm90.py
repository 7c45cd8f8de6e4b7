"""The table-bias kernels compile for sm90 on a machine without a GPU (Triton ships ptxas), with the PTX
the GPU path relies on. The interpreter (CPU tests) takes ``tl.load`` / ``tl.log2`` where a GPU build takes
inline PTX (attention_jit._table_load, _log2_guess, _bucket_search), so only a real build checks those (and
that every timestamp dtype's path type-checks as Triton compiles it, which the interpreter does not): 16-bit
tables with fp64 timestamps, fp32 tables with fp32 and int32 timestamps; the bucket map's reader and writer
(kernels/bucket_map.py). A subprocess: this process's kernels
are the interpreter's."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BUILD = """
import os, sys
sys.path.insert(0, os.path.join({root!r}, "scripts"))
import ptx_unchanged as tool
kernels = tool._load(os.path.join(tool.ROOT, tool.PATH), "_attention_sm90_probe")
for tables, ts, tsb in (("bf16", "fp64", "fp64"), ("fp32", "fp32", "fp32"), ("fp32", "i32", "i64")):
    extra = dict(TS=(ts,), TSW=(tables,), POSW=(tables,), NB=64, HAS_TS=2, HAS_POS=True, TSB=(tsb,), TSP=("i32",),
                 TS_STEPS=7)
    ptx = tool._ptx(kernels, "fwd", False, 0, extra)
    print(tables, ts, "lg2.approx.ftz.f32" in ptx, "lg2.approx.f32" in ptx, "SEARCH_STEP" in ptx,
          ("ld.global.nc.b16" if tables == "bf16" else "ld.global.nc.f32") in ptx, "ld.global.nc.b64" in ptx)
# the buckets read from the call's map (HAS_TS 5), and the kernel that writes the map (int64 timestamps)
extra = dict(TS=("u8",), TSW=("fp32",), NB=64, HAS_TS=5, TSB=("i64",), TSP=("i32",), TS_STEPS=7)
print("map reader", "ld.global.nc.u8" in tool._ptx(kernels, "fwd", False, 0, extra))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hstu_inductor.kernels import bucket_map
fn = bucket_map._bucket_map_kernel
sig = dict(MAP="*u8", SEQ_OFFSETS="*i64", TS="*i64", TSB="*i64", TSP="*i32", NB="i32", ROWS="i32", MAX_N="i32")
consts = dict(HAS_TS=1, TS_STEPS=7, LOWER=True, BLOCK_M=64, BLOCK_N=64)
sig.update({{k: "constexpr" for k in consts}})
k = triton.compile(ASTSource(fn, sig, consts, {{(fn.arg_names.index("MAP"),): [["tt.divisibility", 16]]}}),
                   target=GPUTarget("cuda", 90, 128), options=dict(num_warps=4))
print("map writer", "SEARCH_STEP" in k.asm["ptx"], "st.global" in k.asm["ptx"])
"""


def test_table_forward_builds_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _BUILD.format(root=ROOT)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # per build: the bucket guess is one MUFU op (lg2.approx; .ftz for integer gaps, which are never subnormal),
    # the fallback search one PTX loop, table gathers and 64-bit timestamps (or thresholds) plain read-only loads
    assert out.stdout.split("\n")[:5] == ["bf16 fp64 True False True True True", "fp32 fp32 False True True True False",
                                          "fp32 i32 False True True True True", "map reader True",
                                          "map writer True True"], out.stdout
