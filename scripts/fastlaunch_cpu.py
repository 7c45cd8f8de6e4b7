"""Host time of the Gluon forward / backward host functions with and without the cached launch path
(kernels/fastlaunch.py), on a GPU-less machine: Triton's real ``JITFunction.run`` on the fake sm90 device of
tests/kernels/test_fastlaunch.py, the C launcher replaced by a no-op and outputs preallocated (the same work on
both paths).

    PYTHONPATH=. .venv/bin/python scripts/fastlaunch_cpu.py [--batch 8] [--n 1024]

Prints the median and minimum microseconds per call of each path (7 timings of 3000 calls).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))

import pytest  # noqa: E402
import torch  # noqa: E402

import test_fastlaunch as T  # noqa: E402
from hstu_inductor import config  # noqa: E402
from hstu_inductor.kernels import gluon_attention as ga  # noqa: E402
from hstu_inductor.kernels import gluon_backward as gb  # noqa: E402


class _NoRecord(list):
    def append(self, x):  # the fake launcher records nothing
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n", type=int, default=1024)
    args = ap.parse_args()
    mp = pytest.MonkeyPatch()
    fake = T.FakeGPU()
    fake.launches = _NoRecord()
    mp.setattr(T.DRIVER, "_active", T._Driver())
    for kern in T.KERNELS:
        mp.setattr(kern, "device_caches", defaultdict(kern.create_binder))
        mp.setattr(kern, "_do_compile", fake.do_compile(kern))
    mp.setattr(ga, "_num_sms", lambda device: 132)
    # outputs preallocated: CPU malloc of MBs moves by 20 us with the heap's history (the GPU's caching allocator
    # does not), the same on both paths
    outs = {}
    alloc = lambda shape, dtype, device: outs.setdefault((shape, dtype), torch.empty(shape, dtype=dtype))  # noqa
    mp.setattr(ga, "new_tensor", alloc)
    mp.setattr(gb, "new_tensor", alloc)
    q, k, v, off, N, nt = T._case(B=args.batch, N=args.n, H=4, fused=True)
    g = q.clone()
    calls = {"forward": lambda: ga.gluon_forward(q, k, v, off, N, 0.1, nt, checked=True),
             "backward": lambda: gb.gluon_backward(g, q, k, v, off, N, 0.1, nt, checked=True)}
    for mode in ("off", "on", "off", "on"):
        mp.setattr(config, "fastlaunch", mode)
        row = []
        for name, fn in calls.items():
            fn(), fn()
            ts = [timeit.timeit(fn, number=3000) / 3000 * 1e6 for _ in range(7)]
            row.append(f"{name} {statistics.median(ts):6.2f} (min {min(ts):6.2f}) us")
        print(f"{'cached' if mode == 'on' else 'uncached':8s}  " + "   ".join(row))
    mp.undo()


if __name__ == "__main__":
    main()
