"""Why is ``backend="hstu"`` slower than launching the attention kernels directly?

    TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc \
        python benchmarks/diagnose_backend_gap.py --n 1024 --out /tmp/gap

Times the forward (inference) and forward+backward of the plain reference under
``backend="hstu"`` against the direct kernels, logs the launch arguments both paths pass
(``hstu_inductor`` DEBUG log), and then lists every compiled variant of our kernels found in the
Triton and Inductor caches (warps, stages, maxnreg, shared memory and the specialised signature),
so the two paths' compiled kernels can be compared side by side.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re

import torch
from triton.testing import do_bench

import hstu_inductor  # noqa: F401  (registers the backend)
from hstu_inductor.kernels import attention as K
from hstu_inductor.reference import hstu_mha


def make_inputs(N, B, H, D, grad, strided=False):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(int(0.9 * N), N, (B,), generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
    L = int(off[-1])
    if strided:  # views of one fused projection [L, 4*H*D], as benchmarks/attention.py uses
        fused = torch.randn(L, 4 * H * D, device="cuda", dtype=torch.bfloat16)
        q, k, v = (fused[:, i * H * D:(i + 1) * H * D].view(L, H, D).detach().requires_grad_(grad)
                   for i in (2, 3, 1))
    else:
        q, k, v = (torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_(grad) for _ in range(3))
    nt = torch.randint(1, 20, (B,), generator=g).cuda()
    return q, k, v, off, nt


def compiled_variants(roots):
    """(dir, name, num_warps, num_stages, maxnreg, shared, signature line) of each cached hstu kernel."""
    rows = []
    for root in roots:
        for meta_path in glob.glob(os.path.join(root, "**", "*.json"), recursive=True):
            base = os.path.basename(meta_path)
            if not base.startswith("_hstu") or base.startswith("__grp"):
                continue
            try:
                meta = json.load(open(meta_path))
            except Exception:
                continue
            ttir = meta_path[:-5] + ".ttir"
            sig = ""
            if os.path.exists(ttir):
                m = re.search(r"tt\.func public @\w+\((.*?)\)\s*(attributes|\{)", open(ttir).read(), re.S)
                sig = m.group(1) if m else ""
                # keep only the argument attributes (divisibility), not the types
                sig = " ".join(re.findall(r"%arg\d+: [^,{]+(?:\{[^}]*\})?", sig))
            rows.append((root, meta.get("name"), meta.get("num_warps"), meta.get("num_stages"), meta.get("maxnreg"),
                         meta.get("shared"), sig))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--out", default="/tmp/gap")
    ap.add_argument("--strided", action="store_true", help="q, k, v as views of one fused projection")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    handler = logging.FileHandler(os.path.join(args.out, "launch_log.txt"), mode="w")
    logging.getLogger("hstu_inductor").addHandler(handler)
    logging.getLogger("hstu_inductor").setLevel(logging.DEBUG)

    N, B, H, D = args.n, args.batch, 4, 128
    alpha = 1.0 / D

    def ref(q, k, v, off, nt):
        return hstu_mha(N, alpha, q, k, v, off, causal=True, num_targets=nt)

    results = {}
    # ---- inference forward
    q, k, v, off, nt = make_inputs(N, B, H, D, grad=False, strided=args.strided)
    handler.stream.write("==== direct fwd\n")
    direct = lambda: K.hstu_attention_fwd(q, k, v, off, N, alpha, num_targets=nt)  # noqa: E731
    direct()
    results["fwd direct"] = do_bench(direct, warmup=25, rep=100)
    handler.stream.write("==== backend fwd\n")
    compiled = torch.compile(ref, backend="hstu")
    with torch.no_grad():
        for t in (q, k, v, off, nt):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        out_c = compiled(q, k, v, off, nt)
        results["fwd backend"] = do_bench(lambda: compiled(q, k, v, off, nt), warmup=25, rep=100)
    with torch.no_grad():
        ref_out = hstu_mha(N, alpha, q.float(), k.float(), v.float(), off, causal=True, num_targets=nt)
    rel = lambda x: ((x.float() - ref_out).norm() / ref_out.norm()).item()  # noqa: E731
    print(f"fwd rel err vs fp32 reference: backend {rel(out_c):.2e}, direct (autotuned) {rel(direct()):.2e}")
    print("forced fwd configs (BLOCK_M, BLOCK_N, warps, stages[, maxnreg, q_in_regs]):")
    for cfg in K._GPU_CONFIGS[("fwd", "small")]:
        with K.force_configs(fwd=cfg):
            f = lambda: K.hstu_attention_fwd(q, k, v, off, N, alpha, num_targets=nt)  # noqa: E731
            err_cfg = rel(f())
            ms = do_bench(f, warmup=25, rep=100)
        print(f"   {cfg}: {ms * 1e3:8.1f} us, rel err {err_cfg:.2e}")

    # ---- training forward + backward
    torch._dynamo.reset()
    q, k, v, off, nt = make_inputs(N, B, H, D, grad=True, strided=args.strided)
    dout = torch.randn_like(q)
    handler.stream.write("==== direct fwd+bwd\n")

    def direct_fb():
        K.hstu_attention_fwd(q, k, v, off, N, alpha, num_targets=nt)  # the forward a training step also runs
        return K.hstu_attention_bwd(dout, q, k, v, off, N, alpha, num_targets=nt)

    direct_fb()
    results["fwd+bwd direct"] = do_bench(direct_fb, warmup=25, rep=100)
    handler.stream.write("==== backend fwd+bwd\n")
    compiled = torch.compile(ref, backend="hstu")
    for t in (q, k, v, off, nt):
        torch._dynamo.maybe_mark_dynamic(t, 0)

    def backend_fb():
        o = compiled(q, k, v, off, nt)
        return torch.autograd.grad(o, (q, k, v), dout)

    backend_fb()
    results["fwd+bwd backend"] = do_bench(backend_fb, warmup=25, rep=100)

    for name, ms in results.items():
        print(f"{name:18s} {ms * 1e3:9.1f} us")
    print(f"fwd ratio backend/direct time: {results['fwd backend'] / results['fwd direct']:.3f}")
    print(f"fwd+bwd ratio backend/direct time: {results['fwd+bwd backend'] / results['fwd+bwd direct']:.3f}")
    for name, tuner in K._TUNERS.items():
        print(f"direct autotuner {name}: best {getattr(tuner, 'best_config', None)}")
    roots = [os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache")),
             os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_" + os.environ.get("USER", "root"))]
    print("compiled hstu kernel variants (root, name, warps, stages, maxnreg, shared, specialised signature):")
    for row in sorted(compiled_variants(roots), key=lambda r: (r[1] or "", r[0])):
        print("  ", row[0].split("/")[-1], row[1], row[2], row[3], row[4], row[5])
        print("      ", row[6][:900])


if __name__ == "__main__":
    main()
