"""First GPU contact for the Gluon backward: each config variant in its own subprocess with its own timeout, so a
hang (a barrier phase or turn-count mistake) or a fault in one variant does not hide the others.

    PYTHONPATH=. python scripts/gluon_bwd_smoke.py [--timeout 45] [VARIANT ...]

Per variant: a small case (B=6, N=777, H=2, targets, fused layout; lengths 777, 1, 0, 776, random) and a larger one
(B=24, N=1100, H=4: more items than SMs), rel-norm error of dq/dk/dv against fp64 and against the Triton backward,
and whether two runs are bitwise equal. One line per variant: OK / BAD / TIMEOUT / CRASH.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hstu_inductor.kernels.gluon_backward import BWD_VARIANTS as VARIANTS  # noqa: E402



def child(name):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
    from test_gluon_backward import make_case, rel_err

    from hstu_inductor.kernels.attention import hstu_attention_bwd
    from hstu_inductor.kernels.gluon_backward import gluon_backward
    from hstu_inductor.reference.attention import hstu_mha_backward

    cfg = VARIANTS[name]
    out = {}
    for case, (B, N, H) in (("small", (6, 777, 2)), ("items", (24, 1100, 4))):
        q, k, v, g, off, nt = make_case(B, N, H, 128, torch.bfloat16, 20261122 + N, targets=True)
        got = gluon_backward(g, q, k, v, off, N, 0.1, nt, config=cfg)
        torch.cuda.synchronize()
        again = gluon_backward(g, q, k, v, off, N, 0.1, nt, config=cfg)
        ref = hstu_mha_backward(g.double(), N, 0.1, q.double(), k.double(), v.double(), off, num_targets=nt)[:3]
        tri = hstu_attention_bwd(g, q, k, v, off, N, 0.1, nt, deterministic=True)[:3]
        res = {}
        for gname, x, r, t, a in zip(("dq", "dk", "dv"), got, ref, tri, again):
            try:
                res[gname] = dict(fp64=rel_err(x, r), triton=rel_err(x, t), triton_fp64=rel_err(t, r),
                                  repeat_equal=bool(torch.equal(x, a)))
            except AssertionError as e:
                res[gname] = dict(error=str(e))
        out[case] = res
    print("RESULT " + json.dumps(out))


def main(argv):
    timeout = 45
    if "--timeout" in argv:
        i = argv.index("--timeout")
        timeout = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    names = argv or [n for n, c in VARIANTS.items() if "RUN" not in c]  # both kernels: all grads checked
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in names:
        try:
            r = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True,
                               timeout=timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            print(f"{name:16s} TIMEOUT after {timeout:.0f} s (hang?)", flush=True)
            continue
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            print(f"{name:16s} CRASH rc={r.returncode}\n{(r.stdout + r.stderr)[-3000:]}", flush=True)
            continue
        res = json.loads(line[0][7:])
        ok = all("error" not in g and g["fp64"] < 2.4e-3 and g["triton"] < 2.4e-3 and g["repeat_equal"]
                 for c in res.values() for g in c.values())
        detail = "; ".join(f"{c}/{gn}: " + (g["error"] if "error" in g else
                                           f"fp64 {g['fp64']:.1e} tri {g['triton']:.1e} (tri-fp64 "
                                           f"{g['triton_fp64']:.1e}){'' if g['repeat_equal'] else ' NOT-REPEATABLE'}")
                           for c, cr in res.items() for gn, g in cr.items())
        print(f"{name:16s} {'OK ' if ok else 'BAD'} {detail}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main(sys.argv[1:])
